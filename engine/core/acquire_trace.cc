#include "engine/core/acquire_trace.h"

namespace zinf {

void AcquireTrace::SetOrder(std::vector<ParamId> order) {
  ids_ = std::move(order);
  mode_ = ids_.empty() ? Mode::kInvalid : Mode::kComplete;
}

std::string AcquireTrace::Check(ParamId id, const Layout& layout) {
  if (mode_ == Mode::kRecord) {
    ids_.push_back(id);
    return std::string();
  }
  if (mode_ == Mode::kInvalid) return std::string();
  if (pos_ < ids_.size() && ids_[pos_] == id) {
    ++pos_;
    return std::string();
  }
  const std::string expected = pos_ < ids_.size() ? "'" + layout.param(ids_[pos_]).info.name + "'"
                                                  : std::string("the end of the step");
  mode_ = Mode::kInvalid;
  return "prefetch trace invalidated: acquire #" + std::to_string(pos_) + " was '" +
         layout.param(id).info.name + "', the recorded trace expected " + expected +
         "; prefetching stops and parameters are fetched on demand";
}

void AcquireTrace::EndMicroStep() {
  if (mode_ == Mode::kRecord && !ids_.empty()) mode_ = Mode::kComplete;
  pos_ = 0;
}

uint64_t AcquireTrace::ReuseDistance(ParamId id, const Layout& layout) const {
  if (!valid()) return UINT64_MAX;
  uint64_t dist = 0;
  for (size_t i = pos_; i < ids_.size(); ++i) {
    if (ids_[i] == id) return dist;
    dist += layout.param(ids_[i]).info.numel;
  }
  return UINT64_MAX;
}

}  // namespace zinf
