// CudaDevice: the Device seam on a CUDA GPU (see zinf/cuda.h for the contract). Not installed;
// users create one with NewCudaDevice.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/thread_annotations.h"
#include "device/cuda/cuda_internal.h"
#include "device/device_pool.h"
#include "zinf/cuda.h"
#include "zinf/device.h"
#include "zinf/status.h"

namespace zinf {

// Every allocation starts on this boundary (cudaMalloc's own alignment).
inline constexpr size_t kCudaDeviceAlignment = 256;

class CudaDevice final : public Device {
 public:
  // Use Create. Reserves the pool; fails like NewCudaDevice.
  static Result<std::unique_ptr<CudaDevice>> Create(const CudaDeviceOptions& options);
  // Waits for every stream to drain, destroys them and releases the pool. REQUIRES: no other
  // thread uses the device; allocations still live are released with it.
  ~CudaDevice() override;
  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  std::string Name() const override;
  DeviceCaps Caps() const override {
    DeviceCaps c;
    // cuda::AdamStep: Adam and AdamW with fp32 states; it writes the updated parameters into
    // their device stores.
    c.step_kinds = DeviceCaps::Kind(OptimizerKind::kAdam) | DeviceCaps::Kind(OptimizerKind::kAdamW);
    c.step_needs_device_params = true;
    return c;
  }
  int ordinal() const { return ordinal_; }

  // `bytes` (exactly) count against the budget; Alloc(0) returns a unique pointer counting
  // nothing. ResourceExhausted naming the budget and use, or fragmentation of the pool.
  Result<void*> Alloc(size_t bytes) override;
  // REQUIRES: ptr came from Alloc on this device (checked) and no queued work uses it.
  void Free(void* ptr) override;
  DeviceMemoryInfo MemoryInfo() const override;
  // With the driver's virtual memory management (every GPU of the last decade): unmaps and
  // releases the pool's free chunks, so cudaMemGetInfo (and torch) sees them free. Without
  // it the pool is one cudaMalloc and nothing is given back.
  Status TrimMemory() override;
  // Backs the whole pool again (as at creation): reload_states, so that a step never finds
  // its memory taken by another library while the states were offloaded.
  Status RestoreMemory() override;

  Stream* ComputeStream() override;
  Result<Stream*> CreateStream(const std::string& name) override;

  Status CopyHostToDevice(void* dst, const void* src, size_t bytes, Stream* stream) override;
  Status CopyDeviceToHost(void* dst, const void* src, size_t bytes, Stream* stream) override;
  Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes, Stream* stream) override;
  Status LaunchHostFunc(Stream* stream, std::function<void()> fn) override;
  // Like LaunchHostFunc for work that can fail: a non-OK result becomes the stream's sticky
  // error (reported by SynchronizeStream). `task` must not call CUDA (cudaLaunchHostFunc).
  Status LaunchHostTask(Stream* stream, std::function<Status()> task);

  Result<std::unique_ptr<Event>> CreateEvent() override;
  Status RecordEvent(Event* event, Stream* stream) override;
  Status StreamWaitEvent(Stream* stream, Event* event) override;
  Status SynchronizeEvent(Event* event) override;
  // A CUDA error while querying counts as done (SynchronizeEvent then reports it).
  // REQUIRES: `event` is a CudaDevice event (checked).
  bool EventDone(Event* event) override;
  // cudaStreamSynchronize, then the stream's sticky host-function error.
  Status SynchronizeStream(Stream* stream) override;

  Status RegisterHostMemory(void* ptr, size_t bytes) override;
  Status UnregisterHostMemory(void* ptr) override;

  // The kernels of zinf/cuda.h on `stream` (a stream of this device): cuda::CastF32ToBf16,
  // cuda::Add, cuda::SumSquares, cuda::AdamStep.
  Status ConvertToBf16(uint16_t* dst, const float* src, size_t n, Stream* stream) override;
  Status AddInto(float* dst, const float* src, size_t n, Stream* stream) override;
  Status QuantizeInt8(void* dst, const void* src, ParamCopyType type, size_t n, size_t block,
                      Stream* stream) override;
  Status DequantizeInt8(void* dst, ParamCopyType type, const void* src, size_t n, size_t block,
                        Stream* stream) override;
  Status QuantizeInt4(void* dst, const float* src, size_t n, size_t block, Stream* stream) override;
  Status DequantizeInt4(float* dst, const void* src, size_t n, size_t block,
                        Stream* stream) override;
  Status SumSquares(const float* x, size_t n, GradStats* out_host, Stream* stream) override;
  Status OptimizerStep(const OptimizerHyperParams& hp, const OptimizerTensors& t,
                       Stream* stream) override;

  // A stream of this device, or InvalidArgument naming `what`.
  Result<cuda_internal::CudaStream*> OwnStream(Stream* stream, const char* what);

 private:
  CudaDevice(int ordinal, std::string gpu_name, size_t budget);
  Status Init(const CudaDeviceOptions& options);
  Status Copy(const char* what, cudaMemcpyKind kind, void* dst, const void* src, size_t bytes,
              Stream* stream);

  const int ordinal_;
  const std::string gpu_name_;
  const size_t budget_;

  // Init reserves pool_bytes_ of device addresses and backs them chunk by chunk as
  // allocations reach them (vmm_), or, where the driver cannot, makes one cudaMalloc.
  Status InitPool();
  Status CommitChunks(char* addr, size_t bytes);
  Status DecommitChunks(char* addr, size_t bytes);

  struct Vmm;                  // the driver entry points and each chunk's allocation handle
  std::unique_ptr<Vmm> vmm_;   // null: the pool is one cudaMalloc
  char* pool_base_ = nullptr;  // set once in Init
  size_t pool_bytes_ = 0;
  DevicePool pool_;

  std::unique_ptr<cuda_internal::CudaStream> compute_stream_;
  Mutex streams_mu_;
  std::vector<std::unique_ptr<cuda_internal::CudaStream>> streams_ GUARDED_BY(streams_mu_);
};

}  // namespace zinf
