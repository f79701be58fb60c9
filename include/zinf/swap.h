// The NVMe tier: a pinned buffer arena and the SwapStore that keeps tensors in preallocated
// swap files striped over one or more folders.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "zinf/align.h"  // RoundUp, which swap callers use for padded sizes
#include "zinf/io.h"
#include "zinf/status.h"

namespace zinf {

// ---- PinnedArena ------------------------------------------------------------------------------

struct PinnedArenaOptions {
  size_t bytes = 0;         // rounded up to 2 MiB
  size_t alignment = 4096;  // every allocation's start and size
  bool lock_memory = true;  // mlock; refused -> one warning naming RLIMIT_MEMLOCK
  bool huge_pages = true;   // MADV_HUGEPAGE (fewer TLB misses, larger DMA segments)
};

class PinnedArena;

// A block of the arena; returns itself on destruction. Move-only.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer() { Reset(); }
  PinnedBuffer(PinnedBuffer&& other) noexcept { *this = std::move(other); }
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  void* data() const { return data_; }
  size_t capacity() const { return capacity_; }
  void Reset();

 private:
  friend class PinnedArena;
  PinnedBuffer(PinnedArena* arena, void* data, size_t capacity)
      : arena_(arena), data_(data), capacity_(capacity) {}
  PinnedArena* arena_ = nullptr;
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

// One allocation made once (and registered with I/O backends and, later, CUDA), handed out in
// aligned blocks. Thread-safe. Must outlive its buffers.
class PinnedArena {
 public:
  static Result<std::unique_ptr<PinnedArena>> Create(const PinnedArenaOptions& options);
  ~PinnedArena();
  PinnedArena(const PinnedArena&) = delete;
  PinnedArena& operator=(const PinnedArena&) = delete;

  // A block of at least `bytes` (rounded up to the alignment). ResourceExhausted when no free
  // range is large enough.
  Result<PinnedBuffer> Allocate(size_t bytes);

  MemoryRegion region() const { return {base_, capacity_}; }
  bool locked() const { return locked_; }
  size_t capacity() const { return capacity_; }
  size_t alignment() const { return alignment_; }
  size_t used() const;
  size_t peak_used() const;

  // The blocks handed out now, widened to whole 4 KiB pages and merged, in address order: what
  // holds values (offload_states to NVMe writes these before Release).
  std::vector<MemoryRegion> UsedPages() const;
  // Gives the arena's memory back to the kernel (munlock when locked, MADV_DONTNEED): every
  // value in it is lost, the addresses stay reserved. Whoever registered the memory (a device,
  // an io_uring) must have unregistered it first: those registrations pin the old pages.
  Status Release();
  // Backs the arena again (mlock when it was locked, else the pages faulted in), zeroed.
  Status Restore();
  bool released() const { return released_; }
  // Bytes of the arena resident in memory now (mincore).
  Result<size_t> ResidentBytes() const;
  // Bytes of the arena backed by 2 MiB transparent huge pages now (AnonHugePages of its
  // mappings in /proc/self/smaps). A 1 MiB request from 4 KiB pages is 256 segments, which the
  // block layer splits; from a huge page it is one. Create asks for them (MADV_HUGEPAGE, then
  // MADV_COLLAPSE where the fault path left 4 KiB pages) and warns, with the numbers, when
  // under 90 % are.
  Result<size_t> HugePageBytes() const;

 private:
  friend class PinnedBuffer;
  PinnedArena() = default;
  void Free(void* data, size_t capacity);
  // With huge_pages: backs the arena with 2 MiB pages where the kernel can (MADV_COLLAPSE),
  // warning when under 90 % are.
  void EnsureHugePages();

