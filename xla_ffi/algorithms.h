// The AllGather+GEMM / GEMM+ReduceScatter algorithms the project offers, by
// the names Python uses: two of cuBLASMp's, with their numbers taken straight
// from cublasmp.h's enum, and the project's own (pipelined.h), numbered clear
// of that enum. Header constants only: including it links nothing, so
// _constants can export it.
// cuBLASMp's others (split_multicast, atomic_p2p, atomic_multicast,
// no_overlap) are not offered: nothing selects them and no user gains by
// choosing them (docs/design.md#options-removed-and-why). FUSED is
// GEMM+AllReduce only.
#ifndef JAX_COMM_GEMM_ALGORITHMS_H_
#define JAX_COMM_GEMM_ALGORITHMS_H_

#include <cstdint>

#include <cublasmp.h>

namespace jax_comm_gemm {

struct AlgorithmName {
  const char* name;
  int64_t algorithm;
};

// The project's own (pipelined.h): a cuBLASLt GEMM per block of rows beside
// NCCL transfers on its copy engines (both ops: an AllGather or AlltoAll on a
// symmetric window of a zero-CTA communicator). Numbered clear of cuBLASMp's
// enum.
inline constexpr int64_t kPipelinedCeAlgorithm = 101;

inline constexpr AlgorithmName kAlgorithms[] = {
    {"default", CUBLASMP_MATMUL_ALGO_TYPE_DEFAULT},
    {"split_p2p", CUBLASMP_MATMUL_ALGO_TYPE_SPLIT_P2P},
    {"pipelined_ce", kPipelinedCeAlgorithm},
};

// The name of algorithm `number`, or null if the project does not offer it.
inline const char* AlgorithmNameOf(int64_t number) {
  for (const AlgorithmName& a : kAlgorithms) {
    if (a.algorithm == number) return a.name;
  }
  return nullptr;
}

// Whether algorithm `number` is the project's own rather than cuBLASMp's.
inline bool IsPipelined(int64_t number) { return number == kPipelinedCeAlgorithm; }

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_ALGORITHMS_H_
