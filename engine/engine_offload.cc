// offload_states / reload_states: the engine's device memory moved out between phases (an RLHF
// trainer's generation, another model's turn) and back, the training then going on bit for bit.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "engine/engine_impl.h"
#include "zinf/log.h"

namespace zinf {

namespace {
constexpr size_t kHostAlign = 4096;  // each kept buffer's offset in the host copy

std::string TypeNames(uint32_t mask) {
  std::string s;
  for (auto [bit, name] : {std::pair{Engine::kOffloadParams, "lp_params"},
                           std::pair{Engine::kOffloadOptimizerStates, "optim_states"},
                           std::pair{Engine::kOffloadGradients, "lp_grads"}}) {
    if (mask & bit) s += (s.empty() ? "" : ", ") + std::string(name);
  }
  return s;
}

struct Piece {
  std::string key;
  void* buf;
  size_t bytes;  // a multiple of 4096, as the buffer's capacity
};

// Every piece written (or read) through `store`, all in flight together; the first failure.
Status TransferAll(SwapStore* store, const std::vector<Piece>& pieces, bool write) {
  std::vector<Ticket> tickets;
  Status first;
  for (const Piece& p : pieces) {
    Result<Ticket> t = write ? store->Write(p.key, p.buf, p.bytes, p.bytes)
                             : store->Read(p.key, p.buf, p.bytes, /*urgent=*/true);
    if (!t.ok()) {
      first = t.status();
      break;
    }
    tickets.push_back(*t);
  }
  for (Ticket t : tickets) {
    Status s = store->Wait(t);
    if (first.ok()) first = s;
  }
  return first;
}

void RemoveAll(SwapStore* store, const std::vector<Piece>& pieces) {
  for (const Piece& p : pieces) {
    if (!store->Contains(p.key)) continue;
    Status s = store->Remove(p.key);
    // (Space in a store removed at close; the values are elsewhere by now.)
    if (!s.ok()) LogWarning("offload_states: freeing its NVMe copy: " + s.ToString());
  }
}

std::vector<Piece> NvmePieces(const std::vector<MemoryRegion>& arena_pages, void* host,
                              size_t host_used) {
  std::vector<Piece> pieces;
  if (host_used > 0) pieces.push_back({"device", host, host_used});
  for (size_t i = 0; i < arena_pages.size(); ++i) {
    pieces.push_back({"arena/" + std::to_string(i), arena_pages[i].base, arena_pages[i].len});
  }
  return pieces;
}
}  // namespace

void Engine::Impl::ReleaseHostCopy(Offloaded* o) {
  if (o->registered && o->host) {
    Status s = device_->UnregisterHostMemory(o->host->data);
    if (!s.ok()) LogWarning("releasing offload_states' host copy: " + s.ToString());
  }
  o->registered = false;
  o->host.reset();
}

void Engine::Impl::KeepAsSpare(std::unique_ptr<Offloaded> o) {
  if (!o->host) return;  // (nothing was copied: the spare there is stays)
  if (spare_) ReleaseHostCopy(spare_.get());
  o->moved.clear();
  o->mask = 0;
  spare_ = std::move(o);
}

Status Engine::Impl::EnsureStatesLoaded(uint32_t needed) {
  if (offloaded_ && (offloaded_->mask & needed) != 0) {
    ZINF_RETURN_IF_ERROR(ReloadTypes(needed, /*non_blocking=*/false));
  }
  if (reloading_) {
    // A non-blocking reload: its copies end before anything reads the states (the streams
    // already wait for them), and its host copy is kept for the next offload.
    ZINF_RETURN_IF_ERROR(
        device_->SynchronizeStream(streams_.copy).WithContext("waiting for reload_states' copies"));
    KeepAsSpare(std::move(reloading_));
  }
  return Status::OK();
}

// The device buffers of the types in `include`, into `off` (the fetched copies dropped first
// when the parameters are included).
Status Engine::Impl::CollectSlots(uint32_t include, Offloaded* off) {
  auto add = [off](std::vector<DeviceSlot> slots, uint32_t type) {
    for (DeviceSlot& slot : slots) off->moved.push_back({std::move(slot), 0, type});
  };
  if (include & Engine::kOffloadParams) {
    ZINF_RETURN_IF_ERROR(core_->fetch->DropAll());
    std::vector<DeviceSlot> slots;
    core_->params->DeviceSlots(&slots);
    add(std::move(slots), Engine::kOffloadParams);
  }
  if (include & Engine::kOffloadOptimizerStates) {
    std::vector<DeviceSlot> slots;
    core_->states->DeviceSlots(&slots);
    add(std::move(slots), Engine::kOffloadOptimizerStates);
  }
  if (include & Engine::kOffloadGradients) {
    std::vector<DeviceSlot> slots;
    core_->grads->DeviceSlots(&slots);
    if (core_->local_grads) core_->local_grads->DeviceSlots(&slots);
    add(std::move(slots), Engine::kOffloadGradients);
  }
  return Status::OK();
}

Status Engine::Impl::OffloadStates(const Engine::OffloadStatesOptions& o) {
  if (!broken_.ok()) return broken_;
  const bool to_nvme = o.device == Tier::kNvme;
  if (o.device != Tier::kCpu && !to_nvme) {
    return Status::InvalidArgument("offload_states: device must be cpu or nvme");
  }
  if ((o.include & ~uint32_t{Engine::kOffloadAll}) != 0 || o.include == 0) {
    return Status::InvalidArgument("offload_states: include names no known state (mask " +
                                   std::to_string(o.include) + ")");
  }
  if (!registered_) {
    return Status::FailedPrecondition(
        "offload_states before the engine holds anything (registration ends at the first "
        "Acquire)");
  }
  // Every rank offloads the same states at the same point: each drops its fetched copies, and
  // the gathers that fetch them again must pair up.
  if (world_ > 1) {
    ZINF_RETURN_IF_ERROR(CompareAcrossRanks(
        "offload_states",
        "include " + TypeNames(o.include) + ", device " + (to_nvme ? "nvme" : "cpu"),
        "Call offload_states on every rank at the same point, with the same include and "
        "device."));
  }
  if (to_nvme && o.include != Engine::kOffloadAll) {
    return Status::InvalidArgument(
        "offload_states(device=\"nvme\") releases the pinned host memory, which holds every "
        "type of state: include all of them (Engine::kOffloadAll; in Python include=None), or "
        "offload to device=\"cpu\"");
  }
  Status ready = CheckBetweenSteps("offload_states");
  if (world_ > 1) ready = collectives_->Agree(ready, "offload_states");
  ZINF_RETURN_IF_ERROR(ready);
  offload_pending_ |= o.include;  // (what failed below stays pending: reloads agree on it)
  Status to_host = OffloadToHost(o);
  // (To NVMe: every rank goes on to MoveToNvme whatever happened here; it agrees.)
  return to_nvme ? MoveToNvme(to_host) : to_host;
}

Status Engine::Impl::OffloadToHost(const Engine::OffloadStatesOptions& o) {
  const bool to_nvme = o.device == Tier::kNvme;
  // What it names is offloaded already: nothing to do. Otherwise what is offloaded stays so:
  // everything comes back, and the union goes out again in one host copy (the spare).
  if (offloaded_ && (o.include & ~offloaded_->mask) == 0) {
    // (After a non-blocking one, or a reload that failed, this blocking call waits for the
    // copies and returns the memory; cheap when there is nothing to wait for.) On NVMe
    // already: further out than asked.
    if (offloaded_->on_nvme || (o.non_blocking && !to_nvme)) return Status::OK();
    return FinishOffload();
  }
  const uint32_t include = o.include | (offloaded_ ? offloaded_->mask : 0);
  ZINF_RETURN_IF_ERROR(EnsureStatesLoaded());
  // A delayed update still running is waited for (its writes land in buffers about to move);
  // which parameter version the next micro-step reads does not change.
  ZINF_RETURN_IF_ERROR(core_->board->WaitDone(clock_.step()));
  ZINF_RETURN_IF_ERROR(budget_->ReclaimScratch());
  auto off = std::make_unique<Offloaded>();
  off->mask = include;
  ZINF_RETURN_IF_ERROR(CollectSlots(include, off.get()));
  size_t total = 0;
  for (Moved& m : off->moved) {
    m.offset = total;
    if (m.slot.keep) total += RoundUp(m.slot.bytes, kHostAlign);
  }
  if (total > 0 && spare_ && spare_->host && spare_->host->bytes >= total) {
    // The previous cycle's host copy, already faulted in (and registered when it was pinned).
    off->host = std::move(spare_->host);
    off->registered = spare_->registered;
    spare_.reset();
  } else if (total > 0) {
    if (spare_) ReleaseHostCopy(spare_.get());
    spare_.reset();
    off->host = std::make_unique<HostArray>();
    ZINF_RETURN_IF_ERROR(off->host->Allocate(total / sizeof(float), "offload_states"));
  }
  off->host_used = total;
  // (To NVMe: the host copy is released once written; pinning it would not pay.)
  if (total > 0 && !off->registered && o.pin_memory && !to_nvme) {
    ZINF_RETURN_IF_ERROR(device_->RegisterHostMemory(off->host->data, off->host->bytes)
                             .WithContext("offload_states: pinning its host memory"));
    off->registered = true;
  }
  // The copy stream runs after what the other streams have queued (the last step's updates,
  // copies and gathers read or write these buffers), then copies the kept ones out; each
  // buffer goes back once the copy stream has passed it.
  auto failed = [this, &off](const Status& s) {
    // The host copy goes only once no copy may still write it; else at close.
    if (device_->SynchronizeStream(streams_.copy).ok()) {
      ReleaseHostCopy(off.get());
    } else {
      reloading_ = std::move(off);
    }
    return Break("the engine stopped: offload_states failed part-way", s,
                 "; recreate it (from a checkpoint) to continue");
  };
  for (Stream* other : {device_->ComputeStream(), streams_.comm, streams_.update, streams_.grad}) {
    Result<std::unique_ptr<Event>> ev = device_->CreateEvent();
    Status s = ev.status();
    if (s.ok()) s = device_->RecordEvent(ev->get(), other);
    if (s.ok()) s = device_->StreamWaitEvent(streams_.copy, ev->get());
    if (!s.ok()) return failed(s);
  }
  char* host = off->host ? reinterpret_cast<char*>(off->host->data) : nullptr;
  for (Moved& m : off->moved) {
    if (!m.slot.keep) continue;
    Status s =
        device_->CopyDeviceToHost(host + m.offset, m.slot.get(), m.slot.bytes, streams_.copy);
    if (!s.ok()) return failed(s.WithContext("offload_states: copying " + m.slot.what));
  }
  for (Moved& m : off->moved) {
    Status s = budget_->FreeAfter(m.slot.get(), m.slot.bytes, streams_.copy);
    if (!s.ok()) return failed(s.WithContext("offload_states: freeing " + m.slot.what));
    budget_->Unplan(m.slot.bytes);
    m.slot.set(nullptr);
  }
  offloaded_ = std::move(off);
  // (To NVMe always blocks: the pinned memory is released when OffloadStates returns.)
  if (o.non_blocking && !to_nvme) return Status::OK();
  return FinishOffload();
}

Status Engine::Impl::FinishOffload() {
  // The copies have ended and the device memory is free when this returns.
  Status s = device_->SynchronizeStream(streams_.copy);
  if (s.ok()) s = budget_->Collect(/*wait=*/true);
  if (!s.ok()) {
    return Break("the engine stopped: offload_states could not finish its copies", s,
                 "; recreate it (from a checkpoint) to continue");
  }
  // The states are safe in host memory whatever this says; the engine goes on.
  return device_->TrimMemory().WithContext(
      "offload_states moved the states to host memory, but giving the device memory back "
      "failed");
}

// Nothing is queued on what a failed reload took: the memory goes back at once (else
// "free device memory and call it again" would find zinf holding more than before).
void Engine::Impl::ReturnMemoryAfterFailedReload() {
  Status s = device_->TrimMemory();
  if (!s.ok()) LogWarning("reload_states failed, and returning its memory too: " + s.ToString());
}

Status Engine::Impl::ReloadStates(bool non_blocking) {
  if (!broken_.ok()) return broken_;
  Status s = ReloadTypes(Engine::kOffloadAll, non_blocking);
  // Every rank learns whether every rank reloaded (then nothing is pending anywhere).
  if (world_ > 1 && offload_pending_ != 0) s = collectives_->Agree(s, "reload_states");
  if (s.ok()) offload_pending_ = 0;
  return s;
}

Status Engine::Impl::ReloadTypes(uint32_t mask, bool non_blocking) {
  if (!offloaded_) return Status::OK();
  if (offloaded_->on_nvme) ZINF_RETURN_IF_ERROR(LoadFromNvme());
  // Reloading all of it: the device's whole budget first, where it holds it from creation
  // (CUDA). When another library took it meanwhile, this fails here, with the states still
  // offloaded, rather than in a later step. (A partial reload, an inference Acquire's, takes
  // only what it reloads: generation keeps the rest free.)
  const bool all = (offloaded_->mask & ~mask) == 0;
  if (Status s = all ? device_->RestoreMemory() : Status::OK(); !s.ok()) {
    ReturnMemoryAfterFailedReload();
    return s.WithContext(
        "reload_states: the states stay offloaded; free device memory and call it again");
  }
  // Device memory first, for every buffer: when some cannot have it (the trainer's own tensors
  // hold it), nothing changes and the states stay offloaded.
  std::vector<std::pair<Moved*, void*>> taken;
  for (Moved& m : offloaded_->moved) {
    if ((m.type & mask) == 0) continue;
    Result<void*> p = budget_->Alloc(m.slot.bytes, m.slot.what + " (reload_states)");
    if (!p.ok()) {
      for (auto& [moved, ptr] : taken) budget_->Free(ptr, moved->slot.bytes);
      ReturnMemoryAfterFailedReload();
      return p.status().WithContext(
          "reload_states: the states stay offloaded; free device memory and call it again");
    }
    taken.emplace_back(&m, *p);
  }
  char* host = offloaded_->host ? reinterpret_cast<char*>(offloaded_->host->data) : nullptr;
  Status s;
  for (auto& [m, ptr] : taken) {
    budget_->Plan(m->slot.bytes);
    m->slot.set(ptr);
    if (s.ok() && m->slot.keep) {
      s = device_->CopyHostToDevice(ptr, host + m->offset, m->slot.bytes, streams_.copy);
    }
  }
  // Every stream waits for the copies before it uses the buffers.
  for (Stream* other : {device_->ComputeStream(), streams_.comm, streams_.update, streams_.grad}) {
    if (!s.ok()) break;
    Result<std::unique_ptr<Event>> ev = device_->CreateEvent();
    s = ev.status();
    if (s.ok()) s = device_->RecordEvent(ev->get(), streams_.copy);
    if (s.ok()) s = device_->StreamWaitEvent(other, ev->get());
  }
  if (s.ok() && !non_blocking) s = device_->SynchronizeStream(streams_.copy);
  // The reloaded ones leave the record; the host copy goes once none is left.
  auto& moved = offloaded_->moved;
  moved.erase(std::remove_if(moved.begin(), moved.end(),
                             [mask](const Moved& m) { return (m.type & mask) != 0; }),
              moved.end());
  offloaded_->mask &= ~mask;
  if (!s.ok()) {
    if (offloaded_->moved.empty()) reloading_ = std::move(offloaded_);  // released at close
    return Break("the engine stopped: reload_states failed part-way", s,
                 "; recreate it (from a checkpoint) to continue");
  }
  if (!offloaded_->moved.empty()) {
    // Some types stay offloaded: their values stay in the host copy; a non-blocking reload's
    // copies out of it are waited for by the next call that needs the states.
    if (non_blocking) {
      s = device_->SynchronizeStream(streams_.copy);  // (the host copy stays in use)
      if (!s.ok()) {
        return Break("the engine stopped: reload_states failed part-way", s,
                     "; recreate it (from a checkpoint) to continue");
      }
    }
    return Status::OK();
  }
  offloaded_->mask = 0;
  if (non_blocking) {
    reloading_ = std::move(offloaded_);
  } else {
    KeepAsSpare(std::move(offloaded_));
  }
  return Status::OK();
}

// ---- device="nvme" -----------------------------------------------------------------------------

Result<SwapStore*> Engine::Impl::OffloadStore() {
  if (offload_store_) return offload_store_.get();
  std::string root;
  for (const OffloadConfig* c : {&config_.offload_optimizer, &config_.offload_param}) {
    if (root.empty() && !c->nvme_paths.empty()) root = c->nvme_paths[0];
  }
  bool created_root = false;
  if (root.empty()) {
    root = "zinf-swap";  // (zinf-train's default swap folder, in the working directory)
    if (mkdir(root.c_str(), 0700) == 0) {
      created_root = true;
    } else if (errno != EEXIST) {
      return ErrnoToStatus(errno, "offload_states(device=\"nvme\"): creating folder " + root);
    }
  }
  if (Status s = CheckNvmePaths({root}, config_.allowed_nvme_roots); !s.ok()) {
    if (created_root) rmdir(root.c_str());  // (empty: ours; best effort)
    return s.WithContext("offload_states(device=\"nvme\")");
  }
  // A folder of this engine's own (two engines of a process, ranks as threads, never meet),
  // removed at close.
  static std::atomic<uint64_t> engines{0};
  const std::string dir = root + "/offload_states-" + std::to_string(getpid()) + "-" +
                          std::to_string(engines.fetch_add(1)) + "-rank" + std::to_string(rank_);
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return ErrnoToStatus(errno, "offload_states(device=\"nvme\"): creating folder " + dir);
  }
  // The engine's I/O settings; nothing registered (the arena is released while this store
  // holds its values); no capacity limit but the filesystem's reserve.
  SwapStoreOptions so;
  so.paths = {dir};
  Result<IoBackendKind> kind = ParseIoBackendKind(config_.aio.backend);
  if (!kind.ok()) return kind.status().WithContext("aio.backend");
  so.backend = *kind;
  so.backend_options.queue_depth = config_.aio.queue_depth;
  so.block_size = config_.aio.block_size;
  so.chunk_size = std::max<uint64_t>(RoundUp(config_.aio.block_size, 4096), 4096);
  so.checksums = config_.checksums;
  so.reserve_bytes = config_.nvme_reserve_bytes;
  so.fault_plan = hooks_.fault_plan;
  so.overwrite = true;
  so.remove_on_close = true;
  Result<std::unique_ptr<SwapStore>> opened = SwapStore::Open(so);
  if (!opened.ok()) {
    rmdir(dir.c_str());  // (best effort: a retry makes a folder of its own)
    return opened.status().WithContext("opening a swap store in " + dir);
  }
  offload_store_ = std::move(opened).value();
  offload_folder_ = dir;
  return offload_store_.get();
}

