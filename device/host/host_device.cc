#include "device/host/host_device.h"

#include <sys/mman.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <random>
#include <set>
#include <system_error>
#include <utility>

#include "zinf/align.h"
#include "zinf/log.h"

namespace zinf {

namespace {
constexpr int kMadvPopulateWrite = 23;  // MADV_POPULATE_WRITE (Linux 5.14; glibc 2.36 names it)
}  // namespace
namespace {

// The state behind an Event, shared with the markers and waits queued on streams so that the
// Event object itself may be destroyed while they are pending (as cudaEventDestroy allows).
//
// Every record gets the next generation number. A record is pending from RecordEvent until
// its marker runs. Generations, not a done flag, make re-recording safe: a wait captures the
// generation recorded at the time it is issued and is not confused by a later record (still
// pending) or by an earlier one (completing late).
struct EventState {
  Mutex mu;
  CondVar cv;
  uint64_t last_recorded GUARDED_BY(mu) = 0;  // 0 = never recorded
  std::set<uint64_t> pending GUARDED_BY(mu);  // recorded, marker not yet run
  Status status GUARDED_BY(mu);               // of the most recently completed record

  uint64_t Record() EXCLUDES(mu) {
    MutexLock lock(&mu);
    pending.insert(++last_recorded);
    return last_recorded;
  }
  void Complete(uint64_t generation, Status record_status) EXCLUDES(mu) {
    {
      MutexLock lock(&mu);
      pending.erase(generation);
      status = std::move(record_status);
    }
    cv.NotifyAll();
  }
  uint64_t Latest() EXCLUDES(mu) {
    MutexLock lock(&mu);
    return last_recorded;
  }
  bool Done(uint64_t generation) EXCLUDES(mu) {
    MutexLock lock(&mu);
    return pending.count(generation) == 0;
  }
  Status Wait(uint64_t generation) EXCLUDES(mu) {
    MutexLock lock(&mu);
    while (pending.count(generation) != 0) cv.Wait(&mu);
    return status;
  }
};

}  // namespace

class HostEvent final : public Event {
 public:
  HostEvent() : state_(std::make_shared<EventState>()) {}
  const std::shared_ptr<EventState>& state() const { return state_; }

 private:
  std::shared_ptr<EventState> state_;
};

// Strict mode: the one thread every stream's host functions run on, one at a time (as CUDA
// may run them). A stream's worker hands its host function over and waits for it to return.
class HostFuncRunner {
 public:
  HostFuncRunner() : thread_([this] { Main(); }) {}
  ~HostFuncRunner() {
    {
      MutexLock lock(&mu_);
      stopping_ = true;
    }
    cv_.NotifyAll();
    thread_.join();
  }
  HostFuncRunner(const HostFuncRunner&) = delete;
  HostFuncRunner& operator=(const HostFuncRunner&) = delete;

  bool OnRunnerThread() const { return std::this_thread::get_id() == thread_.get_id(); }

  // Runs `fn` on the runner thread and waits for it; an exception escaping `fn` is rethrown
  // here (the stream's worker turns it into the stream's error).
  void RunAndWait(const std::function<void()>& fn) EXCLUDES(mu_) {
    Job job{&fn, nullptr, false};
    {
      MutexLock lock(&mu_);
      queue_.push_back(&job);
    }
    cv_.NotifyAll();
    MutexLock lock(&mu_);
    while (!job.done) cv_.Wait(&mu_);
    if (job.error) std::rethrow_exception(job.error);
  }

 private:
  struct Job {
    const std::function<void()>* fn;
    std::exception_ptr error;  // written by the runner before `done`, read by the submitter after
    bool done;                 // under mu_
  };

  void Main() EXCLUDES(mu_) {
    for (;;) {
      Job* job = nullptr;
      {
        MutexLock lock(&mu_);
        while (!stopping_ && queue_.empty()) cv_.Wait(&mu_);
        if (queue_.empty()) return;
        job = queue_.front();
        queue_.pop_front();
      }
      try {
        (*job->fn)();
      } catch (...) {
        job->error = std::current_exception();
      }
      {
        MutexLock lock(&mu_);
        job->done = true;
      }
      cv_.NotifyAll();
    }
  }

