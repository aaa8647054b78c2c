// The XLA FFI handlers and the Python module `jax_comm_gemm._comm_gemm`.
//
// Handlers check what Python cannot (the buffers XLA hands over against the
// group size of the context) and run the call on the context that the
// `comm_id` attribute names for this device. Python registers them with
// jax.ffi.register_ffi_target for platform "CUDA". They are not marked
// command-buffer compatible: they run NCCL collectives and may grow the
// registered workspace, which must not happen inside a CUDA-graph capture.
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <cublasmp.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "nanobind/nanobind.h"
#include "nanobind/stl/pair.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/tuple.h"
#include "nanobind/stl/vector.h"
#include "xla/ffi/api/ffi.h"

#include "context.h"
#include "registry.h"
#include "status.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;

namespace jax_comm_gemm {
namespace {

ffi::Error ToFfi(const Status& s) {
  switch (s.code()) {
    case Status::Code::kOk:
      return ffi::Error::Success();
    case Status::Code::kInvalidArgument:
      return ffi::Error::InvalidArgument(s.message());
    case Status::Code::kFailedPrecondition:
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition, s.message());
    case Status::Code::kInternal:
      break;
  }
  return ffi::Error::Internal(s.message());
}

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

Status Algorithm(int64_t a, cublasMpMatmulAlgoType_t* out) {
  if (a < CUBLASMP_MATMUL_ALGO_TYPE_DEFAULT || a > CUBLASMP_MATMUL_ALGO_TYPE_NO_OVERLAP) {
    return Status::InvalidArgument("unknown cuBLASMp algorithm " + std::to_string(a));
  }
  *out = static_cast<cublasMpMatmulAlgoType_t>(a);
  return Status();
}

// Fills `call` from the buffers and checks them against the context's group size.
Status Prepare(CommOp op, Context* ctx, int64_t algorithm, bool transpose_w, ffi::AnyBuffer x,
               ffi::AnyBuffer w, ffi::AnyBuffer y, MatmulCall* call) {
  JCG_RETURN_IF_ERROR(CudaType(x.element_type(), &call->dtype));
  if (w.element_type() != x.element_type() || y.element_type() != x.element_type()) {
    return Status::InvalidArgument("x, w and the result must share one dtype");
  }
  JCG_RETURN_IF_ERROR(Algorithm(algorithm, &call->algorithm));
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) {
    return Status::InvalidArgument("x " + Shape(xd) + " and w " + Shape(wd) + " must be 2-D");
  }
  const int64_t P = ctx->nranks();
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

ffi::Error AllGatherMatmulImpl(cudaStream_t stream, int32_t device, int64_t comm_id,
                               int64_t algorithm, bool transpose_w, int64_t layout,
                               ffi::AnyBuffer x, ffi::AnyBuffer w,
                               ffi::Result<ffi::AnyBuffer> y, ffi::RemainingRets rest) {
  Status error;
  Context* ctx = Registry::Instance().Find(comm_id, device, &error);
  if (ctx == nullptr) return ToFfi(error);
  MatmulCall call;
  Status s = Prepare(CommOp::kAllGather, ctx, algorithm, transpose_w, x, w, *y, &call);
  if (!s.ok()) return ToFfi(s);
  if (rest.size() > 1) return ffi::Error::InvalidArgument("at most one extra result (gathered x)");
  if (rest.size() == 1) {
    auto gathered = rest.get<ffi::AnyBuffer>(0);
    if (gathered.has_error()) return gathered.error();
    ffi::AnyBuffer g = **gathered;
    if (g.element_type() != x.element_type()) {
      return ffi::Error::InvalidArgument("the gathered result must have x's dtype");
    }
    s = Expect("the gathered result", g.dimensions(), {call.x_rows * ctx->nranks(), call.x_cols});
    if (!s.ok()) return ToFfi(s);
    if (layout != static_cast<int64_t>(GatheredLayout::kFront) &&
        layout != static_cast<int64_t>(GatheredLayout::kTail)) {
      return ffi::Error::InvalidArgument("unknown gathered layout " + std::to_string(layout));
    }
    call.gathered = g.untyped_data();
    call.gathered_bytes = g.size_bytes();
    call.layout = static_cast<GatheredLayout>(layout);
  }
  return ToFfi(ctx->Run(stream, call));
}

ffi::Error MatmulReduceScatterImpl(cudaStream_t stream, int32_t device, int64_t comm_id,
                                   int64_t algorithm, bool transpose_w, ffi::AnyBuffer x,
                                   ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y) {
  Status error;
  Context* ctx = Registry::Instance().Find(comm_id, device, &error);
  if (ctx == nullptr) return ToFfi(error);
  MatmulCall call;
  Status s = Prepare(CommOp::kReduceScatter, ctx, algorithm, transpose_w, x, w, *y, &call);
  if (!s.ok()) return ToFfi(s);
  return ToFfi(ctx->Run(stream, call));
}

void ThrowIfError(const Status& s) {
  if (!s.ok()) throw std::runtime_error(s.message());
}

}  // namespace
}  // namespace jax_comm_gemm

XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllGatherMatmul, jax_comm_gemm::AllGatherMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("comm_id")
                                  .Attr<int64_t>("algorithm")
                                  .Attr<bool>("transpose_w")
                                  .Attr<int64_t>("layout")
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .RemainingRets());      // optional gathered x

XLA_FFI_DEFINE_HANDLER_SYMBOL(kMatmulReduceScatter, jax_comm_gemm::MatmulReduceScatterImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("comm_id")
                                  .Attr<int64_t>("algorithm")
                                  .Attr<bool>("transpose_w")
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Ret<ffi::AnyBuffer>());

NB_MODULE(_comm_gemm, m) {
  using jax_comm_gemm::Fence;
  using jax_comm_gemm::FenceNames;
  using jax_comm_gemm::GroupSpec;
  using jax_comm_gemm::ParseFence;
  using jax_comm_gemm::Registry;
  using jax_comm_gemm::ThrowIfError;

  m.def("handlers", [] {
    nb::dict d;
    d["jax_comm_gemm_all_gather_matmul"] = nb::capsule(reinterpret_cast<void*>(kAllGatherMatmul));
    d["jax_comm_gemm_matmul_reduce_scatter"] =
        nb::capsule(reinterpret_cast<void*>(kMatmulReduceScatter));
    return d;
  });

  m.def("cublasmp_version", [] {
    int version = 0;
    return cublasMpGetVersion(&version) == CUBLASMP_STATUS_SUCCESS ? version : 0;
  }, "cuBLASMp's version as major*10000 + minor*100 + patch; 0 if it does not answer.");

  m.def("nccl_version", [] {
    int version = 0;
    return ncclGetVersion(&version) == ncclSuccess ? version : 0;
  });

  m.def("nccl_unique_id", [] {
    ncclUniqueId id;
    jax_comm_gemm::Status s = [&]() -> jax_comm_gemm::Status {
      JCG_NCCL(ncclGetUniqueId(&id));
      return jax_comm_gemm::Status();
    }();
    ThrowIfError(s);
    return nb::bytes(id.internal, sizeof(id.internal));
  }, "A new ncclUniqueId (its process hosts the bootstrap root).");

  m.def(
      "connect",
      [](const std::vector<std::tuple<int64_t, nb::bytes, int, std::vector<std::pair<int, int>>>>&
             groups,
         const std::string& fence_name, double timeout_s) {
        Fence fence;
        ThrowIfError(ParseFence(fence_name, &fence));
        std::vector<GroupSpec> specs;
        for (const auto& [key, id, nranks, members] : groups) {
          GroupSpec g;
          g.key = key;
          if (id.size() != sizeof(g.id.internal)) {
            throw std::invalid_argument("an ncclUniqueId has " +
                                        std::to_string(sizeof(g.id.internal)) + " bytes");
          }
          std::memcpy(g.id.internal, id.c_str(), sizeof(g.id.internal));
          g.nranks = nranks;
          g.local_members = members;
          specs.push_back(std::move(g));
        }
        nb::gil_scoped_release release;  // XLA threads may need the GIL meanwhile
        ThrowIfError(Registry::Instance().Connect(specs, fence, timeout_s));
      },
      nb::arg("groups"), nb::arg("fence"), nb::arg("timeout_s"),
      "Creates the contexts of (group key, unique id, nranks, [(device, rank)]) groups,\n"
      "which order their calls by `fence` (one of fences()).");

  m.def("fences", [] {
    std::vector<std::string> names;
    for (const auto& [name, _] : FenceNames()) names.push_back(name);
    return names;
  }, "The fence names that connect() takes, the default first.");

  m.def(
      "bind",
      [](int64_t comm_id, const std::vector<std::pair<int, int64_t>>& device_groups) {
        ThrowIfError(Registry::Instance().Bind(comm_id, device_groups));
      },
      nb::arg("comm_id"), nb::arg("device_groups"));

  m.def(
      "shutdown",
      [](double timeout_s) {
        nb::gil_scoped_release release;
        return Registry::Instance().Shutdown(timeout_s);
      },
      nb::arg("timeout_s"));

  m.def("contexts", [] {
    nb::list out;
    for (const auto& c : Registry::Instance().Describe()) {
      nb::dict d;
      d["group"] = c.group;
      d["device"] = c.device;
      d["rank"] = c.rank;
      d["nranks"] = c.nranks;
      d["workspace_bytes"] = c.workspace_bytes;
      d["plans"] = c.plans;
      out.append(d);
    }
    return out;
  });
}
