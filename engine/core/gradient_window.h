// One accumulation window's gradients, from the trainer to the optimizer: each parameter's
// gradient is reduce-scattered (or, on one rank, copied) into the pinned fp32 accumulators of
// its sub-group (device memory for a sub-group the device steps); the window records that it
// arrived (once: the trainer's flag and the group board's has-grad), lands it, hands the
// optimizer each sub-group once it is ready (WaitReady: the board's verdict with the
// accumulators) and takes it back when the optimizer is done (Release). Accumulators live as
// long as the engine, or, streaming (no accumulation, no clipping), are blocks of a pool that
// a sub-group holds from its first gradient until Release.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "common/thread_annotations.h"
#include "engine/core/device_budget.h"
#include "engine/core/engine_context.h"
#include "engine/core/fetch_scheduler.h"
#include "engine/core/gradient_adder.h"
#include "engine/core/group_board.h"
#include "engine/core/host_collectives.h"
#include "engine/core/host_memory.h"
#include "engine/core/layout.h"
#include "engine/core/stats_recorder.h"
#include "zinf/comm.h"
#include "zinf/config.h"
#include "zinf/cpu_adam.h"
#include "zinf/device.h"

namespace zinf {

class GradientWindow {
 public:
  // Staging comes from the context's arena; the accumulators, streaming, from `grad_pool`,
  // else AllocateGroup gives each sub-group its own. Later micro-steps' gradients are summed
  // by `adder`. The reduce-scatters run on the comm stream, the landing on the grad stream.
  GradientWindow(const EngineContext& ctx, FetchScheduler* fetch, GradientAdder* adder,
                 BlockPool* grad_pool, bool streaming);
  ~GradientWindow();  // drains the adder first: its jobs use this object
  GradientWindow(const GradientWindow&) = delete;
  GradientWindow& operator=(const GradientWindow&) = delete;
  // One rank's gradient copied on the host device's inline compute stream at a window's end
  // lands in up to kLandPieces pieces of whole multiples of kLandPieceAlign elements
  // (GroupBoard::LandPiece).
  static constexpr size_t kLandPieces = 8;
  static constexpr size_t kLandPieceAlign = size_t{1} << 16;
  Status Init();  // its events and the registered zeros
  Status AllocateGroup(size_t gi);
  // offload_states: the device gradient accumulators (freed: a window's first gradient is
  // copied into them, and nothing reads what they held before).
  void DeviceSlots(std::vector<DeviceSlot>* out);

  // ---- Trainer thread ----
  // The gradient of `id` (device memory, `numel` fp32) goes into its accumulator; `ready` is
  // the optimizer step this micro-step completes (0: not a boundary; kNotLast: a layer-major
  // window's gradient before the parameter's last, summed in but neither landing nor counting
  // as reduced in the micro-step). On error the gradient may have partly landed: the caller
  // must stop the engine.
  static constexpr int64_t kNotLast = GroupBoard::kNotLast;
  Status Reduce(ParamId id, const float* grad, int64_t ready);
  // A micro-step starts: no gradient reduced in it yet.
  void BeginMicroStep();
  // At the boundary Step: parameters not reduced in this micro-step have final accumulators
  // (zeroed when they got no gradient in the window): they count as landed for step `ready`,
  // once the previous step is done with their sub-group (WaitStepped).
  Status CompleteWindow(int64_t ready);
  // Delayed update: waits until the optimizer step of window `step` (the one before the
  // current) is done with sub-group `gi`, whose accumulators the trainer is about to write;
  // the wait counts as optimizer wait. No-op otherwise.
  Status WaitStepped(size_t gi, int64_t step);
  // Wait-for-norm (clipping, fp16) at the end of a window: the global gradient norm of the
  // accumulators (this rank's sum of squares, all-reduced over `collectives`), not finite
  // when a gradient of any rank holds inf or NaN (StepCoefficient, loss_scaler.h, decides
  // from it). REQUIRES: Drain() since the last Reduce.
  Result<double> GlobalNorm(CpuOptimizer* optimizer, HostCollectives* collectives);
  // The window's optimizer step is taken: the next window starts with no gradients.
  void EndWindow();
  // Clipping: this rank's sum of squares of every accumulator (those on the device summed
  // there). REQUIRES: Drain() since the last Reduce.
  Result<double> LocalSumSquares(CpuOptimizer* optimizer);
  // Waits until every gradient added onto an earlier one (in the accumulation thread) is in
  // its accumulator. The streams' part must be done first (DeviceBudget::ReclaimScratch).
  void Drain() { adder_->Drain(); }

  bool reduced_this_micro() const { return reduced_this_micro_; }
  bool reduced(ParamId id) const { return flags_[id].reduced_this_micro; }
  // The trainable parameter of sub-group `gi` not reduced yet in this micro-step ("" if none).
  std::string Unreduced(size_t gi) const;

