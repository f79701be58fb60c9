// The engine behind its façade: Engine forwards each call to the one of the same name here.
// Private fields: the constant configuration and handles, the components (engine/core/*.h,
// the pipeline, persistence), the step sequencing fields; all of them touched by the
// trainer's thread only (what other threads share lives in the components, under their own
// locks: GroupBoard, DeviceBudget, StatsRecorder). Implemented in engine.cc and
// engine_values.cc.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/core/acquire_trace.h"
#include "engine/core/core_parts.h"
#include "engine/core/device_budget.h"
#include "engine/core/engine_context.h"
#include "engine/core/fetch_scheduler.h"
#include "engine/core/frozen_params.h"
#include "engine/core/gradient_adder.h"
#include "engine/core/gradient_window.h"
#include "engine/core/group_board.h"
#include "engine/core/host_collectives.h"
#include "engine/core/host_memory.h"
#include "engine/core/layout.h"
#include "engine/core/loss_scaler.h"
#include "engine/core/memory_plan.h"
#include "engine/core/param_store.h"
#include "engine/core/state_store.h"
#include "engine/core/stats_recorder.h"
#include "engine/core/step_clock.h"
#include "engine/optimizer_pipeline.h"
#include "engine/persistence/checkpointer.h"
#include "engine/persistence/durable_commits.h"
#include "zinf/cpu_adam.h"
#include "zinf/engine.h"
#include "zinf/swap.h"

namespace zinf {

class Engine::Impl {
 public:
  Impl(const EngineConfig& c, Device* d, Communicator* cm, const EngineHooks& h)
      : config_(c),
        device_(d),
        comm_(cm),
        hooks_(h),
        rank_(cm->rank()),
        world_(cm->world_size()),
        layout_(world_, StoredParamBytes(c), c.optimizer_state_type, c.frozen_int8),
        clock_(config_),
        scaler_(c.fp16.enabled ? std::make_unique<LossScaler>(LossScaleSettingsOf(c.fp16))
                               : nullptr),
        groups_{ParamGroupHyper{c.optimizer.lr, c.optimizer.beta1, c.optimizer.beta2,
                                c.optimizer.eps, c.optimizer.weight_decay}} {}
  ~Impl();
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  // Builds what the engine needs before registration (the CPU optimizer, the streams, the
  // device budget, the collectives, the checkpointer); Engine::Create's last step.
  Status Open();

  // ---- The façade's calls, as zinf/engine.h describes them (Engine forwards each) ----
  Result<ParamId> RegisterParameter(const ParamSpec& spec);
  Status FinishRegistration();
  Status CompareAcrossRanks(const std::string& what, const std::string& text,
                            const std::string& remedy);
  Status RequireAgreement(const std::string& name, const std::string& value);
  Status SetCommitUserData(const std::string& user_data);
  Status ResumeFromStore(StoreResume* resumed);
  Status SetAcquireOrder(const std::vector<ParamId>& order);
  Result<std::vector<void*>> Acquire(const std::vector<ParamId>& ids, AcquireMode mode);
  Status Release(const std::vector<ParamId>& ids);
  // micro_batch -1: the form without one.
  Status ReduceGradient(ParamId id, const float* grad, int micro_batch);
  Result<StepStats> Step();
  Status PrepareCheckpointDir(const std::string& dir);
  Status RemoveCheckpoints(const std::string& dir);
  Status SaveCheckpoint(const std::string& dir, const std::string& user_data);
  Status LoadCheckpoint(const std::string& dir, std::string* user_data, bool fall_back_to_older);
  Status GatherMasterParameter(ParamId id, float* out);
  Status SetParameterValues(const std::vector<ParamId>& ids,
                            const std::function<Status(ParamId, float*)>& fill);
  int64_t param_updates(ParamId id) const;
  Status SetLearningRate(float lr);
  Status SetParamGroup(size_t group, const ParamGroupHyper& hp);
  size_t num_param_groups() const;
  ParamGroupHyper param_group(size_t group) const;
  int64_t global_step() const;
  Status OffloadStates(const Engine::OffloadStatesOptions& o);
  Status ReloadStates(bool non_blocking);
  bool states_offloaded() const { return offloaded_ != nullptr; }
  Result<Engine::PinnedMemoryInfo> pinned_memory() const {
    Engine::PinnedMemoryInfo info;
    if (!arena_) return info;
    info.capacity = arena_->capacity();
    info.used = arena_->used();
    ZINF_ASSIGN_OR_RETURN(info.resident, arena_->ResidentBytes());
    return info;
  }
  double loss_scale() const { return scaler_ ? scaler_->scale() : 1.0; }
  uint64_t skipped_steps() const { return scaler_ ? scaler_->skipped_steps() : 0; }
  int rank() const;
  int world_size() const;
  size_t num_params() const;
  const ParamInfo& param(ParamId id) const;
  const EngineConfig& config() const;

