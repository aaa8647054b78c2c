// The Registry (registry.h). Creating and destroying contexts is collective:
// every member of a group must be in the call at the same time, and a member
// whose peer never comes blocks for good. So each context gets a thread of its
// own, and the caller waits up to a deadline, then leaves the stragglers
// behind, safely.
#include "registry.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace jax_comm_gemm {
namespace {

// How often the watchdog looks at every context: an NCCL error query and a
// few event queries each, cheap next to the timeouts it enforces.
constexpr auto kWatchInterval = std::chrono::milliseconds(100);

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

struct ContextRequest {
  ContextOptions options;
  ncclUniqueId id;
};

// Creates the requested contexts concurrently. On success `made` holds them,
// in request order. On failure (a member failed, or the set-up outlasted
// `timeout_s`) it aborts whatever was made, and a context that a straggling
// thread finishes later is aborted by that thread: none is ever left to a
// collective destruction that its peers would not join.
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

// Drops `contexts` concurrently (the last reference of each, if it is the
// last: a healthy context's destruction is collective). Returns false if that
// outlasted `deadline`; the rest is then left to its threads.
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

}  // namespace

Registry& Registry::Instance() {
  static Registry* registry = new Registry();  // intentionally leaked, see header
  return *registry;
}

Status Registry::Connect(const std::vector<GroupSpec>& groups, double timeout_s,
                         double call_timeout_s, bool time_gemms) {
  std::vector<ContextRequest> requests;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_) return Status::FailedPrecondition("jax_comm_gemm was shut down");
    for (const GroupSpec& g : groups) {
      for (auto [device, rank] : g.local_members) {
        if (contexts_.count({g.key, device})) continue;
        ContextOptions o;
        o.group = g.key, o.device = device, o.nranks = g.nranks, o.rank = rank;
        o.call_timeout_s = call_timeout_s, o.time_gemms = time_gemms;
        requests.push_back({o, g.id});
      }
    }
  }
  std::vector<std::shared_ptr<Context>> made;
  JCG_RETURN_IF_ERROR(CreateContexts(requests, timeout_s, &made));
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& ctx : made) {
    // Python connects from one thread; should two connects race, keep the first.
    auto [it, inserted] = contexts_.emplace(std::make_pair(ctx->group(), ctx->device()), ctx);
    if (!inserted) ctx->Abort("a duplicate of an existing context");
  }
  if (!watchdog_ && !contexts_.empty()) {
    watchdog_ = std::make_unique<Watchdog>([this] { WatchAll(); }, kWatchInterval);
  }
  return Status();
}

Status Registry::Bind(int64_t comm_id, const std::vector<std::pair<int, int64_t>>& device_groups) {
  std::lock_guard<std::mutex> lock(mu_);
  if (shut_down_) return Status::FailedPrecondition("jax_comm_gemm was shut down");
  for (auto [device, group] : device_groups) {
    auto it = contexts_.find({group, device});
    if (it == contexts_.end()) {
      return Status::FailedPrecondition("no context for group " + std::to_string(group) +
                                        " on device " + std::to_string(device) +
                                        "; connect() it first");
    }
    bindings_[{comm_id, device}] = it->second;
  }
  return Status();
}

std::shared_ptr<Context> Registry::Find(int64_t comm_id, int device, Status* error) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = bindings_.find({comm_id, device});
  if (it != bindings_.end()) return it->second;
  *error = Status::FailedPrecondition(
      shut_down_ ? std::string("jax_comm_gemm was shut down")
                 : "no communicator is set up for comm_id " + std::to_string(comm_id) +
                       " on device " + std::to_string(device) +
                       ": call jax_comm_gemm.connect(mesh, axis_name) in every process "
                       "before running a program that uses the cuBLASMp backend on that "
                       "mesh axis");
  return nullptr;
}

std::vector<std::shared_ptr<Context>> Registry::Snapshot() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<Context>> out;
  for (const auto& [key, ctx] : contexts_) out.push_back(ctx);
  return out;
}

void Registry::WatchAll() noexcept {
  try {
    const Clock::time_point now = Clock::now();
    for (const auto& ctx : Snapshot()) ctx->Watch(now);
  } catch (...) {
    // Out of memory for the snapshot: the next poll tries again.
  }
}

bool Registry::Shutdown(double timeout_s) {
  const Clock::time_point deadline = Clock::now() + SecondsToDuration(timeout_s);
  std::vector<std::shared_ptr<Context>> contexts;
  std::unique_ptr<Watchdog> watchdog;
  {
    std::lock_guard<std::mutex> lock(mu_);
    shut_down_ = true;
    bindings_.clear();
    for (auto& [key, ctx] : contexts_) contexts.push_back(std::move(ctx));
    contexts_.clear();
    watchdog = std::move(watchdog_);
  }
  watchdog.reset();  // joins its thread, which drops its references
  for (auto& ctx : contexts) ctx->Close();
  // Calls in flight hold references of their own; closed, the contexts turn new
  // calls away, so once a count reaches 1 it stays there.
  auto idle = [&] {
    return std::all_of(contexts.begin(), contexts.end(),
                       [](const auto& c) { return c.use_count() == 1; });
  };
  while (!idle() && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  bool in_time = true;
  for (auto& ctx : contexts) {
    if (ctx.use_count() == 1) continue;
    // Destroyed when its call lets go, then without collective frees.
    ctx->Abort("jax_comm_gemm was shut down while a call on this context was still running");
    in_time = false;
  }
  return DestroyContexts(std::move(contexts), deadline) && in_time;
}

std::vector<ContextInfo> Registry::Describe() {
  std::vector<ContextInfo> out;
  for (const auto& ctx : Snapshot()) {
    out.push_back({ctx->group(), ctx->device(), ctx->rank(), ctx->nranks(),
                   ctx->workspace_bytes(), ctx->own_buffer_bytes(), ctx->plan_count(),
                   ctx->calls(), ctx->host_seconds(), ctx->error(),
                   ctx->workspace_error(), ctx->workspace_mode()});
  }
  return out;
}

bool Registry::Abort(int64_t group, int device, const std::string& reason) {
  std::shared_ptr<Context> ctx;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = contexts_.find({group, device});
    if (it == contexts_.end()) return false;
    ctx = it->second;
  }
  ctx->Abort(reason);  // outside mu_ (the lock order in context.h)
  return true;
}

}  // namespace jax_comm_gemm
