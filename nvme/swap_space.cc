#include "nvme/swap_space.h"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "zinf/align.h"
#include "zinf/log.h"

namespace zinf {

SwapSpace::SwapSpace(const SwapSpaceOptions& options, std::vector<IoFile> files,
                     std::vector<uint64_t> file_sizes)
    : options_(options),
      files_(std::move(files)),
      file_size_(std::move(file_sizes)),
      free_(files_.size()) {}

uint64_t SwapSpace::ExtentBytes(uint64_t padded, size_t f) const {
  const uint64_t chunks = NumChunks(padded);
  const size_t n = files_.size();
  if (f >= chunks) return 0;
  const uint64_t count = (chunks - f + n - 1) / n;  // chunks f, f+n, ...
  const uint64_t last = f + (count - 1) * n;
  return (count - 1) * options_.chunk_size +
         std::min<uint64_t>(options_.chunk_size, padded - last * options_.chunk_size);
}

size_t SwapSpace::ExtentCount(uint64_t padded) const {
  return static_cast<size_t>(std::min<uint64_t>(NumChunks(padded), files_.size()));
}

Transfer SwapSpace::ChunkTransfer(const std::vector<Extent>& extents, uint64_t padded, uint64_t i,
                                  IoOp op, char* buf) const {
  const size_t n = files_.size();
  const Extent& x = extents[i % n];
  Transfer t;
  t.op = op;
  t.file = x.file;
  t.offset = x.offset + (i / n) * options_.chunk_size;
  t.buf = buf + i * options_.chunk_size;
  t.len = std::min<uint64_t>(options_.chunk_size, padded - i * options_.chunk_size);
  return t;
}

Result<std::vector<Extent>> SwapSpace::Allocate(uint64_t size, const std::string& key) {
  const uint64_t padded = RoundUp(size, options_.alignment);
  std::vector<Extent> extents;
  for (size_t f = 0; f < files_.size(); ++f) {
    const uint64_t len = ExtentBytes(padded, f);
    if (len == 0) break;
    std::optional<uint64_t> off = free_[f].Allocate(len);
    if (!off) {
      Status s = Grow(f, len, key, options_.growth_step);
      if (s.ok()) off = free_[f].Allocate(len);
      if (!off) {
        for (const Extent& x : extents) Free(x);
        return s.ok() ? Status::Internal("extent allocation failed after growth") : s;
      }
    }
    extents.push_back({static_cast<uint32_t>(f), *off, len});
    allocated_ += len;
  }
  return extents;
}

void SwapSpace::Free(const Extent& x) {
  free_[x.file].Free(x.offset, x.len);
  allocated_ -= x.len;
}

void SwapSpace::FreeAll() {
  for (size_t f = 0; f < files_.size(); ++f) free_[f].Add(0, file_size_[f]);
}

bool SwapSpace::Reserve(const Extent& x) {
  if (x.file >= files_.size() || !free_[x.file].Reserve(x.offset, x.len)) return false;
  allocated_ += x.len;
  return true;
}

uint64_t SwapSpace::file_bytes() const {
  uint64_t n = 0;
  for (uint64_t s : file_size_) n += s;
  return n;
}

Status SwapSpace::Preallocate(size_t f, uint64_t bytes) {
  if (file_size_[f] >= bytes) return Status::OK();
  // Exactly the requested capacity: the growth step is this one growth.
  const uint64_t grow = RoundUp(bytes - file_size_[f], options_.alignment);
  return Grow(f, grow, "(preallocation)", grow);
}

Status SwapSpace::Grow(size_t f, uint64_t len, const std::string& key, uint64_t growth_step) {
  const uint64_t tail = free_[f].FreeTailLength(file_size_[f]);
  const uint64_t need = RoundUp(len - std::min(len, tail), options_.alignment);
  const uint64_t step = std::clamp<uint64_t>(file_size_[f] / 4, 1ull << 20,
                                             std::max<uint64_t>(growth_step, 1ull << 20));
  uint64_t grow = RoundUp(std::max(need, step), options_.alignment);
  const uint64_t limit = options_.max_capacity_per_path;
  const IoFile& file = files_[f];
  if (limit != 0 && file_size_[f] + grow > limit) {
    grow = limit > file_size_[f] ? need : 0;
    if (grow == 0 || file_size_[f] + grow > limit) {
      return Status::ResourceExhausted(
          "swap store full: tensor '" + key + "' needs " + FormatBytes(len) + " more on " +
          file.path + ", which reached its capacity limit of " + FormatBytes(limit) +
          "; raise the per-path capacity, add another nvme path or offload less");
    }
  }
  struct statvfs vfs {};
  if (fstatvfs(file.fd, &vfs) != 0) return ErrnoToStatus(errno, "statvfs of " + file.path);
  const uint64_t free_bytes = uint64_t(vfs.f_bavail) * vfs.f_frsize;
  const uint64_t fs_bytes = uint64_t(vfs.f_blocks) * vfs.f_frsize;
  const uint64_t reserve = options_.reserve_bytes != UINT64_MAX
                               ? options_.reserve_bytes
                               : std::min<uint64_t>(fs_bytes / 50, 4ull << 30);
  const uint64_t usable = free_bytes > reserve ? free_bytes - reserve : 0;
  if (grow > usable) grow = need;  // the step is a convenience, the need is not
  if (grow > usable) {
    return Status(StatusCode::kResourceExhausted,
                  "no space left for tensor '" + key + "': it needs " + FormatBytes(need) +
                      " more in " + file.path + ", and the filesystem has " +
                      FormatBytes(free_bytes) + " free, of which " + FormatBytes(reserve) +
                      " stay in reserve; free space there, add another nvme path or offload "
                      "less",
                  ENOSPC);
  }
  if (fallocate(file.fd, 0, static_cast<off_t>(file_size_[f]), static_cast<off_t>(grow)) != 0) {
    const int err = errno;
    // Blocks a failed fallocate took stay allocated (beyond the size or not): give them back.
    if (ftruncate(file.fd, static_cast<off_t>(file_size_[f])) != 0) {
      LogWarning("could not give back the space of a failed growth of " + file.path + ": " +
                 ErrnoToStatus(errno, "ftruncate").message());
    }
    if (err == ENOSPC || err == EDQUOT) {
      const uint64_t now_free =
          fstatvfs(file.fd, &vfs) == 0 ? uint64_t(vfs.f_bavail) * vfs.f_frsize : 0;
      return Status(StatusCode::kResourceExhausted,
                    "no space left for tensor '" + key + "': growing " + file.path + " by " +
                        FormatBytes(grow) + " failed (" + FormatBytes(now_free) +
                        " free on that filesystem); free space there, add another nvme path "
                        "or offload less",
                    err);
    }
    return ErrnoToStatus(err, "fallocate " + file.path + " for tensor '" + key + "'");
  }
  free_[f].Add(file_size_[f], grow);
  file_size_[f] += grow;
  return Status::OK();
}

}  // namespace zinf
