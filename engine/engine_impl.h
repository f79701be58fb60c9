// The engine's state as its façade sees it: the configuration and handles, the components
// (engine/*.h) and the step sequencing fields. Private to engine.cc and engine_values.cc.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/core/acquire_trace.h"
#include "engine/core/device_budget.h"
#include "engine/core/engine_context.h"
#include "engine/core/fetch_scheduler.h"
#include "engine/core/gradient_adder.h"
#include "engine/core/gradient_path.h"
#include "engine/core/group_board.h"
#include "engine/core/host_collectives.h"
#include "engine/core/host_memory.h"
#include "engine/core/layout.h"
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

struct Engine::Impl {
  Impl(const EngineConfig& c, Device* d, Communicator* cm, const EngineHooks& h)
      : config(c),
        device(d),
        comm(cm),
        hooks(h),
        rank(cm->rank()),
        world(cm->world_size()),
        layout(world, c.bf16 ? 2 : 4, c.optimizer_state_type, c.frozen_int8),
        clock(config),
        groups{ParamGroupHyper{c.optimizer.lr, c.optimizer.beta1, c.optimizer.beta2,
                               c.optimizer.eps, c.optimizer.weight_decay}} {}
  ~Impl();

  const EngineConfig config;
  Device* const device;
  Communicator* const comm;
  const EngineHooks hooks;
  const int rank;
  const int world;
  Layout layout;
  std::vector<std::function<void(float*, size_t)>> inits;  // until the stores are initialised
  // A trainer's own settings every rank must share (RequireAgreement), compared with the
  // engine's at FinishRegistration.
  std::vector<std::pair<std::string, std::string>> agreement;
  // The initial values' xxh3 per parameter (InitStores, when it calls the inits), compared
  // across the ranks; empty when the values came from a durable store.
  std::vector<uint64_t> initial_hashes;
  // Several ranks: the initial values are compared at the first call that uses them
  // (CheckInitialValues), so that a load that replaces them first (SetParameterValues,
  // LoadCheckpoint) is not refused for values nobody trains on. 0 in initial_hashes: replaced.
  bool values_unchecked = false;
  Status CheckInitialValues();
  // SetParameterValues with several ranks: the `count` parameters marked in `wanted` and
  // their values (xxh3, from a first call of `fill`) compared across the ranks.
  Status CompareValuesToSet(size_t count, const std::vector<uint8_t>& wanted,
                            const std::function<Status(ParamId, float*)>& fill);

  EngineStreams streams;
  std::unique_ptr<CpuOptimizer> optimizer;
  std::unique_ptr<DeviceBudget> budget;
  StatsRecorder stats;
  std::unique_ptr<HostCollectives> collectives;
  AcquireTrace trace;

  // From placement on (FinishRegistration).
  std::unique_ptr<PinnedArena> arena;
  BlockPool grad_pool;      // streaming accumulators, one block per sub-group
  BlockPool state_pool;     // [master | m | v] of one sub-group (NVMe states; initialisation)
  BlockPool copy_pool;      // the bf16 parameter copy of one sub-group
  BlockPool snapshot_pool;  // pre-step states of sub-groups stepped speculatively
  std::unique_ptr<SwapStore> swap;
  std::unique_ptr<GroupBoard> board;
  std::unique_ptr<ParamStore> param_store;
  std::unique_ptr<StateStore> states;
  std::unique_ptr<GradientAdder> adder;
  std::unique_ptr<FetchScheduler> fetch;
  std::unique_ptr<GradientPath> grads;
  std::unique_ptr<DurableCommits> durable;
  std::unique_ptr<Checkpointer> checkpointer;
  std::unique_ptr<OptimizerPipeline> pipeline;
  bool registered = false;
  bool resume_store = false;      // ResumeFromStore: InitStores reopens instead of initialising
  std::string resumed_user_data;  // ResumeFromStore: the commit's SetCommitUserData text
  bool reopened_store = false;    // ResumeFromStore: a commit was reopened
  std::string commit_user_data;   // SetCommitUserData's text, for the commits

