#include "device/cuda/cuda_device.h"

#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <limits>
#include <optional>
#include <utility>

#include "zinf/align.h"
#include "zinf/cuda.h"
#include "zinf/log.h"

namespace zinf {
namespace cuda_internal {

Status CudaCallStatus(cudaError_t err, const char* call, const char* file, int line) {
  std::string message = std::string(call) + " failed at " + file + ":" + std::to_string(line) +
                        ": " + cudaGetErrorString(err) + " (" + cudaGetErrorName(err) + ")";
  switch (err) {
    case cudaErrorMemoryAllocation:
      return Status::ResourceExhausted(std::move(message));
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorHostMemoryAlreadyRegistered:
    case cudaErrorHostMemoryNotRegistered:
      return Status::InvalidArgument(std::move(message));
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
      return Status::NotSupported(std::move(message));
    default:
      return Status::Internal(std::move(message));
  }
}

Status MakeCurrent(int device) {
  int current = -1;
  ZINF_CUDA_CHECK(cudaGetDevice(&current));
  if (current != device) ZINF_CUDA_CHECK(cudaSetDevice(device));
  return Status::OK();
}

CudaStream::~CudaStream() {
  // Errors cannot be reported from here; a failing context fails every call anyway.
  if (MakeCurrent(device_).ok()) {
    if (handle_ != nullptr && owned_) {
      (void)cudaStreamSynchronize(handle_);
      (void)cudaStreamDestroy(handle_);
    }
    if (scratch_ != nullptr) (void)cudaFree(scratch_);
    if (staging_ != nullptr) (void)cudaFreeHost(staging_);
  }
}

Status CudaStream::InitExternal(cudaStream_t handle) {
  handle_ = handle;
  owned_ = false;
  // Made when the stream is, never in a step: a few KiB outside the device budget.
  ZINF_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&scratch_), sizeof(ReduceScratch)));
  ZINF_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&staging_), sizeof(ReduceScratch)));
  return Status::OK();
}

Status CudaStream::Init() {
  ZINF_CUDA_CHECK(cudaStreamCreateWithFlags(&handle_, cudaStreamNonBlocking));
  // Made when the stream is, never in a step: a few KiB outside the device budget.
  ZINF_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&scratch_), sizeof(ReduceScratch)));
  ZINF_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&staging_), sizeof(ReduceScratch)));
  return Status::OK();
}

Result<CudaStream*> AsCudaStream(Stream* stream, const char* what) {
  if (stream == nullptr) return Status::InvalidArgument(std::string(what) + ": stream is null");
  auto* cs = dynamic_cast<CudaStream*>(stream);
  if (cs == nullptr) {
    return Status::InvalidArgument(std::string(what) + ": stream '" + stream->name() +
                                   "' is not a CudaDevice stream");
  }
  return cs;
}

}  // namespace cuda_internal

using cuda_internal::CudaStream;
using cuda_internal::MakeCurrent;

namespace {

std::string BytesText(size_t n) { return FormatBytes(n) + " (" + std::to_string(n) + " bytes)"; }

class CudaEvent final : public Event {
 public:
  CudaEvent(int device, cudaEvent_t handle) : device_(device), handle_(handle) {}
  ~CudaEvent() override {
    if (MakeCurrent(device_).ok()) (void)cudaEventDestroy(handle_);
  }
  int device() const { return device_; }
  cudaEvent_t handle() const { return handle_; }

