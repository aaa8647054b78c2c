// The XLA FFI handlers. They check what Python cannot (the buffers XLA hands
// over against the group size of the context) and run the call on the context
// that the `comm_id` attribute names for this device. Every body runs inside
// FfiGuard: no C++ exception reaches XLA. They are not marked command-buffer
// compatible: they run NCCL collectives and may grow the registered workspace,
// which must not happen inside a CUDA-graph capture.
#include "handlers.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "algorithms.h"
#include "constants.h"
#include "context.h"
#include "ffi_status.h"
#include "plan.h"
#include "plan_key.h"
#include "registry.h"
#include "status.h"

namespace ffi = xla::ffi;

namespace jax_comm_gemm {
namespace {

Status CudaType(ffi::DataType t, cudaDataType_t* out) {
  switch (t) {
    case ffi::DataType::BF16: *out = CUDA_R_16BF; return Status();
    case ffi::DataType::F16: *out = CUDA_R_16F; return Status();
    case ffi::DataType::F32: *out = CUDA_R_32F; return Status();
    default:
      return Status::InvalidArgument(
          "unsupported dtype: jax_comm_gemm's cuBLASMp ops take bfloat16, float16 or float32");
  }
}

std::string Shape(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

Status Expect(const char* what, ffi::AnyBuffer::Dimensions d, std::vector<int64_t> want) {
  if (d.size() == want.size() && std::equal(want.begin(), want.end(), d.begin())) return Status();
  std::string w = "[";
  for (size_t i = 0; i < want.size(); ++i) w += (i ? ", " : "") + std::to_string(want[i]);
  return Status::InvalidArgument(std::string(what) + " has shape " + Shape(d) + ", expected " +
                                 w + "]");
}

Status Layout(int64_t number, GatheredLayout* out) {
  const std::optional<GatheredLayout> l = LayoutByNumber(number);
  if (!l) return Status::InvalidArgument("unknown gathered layout " + std::to_string(number));
  *out = *l;
  return Status();
}

// Fills `call` from the buffers and checks them against the context's group size.
Status Prepare(CommOp op, const Context& ctx, int64_t algorithm, bool transpose_w,
               ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer y, MatmulCall* call) {
  JCG_RETURN_IF_ERROR(CudaType(x.element_type(), &call->dtype));
  if (w.element_type() != x.element_type() || y.element_type() != x.element_type()) {
    return Status::InvalidArgument("x, w and the result must share one dtype");
  }
  // Unknown numbers, and "pipelined" for a GEMM+ReduceScatter, are refused here.
  JCG_RETURN_IF_ERROR(CheckAlgorithm(op, algorithm));
  call->algorithm = algorithm;
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) {
    return Status::InvalidArgument("x " + Shape(xd) + " and w " + Shape(wd) + " must be 2-D");
  }
  const int64_t P = ctx.nranks();
  const int64_t k = transpose_w ? wd[1] : wd[0];
  const int64_t m = transpose_w ? wd[0] : wd[1];
  if (xd[1] != k) {
    return Status::InvalidArgument("inner dimensions differ: x " + Shape(xd) + ", w " +
                                   Shape(wd) + (transpose_w ? " (transposed)" : ""));
  }
  if (op == CommOp::kAllGather) {
    JCG_RETURN_IF_ERROR(Expect("the result", y.dimensions(), {xd[0] * P, m}));
  } else {
    if (xd[0] % P != 0) {
      return Status::InvalidArgument("x " + Shape(xd) + ": its " + std::to_string(xd[0]) +
                                     " tokens do not split over " + std::to_string(P) + " ranks");
    }
    JCG_RETURN_IF_ERROR(Expect("the result", y.dimensions(), {xd[0] / P, m}));
  }
  call->op = op;
  call->transpose_w = transpose_w;
  call->x = x.untyped_data(), call->x_rows = xd[0], call->x_cols = xd[1];
  call->w = w.untyped_data(), call->w_rows = wd[0], call->w_cols = wd[1];
  call->y = y.untyped_data();
  return Status();
}

// The optional second result of an AllGather+GEMM: the gathered x. The
// pipelined algorithm receives the shards into it, so it needs one.
Status PrepareGathered(const Context& ctx, int64_t layout, ffi::AnyBuffer x,
                       ffi::RemainingRets rest, MatmulCall* call) {
  if (rest.size() == 0 && call->algorithm == kPipelinedAlgorithm) {
    return Status::InvalidArgument("the pipelined algorithm needs the gathered result");
  }
  if (rest.size() == 0) return Status();
  if (rest.size() > 1) return Status::InvalidArgument("at most one extra result (gathered x)");
  auto gathered = rest.get<ffi::AnyBuffer>(0);
  if (gathered.has_error()) return Status::InvalidArgument(gathered.error().message());
  ffi::AnyBuffer g = **gathered;
  if (g.element_type() != x.element_type()) {
    return Status::InvalidArgument("the gathered result must have x's dtype");
  }
  JCG_RETURN_IF_ERROR(
      Expect("the gathered result", g.dimensions(), {call->x_rows * ctx.nranks(), call->x_cols}));
  JCG_RETURN_IF_ERROR(Layout(layout, &call->layout));
  call->gathered = g.untyped_data();
  call->gathered_bytes = g.size_bytes();
  return Status();
}

// The fused weight gradient's buffers (weight_gradient.h): h of y's shape,
// dw of w's. It reads the gathered x where the algorithm gathered it.
Status PrepareWeightGradient(const Context& ctx, int64_t layout, ffi::AnyBuffer x,
                             ffi::AnyBuffer h, ffi::AnyBuffer dw, MatmulCall* call) {
  if (call->algorithm == kPipelinedAlgorithm) {
    return Status::InvalidArgument(
        "the pipelined algorithm gathers into an XLA buffer, so it has no weight gradient to "
        "fuse; use pipelined_ce or a cuBLASMp algorithm");
  }
  if (h.element_type() != x.element_type() || dw.element_type() != x.element_type()) {
    return Status::InvalidArgument("h and dw must have x's dtype");
  }
  const int64_t f = call->transpose_w ? call->w_rows : call->w_cols;
  JCG_RETURN_IF_ERROR(Expect("h", h.dimensions(), {call->x_rows * ctx.nranks(), f}));
  JCG_RETURN_IF_ERROR(Expect("dw", dw.dimensions(), {call->w_rows, call->w_cols}));
  JCG_RETURN_IF_ERROR(Layout(layout, &call->layout));
  call->h = h.untyped_data();
  call->dw = dw.untyped_data();
  call->gathered_bytes = x.size_bytes() * static_cast<size_t>(ctx.nranks());
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
      JCG_RETURN_IF_ERROR(
          Prepare(CommOp::kAllGather, ctx, algorithm, transpose_w, x, w, *y, call));
      return PrepareGathered(ctx, layout, x, rest, call);
    });
  });
}

