// How fast are the own algorithms' block GEMMs, on one GPU, with each of
// cuBLASLt's candidate algorithms? The pipelined plans (xla_ffi/pipelined.cc)
// take cuBLASLt's first heuristic choice for one block of rows; XLA autotunes
// its whole GEMM. This times, per GEMM, the first N heuristic candidates
// interleaved (after seconds of load: the power cap), so that one can see
// whether a timed choice would beat the first one, and what splitting a GEMM
// into blocks costs.
//
// Then, per GEMM, the project's own timed pick (xla_ffi/cublaslt.cc's
// PickAlgorithm with a trial, as a pipelined plan makes it at its first call)
// is made a few times; each line says which candidate it took, so that the
// pick can be checked against the times above on one GPU.
//
// Built and run on the GPU machine by benchmarks/gemm_probe.py:
//   gemm_probe [--candidates N] [--seconds S] [--picks P] ROWS,K,M,NN|TN ...
// Each GEMM is y[ROWS, M] = x[ROWS, K] @ w, w being [K, M] (NN) or [M, K]
// used transposed (TN), bf16 in and out, float32 accumulation, laid out as
// pipelined.cc lays out a block. Prints one line per (GEMM, candidate):
// median microseconds, TFLOP/s, and the ratio to the first candidate; then a
// line "pick GEMM: i j k ..." with the candidate of each of the P picks.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cublaslt.h"  // the project's PickAlgorithm (xla_ffi/)

namespace jcg = jax_comm_gemm;

namespace {

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

void Check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "%s: cuBLAS status %d\n", what, static_cast<int>(s));
    std::exit(1);
  }
}

struct Gemm {
  long rows, k, m;
  bool transpose_w;
  std::string text;
  void *x = nullptr, *w = nullptr, *y = nullptr;
  jcg::LtMatmulDesc desc;
  jcg::LtLayout a, b, d;
  std::vector<cublasLtMatmulHeuristicResult_t> candidates;
  double flop() const { return 2.0 * rows * k * m; }
};

void* RandomBf16(size_t count, unsigned seed, float scale) {
  std::vector<__nv_bfloat16> host(count);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  for (auto& v : host) v = __float2bfloat16(normal(rng));
  void* dev = nullptr;
  Check(cudaMalloc(&dev, count * sizeof(__nv_bfloat16)), "cudaMalloc");
  Check(cudaMemcpy(dev, host.data(), count * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice),
        "cudaMemcpy");
  return dev;
}

void CheckOk(const jcg::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.message().c_str());
    std::exit(1);
  }
}

