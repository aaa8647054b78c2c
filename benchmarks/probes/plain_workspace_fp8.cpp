// Does cuBLASMp's FP8 (per-tensor E4M3) AllGather+GEMM and GEMM+ReduceScatter run
// on a workspace from plain cudaMalloc, where NCCL has no symmetric memory (ranks
// sharing one GPU, each process its own NCCL_HOSTID)? Is the result right against
// float64, and where in the workspace is the gathered FP8 operand?
// PROBE_TYPE=bf16 runs the same in bf16 (no scales), to find where the gathered
// operand lies at each group size for the layouts of jax_comm_gemm's reuse.
//
// One process per rank, the ranks of a group on GPU PROBE_DEVICE (default: their
// rank). Every rank makes every rank's inputs from the same seeds, so the float64
// reference needs no communication.
//
// usage: plain_workspace_fp8 RANK NRANKS UIDFILE n k m op algo
//   op: ag (D[m/P, n] = A^T B_gathered) or rs (D[m, n/P] = sum over ranks of A_r^T B_r)
//   algo: cuBLASMp's cublasMpMatmulAlgoType_t (0 DEFAULT, 1 SPLIT_P2P, 5 NO_OVERLAP);
//         never a MULTICAST one (2, 4).
// PROBE_SYMMETRIC=1 takes the workspace from cublasMpMalloc instead (for comparison
// on GPUs with symmetric memory).
//
// Shapes in cuBLASMp's column-major terms, TN as Hopper's FP8 GEMMs need:
// A is k x m (the weight, E4M3), B is k x n (the tokens, E4M3), D is m x n (bf16);
// D = a_scale * b_scale * A^T B, the scales one float each on the device.
#include <cublasmp.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "constants.h"  // jax_comm_gemm's TailPadding: where its 'tail' layout reads

