// The cuBLASLt pieces the project's own GEMMs share (cublaslt.h).
#include "cublaslt.h"

#include <algorithm>
#include <string>
#include <vector>

namespace jax_comm_gemm {

Status CreateLayout(cudaDataType_t t, int64_t rows, int64_t cols, int64_t ld, LtLayout* out) {
  cublasLtMatrixLayout_t layout = nullptr;
  JCG_CUBLASLT(cublasLtMatrixLayoutCreate(&layout, t, rows, cols, ld));
  out->reset(layout);
  return Status();
}

Status CreateMatmulDesc(cublasOperation_t trans_a, cublasOperation_t trans_b, LtMatmulDesc* out) {
  cublasLtMatmulDesc_t desc = nullptr;
  JCG_CUBLASLT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  out->reset(desc);
  JCG_RETURN_IF_ERROR(SetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, trans_a));
  return SetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, trans_b);
}

Status PointFp8Scales(const LtMatmulDesc& desc, const void* a_scale, const void* b_scale) {
  JCG_RETURN_IF_ERROR(SetAttribute(desc.get(), CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a_scale));
  return SetAttribute(desc.get(), CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, b_scale);
}

Status SetFp8ScaleModes(const LtMatmulDesc& desc, int32_t a_mode, int32_t b_mode) {
  JCG_RETURN_IF_ERROR(SetAttribute(desc.get(), CUBLASLT_MATMUL_DESC_A_SCALE_MODE, a_mode));
  return SetAttribute(desc.get(), CUBLASLT_MATMUL_DESC_B_SCALE_MODE, b_mode);
}

Status SetFastAccumulation(const LtMatmulDesc& desc, bool on) {
  const int8_t value = on ? 1 : 0;
  return SetAttribute(desc.get(), CUBLASLT_MATMUL_DESC_FAST_ACCUM, value);
}

