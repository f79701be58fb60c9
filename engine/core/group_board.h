// The one monitor between the trainer's thread, the device's stream callbacks and the
// optimizer thread: per sub-group, the gradients still to land in the window and the steps
// they are ready for and stepped to; the optimizer's task queue, its progress and first
// failure; the clipping coefficients; the streaming accumulators' release count; shutdown.
// Every field is under one lock, and every wait is on its condition variable.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "common/thread_annotations.h"
#include "engine/core/layout.h"
#include "zinf/status.h"

namespace zinf {

// One optimizer step handed to the optimizer thread.
struct OptimizerTask {
  int64_t step = 0;
  // Its sub-groups wait for the global norm's verdict (SetClipCoef, SetSkipped or
  // SetNormFailed) before they are stepped for good: with clipping, and with fp16 (the norm
  // decides overflow).
  bool needs_norm = false;
  // Every parameter group's hyperparameters for this step (ParamSpec::param_group indexes it),
  // as they were when the step's micro-step started.
  std::vector<ParamGroupHyper> groups;
  // The coefficient the gradients are multiplied by when the norm neither clips nor overflows:
  // 1 / the loss scale the window's backward used (fp16), 1 otherwise. A speculative step
  // uses it.
  float unscale = 1.0f;
};

class GroupBoard {
 public:
  explicit GroupBoard(const Layout* layout);

  // ---- Trainer thread ----
  // A micro-step starts: every sub-group waits for its trainable parameters' gradients; at a
  // boundary, one with none is ready for step `step + 1` at once.
  void BeginMicroStep(bool boundary, int64_t step) EXCLUDES(mu_);
  void Push(const OptimizerTask& task) EXCLUDES(mu_);
  // Parameter `index` of sub-group `gi` has a gradient in the window being accumulated.
  void MarkHasGrad(size_t gi, size_t index) EXCLUDES(mu_);
  // Waits until the optimizer is done with sub-group `gi` for step `step` (its accumulators
  // are free); *waited gets the seconds spent.
  Status WaitStepped(size_t gi, int64_t step, double* waited) EXCLUDES(mu_);
  // Waits until every task up to `target` is done; returns the first optimizer failure.
  Status WaitDone(int64_t target) EXCLUDES(mu_);
  // The verdict of step `step`'s global norm (clipping on): its coefficient, or that the norm
  // could not be had (not finite, or its collective failed): the optimizer then rolls back
  // what it stepped speculatively and fails the task.
  void SetClipCoef(int64_t step, float coef) EXCLUDES(mu_);
  void SetNormFailed(int64_t step) EXCLUDES(mu_);
  // fp16: step `step`'s gradients overflowed (the norm is not finite), so the step is skipped:
  // every sub-group is stepped as if none of its parameters had a gradient (no state changes;
  // the parameter stores get the values they hold), and what was speculated is rolled back.
  void SetSkipped(int64_t step) EXCLUDES(mu_);
  // Whether SetNormFailed(step) was called (the task then steps nothing, and is not a failure
  // of the optimizer: the trainer's Step reports the norm's).
  bool NormFailed(int64_t step) const EXCLUDES(mu_);
  // After a resume or a load at `step`: nothing pending, everything stepped to it.
  void ResetTo(int64_t step) EXCLUDES(mu_);
  // Shutdown: with `drain_to` >= 0, first waits for the tasks up to it and returns the
  // failure nobody saw; then stops every waiter.
  Status Stop(int64_t drain_to) EXCLUDES(mu_);

  // ---- Any thread (stream callbacks, the trainer at Step) ----
  // One gradient of sub-group `gi` landed; `ready` > 0: the window ends with step `ready`;
  // kNotLast: a layer-major window's gradient before its parameter's last (nothing counted:
  // each parameter lands once per micro-step).
  static constexpr int64_t kNotLast = -1;
  void Land(size_t gi, int64_t ready) EXCLUDES(mu_);
  // The first `landed` elements of the partition of the group's parameter `index` are in its
  // accumulator, the rest still coming (its Land follows, unless the copy fails: the engine
  // then stops, and Stop ends the waits), in the window that ends with step `ready` > 0. Once it is
  // the group's only gradient still to land, the optimizer may step what has landed
  // (WaitGroupReady's `partial`, WaitLanded).
  void LandPiece(size_t gi, size_t index, size_t landed, int64_t ready) EXCLUDES(mu_);
  // A streaming accumulator block went back to its pool.
  void NoteGradRelease() EXCLUDES(mu_);
  // Streaming accumulators: calls `try_take` (under the lock) until it succeeds; fails when
  // none can come: the optimizer failed or stopped, has no task, or waits for a sub-group
  // whose gradient `unreduced(gi)` names (one the trainer has not reduced yet), or frees
  // none for `no_progress`.
  Status WaitForGradBlock(const std::function<bool()>& try_take,
                          const std::function<std::string(size_t)>& unreduced, uint64_t block_bytes,
                          std::chrono::seconds no_progress) EXCLUDES(mu_);

