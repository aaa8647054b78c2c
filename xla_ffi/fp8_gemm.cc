#include "fp8_gemm.h"

#include <atomic>
#include <memory>
#include <string>

#include <cuda_runtime_api.h>

#include "constants.h"
#include "cublaslt.h"
#include "cuda_wait.h"
#include "ffi_status.h"
#include "ffi_types.h"
#include "handlers.h"
#include "library_status.h"

namespace ffi = xla::ffi;

namespace jax_comm_gemm {

ffi::TypeId Fp8GemmState::id = {};

namespace {

// How long the first call's timed pick may wait for its trial GEMMs: a local
// GEMM has no peer to wait for, so only a broken device gets near it.
constexpr double kTrialTimeoutS = 120;

bool IsBlockMode(int32_t mode) {
  return mode == CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F ||
         mode == CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
}

// The scales of an operand of `rows` x k in `mode`, in the layout cuBLASLt
// reads (fp8_gemm.h): their element count, f32.
Status CheckScales(const char* operand, int32_t mode, int64_t rows, int64_t k,
                   ffi::AnyBuffer scales) {
  if (scales.element_type() != ffi::DataType::F32) {
    return Status::InvalidArgument("the scales must be float32");
  }
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
  if (dd.size() != 2 || dd[0] != s->m || dd[1] != s->n) {
    return Status::InvalidArgument("d has shape " + Dims(dd) + ", expected [" +
                                   std::to_string(s->m) + ", " + std::to_string(s->n) + "]");
  }
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
Status Plan(Fp8GemmState* st, int32_t device, cudaStream_t stream, bool timed,
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
    JCG_CUDA(cudaMalloc(&ptr, Fp8GemmState::kTrialWorkspaceBytes));
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
                                    Fp8GemmState::kTrialWorkspaceBytes, what,
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

ffi::ErrorOr<std::unique_ptr<Fp8GemmState>> Fp8GemmInstantiate() {
  return std::make_unique<Fp8GemmState>();
}

ffi::Error Fp8GemmExecute(cudaStream_t stream, int32_t device, bool timed, bool fast_accum,
                          int32_t a_scale_mode, int32_t b_scale_mode, Fp8GemmState* st,
                          ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer sa,
                          ffi::AnyBuffer sb, ffi::Result<ffi::AnyBuffer> d) {
  return FfiGuard(kFp8GemmTarget, [&]() -> Status {
    Fp8GemmShape shape;
    shape.fast_accum = fast_accum;
    shape.a_mode = a_scale_mode, shape.b_mode = b_scale_mode;
    JCG_RETURN_IF_ERROR(Describe(a, b, sa, sb, *d, &shape));
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
