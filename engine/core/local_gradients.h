// ZeRO stages 0 and 1 with gradient accumulation: each trainable parameter's gradient summed
// over the window's micro-steps on its own rank, in a whole-parameter fp32 buffer of device
// memory (DeepSpeed's stage 1 keeps its gradients whole the same way), then reduced once, at
// the window's end, instead of once per micro-step. Trainer thread only; the copies and sums
// run on the compute stream, so they are ordered with the trainer's own work on its
// gradients, and a sum handed to the gradient window is read there in that order too.
#pragma once

#include <vector>

#include "engine/core/engine_context.h"
#include "zinf/status.h"

namespace zinf {

class LocalGradients {
 public:
  explicit LocalGradients(const EngineContext& ctx) : ctx_(ctx) {}
  ~LocalGradients();  // the buffers go back to the budget (the engine synchronised the streams)
  LocalGradients(const LocalGradients&) = delete;
  LocalGradients& operator=(const LocalGradients&) = delete;

  // Every trainable parameter's buffer, planned in the device budget for the engine's life.
  Status Init();
  // `grad` (device memory, the parameter's numel fp32) into id's sum: copied when it is the
  // window's first, added otherwise.
  Status Add(ParamId id, const float* grad);
  // Whether id's sum holds a gradient of this window, and the sum (device memory).
  bool holds(ParamId id) const { return slots_[id].holds; }
  const float* sum(ParamId id) const { return slots_[id].data; }
  // Whether id's gradient was added in this micro-step.
  bool added(ParamId id) const { return slots_[id].added_this_micro; }
  // The sum was handed on (reduced): the next window starts it again.
  void Clear(ParamId id) { slots_[id].holds = false; }
  void BeginMicroStep();
  // offload_states: the sums (freed: empty between steps).
  void DeviceSlots(std::vector<DeviceSlot>* out);

 private:
  struct Slot {
    float* data = nullptr;
    bool holds = false;
    bool added_this_micro = false;
  };
  const EngineContext ctx_;
  std::vector<Slot> slots_;
};

}  // namespace zinf
