#include "engine/speculation.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#include "engine/core/stats_recorder.h"

namespace zinf {

bool Speculation::CanTake(size_t gi) const {
  // Device-resident states are stepped where they are (a real device): not speculated.
  return enabled() && snapshots_->free_blocks() > 0 &&
         (states_->device_states(gi) == nullptr || ctx_.device->IsHost());
}

Result<Speculation::Group> Speculation::Begin(size_t gi,
                                              const std::vector<uint8_t>& with_grad) const {
  Group g;
  g.gi = gi;
  ZINF_ASSIGN_OR_RETURN(g.snapshot, snapshots_->Take());
  for (ParamId id : ctx_.layout->group(gi).params) g.updates.push_back(states_->updates(id));
  g.with_grad = with_grad;
  return g;
}

void Speculation::Resolve(float coef, float speculated, bool roll_back, const Actions& actions,
                          Status* first) {
  if (groups_.empty()) return;
  uint64_t kept = 0, redone = 0, rolled_back = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (Group& g : groups_) {
    if (!roll_back && coef == speculated && !g.poisoned) {
      ++kept;
      actions.settled(g.gi);
      continue;
    }
    const bool nvme = states_->on_nvme(g.gi);
    float* master = Restore(g);
    PooledBlock block = nvme ? std::move(g.snapshot) : PooledBlock();
    if (roll_back) {
      ++rolled_back;
      // No parameter is updated: the stores get the restored values back.
      const std::vector<uint8_t> none(g.updates.size(), 0);
      first->Update(actions.restep(g.gi, master, std::move(block), 1.0f, none));
    } else {
      ++redone;
      first->Update(actions.restep(g.gi, master, std::move(block), coef, g.with_grad));
    }
    actions.after_restep();
    actions.settled(g.gi);
  }
  groups_.clear();
  const double seconds =
      redone + rolled_back > 0
          ? std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()
          : 0;
  ctx_.stats->CountSpeculation(0, kept, redone, rolled_back, seconds);
}

float* Speculation::Restore(Group& g) {
  const Layout& layout = *ctx_.layout;
  const std::vector<ParamId>& ids = layout.group(g.gi).params;
  for (size_t j = 0; j < ids.size(); ++j) states_->set_updates(ids[j], g.updates[j]);
  if (states_->on_nvme(g.gi)) return static_cast<float*>(g.snapshot.data());
  float* master = states_->resident_states(g.gi);
  for (ParamId id : ids) {
    for (int k = 0; k < 3; ++k) {
      const size_t offset = layout.SliceOffsetIn(id, k);
      Copy(reinterpret_cast<char*>(master) + offset,
           static_cast<const char*>(g.snapshot.data()) + offset, layout.SliceBytesIn(id, k));
    }
  }
  return master;
}

void Speculation::KeepTiles(ParamId id, const float* master, void* snapshot, size_t begin,
                            size_t end) const {
  const Layout& layout = *ctx_.layout;
  const char* from = reinterpret_cast<const char*>(master);
  char* to = static_cast<char*>(snapshot);
  for (int k = 0; k < 3; ++k) {
    const size_t offset = layout.SliceOffsetIn(id, k);
    const size_t b = k == 0 ? begin * sizeof(float) : StateBytes(layout.state_type(), begin);
    const size_t e = k == 0 ? end * sizeof(float) : StateBytes(layout.state_type(), end);
    StreamCopy(to + offset + b, from + offset + b, e - b);
  }
}

void Speculation::Copy(void* dst, const void* src, size_t bytes) {
  constexpr size_t kLine = 64;
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  optimizer_->ParallelFor((bytes + kLine - 1) / kLine, [&](size_t begin, size_t end) {
    std::memcpy(d + begin * kLine, s + begin * kLine, std::min(bytes, end * kLine) - begin * kLine);
  });
}

}  // namespace zinf
