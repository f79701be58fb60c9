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
#include "engine/core/gradient_path.h"
#include "engine/core/group_board.h"
#include "engine/core/host_memory.h"
#include "engine/core/layout.h"
#include "engine/core/param_store.h"
#include "engine/core/state_store.h"
#include "engine/core/stats_recorder.h"
#include "engine/core/step_clock.h"
#include "engine/persistence/durable_commits.h"
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
    GradientPath* grads = nullptr;
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
  void Loop();
  // One task: every sub-group, in backward order.
  Status Run(const OptimizerTask& task);
  // Step `task`'s hyperparameters for a parameter of parameter group `group`.
  OptimizerHyperParams HyperParams(const OptimizerTask& task, float coef, size_t group) const;
  // A sub-group kept on the device, with its parameters on the device: stepped by
  // Device::OptimizerStep on the update stream, the parameters written into their device
  // stores by the step itself (bf16) or a device copy (fp32). `with_grad[j]`: whether the
  // group's j-th parameter got a gradient in the window; the others are not updated (their
  // parameter stores are still written, as their buffer may be stale).
  Status StepGroupOnDevice(size_t gi, const OptimizerTask& task, float coef,
                           const std::vector<uint8_t>& with_grad);
  // `states`: the sub-group's [master | state 1 | state 2] (Layout::GroupStateBytes).
  //
  // `non_finite` not null: each gradient is checked for inf and NaN inside the step (tile by
  // tile, see CpuOptimizer::StepIfFinite); one that holds one sets it and fails the group
  // with NonFinite before anything of the group is written to a store (but for the pieces of
  // `upload_pieces`), so a non-finite master is never written (the engine must then be
  // recreated from a checkpoint or the durable store, whose last commit predates the step).
  // Null: with clipping, the norm checked them.
  //
  // `snapshot` not null (a speculative step): a block laid out as `states`, into which each
  // parameter's slices get their pre-step values as the step goes (KeepTiles); whole once
  // this returns, a failure or not.
  //
  // `landing` >= 0 (no clipping, not speculative): the index in the group of a parameter
  // whose gradient is still landing piece by piece (GroupBoard::LandPiece); it is stepped
  // last, in up to kPieces pieces, each once its gradient has landed (GroupBoard::WaitLanded).
  //
  // `upload_pieces` (parameters on the device): each parameter is stepped in up to kPieces pieces
  // (whole tiles of the optimizer's; fewer for a parameter of fewer tiles), and each piece's
  // copy to the device is issued as soon as it is stepped, so that the copies run under the
  // step instead of after it (the task's last sub-groups, kPiecedLastGroups, whose copies
  // nothing else would overlap). A non-finite gradient then stops the step with the pieces
  // before it (finite, stepped values) already copied: the engine stops either way, and with
  // clipping the norm has checked every gradient before the step.
  Status StepGroup(size_t gi, float* states, uint16_t* copy_out, const OptimizerTask& task,
                   float coef, bool* non_finite, const std::vector<uint8_t>& with_grad,
                   std::vector<Ticket>* writes, void* snapshot = nullptr,
                   bool upload_pieces = false, int landing = -1);
  static constexpr size_t kPieces = 8;
  static constexpr size_t kPiecedLastGroups = 2;  // upload_pieces: the task's last two
  // Copies elements [begin, end) of parameter id's slices (master and states) from its
  // sub-group's buffer `master` into the same places of `snapshot`, with streaming stores.
  void KeepTiles(ParamId id, const float* master, void* snapshot, size_t begin, size_t end) const;
  // fn(byte offset, bytes) for each slice (master, state 1, state 2) of sub-group gi's
  // parameters in its [master | states] buffer.
  void ForEachSlice(size_t gi, const std::function<void(size_t, size_t)>& fn) const;
  Status NonFinite(ParamId id, int64_t step) const;
  // memcpy on the optimizer's threads (a speculated sub-group's snapshot and its restore).
  void Copy(void* dst, const void* src, size_t bytes);
  // The optimizer's view of parameter `id`'s partition inside its sub-group's buffer `states`
  // ([master | state 1 | state 2]: exp_avg / exp_avg_sq, or Lion's momentum in state 1, or the
  // Adagrad sum in state 2; fp32 or compressed, zinf.optimizer_state_dtype), with fp32
  // gradients at `grad`; no parameter copy.
  OptimizerTensors PartTensors(ParamId id, const OptimizerHyperParams& hp, float* states,
                               const float* grad) const;
  int Buf(int64_t version) const { return m_.params->Buf(version); }

  const EngineContext ctx_;
  const Parts m_;
  std::thread thread_;
  bool last_clipped_ = false;  // the last clipped task's verdict rescaled (optimizer thread)
};

}  // namespace zinf