  Mutex mu_;
  CondVar cv_;
  std::deque<Job*> queue_ GUARDED_BY(mu_);  // each waited for by its submitter
  bool stopping_ GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: started once the rest is initialised
};

// A FIFO of tasks run by one worker thread, or (the compute stream, unless strict) the
// calling thread.
class HostStream final : public Stream {
 public:
  using Task = std::function<Status()>;

  // `strict`: the device's strict mode (asynchronous compute stream, random delays before each
  // task drawn from a generator seeded with `seed`, sticky errors refused at submission).
  HostStream(const HostDevice* owner, std::string name, bool is_compute, bool strict, uint64_t seed)
      : owner_(owner),
        name_(std::move(name)),
        inline_(is_compute && !strict),
        strict_(strict),
        rng_(seed) {}
  // Drains the queue, then joins the worker.
  ~HostStream() override { Stop(); }

  // Starts the worker thread (not for the compute stream). May throw std::system_error.
  void Start() {
    thread_ = std::thread([this] { WorkerMain(); });
  }
  // Asks the worker to exit once its queue is empty; does not wait.
  void RequestStop() EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      stopping_ = true;
    }
    work_cv_.NotifyOne();
  }
  void Stop() {
    RequestStop();
    if (thread_.joinable()) thread_.join();
  }

  const std::string& name() const override { return name_; }
  const HostDevice* owner() const { return owner_; }
  // The compute stream outside strict mode: work runs on the calling thread before returning.
  bool runs_inline() const { return inline_; }

  // Inline (compute) stream: runs `task` now and returns its Status. Worker stream: queues it
  // and returns OK; a failure becomes the sticky error, which strict mode returns from every
  // later Submit (nothing is queued then).
  Status Submit(Task task) EXCLUDES(mu_) {
    if (inline_) return RunTask(task);
    {
      MutexLock lock(&mu_);
      ZINF_CHECK_MSG(!stopping_, "work submitted to a HostDevice stream being destroyed");
      if (strict_ && !error_.ok()) return error_;
      queue_.push_back(std::move(task));
      ++submitted_;
    }
    work_cv_.NotifyOne();
    return Status::OK();
  }

  Status Synchronize() EXCLUDES(mu_) {
    if (inline_) return Status::OK();
    // A task that waits for its own stream would wait forever.
    ZINF_CHECK_MSG(std::this_thread::get_id() != thread_.get_id(),
                   "SynchronizeStream called from a task of the same stream");
    MutexLock lock(&mu_);
    const uint64_t target = submitted_;
    while (completed_ < target) done_cv_.Wait(&mu_);
    return error_;
  }

  Status error() const EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return error_;
  }

 private:
  Status RunTask(const Task& task) const {
    try {
      return task();
    } catch (const std::exception& e) {
      return Status::Internal("a host task on stream '" + name_ + "' threw: " + e.what());
    } catch (...) {
      return Status::Internal("a host task on stream '" + name_ + "' threw a non-std exception");
    }
  }

  // Before each task in strict mode: nothing half the time, else a yield or a sleep of up to
  // half a millisecond, so that streams interleave in orders a GPU could produce.
  void StrictDelay() {
    const uint64_t r = rng_();
    switch (r % 8) {
      case 0:
      case 1:
      case 2:
      case 3:
        break;
      case 4:
      case 5:
        std::this_thread::yield();
        break;
      default:
        std::this_thread::sleep_for(std::chrono::microseconds((r >> 8) % 500));
        break;
    }
  }

  void WorkerMain() EXCLUDES(mu_) {
    for (;;) {
      Task task;
      {
        MutexLock lock(&mu_);
        while (!stopping_ && queue_.empty()) work_cv_.Wait(&mu_);
        if (queue_.empty()) return;  // stopping, and drained
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      if (strict_) StrictDelay();
      Status s = RunTask(task);
      task = nullptr;  // release what the task captured before reporting completion
      {
        MutexLock lock(&mu_);
        if (!s.ok() && error_.ok()) error_ = s.WithContext("stream '" + name_ + "'");
        ++completed_;
      }
      done_cv_.NotifyAll();
    }
  }

  const HostDevice* const owner_;
  const std::string name_;
  const bool inline_;
  const bool strict_;
  std::mt19937_64 rng_;  // worker thread only: the strict mode's delays
  std::thread thread_;   // owned; joined by Stop

  mutable Mutex mu_;
  CondVar work_cv_;  // the worker waits for tasks or stopping_
  CondVar done_cv_;  // Synchronize waits for completed_
  std::deque<Task> queue_ GUARDED_BY(mu_);
  uint64_t submitted_ GUARDED_BY(mu_) = 0;
  uint64_t completed_ GUARDED_BY(mu_) = 0;
  bool stopping_ GUARDED_BY(mu_) = false;
  Status error_ GUARDED_BY(mu_);  // the first failure, sticky
};

