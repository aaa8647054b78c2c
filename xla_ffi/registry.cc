#include "registry.h"

#include <chrono>
#include <condition_variable>
#include <future>
#include <string>
#include <thread>

namespace jax_comm_gemm {
namespace {

struct Created {
  Status status;
  Context* context = nullptr;  // owned by whoever collects it in time
};

std::string Where(int64_t group, int device, int rank) {
  return "group " + std::to_string(group) + ", device " + std::to_string(device) + ", rank " +
         std::to_string(rank);
}

}  // namespace

Registry& Registry::Instance() {
  static Registry* registry = new Registry();  // intentionally leaked, see header
  return *registry;
}

Status Registry::Connect(const std::vector<GroupSpec>& groups, Fence fence, double timeout_s) {
  struct Pending {
    int64_t group;
    int device, rank;
    std::future<Created> result;
  };
  std::vector<Pending> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_) return Status::FailedPrecondition("jax_comm_gemm was shut down");
    for (const GroupSpec& g : groups) {
      for (auto [device, rank] : g.local_members) {
        if (contexts_.count({g.key, device})) continue;
        // A detached thread per member: a member that never returns (a peer
        // that never joined) must not block the caller past the deadline.
        auto task = std::make_shared<std::packaged_task<Created()>>(
            [device = device, rank = rank, id = g.id, nranks = g.nranks, fence] {
              Created out;
              std::unique_ptr<Context> ctx;
              out.status = Context::Create(device, id, nranks, rank, fence, &ctx);
              out.context = ctx.release();
              return out;
            });
        pending.push_back({g.key, device, rank, task->get_future()});
        std::thread([task] { (*task)(); }).detach();
      }
    }
  }
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_s));
  Status first_error;
  std::vector<std::pair<const Pending*, Context*>> made;
  for (Pending& p : pending) {
    if (p.result.wait_until(deadline) != std::future_status::ready) {
      if (first_error.ok()) {
        first_error = Status::FailedPrecondition(
            "NCCL/cuBLASMp set-up of " + Where(p.group, p.device, p.rank) +
            " did not finish within " + std::to_string(timeout_s) +
            " s: a member of the tensor-parallel group did not join (every process must run "
            "the same jitted program; raise JAX_COMM_GEMM_CONNECT_TIMEOUT for slow starts)");
      }
      continue;  // abandoned: its thread may still be blocked in NCCL
    }
    Created c = p.result.get();
    if (!c.status.ok() && first_error.ok()) {
      first_error = Status(c.status.code() == Status::Code::kInternal
                               ? Status::Internal(Where(p.group, p.device, p.rank) + ": " +
                                                  c.status.message())
                               : c.status);
    }
    if (c.context != nullptr) made.emplace_back(&p, c.context);
  }
  if (!first_error.ok()) {
    // Peers of a failed member cannot complete collectives: abort, then leak.
    for (auto& [p, ctx] : made) ctx->Abort();
    return first_error;
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [p, ctx] : made) contexts_[{p->group, p->device}].reset(ctx);
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
    bindings_[{comm_id, device}] = it->second.get();
  }
  return Status();
}

Context* Registry::Find(int64_t comm_id, int device, Status* error) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = bindings_.find({comm_id, device});
  if (it != bindings_.end()) return it->second;
  *error = Status::FailedPrecondition(
      shut_down_ ? std::string("jax_comm_gemm was shut down")
                 : "no communicator is set up for comm_id " + std::to_string(comm_id) +
                       " on device " + std::to_string(device) +
                       ": jax_comm_gemm sets them up while lowering its ops inside "
                       "jax.shard_map over a concrete Mesh, in every process");
  return nullptr;
}

bool Registry::Shutdown(double timeout_s) {
  std::map<std::pair<int64_t, int>, std::unique_ptr<Context>> contexts;
  {
    std::lock_guard<std::mutex> lock(mu_);
    shut_down_ = true;
    bindings_.clear();
    contexts.swap(contexts_);
  }
  if (contexts.empty()) return true;
  auto state = std::make_shared<std::pair<std::mutex, std::condition_variable>>();
  auto remaining = std::make_shared<size_t>(contexts.size());
  for (auto& [key, ctx] : contexts) {
    std::thread([ctx = ctx.release(), state, remaining] {
      delete ctx;
      std::lock_guard<std::mutex> lock(state->first);
      if (--*remaining == 0) state->second.notify_all();
    }).detach();
  }
  std::unique_lock<std::mutex> lock(state->first);
  return state->second.wait_for(lock, std::chrono::duration<double>(timeout_s),
                                [&] { return *remaining == 0; });
}

std::vector<ContextInfo> Registry::Describe() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<ContextInfo> out;
  for (auto& [key, ctx] : contexts_) {
    out.push_back({key.first, ctx->device(), ctx->rank(), ctx->nranks(), ctx->workspace_bytes(),
                   ctx->plan_count()});
  }
  return out;
}

}  // namespace jax_comm_gemm
