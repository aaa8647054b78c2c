// The Python module `jax_comm_gemm._constants`: the names and numbers Python
// must agree on with the handlers, from the very definitions they use. It
// links no CUDA, NCCL or cuBLASMp library (header constants only), so it loads
// on a CPU-only machine, where a test compares it with Python's own table.
#include "nanobind/nanobind.h"

#include "constants.h"

namespace nb = nanobind;

NB_MODULE(_constants, m) {
  namespace jcg = jax_comm_gemm;

  m.def("constants", [] {
    nb::dict targets;
    targets["all_gather_matmul"] = jcg::kAllGatherMatmulTarget;
    targets["matmul_reduce_scatter"] = jcg::kMatmulReduceScatterTarget;
    targets["fp8_all_gather_matmul"] = jcg::kFp8AllGatherMatmulTarget;
    targets["fp8_matmul_reduce_scatter"] = jcg::kFp8MatmulReduceScatterTarget;
    targets["fp8_gemm"] = jcg::kFp8GemmTarget;
    nb::dict algorithms;
    for (const jcg::AlgorithmName& a : jcg::kAlgorithms) {
      algorithms[a.name] = static_cast<int>(a.algorithm);
    }
    // cublasmp.h's whole enum, as the build saw it: a test checks that each of
    // cuBLASMp's algorithms above has its enum value, and that the project's
    // own numbers are clear of the enum.
    nb::dict cublasmp_enum;
    cublasmp_enum["DEFAULT"] = static_cast<int>(CUBLASMP_MATMUL_ALGO_TYPE_DEFAULT);
    cublasmp_enum["SPLIT_P2P"] = static_cast<int>(CUBLASMP_MATMUL_ALGO_TYPE_SPLIT_P2P);
    cublasmp_enum["SPLIT_MULTICAST"] = static_cast<int>(CUBLASMP_MATMUL_ALGO_TYPE_SPLIT_MULTICAST);
    cublasmp_enum["ATOMIC_P2P"] = static_cast<int>(CUBLASMP_MATMUL_ALGO_TYPE_ATOMIC_P2P);
    cublasmp_enum["ATOMIC_MULTICAST"] =
        static_cast<int>(CUBLASMP_MATMUL_ALGO_TYPE_ATOMIC_MULTICAST);
    cublasmp_enum["NO_OVERLAP"] = static_cast<int>(CUBLASMP_MATMUL_ALGO_TYPE_NO_OVERLAP);
    cublasmp_enum["FUSED"] = static_cast<int>(CUBLASMP_MATMUL_ALGO_TYPE_FUSED);
    nb::dict layouts;
    for (const jcg::LayoutName& l : jcg::kLayouts) layouts[l.name] = static_cast<int>(l.layout);
    nb::dict out;
    out["targets"] = targets;
    out["algorithms"] = algorithms;
    out["cublasmp_algorithm_types"] = cublasmp_enum;
    out["layouts"] = layouts;
    return out;
  }, "{'targets': {...}, 'algorithms': {...},\n"
     " 'cublasmp_algorithm_types': {...} (cublasMpMatmulAlgoType_t without its prefix),\n"
     " 'layouts': {...}}");
}
