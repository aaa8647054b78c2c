// The FP8 GEMM of the FP8 layers (jax_comm_gemm/fp8/gemm.py, form "cublaslt"):
//
//   d[m, n] = (a8[m, k] . b8[n, k]^T) * sa * sb
//
// both FP8 operands contracting on their last axis (the TN form Hopper's FP8
// GEMMs take), the inverse scales sa, sb applied by cuBLASLt itself through its
// A/B scale pointers: per tensor (f32 scalars, SCALAR_32F), per row of a and of
// b (f32 vectors of m and n, OUTER_VEC_32F), or per block (a's 1 x 128, b's
// 128 x 128: VEC128_32F, BLK128x128_32F). No output pass, no FP8 transpose,
// and the epilogue scales in f32 before the one rounding to d's type.
//
// XLA's own FP8 GEMM takes cuBLASLt's first heuristic choice, or a Triton
// fusion; this one times cuBLASLt's first candidates on the first call's
// operands (cublaslt.h's PickAlgorithm, as pipelined_ce's block GEMMs do) and
// keeps the fastest for the custom call's lifetime: the
// shapes of one call site never change.
//
// The algorithm, the descriptors and a cuBLASLt handle and the workspace the
// algorithm needs (often none) live in the custom call's FFI state (made at
// instantiation, filled at the first call on each device, freed with the
// executable), one set per device: a process that drives several GPUs runs one
// executable on each, and a handle, workspace or timed algorithm of one GPU
// must not serve another (per_device.h). No global state, nothing per call but
// the scale pointers and the GEMM itself. Unlike the collective handlers it is
// command-buffer compatible: XLA may record it into the CUDA graphs it makes
// of a step's GEMMs and fusions (a call outside them would split those graphs).
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <library_types.h>

#include "constants.h"
#include "cublaslt.h"
#include "handlers.h"
#include "library.h"
#include "per_device.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_comm_gemm {

inline constexpr int64_t kBlock = 128;  // the side of a scaling block

// What one call site computes: the shapes, the element types and whether the
// scales are vectors. Python checks it before lowering (fp8/gemm.py); the
// handler checks it again against the buffers.
struct Fp8GemmShape {
  int64_t m = 0, n = 0, k = 0;
  cudaDataType_t a_type = CUDA_R_8F_E4M3, b_type = CUDA_R_8F_E4M3, d_type = CUDA_R_16BF;
  // cublasLtMatmulMatrixScale_t of a's and b's scales: both SCALAR_32F, both
  // OUTER_VEC_32F, or VEC128_32F / BLK128x128_32F each (fp8_gemm.cc checks).
  int32_t a_mode = 0, b_mode = 0;
  // cuBLASLt's FP8 fast accumulation: partial sums are not promoted to f32
  // along k (faster, less precise; XLA's default for FP8 dots).
  bool fast_accum = false;

  bool operator==(const Fp8GemmShape& o) const {
    return m == o.m && n == o.n && k == o.k && a_type == o.a_type && b_type == o.b_type &&
           d_type == o.d_type && a_mode == o.a_mode && b_mode == o.b_mode &&
           fast_accum == o.fast_accum;
  }
};

// The cuBLASLt descriptors of one call site and the algorithm picked for it.
struct Fp8GemmPlan {
  Fp8GemmShape shape;
  LtMatmulDesc desc;
  LtLayout a, b, d;  // cuBLASLt's column-major view: A = b8, B = a8, D = d^T
  cublasLtMatmulAlgo_t algo{};
  size_t workspace_bytes = 0;
};

// One device's share of an FP8 GEMM call site: planned at its first call there.
struct Fp8GemmDeviceState {
  // What the timed candidates may use (cuBLASLt's advice for Hopper), at the
  // first call only; `workspace` is then what the chosen algorithm needs.
  static constexpr size_t kTrialWorkspaceBytes = size_t{32} << 20;

  std::mutex mu;  // one executable may run on several threads
  bool planned = false;
  LtHandle lt;
  DeviceBuffer workspace;
  Fp8GemmPlan plan;
};

// The FFI state of one FP8 GEMM custom call (ffi::State): made empty at
// instantiation, a device's share made and planned at its first call there.
struct Fp8GemmState {
  static xla::ffi::TypeId id;  // set by XLA when Python registers the type
  PerDevice<Fp8GemmDeviceState> devices;
};

ffi::TypeId Fp8GemmState::id = {};

