// The optimizer thread: for each OptimizerTask it steps the sub-groups in backward order as
// their gradients land, reading NVMe states ahead into a window of buffers, stepping on the
// CPU (or on the device for sub-groups kept there), and writing states and parameters behind.
#pragma once

#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "engine/core/device_budget.h"
#include "engine/core/engine_context.h"
#include "engine/core/gradient_window.h"
#include "engine/core/group_board.h"
#include "engine/core/host_memory.h"
#include "engine/core/layout.h"
#include "engine/core/param_store.h"
#include "engine/core/state_store.h"
#include "engine/core/stats_recorder.h"
#include "engine/core/step_clock.h"
#include "engine/persistence/durable_commits.h"
#include "engine/speculation.h"
#include "engine/state_window.h"
#include "zinf/config.h"
#include "zinf/cpu_adam.h"
#include "zinf/device.h"
#include "zinf/swap.h"

namespace zinf {

class OptimizerPipeline {
 public:
  // What it steps: the stores, the gradients, the commits of a delayed step, the CPU
  // optimizer, and the pools of state and parameter-copy buffers (NVMe states).
  struct Parts {
    StateStore* states = nullptr;
    ParamStore* params = nullptr;
    GradientWindow* grads = nullptr;
    DurableCommits* durable = nullptr;
    CpuOptimizer* optimizer = nullptr;
    BlockPool* state_pool = nullptr;
    BlockPool* copy_pool = nullptr;
    // Snapshots of sub-groups stepped speculatively (zinf.speculative_step); not initialized:
    // no speculation.
    BlockPool* snapshot_pool = nullptr;
  };
  OptimizerPipeline(const EngineContext& ctx, const Parts& parts);
  ~OptimizerPipeline();  // joins the thread (the board must have been stopped)
  OptimizerPipeline(const OptimizerPipeline&) = delete;
  OptimizerPipeline& operator=(const OptimizerPipeline&) = delete;

  Status Start();
  void Join();