namespace {

// Strict mode: stream `index` (0 = compute, then in creation order) draws its delays from its
// own generator, so a seed reproduces each stream's sequence.
uint64_t StreamSeed(const HostDeviceOptions& options, uint64_t index) {
  return options.strict_seed ^ ((index + 1) * 0x9E3779B97F4A7C15ull);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// CopyLink

CopyLink::CopyLink(double gbps)
    : bytes_per_second_(gbps * 1e9),
      chunk_bytes_(std::max<size_t>(size_t{1} << 20, static_cast<size_t>(gbps * 1e9 * 2e-3))) {
  ZINF_CHECK(gbps > 0);
}

CopyLink::Clock::time_point CopyLink::Reserve(size_t bytes, Clock::time_point now) {
  const auto duration = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(static_cast<double>(bytes) / bytes_per_second_));
  MutexLock lock(&mu_);
  free_at_ = std::max(now, free_at_) + duration;
  return free_at_;
}

namespace {

// memcpy, then (with a link) hold the copy until the link would have carried the bytes.
// Chunked so that copies of several streams sharing the link interleave.
void LinkCopy(CopyLink* link, void* dst, const void* src, size_t bytes) {
  if (link == nullptr) {
    std::memmove(dst, src, bytes);
    return;
  }
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  for (size_t offset = 0; offset < bytes;) {
    const size_t len = std::min(link->chunk_bytes(), bytes - offset);
    const auto deadline = link->Reserve(len, CopyLink::Clock::now());
    std::memmove(d + offset, s + offset, len);
    std::this_thread::sleep_until(deadline);  // simulated transfer time, not a poll
    offset += len;
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// HostDevice

HostDevice::HostDevice(const HostDeviceOptions& options)
    : options_(options),
      pool_("HostDevice", "HostDeviceOptions::memory_budget", options.memory_budget,
            kHostDeviceAlignment),
      compute_stream_(std::make_unique<HostStream>(this, "compute", /*is_compute=*/true,
                                                   options.strict, StreamSeed(options, 0))) {
  if (options_.strict) {
    runner_ = std::make_unique<HostFuncRunner>();
    compute_stream_->Start();
  }
  if (options_.copy_gbps > 0) {
    h2d_link_ = std::make_unique<CopyLink>(options_.copy_gbps);
    d2h_link_ = std::make_unique<CopyLink>(options_.copy_gbps);
  }
  // Twice the budget of address space, so fragmentation never refuses what the budget allows;
  // under an address-space limit (ulimit -v) that refuses it, the budget itself.
  const size_t huge = size_t{2} << 20;
  const size_t one = RoundUp(options_.memory_budget + 1, huge);  // always past the budget
  void* p = MAP_FAILED;
  int err = 0;
  for (size_t bytes : {2 * one, one}) {
    pool_bytes_ = bytes;
    // One huge page more, to start the pool on a 2 MiB boundary: its chunks are then whole
    // huge pages, which a trim drops and the next touch faults in again as one page each.
    p = mmap(nullptr, pool_bytes_ + huge, PROT_READ | PROT_WRITE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p != MAP_FAILED) {
      char* raw = static_cast<char*>(p);
      char* aligned = reinterpret_cast<char*>(RoundUp(reinterpret_cast<uintptr_t>(raw), huge));
      // Cannot fail for whole pages of a mapping just made; the excess is only address space.
      if (aligned > raw) (void)munmap(raw, aligned - raw);
      if (aligned + pool_bytes_ < raw + pool_bytes_ + huge) {
        (void)munmap(aligned + pool_bytes_, raw + pool_bytes_ + huge - (aligned + pool_bytes_));
      }
      p = aligned;
      break;
    }
    err = errno;
  }
  if (p == MAP_FAILED) {
    rlimit as{};
    const bool limited = getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY;
    const std::string why =
        "reserving " + FormatBytes(pool_bytes_) + " of address space for the budget of " +
        FormatBytes(options_.memory_budget) + " failed (" + std::strerror(err) + ")" +
        (limited ? "; the address-space limit (ulimit -v) is " + FormatBytes(as.rlim_cur) +
                       ": raise it or lower the device budget"
                 : ": lower the device budget");
    LogWarning("HostDevice: " + why + "; every allocation will fail");
    pool_.SetUnavailable(why);
    pool_bytes_ = 0;
  } else {
    madvise(p, pool_bytes_, MADV_HUGEPAGE);
    pool_base_ = static_cast<char*>(p);
    DevicePool::Backing backing;
    // pool_chunk (2 MiB, a huge page, by default), or for a pool of more than 65,536 of
    // those, the next multiple of 2 MiB that keeps the count there.
    backing.chunk =
        RoundUp(std::max(options_.pool_chunk, kHostDeviceAlignment), kHostDeviceAlignment);
    if (pool_bytes_ / 65536 > backing.chunk) backing.chunk = RoundUp(pool_bytes_ / 65536, huge);
    const bool strict = options_.strict;
    if (strict && mprotect(p, pool_bytes_, PROT_NONE) != 0) {
      LogWarning(std::string("HostDevice: mprotect(PROT_NONE) of the pool failed (") +
                 std::strerror(errno) + "); trimmed memory stays readable");
    }
    backing.commit = [strict](char* addr, size_t bytes) -> Status {
      if (!strict) {
        // Faulted in here, in one call (huge pages where the kernel has them), rather than
        // page by page by the first copy into them. Kernels before 5.14 lack it: then they
        // fault in at first touch.
        (void)madvise(addr, bytes, kMadvPopulateWrite);
        return Status::OK();
      }
      if (mprotect(addr, bytes, PROT_READ | PROT_WRITE) != 0) {
        return Status::IoError(std::string("mprotect(PROT_READ|PROT_WRITE) of ") +
                               FormatBytes(bytes) + " failed: " + std::strerror(errno));
      }
      std::memset(addr, 0xFF, bytes);  // never-written memory reads NaN, as a freed buffer
      return Status::OK();
    };
    backing.decommit = [strict](char* addr, size_t bytes) -> Status {
      if (madvise(addr, bytes, MADV_DONTNEED) != 0) {
        return Status::IoError(std::string("madvise(MADV_DONTNEED) of ") + FormatBytes(bytes) +
                               " failed: " + std::strerror(errno));
      }
      if (strict && mprotect(addr, bytes, PROT_NONE) != 0) {
        return Status::IoError(std::string("mprotect(PROT_NONE) of ") + FormatBytes(bytes) +
                               " failed: " + std::strerror(errno));
      }
      return Status::OK();
    };
    pool_.SetRange(pool_base_, pool_bytes_, std::move(backing));
  }
}

HostDevice::~HostDevice() {
  {
    MutexLock lock(&streams_mu_);
    // Let all streams drain concurrently (one may wait on another's event), then join.
    compute_stream_->RequestStop();
    for (auto& s : streams_) s->RequestStop();
    for (auto& s : streams_) s->Stop();
    compute_stream_->Stop();
    streams_.clear();
  }
  runner_.reset();  // after every stream: their host functions run on it
  if (pool_base_ != nullptr) munmap(pool_base_, pool_bytes_);
}

std::string HostDevice::Name() const {
  std::string name = "host (budget " + FormatBytes(options_.memory_budget);
  if (options_.copy_gbps > 0) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), ", link %.3g GB/s per direction)", options_.copy_gbps);
    name += buf;
  } else {
    name += ", copies at memcpy speed)";
  }
  return name;
}

Result<void*> HostDevice::Alloc(size_t bytes) { return pool_.Allocate(bytes); }

void HostDevice::Free(void* ptr) {
  if (!options_.strict) return pool_.Free(ptr);
  // Work still queued on the buffer (a missing wait) reads NaN instead of the old values.
  pool_.Free(ptr, [](void* p, size_t bytes) { std::memset(p, 0xFF, bytes); });
}

DeviceMemoryInfo HostDevice::MemoryInfo() const { return pool_.Info(); }

Status HostDevice::TrimMemory() { return pool_.Trim(); }

Stream* HostDevice::ComputeStream() { return compute_stream_.get(); }

Result<Stream*> HostDevice::CreateStream(const std::string& name) {
  const uint64_t index = next_stream_index_.fetch_add(1);
  auto stream = std::make_unique<HostStream>(this, name, /*is_compute=*/false, options_.strict,
                                             StreamSeed(options_, index));
  try {
    stream->Start();
  } catch (const std::system_error& e) {
    return Status::ResourceExhausted("HostDevice: cannot start a thread for stream '" + name +
                                     "': " + e.what());
  }
  MutexLock lock(&streams_mu_);
  streams_.push_back(std::move(stream));
  return static_cast<Stream*>(streams_.back().get());
}

Status HostDevice::CheckNotInHostFunc(const char* what) const {
  if (runner_ != nullptr && runner_->OnRunnerThread()) {
    return Status::FailedPrecondition(
        std::string(what) +
        " called from a host function (strict mode): CUDA forbids device calls there; do the "
        "work on a thread of your own and order it with events");
  }
  return Status::OK();
}

Result<HostStream*> HostDevice::OwnStream(Stream* stream, const char* what) {
  ZINF_RETURN_IF_ERROR(CheckNotInHostFunc(what));
  if (stream == nullptr) return Status::InvalidArgument(std::string(what) + ": stream is null");
  auto* hs = dynamic_cast<HostStream*>(stream);
  if (hs == nullptr || hs->owner() != this) {
    return Status::InvalidArgument(std::string(what) + ": stream '" + stream->name() +
                                   "' does not belong to this HostDevice");
  }
  return hs;
}

Status HostDevice::Copy(const char* what, CopyLink* link, void* dst, const void* src, size_t bytes,
                        Stream* stream) {
  ZINF_ASSIGN_OR_RETURN(HostStream * hs, OwnStream(stream, what));
  if (bytes == 0) return Status::OK();
  if (dst == nullptr || src == nullptr) {
    return Status::InvalidArgument(std::string(what) + " of " + std::to_string(bytes) +
                                   " bytes on stream '" + hs->name() +
                                   "': " + (dst == nullptr ? "dst" : "src") + " is null");
  }
  return hs->Submit([link, dst, src, bytes] {
    LinkCopy(link, dst, src, bytes);
    return Status::OK();
  });
}

Status HostDevice::CopyHostToDevice(void* dst, const void* src, size_t bytes, Stream* stream) {
  return Copy("CopyHostToDevice", h2d_link_.get(), dst, src, bytes, stream);
}

Status HostDevice::CopyDeviceToHost(void* dst, const void* src, size_t bytes, Stream* stream) {
  return Copy("CopyDeviceToHost", d2h_link_.get(), dst, src, bytes, stream);
}

Status HostDevice::CopyDeviceToDevice(void* dst, const void* src, size_t bytes, Stream* stream) {
  return Copy("CopyDeviceToDevice", nullptr, dst, src, bytes, stream);
}

namespace {

// Fp32ToBf16 (cpu_adam.h) branch-free, so that the loop vectorises (checked equal on all 2^32
// inputs): NaN stays a quiet NaN, a denormal becomes a signed zero, anything else rounds to
// nearest even.
inline uint16_t ToBf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t zero = (bits >> 16) & 0x8000u;
  const uint32_t nan = (bits >> 16) | 0x0040u;
  const uint32_t r = (bits & 0x7f800000u) == 0 ? zero : rounded;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? nan : r);
}

}  // namespace