void Run(cublasLtHandle_t lt, const Gemm& g, const cublasLtMatmulAlgo_t& algo, void* workspace,
         size_t workspace_bytes, cudaStream_t stream) {
  const float alpha = 1.0f, beta = 0.0f;
  Check(cublasLtMatmul(lt, g.desc.get(), &alpha, g.w, g.a.get(), g.x, g.b.get(), &beta, g.y,
                       g.d.get(), g.y, g.d.get(), &algo, workspace, workspace_bytes, stream),
        "cublasLtMatmul");
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  int wanted = 8, picks = 5;
  double seconds = 3.0;
  const int rounds = 10;
  std::vector<Gemm> gemms;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--candidates" && i + 1 < argc) {
      wanted = std::atoi(argv[++i]);
    } else if (arg == "--seconds" && i + 1 < argc) {
      seconds = std::atof(argv[++i]);
    } else if (arg == "--picks" && i + 1 < argc) {
      picks = std::atoi(argv[++i]);
    } else {
      Gemm g;
      char kind[3] = {0};
      if (std::sscanf(arg.c_str(), "%ld,%ld,%ld,%2s", &g.rows, &g.k, &g.m, kind) != 4 ||
          (std::string(kind) != "NN" && std::string(kind) != "TN")) {
        std::fprintf(stderr, "bad GEMM %s: want ROWS,K,M,NN|TN\n", arg.c_str());
        return 2;
      }
      g.transpose_w = std::string(kind) == "TN";
      g.text = arg;
      gemms.push_back(std::move(g));
    }
  }
  if (gemms.empty()) {
    std::fprintf(stderr, "usage: gemm_probe [--candidates N] [--seconds S] [--picks P] ROWS,K,M,NN|TN ...\n");
    return 2;
  }

  cublasLtHandle_t lt = nullptr;
  Check(cublasLtCreate(&lt), "cublasLtCreate");
  cudaStream_t stream = nullptr;
  Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  const size_t workspace_bytes = size_t{32} << 20;  // the context's (context.h)
  void* workspace = nullptr;
  Check(cudaMalloc(&workspace, workspace_bytes), "cudaMalloc workspace");

  unsigned seed = 1;
  for (Gemm& g : gemms) {
    // A layer's magnitudes: w ~ k^-1/2 (the GEMM's power depends on its data).
    g.x = RandomBf16(static_cast<size_t>(g.rows * g.k), seed++, 1.0f);
    g.w = RandomBf16(static_cast<size_t>(g.k * g.m), seed++, 1.0f / std::sqrt(float(g.k)));
    Check(cudaMalloc(&g.y, static_cast<size_t>(g.rows * g.m) * 2), "cudaMalloc y");
    // Column-major as pipelined.cc: D (m x r) = op(A) (m x k) * B (k x r), A = w.
    CheckOk(jcg::CreateMatmulDesc(g.transpose_w ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N,
                                  &g.desc));
    if (g.transpose_w) {
      CheckOk(jcg::CreateLayout(CUDA_R_16BF, g.k, g.m, g.k, &g.a));
    } else {
      CheckOk(jcg::CreateLayout(CUDA_R_16BF, g.m, g.k, g.m, &g.a));
    }
    CheckOk(jcg::CreateLayout(CUDA_R_16BF, g.k, g.rows, g.k, &g.b));
    CheckOk(jcg::CreateLayout(CUDA_R_16BF, g.m, g.rows, g.m, &g.d));
    cublasLtMatmulPreference_t pref = nullptr;
    Check(cublasLtMatmulPreferenceCreate(&pref), "pref");
    const uint64_t max_ws = workspace_bytes;
    Check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                               &max_ws, sizeof(max_ws)),
          "pref ws");
    g.candidates.resize(wanted);
    int found = 0;
    Check(cublasLtMatmulAlgoGetHeuristic(lt, g.desc.get(), g.a.get(), g.b.get(), g.d.get(),
                                         g.d.get(), pref, wanted, g.candidates.data(), &found),
          "heuristic");
    g.candidates.resize(found);
    cublasLtMatmulPreferenceDestroy(pref);
  }

  // Calls per timed batch: about 20 ms of work at 600 TFLOP/s.
  auto batch = [](const Gemm& g) { return std::max(3, int(0.02 / (g.flop() / 6e14))); };
  cudaEvent_t start, stop;
  Check(cudaEventCreate(&start), "event");
  Check(cudaEventCreate(&stop), "event");
  // Load first, every candidate of every GEMM, until `seconds` have passed.
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < until) {
    for (const Gemm& g : gemms)
      for (const auto& c : g.candidates)
        for (int i = 0; i < batch(g); ++i) Run(lt, g, c.algo, workspace, workspace_bytes, stream);
    Check(cudaStreamSynchronize(stream), "warm-up");
  }
  // Rounds over every (GEMM, candidate), alternating in order.
  std::vector<std::pair<int, int>> order;
  for (int gi = 0; gi < int(gemms.size()); ++gi)
    for (int ci = 0; ci < int(gemms[gi].candidates.size()); ++ci) order.push_back({gi, ci});
  std::vector<std::vector<std::vector<double>>> us(gemms.size());
  for (size_t gi = 0; gi < gemms.size(); ++gi) us[gi].resize(gemms[gi].candidates.size());
  for (int r = 0; r < rounds; ++r) {
    for (size_t o = 0; o < order.size(); ++o) {
      const auto [gi, ci] = r % 2 ? order[order.size() - 1 - o] : order[o];
      const Gemm& g = gemms[gi];
      const int n = batch(g);
      Check(cudaEventRecord(start, stream), "record");
      for (int i = 0; i < n; ++i)
        Run(lt, g, g.candidates[ci].algo, workspace, workspace_bytes, stream);
      Check(cudaEventRecord(stop, stream), "record");
      Check(cudaEventSynchronize(stop), "sync");
      float ms = 0;
      Check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
      us[gi][ci].push_back(ms * 1e3 / n);
    }
  }
  std::printf("%-24s %4s %10s %8s %8s %s\n", "gemm", "cand", "median_us", "TFLOP/s", "vs_1st",
              "workspace_MiB");
  for (size_t gi = 0; gi < gemms.size(); ++gi) {
    const Gemm& g = gemms[gi];
    const double first = Median(us[gi][0]);
    for (size_t ci = 0; ci < g.candidates.size(); ++ci) {
      const double t = Median(us[gi][ci]);
      std::printf("%-24s %4zu %10.2f %8.1f %8.4f %.1f\n", g.text.c_str(), ci, t,
                  g.flop() / (t * 1e-6) / 1e12, t / first,
                  g.candidates[ci].workspaceSize / 1048576.0);
    }
  }
  // The project's timed pick, as a plan makes it, `picks` times per GEMM.
  for (const Gemm& g : gemms) {
    std::printf("pick %s:", g.text.c_str());
    for (int p = 0; p < picks; ++p) {
      jcg::GemmTrial trial;
      trial.a = g.w, trial.b = g.x, trial.d = g.y;
      trial.workspace = workspace, trial.stream = stream;
      trial.wait = [&] {
        Check(cudaStreamSynchronize(stream), "trial");
        return jcg::Status();
      };
      cublasLtMatmulAlgo_t algo;
      size_t needs = 0;
      CheckOk(jcg::PickAlgorithm(lt, g.desc, g.a, g.b, g.d, workspace_bytes, g.text, &trial,
                                 &algo, &needs));
      int index = -1;
      for (size_t ci = 0; ci < g.candidates.size(); ++ci) {
        if (std::memcmp(&algo, &g.candidates[ci].algo, sizeof(algo)) == 0) index = int(ci);
      }
      std::printf(" %d", index);
    }
    std::printf("\n");
  }
  return 0;
}
