// The zinf engine: ZeRO-3 parameter partitioning with tiered placement (device, pinned host,
// NVMe), trace-driven prefetch, the gradient path and the CPU optimizer pipeline.
//
// One Engine per rank. The engine sees the device and the other ranks only through the
// Device and Communicator seams, so every path runs on a CPU-only machine (HostDevice +
// LocalComm).
//
// A training step, as the trainer drives it:
//   for each layer (forward):  ptrs = Acquire(layer params); compute; Release(layer params)
//   for each layer (backward): ptrs = Acquire(...); compute grads; ReduceGradient(id, grad)
//                              for each param; Release(...)
//   Step()   // every micro-step; the optimizer runs after gradient_accumulation_steps
// With zinf.schedule "layer-major" a Step covers the whole window: each layer runs for every
// micro-batch before the next (forward up, backward down), so each parameter is acquired
// once per pass, and its gradients go in as ReduceGradient(id, grad, j) in micro-batch order.
// All ranks must make the same calls in the same order (the collectives are matched by
// order). The first step's Acquire sequence is recorded and drives prefetch from then on,
// unless SetAcquireOrder gave the order up front.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "zinf/comm.h"
#include "zinf/config.h"
#include "zinf/device.h"
#include "zinf/engine_types.h"
#include "zinf/plan.h"
#include "zinf/status.h"

