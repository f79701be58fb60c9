// Residency of the full (gathered) parameters in device memory: demand fetches, prefetch
// along the acquire trace, eviction of the parameter used farthest ahead, and the acquire /
// release bookkeeping. Trainer thread only.
//
// An NVMe fetch is two halves: the read into pinned staging, then the copy to the device and
// the all-gather on the streams. The copy is issued by the trainer thread once the read has
// ended (Acquire waits for it; every other call issues the copies of the reads that have
// ended), never by a stream callback that waits on I/O: the read's result is known on the host
// before Acquire returns, and no stream (no host-function thread) ever blocks on NVMe.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/core/acquire_trace.h"
#include "engine/core/device_budget.h"
#include "engine/core/engine_context.h"
#include "engine/core/gradient_adder.h"
#include "engine/core/layout.h"
#include "engine/core/param_store.h"
#include "engine/core/stats_recorder.h"
#include "zinf/comm.h"
#include "zinf/config.h"
#include "zinf/device.h"
#include "zinf/swap.h"

namespace zinf {

// The device scratch a stage-3 gather of `p` takes beside the full parameter when it moves int8
// blocks (an int8 frozen weight, `stored_int8`; zero_quantized_weights or
// zero_quantized_nontrainable_weights when the blocks are smaller than the partition of
// `elem_size`-byte values): this rank's blocks, then every rank's. 0: a plain gather.
size_t QuantizedGatherScratch(const ParamLayout& p, const EngineConfig& c, int world,
                              bool stored_int8, size_t elem_size);

class FetchScheduler {
 public:
  // Reads' copies go to the device on the copy stream, the all-gathers on the comm stream;
  // staging comes from the context's arena, and a demand fetch short of it waits for the
  // copies in flight, the gradient landings (grad stream) and `adder`'s jobs to give theirs
  // back.
  FetchScheduler(const EngineContext& ctx, const ParamStore* store, AcquireTrace* trace,
                 GradientAdder* adder);
  ~FetchScheduler();
  FetchScheduler(const FetchScheduler&) = delete;
  FetchScheduler& operator=(const FetchScheduler&) = delete;
  Status Init();  // its events, and hpZ's secondary shards (from the pinned arena)
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
  // ZeRO stages 0 to 2, right after an optimizer step: starts the fetch (one gather) of every
  // parameter not resident at `visible` and not acquired, in registration order on every
  // rank, into free budget, dropping stale copies first; what does not fit is fetched by its
  // Acquire. (Several ranks with NVMe parameters: nothing; the trace's prefetch and the
  // Acquires fetch each parameter once, in acquire order.)
  void Refresh(int64_t visible, const Rewriting& rewriting);
  // Gives back the device copy of `id` once nothing can use or write it (DeviceBudget::
  // FreeAfter: without waiting for the streams now); an error leaves it allocated (nothing is
  // known to be done with it).
  Status Evict(ParamId id);
  // Makes room under the budget (and max_live_parameters) for `elems` / `bytes` more, for
  // parameter `for_id` (its gradient scratch counts too), evicting released parameters.
  Status MakeRoom(uint64_t elems, uint64_t bytes, ParamId for_id);

  // offload_states (nothing acquired): every device copy goes (Evict), and the copies that
  // are the device-tier partitions themselves (one rank) are forgotten: the next Acquire
  // points them at the partitions again, wherever those are then.
  Status DropAll();
  // `id`'s values are about to change at the same version (SetParameterValues, a load): the
  // device copy goes (Evict) and so does hpZ's secondary shard.
  Status Replace(ParamId id);
  int acquired(ParamId id) const { return res_[id].acquired; }
  // Whether `id` is still acquired from a version older than `visible`.
  bool AcquiredStale(ParamId id, int64_t visible) const {
    return res_[id].acquired > 0 && !Fresh(id, visible);
  }

