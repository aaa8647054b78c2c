// The shared names and numbers: what _constants exports and the handlers use.
#include <set>
#include <string>

#include <cublasmp.h>

#include "algorithms.h"
#include "check.h"
#include "constants.h"

namespace jcg = jax_comm_gemm;

TEST(FencesDefaultFirst) {
  CHECK_EQ(std::string(jcg::kFences[0].name), std::string("isolated"));
  CHECK_EQ(jcg::FenceList(),
           std::string("isolated, own_stream, barrier, host, none"));
}

TEST(EveryFenceIsFoundByName) {
  for (const jcg::FenceName& f : jcg::kFences) CHECK(jcg::FenceByName(f.name) == f.fence);
  CHECK(!jcg::FenceByName("Isolated").has_value());
  CHECK(!jcg::FenceByName("").has_value());
}

TEST(LayoutNumbers) {
  CHECK_EQ(static_cast<int>(jcg::kLayouts[0].layout), 0);
  CHECK_EQ(std::string(jcg::kLayouts[0].name), std::string("front"));
  CHECK_EQ(static_cast<int>(jcg::kLayouts[1].layout), 1);
  CHECK_EQ(std::string(jcg::kLayouts[1].name), std::string("tail"));
}

TEST(AlgorithmsAreCublasMpsEnum) {
  auto name = [](int number) { return std::string(jcg::AlgorithmNameOf(number)); };
  CHECK_EQ(name(CUBLASMP_MATMUL_ALGO_TYPE_DEFAULT), std::string("default"));
  CHECK_EQ(name(CUBLASMP_MATMUL_ALGO_TYPE_SPLIT_P2P), std::string("split_p2p"));
  CHECK_EQ(name(CUBLASMP_MATMUL_ALGO_TYPE_SPLIT_MULTICAST), std::string("split_multicast"));
  CHECK_EQ(name(CUBLASMP_MATMUL_ALGO_TYPE_ATOMIC_P2P), std::string("atomic_p2p"));
  CHECK_EQ(name(CUBLASMP_MATMUL_ALGO_TYPE_ATOMIC_MULTICAST), std::string("atomic_multicast"));
  CHECK_EQ(name(CUBLASMP_MATMUL_ALGO_TYPE_NO_OVERLAP), std::string("no_overlap"));
  CHECK_EQ(name(jcg::kPipelinedAlgorithm), std::string("pipelined"));
  CHECK_EQ(name(jcg::kPipelinedCeAlgorithm), std::string("pipelined_ce"));
  CHECK(jcg::IsPipelined(jcg::kPipelinedAlgorithm) && jcg::IsPipelined(jcg::kPipelinedCeAlgorithm));
  CHECK(!jcg::IsPipelined(CUBLASMP_MATMUL_ALGO_TYPE_SPLIT_P2P));
  // GEMM+AllReduce only: not offered.
  CHECK(jcg::AlgorithmNameOf(CUBLASMP_MATMUL_ALGO_TYPE_FUSED) == nullptr);
  CHECK(jcg::AlgorithmNameOf(-1) == nullptr);
  std::set<std::string> names;
  std::set<int> numbers;
  for (const jcg::AlgorithmName& a : jcg::kAlgorithms) {
    names.insert(a.name);
    numbers.insert(a.algorithm);
  }
  CHECK_EQ(names.size(), std::size(jcg::kAlgorithms));
  CHECK_EQ(numbers.size(), std::size(jcg::kAlgorithms));
}

TEST(TargetNames) {
  const std::string ag = jcg::kAllGatherMatmulTarget, rs = jcg::kMatmulReduceScatterTarget;
  CHECK(ag != rs);
  CHECK_EQ(ag.rfind("jax_comm_gemm_", 0), size_t{0});
  CHECK_EQ(rs.rfind("jax_comm_gemm_", 0), size_t{0});
}