 private:
  const int device_;
  const cudaEvent_t handle_;
};

Result<CudaEvent*> AsCudaEvent(Event* event, const char* what) {
  if (event == nullptr) return Status::InvalidArgument(std::string(what) + ": event is null");
  auto* ce = dynamic_cast<CudaEvent*>(event);
  if (ce == nullptr) {
    return Status::InvalidArgument(std::string(what) +
                                   ": the event was not created by a CudaDevice");
  }
  return ce;
}

// What cudaLaunchHostFunc runs: owns the function, deleted by the trampoline (or by the
// caller when the launch fails).
struct HostCall {
  std::function<Status()> task;
  CudaStream* stream;
};

void CUDART_CB RunHostCall(void* arg) {
  std::unique_ptr<HostCall> call(static_cast<HostCall*>(arg));
  Status s;
  try {
    s = call->task();
  } catch (const std::exception& e) {
    s = Status::Internal("a host function on stream '" + call->stream->name() +
                         "' threw: " + e.what());
  } catch (...) {
    s = Status::Internal("a host function on stream '" + call->stream->name() +
                         "' threw a non-std exception");
  }
  if (!s.ok()) call->stream->SetError(s);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// CudaDevice

Result<std::unique_ptr<CudaDevice>> CudaDevice::Create(const CudaDeviceOptions& options) {
  int count = 0;
  ZINF_CUDA_CHECK(cudaGetDeviceCount(&count));
  if (options.device < 0 || options.device >= count) {
    return Status::InvalidArgument("NewCudaDevice: device " + std::to_string(options.device) +
                                   " does not exist (" + std::to_string(count) +
                                   " CUDA device(s) visible; check CUDA_VISIBLE_DEVICES)");
  }
  ZINF_CUDA_CHECK(cudaSetDevice(options.device));
  cudaDeviceProp prop{};
  ZINF_CUDA_CHECK(cudaGetDeviceProperties(&prop, options.device));
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  ZINF_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  size_t budget = options.memory_budget;
  if (budget == 0) {
    budget = free_bytes / 10 * 9;
  } else if (budget > free_bytes) {
    return Status::ResourceExhausted(
        "NewCudaDevice: the memory budget " + BytesText(budget) + " exceeds the " +
        BytesText(free_bytes) + " free on device " + std::to_string(options.device) + " (" +
        prop.name + ", " + BytesText(total_bytes) +
        " in all); lower CudaDeviceOptions::memory_budget or pass 0 for 90% of the free memory");
  }
  std::unique_ptr<CudaDevice> device(new CudaDevice(options.device, prop.name, budget));
  ZINF_RETURN_IF_ERROR(device->Init(options).WithContext("NewCudaDevice"));
  return device;
}

// The driver's virtual memory management, through the runtime's entry-point lookup (linking
// libcuda itself would stop every binary from starting on a machine without a driver).
struct CudaDevice::Vmm {
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetAttribute_v2000 get_attribute = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 granularity = nullptr;
  PFN_cuMemAddressReserve_v10020 address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 address_free = nullptr;
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
  PFN_cuGetErrorString_v6000 error_string = nullptr;
  CUdevice device = 0;
  size_t chunk = 0;
  std::vector<CUmemGenericAllocationHandle> handles;  // per chunk; 0: not backed

  // Whether every entry point was found.
  bool Load() {
    auto get = [](const char* name, auto* fn) {
      void* p = nullptr;
      cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
      // The 12.0 versions of the entry points (the signatures of cudaTypedefs.h's _v10020).
      const cudaError_t err =
          cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found);
#else
      const cudaError_t err = cudaGetDriverEntryPoint(name, &p, cudaEnableDefault, &found);
#endif
      if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || p == nullptr) {
        return false;
      }
      *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(p);
      return true;
    };
    return get("cuDeviceGet", &device_get) && get("cuDeviceGetAttribute", &get_attribute) &&
           get("cuMemGetAllocationGranularity", &granularity) &&
           get("cuMemAddressReserve", &address_reserve) && get("cuMemAddressFree", &address_free) &&
           get("cuMemCreate", &create) && get("cuMemRelease", &release) && get("cuMemMap", &map) &&
           get("cuMemUnmap", &unmap) && get("cuMemSetAccess", &set_access) &&
           get("cuGetErrorString", &error_string);
  }