Status HostDevice::ConvertToBf16(uint16_t* dst, const float* src, size_t n, Stream* stream) {
  ZINF_RETURN_IF_ERROR(OwnStream(stream, "ConvertToBf16").status());
  if (n == 0) return Status::OK();
  if (dst == nullptr || src == nullptr) {
    return Status::InvalidArgument(std::string("ConvertToBf16 of ") + std::to_string(n) +
                                   " values: " + (dst == nullptr ? "dst" : "src") + " is null");
  }
  return LaunchHostTask(stream, [dst, src, n] {
    for (size_t i = 0; i < n; ++i) dst[i] = ToBf16(src[i]);
    return Status::OK();
  });
}

Status HostDevice::AddInto(float* dst, const float* src, size_t n, Stream* stream) {
  ZINF_RETURN_IF_ERROR(OwnStream(stream, "AddInto").status());
  if (n == 0) return Status::OK();
  if (dst == nullptr || src == nullptr) {
    return Status::InvalidArgument(std::string("AddInto of ") + std::to_string(n) +
                                   " values: " + (dst == nullptr ? "dst" : "src") + " is null");
  }
  return LaunchHostTask(stream, [dst, src, n] {
    for (size_t i = 0; i < n; ++i) dst[i] += src[i];
    return Status::OK();
  });
}

