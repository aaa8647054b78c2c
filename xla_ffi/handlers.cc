// The comm-GEMM FFI handlers, the first half of a call's path: they decode
// the buffers and attributes XLA hands over into a MatmulCall, check what
// Python cannot (the buffers against the group size of the context), and run
// the call on the context that the `comm_id` attribute names for this device
// (context.cc). Every body runs inside FfiGuard: no C++ exception reaches XLA.
// They are not marked command-buffer compatible: they run NCCL collectives and
// may grow the registered workspace, which must not happen inside a CUDA-graph
// capture.
#include "handlers.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <cuda_runtime_api.h>

#include "constants.h"
#include "context.h"
#include "library.h"
#include "registry.h"

namespace ffi = xla::ffi;

namespace jax_comm_gemm {
namespace {

// The element types of a bf16/f16/f32 call: x's, which w and y share.
Status WideTypes(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer y, MatmulCall* call) {
  if (!WideType(x.element_type(), "x", &call->x_type).ok()) {
    return Status::InvalidArgument(
        "unsupported dtype: jax_comm_gemm's cuBLASMp ops take bfloat16, float16 or float32 "
        "(FP8 through their FP8 targets, with scales)");
  }
  if (w.element_type() != x.element_type() || y.element_type() != x.element_type()) {
    return Status::InvalidArgument("x, w and the result must share one dtype");
  }
  call->w_type = call->y_type = call->x_type;
  return Status();
}

// The element types and scales of an FP8 call (MatmulCall): x and w FP8, w in the
// TN form, y wider, each scale one float32.
Status Fp8Types(bool transpose_w, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer y,
                ffi::AnyBuffer x_scale, ffi::AnyBuffer w_scale, bool fast_accum,
                MatmulCall* call) {
  JCG_RETURN_IF_ERROR(Fp8Type(x.element_type(), "x", &call->x_type));
  JCG_RETURN_IF_ERROR(Fp8Type(w.element_type(), "w", &call->w_type));
  JCG_RETURN_IF_ERROR(CheckFp8Pair(call->x_type, call->w_type));
  JCG_RETURN_IF_ERROR(WideType(y.element_type(), "the result", &call->y_type));
  if (!transpose_w) {
    return Status::InvalidArgument(
        "an FP8 comm-GEMM takes w as [features, k] (transpose_w): Hopper's FP8 GEMMs take "
        "only operands that contract on their last axis");
  }
  for (const ffi::AnyBuffer& scale : {x_scale, w_scale}) {
    if (scale.element_type() != ffi::DataType::F32 || scale.element_count() != 1) {
      return Status::InvalidArgument("the scales must be float32 scalars (one scale per tensor)");
    }
  }
  call->x_scale = x_scale.untyped_data();
  call->w_scale = w_scale.untyped_data();
  call->fast_accum = fast_accum;
  return Status();
}

// Fills `call` from the buffers and checks them against the context's group
// size; the element types are filled and checked before (WideTypes, Fp8Types).
Status Prepare(CommOp op, const Context& ctx, int64_t algorithm, bool transpose_w,
               ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer y, MatmulCall* call) {
  // Unknown numbers are refused here.
  JCG_RETURN_IF_ERROR(CheckAlgorithm(op, algorithm));
  call->algorithm = algorithm;
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) {
    return Status::InvalidArgument("x " + Dims(xd) + " and w " + Dims(wd) + " must be 2-D");
  }
  const int64_t P = ctx.nranks();
  const int64_t k = transpose_w ? wd[1] : wd[0];
  const int64_t m = transpose_w ? wd[0] : wd[1];
  if (xd[1] != k) {
    return Status::InvalidArgument("inner dimensions differ: x " + Dims(xd) + ", w " +
                                   Dims(wd) + (transpose_w ? " (transposed)" : ""));
  }
  if (op == CommOp::kAllGather) {
    JCG_RETURN_IF_ERROR(ExpectShape("the result", y.dimensions(), xd[0] * P, m));
  } else {
    if (xd[0] % P != 0) {
      return Status::InvalidArgument("x " + Dims(xd) + ": its " + std::to_string(xd[0]) +
                                     " tokens do not split over " + std::to_string(P) + " ranks");
    }
    JCG_RETURN_IF_ERROR(ExpectShape("the result", y.dimensions(), xd[0] / P, m));
  }
  call->op = op;
  call->transpose_w = transpose_w;
  call->x = x.untyped_data(), call->x_rows = xd[0], call->x_cols = xd[1];
  call->w = w.untyped_data(), call->w_rows = wd[0], call->w_cols = wd[1];
  call->y = y.untyped_data();
  return Status();
}

// The optional second result of an AllGather+GEMM: the gathered x.
Status PrepareGathered(const Context& ctx, int64_t layout, ffi::AnyBuffer x,
                       ffi::RemainingRets rest, MatmulCall* call) {
  if (rest.size() == 0) return Status();
  if (rest.size() > 1) return Status::InvalidArgument("at most one extra result (gathered x)");
  auto gathered = rest.get<ffi::AnyBuffer>(0);
  if (gathered.has_error()) return Status::InvalidArgument(gathered.error().message());
  ffi::AnyBuffer g = **gathered;
  if (g.element_type() != x.element_type()) {
    return Status::InvalidArgument("the gathered result must have x's dtype");
  }
  JCG_RETURN_IF_ERROR(ExpectShape("the gathered result", g.dimensions(),
                                  call->x_rows * ctx.nranks(), call->x_cols));
  const std::optional<GatheredLayout> l = LayoutByNumber(layout);
  if (!l) return Status::InvalidArgument("unknown gathered layout " + std::to_string(layout));
  call->layout = *l;
  call->gathered = g.untyped_data();
  call->gathered_bytes = g.size_bytes();
  return Status();
}

// Looks the context up, prepares the call with `prepare`, runs it. A call whose
// buffers do not check out fails before any collective, alike on every rank of
// an SPMD program, so its context stays usable.
template <typename PrepareFn>
Status RunCall(cudaStream_t stream, int32_t device, int64_t comm_id, PrepareFn&& prepare) {
  Status error;
  std::shared_ptr<Context> ctx = Registry::Instance().Find(comm_id, device, &error);
  if (!ctx) return error;
  MatmulCall call;
  Status s = prepare(*ctx, &call);
  if (!s.ok()) return s;
  return ctx->Run(stream, call);
}

ffi::Error AllGatherMatmulImpl(cudaStream_t stream, int32_t device, int64_t comm_id,
                               int64_t algorithm, bool transpose_w, int64_t layout,
                               ffi::AnyBuffer x, ffi::AnyBuffer w,
                               ffi::Result<ffi::AnyBuffer> y, ffi::RemainingRets rest) {
  return FfiGuard(kAllGatherMatmulTarget, [&] {
    return RunCall(stream, device, comm_id, [&](const Context& ctx, MatmulCall* call) {
      JCG_RETURN_IF_ERROR(WideTypes(x, w, *y, call));
      JCG_RETURN_IF_ERROR(
          Prepare(CommOp::kAllGather, ctx, algorithm, transpose_w, x, w, *y, call));
      return PrepareGathered(ctx, layout, x, rest, call);
    });
  });
}

ffi::Error MatmulReduceScatterImpl(cudaStream_t stream, int32_t device, int64_t comm_id,
                                   int64_t algorithm, bool transpose_w, ffi::AnyBuffer x,
                                   ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y) {
  return FfiGuard(kMatmulReduceScatterTarget, [&] {
    return RunCall(stream, device, comm_id, [&](const Context& ctx, MatmulCall* call) {
      JCG_RETURN_IF_ERROR(WideTypes(x, w, *y, call));
      return Prepare(CommOp::kReduceScatter, ctx, algorithm, transpose_w, x, w, *y, call);
    });
  });
}

// The FP8 comm-GEMMs (MatmulCall): the same calls with FP8 x and w and their
// scales. No fused weight gradient: the FP8 one needs the gathered x
// transposed, which XLA makes from the gathered result (fp8/steps.py).
ffi::Error Fp8AllGatherMatmulImpl(cudaStream_t stream, int32_t device, int64_t comm_id,
                                  int64_t algorithm, bool transpose_w, bool fast_accum,
                                  int64_t layout, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                  ffi::AnyBuffer x_scale, ffi::AnyBuffer w_scale,
                                  ffi::Result<ffi::AnyBuffer> y, ffi::RemainingRets rest) {
  return FfiGuard(kFp8AllGatherMatmulTarget, [&] {
    return RunCall(stream, device, comm_id, [&](const Context& ctx, MatmulCall* call) {
      JCG_RETURN_IF_ERROR(
          Fp8Types(transpose_w, x, w, *y, x_scale, w_scale, fast_accum, call));
      JCG_RETURN_IF_ERROR(
          Prepare(CommOp::kAllGather, ctx, algorithm, transpose_w, x, w, *y, call));
      return PrepareGathered(ctx, layout, x, rest, call);
    });
  });
}

ffi::Error Fp8MatmulReduceScatterImpl(cudaStream_t stream, int32_t device, int64_t comm_id,
                                      int64_t algorithm, bool transpose_w, bool fast_accum,
                                      ffi::AnyBuffer x, ffi::AnyBuffer w,
                                      ffi::AnyBuffer x_scale, ffi::AnyBuffer w_scale,
                                      ffi::Result<ffi::AnyBuffer> y) {
  return FfiGuard(kFp8MatmulReduceScatterTarget, [&] {
    return RunCall(stream, device, comm_id, [&](const Context& ctx, MatmulCall* call) {
      JCG_RETURN_IF_ERROR(
          Fp8Types(transpose_w, x, w, *y, x_scale, w_scale, fast_accum, call));
      return Prepare(CommOp::kReduceScatter, ctx, algorithm, transpose_w, x, w, *y, call);
    });
  });
}

// What every handler binds first, in the order of its Impl's parameters: the
// stream, the device, and the attributes every lowering sets (primitives.py).
auto CallBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Attr<int64_t>("comm_id")
      .Attr<int64_t>("algorithm")
      .Attr<bool>("transpose_w");
}

}  // namespace
}  // namespace jax_comm_gemm

XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllGatherMatmul, jax_comm_gemm::AllGatherMatmulImpl,
                              jax_comm_gemm::CallBinding()
                                  .Attr<int64_t>("layout")
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .RemainingRets());      // optional gathered x

XLA_FFI_DEFINE_HANDLER_SYMBOL(kMatmulReduceScatter, jax_comm_gemm::MatmulReduceScatterImpl,
                              jax_comm_gemm::CallBinding()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kFp8AllGatherMatmul, jax_comm_gemm::Fp8AllGatherMatmulImpl,
                              jax_comm_gemm::CallBinding()
                                  .Attr<bool>("fast_accum")
                                  .Attr<int64_t>("layout")
                                  .Arg<ffi::AnyBuffer>()  // x8
                                  .Arg<ffi::AnyBuffer>()  // w8, [m/P, k]
                                  .Arg<ffi::AnyBuffer>()  // x's scale
                                  .Arg<ffi::AnyBuffer>()  // w's scale
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .RemainingRets());      // optional gathered x8

XLA_FFI_DEFINE_HANDLER_SYMBOL(kFp8MatmulReduceScatter,
                              jax_comm_gemm::Fp8MatmulReduceScatterImpl,
                              jax_comm_gemm::CallBinding()
                                  .Attr<bool>("fast_accum")
                                  .Arg<ffi::AnyBuffer>()  // x8
                                  .Arg<ffi::AnyBuffer>()  // w8, [m, k/P]
                                  .Arg<ffi::AnyBuffer>()  // x's scale
                                  .Arg<ffi::AnyBuffer>()  // w's scale
                                  .Ret<ffi::AnyBuffer>());