namespace {

// Event marks around runs on one stream: marks[j] before the j-th run (or
// batch of runs), marks[j + 1] after it.
Status MakeMarks(size_t count, std::vector<CudaEvent>* marks) {
  marks->resize(count);
  for (CudaEvent& mark : *marks) {
    cudaEvent_t e = nullptr;
    JCG_CUDA(cudaEventCreate(&e));
    mark.reset(e);
  }
  return Status();
}

// The index of the fastest of `candidates`, each run on trial's operands.
// First a pass that loads every kernel and times one run of each; then, in
// batches of about kTimedSampleSeconds of work each (a single run's time
// follows the clock, which swings within milliseconds at the power cap), an
// untimed round and kTimedRounds rounds, alternating in order;
// FastestByMedian decides. A candidate cuBLASLt refuses to run is left out;
// -1 if it refuses them all.
Status FastestCandidate(cublasLtHandle_t lt, const LtMatmulDesc& desc, const LtLayout& a,
                        const LtLayout& b, const LtLayout& d, size_t workspace_bytes,
                        const GemmTrial& trial,
                        const std::vector<cublasLtMatmulHeuristicResult_t>& candidates,
                        int* fastest) {
  const int n = static_cast<int>(candidates.size());
  const float alpha = 1.0f, beta = 0.0f;
  auto run = [&](int i) {
    return cublasLtMatmul(lt, desc.get(), &alpha, trial.a, a.get(), trial.b, b.get(), &beta,
                          trial.d, d.get(), trial.d, d.get(), &candidates[i].algo,
                          trial.workspace, workspace_bytes, trial.stream);
  };
  std::vector<CudaEvent> marks;
  JCG_RETURN_IF_ERROR(MakeMarks(static_cast<size_t>(n) + 1, &marks));
  std::vector<bool> runs(n);
  for (int i = 0; i < n; ++i) {
    JCG_CUDA(cudaEventRecord(marks[i].get(), trial.stream));
    runs[i] = run(i) == CUBLAS_STATUS_SUCCESS;
  }
  JCG_CUDA(cudaEventRecord(marks[n].get(), trial.stream));
  JCG_RETURN_IF_ERROR(trial.wait());
  float once_ms = 0;  // the shortest single run: the batch size follows it
  for (int i = 0; i < n; ++i) {
    float ms = 0;
    JCG_CUDA(cudaEventElapsedTime(&ms, marks[i].get(), marks[i + 1].get()));
    if (runs[i] && (once_ms == 0 || ms < once_ms)) once_ms = ms;
  }
  // At most 64 runs a sample: a tiny GEMM's samples are bound by the host's
  // launches anyway.
  const int batch = std::clamp(
      static_cast<int>(kTimedSampleSeconds * 1e3 / std::max(once_ms, 1e-3f)), 1, 64);

  const int rounds = 1 + kTimedRounds;  // round 0 untimed
  JCG_RETURN_IF_ERROR(MakeMarks(static_cast<size_t>(rounds) * (n + 1), &marks));
  auto order = [&](int round, int j) { return round % 2 ? n - 1 - j : j; };
  for (int r = 0; r < rounds; ++r) {
    for (int j = 0; j < n; ++j) {
      JCG_CUDA(cudaEventRecord(marks[r * (n + 1) + j].get(), trial.stream));
      if (!runs[order(r, j)]) continue;
      for (int k = 0; k < batch; ++k) JCG_CUBLASLT(run(order(r, j)));
    }
    JCG_CUDA(cudaEventRecord(marks[r * (n + 1) + n].get(), trial.stream));
  }
  JCG_RETURN_IF_ERROR(trial.wait());
  std::vector<std::vector<float>> samples(n);
  for (int i = 0; i < n; ++i) {
    if (!runs[i]) continue;
    for (int r = 1; r < rounds; ++r) {
      const int j = order(r, i);  // where i ran in round r: the order is its own inverse
      float ms = 0;
      JCG_CUDA(cudaEventElapsedTime(&ms, marks[r * (n + 1) + j].get(),
                                    marks[r * (n + 1) + j + 1].get()));
      samples[i].push_back(ms);
    }
  }
  *fastest = FastestByMedian(samples);
  return Status();
}

}  // namespace

Status PickAlgorithm(cublasLtHandle_t lt, const LtMatmulDesc& desc, const LtLayout& a,
                     const LtLayout& b, const LtLayout& d, size_t workspace_bytes,
                     const std::string& what, const GemmTrial* trial,
                     cublasLtMatmulAlgo_t* algo, size_t* needs) {
  cublasLtMatmulPreference_t pref_raw = nullptr;
  JCG_CUBLASLT(cublasLtMatmulPreferenceCreate(&pref_raw));
  LtPreference pref(pref_raw);
  const uint64_t max_workspace = workspace_bytes;
  JCG_CUBLASLT(cublasLtMatmulPreferenceSetAttribute(
      pref.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_workspace,
      sizeof(max_workspace)));
  std::vector<cublasLtMatmulHeuristicResult_t> candidates(trial ? kTimedCandidates : 1);
  int found = 0;
  JCG_CUBLASLT(cublasLtMatmulAlgoGetHeuristic(lt, desc.get(), a.get(), b.get(), d.get(),
                                              d.get(), pref.get(),
                                              static_cast<int>(candidates.size()),
                                              candidates.data(), &found));
  if (found == 0) return Status::InvalidArgument("cuBLASLt has no GEMM algorithm for " + what);
  candidates.resize(found);
  int chosen = 0;
  if (trial != nullptr && found > 1) {
    JCG_RETURN_IF_ERROR(FastestCandidate(lt, desc, a, b, d, workspace_bytes, *trial,
                                         candidates, &chosen));
    chosen = std::max(chosen, 0);  // none ran: the call's own GEMM reports why
  }
  *algo = candidates[chosen].algo;
  *needs = candidates[chosen].workspaceSize;
  return Status();
}

}  // namespace jax_comm_gemm
