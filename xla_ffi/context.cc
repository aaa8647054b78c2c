#include "context.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "algorithms.h"
#include "chunks.h"
#include "layout.h"
#include "library_status.h"
#include "pipelined.h"

namespace jax_comm_gemm {
namespace {

// Workspaces grow in steps of this size, so that shapes that change a little
// from step to step do not reallocate (a collective) every time.
constexpr size_t kWorkspaceGranule = size_t{32} << 20;

size_t Granules(size_t bytes) {
  return (bytes + kWorkspaceGranule - 1) / kWorkspaceGranule * kWorkspaceGranule;
}

}  // namespace

Context::Context(const ContextOptions& options)
    : options_(options), call_timeout_(SecondsToDuration(options.call_timeout_s)) {}

Status Context::Create(const ContextOptions& options, const ncclUniqueId& id,
                       std::shared_ptr<Context>* out) {
  DeviceScope scope;
  JCG_RETURN_IF_ERROR(scope.Enter(options.device));
  std::shared_ptr<Context> ctx(new Context(options));
  Status status = ctx->Init(id);
  if (!status.ok()) {
    ctx->Abort("set-up failed: " + status.message());
    return status;
  }
  *out = std::move(ctx);
  return Status();
}

Status Context::Init(const ncclUniqueId& id) {
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRank(&comm, options_.nranks, id, options_.rank);
  if (r != ncclSuccess) return NcclError("ncclCommInitRank", r, comm);
  comm_.reset(comm);
  // The project's own collectives (barrier, plan agreement) on a
  // communicator of their own: comm_ is
  // cuBLASMp's, and two operations of one communicator must never run at once
  // on different streams, which cuBLASMp's internal streams would not rule out.
  ncclComm_t own = nullptr;
  r = ncclCommSplit(comm, 0, options_.rank, &own, nullptr);
  if (r != ncclSuccess) return NcclError("ncclCommSplit", r, comm);
  own_comm_.reset(own);
  // The pipelined_ce algorithm's AllGather: on copy engines where NCCL can.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.CTAPolicy = NCCL_CTA_POLICY_ZERO;
  ncclComm_t ce_comm = nullptr;
  r = ncclCommSplit(comm, 0, options_.rank, &ce_comm, &config);
  if (r != ncclSuccess) return NcclError("ncclCommSplit", r, comm);
  ce_comm_.reset(ce_comm);
  cudaStream_t stream = nullptr;
  JCG_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  stream_.reset(stream);
  cublasMpHandle_t handle = nullptr;
  JCG_CUBLASMP(cublasMpCreate(&handle, stream));
  handle_.reset(handle);
  const int P = options_.nranks;
  cublasMpGrid_t grid = nullptr;
  JCG_CUBLASMP(cublasMpGridCreate(P, 1, CUBLASMP_GRID_LAYOUT_COL_MAJOR, comm, &grid));
  col_grid_.reset(grid);
  JCG_CUBLASMP(cublasMpGridCreate(1, P, CUBLASMP_GRID_LAYOUT_ROW_MAJOR, comm, &grid));
  row_grid_.reset(grid);
  cublasLtHandle_t lt = nullptr;
  JCG_CUBLASLT(cublasLtCreate(&lt));
  lt_.reset(lt);
  JCG_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  comm_stream_.reset(stream);
  arrived_.resize(std::max(P, kMaxChunks + 1));
  computed_.resize(kMaxChunks);
  std::vector<CudaEvent*> events = {&event_in_, &event_out_, &host_wait_event_, &started_};
  for (CudaEvent& e : arrived_) events.push_back(&e);
  for (CudaEvent& e : computed_) events.push_back(&e);
  for (CudaEvent* e : events) {
    cudaEvent_t event = nullptr;
    JCG_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    e->reset(event);
  }
  void* ptr = nullptr;
  JCG_CUDA(cudaMalloc(&ptr, sizeof(float)));
  barrier_word_.reset(ptr);
  JCG_CUDA(cudaMemset(ptr, 0, sizeof(float)));
  const size_t key_bytes = kPlanKeyBytes * (1 + P);
  JCG_CUDA(cudaMalloc(&ptr, key_bytes));
  keys_device_.reset(ptr);
  JCG_CUDA(cudaMallocHost(&ptr, key_bytes));
  keys_host_.reset(ptr);
  // NCCL connects peers at a collective's first launch, blocking the host until
  // they answer. Do that here, under connect()'s deadline, for the two
  // collectives a call issues, rather than inside a call.
  JCG_RETURN_IF_ERROR(Barrier(stream));
  JCG_RETURN_IF_ERROR(EnqueueKeyExchange(PlanKey{}));
  JCG_CUDA(cudaStreamSynchronize(stream));
  // Whether cuBLASMp can get its workspace here: cublasMpMalloc registers it
  // with NCCL symmetric memory, which NCCL refuses where it cannot map the
  // peers' memory (ranks sharing a GPU, GPUs without peer access). Learnt
  // once, under connect()'s deadline, so that routing leaves cuBLASMp's
  // algorithms out instead of failing at each call; the context stays usable
  // for the own algorithms, which need no cuBLASMp workspace.
  const Status probe = workspace_.Allocate(col_grid_.get(), row_grid_.get(), kWorkspaceGranule);
  workspace_.Release();
  if (!probe.ok()) workspace_error_ = probe.message();
  return Status();
}

Context::~Context() {
  if (aborted_) {
    Abandon();
    return;
  }
  // In-flight work may still read the workspace; members are destroyed on this device.
  if (cudaSetDevice(options_.device) == cudaSuccess) (void)cudaDeviceSynchronize();
}

template <typename Body>
Status Context::WithComm(Body&& body) {
  std::shared_lock<std::shared_timed_mutex> lock(comm_lock_);
  if (aborted_) return AbortedStatus();
  return body();
}

Status Context::Barrier(cudaStream_t stream) {
  const ncclResult_t r = ncclAllReduce(barrier_word_.get(), barrier_word_.get(), 1, ncclFloat32,
                                       ncclSum, own_comm_.get(), stream);
  if (r != ncclSuccess) return NcclError("ncclAllReduce", r, own_comm_.get());
  return Status();
}

Status Context::Join(cudaStream_t waiter, cudaStream_t signaller, cudaEvent_t event) {
  JCG_CUDA(cudaEventRecord(event, signaller));
  JCG_CUDA(cudaStreamWaitEvent(waiter, event, 0));
  return Status();
}

Status Context::WaitForStream(cudaStream_t stream, Clock::time_point deadline,
                              const char* what) {
  JCG_CUDA(cudaEventRecord(host_wait_event_.get(), stream));
  Status s = WaitForEvent(host_wait_event_.get(), deadline, aborted_);
  switch (s.code()) {
    case Status::Code::kDeadlineExceeded:
      return Status::DeadlineExceeded(PeerTimeout() + " while " + what);
    case Status::Code::kAborted:
      return AbortedStatus();
    default:
      return s;
  }
}

// Sends this rank's key to every rank on stream_: keys_host_ holds this rank's
// key, then every rank's, once the stream gets there.
Status Context::EnqueueKeyExchange(const PlanKey& key) {
  const PlanKeyBytes mine = SerializePlanKey(key);
  auto* host = static_cast<unsigned char*>(keys_host_.get());
  auto* device = static_cast<unsigned char*>(keys_device_.get());
  std::memcpy(host, mine.data(), kPlanKeyBytes);
  cudaStream_t s = stream_.get();
  JCG_CUDA(cudaMemcpyAsync(device, host, kPlanKeyBytes, cudaMemcpyHostToDevice, s));
  const ncclResult_t r = ncclAllGather(device, device + kPlanKeyBytes, kPlanKeyBytes, ncclUint8,
                                       own_comm_.get(), s);
  if (r != ncclSuccess) return NcclError("ncclAllGather", r, own_comm_.get());
  JCG_CUDA(cudaMemcpyAsync(host + kPlanKeyBytes, device + kPlanKeyBytes,
                           kPlanKeyBytes * options_.nranks, cudaMemcpyDeviceToHost, s));
  return Status();
}

// Once per plan, before cuBLASMp sees its shapes: a rank whose shapes differ
// would make its peers read and write past their buffers.
Status Context::AgreeOnPlan(const PlanKey& key, Clock::time_point deadline) {
  if (options_.nranks == 1) return Status();
  JCG_RETURN_IF_ERROR(WithComm([&] { return EnqueueKeyExchange(key); }));
  JCG_RETURN_IF_ERROR(WaitForStream(stream_.get(), deadline, "the ranks agreed on a new plan"));
  // Over NCCL's network transport a departed peer ends the exchange's kernels
  // early, without an error from the wait, and the gathered keys are stale:
  // NCCL says so only through the communicator's asynchronous error.
  JCG_RETURN_IF_ERROR(WithComm([&] {
    const std::string error = AsyncNcclError();
    return error.empty() ? Status() : Status::Internal(error);
  }));
  const auto* gathered = static_cast<const unsigned char*>(keys_host_.get()) + kPlanKeyBytes;
  return CheckGatheredPlanKeys(gathered, options_.nranks);
}

Status Context::EnsureWorkspace(size_t bytes, cudaStream_t stream,
                                Clock::time_point deadline) {
  if (bytes <= workspace_.size()) return Status();
  // Earlier calls on these streams may still use the old buffer.
  const char* what = "earlier calls finished before the workspace grew";
  JCG_RETURN_IF_ERROR(WaitForStream(stream, deadline, what));
  JCG_RETURN_IF_ERROR(WaitForStream(stream_.get(), deadline, what));
  Status s = WithComm(
      [&] { return workspace_.Allocate(col_grid_.get(), row_grid_.get(), Granules(bytes)); });
  workspace_bytes_ = workspace_.size();
  return s;
}

Status Context::Run(cudaStream_t stream, const MatmulCall& call) noexcept {
  return CatchExceptions("jax_comm_gemm", [&]() -> Status {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return Status::FailedPrecondition("jax_comm_gemm was shut down");
    if (aborted_) return AbortedStatus();
    const Clock::time_point start = Clock::now();
    Status s;
    {
      CallTracker::HostCall host_call(tracker_, start);
      s = CatchExceptions("jax_comm_gemm", [&] { return RunLocked(stream, call, start); });
    }
    host_ns_ += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count());
    ++calls_;
    switch (s.code()) {
      case Status::Code::kOk:
      case Status::Code::kAborted:  // already aborted; s says why
        return s;
      case Status::Code::kInvalidArgument:
      case Status::Code::kFailedPrecondition:  // alike on every rank: still in step
        s.message() = "jax_comm_gemm: " + s.message() + " (" + Where() + ")";
        return s;
      default:
        return AbortFor(std::move(s));
    }
  });
}

