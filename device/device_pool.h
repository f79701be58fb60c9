// Device memory under a byte budget, sub-allocated from one address range reserved up front:
// the bookkeeping HostDevice and CudaDevice share (budget check, alignment, first-fit ranges,
// exact use and peak). The range is backed chunk by chunk: a chunk gets memory when an
// allocation first reaches into it, and Trim gives back the memory of every chunk no
// allocation holds (offload_states returning the device memory to the driver). Thread-safe.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/thread_annotations.h"
#include "nvme/range_allocator.h"
#include "zinf/align.h"
#include "zinf/device.h"
#include "zinf/log.h"
#include "zinf/status.h"

namespace zinf {

class DevicePool {
 public:
  // `owner` ("HostDevice") and `budget_option` ("HostDeviceOptions::memory_budget") name the
  // device and the setting to raise in error messages.
  DevicePool(std::string owner, std::string budget_option, size_t budget, size_t alignment)
      : owner_(std::move(owner)),
        budget_option_(std::move(budget_option)),
        budget_(budget),
        alignment_(alignment) {}

  // How a range is backed by memory, `chunk` bytes at a time (a multiple of the alignment):
  // `commit` backs [addr, addr + bytes) (whole chunks, contiguous) or fails having backed
  // none of them; `decommit` gives one chunk's memory back (no allocation holds it) or fails
  // leaving it backed. Either may be empty: nothing to do.
  struct Backing {
    size_t chunk = 0;
    std::function<Status(char* addr, size_t bytes)> commit;
    std::function<Status(char* addr, size_t bytes)> decommit;
  };

  // The reserved range (once, before any Allocate). Without a backing (chunk 0) the whole
  // range counts as committed from the start, and Trim gives nothing back.
  void SetRange(char* base, size_t bytes) { SetRange(base, bytes, Backing()); }
  void SetRange(char* base, size_t bytes, Backing backing) {
    MutexLock lock(&mu_);
    base_ = base;
    range_bytes_ = bytes;
    ranges_.Add(0, bytes);
    backing_ = std::move(backing);
    if (backing_.chunk == 0) {
      committed_ = bytes;
      return;
    }
    const size_t chunks = (bytes + backing_.chunk - 1) / backing_.chunk;
    holders_.assign(chunks, 0);
    chunk_committed_.assign(chunks, false);
  }

  // No range could be reserved: every Allocate fails with `why` (not as fragmentation).
  void SetUnavailable(std::string why) {
    MutexLock lock(&mu_);
    unavailable_ = std::move(why);
  }

  // `bytes` (exactly, not rounded) count against the budget; Allocate(0) returns a unique
  // pointer that counts for nothing.
  Result<void*> Allocate(size_t bytes) {
    // Under the lock from check to insertion, so concurrent calls never overshoot the budget
    // and the peak is exact.
    MutexLock lock(&mu_);
    if (!unavailable_.empty()) {
      return Status::ResourceExhausted(owner_ + ": cannot allocate " + Text(bytes) + ": " +
                                       unavailable_);
    }
    if (bytes > budget_ - used_) {
      return Status::ResourceExhausted(owner_ + ": cannot allocate " + Text(bytes) +
                                       ": the device memory budget is " + Text(budget_) + " and " +
                                       Text(used_) + " are in use; raise " + budget_option_ +
                                       " or free device buffers first")
          .WithKey("zinf.device_budget_bytes");
    }
    if (bytes > std::numeric_limits<size_t>::max() - alignment_) {
      return Status::ResourceExhausted(owner_ + ": cannot allocate " + Text(bytes) +
                                       ": larger than any allocation");
    }
    const size_t rounded = bytes == 0 ? alignment_ : RoundUp(bytes, alignment_);
    std::optional<uint64_t> offset = ranges_.Allocate(rounded);
    if (!offset) {
      return Status::ResourceExhausted(owner_ + ": no contiguous range of " + Text(bytes) +
                                       " left in the device pool (" + Text(used_) +
                                       " in use; fragmentation)");
    }
    if (Status s = Hold(*offset, rounded); !s.ok()) {
      ranges_.Free(*offset, rounded);
      return Status::ResourceExhausted(owner_ + ": cannot allocate " + Text(bytes) +
                                       ": backing it with device memory failed (" + s.ToString() +
                                       "); other allocations on the device (the trainer's own "
                                       "tensors) may hold it: free some and retry");
    }
    void* ptr = base_ + *offset;
    allocations_.emplace(ptr, Allocation{bytes, rounded});
    used_ += bytes;
    peak_ = std::max(peak_, used_);
    return ptr;
  }

  // REQUIRES: ptr came from Allocate and is not freed yet (checked: anything else aborts).
  // `poison` (host-addressable pools only): called with the whole range before it can be
  // handed out again, to overwrite it.
  void Free(void* ptr, const std::function<void(void*, size_t)>& poison = nullptr) {
    if (ptr == nullptr) return;
    MutexLock lock(&mu_);
    auto it = allocations_.find(ptr);
    ZINF_CHECK_MSG(
        it != allocations_.end(),
        (owner_ + "::Free of a pointer this device did not allocate (or freed twice)").c_str());
    if (poison) poison(ptr, it->second.rounded);
    used_ -= it->second.bytes;
    const uint64_t offset = static_cast<char*>(ptr) - base_;
    ranges_.Free(offset, it->second.rounded);
    Release(offset, it->second.rounded);
    allocations_.erase(it);
  }

