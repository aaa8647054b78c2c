// Creating and destroying contexts is collective: every member of a group must
// be in the call at the same time, and a member whose peer never comes blocks
// for good. So each context gets a thread of its own, and the caller waits up
// to a deadline, then leaves the stragglers behind, safely.
#ifndef JAX_COMM_GEMM_COLLECTIVE_SETUP_H_
#define JAX_COMM_GEMM_COLLECTIVE_SETUP_H_

#include <memory>
#include <vector>

#include <nccl.h>

#include "context.h"
#include "cuda_wait.h"
#include "status.h"

namespace jax_comm_gemm {

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
                      std::vector<std::shared_ptr<Context>>* made);

// Drops `contexts` concurrently (the last reference of each, if it is the
// last: a healthy context's destruction is collective). Returns false if that
// outlasted `deadline`; the rest is then left to its threads.
bool DestroyContexts(std::vector<std::shared_ptr<Context>> contexts, Clock::time_point deadline);

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_COLLECTIVE_SETUP_H_