// Collective: every rank makes the plan that needs it at the same call. The
// calls that used the old window ran on stream_ and comm_stream_; XLA's
// `stream` is waited for too, which costs little at a growth this rare.
Status Context::EnsureWindow(size_t bytes, cudaStream_t stream, Clock::time_point deadline) {
  if (bytes <= window_.size()) return Status();
  const char* what = "earlier calls finished before the window grew";
  JCG_RETURN_IF_ERROR(WaitForStream(stream, deadline, what));
  JCG_RETURN_IF_ERROR(WaitForStream(stream_.get(), deadline, what));
  JCG_RETURN_IF_ERROR(WaitForStream(comm_stream_.get(), deadline, what));
  Status s = WithComm([&] { return window_.Allocate(ce_comm_.get(), Granules(bytes)); });
  CountOwnBuffers();
  return s;
}

void Context::CountOwnBuffers() {
  own_buffer_bytes_ = (lt_workspace_ ? kLtWorkspaceBytes : 0) + window_.size();
}

Status Context::EnsureLtWorkspace() {
  if (lt_workspace_) return Status();
  void* ptr = nullptr;
  JCG_CUDA(cudaMalloc(&ptr, kLtWorkspaceBytes));
  lt_workspace_.reset(ptr);
  CountOwnBuffers();
  return Status();
}