ffi::Error AllGatherMatmulWeightGradientImpl(cudaStream_t stream, int32_t device,
                                             int64_t comm_id, int64_t algorithm,
                                             bool transpose_w, int64_t layout, ffi::AnyBuffer x,
                                             ffi::AnyBuffer w, ffi::AnyBuffer h,
                                             ffi::Result<ffi::AnyBuffer> y,
                                             ffi::Result<ffi::AnyBuffer> dw) {
  return FfiGuard(kAllGatherMatmulWeightGradientTarget, [&] {
    return RunCall(stream, device, comm_id, [&](const Context& ctx, MatmulCall* call) {
      JCG_RETURN_IF_ERROR(
          Prepare(CommOp::kAllGather, ctx, algorithm, transpose_w, x, w, *y, call));
      return PrepareWeightGradient(ctx, layout, x, h, *dw, call);
    });
  });
}

ffi::Error MatmulReduceScatterImpl(cudaStream_t stream, int32_t device, int64_t comm_id,
                                   int64_t algorithm, bool transpose_w, ffi::AnyBuffer x,
                                   ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y) {
  return FfiGuard(kMatmulReduceScatterTarget, [&] {
    return RunCall(stream, device, comm_id, [&](const Context& ctx, MatmulCall* call) {
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllGatherMatmulWeightGradient,
                              jax_comm_gemm::AllGatherMatmulWeightGradientImpl,
                              jax_comm_gemm::CallBinding()
                                  .Attr<int64_t>("layout")
                                  .Arg<ffi::AnyBuffer>()   // x
                                  .Arg<ffi::AnyBuffer>()   // w
                                  .Arg<ffi::AnyBuffer>()   // h
                                  .Ret<ffi::AnyBuffer>()   // y
                                  .Ret<ffi::AnyBuffer>());  // dw

XLA_FFI_DEFINE_HANDLER_SYMBOL(kMatmulReduceScatter, jax_comm_gemm::MatmulReduceScatterImpl,
                              jax_comm_gemm::CallBinding()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Ret<ffi::AnyBuffer>());
