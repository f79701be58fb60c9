#include "engine/core/layout.h"

#include <algorithm>
#include <cmath>

#include "common/utf8.h"
#include "zinf/swap.h"

namespace zinf {

const char* OptimizerTypeName(OptimizerType t) {
  switch (t) {
    case OptimizerType::kAdam:
      return "adam";
    case OptimizerType::kAdamW:
      return "adamw";
    case OptimizerType::kAdagrad:
      return "adagrad";
    case OptimizerType::kLion:
      return "lion";
  }
  return "?";
}

Result<ParamLayout> Layout::Describe(const std::string& name, const std::vector<int64_t>& shape,
                                     bool trainable, uint64_t persistence_threshold) const {
  if (frozen_) {
    return Status::FailedPrecondition("RegisterParameter('" + name +
                                      "') after registration ended (first Acquire)");
  }
  size_t numel = 1;
  for (int64_t d : shape) {
    if (d <= 0) {
      return Status::InvalidArgument("parameter '" + name + "': every dimension must be positive");
    }
    // At most 2^48 elements (1 PiB of fp32): far beyond any tier, and no size computed from
    // it can overflow.
    if (__builtin_mul_overflow(numel, static_cast<size_t>(d), &numel) ||
        numel > (size_t{1} << 48)) {
      return Status::InvalidArgument("parameter '" + name +
                                     "': its shape has more than 2^48 elements");
    }
  }
  if (shape.empty()) {
    return Status::InvalidArgument("parameter '" + name + "': needs a shape and an init");
  }
  if (name.empty() || !IsValidUtf8(name)) {
    return Status::InvalidArgument(
        "parameter name '" + name +
        "' is empty or not valid UTF-8 (names go into swap keys and JSON manifests)");
  }
  if (names_.count(name) != 0) {
    return Status::InvalidArgument("parameter name '" + name +
                                   "' is registered twice; names must be unique (they key "
                                   "the swap store and the checkpoints)");
  }
  ParamLayout p;
  p.info.name = name;
  p.info.shape = shape;
  p.info.numel = numel;
  // int8 frozen weights: partitions start on the int8 block grid of the whole tensor, so that
  // every block holds the same elements, and the same values decode, on any number of ranks.
  const size_t align = frozen_int8_ && !trainable ? kInt8StateBlock : kPartitionAlign;
  p.info.partition_numel = RoundUp((numel + world_ - 1) / world_, align);
  p.padded_numel = p.info.partition_numel * world_;
  p.info.persistent = numel <= persistence_threshold;
  p.info.trainable = trainable;
  return p;
}

ParamId Layout::Add(ParamLayout p) {
  names_.insert(p.info.name);
  params_.push_back(std::move(p));
  return static_cast<ParamId>(params_.size() - 1);
}

size_t Layout::Freeze(uint64_t sub_group_size, Tier optimizer_tier, double ratio) {
  // Sub-groups: consecutive trainable parameters up to sub_group_size partition elements.
  for (ParamId id = 0; id < params_.size(); ++id) {
    ParamLayout& p = params_[id];
    if (!p.info.trainable) continue;
    const size_t slice = RoundUp(p.info.partition_numel, kSliceAlign);
    if (groups_.empty() ||
        (groups_.back().numel + slice > sub_group_size && !groups_.back().params.empty())) {
      groups_.emplace_back();
    }
    GroupLayout& g = groups_.back();
    p.info.sub_group = groups_.size() - 1;
    p.slice_offset = g.numel;
    p.index_in_group = g.params.size();
    g.params.push_back(id);
    ++g.trainable;
    g.numel += slice;
  }
  const size_t trainable_groups = groups_.size();
  // The frozen parameters: one sub-group without states, never stepped.
  for (ParamId id = 0; id < params_.size(); ++id) {
    ParamLayout& p = params_[id];
    if (p.info.trainable) continue;
    if (num_frozen_ == 0) {
      groups_.emplace_back();
      groups_.back().frozen = true;
    }
    GroupLayout& g = groups_.back();
    p.info.sub_group = groups_.size() - 1;
    p.slice_offset = 0;
    p.index_in_group = g.params.size();
    g.params.push_back(id);
    ++num_frozen_;
    frozen_numel_ += p.info.numel;
  }
  // offload_optimizer.ratio: the share of sub-groups whose states are offloaded (cpu or nvme)
  // and stepped by the CPU. The others stay in device memory and are stepped there: the
  // first registered ones, whose gradients complete last in backward (a CPU step of them
  // would overlap least with the backward).
  const size_t offloaded = optimizer_tier == Tier::kDevice
                               ? 0
                               : static_cast<size_t>(std::llround(ratio * trainable_groups));
  for (size_t gi = 0; gi + offloaded < trainable_groups; ++gi) groups_[gi].on_device = true;
  frozen_ = true;
  return offloaded;
}

size_t Layout::LargestGroupStateBytes(StateType t) const {
  size_t largest = 0;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    largest = std::max(largest, GroupStateBytes(gi, t));
  }
  return largest;
}

std::vector<size_t> Layout::GroupOrder() const {
  std::vector<size_t> order;
  for (size_t i = groups_.size(); i-- > 0;) {
    if (!groups_[i].frozen) order.push_back(i);
  }
  return order;
}

}  // namespace zinf