  // ---- Optimizer thread ----
  // The oldest task, waiting for one; false when stopping.
  bool NextTask(OptimizerTask* task) EXCLUDES(mu_);
  bool failed() const EXCLUDES(mu_);
  // What WaitGroupReady hands the optimizer: a sub-group ready to step.
  struct GroupReady {
    float coef = 1.0f;               // the clipping coefficient (1: no clipping, or not known yet)
    bool coef_known = true;          // false: the norm is not known yet (a speculative step)
    std::vector<uint8_t> with_grad;  // by index in the group: got a gradient in the window
    // >= 0: the index of the parameter still landing piece by piece (WaitLanded); -1: whole.
    int partial = -1;
  };
  // Waits until sub-group `gi` is ready for `task` and, with clipping, the norm is known, or
  // with `speculate` not (then coef_known is false and coef 1). Takes the group's has-grad
  // flags. Fails when the norm failed (SetNormFailed). With `allow_partial` (no clipping) it
  // also returns once every gradient of the group has landed but one that is landing piece by
  // piece (LandPiece), named by `partial`.
  Result<GroupReady> WaitGroupReady(size_t gi, const OptimizerTask& task, bool speculate,
                                    bool allow_partial) EXCLUDES(mu_);
  // After WaitGroupReady gave a partial group: waits until `upto` elements of the parameter
  // landing in pieces are there, or the whole group has landed.
  Status WaitLanded(size_t gi, int64_t step, size_t upto) EXCLUDES(mu_);
  // The verdict of a task that needs the norm: with `wait`, waits for it; without, *known says
  // whether it is there; *skipped whether the step is skipped (SetSkipped; *coef is then 1).
  // Fails when the norm failed or the board stops.
  Status Verdict(const OptimizerTask& task, bool wait, float* coef, bool* known, bool* skipped)
      EXCLUDES(mu_);
  void MarkStepped(size_t gi, int64_t step) EXCLUDES(mu_);
  // The task is done (`s`: its result); sub-groups it did not reach count as stepped.
  void FinishTask(int64_t step, const Status& s) EXCLUDES(mu_);

 private:
  struct Group {
    int pending = 0;  // trainable params whose gradient has not landed
    // Per parameter (index_in_group): whether it got a gradient in the window being
    // accumulated. Set by the trainer; taken (and cleared) by the optimizer when it steps the
    // group, before the next window's gradients may come in.
    std::vector<uint8_t> has_grad;
    // The step whose gradients are complete in the accumulators, and the last step the
    // optimizer has finished with this sub-group (its accumulators are free for the next
    // window's gradients from then on).
    int64_t ready_step = 0;
    int64_t stepped_step = 0;
    // The parameter (index) landing piece by piece as the group's last gradient, its elements
    // landed so far, and the step its window ends with (LandPiece); -1: none.
    int partial = -1;
    size_t partial_landed = 0;
    int64_t partial_step = 0;
  };

  const Layout* const layout_;
  mutable Mutex mu_;
  CondVar cv_;
  std::vector<Group> groups_ GUARDED_BY(mu_);
  std::deque<OptimizerTask> tasks_ GUARDED_BY(mu_);      // queued or running, oldest first
  int64_t done_step_ GUARDED_BY(mu_) = 0;                // the last task the optimizer finished
  Status optimizer_status_ GUARDED_BY(mu_);              // the first failure of any task (sticky)
  std::map<int64_t, float> clip_coefs_ GUARDED_BY(mu_);  // NaN: the norm failed
  std::set<int64_t> skipped_ GUARDED_BY(mu_);            // SetSkipped (in clip_coefs_ too)
  bool stopping_ GUARDED_BY(mu_) = false;
  uint64_t grad_releases_ GUARDED_BY(mu_) = 0;  // accumulator blocks freed so far (progress)
  // The sub-group whose gradients the optimizer waits for (SIZE_MAX: none), and for which
  // step.
  size_t waiting_group_ GUARDED_BY(mu_) = SIZE_MAX;
  int64_t waiting_step_ GUARDED_BY(mu_) = 0;
};

}  // namespace zinf
