// io_uring backend: one ring owned by the I/O thread, files and buffers registered once,
// READ_FIXED/WRITE_FIXED for requests inside registered memory, an eventfd poll to wake Reap.
#include <liburing.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "zinf/io.h"
#include "zinf/log.h"

namespace zinf {
namespace {

constexpr uint64_t kWakeTag = ~uint64_t{0};
// The kernel takes at most 1 GiB per registered buffer.
constexpr size_t kMaxRegisteredBuffer = size_t{1} << 30;

class IoUringBackend final : public IoBackend {
 public:
  explicit IoUringBackend(const IoBackendOptions& options) : options_(options) {}

  ~IoUringBackend() override {
    if (ring_ready_) io_uring_queue_exit(&ring_);  // waits for in-flight requests
    if (wake_fd_ >= 0) close(wake_fd_);
  }

  const char* Name() const override { return "io_uring"; }
  std::string Features() const override { return features_; }
  int InFlight() const override { return in_flight_; }
  int QueueDepth() const override { return static_cast<int>(options_.queue_depth); }

  Status Start(const std::vector<IoFile>& files,
               const std::vector<MemoryRegion>& regions) override {
    if (options_.queue_depth == 0) return Status::InvalidArgument("io_uring: queue depth is 0");
    wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake_fd_ < 0) return ErrnoToStatus(errno, "io_uring: eventfd");
    ZINF_RETURN_IF_ERROR(InitRing());
    for (const IoFile& f : files) fds_.push_back(f.fd);
    if (options_.register_files && !fds_.empty()) {
      int rc = io_uring_register_files(&ring_, fds_.data(), static_cast<unsigned>(fds_.size()));
      if (rc == 0) {
        files_registered_ = true;
        AddFeature("registered-files");
      } else {
        LogWarning("io_uring: the kernel refused to register files (" + std::string(strerror(-rc)) +
                   "); using plain file descriptors");
      }
    }
    regions_ = regions;
    if (options_.register_buffers && !regions.empty()) RegisterBuffers(regions);
    return ArmWakePoll();
  }

  Status SetBuffersRegistered(bool registered) override {
    if (in_flight_ != 0) {
      return Status::FailedPrecondition("io_uring: buffers re-registered with " +
                                        std::to_string(in_flight_) + " requests in flight");
    }
    if (!registered && !registered_.empty()) {
      int rc = io_uring_unregister_buffers(&ring_);
      if (rc != 0) return ErrnoToStatus(-rc, "io_uring_unregister_buffers");
      registered_.clear();  // (plain requests from now on)
      dropped_ = true;
    } else if (registered && dropped_) {
      dropped_ = false;
      RegisterBuffers(regions_);  // (a refusal warns and leaves plain requests: still correct)
    }
    return Status::OK();
  }

  Result<int> Submit(const IoRequest* reqs, int n) override {
    int room = static_cast<int>(options_.queue_depth) - in_flight_;
    int accepted = 0;
    for (; accepted < n && accepted < room; ++accepted) {
      io_uring_sqe* sqe = GetSqe();
      if (sqe == nullptr) break;
      Prepare(sqe, reqs[accepted]);
    }
    in_flight_ += accepted;
    if (accepted > 0) {
      int rc = SubmitPending();
      if (rc < 0) return ErrnoToStatus(-rc, "io_uring_submit");
    }
    return accepted;
  }

