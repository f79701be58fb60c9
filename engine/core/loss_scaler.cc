#include "engine/core/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace zinf {

LossScaleSettings LossScaleSettingsOf(const Fp16Config& fp16) {
  LossScaleSettings s;
  s.static_scale = fp16.loss_scale;
  s.initial_scale_power = fp16.initial_scale_power;
  s.window = fp16.loss_scale_window;
  s.hysteresis = fp16.hysteresis;
  s.consecutive_hysteresis = fp16.consecutive_hysteresis;
  s.min_scale = fp16.min_loss_scale;
  return s;
}

LossScaler::LossScaler(const LossScaleSettings& settings) : settings_(settings) {
  state_.scale =
      dynamic() ? std::ldexp(1.0, settings_.initial_scale_power) : settings_.static_scale;
  state_.hysteresis_left = std::max(settings_.hysteresis, 1);
}

Status LossScaler::Update(bool overflow) {
  if (overflow && dynamic() && state_.hysteresis_left <= 1 && state_.scale == settings_.min_scale) {
    return Status::FailedPrecondition(
        "the gradients hold inf or NaN at the smallest loss scale (" +
        std::to_string(settings_.min_scale) +
        ", fp16.min_loss_scale): the model overflows fp16 however small the scale; lower the "
        "learning rate, check the data, or train in bf16");
  }
  if (overflow) {
    ++state_.skipped_steps;
    if (dynamic()) {
      if (state_.hysteresis_left <= 1) {
        state_.scale = std::max(state_.scale / 2, settings_.min_scale);
      } else {
        --state_.hysteresis_left;
      }
      state_.last_overflow = static_cast<int64_t>(state_.iteration);
    }
  } else if (dynamic()) {
    if (settings_.consecutive_hysteresis)
      state_.hysteresis_left = std::max(settings_.hysteresis, 1);
    // Clean steps before this one since the last overflow (or the start): the scale doubles
    // on the step after each whole window of them (DeepSpeed from 0.17.1; before, one step
    // earlier, and right after an overflow with a window of 1).
    const int64_t stable = static_cast<int64_t>(state_.iteration) - state_.last_overflow - 1;
    if (stable > 0 && stable % static_cast<int64_t>(settings_.window) == 0) {
      if (!settings_.consecutive_hysteresis) {
        state_.hysteresis_left = std::max(settings_.hysteresis, 1);
      }
      state_.scale *= 2;
    }
  }
  ++state_.iteration;
  return Status::OK();
}

Status LossScaler::Restore(const State& state) {
  if (!std::isfinite(state.scale) || state.scale <= 0) {
    return Status::InvalidArgument("loss scaler state: scale " + std::to_string(state.scale) +
                                   " is not a positive finite number");
  }
  if (state.hysteresis_left < 1) {
    return Status::InvalidArgument("loss scaler state: hysteresis_left " +
                                   std::to_string(state.hysteresis_left) + " is below 1");
  }
  if (state.last_overflow >= static_cast<int64_t>(state.iteration)) {
    return Status::InvalidArgument("loss scaler state: last_overflow " +
                                   std::to_string(state.last_overflow) + " not before iteration " +
                                   std::to_string(state.iteration));
  }
  state_ = state;
  // A static scale is the config's, whatever the saved run used (its counts go on); a
  // hysteresis lowered since is taken as the whole new one.
  if (!dynamic()) state_.scale = settings_.static_scale;
  state_.hysteresis_left = std::min(state_.hysteresis_left, std::max(settings_.hysteresis, 1));
  return Status::OK();
}

NormVerdict StepCoefficient(double norm, double clip, double scale) {
  NormVerdict v;
  v.finite = std::isfinite(norm);
  v.norm = norm / scale;
  if (!v.finite) return v;
  if (scale == 1.0) {
    // (Written so that without fp16 the coefficient is the one clipping always computed.)
    v.coef = clip > 0 && norm > clip ? static_cast<float>(clip / (norm + 1e-6)) : 1.0f;
    return v;
  }
  const double clipped = clip > 0 && v.norm > clip ? clip / (v.norm + 1e-6) : 1.0;
  v.coef = static_cast<float>(clipped / scale);
  return v;
}

CheckpointLossScale RecordOf(const LossScaler::State& state) {
  CheckpointLossScale l;
  l.scale = state.scale;
  l.iteration = state.iteration;
  l.last_overflow = state.last_overflow;
  l.hysteresis_left = state.hysteresis_left;
  l.skipped_steps = state.skipped_steps;
  return l;
}

LossScaler::State ScalerStateOf(const CheckpointLossScale& record) {
  LossScaler::State s;
  s.scale = record.scale;
  s.iteration = record.iteration;
  s.last_overflow = record.last_overflow;
  // (Beyond int's range is beyond the scaler's too: Restore refuses it.)
  s.hysteresis_left = static_cast<int>(std::clamp<int64_t>(record.hysteresis_left, -1, INT32_MAX));
  s.skipped_steps = record.skipped_steps;
  return s;
}

}  // namespace zinf
