// The shared names and numbers: what _constants exports and the handlers use,
// and which algorithms each operation takes (CheckAlgorithm, what the handlers
// call before anything runs).
#include <set>
#include <string>

#include <cublasmp.h>

#include "check.h"
#include "constants.h"
#include "plan_key.h"

namespace jcg = jax_comm_gemm;
using jcg::CommOp;
using jcg::Status;

TEST(LayoutNumbers) {
  CHECK_EQ(std::size(jcg::kLayouts), size_t{2});
  CHECK_EQ(static_cast<int>(jcg::kLayouts[0].layout), 0);
  CHECK_EQ(std::string(jcg::kLayouts[0].name), std::string("front"));
  CHECK_EQ(static_cast<int>(jcg::kLayouts[1].layout), 1);
  CHECK_EQ(std::string(jcg::kLayouts[1].name), std::string("tail"));
  CHECK(jcg::LayoutByNumber(1) == jcg::GatheredLayout::kTail);
  CHECK(!jcg::LayoutByNumber(2).has_value());
}

TEST(AlgorithmsAreCublasMpsEnumAndTheOwnTwo) {
  auto name = [](int64_t number) {
    const char* n = jcg::AlgorithmNameOf(number);
    return std::string(n != nullptr ? n : "<none>");
  };
  CHECK_EQ(std::size(jcg::kAlgorithms), size_t{3});
  CHECK_EQ(name(CUBLASMP_MATMUL_ALGO_TYPE_DEFAULT), std::string("default"));
  CHECK_EQ(name(CUBLASMP_MATMUL_ALGO_TYPE_SPLIT_P2P), std::string("split_p2p"));
  CHECK_EQ(name(jcg::kPipelinedCeAlgorithm), std::string("pipelined_ce"));
  CHECK(jcg::IsPipelined(jcg::kPipelinedCeAlgorithm));
  CHECK(!jcg::IsPipelined(CUBLASMP_MATMUL_ALGO_TYPE_SPLIT_P2P));
  CHECK(!jcg::IsPipelined(CUBLASMP_MATMUL_ALGO_TYPE_DEFAULT));
  // Not offered: the options no one should choose, and GEMM+AllReduce's FUSED.
  for (int removed : {int{CUBLASMP_MATMUL_ALGO_TYPE_SPLIT_MULTICAST},
                      int{CUBLASMP_MATMUL_ALGO_TYPE_ATOMIC_P2P},
                      int{CUBLASMP_MATMUL_ALGO_TYPE_ATOMIC_MULTICAST},
                      int{CUBLASMP_MATMUL_ALGO_TYPE_NO_OVERLAP},
                      int{CUBLASMP_MATMUL_ALGO_TYPE_FUSED}, -1}) {
    CHECK(jcg::AlgorithmNameOf(removed) == nullptr);
  }
  // The own numbers are clear of cuBLASMp's enum.
  CHECK(jcg::kPipelinedCeAlgorithm > CUBLASMP_MATMUL_ALGO_TYPE_FUSED);
  std::set<std::string> names;
  std::set<int64_t> numbers;
  for (const jcg::AlgorithmName& a : jcg::kAlgorithms) {
    names.insert(a.name);
    numbers.insert(a.algorithm);
  }
  CHECK_EQ(names.size(), std::size(jcg::kAlgorithms));
  CHECK_EQ(numbers.size(), std::size(jcg::kAlgorithms));
}

TEST(EveryAlgorithmRunsBothOps) {
  for (const jcg::AlgorithmName& a : jcg::kAlgorithms) {
    CHECK(jcg::CheckAlgorithm(CommOp::kAllGather, a.algorithm).ok());
    CHECK(jcg::CheckAlgorithm(CommOp::kReduceScatter, a.algorithm).ok());
  }
}

TEST(UnknownAlgorithmsAreRefusedWithWhatIsOffered) {
  const Status ag = jcg::CheckAlgorithm(CommOp::kAllGather, CUBLASMP_MATMUL_ALGO_TYPE_NO_OVERLAP);
  CHECK(ag.code() == Status::Code::kInvalidArgument);
  CHECK_EQ(ag.message(), std::string("unknown algorithm 5: jax_comm_gemm_all_gather_matmul takes "
                                     "default, split_p2p, pipelined_ce"));
  const Status rs = jcg::CheckAlgorithm(CommOp::kReduceScatter, 100);  // the removed "pipelined"
  CHECK(rs.code() == Status::Code::kInvalidArgument);
  CHECK_EQ(rs.message(), std::string("unknown algorithm 100: jax_comm_gemm_matmul_reduce_scatter "
                                     "takes default, split_p2p, pipelined_ce"));
}

TEST(TargetNames) {
  const std::string ag = jcg::kAllGatherMatmulTarget, rs = jcg::kMatmulReduceScatterTarget;
  CHECK(ag != rs);
  for (const std::string& t : {ag, rs}) CHECK_EQ(t.rfind("jax_comm_gemm_", 0), size_t{0});
}
