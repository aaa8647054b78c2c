#include "collective_setup.h"

#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace jax_comm_gemm {
namespace {

// Where a creation thread hands its context over, unless the caller has given
// up on it: then the thread aborts the context instead.
class Handoff {
 public:
  void Deliver(Status status, std::shared_ptr<Context> context) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!abandoned_) {
        status_ = std::move(status);
        context_ = std::move(context);
        done_ = true;
        ready_.notify_all();
        return;
      }
    }
    if (context) context->Abort("connect() stopped waiting for this context's set-up");
  }

  bool WaitUntil(Clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    return ready_.wait_until(lock, deadline, [this] { return done_; });
  }

  // After WaitUntil returned true.
  Status Take(std::shared_ptr<Context>* context) {
    std::lock_guard<std::mutex> lock(mu_);
    *context = std::move(context_);
    return status_;
  }

  void Abandon() {
    std::shared_ptr<Context> late;
    {
      std::lock_guard<std::mutex> lock(mu_);
      abandoned_ = true;
      late = std::move(context_);
    }
    if (late) late->Abort("connect() stopped waiting for this context's set-up");
  }

 private:
  std::mutex mu_;
  std::condition_variable ready_;
  bool done_ = false, abandoned_ = false;
  Status status_;
  std::shared_ptr<Context> context_;
};

std::string Where(const ContextOptions& o) {
  return "group " + std::to_string(o.group) + ", device " + std::to_string(o.device) +
         ", rank " + std::to_string(o.rank);
}

}  // namespace

Status CreateContexts(const std::vector<ContextRequest>& requests, double timeout_s,
                      std::vector<std::shared_ptr<Context>>* made) {
  const Clock::time_point deadline = Clock::now() + SecondsToDuration(timeout_s);
  std::vector<std::shared_ptr<Handoff>> handoffs;
  // Whatever is not collected below (a deadline, a failure, an exception) is
  // abandoned: its thread aborts what it makes.
  struct AbandonAll {
    std::vector<std::shared_ptr<Handoff>>& handoffs;
    ~AbandonAll() {
      for (auto& h : handoffs) h->Abandon();
    }
  } abandon_all{handoffs};

  for (const ContextRequest& request : requests) {
    auto handoff = std::make_shared<Handoff>();
    handoffs.push_back(handoff);
    // Detached: a member that never returns (a peer that never joined) must
    // not keep the caller past its deadline.
    std::thread([handoff, request] {
      std::shared_ptr<Context> ctx;
      Status s = CatchExceptions("jax_comm_gemm connect", [&] {
        return Context::Create(request.options, request.id, &ctx);
      });
      handoff->Deliver(std::move(s), std::move(ctx));
    }).detach();
  }

  Status first_error;
  std::vector<std::shared_ptr<Context>> out;
  for (size_t i = 0; i < requests.size(); ++i) {
    const ContextOptions& o = requests[i].options;
    if (!handoffs[i]->WaitUntil(deadline)) {
      if (first_error.ok()) {
        first_error = Status::FailedPrecondition(
            "NCCL/cuBLASMp set-up of " + Where(o) + " did not finish within " +
            FormatSeconds(timeout_s) +
            ": a member of the tensor-parallel group did not join "
            "(every process must run the same jitted program; raise "
            "JAX_COMM_GEMM_CONNECT_TIMEOUT for slow starts)");
      }
      continue;
    }
    std::shared_ptr<Context> ctx;
    Status s = handoffs[i]->Take(&ctx);
    if (!s.ok() && first_error.ok()) {
      first_error = s.code() == Status::Code::kInternal
                        ? Status::Internal(Where(o) + ": " + s.message())
                        : s;
    }
    if (ctx) out.push_back(std::move(ctx));
  }
  if (!first_error.ok()) {
    // Peers of a failed member cannot complete collectives: abort, then leak.
    for (auto& ctx : out) ctx->Abort("connect() failed: " + first_error.message());
    return first_error;
  }
  *made = std::move(out);
  return Status();
}

bool DestroyContexts(std::vector<std::shared_ptr<Context>> contexts, Clock::time_point deadline) {
  if (contexts.empty()) return true;
  struct Countdown {
    std::mutex mu;
    std::condition_variable zero;
    size_t remaining;
  };
  auto countdown = std::make_shared<Countdown>();
  countdown->remaining = contexts.size();
  for (auto& ctx : contexts) {
    std::thread([ctx = std::move(ctx), countdown]() mutable {
      ctx.reset();  // the destructor is noexcept
      std::lock_guard<std::mutex> lock(countdown->mu);
      if (--countdown->remaining == 0) countdown->zero.notify_all();
    }).detach();
  }
  std::unique_lock<std::mutex> lock(countdown->mu);
  return countdown->zero.wait_until(lock, deadline, [&] { return countdown->remaining == 0; });
}

}  // namespace jax_comm_gemm
