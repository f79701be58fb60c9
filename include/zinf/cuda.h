// The CUDA backends of the two seams (zinf/device.h, zinf/comm.h) and the device kernels the
// engine runs between them.
//
// Always declared and always linkable (target zinf_cuda_backends): a build without CUDA
// (ZINF_CUDA=OFF, or no nvcc) compiles a fallback in which CudaDeviceCount() is 0, every
// factory and kernel returns NotSupported("built without CUDA") and CudaStreamOf returns null,
// so callers need no #ifdef.
//
// CudaDevice
//   - Memory: one pool of `memory_budget` bytes, taken whole when the device is created, then
//     sub-allocated first-fit (256-byte aligned) with coalescing on Free: Alloc and Free never
//     call cudaMalloc/cudaFree, so a training step neither synchronizes the device nor
//     fragments the CUDA caching state. With the driver's virtual memory management (found
//     at run time; else one cudaMalloc) the pool is an address range backed in 32 MiB chunks
//     (cuMemCreate/cuMemMap): TrimMemory (offload_states) unmaps and releases the chunks no
//     allocation holds, so torch and other processes can use them, and RestoreMemory
//     (reload_states) backs the whole pool again; an Alloc reaching a chunk trimmed and not
//     restored backs it then. Free is immediate, as on HostDevice: the caller must know no
//     queued work still uses the buffer.
//   - Streams are cudaStreamCreateWithFlags(cudaStreamNonBlocking); none is the legacy default
//     stream. ComputeStream() is such a dedicated stream (unlike HostDevice's, it is
//     asynchronous): the trainer must launch its own kernels on CudaStreamOf(ComputeStream())
//     so that the engine's events order them against the copies and collectives.
//   - Events are cudaEventDisableTiming events; an event never recorded counts as completed.
//   - LaunchHostFunc is cudaLaunchHostFunc; an exception escaping the function becomes the
//     stream's sticky error, reported by SynchronizeStream (CUDA's own errors are sticky
//     for the whole context and are reported by every later call).
//   - Every CUDA call is checked; a failure becomes a Status naming the call, the file and
//     line and CUDA's error string (cudaErrorMemoryAllocation -> ResourceExhausted).
//   - Thread-safe; each method makes the device current on the calling thread first.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "zinf/comm.h"
#include "zinf/cpu_adam.h"
#include "zinf/device.h"
#include "zinf/status.h"

