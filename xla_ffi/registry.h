// Registry: the project's one piece of global state. It owns every Context,
// keyed by (tensor-parallel group, device), and maps the `comm_id` attribute of
// a custom call plus the executing device to the context to run on.
//
// Python fills it while lowering (registry.py): connect() creates the contexts
// of the groups this process takes part in, bind() names the set of groups that
// one mesh axis forms. The FFI handlers only look contexts up.
#ifndef JAX_COMM_GEMM_REGISTRY_H_
#define JAX_COMM_GEMM_REGISTRY_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include <nccl.h>

#include "context.h"
#include "status.h"

namespace jax_comm_gemm {

struct GroupSpec {
  int64_t key;                                  // identifies the group's devices
  ncclUniqueId id;                              // shared by all members
  int nranks;
  std::vector<std::pair<int, int>> local_members;  // (device ordinal, rank) on this process
};

struct ContextInfo {
  int64_t group;
  int device, rank, nranks;
  size_t workspace_bytes, plans;
};

class Registry {
 public:
  // Never destroyed by static destructors (CUDA may be gone by then):
  // Python calls Shutdown() at exit.
  static Registry& Instance();

  // Creates the contexts of `groups` that do not exist yet, one thread per
  // local member so that the collective set-up of all members overlaps; each
  // orders its calls by `fence`. Fails, aborting what it made, if any member
  // fails or the set-up outlasts `timeout_s`.
  Status Connect(const std::vector<GroupSpec>& groups, Fence fence, double timeout_s);

  // `comm_id` on `device` runs on the context of group `group`.
  Status Bind(int64_t comm_id, const std::vector<std::pair<int, int64_t>>& device_groups);

  // The context for a custom call, or null with `error` set.
  Context* Find(int64_t comm_id, int device, Status* error);

  // Destroys every context, concurrently (their destruction is collective).
  // Returns false if that outlasted `timeout_s`; the rest is then left to
  // process exit.
  bool Shutdown(double timeout_s);

  std::vector<ContextInfo> Describe();

 private:
  Registry() = default;

  std::mutex mu_;
  bool shut_down_ = false;
  std::map<std::pair<int64_t, int>, std::unique_ptr<Context>> contexts_;  // (group, device)
  std::map<std::pair<int64_t, int>, Context*> bindings_;                  // (comm_id, device)
};

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_REGISTRY_H_
