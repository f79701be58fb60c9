#include <sys/mman.h>
#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <vector>

#include "common/thread_annotations.h"
#include "nvme/range_allocator.h"
#include "zinf/align.h"
#include "zinf/log.h"
#include "zinf/swap.h"

namespace zinf {

struct PinnedArena::State {
  Mutex mu;
  RangeAllocator free GUARDED_BY(mu);
  size_t used GUARDED_BY(mu) = 0;
  size_t peak GUARDED_BY(mu) = 0;
};

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    arena_ = other.arena_;
    data_ = other.data_;
    capacity_ = other.capacity_;
    other.arena_ = nullptr;
    other.data_ = nullptr;
    other.capacity_ = 0;
  }
  return *this;
}

void PinnedBuffer::Reset() {
  if (arena_ != nullptr) arena_->Free(data_, capacity_);
  arena_ = nullptr;
  data_ = nullptr;
  capacity_ = 0;
}

Result<std::unique_ptr<PinnedArena>> PinnedArena::Create(const PinnedArenaOptions& options) {
  if (options.bytes == 0) return Status::InvalidArgument("pinned arena size is 0");
  if (options.alignment < 64 || !IsPowerOfTwo(options.alignment) ||
      options.alignment > (2u << 20)) {
    return Status::InvalidArgument("pinned arena alignment " + std::to_string(options.alignment) +
                                   " must be a power of two in [64, 2 MiB]");
  }
  constexpr size_t kHuge = 2u << 20;
  size_t bytes = RoundUp(options.bytes, kHuge);
  // Over-map by one huge page so the start can be 2 MiB aligned (transparent huge pages).
  void* raw =
      mmap(nullptr, bytes + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    return ErrnoToStatus(errno, "pinned arena: mmap of " + FormatBytes(bytes));
  }
  uintptr_t start = RoundUp(reinterpret_cast<uintptr_t>(raw), kHuge);
  size_t head = start - reinterpret_cast<uintptr_t>(raw);
  if (head > 0) munmap(raw, head);
  size_t tail = kHuge - head;
  if (tail > 0) munmap(reinterpret_cast<char*>(start) + bytes, tail);

  std::unique_ptr<PinnedArena> arena(new PinnedArena());
  arena->base_ = reinterpret_cast<void*>(start);
  arena->capacity_ = bytes;
  arena->alignment_ = options.alignment;
  arena->state_ = std::make_unique<State>();
  {
    MutexLock lock(&arena->state_->mu);  // not shared yet; the lock keeps the analysis exact
    arena->state_->free.Add(0, bytes);
  }

  if (options.huge_pages && madvise(arena->base_, bytes, MADV_HUGEPAGE) != 0) {
    LogWarning("pinned arena: MADV_HUGEPAGE refused (" + std::string(strerror(errno)) +
               "); using 4 KiB pages");
  }
  if (options.lock_memory) {
    if (mlock(arena->base_, bytes) == 0) {
      arena->locked_ = true;
    } else {
      int err = errno;
      rlimit lim{};
      getrlimit(RLIMIT_MEMLOCK, &lim);
      std::string limit = lim.rlim_cur == RLIM_INFINITY ? "unlimited" : FormatBytes(lim.rlim_cur);
      LogWarning("pinned arena: could not lock " + FormatBytes(bytes) + " in memory (" +
                 strerror(err) + "; RLIMIT_MEMLOCK is " + limit +
                 "). The arena stays pageable: I/O still works but may be slower. Raise the "
                 "limit with `ulimit -l unlimited`, LimitMEMLOCK=infinity (systemd) or a "
                 "memlock line in /etc/security/limits.conf");
    }
  }
  if (!arena->locked_) {
    // Fault every page in now, not in the middle of a training step.
    for (size_t off = 0; off < bytes; off += 4096) static_cast<char*>(arena->base_)[off] = 0;
  }
  if (options.huge_pages) arena->EnsureHugePages();
  return arena;
}

void PinnedArena::EnsureHugePages() {
  Result<size_t> huge = HugePageBytes();
  if (!huge.ok() || *huge >= capacity_) return;  // (no smaps: nothing to learn or do)
  // The fault path fell back to 4 KiB pages for part of it (THP off for this process, or no
  // free 2 MiB page at the time): collapse them synchronously (Linux 6.1), where it can.
  constexpr int kCollapse = 25;                             // MADV_COLLAPSE
  static_cast<void>(madvise(base_, capacity_, kCollapse));  // (checked below by its effect)
  huge = HugePageBytes();
  if (!huge.ok() || *huge * 10 >= capacity_ * 9) return;
  std::string mode = "unknown";
  if (FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r")) {
    char line[128] = {0};
    if (std::fgets(line, sizeof(line), f) != nullptr) mode = line;
    std::fclose(f);
    while (!mode.empty() && (mode.back() == '\n' || mode.back() == ' ')) mode.pop_back();
  }
  LogWarning("pinned arena: only " + FormatBytes(*huge) + " of " + FormatBytes(capacity_) +
             " is on 2 MiB huge pages (transparent_hugepage/enabled: " + mode +
             "): I/O of 1 MiB and more from 4 KiB pages is split into more requests (slower "
             "writes). Set transparent_hugepage to madvise or always, or free memory so that "
             "2 MiB pages are available");
}