void Engine::Impl::CloseOffloadStore() {
  if (!offload_store_) return;
  Status s = offload_store_->Close();
  if (!s.ok()) LogWarning("closing the engine: offload_states' NVMe store: " + s.ToString());
  offload_store_.reset();  // (its folder lock goes with it)
  // The folder is this engine's own: what the store leaves (its lock, its mark) goes with it.
  for (const char* name : {"zinf-swap.lock", "zinf-swap.folder.json"}) {
    const std::string file = offload_folder_ + "/" + name;
    if (unlink(file.c_str()) != 0 && errno != ENOENT) {
      LogWarning("closing the engine: removing " + file + ": " + strerror(errno));
    }
  }
  if (rmdir(offload_folder_.c_str()) != 0) {
    LogWarning("closing the engine: removing offload_states' folder " + offload_folder_ + ": " +
               strerror(errno));
  }
}

Status Engine::Impl::ReleaseArena() {
  Status s;
  if (arena_device_registered_) {
    s = device_->UnregisterHostMemory(arena_->region().base);
    if (s.ok()) arena_device_registered_ = false;
  }
  if (s.ok() && swap_ && arena_io_registered_) {
    s = swap_->SetRegionsRegistered(false);
    if (s.ok()) arena_io_registered_ = false;
  }
  if (s.ok()) s = arena_->Release();
  if (s.ok()) return s;
  // Registered again as it was (nothing was released).
  if (swap_ && !arena_io_registered_ && swap_->SetRegionsRegistered(true).ok()) {
    arena_io_registered_ = true;
  }
  if (!arena_device_registered_ &&
      device_->RegisterHostMemory(arena_->region().base, arena_->capacity()).ok()) {
    arena_device_registered_ = true;
  }
  return s;
}