  Status Check(CUresult r, const char* call) const {
    if (r == CUDA_SUCCESS) return Status::OK();
    const char* text = nullptr;
    if (error_string == nullptr || error_string(r, &text) != CUDA_SUCCESS || text == nullptr) {
      text = "unknown error";
    }
    std::string message = std::string(call) + " failed: " + text + " (CUresult " +
                          std::to_string(static_cast<int>(r)) + ")";
    return r == CUDA_ERROR_OUT_OF_MEMORY ? Status::ResourceExhausted(std::move(message))
                                         : Status::Internal(std::move(message));
  }

  CUmemAllocationProp Prop(int ordinal) const {
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal;
    return prop;
  }
};

CudaDevice::CudaDevice(int ordinal, std::string gpu_name, size_t budget)
    : ordinal_(ordinal),
      gpu_name_(std::move(gpu_name)),
      budget_(budget),
      pool_("CudaDevice", "CudaDeviceOptions::memory_budget", budget, kCudaDeviceAlignment) {}

Status CudaDevice::Init(const CudaDeviceOptions& options) {
  ZINF_RETURN_IF_ERROR(MakeCurrent(ordinal_));
  ZINF_RETURN_IF_ERROR(InitPool());
  compute_stream_ = std::make_unique<CudaStream>(this, ordinal_, "compute");
  if (options.use_external_compute_stream) {
    return compute_stream_->InitExternal(
        static_cast<cudaStream_t>(options.external_compute_stream));
  }
  return compute_stream_->Init();
}

CudaDevice::~CudaDevice() {
  {
    MutexLock lock(&streams_mu_);
    streams_.clear();  // each synchronizes, then is destroyed
  }
  compute_stream_.reset();
  if (pool_base_ == nullptr || !MakeCurrent(ordinal_).ok()) return;
  // Errors cannot be reported from here; the context goes with the process anyway.
  if (!vmm_) {
    (void)cudaFree(pool_base_);
    return;
  }
  for (size_t i = 0; i < vmm_->handles.size(); ++i) {
    if (vmm_->handles[i] == 0) continue;
    const auto addr = reinterpret_cast<CUdeviceptr>(pool_base_) + i * vmm_->chunk;
    (void)vmm_->unmap(addr, std::min(vmm_->chunk, pool_bytes_ - i * vmm_->chunk));
    (void)vmm_->release(vmm_->handles[i]);
  }
  (void)vmm_->address_free(reinterpret_cast<CUdeviceptr>(pool_base_), pool_bytes_);
}

std::string CudaDevice::Name() const {
  return "cuda:" + std::to_string(ordinal_) + " (" + gpu_name_ + ", budget " +
         FormatBytes(budget_) + ")";
}