  // ---- Optimizer thread (from a sub-group's WaitReady to its Release) ----
  // A sub-group ready to step: the board's verdict (GroupBoard::GroupReady) and where its
  // accumulators are: host memory, or device memory for a sub-group the device steps.
  struct ReadyGroup : GroupBoard::GroupReady {
    const float* grads = nullptr;  // the sub-group's accumulators, laid out as its partitions
    bool on_device = false;
  };
  // Waits until sub-group `gi` is ready for `task` (GroupBoard::WaitGroupReady, `speculate`
  // as there). Without clipping a host sub-group is handed over once all but a last gradient
  // landing piece by piece are in (`partial`; WaitLanded follows).
  Result<ReadyGroup> WaitReady(size_t gi, const OptimizerTask& task, bool speculate);
  // After a partial ReadyGroup: waits until `upto` elements of its landing parameter are in
  // (SIZE_MAX: the whole group).
  Status WaitLanded(size_t gi, int64_t step, size_t upto) {
    return ctx_.board->WaitLanded(gi, step, upto);
  }
  // Parameter `id`'s accumulator (its partition), from its sub-group's WaitReady to its
  // Release.
  float* Acc(ParamId id) const;
  // The optimizer is done with sub-group `gi` for `step` (stepped, or failed and left as it
  // was): streaming accumulators go back to their pool, and the trainer may put the next
  // window's gradients in.
  void Release(size_t gi, int64_t step);

 private:
  struct Flags {
    bool reduced_this_micro = false;
    bool seen_this_window = false;
  };
  struct Group {
    PinnedBuffer grads;      // not streaming
    PooledBlock block;       // streaming
    float* data = nullptr;   // either, or device memory (on_device)
    bool on_device = false;  // stepped on the device: accumulated in device memory
  };
  // Streaming: gives sub-group `gi` its accumulators, waiting (bounded) for the optimizer to
  // free a block when all are taken. No-op when it has them.
  Status EnsureBuffer(size_t gi);
  // Streaming: gives back the accumulators of a stepped sub-group.
  void ReleaseBuffer(size_t gi);
  void MarkReduced(ParamId id, int64_t ready);
  // Once the gradient stream has copied `p`'s gradient into its accumulator: the scratch goes
  // back and the gradient lands (a host function that only frees and lands).
  Status LandAfterCopy(const ParamLayout& p, void* scratch, size_t scratch_bytes, int64_t ready);

  // One gradient's way into its accumulator (Reduce), chosen once: the routes below.
  struct ReduceJob {
    ParamId id = 0;
    const ParamLayout* p = nullptr;
    size_t gi = 0;
    int64_t ready = 0;
    bool on_device = false;       // accumulated in device memory (a sub-group the device steps)
    bool bf16 = false;            // rounded to bf16 for the link (zinf.gradient_transfer_dtype)
    bool one_rank_first = false;  // one rank, first gradient of the window: no reduction
    bool first = false;           // the first gradient of the window: copied, not added
    size_t n = 0;                 // values that cross the link
    size_t link_bytes = 0;
    void* scratch = nullptr;  // device scratch (all but the inline route)
    size_t scratch_bytes = 0;
  };
  // Route 1: one rank's first gradient straight into its accumulator on the compute stream
  // (device accumulators, or the host device's inline stream without bf16).
  Status ReduceInline(const ReduceJob& job, const float* grad);
  // Into device scratch, what crosses the link once the gradient stream reaches it: one
  // rank's first gradient copied (or rounded), else the reduce-scatter's partition (rounded
  // with bf16). *out: where it is.
  Status StageForLink(const ReduceJob& job, const float* grad, const void** out);
  // This rank's partition of the sum over ranks of `full` into `mine`, on the comm stream: the
  // communicator's reduce-scatter, or zero_quantized_gradients' all-to-all of int8 (or int4)
  // blocks.
  Status ReduceScatter(const ReduceJob& job, float* full, float* mine);
  // zero_quantized_gradients in two hops (hpZ's nodes known): inside the node, then across.
  Status ReduceScatterTwoHops(const ReduceJob& job, float* full, float* mine);
  // zero_quantized_gradients' blocks (int8, or int4 by zinf.quantized_gradient_bits) on the
  // comm stream.
  Status Encode(void* dst, const float* src, size_t n);
  Status Decode(float* dst, const void* src, size_t n);
  // Route 2: a device accumulator: the partition copied (first) or added, on the gradient stream.
  Status AccumulateOnDevice(const ReduceJob& job, const void* out, float* acc);
  // Route 3: the first fp32 gradient copied straight into its host accumulator.
  Status CopyToAccumulator(const ReduceJob& job, const void* out, float* acc);
  // Routes 4 and 5: into pinned memory that the adder thread widens (a first bf16 gradient,
  // in the first half of its own accumulator) or adds (a later micro-step, through staging).
  Status StageForAdder(const ReduceJob& job, const void* out, float* acc);
  // A failure once the scratch is taken: no landing callback will free it, so once the
  // streams that may still use it are done it goes back here (when waiting fails it stays
  // allocated; the error stops the engine anyway). Returns s.
  Status ReleaseScratch(const ReduceJob& job, const Status& s);

  const EngineContext ctx_;  // the layout, config, device, streams and shared objects
  FetchScheduler* const fetch_;
  GradientAdder* const adder_;
  BlockPool* const grad_pool_;
  const bool streaming_;
  std::unique_ptr<Event> compute_done_;
  std::unique_ptr<Event> comm_done_;
  // The padding source for gradient scratch: page-aligned, page-padded and registered with
  // the device (Init), so that its copies are from pinned memory, as every other host copy.
  float* zeros_ = nullptr;
  size_t zeros_bytes_ = 0;
  bool zeros_registered_ = false;
  std::vector<Flags> flags_;  // trainer thread only
  std::vector<Group> groups_;
  bool reduced_this_micro_ = false;  // trainer thread only
};

}  // namespace zinf