namespace {

#define CK(x)                                                                             \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      std::fprintf(stderr, "CUDA %s at line %d\n", cudaGetErrorString(e_), __LINE__);      \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)
#define NK(x)                                                                             \
  do {                                                                                    \
    ncclResult_t e_ = (x);                                                                \
    if (e_ != ncclSuccess) {                                                              \
      std::fprintf(stderr, "NCCL %s at line %d\n", ncclGetErrorString(e_), __LINE__);      \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)
// A cuBLASMp status that is not SUCCESS is a result here (SPLIT_P2P's refusal), not a
// crash: print it and end the rank.
#define MK(x)                                                                             \
  do {                                                                                    \
    cublasMpStatus_t e_ = (x);                                                            \
    if (e_ != CUBLASMP_STATUS_SUCCESS) {                                                  \
      std::printf("rank %d cublasmp_status %d at line %d\n", rank, (int)e_, __LINE__);     \
      std::fflush(stdout);                                                                \
      std::exit(3);                                                                       \
    }                                                                                     \
  } while (0)

int rank = 0;

// E4M3 (the "fn" variant: no infinities, 0x7f/0xff NaN): the value of each byte.
double E4M3Value(uint8_t b) {
  const int sign = b >> 7, exponent = (b >> 3) & 0xf, mantissa = b & 7;
  double v = exponent == 0 ? std::ldexp(mantissa / 8.0, -6)
                           : std::ldexp(1.0 + mantissa / 8.0, exponent - 7);
  return sign ? -v : v;
}

// Round to nearest E4M3 (saturating at 448) by search over the 127 finite
// non-negative values, which are increasing in their byte.
uint8_t ToE4M3(double v) {
  static const std::vector<double> table = [] {
    std::vector<double> t;
    for (int b = 0; b < 0x7f; ++b) t.push_back(E4M3Value(static_cast<uint8_t>(b)));
    return t;
  }();
  const double a = std::min(std::fabs(v), 448.0);
  auto it = std::lower_bound(table.begin(), table.end(), a);
  size_t i = it - table.begin();
  if (i == table.size()) i = table.size() - 1;
  if (i > 0 && a - table[i - 1] <= table[i] - a) --i;
  return static_cast<uint8_t>(i | (v < 0 && i != 0 ? 0x80 : 0));
}

double Bf16Value(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

bool bf16 = false;  // PROBE_TYPE=bf16: the inputs in bf16, 2 bytes an element

// Element i of a tensor's bytes, in the probe's input type.
double Value(const std::vector<uint8_t>& bytes, size_t i) {
  if (!bf16) return E4M3Value(bytes[i]);
  return Bf16Value(static_cast<uint16_t>(bytes[2 * i] | (bytes[2 * i + 1] << 8)));
}

// Random normal values, as bytes of the input type: E4M3 with one dequantizing
// scale per tensor (values / scale fill E4M3's range up to 448 at 4 sigma), or
// bf16 (scale 1), rounded to nearest even.
std::vector<uint8_t> Quantized(size_t count, uint32_t seed, double sigma, double scale) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> normal(0.0, sigma);
  std::vector<uint8_t> out(count * (bf16 ? 2 : 1));
  for (size_t i = 0; i < count; ++i) {
    if (!bf16) {
      out[i] = ToE4M3(normal(gen) / scale);
      continue;
    }
    const float f = static_cast<float>(normal(gen));
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint16_t b = static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
    out[2 * i] = static_cast<uint8_t>(b & 0xff);
    out[2 * i + 1] = static_cast<uint8_t>(b >> 8);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 9) {
    std::fprintf(stderr, "usage: %s RANK NRANKS UIDFILE n k m ag|rs algo\n", argv[0]);
    return 2;
  }
  rank = std::atoi(argv[1]);
  const int P = std::atoi(argv[2]);
  const std::string uidfile = argv[3];
  const int64_t n = std::atoll(argv[4]), k = std::atoll(argv[5]), m = std::atoll(argv[6]);
  const bool rs = std::string(argv[7]) == "rs";
  const int algo = std::atoi(argv[8]);
  bf16 = std::getenv("PROBE_TYPE") != nullptr && std::string(std::getenv("PROBE_TYPE")) == "bf16";
  CK(cudaSetDevice(std::getenv("PROBE_DEVICE") ? std::atoi(std::getenv("PROBE_DEVICE")) : rank));

  ncclUniqueId uid;
  if (rank == 0) {
    NK(ncclGetUniqueId(&uid));
    const std::string tmp = uidfile + ".tmp";
    {
      std::ofstream f(tmp, std::ios::binary);
      f.write(reinterpret_cast<char*>(&uid), sizeof uid);
    }
    std::rename(tmp.c_str(), uidfile.c_str());
  } else {
    for (;;) {
      std::ifstream f(uidfile, std::ios::binary);
      if (f && f.read(reinterpret_cast<char*>(&uid), sizeof uid)) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  ncclComm_t comm;
  NK(ncclCommInitRank(&comm, P, uid, rank));
  int version = 0, nccl_version = 0;
  MK(cublasMpGetVersion(&version));
  NK(ncclGetVersion(&nccl_version));
  if (rank == 0) std::printf("cublasmp_version %d nccl_version %d\n", version, nccl_version);

  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasMpHandle_t handle;
  MK(cublasMpCreate(&handle, stream));
  cublasMpGrid_t col, row;
  MK(cublasMpGridCreate(P, 1, CUBLASMP_GRID_LAYOUT_COL_MAJOR, comm, &col));
  MK(cublasMpGridCreate(1, P, CUBLASMP_GRID_LAYOUT_ROW_MAJOR, comm, &row));

  const int64_t bm = m / P, bn = n / P, bk = k / P;
  cublasMpMatrixDescriptor_t dA, dB, dD;
  const cudaDataType_t input = bf16 ? CUDA_R_16BF : CUDA_R_8F_E4M3, out = CUDA_R_16BF;
  if (!rs) {  // A split along m, B along n, D along m
    MK(cublasMpMatrixDescriptorCreate(k, m, k, bm, 0, 0, k, input, row, &dA));
    MK(cublasMpMatrixDescriptorCreate(k, n, k, bn, 0, 0, k, input, row, &dB));
    MK(cublasMpMatrixDescriptorCreate(m, n, bm, bn, 0, 0, bm, out, col, &dD));
  } else {  // A and B split along k, D along n
    MK(cublasMpMatrixDescriptorCreate(k, m, bk, m, 0, 0, bk, input, col, &dA));
    MK(cublasMpMatrixDescriptorCreate(k, n, bk, n, 0, 0, bk, input, col, &dB));
    MK(cublasMpMatrixDescriptorCreate(m, n, m, bn, 0, 0, m, out, row, &dD));
  }
  cublasMpMatmulDescriptor_t md;
  MK(cublasMpMatmulDescriptorCreate(&md, CUBLAS_COMPUTE_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  MK(cublasMpMatmulDescriptorSetAttribute(md, CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_TRANSA, &ta,
                                          sizeof ta));
  MK(cublasMpMatmulDescriptorSetAttribute(md, CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_TRANSB, &tb,
                                          sizeof tb));
  const auto at = static_cast<cublasMpMatmulAlgoType_t>(algo);
  MK(cublasMpMatmulDescriptorSetAttribute(md, CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_ALGO_TYPE, &at,
                                          sizeof at));
  if (rs) {
    MK(cublasMpMatmulDescriptorSetAttribute(
        md, CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_COMMUNICATION_TYPE, &out, sizeof out));
  }

  // Every rank's shards, from seeds: A_r and B_r. The scales: dequantizing, one each.
  const double a_scale = bf16 ? 1 : 0.05 / 112, b_scale = bf16 ? 1 : 1.0 / 112;  // 4 sigma -> 448
  const size_t es = bf16 ? 2 : 1;  // bytes an input element
  const size_t a_count = rs ? bk * m : k * bm, b_count = rs ? bk * n : k * bn;
  std::vector<std::vector<uint8_t>> hA(P), hB(P);
  for (int r = 0; r < P; ++r) {
    hA[r] = Quantized(a_count, 1000 + r, 0.05, a_scale);
    hB[r] = Quantized(b_count, 2000 + r, 1.0, b_scale);
  }
  void *A, *B, *D, *scales;
  CK(cudaMalloc(&A, a_count * es));
  CK(cudaMalloc(&B, b_count * es));
  const size_t d_count = rs ? m * bn : bm * n;
  CK(cudaMalloc(&D, d_count * 2));
  CK(cudaMalloc(&scales, 2 * sizeof(float)));
  const float host_scales[2] = {static_cast<float>(a_scale), static_cast<float>(b_scale)};
  CK(cudaMemcpy(scales, host_scales, sizeof host_scales, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(A, hA[rank].data(), a_count * es, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(B, hB[rank].data(), b_count * es, cudaMemcpyHostToDevice));
  const float* a_scale_ptr = static_cast<float*>(scales);
  const float* b_scale_ptr = a_scale_ptr + 1;
  if (!bf16) {
    MK(cublasMpMatmulDescriptorSetAttribute(
        md, CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_A_SCALE_POINTER, &a_scale_ptr, sizeof a_scale_ptr));
    MK(cublasMpMatmulDescriptorSetAttribute(
        md, CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_B_SCALE_POINTER, &b_scale_ptr, sizeof b_scale_ptr));
  }

  const float alpha = 1, beta = 0;
  size_t ws_device = 0, ws_host = 0;
  MK(cublasMpMatmul_bufferSize(handle, md, m, n, k, &alpha, A, 1, 1, dA, B, 1, 1, dB, &beta,
                               nullptr, 1, 1, nullptr, D, 1, 1, dD, &ws_device, &ws_host));
  const bool symmetric = std::getenv("PROBE_SYMMETRIC") != nullptr;
  void* ws = nullptr;
  if (symmetric) {
    MK(cublasMpMalloc(col, &ws, ws_device));
  } else {
    CK(cudaMalloc(&ws, ws_device));
  }
  CK(cudaMemset(ws, 0xAB, ws_device));
  std::vector<uint8_t> host_ws(ws_host);
  CK(cudaDeviceSynchronize());
  std::printf("rank %d %s algo %d workspace %s device_bytes %zu host_bytes %zu\n", rank,
              rs ? "GEMM+RS" : "AG+GEMM", algo, symmetric ? "symmetric" : "plain", ws_device,
              ws_host);
  const auto t0 = std::chrono::steady_clock::now();
  MK(cublasMpMatmul(handle, md, m, n, k, &alpha, A, 1, 1, dA, B, 1, 1, dB, &beta, nullptr, 1, 1,
                    nullptr, D, 1, 1, dD, ws, ws_device, host_ws.data(), ws_host));
  CK(cudaStreamSynchronize(stream));
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();

  // float64 reference at every 8th token (column of D), every output row.
  std::vector<uint16_t> hD(d_count);
  CK(cudaMemcpy(hD.data(), D, d_count * 2, cudaMemcpyDeviceToHost));
  double worst = 0, largest = 0;
  bool nan = false;
  const int64_t rows = rs ? m : bm, cols = rs ? bn : n;
  for (int64_t j = 0; j < cols; j += 8) {
    const int64_t token = rs ? rank * bn + j : j;
    for (int64_t i = 0; i < rows; ++i) {
      double ref = 0;
      if (!rs) {  // A_rank (k x bm) column i, B of the token's rank, column token % bn
        const auto &a = hA[rank], &b = hB[token / bn];
        for (int64_t q = 0; q < k; ++q) ref += Value(a, i * k + q) * Value(b, (token % bn) * k + q);
      } else {  // sum over the ranks' k slices
        for (int r = 0; r < P; ++r) {
          for (int64_t q = 0; q < bk; ++q) ref += Value(hA[r], i * bk + q) * Value(hB[r], token * bk + q);
        }
      }
      ref *= a_scale * b_scale;
      const double got = Bf16Value(hD[j * rows + i]);
      if (std::isnan(got)) nan = true;
      worst = std::max(worst, std::fabs(got - ref));
      largest = std::max(largest, std::fabs(ref));
    }
  }
  const double err = worst / largest;
  // bf16 output: half an ulp (2^-9) of the largest value; GEMM+RS's partial sums travel
  // in bf16 too, one more rounding per rank.
  const double bound = rs ? (P + 1) * std::ldexp(1.0, -8) : std::ldexp(1.0, -8);
  std::printf("rank %d max_err_over_max_ref %.3e bound %.3e nan %d %s ms_first_call %.1f\n",
              rank, err, bound, static_cast<int>(nan), (!nan && err < bound) ? "OK" : "WRONG",
              ms);

  if (!rs) {  // where the gathered B (k x n elements, the ranks' shards in order) lies
    std::vector<uint8_t> gathered;
    for (int r = 0; r < P; ++r) gathered.insert(gathered.end(), hB[r].begin(), hB[r].end());
    std::vector<uint8_t> hw(ws_device);
    CK(cudaMemcpy(hw.data(), ws, ws_device, cudaMemcpyDeviceToHost));
    const size_t bytes = gathered.size();
    long long found = -1;
    for (size_t off = 0; off + bytes <= hw.size(); ++off) {
      if (hw[off] == gathered[0] && std::memcmp(&hw[off], gathered.data(), bytes) == 0) {
        found = static_cast<long long>(off);
        break;
      }
    }
    const long long tail = static_cast<long long>(ws_device) - static_cast<long long>(bytes) -
                           static_cast<long long>(jax_comm_gemm::TailPadding(P));
    std::printf("rank %d gathered_B_bytes %zu offset %lld tail_layout_offset %lld %s\n", rank,
                bytes, found, tail,
                found == tail ? "TAIL" : found == 0 ? "FRONT" : found < 0 ? "ABSENT" : "ELSEWHERE");
  }
  CK(cudaStreamSynchronize(stream));
  if (symmetric) {
    MK(cublasMpFree(col, ws));
  } else {
    CK(cudaFree(ws));
  }
  MK(cublasMpMatrixDescriptorDestroy(dA));
  MK(cublasMpMatrixDescriptorDestroy(dB));
  MK(cublasMpMatrixDescriptorDestroy(dD));
  MK(cublasMpMatmulDescriptorDestroy(md));
  MK(cublasMpGridDestroy(col));
  MK(cublasMpGridDestroy(row));
  MK(cublasMpDestroy(handle));
  NK(ncclCommDestroy(comm));
  return 0;
}