 private:
  // One task's working set: its sub-group order, its state window, its first failure (the
  // sub-groups it speculates are in speculation_, empty again whenever a task ends).
  struct TaskRun;
  // How one sub-group is stepped.
  struct GroupStep {
    const OptimizerTask* task = nullptr;
    size_t gi = 0;
    float coef = 1.0f;  // the clipping coefficient (1: none)
    // A sub-group the device steps: its accumulators in device memory
    // (GradientWindow::ReadyGroup::grads). Host sub-groups read GradientWindow::Acc, also when
    // a speculative step is stepped again.
    const float* grads = nullptr;
    // By index in the group: whether the parameter got a gradient in the window; the others
    // are not updated (their parameter stores are still written, as their buffer may be stale).
    std::vector<uint8_t> with_grad;
    // Each gradient is checked for inf and NaN inside the step (tile by tile, see
    // CpuOptimizer::StepIfFinite); one that holds one sets `non_finite` and fails the group
    // with NonFinite before anything of the group is written to a store (but for the pieces
    // of `upload_pieces`), so a non-finite master is never written (the engine must then be
    // recreated from a checkpoint or the durable store, whose last commit predates the step).
    // Off: with clipping, the norm checked them.
    bool check_finite = false;
    bool non_finite = false;  // out
    // A speculative step: a block laid out as the states, into which each parameter's slices
    // get their pre-step values as the step goes (Speculation::KeepTiles); whole once the step
    // returns, a failure or not.
    void* snapshot = nullptr;
    // Parameters on the device: each parameter is stepped in up to kPieces pieces (whole tiles
    // of the optimizer's; fewer for a parameter of fewer tiles), and each piece's copy to the
    // device is issued as soon as it is stepped, so that the copies run under the step instead
    // of after it (the task's last sub-groups, kPiecedLastGroups, whose copies nothing else
    // would overlap). A non-finite gradient then stops the step with the pieces before it
    // (finite, stepped values) already copied: the engine stops either way, and with clipping
    // the norm has checked every gradient before the step.
    bool upload_pieces = false;
    // >= 0 (no clipping, not speculative): the index in the group of a parameter whose
    // gradient is still landing piece by piece (GroupBoard::LandPiece); it is stepped last, in
    // up to kPieces pieces, each once its gradient has landed (GradientWindow::WaitLanded).
    int landing = -1;
  };
  void Loop();
  // One task: every sub-group, in backward order.
  Status Run(const OptimizerTask& task);
  // The k-th sub-group of the task's order: waits for its gradients, steps it. A failure that
  // stops the task is returned; one that leaves the sub-group as it was goes to run->first.
  // The norm failed: the task is drained (run->drained) and run->first returned; nothing else
  // is stepped.
  Status StepNext(TaskRun* run, size_t k);
  // Steps sub-group plan.gi speculatively (its coefficient not yet known).
  Status StepSpeculatively(TaskRun* run, GroupStep* plan, float* master, PooledBlock states);
  // The verdict on the speculated sub-groups (see Speculation::Resolve).
  void Settle(TaskRun* run, float coef, bool roll_back);
  // The norm failed (not finite, or its collective did): what was speculated is rolled back,
  // nothing else is stepped, and the task did nothing, which is not an optimizer failure (the
  // trainer's Step reports the norm's error). Otherwise `s`.
  Status VerdictFailed(TaskRun* run, const Status& s);
  // Done with sub-group gi (stepped, or failed and left as it was): the trainer may put the
  // next window's gradients into its accumulators.
  void MarkStepped(size_t gi, int64_t step);
  // Steps plan's sub-group in `master` (its NVMe state block `states`, if any) and queues its
  // write-backs in the task's window.
  Status StepAndWrite(TaskRun* run, GroupStep* plan, float* master, PooledBlock states);
  // Step `task`'s hyperparameters for a parameter of parameter group `group`.
  OptimizerHyperParams HyperParams(const OptimizerTask& task, float coef, size_t group) const;
  // A sub-group kept on the device, with its parameters on the device: stepped by
  // Device::OptimizerStep on the update stream, the parameters written into their device
  // stores by the step itself (bf16) or a device copy (fp32).
  Status StepGroupOnDevice(const GroupStep& plan);
  Status CheckDeviceGradients(const GroupStep& plan, const float* grads);
  // `master`: the sub-group's [master | state 1 | state 2] (Layout::GroupStateBytes);
  // `copy_out`: its bf16 parameter copy (bf16 parameters), or null.
  Status StepGroup(GroupStep* plan, float* master, uint16_t* copy_out, std::vector<Ticket>* writes);
  // The group's j-th parameter (a gradient in the window), piece by piece where it lands or
  // uploads in pieces. `kept`: per tile, whether its pre-step values are in the snapshot.
  // `*written`: it went to the device piece by piece. `*landing_wait`: seconds waited.
  Status StepParam(GroupStep* plan, size_t j, float* master, uint16_t* copy_out,
                   std::vector<uint8_t>* kept, bool* written, double* landing_wait);
  // A failure at the group's j-th parameter: what was not stepped still holds its pre-step
  // values (the tiles of j not kept, the parameters after it); the snapshot gets them, so that
  // it is whole for the rollback whatever failed. Returns s.
  Status CompleteSnapshot(const GroupStep& plan, size_t j, const std::vector<uint8_t>& kept,
                          const float* master, const Status& s) const;
  static constexpr size_t kPieces = 8;
  static constexpr size_t kPiecedLastGroups = 2;  // upload_pieces: the task's last two
  Status NonFinite(ParamId id, int64_t step) const;
  // The optimizer's view of parameter `id`'s partition inside its sub-group's buffer `states`
  // ([master | state 1 | state 2]: exp_avg / exp_avg_sq, or Lion's momentum in state 1, or the
  // Adagrad sum in state 2; fp32 or compressed, zinf.optimizer_state_dtype), with fp32
  // gradients at `grad`; no parameter copy.
  OptimizerTensors PartTensors(ParamId id, const OptimizerHyperParams& hp, float* states,
                               const float* grad) const;
  int Buf(int64_t version) const { return m_.params->Buf(version); }

  const EngineContext ctx_;
  const Parts m_;
  Speculation speculation_;  // the task's speculated sub-groups (optimizer thread)
  std::thread thread_;
  bool last_clipped_ = false;  // the last clipped task's verdict rescaled (optimizer thread)
};

}  // namespace zinf
