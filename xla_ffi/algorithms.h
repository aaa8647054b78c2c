// The cuBLASMp matmul algorithms the project offers, by the names Python uses,
// with their numbers taken straight from cublasmp.h's enum. Header constants
// only: including it links nothing, so _constants can export it.
// CUBLASMP_MATMUL_ALGO_TYPE_FUSED (GEMM+AllReduce only) is left out on purpose.
#ifndef JAX_COMM_GEMM_ALGORITHMS_H_
#define JAX_COMM_GEMM_ALGORITHMS_H_

#include <cstdint>

#include <cublasmp.h>

namespace jax_comm_gemm {

struct AlgorithmName {
  const char* name;
  cublasMpMatmulAlgoType_t algorithm;
};

inline constexpr AlgorithmName kAlgorithms[] = {
    {"default", CUBLASMP_MATMUL_ALGO_TYPE_DEFAULT},
    {"split_p2p", CUBLASMP_MATMUL_ALGO_TYPE_SPLIT_P2P},
    {"split_multicast", CUBLASMP_MATMUL_ALGO_TYPE_SPLIT_MULTICAST},
    {"atomic_p2p", CUBLASMP_MATMUL_ALGO_TYPE_ATOMIC_P2P},
    {"atomic_multicast", CUBLASMP_MATMUL_ALGO_TYPE_ATOMIC_MULTICAST},
    {"no_overlap", CUBLASMP_MATMUL_ALGO_TYPE_NO_OVERLAP},
};

// The name of algorithm `number`, or null if the project does not offer it.
inline const char* AlgorithmNameOf(int64_t number) {
  for (const AlgorithmName& a : kAlgorithms) {
    if (static_cast<int64_t>(a.algorithm) == number) return a.name;
  }
  return nullptr;
}

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_ALGORITHMS_H_
