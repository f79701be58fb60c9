// Where a swap store's tensors live on its files: the stripe geometry (chunk i of a tensor on
// file i mod N, one extent per file), each file's free extents and size, and the files' growth
// under the store's limits (a per-path capacity, the filesystem's reserve). Private to nvme/.
//
// Not thread-safe: the store calls it with its own lock held.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "nvme/io_queue.h"
#include "nvme/range_allocator.h"
#include "zinf/status.h"

namespace zinf {

// A tensor's home on one file: a contiguous run holding its chunks f, f+N, f+2N, ...
struct Extent {
  uint32_t file = 0;
  uint64_t offset = 0;
  uint64_t len = 0;
};

struct SwapSpaceOptions {
  uint64_t chunk_size = 1 << 20;  // stripe unit
  uint64_t alignment = 4096;      // every extent's offset and length
  // Growth: by what a tensor needs, or a quarter of the file when that is more (1 MiB at
  // least, growth_step at most), never past max_capacity_per_path (0: no limit) nor into the
  // filesystem's reserve (UINT64_MAX: 2 % of it, at most 4 GiB).
  uint64_t growth_step = 256ull << 20;
  uint64_t max_capacity_per_path = 0;
  uint64_t reserve_bytes = UINT64_MAX;
};

class SwapSpace {
 public:
  // `files` (open, not owned) with their current sizes; every byte of them starts in use
  // (Reopen marks what an index does not hold free with FreeAll, a new store's files are empty).
  SwapSpace(const SwapSpaceOptions& options, std::vector<IoFile> files,
            std::vector<uint64_t> file_sizes);

  // ---- Geometry (pure) ----
  uint64_t NumChunks(uint64_t padded) const {
    return (padded + options_.chunk_size - 1) / options_.chunk_size;
  }
  // Bytes the extent on file slot f needs for a tensor of `padded` bytes (0: none).
  uint64_t ExtentBytes(uint64_t padded, size_t f) const;
  // Extents a tensor of `padded` bytes has: one per file, at most one per chunk.
  size_t ExtentCount(uint64_t padded) const;
  // The file, offset and length of chunk `i` of a tensor with `extents`, `padded` bytes, in a
  // buffer at `buf`.
  Transfer ChunkTransfer(const std::vector<Extent>& extents, uint64_t padded, uint64_t i, IoOp op,
                         char* buf) const;

  // ---- Space ----
  // Extents for a tensor of `size` bytes, growing files as needed; on failure nothing is
  // kept (ResourceExhausted names the tensor `key`, the file and the fix).
  Result<std::vector<Extent>> Allocate(uint64_t size, const std::string& key);
  void Free(const Extent& x);
  // Reopen: marks each file's whole length free, then Reserve takes the extents an index
  // holds; false for one outside its file or overlapping another.
  void FreeAll();
  bool Reserve(const Extent& x);
  // Grows file f to at least `bytes` (preallocation at open).
  Status Preallocate(size_t f, uint64_t bytes);

  size_t num_files() const { return files_.size(); }
  uint64_t file_size(size_t f) const { return file_size_[f]; }
  uint64_t file_bytes() const;                             // sum of the files' sizes
  uint64_t allocated_bytes() const { return allocated_; }  // extents in use

 private:
  // Grows file f so that `len` more bytes fit at its end, by at least `growth_step` (within
  // 1 MiB .. the file's quarter; the need itself when the step does not fit).
  Status Grow(size_t f, uint64_t len, const std::string& key, uint64_t growth_step);

  const SwapSpaceOptions options_;
  const std::vector<IoFile> files_;
  std::vector<uint64_t> file_size_;
  std::vector<RangeAllocator> free_;
  uint64_t allocated_ = 0;
};

}  // namespace zinf
