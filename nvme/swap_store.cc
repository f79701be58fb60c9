// SwapStore: the folders (swap_folders.h: marks, survey, order), the space on the files
// (swap_space.h), the requests in flight and their hashes (swap_tickets.h) and the index
// (swap_index.h) composed behind one lock.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <system_error>
#include <unordered_map>

#include "common/file_io.h"
#include "common/folder_lock.h"
#include "common/thread_annotations.h"
#include "common/utf8.h"
#include "nvme/io_queue.h"
#include "nvme/swap_folders.h"
#include "nvme/swap_index.h"
#include "nvme/swap_space.h"
#include "nvme/swap_tickets.h"
#include "zinf/crash_point.h"
#include "zinf/log.h"
#include "zinf/swap.h"

namespace zinf {
namespace {

using swap_folders::kIndexName;
using swap_folders::kLockName;
using swap_folders::kPrevIndexName;
using swap_folders::SwapFileName;
// Largest index read back (a few hundred bytes per tensor).
constexpr size_t kMaxIndexBytes = size_t{1} << 30;

struct Entry {
  uint64_t size = 0;
  std::vector<Extent> extents;      // one per file used, indexed by chunk % N
  std::vector<uint64_t> checksums;  // per chunk, when checksums are on
  bool valid = false;               // the last write completed
  std::string last_error;           // why it is not valid
  bool writing = false;
  int readers = 0;
  bool committed = false;  // durable: `extents` hold the committed version (never overwritten)
};

// A chunk to verify against its stored checksum once its read has completed.
struct ChunkCheck {
  const char* data;
  uint64_t len;
  uint64_t expected;
  uint64_t chunk;
  uint32_t file;
  uint64_t offset;
};

Status SyncFolder(const std::string& dir) { return FsyncPath(dir, /*directory=*/true); }

Status RemoveFile(const std::string& path) {
  if (unlink(path.c_str()) != 0 && errno != ENOENT) return ErrnoToStatus(errno, "removing " + path);
  return Status::OK();
}

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Reads the index file at `path` and checks what every reader checks first: its own checksum
// (version 2; version 1, from before, has none and is read with a warning) and that `folders`
// are the ones it records, in its order.
Result<SwapIndex> ReadIndexFile(const std::string& path,
                                const std::vector<swap_folders::Survey>& folders) {
  ZINF_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, kMaxIndexBytes));
  ZINF_ASSIGN_OR_RETURN(SwapIndex index, ParseSwapIndex(text, path));
  if (index.version == 1) {
    LogWarning("the swap index " + path +
               " was written by an older zinf: it carries no checksum of its own and does not "
               "record its folders' order; the next commit or flush writes one that does");
  }
  ZINF_RETURN_IF_ERROR(swap_folders::VerifyFolders(folders, index.store, index.folders));
  return index;
}

// Open's checks of the options that need no folder; `align` is the store's alignment.
Status CheckStoreOptions(const SwapStoreOptions& options, uint64_t align) {
  if (options.chunk_size == 0 || options.chunk_size % align != 0) {
    return Status::InvalidArgument("swap store: chunk size " + std::to_string(options.chunk_size) +
                                   " must be a positive multiple of " + std::to_string(align));
  }
  if (options.capacity_per_path % align != 0 || options.max_capacity_per_path % align != 0) {
    return Status::InvalidArgument("swap store: capacities must be multiples of " +
                                   std::to_string(align) + " bytes");
  }
  if (options.max_capacity_per_path != 0 &&
      options.capacity_per_path > options.max_capacity_per_path) {
    return Status::InvalidArgument("swap store: capacity per path exceeds its maximum");
  }
  if (options.retained_commits != 1 && options.retained_commits != 2) {
    return Status::InvalidArgument("swap store: retained_commits is " +
                                   std::to_string(options.retained_commits) + "; use 1 or 2");
  }
  if (options.reopen_previous && !(options.durable && options.reopen)) {
    return Status::InvalidArgument("swap store: reopen_previous needs durable and reopen");
  }
  return Status::OK();
}

// Each nvme path is valid UTF-8 and names an existing folder (the first one that is not is
// named, with what to do).
Status CheckNvmePaths(const std::vector<std::string>& paths) {
  for (const std::string& dir : paths) {
    if (!IsValidUtf8(dir)) {
      return Status::InvalidArgument("nvme path '" + dir +
                                     "' is not valid UTF-8 (the swap index records it); use a "
                                     "folder whose path is");
    }
    struct stat st {};
    if (stat(dir.c_str(), &st) != 0) {
      const int err = errno;
      if (err == ENOENT) {
        return Status::NotFound("nvme path '" + dir +
                                "' does not exist: create the folder or pass another path");
      }
      return ErrnoToStatus(err, "nvme path '" + dir + "'");
    }
    if (!S_ISDIR(st.st_mode)) {
      return Status::InvalidArgument("nvme path '" + dir +
                                     "' is not a folder: pass the folder to hold swap files");
    }
  }
  return Status::OK();
}

