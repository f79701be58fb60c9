// Host buffers of the engine: aligned heap buffers, page-aligned anonymous mappings for CPU
// optimizer states, and pools of fixed-size pinned blocks.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "common/thread_annotations.h"
#include "zinf/status.h"
#include "zinf/swap.h"

namespace zinf {

// A 4 KiB-aligned heap buffer (direct I/O through the swap store needs the alignment).
struct AlignedBuffer {
  void* data = nullptr;
  size_t bytes = 0;
  explicit AlignedBuffer(size_t n);
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
};

// Host memory for optimizer states on the CPU tier: page aligned, huge pages when possible.
struct HostArray {
  float* data = nullptr;
  size_t bytes = 0;
  HostArray() = default;
  HostArray(HostArray&& o) noexcept : data(o.data), bytes(o.bytes) { o.data = nullptr; }
  HostArray& operator=(HostArray&&) = delete;
  HostArray(const HostArray&) = delete;
  HostArray& operator=(const HostArray&) = delete;
  ~HostArray();
  Status Allocate(size_t count, const std::string& what);
};

class BlockPool;

// A block of a BlockPool; returns itself on destruction. Move-only, like PinnedBuffer.
class PooledBlock {
 public:
  PooledBlock() = default;
  PooledBlock(BlockPool* pool, void* data, size_t capacity)
      : pool_(pool), data_(data), capacity_(capacity) {}
  ~PooledBlock() { Reset(); }
  PooledBlock(PooledBlock&& o) noexcept { *this = std::move(o); }
  PooledBlock& operator=(PooledBlock&& o) noexcept;
  PooledBlock(const PooledBlock&) = delete;
  PooledBlock& operator=(const PooledBlock&) = delete;
  void* data() const { return data_; }
  size_t capacity() const { return capacity_; }
  void Reset();

 private:
  BlockPool* pool_ = nullptr;
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

// Fixed-size blocks carved from one pinned range taken at placement, for the engine's large
// buffers of one size (optimizer state buffers, their bf16 copies, streaming gradient
// accumulators). They never come from the arena's remainder, so the variable-size staging
// there cannot fragment them: a block is free or taken, never "there but not contiguous".
// Thread-safe.
class BlockPool {
 public:
  Status Init(PinnedArena* arena, size_t block_bytes, size_t count, const std::string& what);
  bool initialized() const { return region_.data() != nullptr; }
  // A free block, or an empty one when every block is taken.
  PooledBlock TryTake() EXCLUDES(mu_);
  // REQUIRES: the caller never holds more blocks than the pool has (checked: Internal).
  Result<PooledBlock> Take() EXCLUDES(mu_);
  void Give(void* p) EXCLUDES(mu_);
  size_t block_bytes() const { return block_bytes_; }
  size_t free_blocks() const EXCLUDES(mu_);
  // Gives the pinned range back to its arena (every block must be free).
  void Release() { region_.Reset(); }

 private:
  PinnedBuffer region_;
  size_t block_bytes_ = 0;
  std::string what_;
  mutable Mutex mu_;
  std::vector<void*> free_ GUARDED_BY(mu_);
};

// Host memory for one sub-group's states between optimizer steps: from the pinned arena
// (whose optimizer buffers are idle then) when it has room, else from the heap.
struct HostStates {
  PinnedBuffer pinned;
  std::unique_ptr<AlignedBuffer> heap;
  void* data() const { return heap ? heap->data : pinned.data(); }
};
Status AllocateHostStates(PinnedArena* arena, size_t bytes, HostStates* out);

}  // namespace zinf