 private:
  static constexpr uint64_t kNotFetched = UINT64_MAX;
  // kReading: the NVMe read into `staging` is in flight, nothing is issued on a stream yet.
  // kFetching: the copy and gather are issued; `ready` marks their end.
  enum class State { kAbsent, kReading, kFetching, kResident };
  struct Resident {
    void* device_full = nullptr;
    bool aliased = false;  // device_full is the partition (one rank, device tier)
    State state = State::kAbsent;
    std::unique_ptr<Event> ready;
    Ticket read = 0;                        // kReading: the read's ticket
    std::shared_ptr<PinnedBuffer> staging;  // kReading: where it reads into
    // int8 frozen weights: the block of the parameter dtype the partition is decoded into,
    // taken with the staging block (before anything is issued) and handed to the copy.
    std::shared_ptr<PinnedBuffer> decoded;
    // A quantized gather (QuantizedGather): device scratch for this rank's int8 blocks, then
    // every rank's (QuantScratchBytes), from the fetch until its decoding is queued.
    void* quant = nullptr;
    // The version whose fetch was issued into device_full (kNotFetched while it holds none:
    // Acquire takes the buffer for the parameter's value only when this matches).
    uint64_t fetched_version = kNotFetched;
    int acquired = 0;
    // hpZ: this rank's secondary shard of the gathered parameter (SecondaryBytes), written on
    // the comm stream after each gather across every rank, and the version it holds
    // (kNotFetched: none). A fetch at that version all-gathers the shards inside the node.
    PinnedBuffer secondary;
    uint64_t secondary_version = kNotFetched;
    // kReading without a read: a fetch from the secondary shard with NVMe parameters, whose
    // node gather waits in reading_ for its Acquire like the reads' gathers (the same point of
    // every rank's call sequence, whatever each rank's staging allowed it to prefetch).
    bool from_secondary = false;
  };