// Opens the swap file at `path` (created empty unless `reopen`) and returns its descriptor:
// with O_DIRECT while `*direct`; where the filesystem refuses it, buffered, with `*direct`
// cleared and one warning per Open (`*warned_buffered`).
Result<int> OpenSwapFile(const std::string& path, bool reopen, bool* direct,
                         bool* warned_buffered) {
  // A reopened store's files must be there (a missing one is damage, not a new file).
  const int flags = O_RDWR | O_CLOEXEC | O_NOFOLLOW | (reopen ? 0 : O_CREAT | O_TRUNC);
  int fd = -1;
  auto open_failed = [&](int err) {
    if (reopen && err == ENOENT) {
      return Status::Corruption("swap file " + path +
                                " of the store is missing: the store cannot be reopened");
    }
    return ErrnoToStatus(err, "opening swap file " + path);
  };
  if (*direct) {
    fd = open(path.c_str(), flags | O_DIRECT, 0600);
    if (fd < 0 && errno == EINVAL) {
      *direct = false;
      if (!*warned_buffered) {
        LogWarning("O_DIRECT refused on " + path +
                   " (tmpfs or a filesystem without direct I/O): using buffered I/O, which "
                   "goes through the page cache");
        *warned_buffered = true;
      }
    } else if (fd < 0) {
      return open_failed(errno);
    }
  }
  if (fd < 0) {
    fd = open(path.c_str(), flags, 0600);
    if (fd < 0) return open_failed(errno);
  }
  return fd;
}

}  // namespace

struct SwapStore::Impl {
  // One per folder, taken before anything in it is read or written (destroyed last).
  std::vector<std::unique_ptr<FolderLock>> locks;
  SwapStoreOptions options;
  // What the folders held at Open (their marks; names of the files), and this store's id:
  // stores that are kept (not remove_on_close) mark every folder with it.
  std::vector<swap_folders::Survey> folders;
  std::string store_id;
  bool marks_committed = false;  // the marks say the store wrote an index (trainer thread)
  uint64_t alignment = 4096;
  bool direct_io = true;
  std::vector<IoFile> files;  // fixed after Open
  std::unique_ptr<IoQueue> queue;
  std::unique_ptr<HashWorker> hasher;

  mutable Mutex mu;
  CondVar cv;  // a ticket ended (in_flight may have dropped)
  std::unique_ptr<SwapSpace> space GUARDED_BY(mu);
  std::unordered_map<std::string, Entry> entries GUARDED_BY(mu);
  TicketTable tickets GUARDED_BY(mu);
  SwapStoreStats stats GUARDED_BY(mu);  // counters; file and allocation bytes from `space`
  bool closed GUARDED_BY(mu) = false;
  // Durable mode: committed extents superseded since the last commit (freed once the next
  // commit is published; with two retained commits, once the one after it is), the extents only
  // the retained previous commit still refers to, and the meta of the last commit (loaded at
  // reopen).
  std::vector<Extent> superseded GUARDED_BY(mu);
  std::vector<Extent> retired GUARDED_BY(mu);
  std::string meta GUARDED_BY(mu);
  bool committing GUARDED_BY(mu) = false;  // Commit in progress: Write and Remove are refused

  ~Impl() {
    queue.reset();   // drains (its completions may still post hashes)
    hasher.reset();  // drains
    for (const IoFile& f : files) close(f.fd);
  }

  uint64_t ChunkLogicalBytes(const Entry& e, uint64_t i) const {
    const uint64_t start = i * options.chunk_size;
    return std::min<uint64_t>(options.chunk_size, e.size - start);
  }

  void FreeExtents(Entry& e) REQUIRES(mu) {
    for (const Extent& x : e.extents) space->Free(x);
    e.extents.clear();
  }

  void WaitIdle() REQUIRES(mu) {
    while (tickets.in_flight() > 0) cv.Wait(&mu);
  }

  // Called once per finished part (chunk transfer or hash). Runs on the I/O thread, the hash
  // thread or the caller.
  void PartDone(Ticket t, const Status& s, const std::string& key, bool is_write) EXCLUDES(mu) {
    MutexLock lock(&mu);
    const Status part = s.ok()
                            ? s
                            : s.WithContext(std::string("swap ") + (is_write ? "write" : "read") +
                                            " of tensor '" + key + "'");
    if (!tickets.PartDone(t, part)) return;
    // The ticket ended: its entry takes the outcome (the first error of its parts).
    const Status& outcome = tickets.status(t);
    auto it = entries.find(key);
    if (it != entries.end()) {
      Entry& e = it->second;
      if (is_write) {
        e.writing = false;
        e.valid = outcome.ok();
        e.last_error = outcome.ok() ? "" : outcome.message();
        if (outcome.ok()) stats.bytes_written += RoundUp(e.size, alignment);
      } else {
        --e.readers;
        if (outcome.ok()) stats.bytes_read += RoundUp(e.size, alignment);
      }
    }
    cv.NotifyAll();
  }

  Status CheckBuffer(const std::string& key, const void* buf, uint64_t size,
                     uint64_t capacity) const {
    if (key.empty()) return Status::InvalidArgument("swap store: empty tensor key");
    if (!IsValidUtf8(key)) {
      return Status::InvalidArgument("swap store: tensor key '" + key +
                                     "' is not valid UTF-8 (keys go into the JSON index)");
    }
    // Far beyond any disk; keeps every size computed from it (rounding, extents) exact.
    if (size > (uint64_t{1} << 56)) {
      return Status::InvalidArgument("swap store: tensor '" + key + "' of " + std::to_string(size) +
                                     " bytes is larger than any disk");
    }
    if (reinterpret_cast<uintptr_t>(buf) % alignment != 0) {
      char addr[32];
      std::snprintf(addr, sizeof(addr), "%p", buf);
      return Status::InvalidArgument(
          "buffer for tensor '" + key + "' at " + addr + " is not aligned to " +
          std::to_string(alignment) +
          " bytes (needed for direct I/O); allocate it from a PinnedArena or with "
          "zinf_alloc_aligned");
    }
    if (capacity < RoundUp(size, alignment)) {
      return Status::InvalidArgument(
          "buffer for tensor '" + key + "' holds " + std::to_string(capacity) + " bytes but " +
          std::to_string(RoundUp(size, alignment)) + " are needed (size " + std::to_string(size) +
          " rounded up to " + std::to_string(alignment) + ")");
    }
    if (size > 0 && buf == nullptr) {
      return Status::InvalidArgument("null buffer for tensor '" + key + "'");
    }
    return Status::OK();
  }