namespace {

// How long the first call's timed pick may wait for its trial GEMMs: a local
// GEMM has no peer to wait for, so only a broken device gets near it.
constexpr double kTrialTimeoutS = 120;

bool IsBlockMode(int32_t mode) {
  return mode == CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F ||
         mode == CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
}

// The element count of an operand's float32 scales, `rows` x k in `mode`, in
// the layout cuBLASLt reads (the file's first comment).
Status CheckScales(const char* operand, int32_t mode, int64_t rows, int64_t k,
                   ffi::AnyBuffer scales) {
  const int64_t count = static_cast<int64_t>(scales.element_count());
  int64_t want = -1;
  switch (mode) {
    case CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F: want = 1; break;
    case CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F: want = rows; break;
    case CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F:
      if (k % kBlock == 0) want = (k / kBlock) * rows;
      break;
    case CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F:
      if (k % kBlock == 0 && rows % kBlock == 0) want = (rows / kBlock) * ((k / kBlock + 3) / 4 * 4);
      break;
    default:
      return Status::InvalidArgument(std::string(operand) + "'s scale mode " +
                                     std::to_string(mode) + " is none the FP8 GEMM takes");
  }
  if (count != want) {
    return Status::InvalidArgument(std::string(operand) + "'s scales have " +
                                   std::to_string(count) + " elements, mode " +
                                   std::to_string(mode) + " wants " + std::to_string(want) +
                                   " for " + std::to_string(rows) + " x " + std::to_string(k));
  }
  return Status();
}

// The call's shape from its buffers, checked (its modes and fast_accum set before).
Status Describe(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer sa, ffi::AnyBuffer sb,
                ffi::AnyBuffer d, Fp8GemmShape* s) {
  JCG_RETURN_IF_ERROR(Fp8Type(a.element_type(), "a", &s->a_type));
  JCG_RETURN_IF_ERROR(Fp8Type(b.element_type(), "b", &s->b_type));
  JCG_RETURN_IF_ERROR(WideType(d.element_type(), "d", &s->d_type));
  JCG_RETURN_IF_ERROR(CheckFp8Pair(s->a_type, s->b_type));
  auto ad = a.dimensions(), bd = b.dimensions(), dd = d.dimensions();
  if (ad.size() != 2 || bd.size() != 2 || ad[1] != bd[1]) {
    return Status::InvalidArgument("a " + Dims(ad) + " and b " + Dims(bd) +
                                   " must be [m, k] and [n, k]");
  }
  s->m = ad[0], s->n = bd[0], s->k = ad[1];
  JCG_RETURN_IF_ERROR(ExpectShape("d", dd, s->m, s->n));
  if (sa.element_type() != ffi::DataType::F32 || sb.element_type() != ffi::DataType::F32) {
    return Status::InvalidArgument("the scales must be float32");
  }
  JCG_RETURN_IF_ERROR(CheckScales("a", s->a_mode, s->m, s->k, sa));
  JCG_RETURN_IF_ERROR(CheckScales("b", s->b_mode, s->n, s->k, sb));
  const bool vectors_a = s->a_mode == CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
  const bool vectors_b = s->b_mode == CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
  const bool blocks = IsBlockMode(s->a_mode) || IsBlockMode(s->b_mode);
  if (vectors_a != vectors_b || (blocks && !(IsBlockMode(s->a_mode) && IsBlockMode(s->b_mode)))) {
    return Status::InvalidArgument(
        "the scale modes must be both scalar, both per row, or both per block, got " +
        std::to_string(s->a_mode) + " and " + std::to_string(s->b_mode));
  }
  if (blocks && s->fast_accum) {
    return Status::InvalidArgument("cuBLASLt's block-scaled FP8 GEMMs take no fast accumulation");
  }
  return Status();
}

// The scales of this call: cuBLASLt's A is b8 (its scale sb), its B is a8 (sa).
Status PointScales(const Fp8GemmPlan& plan, const void* sa, const void* sb) {
  return PointFp8Scales(plan.desc, sb, sa);
}

// Row-major d[m, n] = a8 . b8^T is column-major d^T (n x m) = op(A) op(B)
// with A = b8 (k x n, ld k) transposed and B = a8 (k x m, ld k): cuBLASLt's
// "TN", the only FP8 layout Hopper's kernels take.
Status MakeDescriptors(const Fp8GemmShape& s, Fp8GemmPlan* plan) {
  plan->shape = s;
  JCG_RETURN_IF_ERROR(CreateMatmulDesc(CUBLAS_OP_T, CUBLAS_OP_N, &plan->desc));
  // cuBLASLt's A is b8, its B is a8.
  JCG_RETURN_IF_ERROR(SetFp8ScaleModes(plan->desc, s.b_mode, s.a_mode));
  JCG_RETURN_IF_ERROR(SetFastAccumulation(plan->desc, s.fast_accum));
  JCG_RETURN_IF_ERROR(CreateLayout(s.b_type, s.k, s.n, s.k, &plan->a));
  JCG_RETURN_IF_ERROR(CreateLayout(s.a_type, s.k, s.m, s.k, &plan->b));
  return CreateLayout(s.d_type, s.n, s.m, s.n, &plan->d);
}

// The handler is command-buffer compatible, so XLA may record its first call
// into a CUDA graph, where cudaMalloc and host waits are not allowed. While
// `stream` is capturing, this lets the thread make the (uncaptured) allocation
// calls, and the plan skips the timed pick (nothing can be timed inside a
// capture): cuBLASLt's heuristic choice serves that call site.
class AllocationsDuringCapture {
 public:
  explicit AllocationsDuringCapture(cudaStream_t stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    capturing_ = cudaStreamIsCapturing(stream, &status) == cudaSuccess &&
                 status != cudaStreamCaptureStatusNone;
    if (capturing_) (void)cudaThreadExchangeStreamCaptureMode(&mode_);  // to relaxed
  }
  ~AllocationsDuringCapture() {
    if (capturing_) (void)cudaThreadExchangeStreamCaptureMode(&mode_);  // back
  }
  AllocationsDuringCapture(const AllocationsDuringCapture&) = delete;
  AllocationsDuringCapture& operator=(const AllocationsDuringCapture&) = delete;
  bool capturing() const { return capturing_; }

