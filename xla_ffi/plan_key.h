// PlanKey: everything that fixes a comm-GEMM call's descriptors and workspace
// size, its fixed-size wire form, and the check that every rank of a group made
// the same plan. Pure (no CUDA calls), so it is unit-tested on the CPU; Context
// all-gathers the wire form when it first makes a plan (context.cc).
#ifndef JAX_COMM_GEMM_PLAN_KEY_H_
#define JAX_COMM_GEMM_PLAN_KEY_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <tuple>
#include <vector>

#include "library.h"

namespace jax_comm_gemm {

enum class CommOp : int64_t { kAllGather = 0, kReduceScatter = 1 };

struct PlanKey {
  CommOp op = CommOp::kAllGather;
  // cudaDataType_t of x, w and y: all one for bf16/f16/f32; FP8 x and w, a
  // wider y (MatmulCall).
  int64_t x_type = 0, w_type = 0, y_type = 0;
  bool transpose_w = false;
  int64_t algorithm = 0;  // constants.h: cuBLASMp's enum value, or the own one's
  int64_t x_rows = 0, x_cols = 0, w_rows = 0, w_cols = 0;
  bool fast_accum = false;  // FP8 only: Hopper's fast accumulation

  auto tie() const {
    return std::tie(op, x_type, w_type, y_type, transpose_w, algorithm, x_rows, x_cols, w_rows,
                    w_cols, fast_accum);
  }
  bool operator==(const PlanKey& o) const { return tie() == o.tie(); }
  bool operator!=(const PlanKey& o) const { return tie() != o.tie(); }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
};

// The wire form: a format word, then the 11 fields, each as 8 little-endian
// bytes. Fixed size, so one ncclAllGather of kPlanKeyBytes per rank carries it.
inline constexpr size_t kPlanKeyFields = 11;
inline constexpr size_t kPlanKeyBytes = 8 * (1 + kPlanKeyFields);
using PlanKeyBytes = std::array<unsigned char, kPlanKeyBytes>;

PlanKeyBytes SerializePlanKey(const PlanKey& key);

// Reads rank `rank`'s wire form; FailedPrecondition if it is not one.
Status ParsePlanKey(const unsigned char* bytes, int rank, PlanKey* out);

// keys[r] is rank r's plan. OK when all are equal; otherwise FailedPrecondition
// naming each field that differs and which ranks have which value.
Status CheckPlanAgreement(const std::vector<PlanKey>& keys);

// Parses `nranks` wire forms laid out one after the other (what ncclAllGather
// leaves), then checks them as above.
Status CheckGatheredPlanKeys(const unsigned char* gathered, int nranks);

// Whether `op` runs algorithm `algorithm` (constants.h): InvalidArgument,
// naming the number and the algorithms `op` takes, for a number that is no
// algorithm of the project's.
Status CheckAlgorithm(CommOp op, int64_t algorithm);

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_PLAN_KEY_H_
