// Each parameter partition's home on its tier (device memory, pinned host memory or an NVMe
// swap key), in storage dtype. With the delayed update every home has two buffers: version v
// of the parameters lives in buffer Buf(v), so the optimizer writes step s's parameters while
// the trainer reads s - 1's. A frozen parameter's home has one buffer, whatever the version:
// its value never changes (only SetParameterValues or a load of other values replace it).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/core/device_budget.h"
#include "engine/core/engine_context.h"
#include "engine/core/layout.h"
#include "engine/core/stats_recorder.h"
#include "zinf/config.h"
#include "zinf/device.h"
#include "zinf/swap.h"

namespace zinf {

class ParamStore {
 public:
  // Device copies on the context's copy stream (initialisation) and update stream (the
  // optimizer's writes); host homes from its arena, NVMe homes in its swap store.
  explicit ParamStore(const EngineContext& ctx);
  ~ParamStore();
  ParamStore(const ParamStore&) = delete;
  ParamStore& operator=(const ParamStore&) = delete;

  // The parameter store buffer that holds version v.
  int Buf(int64_t version) const { return delayed_ ? static_cast<int>(version & 1) : 0; }

  // Where a resume finds the parameter stores (ResumeFromStore of a durable store).
  struct Resume {
    bool active = false;
    bool stored_params = false;  // the commit holds NVMe parameter stores in this dtype
    int64_t step = 0, visible = 0;
  };
  // Stores `image` (this rank's partition in storage dtype, pinned) as parameter `id`'s value
  // at version 0, or at a resume the masters' version (skipped when the store holds it).
  Status Init(ParamId id, PinnedBuffer image, const Resume& resume);

  // Writes sub-group `gi`'s parameters (from the masters, or their storage-dtype copy) into
  // buffer `buf`. With `writes` (the optimizer's pipeline) the NVMe writes' tickets go there
  // and device copies are left in flight on the update stream; without, it returns when
  // everything is written.
  // `written` (optional, by index in the group): parameters already written (WritePiece)
  // are skipped.
  Status WriteGroup(size_t gi, const float* master, const uint16_t* copy_out, int buf,
                    std::vector<Ticket>* writes, const std::vector<uint8_t>* written = nullptr);
  // Device tier: copies elements [begin, end) of parameter `id`'s partition, from its whole
  // partition at `src` (storage dtype), into buffer `buf`, left in flight on the update stream
  // (the optimizer synchronizes it before `src` changes and at the step's end).
  Status WritePiece(ParamId id, const void* src, size_t begin, size_t end, int buf);

  // ResumeFromStore: whether the store holds frozen parameter `id`'s committed copy (NVMe
  // parameters committed in this dtype, of its size); Init then keeps it (give no image).
  bool HoldsCommitted(ParamId id, const Resume& resume) const;
  // A frozen parameter's partition (storage dtype) into `out` (host, PartBytes, 4 KiB
  // aligned with room for the NVMe read's rounding), or from `src` into its store.
  Status ReadFrozen(ParamId id, void* out, size_t capacity);
  Status WriteFrozen(ParamId id, const void* src, size_t capacity);
  // xxh3-64 of a frozen parameter's whole value as stored (Engine::Impl::ValueHash, as
  // registered or last set): what a checkpoint or the durable store records instead of the
  // values. 0 for trainable ones.
  void set_value_hash(ParamId id, uint64_t h) { hashes_[id] = h; }
  const std::vector<uint64_t>& value_hashes() const { return hashes_; }

  void* device_part(ParamId id, int buf) const { return homes_[id].device_part[B(id, buf)]; }
  // offload_states: the device-tier partitions (kept).
  void DeviceSlots(std::vector<DeviceSlot>* out);
  const void* host_part(ParamId id, int buf) const {
    return homes_[id].host_part[B(id, buf)].data();
  }
  const std::string& swap_key(ParamId id, int buf) const { return homes_[id].swap_key[B(id, buf)]; }

 private:
  // The buffer of `id` that holds what buffer `buf` holds for trainable parameters.
  int B(ParamId id, int buf) const { return ctx_.layout->param(id).info.trainable ? buf : 0; }
  struct Home {
    void* device_part[2] = {nullptr, nullptr};  // Tier::kDevice
    PinnedBuffer host_part[2];                  // Tier::kCpu
    std::string swap_key[2];                    // Tier::kNvme
  };
  const EngineContext ctx_;  // the layout, config, device, streams and shared objects
  const bool delayed_;
  std::vector<Home> homes_;
  std::vector<uint64_t> hashes_;
};

}  // namespace zinf
