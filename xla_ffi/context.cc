#include "context.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>

namespace jax_comm_gemm {
namespace {

// Workspaces grow in steps of this size, so that shapes that change a little
// from step to step do not reallocate (a collective) every time.
constexpr size_t kWorkspaceGranule = size_t{32} << 20;
// cuBLASMp 0.10 ends the gathered operand this many bytes before the end of
// its workspace (measured, see DESIGN.md).
constexpr size_t kTailPadding = 16;

// cudaSetDevice for the current thread, restored on scope exit.
class DeviceScope {
 public:
  Status Enter(int device) {
    JCG_CUDA(cudaGetDevice(&previous_));
    if (previous_ != device) JCG_CUDA(cudaSetDevice(device));
    entered_ = true;
    return Status();
  }
  ~DeviceScope() {
    int now = -1;
    if (entered_ && cudaGetDevice(&now) == cudaSuccess && now != previous_) {
      (void)cudaSetDevice(previous_);
    }
  }

 private:
  int previous_ = -1;
  bool entered_ = false;
};

template <typename T>
Status SetAttribute(cublasMpMatmulDescriptor_t desc, cublasMpMatmulDescriptorAttribute_t attr,
                    const T& value) {
  JCG_CUBLASMP(cublasMpMatmulDescriptorSetAttribute(desc, attr, &value, sizeof(value)));
  return Status();
}

Status CreateMatrix(int64_t m, int64_t n, int64_t mb, int64_t nb, int64_t lld,
                    cudaDataType_t type, cublasMpGrid_t grid, MatrixDescriptor* out) {
  cublasMpMatrixDescriptor_t desc = nullptr;
  JCG_CUBLASMP(cublasMpMatrixDescriptorCreate(m, n, mb, nb, 0, 0, lld, type, grid, &desc));
  out->reset(desc);
  return Status();
}

}  // namespace

const std::vector<std::pair<std::string, Fence>>& FenceNames() {
  static const auto* names = new std::vector<std::pair<std::string, Fence>>{
      {"isolated", Fence::kIsolated}, {"own_stream", Fence::kOwnStream},
      {"barrier", Fence::kBarrier},   {"host", Fence::kHost},
      {"none", Fence::kNone},
  };
  return *names;
}

Status ParseFence(const std::string& name, Fence* out) {
  std::string known;
  for (const auto& [n, fence] : FenceNames()) {
    if (n == name) {
      *out = fence;
      return Status();
    }
    known += (known.empty() ? "" : ", ") + n;
  }
  return Status::InvalidArgument("'" + name + "' is not a fence; use one of " + known);
}

Status Context::Create(int device, const ncclUniqueId& id, int nranks, int rank, Fence fence,
                       std::unique_ptr<Context>* out) {
  DeviceScope scope;
  JCG_RETURN_IF_ERROR(scope.Enter(device));
  std::unique_ptr<Context> ctx(new Context(device, nranks, rank, fence));
  Status status = ctx->Init(id);
  if (!status.ok()) {
    ctx->Abort();
    return status;
  }
  *out = std::move(ctx);
  return Status();
}

Status Context::Init(const ncclUniqueId& id) {
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRank(&comm, nranks_, id, rank_);
  if (r != ncclSuccess) return NcclError("ncclCommInitRank", r, comm);
  comm_.reset(comm);
  cudaStream_t stream = nullptr;
  JCG_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  stream_.reset(stream);
  cublasMpHandle_t handle = nullptr;
  JCG_CUBLASMP(cublasMpCreate(&handle, stream));
  handle_.reset(handle);
  cublasMpGrid_t grid = nullptr;
  JCG_CUBLASMP(cublasMpGridCreate(nranks_, 1, CUBLASMP_GRID_LAYOUT_COL_MAJOR, comm, &grid));
  col_grid_.reset(grid);
  JCG_CUBLASMP(cublasMpGridCreate(1, nranks_, CUBLASMP_GRID_LAYOUT_ROW_MAJOR, comm, &grid));
  row_grid_.reset(grid);
  for (CudaEvent* e : {&event_in_, &event_out_}) {
    cudaEvent_t event = nullptr;
    JCG_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    e->reset(event);
  }
  void* word = nullptr;
  JCG_CUDA(cudaMalloc(&word, sizeof(float)));
  barrier_word_.reset(word);
  JCG_CUDA(cudaMemset(word, 0, sizeof(float)));
  return Status();
}

Status Context::Barrier(cudaStream_t stream) {
  ncclResult_t r = ncclAllReduce(barrier_word_.get(), barrier_word_.get(), 1, ncclFloat32,
                                 ncclSum, comm_.get(), stream);
  if (r != ncclSuccess) return NcclError("ncclAllReduce", r, comm_.get());
  return Status();
}

Status Context::Join(cudaStream_t waiter, cudaStream_t signaller, cudaEvent_t event) {
  JCG_CUDA(cudaEventRecord(event, signaller));
  JCG_CUDA(cudaStreamWaitEvent(waiter, event, 0));
  return Status();
}

Context::~Context() {
  // In-flight work may still read the workspace; members are destroyed on this device.
  if (cudaSetDevice(device_) == cudaSuccess) (void)cudaDeviceSynchronize();
}

void Context::Abort() {
  std::lock_guard<std::mutex> lock(mu_);
  workspace_.Abandon();
  // Grid destruction is collective and its peers are gone: leak the grids.
  (void)col_grid_.release();
  (void)row_grid_.release();
  if (comm_) (void)ncclCommAbort(comm_.release());
}

size_t Context::workspace_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return workspace_.size();
}

