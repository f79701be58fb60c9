// Where training is, as the trainer thread sees it: optimizer steps taken, micro-batches taken,
// the parameter version the micro-steps read, and the current micro-step's place in its
// accumulation window. Which steps run delayed is a pure function of the configuration
// (DelayedStep), which the optimizer thread shares. Trainer thread only; pure.
#pragma once

#include <algorithm>
#include <cstdint>

#include "zinf/config.h"

namespace zinf {

class StepClock {
 public:
  explicit StepClock(const EngineConfig& config)
      : config_(config),
        accum_(std::max(1, config.gradient_accumulation_steps)),
        span_(config.layer_major ? accum_ : 1) {}

  // Whether the optimizer step of window s runs delayed (zinf.delayed_update, after the first
  // zinf.delayed_update_after steps): the trainer computes window s + 1 on the parameters of
  // step s - 1 while it runs. Undelayed steps use the two parameter buffers too.
  static bool DelayedStep(const EngineConfig& config, int64_t s) {
    return config.delayed_update && s > static_cast<int64_t>(config.delayed_update_after);
  }
  bool DelayedStep(int64_t s) const { return DelayedStep(config_, s); }
  bool delayed() const { return config_.delayed_update; }

  int64_t step() const { return step_; }    // optimizer steps taken
  int64_t micro() const { return micro_; }  // micro-batches taken
  // The micro-batches one Step covers: the window's (zinf.schedule layer-major), else 1.
  int span() const { return span_; }
  // The window position of the micro-step's first micro-batch.
  int window_position() const { return static_cast<int>(micro_ % accum_); }
  int64_t visible() const { return visible_; }  // the parameter version micro-steps read
  bool boundary() const { return boundary_; }   // this micro-step ends a window
  bool in_micro() const { return in_micro_; }   // it has started (its first call came)
  // Between optimizer steps: no micro-step started, none of a window taken.
  bool BetweenSteps() const { return !in_micro_ && micro_ % accum_ == 0; }

  // The next micro-step is prepared (after Step, at placement): whether it ends a window. Its
  // optimizer task is due until TakeTask.
  bool PrepareMicroStep() {
    boundary_ = (micro_ + span_) % accum_ == 0;
    task_due_ = boundary_;
    return boundary_;
  }
  // The micro-step's first call: it has started. True once per boundary micro-step: its
  // optimizer task is to be handed over now.
  bool StartMicroStep() {
    in_micro_ = true;
    const bool due = task_due_;
    task_due_ = false;
    return due;
  }
  // A window's optimizer step is taken: the parameters micro-steps read from now on (the
  // previous step's with the delayed update).
  void AdvanceStep() {
    ++step_;
    visible_ = DelayedStep(step_) ? std::max(visible_, step_ - 1) : step_;
  }
  // The micro-step ended (Step returned).
  void EndMicroStep() {
    micro_ += span_;
    in_micro_ = false;
  }
  // The running (delayed) step's parameters are the ones read from now on.
  void MakeVisible() { visible_ = step_; }
  // A resume or a checkpoint load: at `step`, reading version `visible`.
  void Reset(int64_t step, int64_t visible) {
    step_ = step;
    visible_ = visible;
    micro_ = step * accum_;
  }

 private:
  const EngineConfig& config_;
  const int accum_;
  const int span_;  // micro-batches per Step
  int64_t step_ = 0;
  int64_t micro_ = 0;
  int64_t visible_ = 0;
  bool boundary_ = false;
  bool task_due_ = false;
  bool in_micro_ = false;
};

}  // namespace zinf
