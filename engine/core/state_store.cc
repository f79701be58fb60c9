#include "engine/core/state_store.h"

#include <cstring>

namespace zinf {

StateStore::StateStore(const EngineContext& ctx, BlockPool* state_pool)
    : ctx_(ctx),
      state_pool_(state_pool),
      groups_(ctx.layout->num_groups()),
      updates_(ctx.layout->num_params(), 0) {}

StateStore::~StateStore() {
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    if (groups_[gi].device_states != nullptr) {
      ctx_.budget->Free(groups_[gi].device_states, ctx_.layout->GroupStateBytes(gi));
    }
  }
}

void StateStore::DeviceSlots(std::vector<DeviceSlot>* out) {
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    if (groups_[gi].device_states == nullptr) continue;
    float** slot = &groups_[gi].device_states;
    out->push_back({ctx_.layout->GroupStateBytes(gi), true,
                    "the optimizer states of sub-group " + std::to_string(gi),
                    [slot] { return static_cast<void*>(*slot); },
                    [slot](void* p) { *slot = static_cast<float*>(p); }});
  }
}

Status StateStore::Allocate(size_t gi, float** master, PooledBlock* staging) {
  Group& g = groups_[gi];
  const size_t bytes = ctx_.layout->GroupStateBytes(gi);
  if (ctx_.layout->group(gi).on_device) {
    ZINF_ASSIGN_OR_RETURN(void* d, ctx_.budget->Alloc(bytes, "optimizer states"));
    ctx_.budget->Plan(bytes);
    g.device_states = static_cast<float*>(d);
    if (ctx_.device->IsHost()) {
      *master = g.device_states;
    } else {  // initialised on the host, then copied
      ZINF_ASSIGN_OR_RETURN(*staging, state_pool_->Take());
      *master = static_cast<float*>(staging->data());
    }
  } else if (ctx_.config->offload_optimizer.tier == Tier::kNvme) {
    ZINF_ASSIGN_OR_RETURN(*staging, state_pool_->Take());
    *master = static_cast<float*>(staging->data());
    g.swap_key = "opt/" + std::to_string(gi);
  } else {
    // Whole floats: the masters, then states of 2 or 4 bytes per element, or int8 blocks of
    // 260 bytes.
    ZINF_RETURN_IF_ERROR(
        g.host.Allocate(ctx_.layout->GroupStateBytes(gi) / sizeof(float), "optimizer states"));
    *master = g.host.data;
  }
  return Status::OK();
}

Status StateStore::ReadCommitted(size_t gi, float* master, size_t capacity) {
  const Group& g = groups_[gi];
  Result<uint64_t> size = ctx_.swap->Size(g.swap_key);
  if (!size.ok() || *size != ctx_.layout->GroupStateBytes(gi)) {
    return Status::FailedPrecondition("ResumeFromStore: the store's optimizer states '" +
                                      g.swap_key + "' do not match this model's sub-group " +
                                      std::to_string(gi));
  }
  ZINF_ASSIGN_OR_RETURN(Ticket t, ctx_.swap->Read(g.swap_key, master, capacity));
  return ctx_.swap->Wait(t).WithContext("ResumeFromStore");
}

Status StateStore::Publish(size_t gi, const float* master, size_t capacity) {
  const Group& g = groups_[gi];
  const size_t bytes = ctx_.layout->GroupStateBytes(gi);
  if (!g.swap_key.empty()) {
    ZINF_ASSIGN_OR_RETURN(Ticket t, ctx_.swap->Write(g.swap_key, master, bytes, capacity));
    ZINF_RETURN_IF_ERROR(ctx_.swap->Wait(t));
  }
  if (g.device_states != nullptr && !ctx_.device->IsHost()) {
    ZINF_RETURN_IF_ERROR(
        ctx_.device->CopyHostToDevice(g.device_states, master, bytes, ctx_.streams.copy));
    ZINF_RETURN_IF_ERROR(ctx_.device->SynchronizeStream(ctx_.streams.copy));
  }
  return Status::OK();
}

Status StateStore::Read(size_t gi, void* buf) {
  const Group& g = groups_[gi];
  const size_t bytes = ctx_.layout->GroupStateBytes(gi);
  if (!g.swap_key.empty()) {
    ZINF_ASSIGN_OR_RETURN(Ticket t, ctx_.swap->Read(g.swap_key, buf, RoundUp(bytes, 4096)));
    return ctx_.swap->Wait(t);
  }
  if (g.device_states != nullptr) {
    ZINF_RETURN_IF_ERROR(
        ctx_.device->CopyDeviceToHost(buf, g.device_states, bytes, ctx_.streams.update));
    return ctx_.device->SynchronizeStream(ctx_.streams.update);
  }
  if (g.host.data == nullptr) {
    // A device sub-group whose states an offload_states that failed part-way had moved.
    return Status::FailedPrecondition("the optimizer states of sub-group " + std::to_string(gi) +
                                      " are gone (offload_states failed part-way); recreate "
                                      "the engine from a checkpoint");
  }
  std::memcpy(buf, g.host.data, bytes);
  return Status::OK();
}

Status StateStore::Write(size_t gi, const void* buf) {
  Group& g = groups_[gi];
  const size_t bytes = ctx_.layout->GroupStateBytes(gi);
  if (!g.swap_key.empty()) {
    ZINF_ASSIGN_OR_RETURN(Ticket t, ctx_.swap->Write(g.swap_key, buf, bytes, RoundUp(bytes, 4096)));
    return ctx_.swap->Wait(t);
  }
  if (g.device_states != nullptr) {
    ZINF_RETURN_IF_ERROR(
        ctx_.device->CopyHostToDevice(g.device_states, buf, bytes, ctx_.streams.update));
    return ctx_.device->SynchronizeStream(ctx_.streams.update);
  }
  std::memcpy(g.host.data, buf, bytes);
  return Status::OK();
}

}  // namespace zinf
