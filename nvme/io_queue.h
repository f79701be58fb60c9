// IoQueue: turns transfers (any length) into backend requests and sees each one through.
//
// It owns one I/O thread that owns the backend (io_uring's SINGLE_ISSUER wants one thread).
// Transfers are cut into requests of at most block_size bytes and up to queue_depth requests
// stay in flight. Every completion is checked: a negative result fails the transfer with a
// Status naming file, offset and length; a short transfer is resubmitted for the rest; -EAGAIN
// and -EINTR are retried (bounded). A failed transfer issues nothing more, waits for its
// in-flight requests, then reports.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <thread>
#include <vector>

#include "common/thread_annotations.h"
#include "zinf/io.h"

namespace zinf {

struct Transfer {
  IoOp op = IoOp::kRead;
  uint32_t file = 0;
  uint64_t offset = 0;
  void* buf = nullptr;
  uint64_t len = 0;
  // Issued before every normal transfer not yet issued (after earlier urgent ones): for data
  // someone is waiting on now, e.g. a parameter the trainer needs, ahead of write-backs.
  bool urgent = false;
};

// Runs on the I/O thread once the transfer has ended; must be short and must not block.
using TransferDone = std::function<void(const Status&)>;

struct IoQueueOptions {
  uint32_t block_size = 1 << 20;  // largest request; a multiple of 4096
  uint32_t max_retries = 100;     // per request, for -EAGAIN/-EINTR
};

struct IoQueueStats {
  uint64_t requests = 0;
  uint64_t short_resubmits = 0;
  uint64_t retries = 0;
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
};

class IoQueue {
 public:
  // Starts the I/O thread, which starts `backend` on `files` and `regions`.
  static Result<std::unique_ptr<IoQueue>> Start(std::unique_ptr<IoBackend> backend,
                                                std::vector<IoFile> files,
                                                std::vector<MemoryRegion> regions,
                                                const IoQueueOptions& options);
  // Finishes every submitted transfer (their callbacks run), then stops the thread.
  ~IoQueue();
  IoQueue(const IoQueue&) = delete;
  IoQueue& operator=(const IoQueue&) = delete;

  // Thread-safe. REQUIRES: t.file < number of files; t.buf valid until `done` runs.
  void Submit(const Transfer& t, TransferDone done);

  // Runs `fn` on the I/O thread once no transfer is active or in flight (transfers submitted
  // just before may still be queued, not yet taken: callers wait for theirs first, as
  // SwapStore does, and submit nothing meanwhile), and returns its result. For the backend's own
  // settings (IoBackend::SetBuffersRegistered). FailedPrecondition when the queue stops first.
  // Never from the I/O thread (a TransferDone): it would wait for itself.
  Status RunWhenIdle(std::function<Status(IoBackend*)> fn) EXCLUDES(mu_);

  const char* BackendName() const { return backend_name_; }
  std::string Features() const { return features_; }  // fixed after Start
  const std::vector<IoFile>& files() const { return files_; }
  IoQueueStats Stats() const;

 private:
  struct Job;
  struct Piece;
  struct Control {
    std::function<Status(IoBackend*)> fn;
    std::promise<Status> done;
  };

  IoQueue(std::unique_ptr<IoBackend> backend, std::vector<IoFile> files,
          std::vector<MemoryRegion> regions, const IoQueueOptions& options);
  void ThreadMain(std::promise<Status>* started);
  void Loop();
  // Moves new jobs in; false when stopping with nothing left.
  bool TakeIncoming(bool block);
  // Runs the queued RunWhenIdle functions (the queue is idle).
  void RunControls();
  Status FillQueue();
  void OnCompletion(const IoCompletion& c);
  void FinishPiece(Piece* piece);
  void FailJob(Job* job, Status status);
  std::string Describe(const Job& job, uint64_t offset, uint64_t len) const;

  std::unique_ptr<IoBackend> backend_;
  const std::vector<IoFile> files_;
  const std::vector<MemoryRegion> regions_;
  const IoQueueOptions options_;
  const char* backend_name_;
  std::string features_;
  std::thread thread_;

  // I/O thread only.
  std::deque<std::unique_ptr<Job>> active_;  // jobs with bytes left to issue or in flight
  std::vector<Piece> pieces_;                // slab, one per queue slot; tag = index
  std::vector<uint32_t> free_pieces_;
  std::deque<uint32_t> resubmit_;  // pieces to issue again (short or EAGAIN)
  Status fatal_;                   // a backend failure: everything after fails

  mutable Mutex mu_;
  CondVar cv_;
  std::deque<std::unique_ptr<Job>> incoming_ GUARDED_BY(mu_);
  std::deque<Control> controls_ GUARDED_BY(mu_);
  bool stopping_ GUARDED_BY(mu_) = false;
  bool in_reap_ GUARDED_BY(mu_) = false;  // the thread may block in Reap
  IoQueueStats stats_ GUARDED_BY(mu_);
};

}  // namespace zinf
