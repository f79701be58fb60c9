// HostDevice: the Device seam on plain host memory, for tests and CPU-only runs.
//
// Memory is aligned host memory counted against a budget. The compute stream is the calling
// thread (in strict mode a worker like the others: see HostDeviceOptions::strict); every other
// stream is a worker thread that runs its tasks in FIFO order. Copies are
// memcpy, optionally throttled to a simulated PCIe link (see CopyLink). Events record a
// generation; waits are on condition variables, never sleep-and-poll.
//
// Lifetimes: the device owns its streams and must outlive every use of them; destroying the
// device drains every stream's queue, then joins its thread. Events may be destroyed at any
// time (queued waits and markers keep the event's state alive).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/thread_annotations.h"
#include "device/device_pool.h"
#include "zinf/device.h"
#include "zinf/status.h"

namespace zinf {

// Every HostDevice allocation starts on a page boundary, so device buffers may also be used
// for O_DIRECT I/O and never share a cache line.
inline constexpr size_t kHostDeviceAlignment = 4096;

// One direction of a simulated PCIe link. A copy reserves the link for bytes / bandwidth
// seconds, starting when the link is free; copies issued by several streams in the same
// direction therefore share the bandwidth (their reservations queue up), while the two
// directions are independent links (PCIe is full duplex). Thread-safe.
class CopyLink {
 public:
  using Clock = std::chrono::steady_clock;

  // REQUIRES: gbps > 0 (10^9 bytes per second).
  explicit CopyLink(double gbps);

  // Reserves the link for `bytes`, starting at max(now, end of the previous reservation).
  // Returns the end of this reservation: the earliest time the transfer may complete.
  Clock::time_point Reserve(size_t bytes, Clock::time_point now);

  // The number of bytes a copy moves per reservation: a few milliseconds' worth (at least
  // 1 MiB), so that concurrent streams interleave instead of one large copy holding the
  // link for its whole duration, while each sleep stays long against wake-up latency.
  size_t chunk_bytes() const { return chunk_bytes_; }

 private:
  const double bytes_per_second_;
  const size_t chunk_bytes_;
  Mutex mu_;
  Clock::time_point free_at_ GUARDED_BY(mu_);  // end of the last reservation
};

class HostStream;
class HostEvent;
class HostFuncRunner;

// Thread-safe (every method may be called from any thread).
class HostDevice final : public Device {
 public:
  explicit HostDevice(const HostDeviceOptions& options);
  // Drains every stream's queued work, joins the stream threads and frees any allocation
  // still live. REQUIRES: no thread is using the device or its streams any more.
  ~HostDevice() override;
  HostDevice(const HostDevice&) = delete;
  HostDevice& operator=(const HostDevice&) = delete;

  std::string Name() const override;
  DeviceCaps Caps() const override {
    DeviceCaps c;
    c.host_memory = true;
    c.compute_inline = !options_.strict;
    // The CPU kernels, every optimizer and state dtype; parameters anywhere.
    c.step_kinds =
        DeviceCaps::Kind(OptimizerKind::kAdam) | DeviceCaps::Kind(OptimizerKind::kAdamW) |
        DeviceCaps::Kind(OptimizerKind::kAdagrad) | DeviceCaps::Kind(OptimizerKind::kLion);
    c.step_compressed_states = true;
    return c;
  }
  bool strict() const { return options_.strict; }

  // `bytes` (exactly, not rounded to the alignment) count against the budget. Alloc(0)
  // returns a unique pointer that counts for nothing.
  Result<void*> Alloc(size_t bytes) override;
  // Frees at once. REQUIRES: ptr came from Alloc on this device and is not freed yet (checked:
  // anything else aborts); no queued work still uses it. Free(nullptr) does nothing.
  void Free(void* ptr) override;
  DeviceMemoryInfo MemoryInfo() const override;
  // madvise(MADV_DONTNEED) on the pool's free 2 MiB chunks: the process's resident memory
  // drops by what they held. Strict mode also makes them inaccessible (PROT_NONE) until an
  // allocation takes them again, then fills them with 0xFF (NaN) like a freed buffer.
  Status TrimMemory() override;

  Stream* ComputeStream() override;
  Result<Stream*> CreateStream(const std::string& name) override;

