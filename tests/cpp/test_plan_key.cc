// PlanKey: equality and order (it keys the plan cache), and its wire form.
#include <cstdint>
#include <limits>
#include <map>

#include "check.h"
#include "plan_key.h"

using jax_comm_gemm::CommOp;
using jax_comm_gemm::kPlanKeyBytes;
using jax_comm_gemm::ParsePlanKey;
using jax_comm_gemm::PlanKey;
using jax_comm_gemm::PlanKeyBytes;
using jax_comm_gemm::SerializePlanKey;
using jax_comm_gemm::Status;

namespace {

PlanKey Sample() {
  PlanKey k;
  k.op = CommOp::kAllGather;
  k.x_type = k.w_type = k.y_type = 14;  // CUDA_R_16BF
  k.transpose_w = false;
  k.algorithm = 1;
  k.x_rows = 512, k.x_cols = 1024, k.w_rows = 1024, k.w_cols = 2048;
  return k;
}

// Each way of changing one field of Sample().
std::vector<PlanKey> OneFieldChanged() {
  std::vector<PlanKey> out(11, Sample());
  out[0].op = CommOp::kReduceScatter;
  out[1].x_type = 28;  // CUDA_R_8F_E4M3
  out[2].w_type = 29;  // CUDA_R_8F_E5M2
  out[3].y_type = 0;
  out[4].transpose_w = true;
  out[5].algorithm = 5;
  out[6].x_rows = 256;
  out[7].x_cols = 1023;
  out[8].w_rows = 1;
  out[9].w_cols = 4096;
  out[10].fast_accum = true;
  return out;
}

PlanKey RoundTrip(const PlanKey& k) {
  const PlanKeyBytes bytes = SerializePlanKey(k);
  PlanKey out;
  const Status s = ParsePlanKey(bytes.data(), 0, &out);
  CHECK(s.ok());
  return out;
}

}  // namespace

TEST(EqualKeysCompareEqual) {
  CHECK(Sample() == Sample());
  CHECK(!(Sample() != Sample()));
  CHECK(!(Sample() < Sample()));
}

TEST(EveryFieldTakesPart) {
  for (const PlanKey& other : OneFieldChanged()) {
    CHECK(other != Sample());
    CHECK((other < Sample()) != (Sample() < other));  // a strict order, for std::map
  }
}

TEST(KeysPlanCacheApart) {
  std::map<PlanKey, int> cache;
  cache[Sample()] = 1;
  for (const PlanKey& other : OneFieldChanged()) cache[other] = 2;
  CHECK_EQ(cache.size(), size_t{12});
  CHECK_EQ(cache[Sample()], 1);
}

TEST(RoundTripKeepsEveryField) {
  CHECK(RoundTrip(Sample()) == Sample());
  for (const PlanKey& k : OneFieldChanged()) CHECK(RoundTrip(k) == k);
}

TEST(RoundTripKeepsExtremeValues) {
  PlanKey k = Sample();
  k.x_rows = std::numeric_limits<int64_t>::max();
  k.x_cols = std::numeric_limits<int64_t>::min();
  k.w_rows = -1;
  k.w_cols = 0;
  CHECK(RoundTrip(k) == k);
}

TEST(WireFormIsFixedSizeLittleEndian) {
  CHECK_EQ(kPlanKeyBytes, size_t{96});
  PlanKey k = Sample();
  k.x_rows = 0x0102;
  const PlanKeyBytes bytes = SerializePlanKey(k);
  // Fields follow the format word in order: op, the three dtypes, transpose_w,
  // algorithm, x_rows.
  CHECK_EQ(int(bytes[8 * 7]), 0x02);
  CHECK_EQ(int(bytes[8 * 7 + 1]), 0x01);
  CHECK_EQ(int(bytes[8 * 7 + 2]), 0);
}

TEST(ParseRejectsWhatIsNotAKey) {
  PlanKey out;
  PlanKeyBytes zeros{};
  Status s = ParsePlanKey(zeros.data(), 3, &out);
  CHECK(s.code() == Status::Code::kFailedPrecondition);
  CHECK_CONTAINS(s.message(), "rank 3 sent something that is not a jax_comm_gemm plan key");

  PlanKeyBytes bad_op = SerializePlanKey(Sample());
  bad_op[8] = 7;  // op
  CHECK(!ParsePlanKey(bad_op.data(), 0, &out).ok());

  PlanKeyBytes bad_flag = SerializePlanKey(Sample());
  bad_flag[8 * 5] = 2;  // transpose_w
  CHECK(!ParsePlanKey(bad_flag.data(), 0, &out).ok());

  PlanKeyBytes bad_fast_accum = SerializePlanKey(Sample());
  bad_fast_accum[8 * 11] = 2;  // fast_accum
  CHECK(!ParsePlanKey(bad_fast_accum.data(), 0, &out).ok());
}
