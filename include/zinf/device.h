// The device seam: memory under a budget, ordered streams, asynchronous copies and events.
//
// Implementations: HostDevice (host memory stands in for device memory; every stream is a
// worker thread; an optional bandwidth cap simulates PCIe) and, when built with CUDA,
// CudaDevice. The engine sees only this interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "zinf/cpu_adam.h"
#include "zinf/status.h"

namespace zinf {

// An ordered queue of device work. Owned by its Device.
class Stream {
 public:
  virtual ~Stream() = default;
  virtual const std::string& name() const = 0;
};

// A point in a stream's work. Created by Device::CreateEvent; reusable (re-record).
class Event {
 public:
  virtual ~Event() = default;
};

// What a backend can do. The engine decides from these (CheckFeasible, the shorter paths of a
// host device), never from which backend it is (ggml-backend's supports_op).
struct DeviceCaps {
  // Device memory is ordinary host memory: host code may read it once the work producing it
  // has completed.
  bool host_memory = false;
  // Work issued on the compute stream has run when the call returns (HostDevice outside
  // strict mode): the engine may take the shorter paths a GPU's compute stream would stall.
  bool compute_inline = false;
  // Device::OptimizerStep: the optimizers it runs (a bit per OptimizerKind), whether it keeps
  // compressed states (StateType bf16 / int8), and whether the sub-groups it steps need their
  // parameters in device memory (a GPU writes the updated parameters straight into their
  // device stores).
  uint32_t step_kinds = 0;
  bool step_compressed_states = false;
  bool step_needs_device_params = false;

  bool Steps(OptimizerKind kind) const { return (step_kinds >> static_cast<int>(kind)) & 1u; }
  static constexpr uint32_t Kind(OptimizerKind kind) { return 1u << static_cast<int>(kind); }
};

struct DeviceMemoryInfo {
  size_t budget = 0;  // bytes the device may allocate in all
  size_t used = 0;
  size_t peak = 0;
  // Device memory backing the allocations now (whole chunks of the device's pool; at least
  // `used`): what the driver sees taken. Device::TrimMemory lowers it to what live
  // allocations hold.
  size_t committed = 0;
};

// Thread-safe.
class Device {
 public:
  virtual ~Device() = default;

  virtual std::string Name() const = 0;
  // What this backend can do (tests/device_contract_test.cc checks each against the
  // behaviour).
  virtual DeviceCaps Caps() const = 0;
  // Caps().host_memory and Caps().compute_inline.
  bool IsHost() const { return Caps().host_memory; }
  bool ComputeRunsInline() const { return Caps().compute_inline; }

  // Device memory. ResourceExhausted (naming budget and use) when the budget is exceeded.
  virtual Result<void*> Alloc(size_t bytes) = 0;
  virtual void Free(void* ptr) = 0;
  virtual DeviceMemoryInfo MemoryInfo() const = 0;
  // Gives the memory no allocation holds back to the system (the driver, for torch and other
  // processes); later allocations take it again. REQUIRES: no queued work uses freed memory.
  // A device whose pool cannot shrink returns OK and keeps it (MemoryInfo().committed says).
  virtual Status TrimMemory() { return Status::OK(); }
  // Takes back what TrimMemory gave, where the device holds its whole budget from creation
  // (CUDA: ResourceExhausted when another library holds it now); the host device's pages come
  // at first touch, so there it does nothing.
  virtual Status RestoreMemory() { return Status::OK(); }

  // The stream the trainer computes on. For HostDevice (outside strict mode) this is the
  // calling thread itself: work "on" it runs immediately and waiting on it blocks the caller.
  virtual Stream* ComputeStream() = 0;
  // A new stream (copy, communication...). Owned by the device; valid until it is destroyed.
  virtual Result<Stream*> CreateStream(const std::string& name) = 0;

  // Asynchronous copies, ordered on `stream`. Host pointers should be pinned (registered).
  virtual Status CopyHostToDevice(void* dst, const void* src, size_t bytes, Stream* stream) = 0;
  virtual Status CopyDeviceToHost(void* dst, const void* src, size_t bytes, Stream* stream) = 0;
  virtual Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes, Stream* stream) = 0;
  // Runs `fn` on a host thread once the work before it on `stream` has completed; the work
  // after it waits for `fn` to return (like cudaLaunchHostFunc).
  virtual Status LaunchHostFunc(Stream* stream, std::function<void()> fn) = 0;

  virtual Result<std::unique_ptr<Event>> CreateEvent() = 0;
  // Marks the event at the current end of `stream`.
  virtual Status RecordEvent(Event* event, Stream* stream) = 0;
  // Work queued on `stream` after this call waits until `event` has completed. A never
  // recorded event counts as completed.
  virtual Status StreamWaitEvent(Stream* stream, Event* event) = 0;
  // Blocks the caller until `event` has completed.
  virtual Status SynchronizeEvent(Event* event) = 0;
  virtual bool EventDone(Event* event) = 0;
  virtual Status SynchronizeStream(Stream* stream) = 0;

  // Registers host memory for fast asynchronous copies (cudaHostRegister); a no-op on
  // HostDevice.
  virtual Status RegisterHostMemory(void* ptr, size_t bytes) = 0;
  virtual Status UnregisterHostMemory(void* ptr) = 0;