Status Context::MakePlanFor(const MatmulCall& c, cudaStream_t stream, cudaStream_t run,
                            Clock::time_point deadline, Plan* plan) {
  if (!IsPipelined(c.algorithm)) {
    const PlanTarget target{handle_.get(), col_grid_.get(), row_grid_.get(), options_.nranks};
    return WithComm([&] { return MakePlan(target, c, plan); });
  }
  JCG_RETURN_IF_ERROR(EnsureLtWorkspace());
  // Local, and fails alike on every rank: before the collectives below. The
  // timed candidates run where the call will, after XLA's work that makes the
  // operands and this context's calls before (they share the workspace); the
  // host waits for them, so none is left running beside the call.
  GemmTrial trial;
  if (options_.time_gemms) {
    JCG_RETURN_IF_ERROR(Join(run, stream, event_in_.get()));
    trial.workspace = lt_workspace_.get();
    trial.stream = run;
    trial.wait = [&] { return WaitForStream(run, deadline, "cuBLASLt's candidate GEMMs ran"); };
  }
  JCG_RETURN_IF_ERROR(MakePipelinedPlan(lt_.get(), c, options_.nranks, kLtWorkspaceBytes,
                                        options_.time_gemms ? &trial : nullptr,
                                        &plan->pipelined));
  return EnsureWindow(WindowBytes(plan->pipelined, options_.nranks), stream, deadline);
}