  Result<int> Reap(IoCompletion* out, int max, bool wait) override {
    for (;;) {
      int rc = wait ? io_uring_submit_and_wait(&ring_, 1) : io_uring_submit_and_get_events(&ring_);
      if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY && rc != -ETIME) {
        return ErrnoToStatus(-rc, "io_uring_enter (waiting for completions)");
      }
      bool woken = false;
      int got = 0;
      io_uring_cqe* cqe;
      unsigned head;
      unsigned seen = 0;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        if (got == max) break;
        ++seen;
        if (cqe->user_data == kWakeTag) {
          woken = true;
          continue;
        }
        out[got].tag = cqe->user_data;
        out[got].res = cqe->res;
        ++got;
      }
      io_uring_cq_advance(&ring_, seen);
      in_flight_ -= got;
      if (woken) {
        uint64_t value;
        // Drain the counter; EAGAIN means another wake already drained it.
        if (read(wake_fd_, &value, sizeof(value)) < 0 && errno != EAGAIN) {
          return ErrnoToStatus(errno, "io_uring: reading the wake eventfd");
        }
        ZINF_RETURN_IF_ERROR(ArmWakePoll());
      }
      if (got > 0 || woken || !wait || in_flight_ == 0) return got;
    }
  }

  void Wake() override {
    uint64_t one = 1;
    // EAGAIN only when the counter is saturated, which already wakes the poll.
    ssize_t rc = write(wake_fd_, &one, sizeof(one));
    (void)rc;
  }

 private:
  Status InitRing() {
    unsigned entries = options_.queue_depth + 2;  // + the wake poll
    struct Attempt {
      unsigned flags;
      const char* name;
    };
    std::vector<Attempt> attempts;
    unsigned base = options_.sqpoll ? IORING_SETUP_SQPOLL : 0;
    if (options_.defer_taskrun && !options_.sqpoll) {
      attempts.push_back(
          {IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN, "single-issuer defer-taskrun"});
    }
    if (!options_.sqpoll) attempts.push_back({IORING_SETUP_COOP_TASKRUN, "coop-taskrun"});
    attempts.push_back({base, options_.sqpoll ? "sqpoll" : ""});
    if (options_.sqpoll) attempts.push_back({0, ""});
    int last_rc = 0;
    for (size_t i = 0; i < attempts.size(); ++i) {
      io_uring_params params;
      std::memset(&params, 0, sizeof(params));
      params.flags = attempts[i].flags;
      if (params.flags & IORING_SETUP_SQPOLL) params.sq_thread_idle = 1000;
      int rc = io_uring_queue_init_params(entries, &ring_, &params);
      if (rc == 0) {
        ring_ready_ = true;
        if (i > 0) {
          LogWarning(std::string("io_uring: the kernel refused ") + attempts[0].name + " (" +
                     strerror(-last_rc) + "); using " +
                     (attempts[i].name[0] ? attempts[i].name : "a plain ring"));
        }
        if (attempts[i].name[0]) AddFeature(attempts[i].name);
        return Status::OK();
      }
      last_rc = rc;
    }
    // The usual causes: ENOMEM from a small RLIMIT_MEMLOCK (kernels before 5.12 count the
    // ring against it), EPERM from /proc/sys/kernel/io_uring_disabled or a container policy,
    // EMFILE from the file descriptor limit. The errno names which.
    return ErrnoToStatus(-last_rc,
                         "setting up an io_uring of " + std::to_string(entries) + " entries");
  }

  void RegisterBuffers(const std::vector<MemoryRegion>& regions) {
    std::vector<iovec> iov;
    for (const MemoryRegion& r : regions) {
      for (size_t off = 0; off < r.len; off += kMaxRegisteredBuffer) {
        iovec v;
        v.iov_base = static_cast<char*>(r.base) + off;
        v.iov_len = std::min(kMaxRegisteredBuffer, r.len - off);
        iov.push_back(v);
      }
    }
    int rc = io_uring_register_buffers(&ring_, iov.data(), static_cast<unsigned>(iov.size()));
    if (rc != 0) {
      LogWarning("io_uring: the kernel refused to register " + std::to_string(iov.size()) +
                 " buffer(s) (" + strerror(-rc) +
                 "; for non-root users RLIMIT_MEMLOCK limits registered memory: raise it with "
                 "`ulimit -l`); using unregistered buffers");
      return;
    }
    registered_ = std::move(iov);
    AddFeature("fixed-buffers");
  }

  io_uring_sqe* GetSqe() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) {
      // SQ ring full of unsubmitted entries: flush them and try once more.
      SubmitPending();
      sqe = io_uring_get_sqe(&ring_);
    }
    return sqe;
  }

  int SubmitPending() {
    int rc;
    do {
      rc = io_uring_submit(&ring_);
    } while (rc == -EINTR);
    // -EAGAIN/-EBUSY: the kernel is short of resources or the CQ is full; the entries stay in
    // the SQ ring and go with the next io_uring_enter in Reap.
    if (rc == -EAGAIN || rc == -EBUSY) return 0;
    return rc;
  }

  int BufferIndex(const void* buf, uint32_t len) const {
    auto p = static_cast<const char*>(buf);
    for (size_t i = 0; i < registered_.size(); ++i) {
      auto base = static_cast<const char*>(registered_[i].iov_base);
      if (p >= base && p + len <= base + registered_[i].iov_len) return static_cast<int>(i);
    }
    return -1;
  }

  void Prepare(io_uring_sqe* sqe, const IoRequest& r) {
    int fd = files_registered_ ? static_cast<int>(r.file) : fds_[r.file];
    int index = BufferIndex(r.buf, r.len);
    if (r.op == IoOp::kRead) {
      if (index >= 0) {
        io_uring_prep_read_fixed(sqe, fd, r.buf, r.len, r.offset, index);
      } else {
        io_uring_prep_read(sqe, fd, r.buf, r.len, r.offset);
      }
    } else {
      if (index >= 0) {
        io_uring_prep_write_fixed(sqe, fd, r.buf, r.len, r.offset, index);
      } else {
        io_uring_prep_write(sqe, fd, r.buf, r.len, r.offset);
      }
    }
    if (files_registered_) sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data64(sqe, r.tag);
  }

  Status ArmWakePoll() {
    io_uring_sqe* sqe = GetSqe();
    if (sqe == nullptr) return Status::Internal("io_uring: no submission entry for the wake poll");
    io_uring_prep_poll_add(sqe, wake_fd_, POLLIN);
    io_uring_sqe_set_data64(sqe, kWakeTag);
    int rc = SubmitPending();
    if (rc < 0) return ErrnoToStatus(-rc, "io_uring_submit (wake poll)");
    return Status::OK();
  }

  void AddFeature(const std::string& f) {
    if ((' ' + features_ + ' ').find(' ' + f + ' ') != std::string::npos) return;  // (again)
    if (!features_.empty()) features_ += ' ';
    features_ += f;
  }

  IoBackendOptions options_;
  io_uring ring_{};
  bool ring_ready_ = false;
  int wake_fd_ = -1;
  std::vector<int> fds_;
  bool files_registered_ = false;
  std::vector<MemoryRegion> regions_;  // as given to Start
  std::vector<iovec> registered_;      // empty: plain requests
  bool dropped_ = false;               // SetBuffersRegistered(false) unregistered them
  int in_flight_ = 0;
  std::string features_;
};

}  // namespace

std::unique_ptr<IoBackend> NewIoUringBackend(const IoBackendOptions& options) {
  return std::make_unique<IoUringBackend>(options);
}

}  // namespace zinf
