// psync backend: worker threads doing one pread/pwrite per request. The portable fallback
// (any filesystem, no io_uring or AIO needed) and the reference the other backends are
// tested against. Workers are plain threads, not a compute pool: they block in syscalls.
#include <unistd.h>

#include <cerrno>
#include <deque>
#include <thread>
#include <vector>

#include "common/thread_annotations.h"
#include "zinf/io.h"

namespace zinf {
namespace {

class PsyncBackend final : public IoBackend {
 public:
  explicit PsyncBackend(const IoBackendOptions& options) : options_(options) {}

  ~PsyncBackend() override {
    {
      MutexLock lock(&mu_);
      stop_ = true;
    }
    work_cv_.NotifyAll();
    for (auto& t : workers_) t.join();
  }

  const char* Name() const override { return "psync"; }
  std::string Features() const override { return std::to_string(workers_.size()) + "-threads"; }
  int InFlight() const override { return in_flight_; }
  int QueueDepth() const override { return static_cast<int>(options_.queue_depth); }

  Status Start(const std::vector<IoFile>& files, const std::vector<MemoryRegion>&) override {
    if (options_.queue_depth == 0) return Status::InvalidArgument("psync: queue depth is 0");
    for (const IoFile& f : files) fds_.push_back(f.fd);
    uint32_t n = options_.psync_threads ? options_.psync_threads
                                        : std::min<uint32_t>(options_.queue_depth, 16);
    for (uint32_t i = 0; i < n; ++i) workers_.emplace_back([this] { WorkerLoop(); });
    return Status::OK();
  }

  Result<int> Submit(const IoRequest* reqs, int n) override {
    int room = static_cast<int>(options_.queue_depth) - in_flight_;
    int count = std::min(n, room);
    if (count <= 0) return 0;
    {
      MutexLock lock(&mu_);
      for (int i = 0; i < count; ++i) queue_.push_back(reqs[i]);
    }
    in_flight_ += count;
    work_cv_.NotifyAll();
    return count;
  }

  Result<int> Reap(IoCompletion* out, int max, bool wait) override {
    MutexLock lock(&mu_);
    if (wait) {
      while (done_.empty() && !woken_) done_cv_.Wait(&mu_);
    }
    woken_ = false;
    int got = 0;
    while (got < max && !done_.empty()) {
      out[got++] = done_.front();
      done_.pop_front();
    }
    in_flight_ -= got;
    return got;
  }

  void Wake() override {
    {
      MutexLock lock(&mu_);
      woken_ = true;
    }
    done_cv_.NotifyAll();
  }

 private:
  void WorkerLoop() {
    for (;;) {
      IoRequest r;
      {
        MutexLock lock(&mu_);
        while (!stop_ && queue_.empty()) work_cv_.Wait(&mu_);
        if (queue_.empty()) return;  // stop_ and drained
        r = queue_.front();
        queue_.pop_front();
      }
      ssize_t rc = r.op == IoOp::kRead
                       ? pread(fds_[r.file], r.buf, r.len, static_cast<off_t>(r.offset))
                       : pwrite(fds_[r.file], r.buf, r.len, static_cast<off_t>(r.offset));
      IoCompletion c{r.tag, rc < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(rc)};
      {
        MutexLock lock(&mu_);
        done_.push_back(c);
      }
      done_cv_.NotifyOne();
    }
  }

  IoBackendOptions options_;
  std::vector<int> fds_;
  std::vector<std::thread> workers_;
  int in_flight_ = 0;  // I/O thread only

  Mutex mu_;
  CondVar work_cv_;
  CondVar done_cv_;
  std::deque<IoRequest> queue_ GUARDED_BY(mu_);
  std::deque<IoCompletion> done_ GUARDED_BY(mu_);
  bool woken_ GUARDED_BY(mu_) = false;
  bool stop_ GUARDED_BY(mu_) = false;
};

}  // namespace

std::unique_ptr<IoBackend> NewPsyncBackend(const IoBackendOptions& options) {
  return std::make_unique<PsyncBackend>(options);
}

}  // namespace zinf
