// The Python module `jax_comm_gemm._constants`: the names and numbers Python
// must agree on with the handlers, from the very definitions they use. It
// links no CUDA, NCCL or cuBLASMp library (header constants only), so it loads
// on a CPU-only machine, where a test compares it with Python's own table.
#include "nanobind/nanobind.h"

#include "algorithms.h"
#include "constants.h"

namespace nb = nanobind;

NB_MODULE(_constants, m) {
  namespace jcg = jax_comm_gemm;

  m.def("constants", [] {
    nb::dict targets;
    targets["all_gather_matmul"] = jcg::kAllGatherMatmulTarget;
    targets["matmul_reduce_scatter"] = jcg::kMatmulReduceScatterTarget;
    targets["all_gather_matmul_weight_gradient"] = jcg::kAllGatherMatmulWeightGradientTarget;
    nb::dict algorithms;
    for (const jcg::AlgorithmName& a : jcg::kAlgorithms) {
      algorithms[a.name] = static_cast<int>(a.algorithm);
    }
    nb::dict layouts;
    for (const jcg::LayoutName& l : jcg::kLayouts) layouts[l.name] = static_cast<int>(l.layout);
    nb::list fences;
    for (const jcg::FenceName& f : jcg::kFences) fences.append(f.name);
    nb::dict out;
    out["targets"] = targets;
    out["algorithms"] = algorithms;
    out["layouts"] = layouts;
    out["fences"] = fences;
    return out;
  }, "{'targets': {...}, 'algorithms': {...}, 'layouts': {...}, 'fences': [default, ...]}");
}