Status Engine::Impl::MoveToNvme(const Status& to_host) {
  Offloaded* off = offloaded_.get();
  const bool already = to_host.ok() && off != nullptr && off->on_nvme;
  std::vector<MemoryRegion> pages;
  std::vector<Piece> pieces;
  SwapStore* store = nullptr;
  Status s = to_host;
  if (s.ok() && off == nullptr) s = Status::Internal("offload_states: nothing was offloaded");
  if (s.ok() && !already) {
    pages = arena_->UsedPages();
    pieces = NvmePieces(pages, off->host ? off->host->data : nullptr, off->host_used);
    Result<SwapStore*> opened = OffloadStore();
    s = opened.status();
    if (s.ok()) store = *opened;
    // Whatever the engine's own store is doing (write-backs, read-ahead into the arena) ends
    // first (this waits for it; the registration stays as it is); nothing issues more until
    // the reload.
    if (s.ok() && swap_) s = swap_->SetRegionsRegistered(arena_io_registered_);
    if (s.ok()) {
      s = TransferAll(store, pieces, /*write=*/true)
              .WithContext("offload_states(device=\"nvme\"): writing the states to " +
                           offload_folder_ +
                           " (free space there, set nvme_path to another folder, or offload "
                           "to device=\"cpu\")");
    }
  }
  // Every rank's states go to NVMe, or every rank's stay in host memory (every rank comes
  // here, whatever failed before).
  if (world_ > 1) s = collectives_->Agree(s, "offload_states to NVMe");
  if (!s.ok()) {
    if (store != nullptr) RemoveAll(store, pieces);
    return to_host.ok() ? s.WithContext("the states stay in host memory (offloaded to the cpu)")
                        : s;
  }
  if (!already) {
    off->arena_pages = std::move(pages);
    off->on_nvme = true;  // (what follows is local: the values are safe on NVMe either way)
  }
  // Nothing of value is left in host memory: the host copies go, and the pinned memory
  // (again, after a reload that failed part-way).
  ReleaseHostCopy(off);
  if (spare_) ReleaseHostCopy(spare_.get());
  spare_.reset();
  return ReleaseArena().WithContext(
      "offload_states(device=\"nvme\"): the states are on NVMe, but releasing the pinned host "
      "memory failed (it stays resident; the engine goes on)");
}