 private:
  const EngineConfig config_;
  Device* const device_;
  Communicator* const comm_;
  // hpZ: this rank's node, split from comm_ at placement (null without hpZ). Kept past every
  // component (they issue on it), destroyed after the streams are synchronised.
  std::unique_ptr<Communicator> node_comm_;
  std::unique_ptr<Communicator> cross_comm_;  // hpZ with qgZ: across the nodes
  const EngineHooks hooks_;
  const int rank_;
  const int world_;
  Layout layout_;
  std::vector<std::function<void(float*, size_t)>> inits_;  // until the stores are initialised
  // A trainer's own settings every rank must share (RequireAgreement), compared with the
  // engine's at FinishRegistration.
  std::vector<std::pair<std::string, std::string>> agreement_;
  // The initial values' xxh3 per parameter (InitStores, when it calls the inits), compared
  // across the ranks; empty when the values came from a durable store.
  std::vector<uint64_t> initial_hashes_;
  // Several ranks: the initial values are compared at the first call that uses them
  // (CheckInitialValues), so that a load that replaces them first (SetParameterValues,
  // LoadCheckpoint) is not refused for values nobody trains on. 0 in initial_hashes_: replaced.
  bool values_unchecked_ = false;
  Status CheckInitialValues();
  // SetParameterValues with several ranks: the `count` parameters marked in `wanted` and
  // their values (xxh3, from a first call of `fill`) compared across the ranks.
  Status CompareValuesToSet(size_t count, const std::vector<uint8_t>& wanted,
                            const std::function<Status(ParamId, float*)>& fill);

  EngineStreams streams_;
  std::unique_ptr<CpuOptimizer> optimizer_;
  std::unique_ptr<DeviceBudget> budget_;
  StatsRecorder stats_;
  std::unique_ptr<HostCollectives> collectives_;
  AcquireTrace trace_;

  // From placement on (FinishRegistration).
  std::unique_ptr<PinnedArena> arena_;
  BlockPool grad_pool_;      // streaming accumulators, one block per sub-group
  BlockPool state_pool_;     // [master | m | v] of one sub-group (NVMe states; initialisation)
  BlockPool copy_pool_;      // the bf16 parameter copy of one sub-group
  BlockPool snapshot_pool_;  // pre-step states of sub-groups stepped speculatively
  std::unique_ptr<SwapStore> swap_;
  std::unique_ptr<CoreParts> core_;  // the components over the layout (BuildComponents)
  std::unique_ptr<DurableCommits> durable_;
  std::unique_ptr<Checkpointer> checkpointer_;
  std::unique_ptr<OptimizerPipeline> pipeline_;
  bool registered_ = false;
  bool resume_store_ = false;      // ResumeFromStore: InitStores reopens instead of initialising
  std::string resumed_user_data_;  // ResumeFromStore: the commit's SetCommitUserData text
  bool reopened_store_ = false;    // ResumeFromStore: a commit was reopened
  std::string commit_user_data_;   // SetCommitUserData's text, for the commits

  StepClock clock_;  // steps, micro-steps, the version read, the window's boundary
  // zinf.schedule layer-major: each parameter's next micro-batch allowed in this window.
  std::vector<int> next_micro_batch_;
  // fp16 (config fp16.enabled): the loss scale, updated at each boundary Step from the norm's
  // verdict (PostNormVerdict); null otherwise.
  std::unique_ptr<LossScaler> scaler_;
  // Whether a window's optimizer step waits for the global norm: with clipping (its
  // coefficient) and with fp16 (overflow).
  bool NeedsNorm() const { return WaitsForGlobalNorm(config_); }
  // At a boundary Step, once every gradient of window `next` has landed: the global norm, its
  // verdict posted to the board (the clipping and unscaling coefficient, or the step skipped
  // for an fp16 overflow; the scale updated) and the unscaled norm into st->grad_norm. A
  // failure (the norm's collective, a non-finite norm without fp16, an overflow at the fp16
  // floor) has posted a failed norm and waited for the optimizer's rollback.
  Status PostNormVerdict(int64_t next, StepStats* st);
  // What a checkpoint records of the scaler (fp16), or nothing.
  std::optional<CheckpointLossScale> LossScaleRecord() const;
  // The parameter groups' hyperparameters of the next task (SetParamGroup; group 0 the
  // config's optimizer.params).
  std::vector<ParamGroupHyper> groups_;
  Status broken_;  // once set, every call fails with it
  // GatherMasterParameter's copy of one sub-group's states.
  std::unique_ptr<AlignedBuffer> gather_states_;
  size_t gather_group_ = 0;

