// psync backend: worker threads doing one pread/pwrite per request. The portable fallback
// (any filesystem, no io_uring or AIO needed) and the reference the other backends are
// tested against. Workers are plain threads, not a compute pool: they block in syscalls.
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "zinf/io.h"

namespace zinf {
namespace {

class PsyncBackend final : public IoBackend {
 public:
  explicit PsyncBackend(const IoBackendOptions& options) : options_(options) {}

  ~PsyncBackend() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
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
      std::lock_guard<std::mutex> lock(mu_);
      for (int i = 0; i < count; ++i) queue_.push_back(reqs[i]);
    }
    in_flight_ += count;
    work_cv_.notify_all();
    return count;
  }

  Result<int> Reap(IoCompletion* out, int max, bool wait) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (wait) done_cv_.wait(lock, [this] { return !done_.empty() || woken_; });
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
      std::lock_guard<std::mutex> lock(mu_);
      woken_ = true;
    }
    done_cv_.notify_all();
  }

 private:
  void WorkerLoop() {
    for (;;) {
      IoRequest r;
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and drained
        r = queue_.front();
        queue_.pop_front();
      }
      ssize_t rc = r.op == IoOp::kRead
                       ? pread(fds_[r.file], r.buf, r.len, static_cast<off_t>(r.offset))
                       : pwrite(fds_[r.file], r.buf, r.len, static_cast<off_t>(r.offset));
      IoCompletion c{r.tag, rc < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(rc)};
      {
        std::lock_guard<std::mutex> lock(mu_);
        done_.push_back(c);
      }
      done_cv_.notify_one();
    }
  }

  IoBackendOptions options_;
  std::vector<int> fds_;
  std::vector<std::thread> workers_;
  int in_flight_ = 0;  // I/O thread only

  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<IoRequest> queue_;    // guarded by mu_
  std::deque<IoCompletion> done_;  // guarded by mu_
  bool woken_ = false;             // guarded by mu_
  bool stop_ = false;              // guarded by mu_
};

}  // namespace

std::unique_ptr<IoBackend> NewPsyncBackend(const IoBackendOptions& options) {
  return std::make_unique<PsyncBackend>(options);
}

}  // namespace zinf