  // stage3_max_live_parameters; no limit at stages 0 to 2 (every parameter stays whole: the
  // device budget, checked at registration, is the limit).
  uint64_t MaxLive() const {
    return ReplicatesParameters(*ctx_.config) ? UINT64_MAX : ctx_.config->max_live_parameters;
  }
  // Whether `id`'s gather moves int8 blocks (several ranks at stage 3): an int8 frozen weight
  // (its stored blocks), or zero_quantized_weights / zero_quantized_nontrainable_weights.
  bool QuantizedGather(ParamId id) const;
  // Its device scratch: this rank's blocks, then the gathered blocks of every rank.
  size_t QuantScratchBytes(ParamId id) const;
  // The device memory a fetch of `id` plans: the full parameter and any gather scratch.
  size_t FetchBytes(ParamId id) const {
    return ctx_.layout->FullBytes(id) + (QuantizedGather(id) ? QuantScratchBytes(id) : 0);
  }
  // Queues the quantized gather on the comm stream (after the copy into `slot`, or into the
  // scratch for an int8 frozen weight): encode this rank's part, all-gather the blocks,
  // decode every rank's into device_full, then the scratch goes back once that has run.
  Status IssueQuantizedGather(ParamId id, void* slot);
  // Frees the quantized gather's scratch now (no stream used it, or every one is done).
  void DropQuant(ParamId id);
  // A pinned block of `bytes` for `id`'s fetch (NVMe staging, or an int8 weight's decode
  // block). A demand fetch (`prefetch` false) waits for the blocks in use to come back once;
  // a prefetch gives up at once.
  Result<std::shared_ptr<PinnedBuffer>> TakeBlock(ParamId id, size_t bytes, bool prefetch);
  // An int8 frozen weight's partition (`src`, int8 blocks, in `src_block` when staged) decoded
  // into `out` (the parameter dtype) by a host function queued on the copy stream, ordered
  // before the copies issued after it.
  Status QueueDequantize(ParamId id, const void* src, std::shared_ptr<PinnedBuffer> src_block,
                         void* out);
  // (A frozen parameter's copy stays fresh from version to version: its value never changes;
  // what replaces it, SetParameterValues or a load, evicts it.)
  bool Fresh(ParamId id, int64_t visible) const {
    return res_[id].device_full != nullptr && res_[id].fetched_version != kNotFetched &&
           (res_[id].fetched_version == static_cast<uint64_t>(visible) ||
            !ctx_.layout->param(id).info.trainable);
  }
  // hpZ: whether `id`'s secondary shard holds version `visible`. A frozen parameter's too is
  // kept for one version only: a shard holding a failed read's NaN part (which every rank
  // keeps alike, so that their gathers stay the same) is then gathered across the ranks again
  // at the next step, as a device copy would be read again.
  bool SecondaryFresh(ParamId id, int64_t visible) const {
    return ctx_.node_comm != nullptr &&
           res_[id].secondary_version == static_cast<uint64_t>(visible);
  }
  // hpZ: whether `id` keeps a shard (a persistent parameter is never evicted: no later fetch).
  bool KeepsSecondary(ParamId id) const {
    return ctx_.node_comm != nullptr && !ctx_.layout->param(id).info.persistent;
  }
  // hpZ: the secondary shard to its place in device_full, then the node's all-gather of the
  // shards, on the comm stream.
  Status IssueFromSecondary(ParamId id);
  // hpZ, after a gather across every rank: this rank's shard of device_full to its secondary,
  // on the comm stream (before the fetch's `ready`, so the copy is done before a use, and an
  // eviction after that use).
  Status KeepSecondary(ParamId id);
  // Fetches `id` into device memory (asynchronously: its `ready` event). `prefetch`: give up
  // at once when no pinned staging is free (a demand fetch waits for the copies in flight to
  // hand theirs back). On failure the parameter holds no device memory.
  Status Fetch(ParamId id, int64_t visible, bool prefetch);
  // The copy of `src` (`part` bytes: host, pinned staging or device memory) into this rank's
  // slot and the all-gather, on the streams; `staging` (or null) goes back after the copy.
  Status IssueCopies(ParamId id, const void* src, std::shared_ptr<PinnedBuffer> staging);
  // A kReading parameter, taken off reading_: waits for its read, then issues the copies. A
  // failed read drops the device copy and returns the read's error; a failure to issue drops
  // it as FailFetch does.
  Status FinishOneRead(ParamId id);
  // Finishes the reads in reading_ up to and including `id`'s (FinishOneRead each); returns
  // `id`'s outcome. The others' errors become their fetch status.
  Status FinishRead(ParamId id);
  // One rank: issues the copies of the reads at the front of reading_ that have ended. (With
  // several ranks the gathers wait for Acquire: see FinishRead.)
  void IssueEndedReads();
  // After a failure to issue a fetch's stream work: the device copy goes back once the streams
  // that may still write it are done (or to the graveyard when that cannot be known).
  void FailFetch(ParamId id);
  // Frees the device copy now (no stream has used it, or every one is done with it).
  void DropDeviceCopy(ParamId id);
  // The bookkeeping of a device copy that is gone (freed or handed to FreeAfter).
  void ForgetDeviceCopy(ParamId id);
  void SetFetchStatus(ParamId id, const Status& s);
  Status TakeFetchStatus(ParamId id);

  const EngineContext ctx_;  // the layout, config, device, streams and shared objects
  const ParamStore* const store_;
  AcquireTrace* const trace_;
  GradientAdder* const adder_;
  std::unique_ptr<Event> copy_done_;
  std::vector<Resident> res_;
  std::deque<ParamId> reading_;  // the kReading parameters, in the order their reads were issued
  uint64_t live_elems_ = 0;      // full params resident or fetching
  // Device buffers of failed fetches that streams may still write: freed at destruction.
  std::vector<std::pair<void*, size_t>> graveyard_;
  // Per parameter: a read error no Acquire has reported yet (a prefetch's read that failed,
  // or one evicted before its Acquire).
  std::vector<Status> fetch_status_;
};

}  // namespace zinf