namespace {

// `blocks`: the int8 or int4 side (dst of QuantizeInt8/Int4, src of DequantizeInt8/Int4), whose
// fp32 scales a GPU reads as words: 4-byte aligned on every device.
Status QuantizeArguments(const char* what, void* dst, const void* src, size_t n, size_t block,
                         const void* blocks) {
  if (dst == nullptr || src == nullptr) {
    return Status::InvalidArgument(std::string(what) + " of " + std::to_string(n) +
                                   " values: " + (dst == nullptr ? "dst" : "src") + " is null");
  }
  return CheckQuantBlocks(what, blocks, block);
}

}  // namespace

Status HostDevice::QuantizeInt8(void* dst, const void* src, ParamCopyType type, size_t n,
                                size_t block, Stream* stream) {
  ZINF_RETURN_IF_ERROR(OwnStream(stream, "QuantizeInt8").status());
  if (n == 0) return Status::OK();
  ZINF_RETURN_IF_ERROR(QuantizeArguments("QuantizeInt8", dst, src, n, block, dst));
  return LaunchHostTask(stream, [dst, src, type, n, block] {
    QuantizeParamsInt8(src, type, n, dst, block);
    return Status::OK();
  });
}

Status HostDevice::DequantizeInt8(void* dst, ParamCopyType type, const void* src, size_t n,
                                  size_t block, Stream* stream) {
  ZINF_RETURN_IF_ERROR(OwnStream(stream, "DequantizeInt8").status());
  if (n == 0) return Status::OK();
  ZINF_RETURN_IF_ERROR(QuantizeArguments("DequantizeInt8", dst, src, n, block, src));
  return LaunchHostTask(stream, [dst, type, src, n, block] {
    DequantizeParamsInt8(src, n, type, dst, block);
    return Status::OK();
  });
}