Status CudaDevice::InitPool() {
  // 2 MiB, the driver's page granularity, or the one it reports.
  size_t granule = size_t{2} << 20;
  auto vmm = std::make_unique<Vmm>();
  bool usable = vmm->Load();
  int supported = 0;
  if (usable) {
    usable = vmm->device_get(&vmm->device, ordinal_) == CUDA_SUCCESS &&
             vmm->get_attribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                vmm->device) == CUDA_SUCCESS &&
             supported != 0;
  }
  std::string why = "no virtual memory management";
  if (usable) {
    const CUmemAllocationProp prop = vmm->Prop(ordinal_);
    size_t g = 0;
    Status s = vmm->Check(vmm->granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                          "cuMemGetAllocationGranularity");
    if (s.ok() && g > 0) granule = RoundUp(granule, g);
    if (!s.ok()) why = s.ToString();
    usable = s.ok();
  }
  pool_bytes_ = std::max(granule, RoundUp(budget_, granule));
  CUdeviceptr base = 0;
  if (usable) {
    Status s =
        vmm->Check(vmm->address_reserve(&base, pool_bytes_, granule, 0, 0), "cuMemAddressReserve");
    if (!s.ok()) why = s.ToString();
    usable = s.ok();
  }
  if (!usable) {
    // The whole budget at once: the step never calls cudaMalloc, and TrimMemory gives
    // nothing back.
    LogInfo("CudaDevice: device " + std::to_string(ordinal_) + ": " + why +
            "; the pool is one cudaMalloc of " + FormatBytes(pool_bytes_) +
            " and offload_states cannot return it");
    void* base = nullptr;
    ZINF_CUDA_CHECK(cudaMalloc(&base, pool_bytes_));
    pool_base_ = static_cast<char*>(base);
    pool_.SetRange(pool_base_, pool_bytes_);
    return Status::OK();
  }
  // Chunks of 32 MiB (fewer driver calls on a first step), at most 65,536 of them; a
  // whole number of granules each, the last one cut short by the pool's end.
  vmm->chunk = std::max(RoundUp(size_t{32} << 20, granule), RoundUp(pool_bytes_ / 65536, granule));
  vmm->handles.assign((pool_bytes_ + vmm->chunk - 1) / vmm->chunk, 0);
  pool_base_ = reinterpret_cast<char*>(base);
  vmm_ = std::move(vmm);
  DevicePool::Backing backing;
  backing.chunk = vmm_->chunk;
  backing.commit = [this](char* addr, size_t bytes) { return CommitChunks(addr, bytes); };
  backing.decommit = [this](char* addr, size_t bytes) { return DecommitChunks(addr, bytes); };
  pool_.SetRange(pool_base_, pool_bytes_, std::move(backing));
  // The whole budget backed now, as the single cudaMalloc did: a step never finds the memory
  // taken (torch allocates beside zinf), only a reload after TrimMemory may (RestoreMemory).
  return pool_.CommitAll().WithContext("CudaDevice: backing the pool of " +
                                       FormatBytes(pool_bytes_));
}

// Called by the pool (under its lock) with whole chunks; on failure the ones this call backed
// are released again.
Status CudaDevice::CommitChunks(char* addr, size_t bytes) {
  ZINF_RETURN_IF_ERROR(MakeCurrent(ordinal_));
  const CUmemAllocationProp prop = vmm_->Prop(ordinal_);
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const size_t first = static_cast<size_t>(addr - pool_base_) / vmm_->chunk;
  size_t done = 0;
  Status s;
  while (done < bytes) {
    const size_t index = first + done / vmm_->chunk;
    const size_t n = std::min(vmm_->chunk, bytes - done);
    const auto at = reinterpret_cast<CUdeviceptr>(addr + done);
    if (vmm_->handles[index] != 0) {
      // Still mapped (an earlier rollback's unmap failed): backed already.
      done += n;
      continue;
    }
    CUmemGenericAllocationHandle h = 0;
    s = vmm_->Check(vmm_->create(&h, n, &prop, 0), "cuMemCreate");
    if (s.ok()) {
      s = vmm_->Check(vmm_->map(at, n, 0, h, 0), "cuMemMap");
      if (s.ok()) {
        s = vmm_->Check(vmm_->set_access(at, n, &access, 1), "cuMemSetAccess");
        if (!s.ok()) (void)vmm_->unmap(at, n);  // (the mapping goes with the handle below)
      }
      if (!s.ok()) (void)vmm_->release(h);  // (the failure reported is the first one)
    }
    if (!s.ok()) break;
    vmm_->handles[index] = h;
    done += n;
  }
  if (s.ok()) return Status::OK();
  Status undone = DecommitChunks(addr, done);
  if (!undone.ok()) LogWarning("CudaDevice: undoing a partial commit: " + undone.ToString());
  return s.WithContext("CudaDevice: backing " + FormatBytes(bytes) + " of the pool");
}