  struct State;
  void* base_ = nullptr;
  size_t capacity_ = 0;
  size_t alignment_ = 4096;
  bool locked_ = false;
  bool released_ = false;
  std::unique_ptr<State> state_;
};

// ---- SwapStore --------------------------------------------------------------------------------

struct SwapStoreOptions {
  std::vector<std::string> paths;      // existing folders; one swap file each (zinf-swap-<i>.bin)
  uint64_t capacity_per_path = 0;      // preallocated (fallocate) at open; 0 = grow on demand
  uint64_t max_capacity_per_path = 0;  // growth limit; 0 = until the filesystem is full
  // Files grow by what a write needs, or by a quarter of their size when that is more (1 MiB
  // at least, growth_step at most): small stores stay small, large ones grow in few steps.
  uint64_t growth_step = 256ull << 20;
  // Growth never leaves less than this free on the filesystem (a write that would is refused
  // at the call, naming the numbers). UINT64_MAX: 2 % of the filesystem, at most 4 GiB.
  uint64_t reserve_bytes = UINT64_MAX;
  // Delete the swap files (and any index) at Close: for a store nobody reopens (the engine's
  // when it is not durable), so nothing is left on the disk after the run. Such a store's
  // files are unlinked as soon as they are open, so a killed run leaves nothing either.
  bool remove_on_close = false;
  uint64_t chunk_size = 1 << 20;  // stripe unit; tensor chunk i lives on path i % N
  uint32_t block_size = 1 << 20;  // largest I/O request
  IoBackendKind backend = IoBackendKind::kIoUring;
  IoBackendOptions backend_options;
  bool direct_io = true;   // O_DIRECT; refused (tmpfs) -> buffered I/O with one warning
  bool checksums = false;  // xxh3-64 per chunk, verified on read
  // Load the index a previous Close() (or Commit()) wrote, keep the data. The folders must be
  // the store's, in its order: each folder of a store that can be reopened carries a mark
  // (zinf-swap.folder.json: the store's id and the folder's position) and the index records
  // them; other folders, another order, or a store whose index is lost are refused, naming
  // the order to give (FailedPrecondition) or the damage (Corruption).
  bool reopen = false;
  // A fresh store (reopen false) never replaces another one: when a folder holds a store's
  // index, a mark of a store that wrote one, or swap files without a mark, Open fails with
  // AlreadyExists naming it, and nothing is changed. With overwrite that store's files (in
  // every folder given) are removed first. A store that never wrote an index holds nothing
  // to keep and is replaced either way.
  bool overwrite = false;
  // Durable (crash-consistent) mode: a write never overwrites the committed version of a
  // tensor. The first write of a tensor after a Commit() goes to fresh extents (later ones
  // overwrite those in place); Commit() publishes every write since the last one atomically
  // (data synced, then the index renamed into place) and only then frees the superseded
  // extents. Reopening (reopen = true) sees exactly the last commit, whatever happened after
  // it. Needs up to twice the space of the tensors. Close() does not commit.
  bool durable = false;
  // Durable stores: how many commits stay loadable, 1 or 2. With 2 the commit before the last
  // one stays on disk too (its index as zinf-swap.index.prev.json, its extents kept until the
  // next commit is published), so that ranks whose stores are one commit apart can all reopen
  // at the same one. Needs up to three times the space of the tensors that change.
  int retained_commits = 1;
  // Durable stores, with reopen: reopen at the commit before the last instead of the last. The
  // last one is dropped (its index removed) before Open returns.
  bool reopen_previous = false;
  // Memory to register with the backend once (for example PinnedArena::region()).
  std::vector<MemoryRegion> registered_regions;
  // Tests: wrap the backend in a FaultyBackend driven by this plan.
  std::shared_ptr<FaultPlan> fault_plan;
};

struct SwapStoreStats {
  uint64_t bytes_written = 0;
  uint64_t bytes_read = 0;
  uint64_t tensors = 0;
  uint64_t bytes_stored = 0;     // sum of tensor sizes
  uint64_t bytes_allocated = 0;  // extents in use, padded
  uint64_t file_bytes = 0;       // sum of swap file sizes
  double checksum_seconds = 0;   // time spent hashing (write) and verifying (read)
  double busy_seconds = 0;       // time with at least one request in flight
};

using Ticket = uint64_t;

// Tensors by key in swap files. Thread-safe: any thread may write, read and wait. A key may
// have one write or any number of reads in flight, not both. Buffers must be aligned to
// alignment() and hold capacity >= size rounded up to alignment() bytes (the padding is
// written to / read from the file); they must stay valid until the ticket is waited for.
class SwapStore {
 public:
  static Result<std::unique_ptr<SwapStore>> Open(const SwapStoreOptions& options);
  // Waits for outstanding requests and writes the index; errors are logged (call Close() to
  // see them).
  ~SwapStore();
  SwapStore(const SwapStore&) = delete;
  SwapStore& operator=(const SwapStore&) = delete;

