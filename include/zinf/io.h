// The I/O backend seam: raw asynchronous reads and writes on registered files.
//
// A backend moves bytes and reports each request's raw result (bytes or -errno); it neither
// retries nor splits. IoQueue (nvme/io_queue.h) sits on top: it cuts transfers into
// block-size requests, keeps the queue full, resubmits short transfers and -EAGAIN, and turns
// errors into Status. Backends: io_uring (default), libaio, psync (threads + pread/pwrite), and
// FaultyBackend, a wrapper that injects faults for tests.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "zinf/status.h"

namespace zinf {

enum class IoOp : uint8_t { kRead, kWrite };
const char* IoOpName(IoOp op);

enum class IoBackendKind { kIoUring, kLibaio, kPsync };
const char* IoBackendKindName(IoBackendKind kind);
Result<IoBackendKind> ParseIoBackendKind(const std::string& name);

// One raw request. `file` indexes the files given to Start().
struct IoRequest {
  uint64_t tag = 0;  // returned in the completion
  IoOp op = IoOp::kRead;
  uint32_t file = 0;
  uint64_t offset = 0;
  void* buf = nullptr;
  uint32_t len = 0;
};

struct IoCompletion {
  uint64_t tag = 0;
  int64_t res = 0;  // bytes transferred (may be short), or -errno
};

// An open file the backend will serve.
struct IoFile {
  int fd = -1;
  std::string path;  // for messages
};

// A memory range the backend may register once (io_uring fixed buffers).
struct MemoryRegion {
  void* base = nullptr;
  size_t len = 0;
};

struct IoBackendOptions {
  uint32_t queue_depth = 32;     // most requests in flight
  bool register_buffers = true;  // io_uring: READ_FIXED/WRITE_FIXED for registered regions
  bool register_files = true;    // io_uring: IOSQE_FIXED_FILE
  bool sqpoll = false;           // io_uring: kernel submission thread (costs a core)
  bool defer_taskrun = true;     // io_uring: SINGLE_ISSUER|DEFER_TASKRUN when the kernel has it
  uint32_t psync_threads = 0;    // psync: worker threads; 0 = queue_depth capped at 16
};

// Thread-compatible, single owner: Start, Submit and Reap are called from one thread (the I/O
// thread); Wake may be called from any thread.
class IoBackend {
 public:
  virtual ~IoBackend() = default;

  virtual const char* Name() const = 0;
  // Features actually in use after Start ("fixed-buffers registered-files defer-taskrun").
  virtual std::string Features() const = 0;

  // Binds the backend to the calling thread, registers `files` and, where supported,
  // `regions`. Features the kernel refuses fall back with one warning line.
  virtual Status Start(const std::vector<IoFile>& files,
                       const std::vector<MemoryRegion>& regions) = 0;

  // Queues requests; returns how many were accepted (>= 1 unless n == 0 or the backend is
  // full: at most queue_depth minus in-flight).
  virtual Result<int> Submit(const IoRequest* reqs, int n) = 0;

  // Collects up to `max` completions. When `wait` is true and nothing has completed, blocks
  // until one completes or Wake() is called (then may return 0).
  virtual Result<int> Reap(IoCompletion* out, int max, bool wait) = 0;

  // Makes a blocked Reap return. Thread-safe.
  virtual void Wake() = 0;

  virtual int InFlight() const = 0;
  virtual int QueueDepth() const = 0;

  // Drops (false) or restores (true) the registration of the regions given to Start, so that
  // their memory can be released (madvise) and faulted in again: io_uring's fixed buffers pin
  // the pages they were registered with. Unregistered regions are served with plain requests.
  // Called on the I/O thread with nothing in flight. Backends that register nothing: OK.
  virtual Status SetBuffersRegistered(bool /*registered*/) { return Status::OK(); }
};

Result<std::unique_ptr<IoBackend>> NewIoBackend(IoBackendKind kind,
                                                const IoBackendOptions& options);
std::unique_ptr<IoBackend> NewIoUringBackend(const IoBackendOptions& options);
std::unique_ptr<IoBackend> NewLibaioBackend(const IoBackendOptions& options);
std::unique_ptr<IoBackend> NewPsyncBackend(const IoBackendOptions& options);

// Faults a FaultyBackend injects. `request` counts the requests submitted through the wrapper
// (0-based); a rule fires on every request whose index is in [first, first + count) and whose
// op matches (or any op when `any_op`).
struct IoFault {
  enum class Kind {
    kError,  // completes with -errno_value (EIO, ENOSPC, EAGAIN...) without touching the file
    kShort,  // transfers only `short_bytes` bytes (the rest must be resubmitted)
    kTorn,   // write: only `short_bytes` reach the file, yet the request reports full success
    kDelay,  // completes after `delay_us` microseconds
  };
  Kind kind = Kind::kError;
  uint64_t first = 0;
  uint64_t count = 1;
  bool any_op = true;
  IoOp op = IoOp::kRead;
  int errno_value = 5;  // EIO
  uint32_t short_bytes = 4096;
  uint32_t delay_us = 0;
};

// Thread-safe controller shared by a test and its FaultyBackend.
class FaultPlan {
 public:
  FaultPlan();
  ~FaultPlan();
  FaultPlan(const FaultPlan&) = delete;
  FaultPlan& operator=(const FaultPlan&) = delete;

  void Add(const IoFault& fault);
  // Adds `fault` with its first request `ahead` requests after those counted so far, read
  // under the same lock: a request that another thread issues meanwhile (a prefetch, a
  // write-back) cannot slip between reading requests() and adding the rule, leaving a rule
  // whose request has passed. Returns the rule's first request.
  uint64_t AddAhead(IoFault fault, uint64_t ahead);
  void Clear();
  // Requests seen so far.
  uint64_t requests() const;
  // Requests a rule fired on so far.
  uint64_t fired() const;
  // Counts one request of `op`; returns true and fills *fault when a rule fires for it.
  bool Next(IoOp op, IoFault* fault);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Wraps `inner`, applying `plan` to every request.
std::unique_ptr<IoBackend> NewFaultyBackend(std::unique_ptr<IoBackend> inner,
                                            std::shared_ptr<FaultPlan> plan);

}  // namespace zinf