  // `meta`: durable mode's commit description. `renamed` (optional): set once the new index
  // has replaced the old one.
  Status WriteIndex(const std::string* meta = nullptr, bool* renamed = nullptr) EXCLUDES(mu);
  // Loads the index file `name` in the first path into the entries and the space.
  Status LoadIndex(const char* name) EXCLUDES(mu);
  // Reopen: loads the index to continue from (durable stores: the last or the previous
  // commit, dropping the other one).
  Status Reopen() EXCLUDES(mu);
  // After a reopen: every folder carries this store's mark, saying it committed (written for
  // a store from before marks, or where a mark was lost).
  Status EnsureMarks();
  // Open's first step: takes each folder's lock, once however often it is listed.
  Status LockFolders();
  // Surveys the folders; a reopen checks that they hold this store's index, a fresh store
  // refuses another store's (unless overwrite), clears them and, when kept, marks them.
  Status ClaimFolders();
  // Opens (or creates) the swap file of each folder into `files` and returns the files' sizes
  // (0 for new ones); a store not kept unlinks them at once.
  Result<std::vector<uint64_t>> OpenSwapFiles();
  // Creates the space on the files, whose sizes are `sizes`.
  void CreateSpace(std::vector<uint64_t> sizes) EXCLUDES(mu);
  // Grows each file to capacity_per_path.
  Status PreallocateFiles() EXCLUDES(mu);
  // Starts the I/O queue on the backend asked for (io_uring falls back to libaio, then psync,
  // with a warning) and the hash worker.
  Status StartIoBackend();
  // Reopen, before any file is opened: the first folder holds the index, or Open fails saying
  // what the folders hold instead (nothing, a store that never committed, another order, a
  // lost index).
  Status CheckBeforeReopen() const {
    if (folders[0].HoldsIndex()) {
      // Its checksum and its folders before any swap file is opened (so that a folder given
      // in the wrong place is named as such, not as a missing file). Read again to load it.
      const std::string index =
          options.paths[0] + "/" + (folders[0].index ? kIndexName : kPrevIndexName);
      return ReadIndexFile(index, folders).status();
    }
    bool uncommitted = false;
    ZINF_RETURN_IF_ERROR(swap_folders::ClassifyWithoutIndex(folders, &uncommitted));
    return Status::NotFound("cannot reopen the swap store in " + options.paths[0] +
                            ": it never wrote an index (its run stopped while initialising), "
                            "so it holds nothing to reopen");
  }
};

SwapStore::SwapStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
  alignment_ = impl_->alignment;
  direct_io_ = impl_->direct_io;
}

SwapStore::~SwapStore() {
  if (!impl_) return;
  bool closed;
  {
    MutexLock lock(&impl_->mu);
    closed = impl_->closed;
  }
  if (!closed) {
    Status s = Close();
    if (!s.ok()) LogWarning("closing the swap store: " + s.ToString());
  }
}

