#include "common/folder_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <string>

#include "common/file_io.h"

namespace zinf {
namespace {

// "pid 1234, zinf-train --nvme x" from /proc (the command line's NULs as spaces).
std::string ThisProcess() {
  std::string cmd;
  if (FILE* f = std::fopen("/proc/self/cmdline", "rb")) {
    char buf[512];
    size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
    std::fclose(f);
    for (size_t i = 0; i < n; ++i) cmd += buf[i] == '\0' ? ' ' : buf[i];
    while (!cmd.empty() && cmd.back() == ' ') cmd.pop_back();
  }
  return "pid " + std::to_string(getpid()) + (cmd.empty() ? "" : ", " + cmd);
}

// The error for a lock someone else holds: the holder as the file names it.
Status HeldBy(int fd, const std::string& dir, const std::string& what) {
  std::string holder;
  char buf[600];
  ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
  if (n > 0) holder.assign(buf, static_cast<size_t>(n));
  while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
  const std::string me = "pid " + std::to_string(getpid());
  const bool self = holder == me || holder.rfind(me + ",", 0) == 0;
  return Status::FailedPrecondition(
      what + " " + dir + " is in use by " + (holder.empty() ? "another process" : holder) +
      (self ? " (this process: another engine or store of it)" : "") +
      "; two runs must not share it: stop that run, or use another folder");
}

// Records this process as the holder (for the next one's error message).
Status WriteHolder(int fd, const std::string& path) {
  const std::string text = ThisProcess() + "\n";
  if (ftruncate(fd, 0) != 0) return ErrnoToStatus(errno, "truncating the lock file " + path);
  return PwriteAll(fd, text.data(), text.size(), 0, path);
}

}  // namespace

Result<std::unique_ptr<FolderLock>> FolderLock::Acquire(const std::string& dir,
                                                        const std::string& file_name,
                                                        const std::string& what, bool shared) {
  const std::string path = dir + "/" + file_name;
  int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0)
    return ErrnoToStatus(errno, "opening the lock file " + path + " of " + what + " " + dir);
  if (flock(fd, (shared ? LOCK_SH : LOCK_EX) | LOCK_NB) != 0) {
    const int err = errno;
    Status s = err == EWOULDBLOCK ? HeldBy(fd, dir, what) : ErrnoToStatus(err, "locking " + path);
    close(fd);
    return s;
  }
  if (!shared) {
    Status s = WriteHolder(fd, path);
    if (!s.ok()) {
      close(fd);
      return s;
    }
  }
  return std::unique_ptr<FolderLock>(new FolderLock(fd, path, dir, what, shared));
}

Status FolderLock::MakeExclusive() {
  if (!shared_) return Status::OK();
  if (flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    return errno == EWOULDBLOCK ? HeldBy(fd_, dir_, what_)
                                : ErrnoToStatus(errno, "locking " + path_);
  }
  shared_ = false;
  return WriteHolder(fd_, path_);
}

FolderLock::~FolderLock() {
  // Closing drops the lock; the file stays (removing it would race with a next holder that
  // opened it already).
  close(fd_);
}

}  // namespace zinf
