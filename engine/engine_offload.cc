// offload_states / reload_states: the engine's device memory moved out between phases (an RLHF
// trainer's generation, another model's turn) and back, the training then going on bit for bit.
#include <algorithm>
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
  if (o.device != Tier::kCpu) {
    return Status::NotSupported(
        "offload_states(device=\"nvme\"): zinf moves the states to host memory only, for now; "
        "use device=\"cpu\"");
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
        "offload_states", "include " + TypeNames(o.include),
        "Call offload_states on every rank at the same point, with the same include."));
  }
  Status ready = CheckBetweenSteps("offload_states");
  if (world_ > 1) ready = collectives_->Agree(ready, "offload_states");
  ZINF_RETURN_IF_ERROR(ready);
  // What it names is offloaded already: nothing to do. Otherwise what is offloaded stays so:
  // everything comes back, and the union goes out again in one host copy (the spare).
  if (offloaded_ && (o.include & ~offloaded_->mask) == 0) {
    // (After a non-blocking one, or a reload that failed, this blocking call waits for the
    // copies and returns the memory; cheap when there is nothing to wait for.)
    return o.non_blocking ? Status::OK() : FinishOffload();
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
  if (total > 0 && !off->registered && o.pin_memory) {
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
  if (o.non_blocking) return Status::OK();
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
  return ReloadTypes(Engine::kOffloadAll, non_blocking);
}

Status Engine::Impl::ReloadTypes(uint32_t mask, bool non_blocking) {
  if (!offloaded_) return Status::OK();
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

}  // namespace zinf