  // Rounds `n` fp32 values at `src` to bf16 at `dst` (both in this device's memory), ordered
  // on `stream`, with the CPU reference's rounding (Fp32ToBf16, cpu_adam.h: nearest even,
  // denormals to signed zero, NaN stays NaN): the halving of a gradient before it crosses the
  // link (zinf.gradient_transfer_dtype "bf16"). Argument errors are returned; failures while
  // running become the stream's error.
  virtual Status ConvertToBf16(uint16_t* dst, const float* src, size_t n, Stream* stream) = 0;

  // dst[i] += src[i] for n fp32 values in this device's memory, ordered on `stream`: one
  // correctly rounded addition each, as the host's `a += b` (gradients accumulated on the
  // device for the sub-groups it steps).
  virtual Status AddInto(float* dst, const float* src, size_t n, Stream* stream) = 0;
  // The quantized parameter gather (zero_quantized_weights): `n` values of `type` at `src`
  // encoded into Int8Bytes(n, block) bytes at `dst` (cpu_adam.h's QuantizeParamsInt8: int8
  // codes and an fp32 scale per block of `block` values, QuantBlockValid; a non-finite block
  // decodes to NaN), and decoded back into `type`; both pointers in this device's memory (the
  // int8 side 4-byte aligned, and `block` valid: InvalidArgument otherwise),
  // ordered on `stream`, bit-identical to the CPU functions on every device. Argument errors
  // are returned; failures while running become the stream's error.
  virtual Status QuantizeInt8(void* dst, const void* src, ParamCopyType type, size_t n,
                              size_t block, Stream* stream) = 0;
  virtual Status DequantizeInt8(void* dst, ParamCopyType type, const void* src, size_t n,
                                size_t block, Stream* stream) = 0;
  // The int4 gradient reduction (zero_quantized_gradients, zinf.quantized_gradient_bits 4):
  // `n` fp32 values at `src` encoded into Int4Bytes(n, block) bytes at `dst` (cpu_adam.h's
  // QuantizeGradsInt4: two codes per byte and an fp32 scale per block of `block` values) and
  // decoded back; as QuantizeInt8 otherwise (the int4 side 4-byte aligned, the CPU functions'
  // bits, argument errors returned).
  virtual Status QuantizeInt4(void* dst, const float* src, size_t n, size_t block,
                              Stream* stream) = 0;
  virtual Status DequantizeInt4(float* dst, const void* src, size_t n, size_t block,
                                Stream* stream) = 0;
  // The sum of squares (in double) of n fp32 values in this device's memory and whether one
  // is inf or NaN, written to *out_host once `stream` reaches this point (synchronize before
  // reading it): the clipping norm and the finite check of gradients kept on the device.
  // HostDevice: CpuOptimizer::GradSumSquares's order of additions (the engine's CPU sums, bit
  // for bit); CudaDevice: cuda::SumSquares (a fixed tree: deterministic, but a different
  // order of the double additions).
  virtual Status SumSquares(const float* x, size_t n, GradStats* out_host, Stream* stream) = 0;

  // One optimizer step ordered on `stream`, every pointer of `t` in this device's memory (the
  // engine steps the sub-groups whose states stay on the device with it). Bit-identical to
  // the CPU scalar reference (zinf/cpu_adam.h). The optimizers and state dtypes Caps() names
  // (HostDevice: the CPU kernel, ZINF_CPU_ISA or the best instruction set, on the stream's
  // thread, every optimizer and dtype; CudaDevice: the GPU kernel cuda::AdamStep, Adam and
  // AdamW with fp32 states); others NotSupported. Argument errors are returned; failures
  // while running become the stream's error.
  virtual Status OptimizerStep(const OptimizerHyperParams& hp, const OptimizerTensors& t,
                               Stream* stream) = 0;
};

struct HostDeviceOptions {
  size_t memory_budget = size_t{1} << 30;
  // Copies between "host" and "device" are throttled to this many GB/s (0 = memcpy speed),
  // to simulate a PCIe link when measuring overlap.
  double copy_gbps = 0;
  // Strict mode: the device behaves like CUDA where CUDA is unforgiving, so that an ordering
  // the engine forgot shows up here instead of on the first GPU run (tests; slower):
  //   - the compute stream is asynchronous (a worker thread, like every other stream): host
  //     code reads what it produced only after synchronising it;
  //   - each stream waits a random while before each operation (seeded by `strict_seed`, one
  //     generator per stream), so streams interleave differently from run to run of seeds;
  //   - host functions of all streams run one at a time on one thread (CUDA may serialise
  //     them), the stream waiting until its function returns;
  //   - copies read their source when they run, not when issued (as always here);
  //   - freed device memory is overwritten with 0xFF bytes (NaN as fp32 and bf16);
  //   - an event is done only once its stream has reached it (as always here);
  //   - a failed operation's error is sticky: every later launch on that stream returns it;
  //   - a host function that calls the device (a stream operation or SynchronizeEvent) gets
  //     FailedPrecondition, as CUDA forbids API calls in host functions.
  bool strict = false;
  uint64_t strict_seed = 0;
  // The pool is backed and trimmed (TrimMemory) in chunks of this many bytes (rounded up to
  // a multiple of 4 KiB; for a pool of more than 65,536 chunks, the next multiple of 2 MiB
  // that keeps the count there): 2 MiB, a huge page, by default; tests measuring what a trim
  // leaves use 4 KiB.
  size_t pool_chunk = size_t{2} << 20;
};

std::unique_ptr<Device> NewHostDevice(const HostDeviceOptions& options);

}  // namespace zinf
