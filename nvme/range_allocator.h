// First-fit allocator of [offset, offset + length) ranges with coalescing on free. Used for the
// pinned arena and for extents of swap files. Not thread-safe: the owner locks.
#pragma once

#include <cstdint>
#include <map>
#include <optional>

#include "zinf/status.h"

namespace zinf {

class RangeAllocator {
 public:
  // Makes [offset, offset + len) available (initial space or growth).
  void Add(uint64_t offset, uint64_t len) { Free(offset, len); }

  // The lowest free range of `len` bytes, or nullopt.
  std::optional<uint64_t> Allocate(uint64_t len) {
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < len) continue;
      uint64_t offset = it->first;
      uint64_t rest = it->second - len;
      free_.erase(it);
      if (rest > 0) free_[offset + len] = rest;
      return offset;
    }
    return std::nullopt;
  }

  // Takes [offset, offset + len) out of the free space; false when any of it is not free.
  bool Reserve(uint64_t offset, uint64_t len) {
    auto it = free_.upper_bound(offset);
    if (it == free_.begin()) return false;
    --it;
    uint64_t start = it->first;
    uint64_t end = start + it->second;
    if (offset + len > end) return false;
    free_.erase(it);
    if (offset > start) free_[start] = offset - start;
    if (end > offset + len) free_[offset + len] = end - (offset + len);
    return true;
  }

  // REQUIRES: [offset, offset + len) was allocated (or never added) and is not free.
  void Free(uint64_t offset, uint64_t len) {
    if (len == 0) return;
    auto next = free_.lower_bound(offset);
    ZINF_CHECK_MSG(next == free_.end() || next->first >= offset + len, "range freed twice");
    uint64_t start = offset;
    uint64_t total = len;
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      ZINF_CHECK_MSG(prev->first + prev->second <= offset, "range freed twice");
      if (prev->first + prev->second == offset) {
        start = prev->first;
        total += prev->second;
        free_.erase(prev);
      }
    }
    if (next != free_.end() && next->first == offset + len) {
      total += next->second;
      free_.erase(next);
    }
    free_[start] = total;
  }

  // The free range ending at `end`, if any (its length), for growth decisions.
  uint64_t FreeTailLength(uint64_t end) const {
    if (free_.empty()) return 0;
    auto last = std::prev(free_.end());
    return last->first + last->second == end ? last->second : 0;
  }

  // Calls fn(offset, len) for each free range, in offset order.
  template <typename Fn>
  void ForEach(Fn fn) const {
    for (const auto& [off, len] : free_) fn(off, len);
  }

  uint64_t FreeBytes() const {
    uint64_t n = 0;
    for (const auto& [off, len] : free_) n += len;
    return n;
  }

 private:
  std::map<uint64_t, uint64_t> free_;  // offset -> length
};

}  // namespace zinf