Status Engine::Impl::LoadFromNvme() {
  Offloaded* off = offloaded_.get();
  Status s = arena_->Restore();
  if (s.ok() && !arena_device_registered_) {
    s = device_->RegisterHostMemory(arena_->region().base, arena_->capacity());
    if (s.ok()) arena_device_registered_ = true;
  }
  if (s.ok() && swap_ && !arena_io_registered_) {
    s = swap_->SetRegionsRegistered(true);
    if (s.ok()) arena_io_registered_ = true;
  }
  if (s.ok() && off->host_used > 0 && !off->host) {
    auto host = std::make_unique<HostArray>();
    s = host->Allocate(off->host_used / sizeof(float), "reading the offloaded states back");
    if (s.ok()) off->host = std::move(host);
  }
  const std::vector<Piece> pieces =
      NvmePieces(off->arena_pages, off->host ? off->host->data : nullptr, off->host_used);
  if (s.ok()) s = TransferAll(offload_store_.get(), pieces, /*write=*/false);
  // Every rank reads back, or every rank's stay on NVMe (a rank that read them reads them
  // again at the next try: the same values).
  if (world_ > 1) s = collectives_->Agree(s, "reading the offloaded states back from NVMe");
  if (!s.ok()) {
    return s.WithContext("reading the offloaded states back from NVMe (" + offload_folder_ +
                         "): they stay there, and the call that needs them can be made again");
  }
  RemoveAll(offload_store_.get(), pieces);
  off->arena_pages.clear();
  off->on_nvme = false;
  return Status::OK();
}

}  // namespace zinf
