// Optimizer states per sub-group ([master | state 1 | state 2]: fp32 masters, then the states
// in zinf.optimizer_state_dtype, see Layout::GroupStateBytes) on their tier: a
// host mapping (cpu), device memory (kept on the device), or one NVMe swap key; and each
// parameter's update count (torch's state["step"]).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/core/device_budget.h"
#include "engine/core/engine_context.h"
#include "engine/core/host_memory.h"
#include "engine/core/layout.h"
#include "zinf/config.h"
#include "zinf/device.h"
#include "zinf/swap.h"

namespace zinf {

class StateStore {
 public:
  // NVMe states in the context's swap store; staging blocks from `state_pool`; device copies
  // on its copy and update streams.
  StateStore(const EngineContext& ctx, BlockPool* state_pool);
  ~StateStore();
  StateStore(const StateStore&) = delete;
  StateStore& operator=(const StateStore&) = delete;

  // Allocates sub-group `gi`'s states on their tier. *master gets host memory holding
  // [master | m | v] to initialise: the states themselves (cpu; device on a host device), or
  // a staging block (`staging`) that Publish writes to their tier.
  Status Allocate(size_t gi, float** master, PooledBlock* staging);
  // ResumeFromStore: reads the committed states of `gi` into `master` (its staging block).
  Status ReadCommitted(size_t gi, float* master, size_t capacity);
  // Writes the initialised staging copy to the states' tier (NVMe, or a real device).
  Status Publish(size_t gi, const float* master, size_t capacity);

  // Copies sub-group `gi`'s [master | exp_avg | exp_avg_sq] into / out of `buf` (host).
  Status Read(size_t gi, void* buf);
  Status Write(size_t gi, const void* buf);

  bool on_nvme(size_t gi) const { return !groups_[gi].swap_key.empty(); }
  const std::string& swap_key(size_t gi) const { return groups_[gi].swap_key; }
  float* device_states(size_t gi) const { return groups_[gi].device_states; }
  // offload_states: the device-stepped sub-groups' [master | state 1 | state 2] (kept).
  void DeviceSlots(std::vector<DeviceSlot>* out);
  float* host_states(size_t gi) const { return groups_[gi].host.data; }
  // Where sub-group gi's states are stepped when they are not on NVMe.
  float* resident_states(size_t gi) const {
    return device_states(gi) != nullptr ? device_states(gi) : host_states(gi);
  }

  // Optimizer updates applied to parameter `id` so far: the optimizer thread changes it while
  // it steps the sub-group; others read it between optimizer steps.
  int64_t updates(ParamId id) const { return updates_[id]; }
  void set_updates(ParamId id, int64_t n) { updates_[id] = n; }
  void CountUpdate(ParamId id) { ++updates_[id]; }

 private:
  struct Group {
    HostArray host;                  // cpu tier: [master | exp_avg | exp_avg_sq], one mapping
    float* device_states = nullptr;  // kept on the device
    std::string swap_key;            // nvme tier: one tensor
  };
  const EngineContext ctx_;  // the layout, config, device, streams and shared objects
  BlockPool* const state_pool_;
  std::vector<Group> groups_;
  std::vector<int64_t> updates_;
};

}  // namespace zinf
