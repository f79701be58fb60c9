// Sub-groups stepped speculatively (clipping, zinf.speculative_step): stepped with the
// coefficient 1 before the global gradient norm is known, each parameter's pre-step values
// kept tile by tile in a snapshot as the step goes. The verdict keeps them (no clipping),
// redoes them from their snapshots with the clipping coefficient, or rolls them back (the norm
// failed, or the task stops). Their accumulators stay taken until then.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "engine/core/engine_context.h"
#include "engine/core/host_memory.h"
#include "engine/core/layout.h"
#include "engine/core/state_store.h"
#include "zinf/cpu_adam.h"

namespace zinf {

class Speculation {
 public:
  // A sub-group stepped speculatively: its pre-step [master | states] and update counts.
  struct Group {
    size_t gi = 0;
    PooledBlock snapshot;
    std::vector<uint8_t> with_grad;
    std::vector<int64_t> updates;  // per parameter of the sub-group, before the step
    bool poisoned = false;         // its step met a non-finite gradient (tiles left unstepped)
  };
  // What the verdict does with each sub-group, done by the optimizer pipeline.
  struct Actions {
    // Steps sub-group gi again from `master` (its NVMe state block `states`, if any) with
    // `coef`, updating the parameters of `with_grad`, and queues its write-backs.
    std::function<Status(size_t gi, float* master, PooledBlock states, float coef,
                         const std::vector<uint8_t>& with_grad)>
        restep;
    // Called after each sub-group redone or rolled back (bounds the write-backs in flight).
    std::function<void()> after_restep;
    // The sub-group's step is final: its accumulators may go.
    std::function<void(size_t gi)> settled;
  };

  Speculation(const EngineContext& ctx, StateStore* states, BlockPool* snapshots,
              CpuOptimizer* optimizer)
      : ctx_(ctx), states_(states), snapshots_(snapshots), optimizer_(optimizer) {}

  // Whether a snapshot block is there (zinf.speculative_step with clipping).
  bool enabled() const { return snapshots_ != nullptr && snapshots_->initialized(); }
  bool empty() const { return groups_.empty(); }
  // Whether sub-group gi could be stepped speculatively now (a snapshot block free, its states
  // where the CPU steps them).
  bool CanTake(size_t gi) const;
  // Starts a speculative step of sub-group gi: a snapshot block and the update counts.
  Result<Group> Begin(size_t gi, const std::vector<uint8_t>& with_grad) const;
  void Add(Group g) { groups_.push_back(std::move(g)); }
  // The verdict: `coef` equal to `speculated` (the coefficient the speculative steps used)
  // keeps each (unless poisoned), another redoes it; `roll_back` (a failed norm, or a step
  // skipped for fp16 overflow) restores each with its parameter stores rewritten from the
  // restored masters. Counts the
  // outcomes in the stats. A failure of a redo or rollback goes to `*first` (the task's
  // first failure).
  // REQUIRES: nothing still reads the sub-groups' buffers (write-backs, device copies).
  void Resolve(float coef, float speculated, bool roll_back, const Actions& actions, Status* first);

  // Copies elements [begin, end) of parameter id's slices (master and states) from its
  // sub-group's buffer `master` into the same places of `snapshot`, with streaming stores.
  void KeepTiles(ParamId id, const float* master, void* snapshot, size_t begin, size_t end) const;

 private:
  // Puts g's pre-step values back: NVMe states are redone in the snapshot block itself (a
  // pinned block of the state buffers' size), resident ones copied back. The buffer to step.
  float* Restore(Group& g);
  // memcpy on the optimizer's threads.
  void Copy(void* dst, const void* src, size_t bytes);

  const EngineContext& ctx_;
  StateStore* const states_;
  BlockPool* const snapshots_;
  CpuOptimizer* const optimizer_;
  std::vector<Group> groups_;  // in step order
};

}  // namespace zinf
