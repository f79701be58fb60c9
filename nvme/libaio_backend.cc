// libaio backend: Linux native AIO (io_submit/io_getevents). Truly asynchronous only with
// O_DIRECT. A poll iocb on an eventfd lets Wake() end a blocked io_getevents.
#include <libaio.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "zinf/io.h"
#include "zinf/log.h"

namespace zinf {
namespace {

constexpr uint64_t kWakeTag = ~uint64_t{0};

class LibaioBackend final : public IoBackend {
 public:
  explicit LibaioBackend(const IoBackendOptions& options) : options_(options) {}

  ~LibaioBackend() override {
    if (ctx_ready_) {
      // Outstanding requests still use caller buffers: collect them before destroying.
      while (in_flight_ > 0) {
        std::vector<io_event> events(options_.queue_depth + 1);
        int rc = io_getevents(ctx_, 1, static_cast<long>(events.size()), events.data(), nullptr);
        if (rc < 0 && rc != -EINTR) break;
        for (int i = 0; i < rc; ++i) {
          if (events[i].data != reinterpret_cast<void*>(kWakeTag)) --in_flight_;
        }
      }
      io_destroy(ctx_);
    }
    if (wake_fd_ >= 0) close(wake_fd_);
  }

  const char* Name() const override { return "libaio"; }
  std::string Features() const override { return wake_poll_ ? "wake-poll" : ""; }
  int InFlight() const override { return in_flight_; }
  int QueueDepth() const override { return static_cast<int>(options_.queue_depth); }

  Status Start(const std::vector<IoFile>& files, const std::vector<MemoryRegion>&) override {
    if (options_.queue_depth == 0) return Status::InvalidArgument("libaio: queue depth is 0");
    int rc = io_setup(static_cast<int>(options_.queue_depth) + 1, &ctx_);
    if (rc < 0) {
      return ErrnoToStatus(-rc,
                           "io_setup (raise /proc/sys/fs/aio-max-nr or lower the queue depth)");
    }
    ctx_ready_ = true;
    for (const IoFile& f : files) fds_.push_back(f.fd);
    iocbs_.resize(options_.queue_depth);
    for (auto& cb : iocbs_) free_.push_back(&cb);
    wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake_fd_ < 0) return ErrnoToStatus(errno, "libaio: eventfd");
    rc = ArmWakePoll();
    if (rc < 0) {
      LogWarning(std::string("libaio: the kernel refused a poll request (") + strerror(-rc) +
                 "); new requests wait for the next completion");
    } else {
      wake_poll_ = true;
    }
    return Status::OK();
  }

  Result<int> Submit(const IoRequest* reqs, int n) override {
    int count = std::min<int>(n, static_cast<int>(free_.size()));
    if (count <= 0) return 0;
    std::vector<iocb*> batch(count);
    for (int i = 0; i < count; ++i) {
      iocb* cb = free_.back();
      free_.pop_back();
      const IoRequest& r = reqs[i];
      if (r.op == IoOp::kRead) {
        io_prep_pread(cb, fds_[r.file], r.buf, r.len, static_cast<long long>(r.offset));
      } else {
        io_prep_pwrite(cb, fds_[r.file], r.buf, r.len, static_cast<long long>(r.offset));
      }
      cb->data = reinterpret_cast<void*>(r.tag);
      batch[i] = cb;
    }
    int done = 0;
    while (done < count) {
      int rc = io_submit(ctx_, count - done, batch.data() + done);
      if (rc == -EINTR) continue;
      if (rc == -EAGAIN || rc == 0) break;  // kernel out of resources: reap, then resubmit
      if (rc < 0) {
        for (int i = done; i < count; ++i) free_.push_back(batch[i]);
        if (done > 0) {
          in_flight_ += done;
          return done;
        }
        return ErrnoToStatus(-rc, "io_submit");
      }
      done += rc;
    }
    for (int i = done; i < count; ++i) free_.push_back(batch[i]);
    in_flight_ += done;
    return done;
  }

  Result<int> Reap(IoCompletion* out, int max, bool wait) override {
    std::vector<io_event>& events = events_;
    events.resize(static_cast<size_t>(max));
    timespec zero{0, 0};
    for (;;) {
      // Without the wake poll a blocked wait must not outlast new work forever: cap it.
      timespec cap{0, 5 * 1000 * 1000};
      timespec* timeout = !wait ? &zero : (wake_poll_ ? nullptr : &cap);
      int rc = io_getevents(ctx_, wait ? 1 : 0, max, events.data(), timeout);
      if (rc == -EINTR) continue;
      if (rc < 0) return ErrnoToStatus(-rc, "io_getevents");
      int got = 0;
      bool woken = false;
      for (int i = 0; i < rc; ++i) {
        if (events[i].data == reinterpret_cast<void*>(kWakeTag)) {
          woken = true;
          continue;
        }
        out[got].tag = reinterpret_cast<uint64_t>(events[i].data);
        // res is an unsigned long holding bytes or -errno.
        out[got].res = static_cast<long>(events[i].res);
        free_.push_back(events[i].obj);
        ++got;
      }
      in_flight_ -= got;
      if (woken) {
        uint64_t value;
        if (read(wake_fd_, &value, sizeof(value)) < 0 && errno != EAGAIN) {
          return ErrnoToStatus(errno, "libaio: reading the wake eventfd");
        }
        int arm = ArmWakePoll();
        if (arm < 0) return ErrnoToStatus(-arm, "io_submit (wake poll)");
      }
      if (got > 0 || woken || !wait || !wake_poll_) return got;
    }
  }

  void Wake() override {
    uint64_t one = 1;
    ssize_t rc = write(wake_fd_, &one, sizeof(one));
    (void)rc;
  }

 private:
  int ArmWakePoll() {
    io_prep_poll(&wake_cb_, wake_fd_, POLLIN);
    wake_cb_.data = reinterpret_cast<void*>(kWakeTag);
    iocb* cb = &wake_cb_;
    int rc;
    do {
      rc = io_submit(ctx_, 1, &cb);
    } while (rc == -EINTR);
    return rc < 0 ? rc : 0;
  }

  IoBackendOptions options_;
  io_context_t ctx_ = nullptr;
  bool ctx_ready_ = false;
  std::vector<int> fds_;
  std::vector<iocb> iocbs_;
  std::vector<iocb*> free_;
  std::vector<io_event> events_;
  iocb wake_cb_{};
  int wake_fd_ = -1;
  bool wake_poll_ = false;
  int in_flight_ = 0;
};

}  // namespace

std::unique_ptr<IoBackend> NewLibaioBackend(const IoBackendOptions& options) {
  return std::make_unique<LibaioBackend>(options);
}

}  // namespace zinf