// One chunk (the pool gives them back one at a time). An error means it is still mapped.
Status CudaDevice::DecommitChunks(char* addr, size_t bytes) {
  ZINF_RETURN_IF_ERROR(MakeCurrent(ordinal_));
  for (size_t done = 0; done < bytes;) {
    const size_t index = static_cast<size_t>(addr + done - pool_base_) / vmm_->chunk;
    const size_t n = std::min(vmm_->chunk, bytes - done);
    const auto at = reinterpret_cast<CUdeviceptr>(addr + done);
    done += n;
    if (vmm_->handles[index] == 0) continue;
    ZINF_RETURN_IF_ERROR(vmm_->Check(vmm_->unmap(at, n), "cuMemUnmap"));
    Status released = vmm_->Check(vmm_->release(vmm_->handles[index]), "cuMemRelease");
    // Unmapped either way: the chunk must be backed again before use.
    if (!released.ok()) LogWarning("CudaDevice: leaking a chunk: " + released.ToString());
    vmm_->handles[index] = 0;
  }
  return Status::OK();
}

Status CudaDevice::TrimMemory() { return pool_.Trim(); }

Status CudaDevice::RestoreMemory() { return vmm_ ? pool_.CommitAll() : Status::OK(); }

Result<void*> CudaDevice::Alloc(size_t bytes) { return pool_.Allocate(bytes); }

void CudaDevice::Free(void* ptr) { pool_.Free(ptr); }

DeviceMemoryInfo CudaDevice::MemoryInfo() const { return pool_.Info(); }

Stream* CudaDevice::ComputeStream() { return compute_stream_.get(); }

Result<Stream*> CudaDevice::CreateStream(const std::string& name) {
  ZINF_RETURN_IF_ERROR(MakeCurrent(ordinal_));
  auto stream = std::make_unique<CudaStream>(this, ordinal_, name);
  ZINF_RETURN_IF_ERROR(stream->Init().WithContext("CudaDevice: creating stream '" + name + "'"));
  MutexLock lock(&streams_mu_);
  streams_.push_back(std::move(stream));
  return static_cast<Stream*>(streams_.back().get());
}

Result<CudaStream*> CudaDevice::OwnStream(Stream* stream, const char* what) {
  ZINF_ASSIGN_OR_RETURN(CudaStream * cs, cuda_internal::AsCudaStream(stream, what));
  if (cs->owner() != this) {
    return Status::InvalidArgument(std::string(what) + ": stream '" + stream->name() +
                                   "' does not belong to this CudaDevice");
  }
  ZINF_RETURN_IF_ERROR(MakeCurrent(ordinal_));
  return cs;
}

Status CudaDevice::Copy(const char* what, cudaMemcpyKind kind, void* dst, const void* src,
                        size_t bytes, Stream* stream) {
  ZINF_ASSIGN_OR_RETURN(CudaStream * cs, OwnStream(stream, what));
  if (bytes == 0) return Status::OK();
  if (dst == nullptr || src == nullptr) {
    return Status::InvalidArgument(std::string(what) + " of " + std::to_string(bytes) +
                                   " bytes on stream '" + cs->name() +
                                   "': " + (dst == nullptr ? "dst" : "src") + " is null");
  }
  ZINF_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, cs->handle()));
  return Status::OK();
}

Status CudaDevice::CopyHostToDevice(void* dst, const void* src, size_t bytes, Stream* stream) {
  return Copy("CopyHostToDevice", cudaMemcpyHostToDevice, dst, src, bytes, stream);
}

Status CudaDevice::CopyDeviceToHost(void* dst, const void* src, size_t bytes, Stream* stream) {
  return Copy("CopyDeviceToHost", cudaMemcpyDeviceToHost, dst, src, bytes, stream);
}

Status CudaDevice::CopyDeviceToDevice(void* dst, const void* src, size_t bytes, Stream* stream) {
  return Copy("CopyDeviceToDevice", cudaMemcpyDeviceToDevice, dst, src, bytes, stream);
}

Status CudaDevice::LaunchHostFunc(Stream* stream, std::function<void()> fn) {
  if (!fn) return Status::InvalidArgument("LaunchHostFunc: the function is empty");
  return LaunchHostTask(stream, [fn = std::move(fn)] {
    fn();
    return Status::OK();
  });
}

