#include "common/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "zinf/log.h"

namespace zinf {

Status PwriteAll(int fd, const void* buf, size_t n, uint64_t off, const std::string& path) {
  const char* p = static_cast<const char*>(buf);
  while (n > 0) {
    ssize_t w = pwrite(fd, p, std::min<size_t>(n, 1 << 30), static_cast<off_t>(off));
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, "writing " + path + " at offset " + std::to_string(off));
    }
    p += w;
    n -= static_cast<size_t>(w);
    off += static_cast<uint64_t>(w);
  }
  return Status::OK();
}

Status PreadAll(int fd, void* buf, size_t n, uint64_t off, const std::string& path,
                const char* short_means) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    ssize_t r = pread(fd, p, std::min<size_t>(n, 1 << 30), static_cast<off_t>(off));
    if (r < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, "reading " + path + " at offset " + std::to_string(off));
    }
    if (r == 0) {
      return Status::Corruption(path + " ends at offset " + std::to_string(off) +
                                ", before the data it should hold (" + short_means + ")");
    }
    p += r;
    n -= static_cast<size_t>(r);
    off += static_cast<uint64_t>(r);
  }
  return Status::OK();
}

Status FsyncPath(const std::string& path, bool directory) {
  int fd = open(path.c_str(), (directory ? O_DIRECTORY : 0) | O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoToStatus(errno, "opening " + path + " to fsync it");
  int rc = fsync(fd);
  int err = errno;
  close(fd);
  if (rc != 0) return ErrnoToStatus(err, "fsync of " + path);
  return Status::OK();
}

Result<int> CreateExclusive(const std::string& path) {
  if (unlink(path.c_str()) != 0 && errno != ENOENT) {
    return ErrnoToStatus(errno, "removing a leftover " + path);
  }
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoToStatus(errno, "creating " + path);
  return fd;
}

Status ReplaceFile(const std::string& path, const void* data, size_t n,
                   const ReplaceFileOptions& options) {
  const std::string tmp = path + ".tmp";
  ZINF_ASSIGN_OR_RETURN(int fd, CreateExclusive(tmp));
  Status s = PwriteAll(fd, data, n, 0, tmp);
  if (s.ok() && fsync(fd) != 0) s = ErrnoToStatus(errno, "fsync of " + tmp);
  if (close(fd) != 0 && s.ok()) s = ErrnoToStatus(errno, "closing " + tmp);
  if (s.ok() && options.before_rename) s = options.before_rename();
  if (s.ok() && rename(tmp.c_str(), path.c_str()) != 0) {
    s = ErrnoToStatus(errno, "renaming " + tmp + " to " + path);
  }
  if (!s.ok()) {
    unlink(tmp.c_str());
    return s;
  }
  if (options.renamed != nullptr) *options.renamed = true;
  const size_t slash = path.rfind('/');
  return FsyncPath(slash == std::string::npos ? "." : path.substr(0, std::max<size_t>(slash, 1)),
                   /*directory=*/true);
}

Status ReplaceFile(const std::string& path, std::string_view text) {
  return ReplaceFile(path, text.data(), text.size());
}

namespace {
const char* FileKind(mode_t mode) {
  if (S_ISDIR(mode)) return "a folder";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}
}  // namespace

Result<int> OpenRegularFile(const std::string& path, const std::string& what, uint64_t* size) {
  if (path.find('\0') != std::string::npos) {
    return Status::InvalidArgument(what + ": the path holds a NUL character; give a plain path");
  }
  int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return ErrnoToStatus(errno, what + ": opening " + path);
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    int err = errno;
    close(fd);
    return ErrnoToStatus(err, what + ": stat of " + path);
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    return Status::InvalidArgument(what + ": " + path + " is " + FileKind(st.st_mode) +
                                   ", not a regular file; give a file");
  }
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    int err = errno;
    close(fd);
    return ErrnoToStatus(err, what + ": fcntl of " + path);
  }
  if (size != nullptr) *size = static_cast<uint64_t>(st.st_size);
  return fd;
}

Result<std::string> ReadSmallFile(const std::string& path, size_t limit) {
  uint64_t size = 0;
  ZINF_ASSIGN_OR_RETURN(int fd, OpenRegularFile(path, "reading", &size));
  if (size > limit) {
    close(fd);
    return Status::Corruption(path + " holds " + FormatBytes(size) + ", more than the " +
                              FormatBytes(limit) + " such a file may hold");
  }
  std::string text(static_cast<size_t>(size), '\0');
  Status s = PreadAll(fd, text.data(), text.size(), 0, path, "it changed while being read");
  close(fd);
  ZINF_RETURN_IF_ERROR(s);
  return text;
}

}  // namespace zinf
