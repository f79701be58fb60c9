// The parameter layout: each parameter's partition per rank, the optimizer sub-groups and the
// slices of the parameters inside them. Built during registration, frozen at placement; pure
// (no device, no I/O), and read-only for every other component once frozen.
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "zinf/config.h"
#include "zinf/engine_types.h"

namespace zinf {

// Partition slices start at multiples of this many elements inside optimizer buffers, so that
// both their fp32 and bf16 images are 4 KiB aligned for direct I/O, and a slice's compressed
// states start on a whole int8 block.
constexpr size_t kSliceAlign = 2048;
static_assert(kSliceAlign % kInt8StateBlock == 0, "a slice's int8 states must start a block");
// Partitions are padded to a multiple of this many elements per rank.
constexpr size_t kPartitionAlign = 16;

struct ParamLayout {
  ParamInfo info;
  size_t padded_numel = 0;    // partition_numel * world
  size_t slice_offset = 0;    // element offset inside its sub-group's state arrays
  size_t index_in_group = 0;  // position in its sub-group's `params`
};

// hpZ (zero_hpz_partition_size K): stage 3 over several nodes of K ranks (1 < K < world). With
// K = world the node is the world: every gather stays inside it anyway.
inline bool HpzActive(const EngineConfig& c, int world) {
  return c.zero_stage >= 3 && c.hpz_partition_size > 1 &&
         static_cast<int>(c.hpz_partition_size) < world;
}

// The bytes of zero_quantized_gradients' blocks for n values: int8 (Int8Bytes) or, with
// zinf.quantized_gradient_bits 4, int4 (Int4Bytes), in blocks of zinf.quantization_block_size.
inline size_t GradientBlockBytes(size_t n, const EngineConfig& config) {
  const size_t block = config.quantization_block_size;
  return config.quantized_gradient_bits == 4 ? Int4Bytes(n, block) : Int8Bytes(n, block);
}

// How zero_quantized_gradients reduces `p`: 0, a plain reduce-scatter; 1, one all-to-all of
// int8 (or int4) blocks over every rank; 2, two hops when the nodes are known (hpZ's K): an
// all-to-all inside the node, summed per node, then the node sums re-encoded and sent across the
// nodes among the ranks of the same place in their node. The full gradient must hold the blocks
// received plus the decoded sums (one partition for one hop, world / K for two).
inline int QuantizedReduceHops(const ParamLayout& p, const EngineConfig& config) {
  const size_t part = p.info.partition_numel;
  if (!config.quantized_gradients || config.zero_stage < 3 ||
      part < config.quantization_block_size) {
    return 0;
  }
  const size_t world = p.padded_numel / part;
  if (world < 2) return 0;
  const size_t blocks = GradientBlockBytes(part, config);
  const size_t full = p.padded_numel * sizeof(float);
  if (HpzActive(config, static_cast<int>(world)) &&
      world * blocks + world / config.hpz_partition_size * part * sizeof(float) <= full) {
    return 2;
  }
  return world * blocks + part * sizeof(float) <= full ? 1 : 0;
}

// GradientScratchBytes' zero_quantized_gradients part: the int8 (or int4) blocks each rank sends
// (world x the partition's blocks; those received and the decoded sums reuse the full gradient,
// read by then). 0 when the reduction is a plain reduce-scatter: one rank, below stage 3 (as in
// DeepSpeed), the key off, or a partition under one block or whose received blocks and decoded
// partitions would not fit the full gradient.
inline size_t QuantizedReduceBytes(const ParamLayout& p, const EngineConfig& config) {
  if (QuantizedReduceHops(p, config) == 0) return 0;
  return p.padded_numel / p.info.partition_numel *
         GradientBlockBytes(p.info.partition_numel, config);
}

// The most device scratch a gradient of `p` takes in GradientWindow::Reduce: the padded full
// gradient and this rank's reduced partition (fp32), plus the partition rounded to bf16 with
// zinf.gradient_transfer_dtype "bf16". Eviction and prefetch leave this much room.
inline size_t GradientScratchBytes(const ParamLayout& p, const EngineConfig& config) {
  if (!p.info.trainable) return 0;  // a frozen parameter takes no gradient
  return (p.padded_numel + p.info.partition_numel) * sizeof(float) +
         (config.gradient_transfer_bf16 ? p.info.partition_numel * sizeof(uint16_t) : 0) +
         QuantizedReduceBytes(p, config);
}

struct GroupLayout {
  std::vector<ParamId> params;
  size_t numel = 0;   // state elements (slices aligned)
  int trainable = 0;  // its trainable parameters
  // The sub-group of the frozen parameters (ParamSpec::trainable false), after every trainable
  // one: data, not state. It has no states (numel 0), no gradients, and is never stepped or
  // written back; its parameters' values live in their parameter stores alone.
  bool frozen = false;
  // Kept and stepped on the device (offload_optimizer.device none, or beyond
  // offload_optimizer.ratio).
  bool on_device = false;
};

// "adam", "adamw", "adagrad", "lion": the names the durable store and checkpoints record.
const char* OptimizerTypeName(OptimizerType t);

class Layout {
 public:
  // `elem_size`: bytes per stored parameter element (2 with bf16 storage); `states`: how the
  // optimizer states are stored (zinf.optimizer_state_dtype).
  // `frozen_int8`: frozen parameters are stored as int8 blocks (zinf.frozen_weight_dtype).
  Layout(int world, size_t elem_size, StateType states = StateType::kF32, bool frozen_int8 = false)
      : world_(world), elem_size_(elem_size), states_(states), frozen_int8_(frozen_int8) {}