Status CudaDevice::LaunchHostTask(Stream* stream, std::function<Status()> task) {
  ZINF_ASSIGN_OR_RETURN(CudaStream * cs, OwnStream(stream, "LaunchHostTask"));
  if (!task) return Status::InvalidArgument("LaunchHostTask: the task is empty");
  auto call = std::make_unique<HostCall>(HostCall{std::move(task), cs});
  ZINF_CUDA_CHECK(cudaLaunchHostFunc(cs->handle(), RunHostCall, call.get()));
  call.release();  // owned by the trampoline now
  return Status::OK();
}

Result<std::unique_ptr<Event>> CudaDevice::CreateEvent() {
  ZINF_RETURN_IF_ERROR(MakeCurrent(ordinal_));
  cudaEvent_t handle = nullptr;
  ZINF_CUDA_CHECK(cudaEventCreateWithFlags(&handle, cudaEventDisableTiming));
  return std::unique_ptr<Event>(std::make_unique<CudaEvent>(ordinal_, handle));
}

Status CudaDevice::RecordEvent(Event* event, Stream* stream) {
  ZINF_ASSIGN_OR_RETURN(CudaEvent * ce, AsCudaEvent(event, "RecordEvent"));
  ZINF_ASSIGN_OR_RETURN(CudaStream * cs, OwnStream(stream, "RecordEvent"));
  ZINF_CUDA_CHECK(cudaEventRecord(ce->handle(), cs->handle()));
  return Status::OK();
}

Status CudaDevice::StreamWaitEvent(Stream* stream, Event* event) {
  ZINF_ASSIGN_OR_RETURN(CudaEvent * ce, AsCudaEvent(event, "StreamWaitEvent"));
  ZINF_ASSIGN_OR_RETURN(CudaStream * cs, OwnStream(stream, "StreamWaitEvent"));
  // Like HostDevice: the record waited for is the latest one at issue time.
  ZINF_CUDA_CHECK(cudaStreamWaitEvent(cs->handle(), ce->handle(), 0));
  return Status::OK();
}

Status CudaDevice::SynchronizeEvent(Event* event) {
  ZINF_ASSIGN_OR_RETURN(CudaEvent * ce, AsCudaEvent(event, "SynchronizeEvent"));
  ZINF_RETURN_IF_ERROR(MakeCurrent(ce->device()));
  ZINF_CUDA_CHECK(cudaEventSynchronize(ce->handle()));
  return Status::OK();
}

bool CudaDevice::EventDone(Event* event) {
  auto ce = AsCudaEvent(event, "EventDone");
  ZINF_CHECK_MSG(ce.ok(), "EventDone: null event or not a CudaDevice event");
  if (!MakeCurrent((*ce)->device()).ok()) return true;
  const cudaError_t err = cudaEventQuery((*ce)->handle());
  if (err == cudaErrorNotReady) {
    // Not an error, but the runtime may keep it as this thread's last error, which the next
    // kernel launch check (cudaGetLastError) would then report as the launch's failure.
    (void)cudaGetLastError();  // safe: only clears NotReady, which is no error
    return false;
  }
  return true;
}

Status CudaDevice::SynchronizeStream(Stream* stream) {
  ZINF_ASSIGN_OR_RETURN(CudaStream * cs, OwnStream(stream, "SynchronizeStream"));
  ZINF_CUDA_CHECK(cudaStreamSynchronize(cs->handle()));
  return cs->error();
}

Status CudaDevice::RegisterHostMemory(void* ptr, size_t bytes) {
  if (ptr == nullptr || bytes == 0) {
    return Status::InvalidArgument("RegisterHostMemory: null pointer or zero bytes");
  }
  ZINF_RETURN_IF_ERROR(MakeCurrent(ordinal_));
  // Portable: usable by every device of the process (ranks of one process on several GPUs).
  ZINF_CUDA_CHECK(cudaHostRegister(ptr, bytes, cudaHostRegisterPortable));
  return Status::OK();
}

Status CudaDevice::UnregisterHostMemory(void* ptr) {
  if (ptr == nullptr) return Status::InvalidArgument("UnregisterHostMemory: null pointer");
  ZINF_RETURN_IF_ERROR(MakeCurrent(ordinal_));
  ZINF_CUDA_CHECK(cudaHostUnregister(ptr));
  return Status::OK();
}