  // Stages 0 to 2, once the layout is frozen: whether the whole parameters fit the device
  // budget with the rest the device holds (refused, naming stage 3, when not).
  Status CheckReplicasFit() const;
  // FinishRegistration's placement: the layout frozen, the pinned arena and its pools
  // (AllocatePinned), the swap store (OpenSwapStore, with an NVMe tier) and the components
  // over them (BuildComponents).
  Status Place();
  Status AllocatePinned(const PinnedPlan& plan);
  Status OpenSwapStore();
  Status BuildComponents(const PinnedPlan& plan);
  Status InitStores();
  // A parameter the optimizer may be rewriting now (delayed update: its gradient was reduced
  // in this boundary micro-step). The function reads clock_ and core_->grads: FetchScheduler calls
  // it on the trainer's thread only.
  FetchScheduler::Rewriting Rewriting() const {
    return [this](ParamId id) {
      return clock_.delayed() && clock_.boundary() && core_->grads->reduced(id);
    };
  }
  // Delayed update: waits until the previous window's optimizer step is done with sub-group
  // `gi`, whose accumulators the trainer is about to write. No-op otherwise.
  Status WaitStepped(size_t gi) { return core_->grads->WaitStepped(gi, clock_.step()); }
  // At the start of a micro-step: resets the gradient flags; a micro-step that ends a window
  // hands the optimizer its task at its first call (KickTask).
  void BeginMicroStep() {
    const bool boundary = clock_.PrepareMicroStep();
    if (clock_.span() > 1) next_micro_batch_.assign(layout_.num_params(), 0);
    core_->grads->BeginMicroStep();
    if (core_->local_grads) core_->local_grads->BeginMicroStep();
    core_->board->BeginMicroStep(boundary, clock_.step());
  }
  // Hands the optimizer thread the task of a boundary micro-step, at the micro-step's first
  // Acquire, ReduceGradient or Step (so that between steps the optimizer is idle and a
  // checkpoint can be saved or loaded). Its read-ahead of NVMe states overlaps the forward.
  void KickTask() {
    gather_states_.reset();
    if (!clock_.StartMicroStep()) return;
    const float unscale = scaler_ ? static_cast<float>(1.0 / scaler_->scale()) : 1.0f;
    core_->board->Push({clock_.step() + 1, NeedsNorm(), groups_, unscale});
  }
  // Between steps: waits for the optimizer step still running (delayed update) and makes its
  // parameters the ones the next micro-step reads, as a checkpoint resume would.
  Status FinishPendingUpdate() {
    ZINF_RETURN_IF_ERROR(core_->board->WaitDone(clock_.step()));
    if (clock_.visible() != clock_.step()) {
      clock_.MakeVisible();
      gather_states_.reset();
      // Durable: a resume must read what the next micro-step reads (the optimizer is idle).
      return durable_->Commit(clock_.step(), clock_.visible());
    }
    return Status::OK();
  }
  Status CheckBetweenSteps(const char* what) const;
  // ReduceGradient's micro-batch `micro_batch` (-1: not named) of `id`, checked against the
  // schedule (zinf.schedule) and the parameter's earlier gradients in the micro-step; true:
  // the parameter's last gradient of the micro-step (it lands).
  Result<bool> CheckMicroBatch(ParamId id, int micro_batch);
  // GatherMasterParameter's end: this rank's partition `mine` of `p` gathered into its whole
  // value at `out` (numel values).
  Status GatherPartition(const ParamLayout& p, const float* mine, float* out);
  // offload_states: what was moved out of device memory (the kept buffers' contents back to
  // back in `host`), until ReloadStates puts it back.
  struct Moved {
    DeviceSlot slot;
    size_t offset = 0;  // in host (kept ones)
    uint32_t type = 0;  // its Engine::OffloadStateType
  };
  struct Offloaded {
    // Anonymous memory with huge pages where the kernel has them: a copy into fresh 4 KiB
    // pages is page-fault bound (a tenth of memcpy's speed on a VM).
    std::unique_ptr<HostArray> host;
    bool registered = false;  // host is registered with the device (pin_memory)
    size_t host_used = 0;     // bytes of `host` holding values
    uint32_t mask = 0;        // the types offloaded
    std::vector<Moved> moved;
    // device="nvme": the values are in offload_store_ ("device": host's first host_used
    // bytes, "arena/<i>": arena_pages[i]); host and the pinned arena are released.
    bool on_nvme = false;
    std::vector<MemoryRegion> arena_pages;
  };
  std::unique_ptr<Offloaded> offloaded_;
  // offload_states(device="nvme"): a store of its own (its own folder, under the first NVMe
  // path or ./zinf-swap, so the engine's store, durable or not, never holds these), opened at
  // the first such offload, its files removed at close.
  std::unique_ptr<SwapStore> offload_store_;
  std::string offload_folder_;
  // The pinned arena's registrations (dropped while it is released to NVMe).
  bool arena_device_registered_ = false;
  bool arena_io_registered_ = false;
  Result<SwapStore*> OffloadStore();
  // At close: the store closed (its files removed) and its folder removed.
  void CloseOffloadStore();
  // OffloadStates after its checks: what `o` names moved out of device memory (into the host
  // copy; to NVMe, everything, blocking).
  Status OffloadToHost(const Engine::OffloadStatesOptions& o);
  // offloaded_ (everything, in host memory, when `to_host` is OK) written to NVMe, every rank
  // agreeing; then the host copy and the pinned arena are released. On failure the values
  // stay in host memory.
  Status MoveToNvme(const Status& to_host);
  // The pinned arena unregistered (device, io_uring) and released; undone on failure.
  Status ReleaseArena();
  // Back from NVMe into the pinned arena and a host copy (ReloadTypes' first step); on
  // failure the values stay on NVMe and a later call tries again.
  Status LoadFromNvme();
  // offload_states' end: waits for its copies, then gives the freed device memory back
  // (Device::TrimMemory); after a non-blocking one, the next blocking offload_states does.
  Status FinishOffload();
  void ReturnMemoryAfterFailedReload();
  // A non-blocking ReloadStates' host copy, released once its copies have run.
  std::unique_ptr<Offloaded> reloading_;
  // The last host copy, kept for the next offload_states once reloaded (its pages are
  // faulted in: repeated cycles copy at memcpy speed); released with the engine.
  std::unique_ptr<Offloaded> spare_;
  // The calls that read the states: reloads the offloaded types in `needed` (blocking), and
  // waits for a non-blocking reload's copies.
  Status EnsureStatesLoaded(uint32_t needed = Engine::kOffloadAll);
  // The types OffloadStates may have left offloaded on some rank: changed only where every
  // rank agrees, so it is the same on every rank even when a reload failed on one rank only
  // (whose offloaded_ then differs from the others').
  uint32_t offload_pending_ = 0;
  // EnsureStatesLoaded at the top of a call whose collectives pair across the ranks (Acquire,
  // ReduceGradient, Step, the checkpoint and value calls): when the states may be offloaded,
  // every rank learns whether every rank could reload them.
  Status ReloadForCollective(uint32_t needed = Engine::kOffloadAll) {
    const bool reloads = world_ > 1 && (offload_pending_ & needed) != 0;
    Status s = EnsureStatesLoaded(needed);
    if (reloads) s = collectives_->Agree(s, "reloading the offloaded states");
    if (s.ok()) offload_pending_ &= ~needed;
    return s;
  }
  // OffloadStates' buffers of the types in `include`.
  Status CollectSlots(uint32_t include, Offloaded* off);
  // ReloadStates of the types in `mask` (the others stay offloaded).
  Status ReloadTypes(uint32_t mask, bool non_blocking);
  // Releases a host copy (unregistering it first).
  void ReleaseHostCopy(Offloaded* o);
  // A reloaded host copy becomes the spare (the previous spare is released).
  void KeepAsSpare(std::unique_ptr<Offloaded> o);
  // Every fetched copy goes (it holds values about to change); with `frozen` false, those of
  // frozen parameters stay.
  Status EvictAll(bool frozen = true) {
    for (ParamId id = 0; id < layout_.num_params(); ++id) {
      if (frozen || layout_.param(id).info.trainable) {
        ZINF_RETURN_IF_ERROR(core_->fetch->Replace(id));
      }
    }
    return Status::OK();
  }
  // Installs sub-group `gi`'s [master | m | v] from `buf` and rebuilds its parameter store
  // buffer `buf_index` from the masters.
  Status WriteGroupStates(size_t gi, const void* buf, int buf_index);
  // Stops the engine after `s`: every later call fails with "head (s); tail".
  Status Break(const std::string& head, const Status& s, const std::string& tail) {
    broken_ = Status::FailedPrecondition(head + " (" + s.message() + ")" + tail);
    return s;
  }
};

}  // namespace zinf
