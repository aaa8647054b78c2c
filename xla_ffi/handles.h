// RAII owners for the CUDA, NCCL, cuBLASLt and cuBLASMp handles of a context. Each
// wrapper frees its handle exactly once; destroy errors are ignored because they
// only happen at shutdown, where nothing can be done about them. After an abort
// a context leaks its handles instead (release()): see Context::Abandon.
#ifndef JAX_COMM_GEMM_HANDLES_H_
#define JAX_COMM_GEMM_HANDLES_H_

#include <cstddef>
#include <memory>
#include <type_traits>
#include <utility>

#include <cublasLt.h>
#include <cublasmp.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "library_status.h"

namespace jax_comm_gemm {

template <typename Handle, auto Destroy>
struct Destroyer {
  void operator()(Handle h) const {
    if (h != nullptr) (void)Destroy(h);
  }
};

template <typename Handle, auto Destroy>
using Owned = std::unique_ptr<std::remove_pointer_t<Handle>, Destroyer<Handle, Destroy>>;

using NcclComm = Owned<ncclComm_t, ncclCommDestroy>;
using CudaStream = Owned<cudaStream_t, cudaStreamDestroy>;
using CudaEvent = Owned<cudaEvent_t, cudaEventDestroy>;
using DeviceBuffer = Owned<void*, cudaFree>;
using PinnedHostBuffer = Owned<void*, cudaFreeHost>;  // for copies that must not block the host
using CublasMpHandle = Owned<cublasMpHandle_t, cublasMpDestroy>;
using Grid = Owned<cublasMpGrid_t, cublasMpGridDestroy>;
using MatrixDescriptor = Owned<cublasMpMatrixDescriptor_t, cublasMpMatrixDescriptorDestroy>;
using MatmulDescriptor = Owned<cublasMpMatmulDescriptor_t, cublasMpMatmulDescriptorDestroy>;
using LtHandle = Owned<cublasLtHandle_t, cublasLtDestroy>;
using LtMatmulDesc = Owned<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>;
using LtLayout = Owned<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>;
using LtPreference = Owned<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>;
using LtTransformDesc = Owned<cublasLtMatrixTransformDesc_t, cublasLtMatrixTransformDescDestroy>;

// Device memory from cublasMpMalloc: allocated with ncclMemAlloc and registered
// with NCCL symmetric memory on both grids (as TransformerEngine does), which
// the overlapped algorithms need: without the registration cuBLASMp silently
// falls back to NO_OVERLAP. Allocation and release are collective.
class Workspace {
 public:
  Workspace() = default;
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  ~Workspace() { Release(); }

  // Frees any previous buffer, then allocates `size` bytes on `grid` and
  // registers them with `other_grid` too.
  Status Allocate(cublasMpGrid_t grid, cublasMpGrid_t other_grid, size_t size) {
    Release();
    void* ptr = nullptr;
    JCG_CUBLASMP(cublasMpMalloc(grid, &ptr, size));
    grid_ = grid;
    ptr_ = ptr;
    size_ = size;
    JCG_CUBLASMP(cublasMpBufferRegister(other_grid, ptr, size));
    other_grid_ = other_grid;
    return Status();
  }

  void Release() {
    if (other_grid_ != nullptr) (void)cublasMpBufferDeregister(other_grid_, ptr_);
    if (ptr_ != nullptr) (void)cublasMpFree(grid_, ptr_);
    ptr_ = nullptr;
    other_grid_ = nullptr;
    size_ = 0;
  }

  // Forgets the buffer without the collective free (after a peer failed).
  void Abandon() { ptr_ = nullptr, other_grid_ = nullptr, size_ = 0; }

  char* data() const { return static_cast<char*>(ptr_); }
  size_t size() const { return size_; }

 private:
  cublasMpGrid_t grid_ = nullptr;
  cublasMpGrid_t other_grid_ = nullptr;
  void* ptr_ = nullptr;
  size_t size_ = 0;
};

// Device memory that NCCL's symmetric collectives on one communicator address
// on every rank: ncclMemAlloc'd and registered as a window (NCCL then runs an
// AllGather on it with copy engines under the zero-CTA policy). Allocation and
// release are collective.
class SymmetricWindow {
 public:
  SymmetricWindow() = default;
  SymmetricWindow(const SymmetricWindow&) = delete;
  SymmetricWindow& operator=(const SymmetricWindow&) = delete;
  ~SymmetricWindow() { Release(); }

  Status Allocate(ncclComm_t comm, size_t size) {
    Release();
    void* ptr = nullptr;
    JCG_NCCL(ncclMemAlloc(&ptr, size));
    ptr_ = ptr;
    ncclWindow_t window = nullptr;
    JCG_NCCL(ncclCommWindowRegister(comm, ptr, size, &window, NCCL_WIN_COLL_SYMMETRIC));
    comm_ = comm, window_ = window, size_ = size;
    return Status();
  }

  void Release() {
    if (window_ != nullptr) (void)ncclCommWindowDeregister(comm_, window_);
    if (ptr_ != nullptr) (void)ncclMemFree(ptr_);
    Abandon();
  }

  // Forgets the buffer without the collective release (after a peer failed).
  void Abandon() { ptr_ = nullptr, window_ = nullptr, comm_ = nullptr, size_ = 0; }

  char* data() const { return static_cast<char*>(ptr_); }
  size_t size() const { return size_; }

 private:
  ncclComm_t comm_ = nullptr;
  ncclWindow_t window_ = nullptr;
  void* ptr_ = nullptr;
  size_t size_ = 0;
};

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_HANDLES_H_