  StepClock clock;  // steps, micro-steps, the version read, the window's boundary
  // The parameter groups' hyperparameters of the next task (SetParamGroup; group 0 the
  // config's optimizer.params).
  std::vector<ParamGroupHyper> groups;
  Status broken;  // once set, every call fails with it
  // GatherMasterParameter's copy of one sub-group's states.
  std::unique_ptr<AlignedBuffer> gather_states;
  size_t gather_group = 0;

  Status Place();
  Status InitStores();
  // The frozen sub-group `gi`: each parameter's value from its init into its store, hashed;
  // at a resume the hash must equal the commit's (`committed`, per parameter; 0: unknown).
  Status InitFrozen(size_t gi, const ParamStore::Resume& resume,
                    const std::vector<uint64_t>& committed);
  // What a checkpoint or a commit records of a frozen parameter's whole value (`n` fp32
  // values): xxh3-64 of the values as the storage dtype holds them (bf16-rounded with bf16
  // storage; int8 storage is a cut of those per rank, not hashed); 0 if no hash could be taken.
  uint64_t ValueHash(const float* full, size_t n) const;
  // This rank's partition (fp32) of frozen parameter `id` in its store's form (PartBytes).
  Status EncodeFrozen(ParamId id, const float* part, void* out);
  // A parameter the optimizer may be rewriting now (delayed update: its gradient was reduced
  // in this boundary micro-step).
  FetchScheduler::Rewriting Rewriting() const {
    return [this](ParamId id) { return clock.delayed() && clock.boundary() && grads->reduced(id); };
  }
  // Delayed update: waits until the previous window's optimizer step is done with sub-group
  // `gi`, whose accumulators the trainer is about to write. No-op otherwise.
  Status WaitStepped(size_t gi) { return grads->WaitStepped(gi, clock.step()); }
  // At the start of a micro-step: resets the gradient flags; a micro-step that ends a window
  // hands the optimizer its task at its first call (KickTask).
  void BeginMicroStep() {
    const bool boundary = clock.PrepareMicroStep();
    grads->BeginMicroStep();
    board->BeginMicroStep(boundary, clock.step());
  }
  // Hands the optimizer thread the task of a boundary micro-step, at the micro-step's first
  // Acquire, ReduceGradient or Step (so that between steps the optimizer is idle and a
  // checkpoint can be saved or loaded). Its read-ahead of NVMe states overlaps the forward.
  void KickTask() {
    gather_states.reset();
    if (!clock.StartMicroStep()) return;
    board->Push({clock.step() + 1, config.gradient_clipping > 0, groups});
  }
  // Between steps: waits for the optimizer step still running (delayed update) and makes its
  // parameters the ones the next micro-step reads, as a checkpoint resume would.
  Status FinishPendingUpdate() {
    ZINF_RETURN_IF_ERROR(board->WaitDone(clock.step()));
    if (clock.visible() != clock.step()) {
      clock.MakeVisible();
      gather_states.reset();
      // Durable: a resume must read what the next micro-step reads (the optimizer is idle).
      return durable->Commit(clock.step(), clock.visible());
    }
    return Status::OK();
  }
  Status CheckBetweenSteps(const char* what) const;
  // GatherMasterParameter / SetParameterValues of a frozen parameter: its value is its
  // parameter store's (storage dtype), read or written there; SetFrozen records the new hash.
  Status GatherFrozen(ParamId id, float* out);
  // *wrote: whether its store was written to (then a failure may leave part of the values).
  Status SetFrozen(ParamId id, const std::function<Status(ParamId, float*)>& fill, bool* wrote);
  // Every fetched copy goes (it holds values about to change); with `frozen` false, those of
  // frozen parameters stay.
  Status EvictAll(bool frozen = true) {
    for (ParamId id = 0; id < layout.num_params(); ++id) {
      if (frozen || layout.param(id).info.trainable) ZINF_RETURN_IF_ERROR(fetch->Evict(id));
    }
    return Status::OK();
  }
  // Installs sub-group `gi`'s [master | m | v] from `buf` and rebuilds its parameter store
  // buffer `buf_index` from the masters.
  Status WriteGroupStates(size_t gi, const void* buf, int buf_index);
  // Stops the engine after `s`: every later call fails with "head (s); tail".
  Status Break(const std::string& head, const Status& s, const std::string& tail) {
    broken = Status::FailedPrecondition(head + " (" + s.message() + ")" + tail);
    return s;
  }
};

}  // namespace zinf
