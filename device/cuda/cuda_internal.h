// Internals shared by the CUDA backends (cuda_device.cc, kernels.cu, nccl_comm.cc): the stream
// type behind CudaDevice streams and the CUDA error check. Not installed.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <mutex>
#include <string>

#include "common/thread_annotations.h"
#include "zinf/device.h"
#include "zinf/status.h"

namespace zinf::cuda_internal {

// A CUDA error as a Status naming the call, where it was made and CUDA's description:
// "cudaMemcpyAsync(dst, src, bytes, kind, s) failed at device/cuda/cuda_device.cc:123:
// out of memory (cudaErrorMemoryAllocation)". cudaErrorMemoryAllocation -> ResourceExhausted,
// a bad value or handle -> InvalidArgument, no device or driver -> NotSupported, else Internal.
Status CudaCallStatus(cudaError_t err, const char* call, const char* file, int line);

// Makes `device` current on the calling thread (the CUDA runtime's current device is
// per thread; streams and kernels must be used with their device current).
Status MakeCurrent(int device);

// Per-stream scratch for the reductions (SumSquares): partial sums of its fixed grid, the
// result, and a pinned host staging copy of the result.
inline constexpr int kReduceBlocks = 1024;
inline constexpr int kReduceThreads = 256;
struct ReduceScratch {
  double partial_sum[kReduceBlocks];
  int partial_nonfinite[kReduceBlocks];
  double sum;
  int nonfinite;
};

class CudaStream final : public Stream {
 public:
  CudaStream(const void* owner, int device, std::string name)
      : owner_(owner), device_(device), name_(std::move(name)) {}
  ~CudaStream() override;  // destroys the stream (after it drains) and frees the scratch

  // Creates the CUDA stream and the scratch. REQUIRES: `device` is current.
  Status Init();
  // Uses an existing stream (not owned: never destroyed) and creates the scratch.
  Status InitExternal(cudaStream_t handle);

  const std::string& name() const override { return name_; }
  const void* owner() const { return owner_; }
  int device() const { return device_; }
  cudaStream_t handle() const { return handle_; }
  ReduceScratch* scratch() const { return scratch_; }  // device memory
  ReduceScratch* staging() const { return staging_; }  // pinned host memory

  // The sticky error of host functions (an exception escaping LaunchHostFunc's function, a
  // failed LaunchHostTask, a collective the NCCL watchdog aborted): the first one is kept.
  void SetError(const Status& s) {
    MutexLock lock(&mu_);
    if (error_.ok() && !s.ok()) error_ = s.WithContext("stream '" + name_ + "'");
  }
  Status error() const {
    MutexLock lock(&mu_);
    return error_;
  }

 private:
  const void* const owner_;
  const int device_;
  const std::string name_;
  cudaStream_t handle_ = nullptr;
  bool owned_ = true;
  ReduceScratch* scratch_ = nullptr;
  ReduceScratch* staging_ = nullptr;
  mutable Mutex mu_;
  Status error_ GUARDED_BY(mu_);
};

// `stream` as a CudaStream, or InvalidArgument naming `what` (the calling operation).
Result<CudaStream*> AsCudaStream(Stream* stream, const char* what);

}  // namespace zinf::cuda_internal

#define ZINF_CUDA_CHECK(expr)                                                                  \
  do {                                                                                         \
    const cudaError_t zinf_cuda_err_ = (expr);                                                 \
    if (zinf_cuda_err_ != cudaSuccess) {                                                       \
      return ::zinf::cuda_internal::CudaCallStatus(zinf_cuda_err_, #expr, __FILE__, __LINE__); \
    }                                                                                          \
  } while (0)
