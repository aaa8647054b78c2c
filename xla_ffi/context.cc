// A group's resources on one device and the comm-GEMM call on them (context.h),
// the second half of a call's path, in order: set-up; the call (Run,
// RunLocked): the plan cache and its agreement across ranks, cuBLASMp's plan
// and its cublasMpMatmul (or pipelined_ce's, pipelined.cc), the collective
// buffers; then how a context fails: the watchdog's record of calls, Abort,
// Watch and Abandon.
#include "context.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace jax_comm_gemm {
namespace {

// Workspaces grow in steps of this size, so that shapes that change a little
// from step to step do not reallocate (a collective) every time.
constexpr size_t kWorkspaceGranule = size_t{32} << 20;

// How long Abort waits for a library call on the communicators to return
// before freeing them anyway: a call blocked for longer is what the abort is
// there for.
constexpr auto kAbortGrace = std::chrono::seconds(5);

size_t Granules(size_t bytes) {
  return (bytes + kWorkspaceGranule - 1) / kWorkspaceGranule * kWorkspaceGranule;
}

double SecondsBetween(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

// `waiter` waits for what `signaller` has enqueued so far.
Status Join(cudaStream_t waiter, cudaStream_t signaller, cudaEvent_t event) {
  JCG_CUDA(cudaEventRecord(event, signaller));
  JCG_CUDA(cudaStreamWaitEvent(waiter, event, 0));
  return Status();
}

Status CreateMatrix(int64_t m, int64_t n, int64_t mb, int64_t nb, int64_t lld,
                    cudaDataType_t type, cublasMpGrid_t grid, MatrixDescriptor* out) {
  cublasMpMatrixDescriptor_t desc = nullptr;
  JCG_CUBLASMP(cublasMpMatrixDescriptorCreate(m, n, mb, nb, 0, 0, lld, type, grid, &desc));
  out->reset(desc);
  return Status();
}

// FP8: points a plan's descriptor at the call's scales, which change from call
// to call. cuBLASMp's A is w, its B is x; the modes stay SCALAR_FP32.
Status PointScales(cublasMpMatmulDescriptor_t md, const MatmulCall& c) {
  JCG_RETURN_IF_ERROR(
      SetAttribute(md, CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_A_SCALE_POINTER, c.w_scale));
  return SetAttribute(md, CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_B_SCALE_POINTER, c.x_scale);
}

}  // namespace

Status CollectiveBuffer::AllocateCublasMp(cublasMpGrid_t grid, cublasMpGrid_t other_grid,
                                          size_t size) {
  Release();
  void* ptr = nullptr;
  JCG_CUBLASMP(cublasMpMalloc(grid, &ptr, size));
  ptr_ = ptr, size_ = size;
  release_ = [grid, ptr] { (void)cublasMpFree(grid, ptr); };
  JCG_CUBLASMP(cublasMpBufferRegister(other_grid, ptr, size));
  release_ = [grid, other_grid, ptr] {
    (void)cublasMpBufferDeregister(other_grid, ptr);
    (void)cublasMpFree(grid, ptr);
  };
  return Status();
}

Status CollectiveBuffer::AllocateWindow(ncclComm_t comm, size_t size) {
  Release();
  void* ptr = nullptr;
  JCG_NCCL(ncclMemAlloc(&ptr, size));
  ptr_ = ptr;
  release_ = [ptr] { (void)ncclMemFree(ptr); };
  ncclWindow_t window = nullptr;
  JCG_NCCL(ncclCommWindowRegister(comm, ptr, size, &window, NCCL_WIN_COLL_SYMMETRIC));
  size_ = size;
  release_ = [comm, window, ptr] {
    (void)ncclCommWindowDeregister(comm, window);
    (void)ncclMemFree(ptr);
  };
  return Status();
}

Status CollectiveBuffer::AllocatePlain(size_t size) {
  Release();
  void* ptr = nullptr;
  JCG_CUDA(cudaMalloc(&ptr, size));
  ptr_ = ptr, size_ = size;
  release_ = [ptr] { (void)cudaFree(ptr); };
  return Status();
}

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
  // The project's own collectives (barrier, plan agreement) on a communicator
  // of their own: comm_ is cuBLASMp's, and two operations of one communicator
  // must never run at once on different streams, which cuBLASMp's internal
  // streams would not rule out. pipelined_ce's on one with NCCL's zero-CTA
  // policy: on copy engines where NCCL can.
  ncclComm_t split = nullptr;
  r = ncclCommSplit(comm, 0, options_.rank, &split, nullptr);
  if (r != ncclSuccess) return NcclError("ncclCommSplit", r, comm);
  own_comm_.reset(split);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.CTAPolicy = NCCL_CTA_POLICY_ZERO;
  r = ncclCommSplit(comm, 0, options_.rank, &split, &config);
  if (r != ncclSuccess) return NcclError("ncclCommSplit", r, comm);
  ce_comm_.reset(split);
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
  JCG_RETURN_IF_ERROR(Barrier(stream_.get()));
  JCG_RETURN_IF_ERROR(EnqueueKeyExchange(PlanKey{}));
  JCG_CUDA(cudaStreamSynchronize(stream_.get()));
  // Whether cuBLASMp can get its workspace here: cublasMpMalloc registers it
  // with NCCL symmetric memory, which NCCL refuses where it cannot map the
  // peers' memory (ranks sharing a GPU, GPUs without peer access). Learnt
  // once, under connect()'s deadline. Where it is refused, the workspace is
  // plain device memory (workspace_mode() "plain"): cuBLASMp's default runs
  // there without overlap (an NCCL all-gather, then the GEMM; the same result
  // bit for bit as NCCL + cuBLAS, docs/design.md#the-plain-workspace-mode), and connect's verdict
  // tells routing which algorithms can run.
  const Status probe =
      workspace_.AllocateCublasMp(col_grid_.get(), row_grid_.get(), kWorkspaceGranule);
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

Status Context::Run(cudaStream_t stream, const MatmulCall& call) noexcept {
  return CatchExceptions("jax_comm_gemm", [&]() -> Status {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return Status::FailedPrecondition("jax_comm_gemm was shut down");
    if (aborted_) return AbortedStatus();
    const Clock::time_point start = Clock::now();
    {
      std::lock_guard<std::mutex> calls_lock(calls_mu_);
      host_since_ = start;
    }
    Status s = CatchExceptions("jax_comm_gemm", [&] { return RunLocked(stream, call, start); });
    {
      std::lock_guard<std::mutex> calls_lock(calls_mu_);
      host_since_.reset();
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

Status Context::RunLocked(cudaStream_t stream, const MatmulCall& c, Clock::time_point start) {
  const Clock::time_point deadline = start + call_timeout_;
  DeviceScope scope;
  JCG_RETURN_IF_ERROR(scope.Enter(options_.device));
  // The call runs on the context's own stream_, joined by events to XLA's
  // `stream`: after everything XLA enqueued before it and before anything XLA
  // enqueues after it (docs/design.md#ordering-against-xla-the-fence).
  // pipelined_ce needs no cross-rank barrier, but runs on stream_ too: XLA may
  // hand two calls different compute streams, and the calls of one context
  // share its scratch (cuBLASLt workspace, window, events), which one stream
  // keeps in order.
  cudaStream_t run = stream_.get();
  const PlanKey key = c.key();
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    JCG_RETURN_IF_ERROR(AgreeOnPlan(key, deadline));
    // Shapes churn: start over. Every rank agreed on every plan, so every
    // rank's cache is the same and all start over at the same call.
    if (plans_.size() >= kMaxPlans) plans_.clear();
    Plan plan;
    JCG_RETURN_IF_ERROR(MakePlan(c, stream, run, deadline, &plan));
    it = plans_.emplace(key, std::move(plan)).first;
    plan_count_ = plans_.size();
  }
  const Plan& plan = it->second;
  size_t gathered_offset = 0;
  if (!IsPipelined(c.algorithm)) {
    if (c.gathered != nullptr) {  // before any collective: fails alike
      JCG_RETURN_IF_ERROR(
          GatheredOffset(c.layout, c.gathered_bytes, plan.device_bytes, nranks(),
                         &gathered_offset));
    }
    JCG_RETURN_IF_ERROR(EnsureWorkspace(plan.device_bytes, stream, deadline));
    if (host_workspace_.size() < plan.host_bytes) host_workspace_.resize(plan.host_bytes);
  }
  JCG_RETURN_IF_ERROR(WithComm([&]() -> Status {
    JCG_RETURN_IF_ERROR(Join(run, stream, event_in_.get()));
    return Enqueue(c, plan, gathered_offset, run);
  }));
  // The watchdog times the call up to here, its last operation on `run`.
  JCG_RETURN_IF_ERROR(RecordCompletion(run, start));
  return Join(stream, run, event_out_.get());
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

Status Context::WaitForStreams(std::initializer_list<cudaStream_t> streams,
                               Clock::time_point deadline, const char* what) {
  for (cudaStream_t stream : streams) {
    JCG_CUDA(cudaEventRecord(host_wait_event_.get(), stream));
    const Status s = WaitForEvent(host_wait_event_.get(), deadline, aborted_);
    if (s.code() == Status::Code::kDeadlineExceeded) {
      return Status::DeadlineExceeded(PeerTimeout() + " while " + what);
    }
    if (s.code() == Status::Code::kAborted) return AbortedStatus();
    JCG_RETURN_IF_ERROR(s);
  }
  return Status();
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
//
// Two rounds. Over NCCL's network transport a peer's bytes can outlive the
// peer: one that sent its key and then gave up (its wait timed out, its
// communicator aborted) still completes this rank's first round from the
// socket's buffer, and this rank would go on to a call that the peer never
// joins. The second round carries only keys sent after a rank checked the
// first, so a peer that gave up in the first round fails it here, with NCCL's
// error or the deadline (docs/design.md#agreement-between-processes).
Status Context::AgreeOnPlan(const PlanKey& key, Clock::time_point deadline) {
  if (options_.nranks == 1) return Status();
  for (const char* round : {"the ranks agreed on a new plan",
                            "the ranks confirmed a new plan"}) {
    JCG_RETURN_IF_ERROR(WithComm([&] { return EnqueueKeyExchange(key); }));
    JCG_RETURN_IF_ERROR(WaitForStreams({stream_.get()}, deadline, round));
    // A departed peer can end the exchange's kernels early, without an error
    // from the wait: NCCL says so only through the asynchronous error.
    JCG_RETURN_IF_ERROR(WithComm([&] {
      const std::string error = AsyncNcclError();
      return error.empty() ? Status() : Status::Internal(error);
    }));
    const auto* gathered = static_cast<const unsigned char*>(keys_host_.get()) + kPlanKeyBytes;
    JCG_RETURN_IF_ERROR(CheckGatheredPlanKeys(gathered, options_.nranks));
  }
  return Status();
}

// Earlier calls on XLA's `stream` and on stream_ may still use the old buffer.
Status Context::EnsureWorkspace(size_t bytes, cudaStream_t stream, Clock::time_point deadline) {
  if (bytes <= workspace_.size()) return Status();
  JCG_RETURN_IF_ERROR(WaitForStreams({stream, stream_.get()}, deadline,
                                     "earlier calls finished before the workspace grew"));
  Status s = WithComm([&] {
    return workspace_error_.empty()
               ? workspace_.AllocateCublasMp(col_grid_.get(), row_grid_.get(), Granules(bytes))
               : workspace_.AllocatePlain(Granules(bytes));
  });
  CountBuffers();
  return s;
}

// Collective: every rank makes the plan that needs it at the same call. The
// calls that used the old window ran on stream_ and comm_stream_; XLA's
// `stream` is waited for too, which costs little at a growth this rare.
Status Context::EnsureWindow(size_t bytes, cudaStream_t stream, Clock::time_point deadline) {
  if (bytes <= window_.size()) return Status();
  JCG_RETURN_IF_ERROR(WaitForStreams({stream, stream_.get(), comm_stream_.get()}, deadline,
                                     "earlier calls finished before the window grew"));
  Status s = WithComm([&] { return window_.AllocateWindow(ce_comm_.get(), Granules(bytes)); });
  CountBuffers();
  return s;
}

Status Context::EnsureLtWorkspace() {
  if (lt_workspace_) return Status();
  void* ptr = nullptr;
  JCG_CUDA(cudaMalloc(&ptr, kLtWorkspaceBytes));
  lt_workspace_.reset(ptr);
  CountBuffers();
  return Status();
}

void Context::CountBuffers() {
  workspace_bytes_ = workspace_.size();
  own_buffer_bytes_ = (lt_workspace_ ? kLtWorkspaceBytes : 0) + window_.size();
}

// cuBLASMp's descriptors of `c` and its workspace sizes. cuBLASMp sees
// column-major matrices: a row-major [r, c] array is its [c, r] transpose. So
// y = x @ w becomes D = A * B with A = w^T, B = x^T, D = y^T, and the token
// dimension is cuBLASMp's n.
Status Context::MakeCublasMpPlan(const MatmulCall& c, Plan* plan) {
  // cuBLASMp returns NOT_SUPPORTED from cublasMpMatmul for SPLIT_P2P on a plain
  // workspace (measured: docs/design.md#the-plain-workspace-mode): refused here, after the
  // plan agreement and before any collective, so alike on every rank.
  if (!workspace_error_.empty() && c.algorithm == CUBLASMP_MATMUL_ALGO_TYPE_SPLIT_P2P) {
    return Status::FailedPrecondition(
        "cuBLASMp's split_p2p cannot run on a plain workspace (no NCCL symmetric memory: "
        "cuBLASMp's default runs without overlap; " + workspace_error_ + ")");
  }
  const int64_t P = options_.nranks;
  cublasMpGrid_t col = col_grid_.get(), row = row_grid_.get();
  const cudaDataType_t tw = c.w_type, tx = c.x_type, ty = c.y_type;
  if (c.op == CommOp::kAllGather) {
    // x [n/P, k] is B (k x n, columns split); y [n, m/P] is D (m x n, rows split).
    const int64_t nl = c.x_rows, k = c.x_cols;
    const int64_t ml = c.transpose_w ? c.w_rows : c.w_cols;
    plan->m = ml * P, plan->n = nl * P, plan->k = k;
    if (c.transpose_w) {  // w [m/P, k] is op(A) = A^T with A k x m, columns split.
      JCG_RETURN_IF_ERROR(CreateMatrix(k, plan->m, k, ml, k, tw, row, &plan->a));
    } else {  // w [k, m/P] is A (m x k), rows split.
      JCG_RETURN_IF_ERROR(CreateMatrix(plan->m, k, ml, k, ml, tw, col, &plan->a));
    }
    JCG_RETURN_IF_ERROR(CreateMatrix(k, plan->n, k, nl, k, tx, row, &plan->b));
    JCG_RETURN_IF_ERROR(CreateMatrix(plan->m, plan->n, ml, nl, ml, ty, col, &plan->d));
  } else {
    // x [n, k/P] is B (k x n, rows split); y [n/P, m] is D (m x n, columns split).
    const int64_t n = c.x_rows, kl = c.x_cols, nl = n / P;
    const int64_t m = c.transpose_w ? c.w_rows : c.w_cols;
    plan->m = m, plan->n = n, plan->k = kl * P;
    if (c.transpose_w) {  // w [m, k/P] is op(A) = A^T with A k x m, rows split.
      JCG_RETURN_IF_ERROR(CreateMatrix(plan->k, m, kl, m, kl, tw, col, &plan->a));
    } else {  // w [k/P, m] is A (m x k), columns split.
      JCG_RETURN_IF_ERROR(CreateMatrix(m, plan->k, m, kl, m, tw, row, &plan->a));
    }
    JCG_RETURN_IF_ERROR(CreateMatrix(plan->k, n, kl, nl, kl, tx, col, &plan->b));
    JCG_RETURN_IF_ERROR(CreateMatrix(m, n, m, nl, m, ty, row, &plan->d));
  }
  cublasMpMatmulDescriptor_t md = nullptr;
  JCG_CUBLASMP(cublasMpMatmulDescriptorCreate(&md, CUBLAS_COMPUTE_32F));
  plan->matmul.reset(md);
  const cublasOperation_t trans_a = c.transpose_w ? CUBLAS_OP_T : CUBLAS_OP_N;
  JCG_RETURN_IF_ERROR(SetAttribute(md, CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_TRANSA, trans_a));
  JCG_RETURN_IF_ERROR(SetAttribute(md, CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_TRANSB, CUBLAS_OP_N));
  JCG_RETURN_IF_ERROR(SetAttribute(md, CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_ALGO_TYPE,
                                   static_cast<cublasMpMatmulAlgoType_t>(c.algorithm)));
  if (c.op == CommOp::kReduceScatter) {
    // Partial sums travel in the output type, as XLA's psum_scatter does.
    JCG_RETURN_IF_ERROR(
        SetAttribute(md, CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_COMMUNICATION_TYPE, ty));
  }
  if (c.fp8()) JCG_RETURN_IF_ERROR(PointScales(md, c));
  const float alpha = 1.0f, beta = 0.0f;
  JCG_CUBLASMP(cublasMpMatmul_bufferSize(
      handle_.get(), md, plan->m, plan->n, plan->k, &alpha, c.w, 1, 1, plan->a.get(), c.x, 1, 1,
      plan->b.get(), &beta, nullptr, 1, 1, nullptr, c.y, 1, 1, plan->d.get(),
      &plan->device_bytes, &plan->host_bytes));
  return Status();
}

Status Context::MakePlan(const MatmulCall& c, cudaStream_t stream, cudaStream_t run,
                         Clock::time_point deadline, Plan* plan) {
  if (!IsPipelined(c.algorithm)) return WithComm([&] { return MakeCublasMpPlan(c, plan); });
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
    trial.wait = [&] { return WaitForStreams({run}, deadline, "cuBLASLt's candidate GEMMs ran"); };
  }
  JCG_RETURN_IF_ERROR(MakePipelinedPlan(lt_.get(), c, options_.nranks, kLtWorkspaceBytes,
                                        options_.time_gemms ? &trial : nullptr,
                                        &plan->pipelined));
  return EnsureWindow(WindowBytes(plan->pipelined, options_.nranks), stream, deadline);
}

Status Context::Enqueue(const MatmulCall& c, const Plan& plan, size_t gathered_offset,
                        cudaStream_t run) {
  if (IsPipelined(c.algorithm)) {
    const PipelineTarget target{lt_.get(),        comm_stream_.get(), started_.get(),
                                arrived_.data(),  computed_.data(),   ce_comm_.get(),
                                window_.data(),   lt_workspace_.get(), kLtWorkspaceBytes,
                                options_.rank,    options_.nranks};
    return EnqueuePipelined(target, plan.pipelined, c, run);
  }
  JCG_CUBLASMP(cublasMpSetStream(handle_.get(), run));
  if (c.fp8()) JCG_RETURN_IF_ERROR(PointScales(plan.matmul.get(), c));
  const float alpha = 1.0f, beta = 0.0f;
  JCG_CUBLASMP(cublasMpMatmul(
      handle_.get(), plan.matmul.get(), plan.m, plan.n, plan.k, &alpha, c.w, 1, 1,
      plan.a.get(), c.x, 1, 1, plan.b.get(), &beta, nullptr, 1, 1, nullptr, c.y, 1, 1,
      plan.d.get(), workspace_.data(), plan.device_bytes, host_workspace_.data(),
      plan.host_bytes));
  if (c.gathered != nullptr) {
    JCG_CUDA(cudaMemcpyAsync(c.gathered, workspace_.data() + gathered_offset, c.gathered_bytes,
                             cudaMemcpyDeviceToDevice, run));
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

// Calls finish in the order they were enqueued (on one stream), so the first
// one not finished ends the sweep: one query per call, not one per call in
// flight.
void Context::ReapLocked() {
  while (!pending_.empty() && cudaEventQuery(pending_.front().event.get()) == cudaSuccess) {
    spare_.push_back(std::move(pending_.front().event));
    pending_.pop_front();
  }
}

Status Context::RecordCompletion(cudaStream_t stream, Clock::time_point enqueued) {
  std::lock_guard<std::mutex> lock(calls_mu_);
  ReapLocked();  // recycles events between the watchdog's polls
  CudaEvent event;
  if (!spare_.empty()) {
    event = std::move(spare_.back());
    spare_.pop_back();
  } else {
    cudaEvent_t e = nullptr;
    JCG_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    event.reset(e);
  }
  const cudaError_t e = cudaEventRecord(event.get(), stream);
  if (e != cudaSuccess) {
    spare_.push_back(std::move(event));
    return CudaError("cudaEventRecord", e);
  }
  pending_.push_back({std::move(event), enqueued});
  return Status();
}

// Why the context must be aborted, if it must: DeadlineExceeded naming the call
// that has outlived the call timeout, or Internal with the CUDA error an event
// reports. On the events' device.
std::optional<Status> Context::CheckCalls(Clock::time_point now) {
  std::lock_guard<std::mutex> lock(calls_mu_);
  if (host_since_ && now - *host_since_ > call_timeout_) {
    return Status::DeadlineExceeded("a call has been blocked on the host for " +
                                    FormatSeconds(SecondsBetween(*host_since_, now)));
  }
  ReapLocked();
  for (const Pending& p : pending_) {
    const cudaError_t e = cudaEventQuery(p.event.get());
    if (e != cudaSuccess && e != cudaErrorNotReady) {
      return Status::Internal("CUDA reported an error for a call: " + CudaErrorDetail(e));
    }
    if (e == cudaErrorNotReady && now - p.enqueued > call_timeout_) {
      return Status::DeadlineExceeded("a call enqueued " +
                                      FormatSeconds(SecondsBetween(p.enqueued, now)) +
                                      " ago has not completed");
    }
  }
  return std::nullopt;
}

void Context::Abandon() noexcept {
  // The peers are gone or out of step, and the device may be stuck waiting for
  // them: keep nothing whose release is collective or waits for the device.
  for (auto& [key, plan] : plans_) {
    (void)plan.a.release(), (void)plan.b.release(), (void)plan.d.release();
    (void)plan.matmul.release();
  }
  workspace_.Abandon();
  window_.Abandon();
  {
    std::lock_guard<std::mutex> lock(calls_mu_);
    for (Pending& p : pending_) (void)p.event.release();
    for (CudaEvent& e : spare_) (void)e.release();
    pending_.clear(), spare_.clear();
  }
  (void)keys_host_.release(), (void)keys_device_.release(), (void)barrier_word_.release();
  (void)host_wait_event_.release(), (void)event_out_.release(), (void)event_in_.release();
  (void)row_grid_.release(), (void)col_grid_.release(), (void)handle_.release();
  (void)lt_workspace_.release(), (void)started_.release(), (void)comm_stream_.release();
  for (CudaEvent& e : arrived_) (void)e.release();
  for (CudaEvent& e : computed_) (void)e.release();
  (void)lt_.release(), (void)stream_.release();
  // Already freed by ncclCommAbort.
  (void)ce_comm_.release(), (void)own_comm_.release(), (void)comm_.release();
}

void Context::Abort(const std::string& reason) noexcept {
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    if (aborted_) return;
    try {
      error_ = reason;
    } catch (...) {
      error_.clear();  // still abort, without the reason
    }
    aborted_ = true;
  }
  std::unique_lock<std::shared_timed_mutex> lock(comm_lock_, std::defer_lock);
  (void)lock.try_lock_for(kAbortGrace);
  // One NCCL group: each ncclCommAbort raises its communicator's abort flag at
  // once and frees it only at ncclGroupEnd, after every flag is up. Aborted one
  // by one, freeing an idle communicator waited for the device, where a kernel
  // of the next one (not yet told to quit) waited for the dead peer, and the
  // survivor of a killed rank stayed stuck in its abort
  // (docs/design.md#failures-become-errors).
  (void)ncclGroupStart();
  for (ncclComm_t comm : {ce_comm_.get(), own_comm_.get(), comm_.get()}) {
    if (comm != nullptr) (void)ncclCommAbort(comm);
  }
  (void)ncclGroupEnd();
}

std::string Context::error() const {
  std::lock_guard<std::mutex> lock(state_mu_);
  return error_;
}

std::string Context::Where() const {
  return "group " + std::to_string(options_.group) + ", device " +
         std::to_string(options_.device) + ", rank " + std::to_string(options_.rank) + " of " +
         std::to_string(options_.nranks);
}

std::string Context::PeerTimeout() const {
  return "a peer did not answer within " + FormatSeconds(options_.call_timeout_s) +
         " (JAX_COMM_GEMM_TIMEOUT)";
}

Status Context::AbortedStatus() const {
  return Status::Aborted("jax_comm_gemm: the tensor-parallel group's communicator was aborted: " +
                         error() + " (" + Where() + ")");
}

Status Context::AbortFor(Status error) noexcept {
  return CatchExceptions("jax_comm_gemm", [&]() -> Status {
    if (aborted_) return AbortedStatus();  // the first failure is the one to report
    Abort(error.message());
    error.message() = "jax_comm_gemm: " + error.message() + " (" + Where() +
                      "; the group's communicator was aborted, later calls fail)";
    return std::move(error);
  });
}

std::string Context::AsyncNcclError() const {
  for (ncclComm_t comm : {comm_.get(), own_comm_.get(), ce_comm_.get()}) {
    if (comm == nullptr) continue;
    ncclResult_t async = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &async);
    if (r != ncclSuccess) async = r;
    if (async != ncclSuccess && async != ncclInProgress) {
      return "NCCL reported an asynchronous error: " + NcclErrorDetail(async, comm);
    }
  }
  return std::string();
}

void Context::Watch(Clock::time_point now) noexcept {
  try {
    if (aborted_ || closed_) return;
    std::string reason;
    {
      std::shared_lock<std::shared_timed_mutex> lock(comm_lock_);
      if (aborted_) return;
      reason = AsyncNcclError();
    }
    if (reason.empty()) {
      DeviceScope scope;
      if (!scope.Enter(options_.device).ok()) return;
      std::optional<Status> stall = CheckCalls(now);
      if (!stall) return;
      reason = stall->code() == Status::Code::kDeadlineExceeded
                   ? PeerTimeout() + ": " + stall->message()
                   : stall->message();
    }
    Abort(reason);
  } catch (...) {
    // Out of memory for a message: try again at the next poll.
  }
}

}  // namespace jax_comm_gemm
