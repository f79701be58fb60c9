#include "engine/core/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace zinf {

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
  if (state.hysteresis_left < 1 || state.hysteresis_left > std::max(settings_.hysteresis, 1)) {
    return Status::InvalidArgument("loss scaler state: hysteresis_left " +
                                   std::to_string(state.hysteresis_left) + " outside [1, " +
                                   std::to_string(std::max(settings_.hysteresis, 1)) + "]");
  }
  if (state.last_overflow >= static_cast<int64_t>(state.iteration)) {
    return Status::InvalidArgument("loss scaler state: last_overflow " +
                                   std::to_string(state.last_overflow) + " not before iteration " +
                                   std::to_string(state.iteration));
  }
  state_ = state;
  return Status::OK();
}

}  // namespace zinf
