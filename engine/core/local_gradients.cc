#include "engine/core/local_gradients.h"

namespace zinf {

LocalGradients::~LocalGradients() {
  for (ParamId id = 0; id < slots_.size(); ++id) {
    if (slots_[id].data == nullptr) continue;
    const size_t bytes = ctx_.layout->param(id).info.numel * sizeof(float);
    ctx_.budget->Free(slots_[id].data, bytes);
    ctx_.budget->Unplan(bytes);
  }
}

Status LocalGradients::Init() {
  slots_.resize(ctx_.layout->num_params());
  for (ParamId id = 0; id < slots_.size(); ++id) {
    const ParamLayout& p = ctx_.layout->param(id);
    if (!p.info.trainable) continue;
    const size_t bytes = p.info.numel * sizeof(float);
    ZINF_ASSIGN_OR_RETURN(
        void* data,
        ctx_.budget->Alloc(
            bytes, "the summed gradient of '" + p.info.name + "' (zero_optimization.stage " +
                       std::to_string(ctx_.config->zero_stage) + " with gradient accumulation)"));
    ctx_.budget->Plan(bytes);
    slots_[id].data = static_cast<float*>(data);
  }
  return Status::OK();
}

Status LocalGradients::Add(ParamId id, const float* grad) {
  Slot& s = slots_[id];
  const size_t n = ctx_.layout->param(id).info.numel;
  Stream* compute = ctx_.device->ComputeStream();
  ZINF_RETURN_IF_ERROR(
      s.holds ? ctx_.device->AddInto(s.data, grad, n, compute)
              : ctx_.device->CopyDeviceToDevice(s.data, grad, n * sizeof(float), compute));
  s.holds = true;
  s.added_this_micro = true;
  return Status::OK();
}

void LocalGradients::DeviceSlots(std::vector<DeviceSlot>* out) {
  for (ParamId id = 0; id < slots_.size(); ++id) {
    if (slots_[id].data == nullptr) continue;
    float** slot = &slots_[id].data;
    out->push_back({ctx_.layout->param(id).info.numel * sizeof(float), false,
                    "the summed gradient of '" + ctx_.layout->param(id).info.name + "'",
                    [slot] { return static_cast<void*>(*slot); },
                    [slot](void* p) { *slot = static_cast<float*>(p); }});
  }
}

void LocalGradients::BeginMicroStep() {
  for (Slot& s : slots_) s.added_this_micro = false;
}

}  // namespace zinf