size_t Context::plan_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return plans_.size();
}

// cuBLASMp sees column-major matrices: a row-major [r, c] array is its [c, r]
// transpose. So y = x @ w becomes D = A * B with A = w^T, B = x^T, D = y^T, and
// the token dimension is cuBLASMp's n.
Status Context::MakePlan(const MatmulCall& c, Plan* plan) const {
  const int64_t P = nranks_;
  const cudaDataType_t t = c.dtype;
  cublasOperation_t trans_a = c.transpose_w ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (c.op == CommOp::kAllGather) {
    // x [n/P, k] is B (k x n, columns split); y [n, m/P] is D (m x n, rows split).
    const int64_t nl = c.x_rows, k = c.x_cols;
    const int64_t ml = c.transpose_w ? c.w_rows : c.w_cols;
    plan->m = ml * P, plan->n = nl * P, plan->k = k;
    if (c.transpose_w) {  // w [m/P, k] is op(A) = A^T with A k x m, columns split.
      JCG_RETURN_IF_ERROR(CreateMatrix(k, plan->m, k, ml, k, t, row_grid_.get(), &plan->a));
    } else {  // w [k, m/P] is A (m x k), rows split.
      JCG_RETURN_IF_ERROR(CreateMatrix(plan->m, k, ml, k, ml, t, col_grid_.get(), &plan->a));
    }
    JCG_RETURN_IF_ERROR(CreateMatrix(k, plan->n, k, nl, k, t, row_grid_.get(), &plan->b));
    JCG_RETURN_IF_ERROR(CreateMatrix(plan->m, plan->n, ml, nl, ml, t, col_grid_.get(), &plan->d));
  } else {
    // x [n, k/P] is B (k x n, rows split); y [n/P, m] is D (m x n, columns split).
    const int64_t n = c.x_rows, kl = c.x_cols, nl = n / P;
    const int64_t m = c.transpose_w ? c.w_rows : c.w_cols;
    plan->m = m, plan->n = n, plan->k = kl * P;
    if (c.transpose_w) {  // w [m, k/P] is op(A) = A^T with A k x m, rows split.
      JCG_RETURN_IF_ERROR(CreateMatrix(plan->k, m, kl, m, kl, t, col_grid_.get(), &plan->a));
    } else {  // w [k/P, m] is A (m x k), columns split.
      JCG_RETURN_IF_ERROR(CreateMatrix(m, plan->k, m, kl, m, t, row_grid_.get(), &plan->a));
    }
    JCG_RETURN_IF_ERROR(CreateMatrix(plan->k, n, kl, nl, kl, t, col_grid_.get(), &plan->b));
    JCG_RETURN_IF_ERROR(CreateMatrix(m, n, m, nl, m, t, row_grid_.get(), &plan->d));
  }
  cublasMpMatmulDescriptor_t md = nullptr;
  JCG_CUBLASMP(cublasMpMatmulDescriptorCreate(&md, CUBLAS_COMPUTE_32F));
  plan->matmul.reset(md);
  const cublasOperation_t trans_b = CUBLAS_OP_N;
  JCG_RETURN_IF_ERROR(SetAttribute(md, CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_TRANSA, trans_a));
  JCG_RETURN_IF_ERROR(SetAttribute(md, CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_TRANSB, trans_b));
  JCG_RETURN_IF_ERROR(SetAttribute(md, CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_ALGO_TYPE, c.algorithm));
  if (c.op == CommOp::kReduceScatter) {
    // Partial sums travel in the output type, as XLA's psum_scatter does.
    JCG_RETURN_IF_ERROR(SetAttribute(md, CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_COMMUNICATION_TYPE, t));
  }
  const float alpha = 1.0f, beta = 0.0f;
  JCG_CUBLASMP(cublasMpMatmul_bufferSize(
      handle_.get(), md, plan->m, plan->n, plan->k, &alpha, c.w, 1, 1, plan->a.get(), c.x, 1, 1,
      plan->b.get(), &beta, nullptr, 1, 1, nullptr, c.y, 1, 1, plan->d.get(),
      &plan->device_bytes, &plan->host_bytes));
  return Status();
}