Status HostDevice::QuantizeInt4(void* dst, const float* src, size_t n, size_t block,
                                Stream* stream) {
  ZINF_RETURN_IF_ERROR(OwnStream(stream, "QuantizeInt4").status());
  if (n == 0) return Status::OK();
  ZINF_RETURN_IF_ERROR(QuantizeArguments("QuantizeInt4", dst, src, n, block, dst));
  return LaunchHostTask(stream, [dst, src, n, block] {
    QuantizeGradsInt4(src, n, dst, block);
    return Status::OK();
  });
}

Status HostDevice::DequantizeInt4(float* dst, const void* src, size_t n, size_t block,
                                  Stream* stream) {
  ZINF_RETURN_IF_ERROR(OwnStream(stream, "DequantizeInt4").status());
  if (n == 0) return Status::OK();
  ZINF_RETURN_IF_ERROR(QuantizeArguments("DequantizeInt4", dst, src, n, block, src));
  return LaunchHostTask(stream, [dst, src, n, block] {
    DequantizeGradsInt4(src, n, dst, block);
    return Status::OK();
  });
}

Status HostDevice::SumSquares(const float* x, size_t n, GradStats* out_host, Stream* stream) {
  ZINF_RETURN_IF_ERROR(OwnStream(stream, "SumSquares").status());
  if (out_host == nullptr) return Status::InvalidArgument("SumSquares: out_host is null");
  if (n > 0 && x == nullptr) {
    return Status::InvalidArgument("SumSquares of " + std::to_string(n) + " values: x is null");
  }
  CpuOptimizer* sums = nullptr;
  {
    MutexLock lock(&sums_mu_);
    if (sums_ == nullptr) {
      CpuOptimizer::Options o;
      o.num_threads = 1;
      ZINF_ASSIGN_OR_RETURN(sums_, CpuOptimizer::Create(o));
    }
    sums = sums_.get();
  }
  return LaunchHostTask(stream, [sums, x, n, out_host] {
    ZINF_ASSIGN_OR_RETURN(*out_host, sums->GradSumSquares(x, GradType::kF32, n));
    return Status::OK();
  });
}

Status HostDevice::OptimizerStep(const OptimizerHyperParams& hp, const OptimizerTensors& t,
                                 Stream* stream) {
  ZINF_RETURN_IF_ERROR(ValidateOptimizerStep(hp, t).WithContext("HostDevice::OptimizerStep"));
  ZINF_ASSIGN_OR_RETURN(CpuIsa isa, SelectCpuIsa());
  return LaunchHostTask(stream, [hp, t, isa] {
    return zinf::OptimizerStep(hp, t, isa).WithContext("HostDevice::OptimizerStep");
  });
}