Status Context::Enqueue(const MatmulCall& c, const Plan& plan, size_t gathered_offset,
                        cudaStream_t run) {
  if (IsPipelined(c.algorithm)) {
    const PipelineTarget target{lt_.get(),
                                comm_stream_.get(),
                                started_.get(),
                                arrived_.data(),
                                computed_.data(),
                                ce_comm_.get(),
                                window_.data(),
                                lt_workspace_.get(),
                                kLtWorkspaceBytes,
                                options_.rank,
                                options_.nranks};
    return EnqueuePipelined(target, plan.pipelined, c, run);
  }
  JCG_CUBLASMP(cublasMpSetStream(handle_.get(), run));
  if (c.fp8()) JCG_RETURN_IF_ERROR(PointScales(plan.matmul, c));
  const float alpha = 1.0f, beta = 0.0f;
  JCG_CUBLASMP(cublasMpMatmul(
      handle_.get(), plan.matmul.get(), plan.m, plan.n, plan.k, &alpha, c.w, 1, 1,
      plan.a.get(), c.x, 1, 1, plan.b.get(), &beta, nullptr, 1, 1, nullptr, c.y, 1, 1,
      plan.d.get(), workspace_.data(), plan.device_bytes, host_workspace_.data(),
      plan.host_bytes));
  const char* gathered = workspace_.data() + gathered_offset;
  if (c.gathered != nullptr) {
    JCG_CUDA(cudaMemcpyAsync(c.gathered, gathered, c.gathered_bytes, cudaMemcpyDeviceToDevice,
                             run));
  }
  // The barrier keeps a peer's next call off this rank's workspace until this
  // rank is done with it: cuBLASMp's AllGather+GEMM writes this rank's shard
  // into each peer's workspace, and nothing in a call keeps a peer's next call
  // from doing so while this rank still reads it (cuBLASMp's own GEMMs, the
  // gathered copy above, which cuBLASMp does not know about). Without it,
  // results were wrong (docs/design.md#ordering-against-xla-the-fence).
  // pipelined_ce returns above without one: it writes no workspace of a
  // peer's, and NCCL orders its transfers within the call.
  return Barrier(run);
}

Status Context::RunLocked(cudaStream_t stream, const MatmulCall& c,
                          Clock::time_point start) {
  const Clock::time_point deadline = start + call_timeout_;
  DeviceScope scope;
  JCG_RETURN_IF_ERROR(scope.Enter(options_.device));
  // The call runs on the context's own stream_, joined by events to XLA's
  // `stream`: after everything XLA enqueued before it and before anything XLA
  // enqueues after it (docs/design.md#ordering-against-xla-the-fence). The own
  // algorithms need no cross-rank barrier, but they run on stream_ too: XLA
  // may hand two calls different compute streams, and the calls of one
  // context share its scratch (cuBLASLt workspace, window, events), which one
  // stream keeps in order.
  cudaStream_t run = stream_.get();
  const PlanKey key = c.key();
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    JCG_RETURN_IF_ERROR(AgreeOnPlan(key, deadline));
    // Shapes churn: start over. Every rank agreed on every plan, so every
    // rank's cache is the same and all start over at the same call.
    if (plans_.size() >= kMaxPlans) plans_.clear();
    Plan plan;
    JCG_RETURN_IF_ERROR(MakePlanFor(c, stream, run, deadline, &plan));
    it = plans_.emplace(key, std::move(plan)).first;
    plan_count_ = plans_.size();
  }
  const Plan& plan = it->second;
  const bool pipelined = IsPipelined(c.algorithm);
  size_t gathered_offset = 0;
  if (!pipelined) {
    if (c.gathered != nullptr) {  // before any collective: fails alike
      JCG_RETURN_IF_ERROR(
          GatheredOffset(c.layout, c.gathered_bytes, plan.device_bytes, &gathered_offset));
    }
    JCG_RETURN_IF_ERROR(EnsureWorkspace(plan.device_bytes, stream, deadline));
    if (host_workspace_.size() < plan.host_bytes) host_workspace_.resize(plan.host_bytes);
  }
  JCG_RETURN_IF_ERROR(WithComm([&]() -> Status {
    JCG_RETURN_IF_ERROR(Join(run, stream, event_in_.get()));
    return Enqueue(c, plan, gathered_offset, run);
  }));
  // The watchdog times the call up to here, its last operation on `run`.
  JCG_RETURN_IF_ERROR(tracker_.RecordCompletion(run, start));
  return Join(stream, run, event_out_.get());
}

}  // namespace jax_comm_gemm