  // A parameter as it would be added (validated: shape, name, uniqueness); nothing changes.
  Result<ParamLayout> Describe(const std::string& name, const std::vector<int64_t>& shape,
                               bool trainable, uint64_t persistence_threshold) const;
  ParamId Add(ParamLayout p);
  // Cuts the trainable parameters (in registration order, frozen ones skipped) into
  // sub-groups of up to `sub_group_size` partition elements and marks the first
  // `trainable_groups - offloaded` of them as kept on the device, where `offloaded` comes from
  // the optimizer tier and ratio. The frozen parameters, if any, form one last sub-group
  // (GroupLayout::frozen). Returns `offloaded`.
  size_t Freeze(uint64_t sub_group_size, Tier optimizer_tier, double ratio);
  bool frozen() const { return frozen_; }

  size_t num_params() const { return params_.size(); }
  size_t num_groups() const { return groups_.size(); }
  // Frozen (ParamSpec::trainable false) parameters and their elements.
  size_t num_frozen() const { return num_frozen_; }
  uint64_t frozen_numel() const { return frozen_numel_; }
  const ParamLayout& param(ParamId id) const { return params_[id]; }
  const GroupLayout& group(size_t gi) const { return groups_[gi]; }
  const std::vector<ParamLayout>& params() const { return params_; }
  const std::vector<GroupLayout>& groups() const { return groups_; }
  int world() const { return world_; }
  size_t elem_size() const { return elem_size_; }
  StateType state_type() const { return states_; }

  // Bytes of the gathered parameter (device, storage dtype), of this rank's partition there,
  // and of the partition in its store (int8 blocks for a frozen parameter with
  // zinf.frozen_weight_dtype int8, else the storage dtype).
  size_t FullBytes(ParamId id) const { return params_[id].padded_numel * elem_size_; }
  size_t DevicePartBytes(ParamId id) const { return params_[id].info.partition_numel * elem_size_; }
  // hpZ's secondary shard of `id` with `k` ranks per node: the 1/k of the gathered parameter
  // (world / k partitions, in the device dtype) that a rank's place in its node is for.
  size_t SecondaryBytes(ParamId id, uint32_t k) const {
    return static_cast<size_t>(world_) / k * DevicePartBytes(id);
  }
  size_t PartBytes(ParamId id) const {
    return StoredInt8(id) ? StateBytes(StateType::kInt8, params_[id].info.partition_numel)
                          : DevicePartBytes(id);
  }
  // Whether parameter `id`'s store holds int8 blocks (a frozen one, frozen_weight_dtype int8).
  bool StoredInt8(ParamId id) const { return frozen_int8_ && !params_[id].info.trainable; }
  // [master | state 1 | state 2] of a sub-group (the fp32 masters, then exp_avg or Lion's
  // momentum, then exp_avg_sq or Adagrad's sum, each StateBytes(state_type, numel) bytes), and
  // its fp32 gradient accumulators. The methods taking a StateType give the same for states
  // stored in another type (a checkpoint's).
  size_t GroupStateBytes(size_t gi) const { return GroupStateBytes(gi, states_); }
  size_t GroupStateBytes(size_t gi, StateType t) const {
    return groups_[gi].numel * sizeof(float) + 2 * StateBytes(t, groups_[gi].numel);
  }
  // Byte offset of state k (1 or 2) in a sub-group's buffer.
  size_t StateRegionOffset(size_t gi, int k) const { return StateRegionOffset(gi, k, states_); }
  size_t StateRegionOffset(size_t gi, int k, StateType t) const {
    return groups_[gi].numel * sizeof(float) +
           static_cast<size_t>(k - 1) * StateBytes(t, groups_[gi].numel);
  }
  // Byte offset of a parameter's slice inside a state region, and the bytes of its states
  // there (whole int8 blocks: slices start on one, kSliceAlign).
  size_t SliceStateOffset(ParamId id, StateType t) const {
    return StateBytes(t, params_[id].slice_offset);
  }
  size_t SliceStateOffset(ParamId id) const { return SliceStateOffset(id, states_); }
  size_t SliceStateBytes(ParamId id, StateType t) const {
    return StateBytes(t, params_[id].info.partition_numel);
  }
  // Parameter id's slice in region k of its sub-group's buffer (0: the fp32 masters, 1 and 2:
  // the states): byte offset and length.
  size_t SliceOffsetIn(ParamId id, int k) const { return SliceOffsetIn(id, k, states_); }
  size_t SliceOffsetIn(ParamId id, int k, StateType t) const {
    return k == 0 ? params_[id].slice_offset * sizeof(float)
                  : StateRegionOffset(params_[id].info.sub_group, k, t) + SliceStateOffset(id, t);
  }
  size_t SliceBytesIn(ParamId id, int k) const { return SliceBytesIn(id, k, states_); }
  size_t SliceBytesIn(ParamId id, int k, StateType t) const {
    return k == 0 ? params_[id].info.partition_numel * sizeof(float) : SliceStateBytes(id, t);
  }
  size_t GroupGradBytes(size_t gi) const { return groups_[gi].numel * sizeof(float); }
  size_t LargestGroupStateBytes() const { return LargestGroupStateBytes(states_); }
  size_t LargestGroupStateBytes(StateType t) const;
  // The order the optimizer steps sub-groups in: backward order, last registered first; the
  // frozen sub-group is never stepped and is not in it.
  std::vector<size_t> GroupOrder() const;

 private:
  int world_;
  size_t elem_size_;
  StateType states_;
  bool frozen_int8_;
  bool frozen_ = false;
  size_t num_frozen_ = 0;
  uint64_t frozen_numel_ = 0;
  std::vector<ParamLayout> params_;
  std::vector<GroupLayout> groups_;
  std::set<std::string> names_;
};

}  // namespace zinf