namespace zinf {

struct CudaDeviceOptions {
  int device = 0;            // CUDA device ordinal (usually LOCAL_RANK)
  size_t memory_budget = 0;  // bytes of the pool; 0: 90% of the device's free memory
  // An existing cudaStream_t (as an opaque pointer) to use as ComputeStream(), for a trainer
  // whose kernels run on a stream of its own (PyTorch's current stream): the engine then orders
  // its copies against that stream with events. Not owned: never destroyed. The legacy default
  // stream is the null handle, so `use_external_compute_stream` says whether to use it.
  bool use_external_compute_stream = false;
  void* external_compute_stream = nullptr;
};

// The CUDA devices visible to this process; 0 when built without CUDA, without a driver, or
// when no device is visible (never fails).
int CudaDeviceCount();

// A CudaDevice on `options.device`. InvalidArgument for a bad ordinal, ResourceExhausted when
// the pool cannot be reserved, NotSupported when built without CUDA.
Result<std::unique_ptr<Device>> NewCudaDevice(const CudaDeviceOptions& options);

// The cudaStream_t (as an opaque pointer, so this header needs no CUDA include) behind a
// stream of a CudaDevice; null for any other stream (or without CUDA).
void* CudaStreamOf(Stream* stream);

// ---- NCCL -----------------------------------------------------------------------------------

struct NcclCommOptions {
  int rank = 0;
  int world_size = 1;
  // The CUDA device of this rank (LOCAL_RANK); informational for NewNcclComm, which uses the
  // given Device, and what a launcher passes to CudaDeviceOptions::device.
  int local_rank = 0;
  // A file on a folder every rank can read (a shared filesystem across nodes). Rank 0 writes
  // the ncclUniqueId there atomically (temporary file + rename); the other ranks poll for it
  // until the timeout. Use a fresh path per job: a stale file from an earlier job would be
  // read as this job's. May be empty when world_size == 1.
  std::string unique_id_file;
  // Instead of the file: a rendezvous store (ProcessGroupOptions, RendezvousStore): rank 0 sets
  // `store_key` to the id, the others wait for it. The communicator keeps the store (rank 0
  // may serve it).
  std::shared_ptr<KeyValueStore> store;
  std::string store_key = "zinf/nccl/unique_id";
  // The longest wait for: the id file, communicator creation, one collective to complete (a
  // watchdog aborts the communicator after that), and Barrier.
  double timeout_seconds = 600;
};

// From the environment torchrun and similar launchers set: RANK, WORLD_SIZE, LOCAL_RANK
// (each default 0, 1, 0 when unset), ZINF_NCCL_ID_FILE (required when WORLD_SIZE > 1) and
// ZINF_NCCL_TIMEOUT_S (optional). InvalidArgument naming the variable for a malformed or
// inconsistent value. Available in every build.
Result<NcclCommOptions> NcclCommOptionsFromEnv();

// The NCCL endpoint of this rank on `device` (a CudaDevice). Collectives are enqueued on the
// cudaStream_t of the Stream passed to each call, so they are ordered like every other
// stream operation. The communicator is non-blocking (ncclConfig_t::blocking = 0): creation
// and every collective are polled with ncclCommGetAsyncError against the deadline, and a
// watchdog thread watches each collective's completion; a dead or stuck peer gives a
// FailedPrecondition (the communicator is aborted with ncclCommAbort and every later call
// fails with the same Status, which also becomes the sticky error of the stream the
// collective was on) instead of a hang.
//
// Differences from LocalComm: sums are taken in NCCL's order (fixed for a given topology and
// NCCL version, but not rank order 0..N-1), so results are reproducible run to run on the
// same machines but not bit-identical to LocalComm's for world_size > 2.
Result<std::unique_ptr<Communicator>> NewNcclComm(Device* device, const NcclCommOptions& options);

// ---- Device kernels -------------------------------------------------------------------------
//
// Every pointer is device memory of the CudaDevice that owns `stream` (except the *_host
// outputs); every kernel is enqueued on `stream` and returns once enqueued. InvalidArgument
// for a null pointer with n > 0 or a stream that is not a CudaDevice stream; the kernels
// allocate nothing.
namespace cuda {

// dst[i] = bf16 -> fp32 of src[i] (exact: the bits shifted up; NaN payloads kept).
Status CastBf16ToF32(const uint16_t* src, float* dst, size_t n, Stream* stream);
// dst[i] = fp32 -> bf16 of src[i], bit-identical to zinf::Fp32ToBf16 (cpu_adam.h): round to
// nearest even, fp32 subnormals flushed to signed zero, NaN -> quiet NaN keeping the top
// payload bits.
Status CastF32ToBf16(const float* src, uint16_t* dst, size_t n, Stream* stream);
// x[i] *= s.
Status Scale(float* x, size_t n, float s, Stream* stream);
// dst[i] += src[i] (one correctly rounded addition, as on the host).
Status Add(float* dst, const float* src, size_t n, Stream* stream);
// The quantized parameter gather's encoding (zinf/cpu_adam.h QuantizeParamsInt8, bit for bit:
// one thread block per quantization block of `block` values (QuantBlockValid: InvalidArgument
// otherwise), the scale's division and the codes' rounding in the CPU's precision) and
// decoding (DequantizeParamsInt8).
Status QuantizeInt8(const void* src, ParamCopyType type, size_t n, size_t block, void* dst,
                    Stream* stream);
Status DequantizeInt8(const void* src, size_t n, size_t block, ParamCopyType type, void* dst,
                      Stream* stream);
// The int4 gradient blocks (QuantizeGradsInt4 / DequantizeGradsInt4, bit for bit).
Status QuantizeInt4(const float* src, size_t n, size_t block, void* dst, Stream* stream);
Status DequantizeInt4(const void* src, size_t n, size_t block, float* dst, Stream* stream);
// *out_host = sum of x[i]^2 accumulated in double, *nonfinite_host = whether any x[i] is inf
// or NaN. Deterministic: a fixed grid (independent of the GPU) of per-thread strided sums,
// reduced per block in a fixed tree, then the per-block sums added in block order by a second
// kernel, so the result is identical from run to run and GPU to GPU (it differs from the
// CPU's sequential sum only in the order of the double additions). The outputs are written
// by a host function when the stream reaches this point: they must stay valid until then
// (synchronize the stream, or an event recorded after the call, before reading them).
Status SumSquares(const float* x, size_t n, double* out_host, bool* nonfinite_host, Stream* stream);
// One Adam or AdamW step (hp.kind kAdam or kAdamW; others NotSupported) over t.n elements in
// device memory: t.param, t.grad (kF32, kBf16 or kF16), t.exp_avg, t.exp_avg_sq and, when
// t.param_copy_type != kNone, t.param_copy (bf16 or fp16, round to nearest even). Arguments
// are checked like the CPU step (ValidateOptimizerStep). Bit-identical to the CPU scalar
// reference (OptimizerStep with CpuIsa::kScalar): the same coefficients (computed on the host
// by the same function), the same sequence of correctly rounded operations with every FMA
// explicit (kernels.cu is built with -fmad=false, IEEE division and square root, no
// flush-to-zero), and the same bf16/fp16 conversions.
Status AdamStep(const OptimizerHyperParams& hp, const OptimizerTensors& t, Stream* stream);
// Benchmark compute: keeps `stream` busy for `seconds` (one thread spinning on the GPU's
// global nanosecond timer, so the time does not depend on the clock rate) and writes that
// timer at its start and its end to times[0] and times[1] (device memory): the compute
// stream's busy intervals on the GPU's own clock (zinf-engine-bench's idle report).
// InvalidArgument for seconds < 0 or above 60.
Status Spin(double seconds, uint64_t* times, Stream* stream);

}  // namespace cuda
}  // namespace zinf