 private:
  bool capturing_ = false;
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

// The first call: a cuBLASLt handle and workspace on `device`, the
// descriptors, and the algorithm (timed on this call's operands if `timed`
// and not inside a graph capture).
Status Plan(Fp8GemmDeviceState* st, int32_t device, cudaStream_t stream, bool timed,
            const Fp8GemmShape& shape, const void* a, const void* b, const void* sa,
            const void* sb, void* d) {
  DeviceScope scope;
  JCG_RETURN_IF_ERROR(scope.Enter(device));
  AllocationsDuringCapture capture(stream);
  timed = timed && !capture.capturing();
  if (!st->lt) {
    cublasLtHandle_t lt = nullptr;
    JCG_CUBLASLT(cublasLtCreate(&lt));
    st->lt.reset(lt);
  }
  // The timed candidates may use up to kTrialWorkspaceBytes; the call site
  // then keeps only what the chosen algorithm needs, since a training step
  // has dozens of FP8 GEMMs (32 MiB each would hold 1.5 GiB in a 4-block step).
  DeviceBuffer trial_space;
  if (timed) {
    void* ptr = nullptr;
    JCG_CUDA(cudaMalloc(&ptr, Fp8GemmDeviceState::kTrialWorkspaceBytes));
    trial_space.reset(ptr);
  }
  Fp8GemmPlan plan;
  JCG_RETURN_IF_ERROR(MakeDescriptors(shape, &plan));
  JCG_RETURN_IF_ERROR(PointScales(plan, sa, sb));
  CudaEvent done;
  GemmTrial trial;
  trial.a = b, trial.b = a, trial.d = d;
  trial.workspace = trial_space.get();
  trial.stream = stream;
  trial.wait = [&]() -> Status {
    if (!done) {
      cudaEvent_t e = nullptr;
      JCG_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      done.reset(e);
    }
    JCG_CUDA(cudaEventRecord(done.get(), stream));
    static const std::atomic<bool> never(false);
    Status s = WaitForEvent(done.get(), Clock::now() + SecondsToDuration(kTrialTimeoutS), never);
    if (s.code() == Status::Code::kDeadlineExceeded) {
      return Status::DeadlineExceeded("the FP8 GEMM's timed pick waited " +
                                      FormatSeconds(kTrialTimeoutS) + " for its trial GEMMs");
    }
    return s;
  };
  const std::string what = "an FP8 GEMM of m = " + std::to_string(shape.m) +
                           ", n = " + std::to_string(shape.n) + ", k = " +
                           std::to_string(shape.k) + ", scale modes " +
                           std::to_string(shape.a_mode) + "/" + std::to_string(shape.b_mode) +
                           (shape.fast_accum ? ", fast accumulation" : "");
  JCG_RETURN_IF_ERROR(PickAlgorithm(st->lt.get(), plan.desc, plan.a, plan.b, plan.d,
                                    Fp8GemmDeviceState::kTrialWorkspaceBytes, what,
                                    timed ? &trial : nullptr, &plan.algo,
                                    &plan.workspace_bytes));
  if (plan.workspace_bytes > 0) {
    void* ptr = nullptr;
    JCG_CUDA(cudaMalloc(&ptr, plan.workspace_bytes));
    st->workspace.reset(ptr);
  }
  st->plan = std::move(plan);
  st->planned = true;
  return Status();
}

// Inside the guard too: no C++ exception (an allocation's) may reach XLA.
ffi::ErrorOr<std::unique_ptr<Fp8GemmState>> Fp8GemmInstantiate() {
  std::unique_ptr<Fp8GemmState> state;
  ffi::Error error = FfiGuard(kFp8GemmTarget, [&]() -> Status {
    state = std::make_unique<Fp8GemmState>();
    return Status();
  });
  if (error.failure()) return ffi::Unexpected(std::move(error));
  return state;
}

ffi::Error Fp8GemmExecute(cudaStream_t stream, int32_t device, bool timed, bool fast_accum,
                          int32_t a_scale_mode, int32_t b_scale_mode, Fp8GemmState* state,
                          ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer sa,
                          ffi::AnyBuffer sb, ffi::Result<ffi::AnyBuffer> d) {
  return FfiGuard(kFp8GemmTarget, [&]() -> Status {
    Fp8GemmShape shape;
    shape.fast_accum = fast_accum;
    shape.a_mode = a_scale_mode, shape.b_mode = b_scale_mode;
    JCG_RETURN_IF_ERROR(Describe(a, b, sa, sb, *d, &shape));
    Fp8GemmDeviceState* st = state->devices.Get(device);
    std::lock_guard<std::mutex> lock(st->mu);
    if (!st->planned) {
      JCG_RETURN_IF_ERROR(Plan(st, device, stream, timed, shape, a.untyped_data(),
                               b.untyped_data(), sa.untyped_data(), sb.untyped_data(),
                               d->untyped_data()));
    } else if (!(st->plan.shape == shape)) {
      return Status::Internal("an FP8 GEMM call site changed its shapes");
    }
    const Fp8GemmPlan& plan = st->plan;
    JCG_RETURN_IF_ERROR(PointScales(plan, sa.untyped_data(), sb.untyped_data()));
    const float alpha = 1.0f, beta = 0.0f;
    JCG_CUBLASLT(cublasLtMatmul(st->lt.get(), plan.desc.get(), &alpha, b.untyped_data(),
                                plan.a.get(), a.untyped_data(), plan.b.get(), &beta,
                                d->untyped_data(), plan.d.get(), d->untyped_data(),
                                plan.d.get(), &plan.algo, st->workspace.get(),
                                plan.workspace_bytes, stream));
    return Status();
  });
}

}  // namespace

ffi::TypeId* Fp8GemmStateTypeId() { return &Fp8GemmState::id; }

const XLA_FFI_TypeInfo* Fp8GemmTypeInfo() {
  static const XLA_FFI_TypeInfo info = ffi::MakeTypeInfo<Fp8GemmState>();
  return &info;
}

}  // namespace jax_comm_gemm

XLA_FFI_DEFINE_HANDLER_SYMBOL(kFp8GemmInstantiate, jax_comm_gemm::Fp8GemmInstantiate,
                              ffi::Ffi::BindInstantiate());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kFp8GemmExecute, jax_comm_gemm::Fp8GemmExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<bool>("timed")
                                  .Attr<bool>("fast_accum")
                                  .Attr<int32_t>("a_scale_mode")
                                  .Attr<int32_t>("b_scale_mode")
                                  .Ctx<ffi::State<jax_comm_gemm::Fp8GemmState>>()
                                  .Arg<ffi::AnyBuffer>()   // a8 [m, k]
                                  .Arg<ffi::AnyBuffer>()   // b8 [n, k]
                                  .Arg<ffi::AnyBuffer>()   // sa: as a_scale_mode says, f32
                                  .Arg<ffi::AnyBuffer>()   // sb: as b_scale_mode says
                                  .Ret<ffi::AnyBuffer>(),  // d [m, n]
                              {ffi::Traits::kCmdBufferCompatible});