Status HostDevice::LaunchHostFunc(Stream* stream, std::function<void()> fn) {
  ZINF_ASSIGN_OR_RETURN(HostStream * hs, OwnStream(stream, "LaunchHostFunc"));
  if (!fn) return Status::InvalidArgument("LaunchHostFunc: the function is empty");
  HostFuncRunner* runner = runner_.get();
  return hs->Submit([fn = std::move(fn), runner] {
    if (runner != nullptr) {
      runner->RunAndWait(fn);  // strict: one thread for every stream's host functions
    } else {
      fn();
    }
    return Status::OK();
  });
}

Status HostDevice::LaunchHostTask(Stream* stream, std::function<Status()> task) {
  ZINF_ASSIGN_OR_RETURN(HostStream * hs, OwnStream(stream, "LaunchHostTask"));
  if (!task) return Status::InvalidArgument("LaunchHostTask: the task is empty");
  return hs->Submit(std::move(task));
}

Result<std::unique_ptr<Event>> HostDevice::CreateEvent() {
  return std::unique_ptr<Event>(std::make_unique<HostEvent>());
}

namespace {

Result<HostEvent*> AsHostEvent(Event* event, const char* what) {
  if (event == nullptr) return Status::InvalidArgument(std::string(what) + ": event is null");
  auto* he = dynamic_cast<HostEvent*>(event);
  if (he == nullptr) {
    return Status::InvalidArgument(std::string(what) +
                                   ": the event was not created by a HostDevice");
  }
  return he;
}

}  // namespace

Status HostDevice::RecordEvent(Event* event, Stream* stream) {
  ZINF_ASSIGN_OR_RETURN(HostEvent * he, AsHostEvent(event, "RecordEvent"));
  ZINF_ASSIGN_OR_RETURN(HostStream * hs, OwnStream(stream, "RecordEvent"));
  std::shared_ptr<EventState> state = he->state();
  const uint64_t generation = state->Record();
  if (hs->runs_inline()) {
    // Everything issued on the compute stream has already run.
    state->Complete(generation, Status::OK());
    return Status::OK();
  }
  Status queued = hs->Submit([hs, state, generation] {
    // Runs on hs's worker: error() is the sticky error of the work before this marker.
    state->Complete(generation, hs->error());
    return Status::OK();
  });
  // Refused (strict mode's sticky error): the record completes with that error, so that
  // nothing waiting on the event hangs.
  if (!queued.ok()) state->Complete(generation, queued);
  return queued;
}

Status HostDevice::StreamWaitEvent(Stream* stream, Event* event) {
  ZINF_ASSIGN_OR_RETURN(HostEvent * he, AsHostEvent(event, "StreamWaitEvent"));
  ZINF_ASSIGN_OR_RETURN(HostStream * hs, OwnStream(stream, "StreamWaitEvent"));
  std::shared_ptr<EventState> state = he->state();
  // The record to wait for is fixed now, at issue time, as cudaStreamWaitEvent does.
  const uint64_t generation = state->Latest();
  if (generation == 0) return Status::OK();  // never recorded: complete
  return hs->Submit([state, generation] { return state->Wait(generation); });
}

Status HostDevice::SynchronizeEvent(Event* event) {
  ZINF_RETURN_IF_ERROR(CheckNotInHostFunc("SynchronizeEvent"));
  ZINF_ASSIGN_OR_RETURN(HostEvent * he, AsHostEvent(event, "SynchronizeEvent"));
  const uint64_t generation = he->state()->Latest();
  if (generation == 0) return Status::OK();
  return he->state()->Wait(generation);
}

bool HostDevice::EventDone(Event* event) {
  auto he = AsHostEvent(event, "EventDone");
  ZINF_CHECK_MSG(he.ok(), "EventDone: null event or not a HostDevice event");
  const auto& state = (*he)->state();
  return state->Done(state->Latest());
}

Status HostDevice::SynchronizeStream(Stream* stream) {
  ZINF_ASSIGN_OR_RETURN(HostStream * hs, OwnStream(stream, "SynchronizeStream"));
  return hs->Synchronize();
}

std::unique_ptr<Device> NewHostDevice(const HostDeviceOptions& options) {
  return std::make_unique<HostDevice>(options);
}

}  // namespace zinf