namespace zinf {

class FaultPlan;  // zinf/io.h

// Seams for tests and embedders, beyond the JSON config.
struct EngineHooks {
  // Wraps the swap store's I/O backend in a FaultyBackend driven by this plan.
  std::shared_ptr<FaultPlan> fault_plan;
  // Tests: called by LoadCheckpoint once the checkpoint (its folder path given) has validated
  // and before its states are installed (a test changes the files there).
  std::function<void(const std::string& folder)> checkpoint_validated;
};

class Engine {
 public:
  // `device` and `comm` must outlive the engine. One engine per rank, each on its own thread.
  static Result<std::unique_ptr<Engine>> Create(const EngineConfig& config, Device* device,
                                                Communicator* comm, const EngineHooks& hooks = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Registers a parameter; the registration order is the layer order. A parameter that can
  // never fit its tiers (device budget, pinned budget) fails here, naming the budget to raise.
  Result<ParamId> RegisterParameter(const ParamSpec& spec);
  // Places every registered parameter in its tier and builds the optimizer sub-groups. Called
  // by the first Acquire when not called before; registration ends with it.
  //
  // With several ranks it first compares across them what must be equal (the parameters in
  // registration order with shapes and trainable flags, the optimizer and its
  // hyperparameters, dtypes, tiers, clipping, accumulation, the RequireAgreement settings):
  // a difference fails FinishRegistration on every rank with FailedPrecondition naming the
  // first difference and both ranks' values, before any other collective. A rank whose
  // placement or initialisation failed fails the others too ("another rank failed"). The
  // initial values (xxh3 of each parameter) are compared at the first call that uses them
  // (Acquire, Step, GatherMasterParameter, SaveCheckpoint), leaving out those a
  // SetParameterValues or LoadCheckpoint replaced before: ranks that initialise differently
  // and then load the same weights train; ranks that train on different initial values are
  // refused there, on every rank, and the engine stops.
  Status FinishRegistration();
  // Adds a trainer's own setting to what every rank must agree on at FinishRegistration
  // (steps, batch size, a schedule: anything that changes which collectives a rank issues or
  // what it computes). One line each; before FinishRegistration.
  Status RequireAgreement(const std::string& name, const std::string& value);
  // Compares `text` ("name: value" lines) across the ranks (collective: every rank calls it
  // at the same point): OK when every rank passed the same text, else FailedPrecondition on
  // every rank, "the ranks disagree on <what>: <the first differing line, rank 0's value and
  // the other rank's>. <remedy>". One 16-byte all-gather when they agree. For a front end
  // whose ranks could take different paths between steps (Python: a write or read of a
  // parameter on some ranks only), before the collectives those paths issue.
  Status CompareAcrossRanks(const std::string& what, const std::string& text,
                            const std::string& remedy);
  // Optional: the Acquire sequence of one micro-step (forward then backward), as a hint that
  // replaces recording it from the first step.
  Status SetAcquireOrder(const std::vector<ParamId>& order);

  // Full parameters on the device, in the order given. Compute on the device's compute stream
  // after this call sees their data (for HostDevice: the data is there when it returns).
  // Pointers stay valid until the matching Release. Element type: fp32, or bf16 / fp16
  // (uint16_t) when config.bf16 / config.fp16.enabled. A parameter still acquired from before an
  // optimizer step that changed it is refused (FailedPrecondition): release it first, its memory
  // holds the old version.
  Result<std::vector<void*>> Acquire(const std::vector<ParamId>& params,
                                     AcquireMode mode = AcquireMode::kTraining);
  // All or nothing for the list: an id not acquired (as many times as listed) is refused
  // before any is released. A device error while evicting one still releases the others and
  // is returned (the evicted copy then stays allocated, never reused).
  Status Release(const std::vector<ParamId>& params);

  // Hands the engine the full fp32 gradient (numel elements, device memory, produced on the
  // compute stream) of a parameter acquired in this micro-step's backward. The buffer may be
  // reused as soon as this returns. Gradients are summed over ranks and over the micro-steps
  // of an accumulation window, never averaged: scale the loss (1 / (ranks * micro-steps)) in
  // the trainer for a mean. Refusals (unknown, frozen, twice) change nothing; any other
  // failure may leave the gradient partly landed, so it stops the engine: every later call
  // fails, naming it; recreate the engine from a checkpoint or the durable store.
  Status ReduceGradient(ParamId id, const float* grad);
  // The gradient of micro-batch `micro_batch` (0-based, within the accumulation window).
  // zinf.schedule "micro-batch": `micro_batch` must be the current micro-step's place in its
  // window (a check; the same as the call above). "layer-major": one Step per window, and a
  // parameter's gradients come in increasing micro-batch order (a micro-batch may give it
  // none); each is summed onto the earlier ones in that order, as the micro-batch schedule
  // sums them, and the window's last micro-batch's gradient is the one that completes the
  // parameter for the optimizer. Out of order, repeated or out of the window: refused.
  Status ReduceGradient(ParamId id, const float* grad, int micro_batch);

  // Ends a micro-step. At an accumulation boundary it runs (or finishes) the optimizer over
  // every sub-group, clipping by global norm when configured, and returns when the updated
  // parameters are in their stores. With zinf.delayed_update (after the first
  // zinf.delayed_update_after steps) it returns without waiting for this step's optimizer (it
  // waits for the previous one's): the next micro-step reads the parameters one update older,
  // and a failure of this step's optimizer is returned by the next Step() that ends a window
  // (or GatherMasterParameter, SaveCheckpoint, LoadCheckpoint). With zinf.durable, a boundary
  // Step() ends by committing the swap store.
  Result<StepStats> Step();

  // Checkpoints. Collective (every rank calls them, with the same arguments) and only between
  // optimizer steps (after Step() at an accumulation boundary, before the next Acquire).
  //
  // SaveCheckpoint writes each rank's optimizer states (fp32 master, exp_avg, exp_avg_sq of
  // every partition, the states in zinf.optimizer_state_dtype, which the manifest records; a
  // checkpoint of another state dtype is converted on load), the step and update counters, the
  // layout and `user_data` (the trainer's own text in UTF-8, e.g. its model shape and data
  // position) under `dir`, with an xxh3 checksum per tensor and one of the manifest itself.
  // The folder is created (0700) if needed and locked for this engine's lifetime (a second
  // engine or run saving there is refused, naming it). The commit is atomic: files go to a
  // new folder (created exclusively, never through a link), are fsync'ed, and replacing
  // `dir/latest` publishes them; until then the previous checkpoint stays the valid one. Older
  // checkpoints are removed, but never the newest readable one before the new one. Parameter stores
  // are not saved: they are the masters converted to the storage dtype, and LoadCheckpoint rebuilds
  // them. Frozen parameters are not saved either: the manifest records the hash of each one's
  // value, and LoadCheckpoint leaves them as they are after checking it. Files are created 0600.
  // With zinf.delayed_update it first finishes the update still running and makes it visible (the
  // next two steps then run on the saved parameters), so the saving run and a run resumed from the
  // checkpoint continue identically.
  Status SaveCheckpoint(const std::string& dir, const std::string& user_data = "");
  // Restores the newest committed checkpoint of `dir` (or `dir` itself when it is one
  // checkpoint folder): optimizer states, parameter stores, step and update counters. The
  // layout (parameter names, sizes, which are frozen and their values' hashes, sub-groups,
  // optimizer type; another number of ranks is re-partitioned) must match this engine
  // (FailedPrecondition naming the first difference); every checksum is verified before
  // anything changes, and a mismatch names the tensor. NotFound only when `dir` does not exist
  // or holds no checkpoint at all; a damaged newest checkpoint (a missing or unreadable piece,
  // a `latest` that is missing or names nothing) is Corruption naming what is wrong, unless
  // `fall_back_to_older`: then the newest readable older one is loaded, with a warning naming
  // what was skipped. The folder is locked like SaveCheckpoint's.
  Status LoadCheckpoint(const std::string& dir, std::string* user_data = nullptr,
                        bool fall_back_to_older = false);
  // Collective: makes `dir` ready for checkpoints before training starts: created (0700),
  // writable (probed), locked for this engine. A trainer calls it first, so that a bad folder
  // or a second run on it is refused before any step is spent.
  Status PrepareCheckpointDir(const std::string& dir);
  // What `dir` holds of zinf's checkpoints: the names zinf wrote there (`latest`, an unfinished
  // `.incoming`, and the step folders step-NNNNNNNNN[.k] that carry zinf's mark or manifest),
  // newest first; empty when there are none or `dir` does not exist. Anything else in `dir`
  // is the user's, never listed and never removed (user notes named "step-..." included).
  static Result<std::vector<std::string>> ListCheckpoints(const std::string& dir);
  // Collective: removes what ListCheckpoints lists, nothing else (a trainer told to start
  // afresh over earlier checkpoints). `dir` must be prepared first (PrepareCheckpointDir: this
  // engine holds its lock).
  Status RemoveCheckpoints(const std::string& dir);

  // Durable mode (zinf.durable): every optimizer step ends with a commit of the NVMe swap
  // store (its writes go to fresh extents until then), so after a crash the store itself
  // holds the last completed step. ResumeFromStore, called after registering every
  // parameter and before anything else, reopens the store at that commit instead of
  // initialising the parameters: it checks that the layout matches (names, sizes,
  // sub-groups, optimizer, storage and optimizer state dtypes), rebuilds the parameter stores
  // that are not on NVMe from the masters, and sets global_step(). Frozen parameters: the
  // committed NVMe copy is kept; on other tiers the registered value must hash as committed
  // (FailedPrecondition naming it otherwise). NotFound when the store has no
  // commit. Collective with several ranks: each rank's store commits separately, so a crash may
  // leave one rank a step ahead; the stores then retain the commit before the last too, and the
  // ranks agree on the latest commit they all hold, of the same history (a LoadCheckpoint
  // starts a new one); a rank ahead drops its last one. FailedPrecondition on every rank when
  // the stores have no commit in common.
  //
  // What the swap folders hold decides, never a guess: NotFound when they hold no store at all
  // (another disk, other folders); Corruption when the store lost its index or a file;
  // FailedPrecondition when the folders are another store's, or its own in another order
  // (the message names the order), or the store is of another model. A store that never
  // committed (its run stopped while initialising) holds nothing to resume: ResumeFromStore
  // then places the initial values (as FinishRegistration) and global_step() is 0. On
  // success `*resumed` (optional) says which it was and what the commit recorded.
  struct StoreResume {
    bool reopened = false;  // a commit was reopened (false: the store never committed)
    int64_t step = 0;       // the step it holds (global_step())
    std::string user_data;  // SetCommitUserData's text of the run that committed ("" if none)
  };
  Status ResumeFromStore(StoreResume* resumed = nullptr);
  // Durable mode: the trainer's own text (UTF-8; e.g. its seed and data position) recorded
  // with every commit from now on, returned by a later ResumeFromStore. Before the first
  // Acquire (the initial commit records it too).
  Status SetCommitUserData(const std::string& user_data);

  // Collective (every rank calls it): the full fp32 master values of a parameter, gathered from
  // all ranks into `out` (numel floats, host memory). Waits for a delayed update still running.
  // A frozen parameter has no master: its stored value (bf16-rounded with bf16 storage; with
  // int8 frozen weights, decoded as a fetch decodes it).
  Status GatherMasterParameter(ParamId id, float* out);

  // Collective, between optimizer steps (like LoadCheckpoint): replaces the values of the
  // parameters `ids` (pretrained weights, say). For each of them `fill(id, data)` writes the
  // full fp32 tensor (numel elements) into `data`; the engine keeps this rank's partition as
  // the new master weights and rebuilds the parameter stores (a frozen parameter: its store
  // alone, and its recorded hash). Optimizer states and update
  // counts stay as they are (zero for an engine that has not stepped yet). The sub-groups
  // are visited in order, each read and written once, so host memory stays within the
  // largest tensor plus one sub-group's states (taken from the pinned budget when it has
  // room). A failing `fill` stops the load: when sub-groups were already written (or with
  // several ranks) the engine refuses to train on (recreate it), else nothing changed: check
  // the sources before calling. With zinf.durable the store commits the new values.
  // With several ranks every rank must pass the same ids and values: `fill` is called twice
  // per parameter (must give the same values both times), first to compare the values'
  // xxh3 across the ranks, and a difference is refused on every rank (FailedPrecondition
  // naming the parameter) before anything is written.
  // Inference acquires (AcquireMode::kInference) are refused between a boundary micro-step's
  // first ReduceGradient and its Step: the optimizer may be rewriting the parameters then.
  Status SetParameterValues(const std::vector<ParamId>& ids,
                            const std::function<Status(ParamId id, float* data)>& fill);

  // The number of optimizer updates applied to a parameter so far (torch's state["step"]),
  // counting the optimizer step still running with the delayed update (it waits for it).
  int64_t param_updates(ParamId id) const;

  // The learning rate of every parameter group's optimizer steps from the next micro-step on
  // (a schedule: warmup, decay); starts at the config's optimizer.params.lr.
  Status SetLearningRate(float lr);
  // Parameter groups (ParamGroupHyper). `group` == num_param_groups() adds a group (before
  // FinishRegistration only, so that parameters registered after it can name it); a smaller
  // index changes that group's hyperparameters for the optimizer steps from the next
  // micro-step on (torch's param_groups[i][key] = value). InvalidArgument for a value the
  // optimizer refuses (not finite, lr, eps or weight_decay < 0, betas outside [0, 1)) or an
  // index beyond the next one, naming the group and the key. Group 0 is the config's
  // optimizer.params. Every rank must make the same calls (compared at FinishRegistration;
  // after it, like SetLearningRate, the caller's).
  Status SetParamGroup(size_t group, const ParamGroupHyper& hp);
  size_t num_param_groups() const;
  ParamGroupHyper param_group(size_t group) const;  // REQUIRES: group < num_param_groups()

  int64_t global_step() const;
  // fp16 (config.fp16.enabled): the loss scale the trainer multiplies the loss (or its
  // gradient) by before the backward of the micro-steps until the next boundary Step (which
  // divides the gradients by it, and updates it); 1 without fp16. Gradients handed to
  // ReduceGradient are then the scaled ones: an inf or NaN in any of them, on any rank, skips
  // the whole optimizer step (no parameter, state or update count changes; global_step()
  // still advances, as DeepSpeed's global_steps does) and lowers a dynamic scale.
  double loss_scale() const;
  // The optimizer steps skipped so far for an fp16 overflow (restored by LoadCheckpoint and
  // ResumeFromStore); 0 without fp16.
  uint64_t skipped_steps() const;
  // ---- Freeing device memory between phases (DeepSpeed's offload_states / reload_states) ----
  // What OffloadStates moves, as a mask; DeepSpeed's OffloadStateTypeEnum names in brackets.
  enum OffloadStateType : uint32_t {
    // [lp_params] the parameters' device copies (dropped: fetched again when used) and the
    // device-tier parameter partitions (moved).
    kOffloadParams = 1,
    // [optim_states, hp_params] the fp32 masters and the states of the sub-groups the device
    // steps (offload_optimizer.device none, or beyond offload_optimizer.ratio).
    kOffloadOptimizerStates = 2,
    // [lp_grads, contiguous_grad_buffer] the device gradient accumulators and, at stages 0
    // and 1, the local gradient sums (empty between steps: freed, not copied).
    kOffloadGradients = 4,
    kOffloadAll = 7,
  };
  struct OffloadStatesOptions {
    uint32_t include = kOffloadAll;
    // Where the moved values go: Tier::kCpu, host memory; Tier::kNvme, a swap store of its
    // own in <first nvme_path, or ./zinf-swap>/offload_states-<pid>-<n>-rank<r> (its files
    // unlinked at creation, the folder removed at close; a killed run leaves it empty), and
    // then the pinned host memory is released too (pinned_memory().resident drops to 0), the
    // host copy with it. NVMe takes everything (include must be kOffloadAll: the pinned
    // memory holds every type) and always blocks. Any reload, an inference Acquire's too,
    // reads everything back into host memory first; a write that fails leaves the states in
    // host memory, a read that fails leaves them on NVMe (call again), and a reload that
    // then fails for device memory leaves them in host memory (offloaded to the cpu).
    Tier device = Tier::kCpu;
    bool pin_memory = true;  // host memory registered with the device (faster copies)
    // Return once the copies are queued; the next use of the engine (ReloadStates or any
    // call that reads the states) waits for them. The device memory goes back to the
    // system at the next blocking OffloadStates (which then moves nothing more).
    bool non_blocking = false;
  };
  // Between optimizer steps (as SaveCheckpoint), on every rank with the same include (the
  // ranks compare it): moves what `o.include` names out of device memory; with everything
  // included, the device memory the engine holds drops to its small collective scratch
  // (16 KiB). Training continues bit-identically after ReloadStates; the calls that need the
  // states reload them first (a training Acquire, ReduceGradient, Step, SaveCheckpoint,
  // LoadCheckpoint, SetParameterValues: all; an inference Acquire: the parameters only;
  // GatherMasterParameter: the parameters and optimizer states). OffloadStates of what is
  // offloaded already does nothing; naming more (or what a call reloaded), the union is
  // offloaded. At stages 0 to 2 the parameters offloaded are gathered again at their next
  // Acquire (a collective), not at the next step's end.
  // A delayed update still running is waited for. The host copy is kept after a reload, for
  // the next offload (released with the engine). A blocking OffloadStates returns the freed
  // memory to the system (Device::TrimMemory): on a CUDA device the pool's chunks are
  // unmapped and released (cudaMemGetInfo and torch see them free), on the host device the
  // pages are dropped; MemoryInfo().committed says what stays backed. If that fails the
  // states are still offloaded and the error says so.
  Status OffloadStates(const OffloadStatesOptions& o);
  // Puts back what OffloadStates moved (device memory allocated again, values copied back);
  // `non_blocking`: returns once the copies are queued (the engine's streams wait for them).
  // Nothing to do when nothing is offloaded. With several ranks, on every rank (they agree
  // on the outcome).
  Status ReloadStates(bool non_blocking = false);
  // Whether the states are offloaded now.
  bool states_offloaded() const;
  // The pinned host memory (the arena: cpu-tier parameters and optimizer states, staging):
  // its size, what is handed out, and what is resident now (0 while OffloadStates to NVMe
  // has released it; 0 for all three before registration ends).
  struct PinnedMemoryInfo {
    size_t capacity = 0;
    size_t used = 0;
    size_t resident = 0;
  };
  Result<PinnedMemoryInfo> pinned_memory() const;

  int rank() const;        // this rank (the communicator's)
  int world_size() const;  // ranks in all
  size_t num_params() const;
  const ParamInfo& param(ParamId id) const;
  const EngineConfig& config() const;

 private:
  class Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zinf