Result<std::unique_ptr<SwapStore>> SwapStore::Open(const SwapStoreOptions& options) {
  if (options.paths.empty()) {
    return Status::InvalidArgument("swap store: no nvme path given; pass at least one folder");
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  ZINF_RETURN_IF_ERROR(CheckStoreOptions(options, impl->alignment));
  ZINF_RETURN_IF_ERROR(CheckNvmePaths(options.paths));
  // Every folder locked before anything in one is touched: a second store (another run, or
  // another engine of this process) on the same folder is refused, naming the holder.
  ZINF_RETURN_IF_ERROR(impl->LockFolders());
  // What the folders hold decides what Open may do: a fresh store never replaces another one
  // (unless told to), a reopened one must find its own folders in its order.
  ZINF_RETURN_IF_ERROR(impl->ClaimFolders());
  ZINF_ASSIGN_OR_RETURN(std::vector<uint64_t> sizes, impl->OpenSwapFiles());
  impl->CreateSpace(std::move(sizes));
  if (options.reopen) {
    ZINF_RETURN_IF_ERROR(impl->Reopen());
    ZINF_RETURN_IF_ERROR(impl->EnsureMarks());
  }
  ZINF_RETURN_IF_ERROR(impl->PreallocateFiles());
  ZINF_RETURN_IF_ERROR(impl->StartIoBackend());
  return std::unique_ptr<SwapStore>(new SwapStore(std::move(impl)));
}

Status SwapStore::Impl::LockFolders() {
  std::vector<std::string> locked;  // canonical paths (a folder may be listed twice)
  for (const std::string& dir : options.paths) {
    char* real = realpath(dir.c_str(), nullptr);
    if (real == nullptr) return ErrnoToStatus(errno, "nvme path '" + dir + "'");
    std::string canonical(real);
    std::free(real);
    if (std::find(locked.begin(), locked.end(), canonical) != locked.end()) continue;
    locked.push_back(canonical);
    ZINF_ASSIGN_OR_RETURN(std::unique_ptr<FolderLock> lock,
                          FolderLock::Acquire(dir, kLockName, "swap folder"));
    locks.push_back(std::move(lock));
  }
  return Status::OK();
}

Status SwapStore::Impl::ClaimFolders() {
  ZINF_ASSIGN_OR_RETURN(folders, swap_folders::SurveyFolders(options.paths));
  if (options.reopen) return CheckBeforeReopen();
  if (!options.overwrite) {
    Status refused = swap_folders::RefuseToReplace(folders);
    if (!refused.ok()) {
      return Status(refused.code(), refused.message() +
                                        ": reopen that store, give other folders, or replace "
                                        "it (SwapStoreOptions::overwrite)");
    }
  }
  ZINF_RETURN_IF_ERROR(swap_folders::ClearFolders(folders));
  if (!options.remove_on_close) {
    ZINF_ASSIGN_OR_RETURN(store_id, swap_folders::NewStoreId());
    ZINF_RETURN_IF_ERROR(swap_folders::WriteMarks(folders, store_id, /*committed=*/false));
  }
  return Status::OK();
}

Result<std::vector<uint64_t>> SwapStore::Impl::OpenSwapFiles() {
  const bool keep = !options.remove_on_close;
  bool warned_buffered = false;
  std::vector<uint64_t> sizes;
  for (size_t i = 0; i < options.paths.size(); ++i) {
    const std::string path = SwapFileName(options.paths[i], i);
    bool direct = options.direct_io;
    ZINF_ASSIGN_OR_RETURN(const int fd,
                          OpenSwapFile(path, options.reopen, &direct, &warned_buffered));
    if (!direct) direct_io = false;
    files.push_back({fd, path});
    struct stat st {};
    if (fchmod(fd, 0600) != 0) return ErrnoToStatus(errno, "fchmod 0600 " + path);
    if (fstat(fd, &st) != 0) return ErrnoToStatus(errno, "fstat " + path);
    if (!S_ISREG(st.st_mode)) return Status::InvalidArgument(path + " is not a regular file");
    // A store nobody reopens keeps its files only as long as they are open: a run killed at
    // any point leaves nothing behind.
    if (!keep && unlink(path.c_str()) != 0) return ErrnoToStatus(errno, "unlinking " + path);
    sizes.push_back(options.reopen ? static_cast<uint64_t>(st.st_size) : 0);
  }
  if (!keep) {
    for (const std::string& dir : options.paths) ZINF_RETURN_IF_ERROR(SyncFolder(dir));
  }
  return sizes;
}

void SwapStore::Impl::CreateSpace(std::vector<uint64_t> sizes) {
  SwapSpaceOptions so;
  so.chunk_size = options.chunk_size;
  so.alignment = alignment;
  so.growth_step = options.growth_step;
  so.max_capacity_per_path = options.max_capacity_per_path;
  so.reserve_bytes = options.reserve_bytes;
  MutexLock lock(&mu);
  space = std::make_unique<SwapSpace>(so, files, std::move(sizes));
}

Status SwapStore::Impl::PreallocateFiles() {
  MutexLock lock(&mu);
  for (size_t f = 0; f < files.size(); ++f) {
    ZINF_RETURN_IF_ERROR(space->Preallocate(f, options.capacity_per_path));
  }
  return Status::OK();
}

Status SwapStore::Impl::StartIoBackend() {
  // The backend: the one asked for; when that is io_uring (the default) and it cannot be set
  // up here, libaio, then psync, with one warning naming the real cause.
  std::vector<IoBackendKind> kinds = {options.backend};
  if (options.backend == IoBackendKind::kIoUring) {
    kinds.push_back(IoBackendKind::kLibaio);
    kinds.push_back(IoBackendKind::kPsync);
  }
  Status first_failure;
  for (IoBackendKind kind : kinds) {
    Result<std::unique_ptr<IoBackend>> backend = NewIoBackend(kind, options.backend_options);
    Status failed = backend.status();
    if (backend.ok()) {
      std::unique_ptr<IoBackend> b = std::move(backend).value();
      if (options.fault_plan) b = NewFaultyBackend(std::move(b), options.fault_plan);
      IoQueueOptions qopt;
      qopt.block_size = options.block_size;
      Result<std::unique_ptr<IoQueue>> started =
          IoQueue::Start(std::move(b), files, options.registered_regions, qopt);
      if (started.ok()) {
        queue = std::move(started).value();
        // (Always: a reopened store may hold checksums although this one writes none.)
        try {
          hasher = std::make_unique<HashWorker>();
        } catch (const std::system_error& e) {  // no thread could be started
          return Status::ResourceExhausted(std::string("swap store: starting its hash thread: ") +
                                           e.what());
        }
        if (!first_failure.ok()) {
          LogWarning("the " + std::string(IoBackendKindName(options.backend)) +
                     " I/O backend is unavailable here (" + first_failure.message() +
                     "); the swap store uses " + IoBackendKindName(kind) +
                     " (zinf.io_backend / --io-backend choose one)");
        }
        return Status::OK();
      }
      failed = started.status();
    }
    if (first_failure.ok()) first_failure = failed;
  }
  return first_failure.WithContext("opening the swap store's I/O backend");
}

Result<Ticket> SwapStore::Write(const std::string& key, const void* buf, uint64_t size,
                                uint64_t capacity) {
  Impl& m = *impl_;
  ZINF_RETURN_IF_ERROR(m.CheckBuffer(key, buf, size, capacity));
  const uint64_t padded = RoundUp(size, m.alignment);
  std::vector<Transfer> transfers;
  uint64_t chunks = 0;
  bool hashed = false;
  Ticket ticket;
  {
    MutexLock lock(&m.mu);
    chunks = m.space->NumChunks(padded);
    // With checksums each chunk is hashed by the hash worker while it is being written (the
    // buffer is the caller's and stays unchanged until the ticket is waited for).
    hashed = m.options.checksums && chunks > 0;
    if (m.closed) return Status::FailedPrecondition("swap store is closed");
    if (m.committing) {
      return Status::FailedPrecondition("write of tensor '" + key +
                                        "' during a Commit of the swap store; commit between "
                                        "steps, with no write in flight");
    }
    auto it = m.entries.find(key);
    if (it != m.entries.end() && (it->second.writing || it->second.readers > 0)) {
      return Status::FailedPrecondition("tensor '" + key +
                                        "' has a swap request in flight; wait for its ticket "
                                        "before writing it again");
    }
    // Durable: the committed version stays where it is until the next commit.
    const bool keep_old = m.options.durable && it != m.entries.end() && it->second.committed;
    const bool reuse = it != m.entries.end() && RoundUp(it->second.size, m.alignment) == padded &&
                       !it->second.extents.empty() && !keep_old;
    if (!reuse && (padded > 0 || keep_old)) {
      // Allocate before freeing the old extents: a full disk leaves the old tensor intact.
      std::vector<Extent> extents;
      if (padded > 0) {
        ZINF_ASSIGN_OR_RETURN(extents, m.space->Allocate(size, key));
      }
      if (keep_old) {
        Entry& old = it->second;
        m.superseded.insert(m.superseded.end(), old.extents.begin(), old.extents.end());
        old.extents.clear();
        old.committed = false;
      } else if (it != m.entries.end()) {
        m.FreeExtents(it->second);
      }
      m.entries[key].extents = std::move(extents);
    }
    Entry& e = m.entries[key];
    if (it == m.entries.end()) ++m.stats.tensors;
    m.stats.bytes_stored = m.stats.bytes_stored - (it != m.entries.end() ? e.size : 0) + size;
    e.size = size;
    e.checksums.assign(m.options.checksums ? chunks : 0, 0);  // filled in by the hashes
    e.writing = true;
    e.valid = false;
    for (uint64_t i = 0; i < chunks; ++i) {
      transfers.push_back(m.space->ChunkTransfer(e.extents, padded, i, IoOp::kWrite,
                                                 static_cast<char*>(const_cast<void*>(buf))));
    }
    ticket = m.tickets.Open(static_cast<int>(std::max<uint64_t>(chunks, 1) * (hashed ? 2 : 1)));
  }
  auto done = [&m, ticket, key](const Status& s) { m.PartDone(ticket, s, key, /*is_write=*/true); };
  if (chunks == 0) {
    done(Status::OK());
    return ticket;
  }
  for (const Transfer& t : transfers) m.queue->Submit(t, done);
  if (hashed) {
    const uint64_t chunk_size = m.options.chunk_size;
    for (uint64_t i = 0; i < chunks; ++i) {
      m.hasher->Post(
          [&m, done, key, buf, size, chunk_size, i] {
            auto t0 = std::chrono::steady_clock::now();
            const uint64_t start = i * chunk_size;
            const uint64_t sum = XXH3_64bits(static_cast<const char*>(buf) + start,
                                             std::min<uint64_t>(chunk_size, size - start));
            {
              MutexLock lock(&m.mu);
              auto it = m.entries.find(key);  // kept while it is being written
              if (it != m.entries.end() && i < it->second.checksums.size()) {
                it->second.checksums[i] = sum;
              }
              m.stats.checksum_seconds += SecondsSince(t0);
            }
            done(Status::OK());
          },
          /*read_check=*/false);
    }
  }
  CrashPoint("swap.write");
  return ticket;
}

Result<Ticket> SwapStore::Read(const std::string& key, void* buf, uint64_t capacity, bool urgent) {
  Impl& m = *impl_;
  std::vector<Transfer> transfers;
  std::vector<ChunkCheck> checks;
  Ticket ticket;
  {
    MutexLock lock(&m.mu);
    if (m.closed) return Status::FailedPrecondition("swap store is closed");
    auto it = m.entries.find(key);
    if (it == m.entries.end()) {
      return Status::NotFound("tensor '" + key + "' is not in the swap store");
    }
    Entry& e = it->second;
    ZINF_RETURN_IF_ERROR(m.CheckBuffer(key, buf, e.size, capacity));
    if (e.writing) {
      return Status::FailedPrecondition("tensor '" + key +
                                        "' is being written; wait for the write's ticket first");
    }
    if (!e.valid) {
      return Status::FailedPrecondition("tensor '" + key + "' has no valid copy on disk: its " +
                                        "last write failed (" + e.last_error +
                                        "); write it again before reading");
    }
    const uint64_t padded = RoundUp(e.size, m.alignment);
    const uint64_t chunks = m.space->NumChunks(padded);
    for (uint64_t i = 0; i < chunks; ++i) {
      transfers.push_back(
          m.space->ChunkTransfer(e.extents, padded, i, IoOp::kRead, static_cast<char*>(buf)));
      transfers.back().urgent = urgent;
    }
    ++e.readers;
    ticket = m.tickets.Open(static_cast<int>(std::max<uint64_t>(chunks, 1)));
    for (uint64_t i = 0; i < e.checksums.size(); ++i) {
      const Transfer& t = transfers[i];
      checks.push_back({static_cast<const char*>(t.buf), m.ChunkLogicalBytes(e, i), e.checksums[i],
                        i, t.file, t.offset});
    }
  }
  auto done = [&m, ticket, key](const Status& s) {
    m.PartDone(ticket, s, key, /*is_write=*/false);
  };
  if (transfers.empty()) {
    done(Status::OK());
    return ticket;
  }
  for (size_t i = 0; i < transfers.size(); ++i) {
    if (i >= checks.size()) {
      m.queue->Submit(transfers[i], done);
      continue;
    }
    // Verified by the hash worker as soon as it lands; the chunk counts as done after.
    const ChunkCheck c = checks[i];
    m.queue->Submit(transfers[i], [&m, done, c](const Status& s) {
      if (!s.ok()) {
        done(s);
        return;
      }
      m.hasher->Post(
          [&m, done, c] {
            auto t0 = std::chrono::steady_clock::now();
            const uint64_t got = XXH3_64bits(c.data, c.len);
            Status v;
            if (got != c.expected) {
              v = Status::Corruption("checksum mismatch in chunk " + std::to_string(c.chunk) +
                                     " (" + m.files[c.file].path + " offset " +
                                     std::to_string(c.offset) + "): stored " +
                                     std::to_string(c.expected) + ", read " + std::to_string(got) +
                                     "; the data on disk is damaged");
            }
            {
              MutexLock lock(&m.mu);
              m.stats.checksum_seconds += SecondsSince(t0);
            }
            done(v);
          },
          /*read_check=*/true);
    });
  }
  return ticket;
}

Status SwapStore::Wait(Ticket ticket) {
  Impl& m = *impl_;
  MutexLock lock(&m.mu);
  if (!m.tickets.Known(ticket)) return m.tickets.Take(ticket);  // InvalidArgument, naming it
  while (!m.tickets.Ended(ticket)) m.cv.Wait(&m.mu);
  // (Read chunks were verified as they landed: a mismatch is the ticket's status.)
  return m.tickets.Take(ticket);
}

bool SwapStore::Done(Ticket ticket) const {
  const Impl& m = *impl_;
  MutexLock lock(&m.mu);
  return m.tickets.Ended(ticket);
}

Result<uint64_t> SwapStore::Size(const std::string& key) const {
  MutexLock lock(&impl_->mu);
  auto it = impl_->entries.find(key);
  if (it == impl_->entries.end()) {
    return Status::NotFound("tensor '" + key + "' is not in the swap store");
  }
  return it->second.size;
}

bool SwapStore::Contains(const std::string& key) const {
  MutexLock lock(&impl_->mu);
  return impl_->entries.count(key) != 0;
}

std::vector<std::string> SwapStore::Keys() const {
  MutexLock lock(&impl_->mu);
  std::vector<std::string> keys;
  for (const auto& [k, e] : impl_->entries) keys.push_back(k);
  std::sort(keys.begin(), keys.end());
  return keys;
}

Status SwapStore::Remove(const std::string& key) {
  Impl& m = *impl_;
  MutexLock lock(&m.mu);
  if (m.committing) {
    return Status::FailedPrecondition("removing tensor '" + key + "' during a Commit");
  }
  auto it = m.entries.find(key);
  if (it == m.entries.end())
    return Status::NotFound("tensor '" + key + "' is not in the swap store");
  if (it->second.writing || it->second.readers > 0) {
    return Status::FailedPrecondition("tensor '" + key + "' has a swap request in flight");
  }
  if (m.options.durable && it->second.committed) {
    // Still part of the last commit: freed once the next one is published.
    m.superseded.insert(m.superseded.end(), it->second.extents.begin(), it->second.extents.end());
    it->second.extents.clear();
  } else {
    m.FreeExtents(it->second);
  }
  m.stats.bytes_stored -= it->second.size;
  --m.stats.tensors;
  m.entries.erase(it);
  return Status::OK();
}

Status SwapStore::SetRegionsRegistered(bool registered) {
  Impl& m = *impl_;
  {
    MutexLock lock(&m.mu);
    if (m.closed) return Status::FailedPrecondition("SetRegionsRegistered on a closed swap store");
    m.WaitIdle();
  }
  return m.queue->RunWhenIdle(
      [registered](IoBackend* backend) { return backend->SetBuffersRegistered(registered); });
}

Status SwapStore::Flush() {
  Impl& m = *impl_;
  if (m.options.durable) {
    return Status::FailedPrecondition(
        "Flush on a durable swap store: its index is written by Commit only");
  }
  {
    MutexLock lock(&m.mu);
    m.WaitIdle();
  }
  for (const IoFile& f : m.files) {
    if (fdatasync(f.fd) != 0) return ErrnoToStatus(errno, "fdatasync " + f.path);
  }
  return m.WriteIndex();
}

Status SwapStore::Commit(const std::string& meta) {
  Impl& m = *impl_;
  if (!m.options.durable) {
    return Status::FailedPrecondition("Commit on a swap store not opened in durable mode");
  }
  {
    MutexLock lock(&m.mu);
    if (m.committing) return Status::FailedPrecondition("Commit while another one runs");
    m.WaitIdle();
    if (m.closed) return Status::FailedPrecondition("swap store is closed");
    for (const auto& [key, e] : m.entries) {
      if (!e.valid) {
        return Status::FailedPrecondition("cannot commit the swap store: tensor '" + key +
                                          "' has no valid copy (" + e.last_error + ")");
      }
    }
    // From here to the end no write or removal may change what is being published.
    m.committing = true;
  }
  struct Unmark {
    Impl& m;
    ~Unmark() {
      MutexLock lock(&m.mu);
      m.committing = false;
    }
  } unmark{m};
  for (const IoFile& f : m.files) {
    if (fdatasync(f.fd) != 0) return ErrnoToStatus(errno, "fdatasync " + f.path);
  }
  CrashPoint("swap.commit");
  bool renamed = false;
  Status written = m.WriteIndex(&meta, &renamed);
  // Once the new index is in place it is the state a reopen sees, whatever failed after the
  // rename (the folder's fsync): the superseded extents are not referenced any more.
  if (!renamed) return written;
  CrashPoint("swap.committed");
  MutexLock lock(&m.mu);
  // Free what no retained commit refers to any more: the extents this commit superseded, or,
  // when the previous commit stays loadable, those only the commit before it referred to.
  std::vector<Extent>& unused = m.options.retained_commits == 2 ? m.retired : m.superseded;
  for (const Extent& x : unused) m.space->Free(x);
  unused.clear();
  if (m.options.retained_commits == 2) std::swap(m.retired, m.superseded);
  for (auto& [key, e] : m.entries) e.committed = true;
  m.meta = meta;
  return written;
}

std::string SwapStore::committed_meta() const {
  MutexLock lock(&impl_->mu);
  return impl_->meta;
}

Status SwapStore::Close() {
  Status s;
  if (impl_->options.durable || impl_->options.remove_on_close) {
    // No commit (durable): the last one stays the state a reopen sees. Removed at close:
    // nothing to sync or index.
    MutexLock lock(&impl_->mu);
    impl_->WaitIdle();
  } else {
    s = Flush();
  }
  MutexLock lock(&impl_->mu);
  impl_->closed = true;
  if (impl_->options.remove_on_close) {
    for (const IoFile& f : impl_->files) {
      if (unlink(f.path.c_str()) != 0 && errno != ENOENT && s.ok()) {
        s = ErrnoToStatus(errno, "removing swap file " + f.path);
      }
    }
    for (const char* name : {kIndexName, kPrevIndexName}) {
      // ENOENT is the usual case (nothing to remove); anything else leaves a file nobody
      // reopens, and the store is gone either way.
      (void)RemoveFile(impl_->options.paths[0] + "/" + name);
    }
  }
  // Nothing more is written: the folders may be another store's from now on.
  impl_->locks.clear();
  return s;
}

std::string SwapStore::backend_features() const {
  return std::string(impl_->queue->BackendName()) + " " + impl_->queue->Features();
}

std::vector<std::string> SwapStore::file_paths() const {
  std::vector<std::string> paths;
  for (const IoFile& f : impl_->files) paths.push_back(f.path);
  return paths;
}

SwapStoreStats SwapStore::stats() const {
  MutexLock lock(&impl_->mu);
  SwapStoreStats s = impl_->stats;
  s.bytes_allocated = impl_->space->allocated_bytes();
  s.file_bytes = impl_->space->file_bytes();
  s.busy_seconds = impl_->tickets.busy_seconds();
  return s;
}

// ---- Index -----------------------------------------------------------------------------------

Status SwapStore::Impl::WriteIndex(const std::string* commit_meta, bool* renamed) {
  SwapIndex index;
  {
    MutexLock lock(&mu);
    index.has_meta = commit_meta != nullptr;
    if (commit_meta != nullptr) index.meta = *commit_meta;
    index.alignment = alignment;
    index.chunk_size = options.chunk_size;
    index.checksums = options.checksums;
    for (size_t f = 0; f < files.size(); ++f) {
      index.files.push_back({files[f].path, space->file_size(f)});
    }
    for (const auto& [key, e] : entries) {
      if (!e.valid) continue;  // nothing trustworthy to reopen
      index.tensors[key] = {e.size, e.extents, e.checksums};
    }
    index.store = store_id;
    for (const swap_folders::Survey& f : folders) index.folders.push_back(f.canonical);
  }
  const std::string text = SerializeSwapIndex(index);
  // The marks say "this store holds data" before the first index can say it: a store whose
  // index is lost later is then never taken for one that never committed.
  if (!options.remove_on_close && !marks_committed) {
    ZINF_RETURN_IF_ERROR(swap_folders::WriteMarks(folders, store_id, /*committed=*/true));
    marks_committed = true;
  }
  const std::string dir = options.paths[0];
  const std::string final_path = dir + "/" + kIndexName;
  // Through kIndexName.tmp, fsync'ed, renamed over kIndexName, the folder fsync'ed.
  ReplaceFileOptions replace;
  replace.renamed = renamed;
  if (commit_meta != nullptr && options.retained_commits == 2) {
    // The last commit becomes the previous one, once the new index is durable in its
    // temporary. A crash right after this rename leaves it as the only index, which a reopen
    // then takes as the last commit.
    replace.before_rename = [&]() -> Status {
      const std::string prev_path = dir + "/" + kPrevIndexName;
      if (rename(final_path.c_str(), prev_path.c_str()) != 0) {
        if (errno == ENOENT) return Status::OK();
        return ErrnoToStatus(errno, "renaming " + final_path + " to " + prev_path);
      }
      // Durable before the next rename, whatever order the filesystem keeps renames in.
      return SyncFolder(dir);
    };
  }
  return ReplaceFile(final_path, text.data(), text.size(), replace);
}

Status SwapStore::Impl::Reopen() {
  const std::string dir = options.paths[0];
  const std::string index = dir + "/" + kIndexName;
  const std::string prev = dir + "/" + kPrevIndexName;
  if (!options.durable) return LoadIndex(kIndexName);
  const bool has_index = folders[0].index;
  const bool has_prev = folders[0].prev;
  if (options.reopen_previous && !(has_index && has_prev)) {
    return Status::NotFound("cannot reopen the swap store in " + dir +
                            " at its previous commit: it holds " +
                            (has_index || has_prev ? "only one commit" : "no commit"));
  }
  if (options.reopen_previous || !has_index) {
    // The previous commit (or the only one left by a crash between the renames of a commit)
    // becomes the last: the later one, whose extents are reused from now on, is dropped.
    ZINF_RETURN_IF_ERROR(LoadIndex(has_prev ? kPrevIndexName : kIndexName));
    if (rename(prev.c_str(), index.c_str()) != 0) {
      return ErrnoToStatus(errno, "renaming " + prev + " to " + index);
    }
    return SyncFolder(dir);
  }
  ZINF_RETURN_IF_ERROR(LoadIndex(kIndexName));
  // Only the last commit's extents are kept: the previous one is not loadable any more.
  if (has_prev) {
    ZINF_RETURN_IF_ERROR(RemoveFile(prev));
    return SyncFolder(dir);
  }
  return Status::OK();
}

Result<std::vector<std::string>> SwapStore::ListCommits(const std::vector<std::string>& paths) {
  if (paths.empty()) return Status::InvalidArgument("ListCommits: no swap folder given");
  ZINF_ASSIGN_OR_RETURN(std::vector<swap_folders::Survey> folders,
                        swap_folders::SurveyFolders(paths));
  std::vector<std::string> metas;
  if (!folders[0].HoldsIndex()) {
    bool uncommitted = false;
    ZINF_RETURN_IF_ERROR(swap_folders::ClassifyWithoutIndex(folders, &uncommitted));
    return metas;  // a store that never committed
  }
  for (const char* name : {kIndexName, kPrevIndexName}) {
    if (!(name == kIndexName ? folders[0].index : folders[0].prev)) continue;
    const std::string path = paths[0] + "/" + name;
    ZINF_ASSIGN_OR_RETURN(SwapIndex index, ReadIndexFile(path, folders));
    if (!index.has_meta) {
      return Status::Corruption("swap index " + path + " is not a durable store's commit record");
    }
    metas.push_back(index.meta);
  }
  return metas;
}

std::string SwapStore::FileName(const std::string& dir, size_t index) {
  return SwapFileName(dir, index);
}

Status SwapStore::Impl::EnsureMarks() {
  if (options.remove_on_close) return Status::OK();
  bool marked = !store_id.empty();
  for (const swap_folders::Survey& f : folders) {
    marked =
        marked && f.has_mark && f.mark_status.ok() && f.mark.store == store_id && f.mark.committed;
  }
  if (!marked) {
    if (store_id.empty()) {
      ZINF_ASSIGN_OR_RETURN(store_id, swap_folders::NewStoreId());
    }
    ZINF_RETURN_IF_ERROR(swap_folders::WriteMarks(folders, store_id, /*committed=*/true));
  }
  marks_committed = true;
  return Status::OK();
}

Status SwapStore::Impl::LoadIndex(const char* name) {
  const std::string path = options.paths[0] + "/" + name;
  if (access(path.c_str(), F_OK) != 0 && errno == ENOENT) {
    return Status::NotFound("cannot reopen the swap store: no index at " + path +
                            " (it is written by Close/Flush)");
  }
  auto bad = [&](const std::string& why) {
    return Status::Corruption("swap index " + path + ": " + why +
                              "; the store cannot be reopened (start a fresh one)");
  };
  ZINF_ASSIGN_OR_RETURN(SwapIndex index, ReadIndexFile(path, folders));
  store_id = index.store;
  if (index.alignment != alignment) return bad("alignment differs");
  if (index.chunk_size != options.chunk_size) {
    return bad("it was written with chunk size " + std::to_string(index.chunk_size) + ", not " +
               std::to_string(options.chunk_size));
  }
  if (index.files.size() != files.size()) {
    return bad("it lists " + std::to_string(index.files.size()) + " swap files but " +
               std::to_string(files.size()) + " paths were given");
  }
  MutexLock lock(&mu);
  for (size_t f = 0; f < files.size(); ++f) {
    if (index.files[f].size > space->file_size(f)) {
      return bad(files[f].path + " is shorter (" + std::to_string(space->file_size(f)) +
                 " bytes) than recorded (" + std::to_string(index.files[f].size) + ")");
    }
  }
  space->FreeAll();
  if (index.has_meta) meta = index.meta;
  for (auto& [key, t] : index.tensors) {
    Entry e;
    e.size = t.size;
    e.valid = true;
    e.committed = true;
    for (const Extent& x : t.extents) {
      if (!space->Reserve(x)) {
        return bad("tensor '" + key + "' has an extent outside its file or overlapping another");
      }
    }
    e.extents = std::move(t.extents);
    const uint64_t padded = RoundUp(e.size, alignment);
    if (e.extents.size() != space->ExtentCount(padded)) {
      return bad("tensor '" + key + "' has the wrong extent count");
    }
    if (index.checksums) {
      if (t.checksums.size() != space->NumChunks(padded)) {
        return bad("tensor '" + key + "' has the wrong checksum count");
      }
      e.checksums = std::move(t.checksums);
    }
    ++stats.tensors;
    stats.bytes_stored += e.size;
    entries.emplace(key, std::move(e));
  }
  return Status::OK();
}

}  // namespace zinf