  // Copies on a worker stream are queued; on the compute stream they run before returning
  // (outside strict mode, as everything below that says "compute stream").
  // Host <-> device copies are throttled by the per-direction link when copy_gbps > 0;
  // device -> device copies are not (device memory bandwidth is far above the link's).
  Status CopyHostToDevice(void* dst, const void* src, size_t bytes, Stream* stream) override;
  Status CopyDeviceToHost(void* dst, const void* src, size_t bytes, Stream* stream) override;
  Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes, Stream* stream) override;
  // On a worker stream `fn` runs on that stream's thread; on the compute stream it runs on the
  // caller's thread before this returns. An exception escaping `fn` becomes the stream's error.
  Status LaunchHostFunc(Stream* stream, std::function<void()> fn) override;

  // Like LaunchHostFunc, for work that can fail (LocalComm's collectives). On a worker stream
  // a non-OK result becomes the stream's sticky error (see SynchronizeStream); on the compute
  // stream `task` runs before this returns and its Status is returned.
  Status LaunchHostTask(Stream* stream, std::function<Status()> task);

  Result<std::unique_ptr<Event>> CreateEvent() override;
  // Events of any HostDevice may be mixed (they hold no reference to their device).
  Status RecordEvent(Event* event, Stream* stream) override;
  // Captures the event's latest record now: records made later do not change what the
  // queued wait waits for. On the compute stream the caller blocks until it completes.
  Status StreamWaitEvent(Stream* stream, Event* event) override;
  // The Status of a completed record is its stream's sticky error at the time the record ran,
  // so errors propagate along event dependencies (a stream that waits on a failed record
  // takes its error). SynchronizeEvent returns that Status.
  Status SynchronizeEvent(Event* event) override;
  // REQUIRES: `event` is a HostDevice event (checked: it cannot report an error).
  bool EventDone(Event* event) override;
  // Waits until every task queued on `stream` before the call has run; returns the stream's
  // sticky error: the first failure of any of its tasks, reported by every later call too.
  // A failed task does not stop the stream: later tasks (and event records) still run, so
  // nothing waiting on the stream hangs. OK at once for the compute stream.
  Status SynchronizeStream(Stream* stream) override;

  Status RegisterHostMemory(void* ptr, size_t bytes) override { return Status::OK(); }
  Status UnregisterHostMemory(void* ptr) override { return Status::OK(); }

  // The CPU kernel as a task of `stream` (LaunchHostTask), with the instruction set chosen
  // SelectCpuIsa picks (ZINF_CPU_ISA or the best); arguments are checked before it is queued.
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

 private:
  // Strict mode: FailedPrecondition when called from a host function (CUDA forbids device
  // calls there), naming `what`.
  Status CheckNotInHostFunc(const char* what) const;
  // A stream of this device, or an InvalidArgument naming `what` (the calling operation); in
  // strict mode, refused from a host function (CheckNotInHostFunc).
  Result<HostStream*> OwnStream(Stream* stream, const char* what);
  Status Copy(const char* what, CopyLink* link, void* dst, const void* src, size_t bytes,
              Stream* stream);

  const HostDeviceOptions options_;
  // Null when copy_gbps == 0 (copies run at memcpy speed).
  std::unique_ptr<CopyLink> h2d_link_;
  std::unique_ptr<CopyLink> d2h_link_;

  // Device memory is one reservation made at construction (virtual until touched) and
  // sub-allocated: freed ranges keep their pages, so a buffer reused every step is not
  // faulted in again (a fresh 4 KiB page costs ~12 us here), until TrimMemory.
  char* pool_base_ = nullptr;  // set once in the constructor
  size_t pool_bytes_ = 0;
  DevicePool pool_;

  std::unique_ptr<HostFuncRunner> runner_;  // strict mode only: runs every host function
  // SumSquares's kernel (one thread; made at the first call).
  Mutex sums_mu_;
  std::unique_ptr<CpuOptimizer> sums_ GUARDED_BY(sums_mu_);  // made on first use
  std::unique_ptr<HostStream> compute_stream_;
  std::atomic<uint64_t> next_stream_index_{1};  // strict mode's seeds (0: compute)
  Mutex streams_mu_;
  std::vector<std::unique_ptr<HostStream>> streams_ GUARDED_BY(streams_mu_);
};

}  // namespace zinf
