#include "engine/core/state_store.h"

#include <cstring>

namespace zinf {

StateStore::StateStore(const EngineContext& ctx, BlockPool* state_pool)
    : layout_(ctx.layout),
      config_(ctx.config),
      device_(ctx.device),
      budget_(ctx.budget),
      copy_stream_(ctx.streams.copy),
      update_stream_(ctx.streams.update),
      swap_(ctx.swap),
      state_pool_(state_pool),
      groups_(ctx.layout->num_groups()),
      updates_(ctx.layout->num_params(), 0) {}

StateStore::~StateStore() {
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    if (groups_[gi].device_states != nullptr) {
      budget_->Free(groups_[gi].device_states, layout_->GroupStateBytes(gi));
    }
  }
}

Status StateStore::Allocate(size_t gi, float** master, PooledBlock* staging) {
  Group& g = groups_[gi];
  const size_t bytes = layout_->GroupStateBytes(gi);
  if (layout_->group(gi).on_device) {
    ZINF_ASSIGN_OR_RETURN(void* d, budget_->Alloc(bytes, "optimizer states"));
    budget_->Plan(bytes);
    g.device_states = static_cast<float*>(d);
    if (device_->IsHost()) {
      *master = g.device_states;
    } else {  // initialised on the host, then copied
      ZINF_ASSIGN_OR_RETURN(*staging, state_pool_->Take());
      *master = static_cast<float*>(staging->data());
    }
  } else if (config_->offload_optimizer.tier == Tier::kNvme) {
    ZINF_ASSIGN_OR_RETURN(*staging, state_pool_->Take());
    *master = static_cast<float*>(staging->data());
    g.swap_key = "opt/" + std::to_string(gi);
  } else {
    // Whole floats: the masters, then states of 2 or 4 bytes per element, or int8 blocks of
    // 260 bytes.
    ZINF_RETURN_IF_ERROR(
        g.host.Allocate(layout_->GroupStateBytes(gi) / sizeof(float), "optimizer states"));
    *master = g.host.data;
  }
  return Status::OK();
}

Status StateStore::ReadCommitted(size_t gi, float* master, size_t capacity) {
  const Group& g = groups_[gi];
  Result<uint64_t> size = swap_->Size(g.swap_key);
  if (!size.ok() || *size != layout_->GroupStateBytes(gi)) {
    return Status::FailedPrecondition("ResumeFromStore: the store's optimizer states '" +
                                      g.swap_key + "' do not match this model's sub-group " +
                                      std::to_string(gi));
  }
  ZINF_ASSIGN_OR_RETURN(Ticket t, swap_->Read(g.swap_key, master, capacity));
  return swap_->Wait(t).WithContext("ResumeFromStore");
}

Status StateStore::Publish(size_t gi, const float* master, size_t capacity) {
  const Group& g = groups_[gi];
  const size_t bytes = layout_->GroupStateBytes(gi);
  if (!g.swap_key.empty()) {
    ZINF_ASSIGN_OR_RETURN(Ticket t, swap_->Write(g.swap_key, master, bytes, capacity));
    ZINF_RETURN_IF_ERROR(swap_->Wait(t));
  }
  if (g.device_states != nullptr && !device_->IsHost()) {
    ZINF_RETURN_IF_ERROR(device_->CopyHostToDevice(g.device_states, master, bytes, copy_stream_));
    ZINF_RETURN_IF_ERROR(device_->SynchronizeStream(copy_stream_));
  }
  return Status::OK();
}

Status StateStore::Read(size_t gi, void* buf) {
  const Group& g = groups_[gi];
  const size_t bytes = layout_->GroupStateBytes(gi);
  if (!g.swap_key.empty()) {
    ZINF_ASSIGN_OR_RETURN(Ticket t, swap_->Read(g.swap_key, buf, RoundUp(bytes, 4096)));
    return swap_->Wait(t);
  }
  if (g.device_states != nullptr) {
    ZINF_RETURN_IF_ERROR(device_->CopyDeviceToHost(buf, g.device_states, bytes, update_stream_));
    return device_->SynchronizeStream(update_stream_);
  }
  std::memcpy(buf, g.host.data, bytes);
  return Status::OK();
}

Status StateStore::Write(size_t gi, const void* buf) {
  Group& g = groups_[gi];
  const size_t bytes = layout_->GroupStateBytes(gi);
  if (!g.swap_key.empty()) {
    ZINF_ASSIGN_OR_RETURN(Ticket t, swap_->Write(g.swap_key, buf, bytes, RoundUp(bytes, 4096)));
    return swap_->Wait(t);
  }
  if (g.device_states != nullptr) {
    ZINF_RETURN_IF_ERROR(device_->CopyHostToDevice(g.device_states, buf, bytes, update_stream_));
    return device_->SynchronizeStream(update_stream_);
  }
  std::memcpy(g.host.data, buf, bytes);
  return Status::OK();
}

}  // namespace zinf
