// fp16 loss scaling with DeepSpeed's meaning (its "fp16" block): the trainer multiplies the
// loss by scale() before the backward, the optimizer divides the gradients by it, and a step
// whose gradients hold an inf or NaN on any rank is skipped (nothing of it is applied) and
// Update(true) lowers the scale. Dynamic (loss_scale 0): the scale starts at
// 2^initial_scale_power; an overflow halves it once `hysteresis` overflows have been taken
// (each overflow before that uses one up), never below min_loss_scale; on the step after
// `loss_scale_window` steps without overflow (since the last one or the start, and after every
// window more) it doubles, and the hysteresis is whole again (after every step without
// overflow with consecutive_hysteresis), as DeepSpeed from 0.17.1 (before, one step earlier).
// Static (loss_scale > 0): the scale never changes and an overflowing step is still skipped. An
// overflow at min_loss_scale fails the step (DeepSpeed raises there too): the gradients overflow
// however small the scale, and skipping would skip every step from then on.
#pragma once

#include <cstdint>

#include "formats/checkpoint_format.h"
#include "zinf/config.h"
#include "zinf/status.h"

namespace zinf {

struct LossScaleSettings {
  double static_scale = 0;  // > 0: a static scale; 0: dynamic
  int initial_scale_power = 16;
  uint64_t window = 1000;
  int hysteresis = 2;
  bool consecutive_hysteresis = false;
  double min_scale = 1;
};

// The verdict of a window's global gradient norm `norm`, taken over the gradients as they were
// accumulated (multiplied by the loss scale `scale` with fp16; scale 1 otherwise), with
// gradient clipping at `clip` (0: off).
struct NormVerdict {
  bool finite = true;  // false: a gradient overflowed (fp16: the step is skipped)
  double norm = 0;     // the norm of the unscaled gradients (norm / scale)
  // What the optimizer multiplies the accumulated gradients by: min(1, clip / (norm + 1e-6))
  // / scale, as DeepSpeed unscales and clips in one factor.
  float coef = 1.0f;
};
NormVerdict StepCoefficient(double norm, double clip, double scale);

// The settings of a config's "fp16" block.
LossScaleSettings LossScaleSettingsOf(const Fp16Config& fp16);

class LossScaler {
 public:
  // What a checkpoint or a durable commit keeps of it.
  struct State {
    double scale = 1;
    uint64_t iteration = 0;      // Update calls so far
    int64_t last_overflow = -1;  // the iteration of the last overflow; -1: none
    int hysteresis_left = 1;     // overflows still taken before the scale halves
    uint64_t skipped_steps = 0;  // overflowing steps skipped so far
  };

  explicit LossScaler(const LossScaleSettings& settings);

  double scale() const { return state_.scale; }
  uint64_t skipped_steps() const { return state_.skipped_steps; }
  bool dynamic() const { return settings_.static_scale <= 0; }

  // After each optimizer step's overflow check (`overflow`: some gradient of some rank was
  // inf or NaN, and the step was skipped). FailedPrecondition when a dynamic scale that is
  // already at min_scale overflows (the state is unchanged then).
  Status Update(bool overflow);

  const State& state() const { return state_; }
  // A state saved by an engine (InvalidArgument naming the field when it cannot be one: a
  // scale not finite or not positive, hysteresis_left below 1, an overflow not before the
  // iteration). Settings changed since: a static scale stays the config's; a hysteresis_left
  // above this hysteresis is lowered to it.
  Status Restore(const State& state);

 private:
  LossScaleSettings settings_;
  State state_;
};

// A state as checkpoints and durable commits record it, and back.
CheckpointLossScale RecordOf(const LossScaler::State& state);
LossScaler::State ScalerStateOf(const CheckpointLossScale& record);

}  // namespace zinf
