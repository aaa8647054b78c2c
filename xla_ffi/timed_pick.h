// Which of cuBLASLt's candidate algorithms a timed pick takes, from the times
// its trial measured (cublaslt.cc runs the trial). Pure, unit-tested on the
// CPU (tests/cpp/test_timed_pick.cc).
#ifndef JAX_COMM_GEMM_TIMED_PICK_H_
#define JAX_COMM_GEMM_TIMED_PICK_H_

#include <vector>

namespace jax_comm_gemm {

// A timed pick runs cuBLASLt's first kTimedCandidates heuristic candidates in
// kTimedRounds rounds (alternating in order; the median counts), each sample
// a batch of about kTimedSampleSeconds of work, and leaves the first only for
// one faster by more than kTimedMargin: cuBLASLt's first choice is often not
// the fastest of its candidates for the block GEMMs
// (docs/design.md#the-projects-own-algorithms, benchmarks/gemm_probe.py).
inline constexpr int kTimedCandidates = 8;
inline constexpr int kTimedRounds = 5;
inline constexpr double kTimedSampleSeconds = 2e-3;
inline constexpr float kTimedMargin = 0.01f;

// The candidate with the smallest median of its `samples` (one list per
// candidate, in cuBLASLt's order; an empty list: it did not run), the first
// candidate's median counted kTimedMargin lower; -1 if none ran.
int FastestByMedian(const std::vector<std::vector<float>>& samples);

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_TIMED_PICK_H_