  // Starts writing `size` bytes under `key` (created, or overwritten in place when its size is
  // unchanged). Running out of space fails here, before any byte moves, with other tensors
  // untouched.
  Result<Ticket> Write(const std::string& key, const void* buf, uint64_t size, uint64_t capacity);
  // Starts reading `key` into `buf`. `urgent`: its requests go ahead of every normal request
  // not yet issued (a read someone waits on, ahead of write-backs and read-ahead).
  Result<Ticket> Read(const std::string& key, void* buf, uint64_t capacity, bool urgent = false);
  // Blocks until the ticket's request has ended; returns its outcome. Once per ticket.
  Status Wait(Ticket ticket);
  // Whether Wait(ticket) would return without blocking: the request has ended (or the ticket
  // is unknown, which Wait reports). Never blocks on I/O.
  bool Done(Ticket ticket) const;

  Result<uint64_t> Size(const std::string& key) const;
  bool Contains(const std::string& key) const;
  std::vector<std::string> Keys() const;
  // Frees the key's extents. FailedPrecondition while it has a request in flight.
  Status Remove(const std::string& key);

  // Waits for all requests, syncs the files and writes the index atomically. Durable stores:
  // FailedPrecondition (use Commit).
  Status Flush();
  // Durable stores: waits for all requests, syncs the files, writes the index with `meta`
  // (the caller's description of the state, e.g. a step number) and renames it into place;
  // then frees the extents of the versions it superseded. FailedPrecondition when a tensor's
  // last write failed (nothing is published then). Writes and removals issued while a commit
  // runs are refused (FailedPrecondition): commit between steps.
  Status Commit(const std::string& meta);
  // The `meta` of the last commit ("" when none): the one the store was reopened at, or the
  // last Commit() since.
  std::string committed_meta() const;
  // The `meta` of each commit a durable store in `paths` (its folders, in order) could reopen
  // at, the last one first (two when the store retains two commits); empty for a store that
  // never committed (its run stopped while initialising). NotFound when the folders hold no
  // store; Corruption when an index cannot be read or is lost; FailedPrecondition when the
  // folders are not the store's, in its order (as Open with reopen). Reads only the small
  // files (indexes, marks) and the folders' listings; changes nothing.
  static Result<std::vector<std::string>> ListCommits(const std::vector<std::string>& paths);
  // The swap file of folder `index` of a store over `dir` (zinf-swap-<index>.bin inside it).
  static std::string FileName(const std::string& dir, size_t index);
  // The same for a store of one folder.
  static Result<std::vector<std::string>> ListCommits(const std::string& first_path) {
    return ListCommits(std::vector<std::string>{first_path});
  }
  // Waits for every request, then drops (false) or restores (true) the backend's registration
  // of options.registered_regions (io_uring fixed buffers pin their pages), so that the
  // memory can be released with madvise and faulted in again. While dropped, requests on that
  // memory go as plain ones. REQUIRES: no request on that memory is issued meanwhile.
  Status SetRegionsRegistered(bool registered);

  // Flush(), then closes; the store is unusable afterwards.
  Status Close();

  uint64_t alignment() const { return alignment_; }
  bool direct_io() const { return direct_io_; }
  std::string backend_features() const;
  std::vector<std::string> file_paths() const;
  SwapStoreStats stats() const;

 private:
  struct Impl;
  explicit SwapStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  uint64_t alignment_ = 4096;
  bool direct_io_ = true;
};

}  // namespace zinf