Status Context::EnsureWorkspace(size_t bytes, cudaStream_t stream) {
  if (bytes <= workspace_.size()) return Status();
  // Earlier calls on these streams may still use the old buffer.
  JCG_CUDA(cudaStreamSynchronize(stream));
  JCG_CUDA(cudaStreamSynchronize(stream_.get()));
  const size_t rounded = (bytes + kWorkspaceGranule - 1) / kWorkspaceGranule * kWorkspaceGranule;
  return workspace_.Allocate(col_grid_.get(), row_grid_.get(), rounded);
}

Status Context::CopyGathered(const MatmulCall& c, const Plan& plan, cudaStream_t stream) const {
  size_t offset = 0;
  if (c.layout == GatheredLayout::kTail) {
    if (c.gathered_bytes + kTailPadding > plan.device_bytes) {
      return Status::FailedPrecondition(
          "the gathered operand (" + std::to_string(c.gathered_bytes) +
          " bytes) cannot sit at the tail of a " + std::to_string(plan.device_bytes) +
          "-byte cuBLASMp workspace; the 'tail' layout does not hold here");
    }
    offset = plan.device_bytes - c.gathered_bytes - kTailPadding;
  } else if (c.gathered_bytes > plan.device_bytes) {
    return Status::FailedPrecondition(
        "the gathered operand (" + std::to_string(c.gathered_bytes) +
        " bytes) is larger than the " + std::to_string(plan.device_bytes) +
        "-byte cuBLASMp workspace; the 'front' layout does not hold here");
  }
  JCG_CUDA(cudaMemcpyAsync(c.gathered, workspace_.data() + offset, c.gathered_bytes,
                           cudaMemcpyDeviceToDevice, stream));
  return Status();
}

Status Context::Run(cudaStream_t stream, const MatmulCall& c) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!comm_) return Status::FailedPrecondition("this cuBLASMp context was aborted");
  DeviceScope scope;
  JCG_RETURN_IF_ERROR(scope.Enter(device_));
  const PlanKey key{c.op,     static_cast<int>(c.dtype), c.transpose_w, static_cast<int>(c.algorithm),
                    c.x_rows, c.x_cols,                   c.w_rows,      c.w_cols};
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    if (plans_.size() >= kMaxPlans) plans_.clear();  // shapes churn: start over
    Plan plan;
    JCG_RETURN_IF_ERROR(MakePlan(c, &plan));
    it = plans_.emplace(key, std::move(plan)).first;
  }
  const Plan& plan = it->second;
  JCG_RETURN_IF_ERROR(EnsureWorkspace(plan.device_bytes, stream));
  if (host_workspace_.size() < plan.host_bytes) host_workspace_.resize(plan.host_bytes);
  // Under kIsolated and kOwnStream, cuBLASMp runs on stream_, after everything
  // XLA enqueued before the call and before anything XLA enqueues after it.
  const bool own = fence_ == Fence::kIsolated || fence_ == Fence::kOwnStream;
  cudaStream_t run = own ? stream_.get() : stream;
  if (own) JCG_RETURN_IF_ERROR(Join(run, stream, event_in_.get()));
  JCG_CUBLASMP(cublasMpSetStream(handle_.get(), run));
  const float alpha = 1.0f, beta = 0.0f;
  JCG_CUBLASMP(cublasMpMatmul(
      handle_.get(), plan.matmul.get(), plan.m, plan.n, plan.k, &alpha, c.w, 1, 1, plan.a.get(),
      c.x, 1, 1, plan.b.get(), &beta, nullptr, 1, 1, nullptr, c.y, 1, 1, plan.d.get(),
      workspace_.data(), plan.device_bytes, host_workspace_.data(), plan.host_bytes));
  if (c.op == CommOp::kAllGather && c.gathered != nullptr) {
    JCG_RETURN_IF_ERROR(CopyGathered(c, plan, run));
  }
  // The barrier keeps a peer's next call off this rank's workspace until the
  // gathered copy above, which cuBLASMp does not know about, has read it.
  if (fence_ == Fence::kIsolated || fence_ == Fence::kBarrier) {
    JCG_RETURN_IF_ERROR(Barrier(run));
  }
  if (own) JCG_RETURN_IF_ERROR(Join(stream, run, event_out_.get()));
  if (fence_ == Fence::kHost) JCG_CUDA(cudaStreamSynchronize(stream));
  return Status();
}

}  // namespace jax_comm_gemm
