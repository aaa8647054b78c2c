#include "registry.h"

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>

#include "collective_setup.h"

namespace jax_comm_gemm {
namespace {

// How often the watchdog looks at every context: an NCCL error query and a
// few event queries each, cheap next to the timeouts it enforces.
constexpr auto kWatchInterval = std::chrono::milliseconds(100);

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
                   ctx->workspace_error()});
  }
  return out;
}

}  // namespace jax_comm_gemm
