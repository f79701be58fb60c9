// Residency of the full (gathered) parameters in device memory: demand fetches, prefetch
// along the acquire trace, eviction of the parameter used farthest ahead, and the acquire /
// release bookkeeping. Trainer thread only, except each parameter's fetch status, which the
// fetch's stream callback sets (under its own lock).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/acquire_trace.h"
#include "engine/device_budget.h"
#include "engine/layout.h"
#include "engine/param_store.h"
#include "engine/stats_recorder.h"
#include "engine/thread_annotations.h"
#include "zinf/comm.h"
#include "zinf/config.h"
#include "zinf/device.h"
#include "zinf/swap.h"

namespace zinf {

class FetchScheduler {
 public:
  struct Streams {
    Stream* copy = nullptr;  // reads' copies to the device
    Stream* comm = nullptr;  // the all-gathers
    Stream* grad = nullptr;  // gradient landing (gives staging back)
  };
  FetchScheduler(const Layout* layout, const EngineConfig* config, Device* device,
                 Communicator* comm, DeviceBudget* budget, StatsRecorder* stats,
                 const ParamStore* store, AcquireTrace* trace, Streams streams);
  ~FetchScheduler();
  FetchScheduler(const FetchScheduler&) = delete;
  FetchScheduler& operator=(const FetchScheduler&) = delete;
  Status Init();  // its events
  void Attach(PinnedArena* arena, SwapStore* swap) {
    arena_ = arena;
    swap_ = swap;
  }
  // One rank on the device tier: the partition is the full parameter (the buffer of the
  // visible version; a fetch points it there).
  void Alias(ParamId id) { res_[id].aliased = true; }

  // Parameters the optimizer may be rewriting right now (delayed update: those whose gradient
  // this boundary micro-step has reduced): neither acquired for training nor prefetched.
  using Rewriting = std::function<bool(ParamId)>;

  // Makes `ids` resident at parameter version `visible` and counts them acquired; returns
  // their device buffers, ready on the compute stream. `trace`: a training acquire (checked
  // against the trace, counted for prefetch statistics). On failure nothing stays acquired.
  Result<std::vector<void*>> Acquire(const std::vector<ParamId>& ids, int64_t visible,
                                     bool training, const Rewriting& rewriting);
  // Uncounts `ids`; evicts those released for the last time that are not persistent and are
  // not used again within `max_reuse_distance` elements of the trace.
  Status Release(const std::vector<ParamId>& ids, int64_t visible, const Rewriting& rewriting);
  // Starts fetches along the trace into free budget.
  void Prefetch(int64_t visible, const Rewriting& rewriting);
  // Gives back the device copy of `id` once nothing can use or write it; an error leaves it
  // allocated (nothing is known to be done with it).
  Status Evict(ParamId id);
  // Makes room under the budget (and max_live_parameters) for `elems` / `bytes` more, for
  // parameter `for_id` (its gradient scratch counts too), evicting released parameters.
  Status MakeRoom(uint64_t elems, uint64_t bytes, ParamId for_id);

  int acquired(ParamId id) const { return res_[id].acquired; }
  // Whether `id` is still acquired from a version older than `visible`.
  bool AcquiredStale(ParamId id, int64_t visible) const {
    return res_[id].acquired > 0 && !Fresh(id, visible);
  }

 private:
  static constexpr uint64_t kNotFetched = UINT64_MAX;
  enum class State { kAbsent, kFetching, kResident };
  struct Resident {
    void* device_full = nullptr;
    bool aliased = false;  // device_full is the partition (one rank, device tier)
    State state = State::kAbsent;
    std::unique_ptr<Event> ready;
    // The version whose fetch was issued into device_full (kNotFetched while it holds none:
    // Acquire takes the buffer for the parameter's value only when this matches).
    uint64_t fetched_version = kNotFetched;
    int acquired = 0;
  };

  bool Fresh(ParamId id, int64_t visible) const {
    return res_[id].device_full != nullptr &&
           res_[id].fetched_version == static_cast<uint64_t>(visible);
  }
  // Fetches `id` into device memory (asynchronously: its `ready` event). `prefetch`: give up
  // at once when no pinned staging is free (a demand fetch waits for the copies in flight to
  // hand theirs back). On failure the parameter holds no device memory.
  Status Fetch(ParamId id, int64_t visible, bool prefetch);
  // Fetch's work once the buffers are there: the read, copy and gather on the streams.
  Status IssueFetch(ParamId id, int64_t visible, const std::shared_ptr<PinnedBuffer>& staging);
  void DropDeviceCopy(ParamId id);
  void SetFetchStatus(ParamId id, const Status& s) EXCLUDES(mu_);
  Status TakeFetchStatus(ParamId id) EXCLUDES(mu_);

  const Layout* const layout_;
  const EngineConfig* const config_;
  Device* const device_;
  Communicator* const comm_;
  DeviceBudget* const budget_;
  StatsRecorder* const stats_;
  const ParamStore* const store_;
  AcquireTrace* const trace_;
  const Streams streams_;
  PinnedArena* arena_ = nullptr;
  SwapStore* swap_ = nullptr;
  std::unique_ptr<Event> compute_done_;
  std::unique_ptr<Event> copy_done_;
  std::vector<Resident> res_;
  uint64_t live_elems_ = 0;  // full params resident or fetching
  // Device buffers of failed fetches that streams may still write: freed at destruction.
  std::vector<std::pair<void*, size_t>> graveyard_;
  Mutex mu_;
  std::vector<Status> fetch_status_ GUARDED_BY(mu_);  // set by the fetch's stream callback
};

}  // namespace zinf