Result<size_t> PinnedArena::HugePageBytes() const {
  FILE* f = std::fopen("/proc/self/smaps", "r");
  if (f == nullptr) return ErrnoToStatus(errno, "pinned arena: /proc/self/smaps");
  const uintptr_t lo = reinterpret_cast<uintptr_t>(base_), hi = lo + capacity_;
  size_t total = 0, overlap = 0;
  char line[512];
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    unsigned long begin = 0, end = 0, kb = 0;
    if (std::sscanf(line, "%lx-%lx ", &begin, &end) == 2 && std::strchr(line, ':') != nullptr &&
        std::strchr(line, '-') < std::strchr(line, ' ')) {
      // A mapping's first line: how much of it lies in the arena.
      const uintptr_t b = std::max<uintptr_t>(begin, lo), e = std::min<uintptr_t>(end, hi);
      overlap = e > b ? e - b : 0;
    } else if (overlap > 0 && std::sscanf(line, "AnonHugePages: %lu kB", &kb) == 1) {
      // (A mapping that extends past the arena counts at most its part inside.)
      total += std::min<size_t>(static_cast<size_t>(kb) << 10, overlap);
    }
  }
  std::fclose(f);
  return total;
}

PinnedArena::~PinnedArena() {
  if (base_ != nullptr) munmap(base_, capacity_);
}

Result<PinnedBuffer> PinnedArena::Allocate(size_t bytes) {
  size_t need = RoundUp(bytes == 0 ? 1 : bytes, alignment_);
  MutexLock lock(&state_->mu);
  if (std::optional<uint64_t> offset = state_->free.Allocate(need)) {
    state_->used += need;
    state_->peak = std::max(state_->peak, state_->used);
    return PinnedBuffer(this, static_cast<char*>(base_) + *offset, need);
  }
  return Status::ResourceExhausted("pinned arena: no free block of " + FormatBytes(need) +
                                   " (arena " + FormatBytes(capacity_) + ", in use " +
                                   FormatBytes(state_->used) +
                                   "); raise the pinned host budget or lower buffer sizes");
}

void PinnedArena::Free(void* data, size_t capacity) {
  size_t offset = static_cast<char*>(data) - static_cast<char*>(base_);
  MutexLock lock(&state_->mu);
  state_->free.Free(offset, capacity);
  state_->used -= capacity;
}

std::vector<MemoryRegion> PinnedArena::UsedPages() const {
  constexpr size_t kPage = 4096;
  std::vector<MemoryRegion> out;
  MutexLock lock(&state_->mu);
  size_t at = 0;  // the end of the last free range seen
  auto add = [&](size_t begin, size_t end) {
    begin = begin / kPage * kPage;
    end = RoundUp(end, kPage);
    if (begin >= end) return;
    char* base = static_cast<char*>(base_);
    if (!out.empty() && static_cast<char*>(out.back().base) + out.back().len >= base + begin) {
      out.back().len =
          std::max<size_t>(out.back().len, base + end - static_cast<char*>(out.back().base));
    } else {
      out.push_back({base + begin, end - begin});
    }
  };
  state_->free.ForEach([&](uint64_t offset, uint64_t len) {
    add(at, offset);
    at = offset + len;
  });
  add(at, capacity_);
  return out;
}

Status PinnedArena::Release() {
  if (released_) return Status::OK();
  if (locked_ && munlock(base_, capacity_) != 0) {
    return ErrnoToStatus(errno, "pinned arena: munlock of " + FormatBytes(capacity_));
  }
  if (madvise(base_, capacity_, MADV_DONTNEED) != 0) {
    const int err = errno;
    // (Nothing was dropped: MADV_DONTNEED fails before it starts. Locked again as it was.)
    if (locked_ && mlock(base_, capacity_) != 0) {
      locked_ = false;
      LogWarning("pinned arena: could not lock it again (" + std::string(strerror(errno)) +
                 "); it stays pageable");
    }
    return ErrnoToStatus(err, "pinned arena: MADV_DONTNEED of " + FormatBytes(capacity_));
  }
  released_ = true;
  return Status::OK();
}

Status PinnedArena::Restore() {
  if (!released_) return Status::OK();
  if (locked_ && mlock(base_, capacity_) != 0) {
    // As at creation: pageable rather than failing (the lock may have been taken part-way).
    LogWarning("pinned arena: could not lock " + FormatBytes(capacity_) + " again (" +
               strerror(errno) + "); it stays pageable: I/O still works but may be slower");
    static_cast<void>(munlock(base_, capacity_));  // (what a partial lock took; it fails
                                                   // only for a bad range, not this one)
    locked_ = false;
  }
  // Faulted in now, locked or not (mlock populates, but where it is a no-op, as under
  // AddressSanitizer, the pages would come back at the first touch): MADV_POPULATE_WRITE
  // (Linux 5.14) at once, touching every page where the kernel lacks it. Memory short: the
  // kernel's OOM handling, as at Create.
  constexpr int kPopulateWrite = 23;
  if (madvise(base_, capacity_, kPopulateWrite) != 0) {
    for (size_t off = 0; off < capacity_; off += 4096) static_cast<char*>(base_)[off] = 0;
  }
  released_ = false;
  return Status::OK();
}

Result<size_t> PinnedArena::ResidentBytes() const {
  constexpr size_t kPage = 4096;
  std::vector<unsigned char> pages(capacity_ / kPage);
  if (mincore(base_, capacity_, pages.data()) != 0) {
    return ErrnoToStatus(errno, "pinned arena: mincore");
  }
  size_t n = 0;
  for (unsigned char p : pages) n += p & 1;
  return n * kPage;
}

size_t PinnedArena::used() const {
  MutexLock lock(&state_->mu);
  return state_->used;
}

size_t PinnedArena::peak_used() const {
  MutexLock lock(&state_->mu);
  return state_->peak;
}

}  // namespace zinf
