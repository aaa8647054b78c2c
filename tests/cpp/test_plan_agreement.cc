// CheckPlanAgreement: the message every rank returns when the ranks' plans
// differ names each differing field and which ranks have which value.
#include <string>
#include <vector>

#include <cublasmp.h>
#include <library_types.h>

#include "constants.h"
#include "check.h"
#include "plan_key.h"

using jax_comm_gemm::CheckGatheredPlanKeys;
using jax_comm_gemm::CheckPlanAgreement;
using jax_comm_gemm::CommOp;
using jax_comm_gemm::kPlanKeyBytes;
using jax_comm_gemm::PlanKey;
using jax_comm_gemm::PlanKeyBytes;
using jax_comm_gemm::SerializePlanKey;
using jax_comm_gemm::Status;

namespace {

const std::string kAdvice =
    " \u2014 every rank must make the same comm-GEMM calls with the same shapes";

PlanKey Sample() {
  PlanKey k;
  k.op = CommOp::kAllGather;
  k.x_type = k.w_type = k.y_type = CUDA_R_16BF;
  k.algorithm = CUBLASMP_MATMUL_ALGO_TYPE_SPLIT_P2P;
  k.x_rows = 512, k.x_cols = 1024, k.w_rows = 1024, k.w_cols = 2048;
  return k;
}

std::vector<unsigned char> Gather(const std::vector<PlanKey>& keys) {
  std::vector<unsigned char> out;
  for (const PlanKey& k : keys) {
    const PlanKeyBytes b = SerializePlanKey(k);
    out.insert(out.end(), b.begin(), b.end());
  }
  return out;
}

}  // namespace

TEST(AgreeingRanksPass) {
  CHECK(CheckPlanAgreement({Sample()}).ok());
  CHECK(CheckPlanAgreement({Sample(), Sample()}).ok());
  CHECK(CheckPlanAgreement(std::vector<PlanKey>(8, Sample())).ok());
}

TEST(TwoRanksDifferInTokens) {
  PlanKey other = Sample();
  other.x_rows = 256;
  const Status s = CheckPlanAgreement({Sample(), other});
  CHECK(s.code() == Status::Code::kFailedPrecondition);
  CHECK_EQ(s.message(),
           "plan mismatch in the group: x rows: rank 0 has 512, rank 1 has 256" + kAdvice);
}

TEST(RanksWithTheSameValueAreGrouped) {
  std::vector<PlanKey> keys(6, Sample());
  keys[2].w_cols = 4096;
  keys[5].w_cols = 1024;
  const Status s = CheckPlanAgreement(keys);
  CHECK_EQ(s.message(),
           "plan mismatch in the group: w cols: ranks 0-1, 3-4 have 2048, rank 2 has 4096, "
           "rank 5 has 1024" + kAdvice);
}

TEST(EveryDifferingFieldIsNamed) {
  PlanKey other = Sample();
  other.x_type = other.w_type = CUDA_R_8F_E4M3;
  other.algorithm = jax_comm_gemm::kPipelinedCeAlgorithm;
  other.transpose_w = true;
  const Status s = CheckPlanAgreement({Sample(), other});
  CHECK_EQ(s.message(),
           "plan mismatch in the group: x dtype: rank 0 has bfloat16, rank 1 has float8_e4m3fn; "
           "w dtype: rank 0 has bfloat16, rank 1 has float8_e4m3fn; "
           "transpose_w: rank 0 has false, rank 1 has true; "
           "algorithm: rank 0 has split_p2p, rank 1 has pipelined_ce" + kAdvice);
}

TEST(AnAlgorithmNotOfferedIsNamedByNumber) {
  PlanKey other = Sample();
  other.algorithm = CUBLASMP_MATMUL_ALGO_TYPE_NO_OVERLAP;  // a build that still offers it
  CHECK_EQ(CheckPlanAgreement({Sample(), other}).message(),
           "plan mismatch in the group: algorithm: rank 0 has split_p2p, rank 1 has algorithm 5" +
               kAdvice);
}

TEST(OperationsAreNamedByTarget) {
  PlanKey other = Sample();
  other.op = CommOp::kReduceScatter;
  other.y_type = 99;
  const Status s = CheckPlanAgreement({Sample(), other});
  CHECK_CONTAINS(s.message(), "operation: rank 0 has jax_comm_gemm_all_gather_matmul, "
                              "rank 1 has jax_comm_gemm_matmul_reduce_scatter");
  CHECK_CONTAINS(s.message(), "result dtype: rank 0 has bfloat16, rank 1 has cudaDataType 99");
}

TEST(GatheredWireFormsAreChecked) {
  PlanKey other = Sample();
  other.x_cols = 512;
  const std::vector<unsigned char> agree = Gather({Sample(), Sample(), Sample()});
  CHECK(CheckGatheredPlanKeys(agree.data(), 3).ok());
  const std::vector<unsigned char> differ = Gather({Sample(), Sample(), other});
  CHECK_CONTAINS(CheckGatheredPlanKeys(differ.data(), 3).message(),
                 "x cols: ranks 0-1 have 1024, rank 2 has 512");
}

TEST(GarbageFromARankIsReportedAsSuch) {
  std::vector<unsigned char> gathered = Gather({Sample(), Sample()});
  gathered[kPlanKeyBytes] ^= 0xff;  // rank 1's format word
  const Status s = CheckGatheredPlanKeys(gathered.data(), 2);
  CHECK(s.code() == Status::Code::kFailedPrecondition);
  CHECK_CONTAINS(s.message(), "rank 1 sent something that is not a jax_comm_gemm plan key");
}
