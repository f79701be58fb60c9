// Device memory under a byte budget, sub-allocated from one address range reserved up front:
// the bookkeeping HostDevice and CudaDevice share (budget check, alignment, first-fit ranges,
// exact use and peak). Thread-safe.
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

  // The reserved range (once, before any Allocate).
  void SetRange(char* base, size_t bytes) {
    MutexLock lock(&mu_);
    base_ = base;
    ranges_.Add(0, bytes);
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
    ranges_.Free(static_cast<char*>(ptr) - base_, it->second.rounded);
    allocations_.erase(it);
  }

  DeviceMemoryInfo Info() const {
    MutexLock lock(&mu_);
    DeviceMemoryInfo info;
    info.budget = budget_;
    info.used = used_;
    info.peak = peak_;
    return info;
  }

  size_t budget() const { return budget_; }

 private:
  struct Allocation {
    size_t bytes;    // counted against the budget
    size_t rounded;  // taken from the range
  };
  static std::string Text(size_t n) {
    return FormatBytes(n) + " (" + std::to_string(n) + " bytes)";
  }

  const std::string owner_, budget_option_;
  const size_t budget_, alignment_;
  mutable Mutex mu_;
  char* base_ GUARDED_BY(mu_) = nullptr;
  std::string unavailable_ GUARDED_BY(mu_);
  RangeAllocator ranges_ GUARDED_BY(mu_);
  std::unordered_map<void*, Allocation> allocations_ GUARDED_BY(mu_);
  size_t used_ GUARDED_BY(mu_) = 0;
  size_t peak_ GUARDED_BY(mu_) = 0;
};

}  // namespace zinf
