// The Python module `jax_comm_gemm._comm_gemm`: the handlers' capsules, the
// library versions, and the Registry's entry points. nanobind turns a C++
// exception into a Python one, so these may throw; Status errors become
// RuntimeError, malformed arguments ValueError.
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <cublasmp.h>
#include <nccl.h>

#include "nanobind/nanobind.h"
#include "nanobind/stl/pair.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/tuple.h"
#include "nanobind/stl/vector.h"

#include "constants.h"
#include "handlers.h"
#include "library.h"
#include "registry.h"

namespace nb = nanobind;

namespace jax_comm_gemm {
namespace {

void ThrowIfError(const Status& s) {
  if (!s.ok()) throw std::runtime_error(s.message());
}

using GroupTuple = std::tuple<int64_t, nb::bytes, int, std::vector<std::pair<int, int>>>;

std::vector<GroupSpec> ToSpecs(const std::vector<GroupTuple>& groups) {
  std::vector<GroupSpec> specs;
  for (const auto& [key, id, nranks, members] : groups) {
    GroupSpec g;
    g.key = key;
    if (id.size() != sizeof(g.id.internal)) {
      throw std::invalid_argument("an ncclUniqueId has " + std::to_string(sizeof(g.id.internal)) +
                                  " bytes");
    }
    std::memcpy(g.id.internal, id.c_str(), sizeof(g.id.internal));
    g.nranks = nranks;
    g.local_members = members;
    specs.push_back(std::move(g));
  }
  return specs;
}

void Connect(const std::vector<GroupTuple>& groups, double timeout_s, double call_timeout_s,
             bool time_gemms) {
  if (!(call_timeout_s > 0)) {
    throw std::invalid_argument("call_timeout_s must be positive, got " +
                                std::to_string(call_timeout_s));
  }
  std::vector<GroupSpec> specs = ToSpecs(groups);
  nb::gil_scoped_release release;  // XLA threads may need the GIL meanwhile
  ThrowIfError(Registry::Instance().Connect(specs, timeout_s, call_timeout_s, time_gemms));
}

nb::list Contexts() {
  nb::list out;
  for (const ContextInfo& c : Registry::Instance().Describe()) {
    nb::dict d;
    d["group"] = c.group;
    d["device"] = c.device;
    d["rank"] = c.rank;
    d["nranks"] = c.nranks;
    d["workspace_bytes"] = c.workspace_bytes;
    d["own_buffer_bytes"] = c.own_buffer_bytes;
    d["plans"] = c.plans;
    d["calls"] = c.calls;
    d["host_seconds"] = c.host_seconds;
    d["error"] = c.error;
    d["workspace_error"] = c.workspace_error;
    d["workspace_mode"] = c.workspace_mode;
    out.append(d);
  }
  return out;
}

}  // namespace
}  // namespace jax_comm_gemm

NB_MODULE(_comm_gemm, m) {
  namespace jcg = jax_comm_gemm;

  m.def("handlers", [] {
    nb::dict d;
    d[jcg::kAllGatherMatmulTarget] = nb::capsule(reinterpret_cast<void*>(kAllGatherMatmul));
    d[jcg::kMatmulReduceScatterTarget] = nb::capsule(reinterpret_cast<void*>(kMatmulReduceScatter));
    d[jcg::kFp8AllGatherMatmulTarget] =
        nb::capsule(reinterpret_cast<void*>(kFp8AllGatherMatmul));
    d[jcg::kFp8MatmulReduceScatterTarget] =
        nb::capsule(reinterpret_cast<void*>(kFp8MatmulReduceScatter));
    nb::dict fp8;  // a stateful handler: one capsule per stage
    fp8["instantiate"] = nb::capsule(reinterpret_cast<void*>(kFp8GemmInstantiate));
    fp8["execute"] = nb::capsule(reinterpret_cast<void*>(kFp8GemmExecute));
    d[jcg::kFp8GemmTarget] = fp8;
    return d;
  }, "The FFI handlers by target name (the names _constants.constants() lists).");

  m.def("types", [] {
    nb::dict state;
    state["type_id"] = nb::capsule(reinterpret_cast<void*>(jcg::Fp8GemmStateTypeId()));
    state["type_info"] =
        nb::capsule(const_cast<void*>(static_cast<const void*>(jcg::Fp8GemmTypeInfo())));
    nb::dict d;
    d[jcg::kFp8GemmStateType] = state;
    return d;
  }, "The handlers' FFI state types by name, for jax.ffi.register_ffi_type.");

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
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) {
      throw std::runtime_error(std::string("ncclGetUniqueId failed: ") + ncclGetErrorString(r));
    }
    return nb::bytes(id.internal, sizeof(id.internal));
  }, "A new ncclUniqueId (its process hosts the bootstrap root).");

  m.def("connect", &jcg::Connect, nb::arg("groups"), nb::arg("timeout_s"),
        nb::arg("call_timeout_s"), nb::arg("time_gemms"),
        "Creates the contexts of (group key, unique id, nranks, [(device, rank)]) groups.\n"
        "Each runs its calls on a stream of its own, joined to XLA's by events, and ends\n"
        "each cuBLASMp call with a barrier on the group. Set-up must finish within\n"
        "`timeout_s`; afterwards a call that does not complete within `call_timeout_s`\n"
        "(JAX_COMM_GEMM_TIMEOUT) aborts its context's communicator. With `time_gemms`\n"
        "the own algorithms' block GEMMs take the fastest of cuBLASLt's candidates, timed\n"
        "at their plan's first call.");

  m.def(
      "bind",
      [](int64_t comm_id, const std::vector<std::pair<int, int64_t>>& device_groups) {
        jcg::ThrowIfError(jcg::Registry::Instance().Bind(comm_id, device_groups));
      },
      nb::arg("comm_id"), nb::arg("device_groups"));

  m.def(
      "shutdown",
      [](double timeout_s) {
        nb::gil_scoped_release release;
        return jcg::Registry::Instance().Shutdown(timeout_s);
      },
      nb::arg("timeout_s"),
      "Destroys every context; False if that outlasted `timeout_s` (the rest is leaked).");

  m.def(
      "abort",
      [](int64_t group, int device, const std::string& reason) {
        nb::gil_scoped_release release;  // Abort may wait a few seconds for a call
        return jcg::Registry::Instance().Abort(group, device, reason);
      },
      nb::arg("group"), nb::arg("device"), nb::arg("reason"),
      "Aborts the context of `group` on `device` for `reason` (a peer's failure): its\n"
      "waiting calls end with the reason. False where there is no such context.");

  m.def("contexts", &jcg::Contexts,
        "One dict per context: group, device, rank, nranks, workspace_bytes (cuBLASMp's),\n"
        "own_buffer_bytes (the own algorithms' buffers), plans, calls and host_seconds\n"
        "(calls run since connect and their host time: the differences between two\n"
        "reads give the host's cost of a call), error ('' while healthy, else why\n"
        "its communicator was aborted) and workspace_error ('' where cuBLASMp got its\n"
        "workspace at set-up, else the library's refusal) and workspace_mode ('symmetric',\n"
        "or 'plain' where it was refused: a cudaMalloc'd workspace, cuBLASMp's default\n"
        "without overlap).");
}