Status CudaDevice::ConvertToBf16(uint16_t* dst, const float* src, size_t n, Stream* stream) {
  ZINF_RETURN_IF_ERROR(OwnStream(stream, "ConvertToBf16").status());
  ZINF_RETURN_IF_ERROR(MakeCurrent(ordinal_));
  return cuda::CastF32ToBf16(src, dst, n, stream);
}

Status CudaDevice::AddInto(float* dst, const float* src, size_t n, Stream* stream) {
  ZINF_RETURN_IF_ERROR(OwnStream(stream, "AddInto").status());
  ZINF_RETURN_IF_ERROR(MakeCurrent(ordinal_));
  return cuda::Add(dst, src, n, stream);
}

Status CudaDevice::QuantizeInt8(void* dst, const void* src, ParamCopyType type, size_t n,
                                size_t block, Stream* stream) {
  ZINF_RETURN_IF_ERROR(OwnStream(stream, "QuantizeInt8").status());
  ZINF_RETURN_IF_ERROR(MakeCurrent(ordinal_));
  return cuda::QuantizeInt8(src, type, n, block, dst, stream);
}

Status CudaDevice::DequantizeInt8(void* dst, ParamCopyType type, const void* src, size_t n,
                                  size_t block, Stream* stream) {
  ZINF_RETURN_IF_ERROR(OwnStream(stream, "DequantizeInt8").status());
  ZINF_RETURN_IF_ERROR(MakeCurrent(ordinal_));
  return cuda::DequantizeInt8(src, n, block, type, dst, stream);
}

Status CudaDevice::QuantizeInt4(void* dst, const float* src, size_t n, size_t block,
                                Stream* stream) {
  ZINF_RETURN_IF_ERROR(OwnStream(stream, "QuantizeInt4").status());
  ZINF_RETURN_IF_ERROR(MakeCurrent(ordinal_));
  return cuda::QuantizeInt4(src, n, block, dst, stream);
}

Status CudaDevice::DequantizeInt4(float* dst, const void* src, size_t n, size_t block,
                                  Stream* stream) {
  ZINF_RETURN_IF_ERROR(OwnStream(stream, "DequantizeInt4").status());
  ZINF_RETURN_IF_ERROR(MakeCurrent(ordinal_));
  return cuda::DequantizeInt4(src, n, block, dst, stream);
}

Status CudaDevice::SumSquares(const float* x, size_t n, GradStats* out_host, Stream* stream) {
  ZINF_RETURN_IF_ERROR(OwnStream(stream, "SumSquares").status());
  if (out_host == nullptr) return Status::InvalidArgument("SumSquares: out_host is null");
  ZINF_RETURN_IF_ERROR(MakeCurrent(ordinal_));
  return cuda::SumSquares(x, n, &out_host->sum_squares, &out_host->has_inf_or_nan, stream);
}

Status CudaDevice::OptimizerStep(const OptimizerHyperParams& hp, const OptimizerTensors& t,
                                 Stream* stream) {
  ZINF_RETURN_IF_ERROR(OwnStream(stream, "OptimizerStep").status());
  ZINF_RETURN_IF_ERROR(MakeCurrent(ordinal_));
  return cuda::AdamStep(hp, t, stream);
}

// ---------------------------------------------------------------------------------------------

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the (non-sticky) error for later calls
    return 0;
  }
  return count;
}

Result<std::unique_ptr<Device>> NewCudaDevice(const CudaDeviceOptions& options) {
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<CudaDevice> device, CudaDevice::Create(options));
  return std::unique_ptr<Device>(std::move(device));
}

void* CudaStreamOf(Stream* stream) {
  auto* cs = dynamic_cast<CudaStream*>(stream);
  return cs == nullptr ? nullptr : static_cast<void*>(cs->handle());
}

}  // namespace zinf