  // Gives back the memory of every committed chunk that no allocation holds, one chunk per
  // decommit call. REQUIRES: no queued work uses freed memory (Free's contract). The first
  // failure is returned; a chunk whose decommit failed stays committed (and usable).
  Status Trim() {
    MutexLock lock(&mu_);
    if (backing_.chunk == 0) return Status::OK();
    Status first;
    for (size_t i = 0; i < holders_.size(); ++i) {
      if (!chunk_committed_[i] || holders_[i] != 0) continue;
      const size_t bytes = ChunkSpan(i, i + 1);
      Status s =
          backing_.decommit ? backing_.decommit(base_ + i * backing_.chunk, bytes) : Status::OK();
      if (s.ok()) {
        chunk_committed_[i] = false;
        committed_ -= bytes;
      } else if (first.ok()) {
        first = s.WithContext(owner_ + ": returning " + FormatBytes(bytes) + " of free memory");
      }
    }
    return first;
  }

  // Commits every chunk not committed (TrimMemory undone), in contiguous runs; on failure
  // what was committed stays so (Trim returns it).
  Status CommitAll() {
    MutexLock lock(&mu_);
    if (backing_.chunk == 0) return Status::OK();
    return CommitRange(0, holders_.size());
  }

  DeviceMemoryInfo Info() const {
    MutexLock lock(&mu_);
    DeviceMemoryInfo info;
    info.budget = budget_;
    info.used = used_;
    info.peak = peak_;
    info.committed = committed_;
    return info;
  }

  size_t budget() const { return budget_; }

 private:
  struct Allocation {
    size_t bytes;    // counted against the budget
    size_t rounded;  // taken from the range
  };
  // Chunks [first, end) in bytes (the last chunk may be cut short by the range's end).
  size_t ChunkSpan(size_t first, size_t end) const REQUIRES(mu_) {
    return std::min(end * backing_.chunk, range_bytes_) - first * backing_.chunk;
  }
  // The chunks [offset, offset + bytes) reaches into gain a holder; those not backed yet are
  // committed (each contiguous run in one call). On failure nothing changes.
  Status Hold(uint64_t offset, size_t bytes) REQUIRES(mu_) {
    if (backing_.chunk == 0) return Status::OK();
    const size_t first = offset / backing_.chunk;
    const size_t end = (offset + bytes + backing_.chunk - 1) / backing_.chunk;
    ZINF_RETURN_IF_ERROR(CommitRange(first, end));
    for (size_t i = first; i < end; ++i) ++holders_[i];
    return Status::OK();
  }
  // Commits the chunks of [first, end) not committed, each contiguous run in one call. On
  // failure the runs committed before stay so (Trim returns them).
  Status CommitRange(size_t first, size_t end) REQUIRES(mu_) {
    for (size_t i = first; i < end;) {
      if (chunk_committed_[i]) {
        ++i;
        continue;
      }
      size_t run = i;
      while (run < end && !chunk_committed_[run]) ++run;
      const size_t span = ChunkSpan(i, run);
      Status s = backing_.commit ? backing_.commit(base_ + i * backing_.chunk, span) : Status::OK();
      if (!s.ok()) return s;
      for (size_t c = i; c < run; ++c) chunk_committed_[c] = true;
      committed_ += span;
      i = run;
    }
    return Status::OK();
  }
  void Release(uint64_t offset, size_t bytes) REQUIRES(mu_) {
    if (backing_.chunk == 0) return;
    const size_t first = offset / backing_.chunk;
    const size_t end = (offset + bytes + backing_.chunk - 1) / backing_.chunk;
    for (size_t i = first; i < end; ++i) --holders_[i];
  }
  static std::string Text(size_t n) {
    return FormatBytes(n) + " (" + std::to_string(n) + " bytes)";
  }

  const std::string owner_, budget_option_;
  const size_t budget_, alignment_;
  mutable Mutex mu_;
  char* base_ GUARDED_BY(mu_) = nullptr;
  size_t range_bytes_ GUARDED_BY(mu_) = 0;
  Backing backing_ GUARDED_BY(mu_);
  std::vector<uint32_t> holders_ GUARDED_BY(mu_);  // live allocations reaching into each chunk
  std::vector<bool> chunk_committed_ GUARDED_BY(mu_);
  size_t committed_ GUARDED_BY(mu_) = 0;
  std::string unavailable_ GUARDED_BY(mu_);
  RangeAllocator ranges_ GUARDED_BY(mu_);
  std::unordered_map<void*, Allocation> allocations_ GUARDED_BY(mu_);
  size_t used_ GUARDED_BY(mu_) = 0;
  size_t peak_ GUARDED_BY(mu_) = 0;
};

}  // namespace zinf
