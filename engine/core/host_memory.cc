#include "engine/core/host_memory.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>

#include "zinf/log.h"

namespace zinf {

AlignedBuffer::AlignedBuffer(size_t n) : bytes(RoundUp(std::max<size_t>(n, 1), 4096)) {
  data = std::aligned_alloc(4096, bytes);
}

AlignedBuffer::~AlignedBuffer() { std::free(data); }

HostArray::~HostArray() {
  if (data != nullptr) munmap(data, bytes);
}

Status HostArray::Allocate(size_t count, const std::string& what) {
  bytes = RoundUp(std::max<size_t>(count, 1) * sizeof(float), 4096);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    data = nullptr;
    return ErrnoToStatus(errno, "allocating " + FormatBytes(bytes) + " of host memory for " + what);
  }
  // Huge pages are a speed hint: without them the states work the same.
  (void)madvise(p, bytes, MADV_HUGEPAGE);  // safe: a hint; without it, normal pages
  data = static_cast<float*>(p);
  return Status::OK();
}

PooledBlock& PooledBlock::operator=(PooledBlock&& o) noexcept {
  if (this != &o) {
    Reset();
    std::swap(pool_, o.pool_);
    std::swap(data_, o.data_);
    std::swap(capacity_, o.capacity_);
  }
  return *this;
}

void PooledBlock::Reset() {
  if (pool_ != nullptr) pool_->Give(data_);
  pool_ = nullptr;
  data_ = nullptr;
  capacity_ = 0;
}

Status BlockPool::Init(PinnedArena* arena, size_t block_bytes, size_t count,
                       const std::string& what) {
  block_bytes_ = RoundUp(std::max<size_t>(block_bytes, 1), 4096);
  count = std::max<size_t>(count, 1);
  ZINF_ASSIGN_OR_RETURN(region_, arena->Allocate(block_bytes_ * count));
  char* base = static_cast<char*>(region_.data());
  MutexLock lock(&mu_);
  for (size_t i = count; i-- > 0;) free_.push_back(base + i * block_bytes_);
  what_ = what;
  return Status::OK();
}

PooledBlock BlockPool::TryTake() {
  MutexLock lock(&mu_);
  if (free_.empty()) return PooledBlock();
  void* p = free_.back();
  free_.pop_back();
  return PooledBlock(this, p, block_bytes_);
}

Result<PooledBlock> BlockPool::Take() {
  PooledBlock b = TryTake();
  if (b.data() == nullptr) {
    return Status::Internal("the pool of " + what_ +
                            " is exhausted (a bug: more taken than planned)");
  }
  return b;
}

void BlockPool::Give(void* p) {
  MutexLock lock(&mu_);
  free_.push_back(p);
}

size_t BlockPool::free_blocks() const {
  MutexLock lock(&mu_);
  return free_.size();
}

Status AllocateHostStates(PinnedArena* arena, size_t bytes, HostStates* out) {
  if (arena != nullptr) {
    Result<PinnedBuffer> b = arena->Allocate(bytes);
    if (b.ok()) {
      out->pinned = std::move(b).value();
      return Status::OK();
    }
  }
  out->heap = std::make_unique<AlignedBuffer>(bytes);
  if (out->heap->data == nullptr) {
    out->heap.reset();
    return Status::ResourceExhausted("allocating " + FormatBytes(bytes) +
                                     " of host memory for a sub-group's optimizer states");
  }
  return Status::OK();
}

}  // namespace zinf
