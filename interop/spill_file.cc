#include "interop/spill_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>
#include <vector>

#include "zinf/cpu_adam.h"

namespace zinf {

Result<HostValueType> ParseHostValueType(std::string_view name) {
  if (name == "float32") return HostValueType::kF32;
  if (name == "bfloat16") return HostValueType::kBf16;
  if (name == "float16") return HostValueType::kF16;
  return Status::InvalidArgument("parameter dtype " + std::string(name) +
                                 ": zinf manages float32, bfloat16 and float16 parameters");
}

size_t HostValueSize(HostValueType type) { return type == HostValueType::kF32 ? 4 : 2; }

void HostValuesToF32(const void* src, HostValueType type, float* dst, size_t n) {
  switch (type) {
    case HostValueType::kF32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case HostValueType::kBf16:
      for (size_t i = 0; i < n; ++i) dst[i] = Bf16ToFp32(static_cast<const uint16_t*>(src)[i]);
      return;
    case HostValueType::kF16:
      for (size_t i = 0; i < n; ++i) dst[i] = Fp16ToFp32(static_cast<const uint16_t*>(src)[i]);
      return;
  }
}

Result<std::unique_ptr<SpillFile>> SpillFile::Create(const std::string& dir) {
  int fd = open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {
    std::string templ = dir + "/.zinf-init-XXXXXX";
    fd = mkostemp(templ.data(), O_CLOEXEC);
    if (fd >= 0 && unlink(templ.c_str()) != 0) {
      const int err = errno;
      close(fd);
      return ErrnoToStatus(err, "zinf.Init: unlinking the spill file " + templ);
    }
  }
  if (fd < 0) {
    return ErrnoToStatus(errno, "zinf.Init: creating a spill file for parameter values in " + dir +
                                    " (pick a writable folder on disk)");
  }
  std::unique_ptr<SpillFile> file(new (std::nothrow) SpillFile(dir, fd));
  if (file == nullptr) {
    close(fd);
    return Status::ResourceExhausted("zinf.Init: no memory for the spill file in " + dir);
  }
  return file;
}

SpillFile::~SpillFile() {
  // Nothing to report: the file is unlinked, closing it frees its blocks.
  close(fd_);
}

Result<uint64_t> SpillFile::Append(const void* src, HostValueType type, size_t n) {
  constexpr size_t kBlock = 1 << 20;  // values converted per write
  MutexLock lock(&mu_);
  const uint64_t offset = size_;
  const size_t esize = HostValueSize(type);
  std::vector<float> block(std::min(n, kBlock));
  for (size_t done = 0; done < n;) {
    const size_t k = std::min(kBlock, n - done);
    HostValuesToF32(static_cast<const char*>(src) + done * esize, type, block.data(), k);
    Status s = WriteAll(block.data(), k * sizeof(float), offset + done * sizeof(float));
    if (!s.ok()) return s;
    done += k;
  }
  size_ += n * sizeof(float);
  return offset;
}

Status SpillFile::Read(uint64_t offset, float* out, size_t n) const {
  {
    MutexLock lock(&mu_);
    if (released_.count(offset) != 0) {
      return Status::FailedPrecondition(
          "the zinf.Init values of this parameter were handed to an engine already, and their "
          "space in the spill file in " +
          dir_ + " was freed; build the model again under zinf.Init for another engine");
    }
  }
  char* p = reinterpret_cast<char*>(out);
  size_t left = n * sizeof(float);
  while (left > 0) {
    ssize_t r = pread(fd_, p, std::min<size_t>(left, 1 << 30), static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      return r < 0 ? ErrnoToStatus(errno, "reading the zinf.Init spill file in " + dir_)
                   : Status::Corruption("the zinf.Init spill file in " + dir_ + " is short");
    }
    p += r;
    left -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
  return Status::OK();
}

void SpillFile::Release(uint64_t offset, size_t n) {
  MutexLock lock(&mu_);
  released_.insert(offset);
  // Only the space is at stake: a file system without hole punching keeps the blocks until
  // the file closes, which is what it did before.
  const int mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE;
  const auto at = static_cast<off_t>(offset), len = static_cast<off_t>(n * sizeof(float));
  (void)fallocate(fd_, mode, at, len);  // safe: only the space is at stake, see above
}

uint64_t SpillFile::bytes() const {
  MutexLock lock(&mu_);
  return size_;
}

Status SpillFile::WriteAll(const void* buf, size_t n, uint64_t offset) {
  const char* p = static_cast<const char*>(buf);
  while (n > 0) {
    ssize_t w = pwrite(fd_, p, std::min<size_t>(n, 1 << 30), static_cast<off_t>(offset));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return ErrnoToStatus(errno, "zinf.Init: writing the spill file in " + dir_);
    if (w == 0) return Status::IoError("zinf.Init: the spill file in " + dir_ + " took no bytes");
    p += w;
    n -= static_cast<size_t>(w);
    offset += static_cast<uint64_t>(w);
  }
  return Status::OK();
}

}  // namespace zinf
