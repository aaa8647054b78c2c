// Registry: the project's one piece of global state. It owns every Context,
// keyed by (tensor-parallel group, device), creates and destroys them (both
// collective, on threads of their own), maps the `comm_id` attribute of a
// custom call plus the executing device to the context to run on, and owns the
// watchdog that polls the contexts.
//
// Python fills it in jax_comm_gemm.connect() (runtime/communicators.py):
// connect() creates the contexts of the groups this process takes part in,
// bind() names the set of groups that one mesh axis forms. The FFI handlers only
// look contexts up.
#ifndef JAX_COMM_GEMM_REGISTRY_H_
#define JAX_COMM_GEMM_REGISTRY_H_

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <nccl.h>

#include "context.h"
#include "library.h"

namespace jax_comm_gemm {

// One thread that calls `poll` every `interval` until the object is destroyed
// (the Registry's: started at the first connect, stopped at shutdown). Plain
// C++, inline: tests/cpp/test_watchdog.cc checks it on the CPU.
class Watchdog {
 public:
  // `poll` must not throw; an exception from it is dropped, not propagated.
  Watchdog(std::function<void()> poll, std::chrono::milliseconds interval)
      : poll_(std::move(poll)), interval_(interval), thread_([this] { Loop(); }) {}
  // Stops and joins the thread: never destroy it while holding a lock that
  // `poll` takes.
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  void Loop() noexcept {
    std::unique_lock<std::mutex> lock(mu_);
    while (!wake_.wait_for(lock, interval_, [this] { return stop_; })) {
      lock.unlock();  // a poll may take long (an abort waits for a library call)
      try {
        poll_();
      } catch (...) {
        // Nothing to report to here; the next poll tries again.
      }
      lock.lock();
    }
  }

  const std::function<void()> poll_;
  const std::chrono::milliseconds interval_;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;   // guarded by mu_
  std::thread thread_;  // last: starts once the members above exist
};

struct GroupSpec {
  int64_t key;                                     // identifies the group's devices
  ncclUniqueId id;                                 // shared by all members
  int nranks;
  std::vector<std::pair<int, int>> local_members;  // (device ordinal, rank) on this process
};

struct ContextInfo {
  int64_t group;
  int device, rank, nranks;
  size_t workspace_bytes, own_buffer_bytes, plans;
  uint64_t calls;
  double host_seconds;
  std::string error;            // "" while healthy
  std::string workspace_error;  // "" where cuBLASMp got its workspace at set-up
  std::string workspace_mode;   // "symmetric", or "plain" where it was refused
};

class Registry {
 public:
  // Never destroyed by static destructors (CUDA may be gone by then):
  // Python calls Shutdown() at exit.
  static Registry& Instance();

  // Creates the contexts of `groups` that do not exist yet, concurrently (their
  // set-up is collective); each aborts a call that outlives `call_timeout_s`,
  // and times its block GEMMs' candidates if `time_gemms` (ContextOptions).
  // Fails, aborting what it made, if any member fails or the set-up outlasts
  // `timeout_s`. Starts the watchdog.
  Status Connect(const std::vector<GroupSpec>& groups, double timeout_s, double call_timeout_s,
                 bool time_gemms);

  // `comm_id` on `device` runs on the context of group `group`.
  Status Bind(int64_t comm_id, const std::vector<std::pair<int, int64_t>>& device_groups);

  // The context for a custom call, or null with `error` set. The caller's
  // reference keeps the context alive through the call.
  std::shared_ptr<Context> Find(int64_t comm_id, int device, Status* error);

  // Stops the watchdog, lets calls in flight finish (aborting the contexts of
  // those still running at the deadline), then destroys every context,
  // concurrently. Returns false if that did not all finish within `timeout_s`.
  bool Shutdown(double timeout_s);

  // Never waits for a call in flight.
  std::vector<ContextInfo> Describe();

  // Aborts the context of `group` on `device` for `reason` (a peer's failure,
  // told through the key-value store): its waiting calls end with the reason.
  // False where there is no such context. Never waits for a call in flight
  // beyond Context::Abort's grace.
  bool Abort(int64_t group, int device, const std::string& reason);

 private:
  Registry() = default;
  std::vector<std::shared_ptr<Context>> Snapshot();
  void WatchAll() noexcept;

  // mu_ guards the members below and nothing else: it is never held while
  // calling into a Context (so never while taking a context's locks), nor
  // while stopping the watchdog, whose poll takes it. context.h gives the
  // order of the contexts' own locks.
  std::mutex mu_;
  bool shut_down_ = false;
  std::map<std::pair<int64_t, int>, std::shared_ptr<Context>> contexts_;  // (group, device)
  std::map<std::pair<int64_t, int>, std::shared_ptr<Context>> bindings_;  // (comm_id, device)
  std::unique_ptr<Watchdog> watchdog_;
};

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_REGISTRY_H_
