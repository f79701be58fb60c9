// What the engine takes from the pinned host budget (a pure plan from the layout and the
// configuration), and the swap store's setup: its options, per-rank folders, allowed roots.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/core/layout.h"
#include "zinf/config.h"
#include "zinf/device.h"
#include "zinf/engine_types.h"
#include "zinf/swap.h"

namespace zinf {

struct PinnedPlan {
  uint64_t state_block_bytes = 0;  // one sub-group's [master | m | v], page rounded
  uint64_t state_blocks = 0;       // 0: no state pool
  uint64_t copy_block_bytes = 0;   // one sub-group's bf16 parameter copy
  uint64_t copy_blocks = 0;        // 0: no copy pool
  uint64_t grad_block_bytes = 0;   // the largest sub-group's accumulators, page rounded
  // Without accumulation and clipping the accumulators stream: a sub-group holds a block from
  // its first gradient until the optimizer has stepped it.
  bool stream_grads = false;
  uint64_t grad_blocks = 0;  // streaming: blocks in the pool
  uint64_t fixed = 0;        // everything but the accumulators (pools, cpu-tier params, staging)
  uint64_t hpz_bytes = 0;    // hpZ's secondary shards (part of `fixed`)
  uint64_t grads_min = 0;    // the accumulators' least share
  // Speculative steps (zinf.speculative_step, with clipping): one block per sub-group that may
  // be stepped before the norm is known, from what the budget has left (at most one per
  // sub-group stepped on the CPU; 0: no speculation). `snapshots_min`: what speculation
  // must have (one block with speculative_step true, else 0), counted in the budget check.
  uint64_t snapshot_block_bytes = 0;
  uint64_t snapshot_blocks = 0;
  uint64_t snapshots_min = 0;
  bool speculation_wanted = false;  // asked for (true, or "auto" with the optimizer offloaded)
};

// The plan for `layout` (frozen) under `config`; ResourceExhausted, naming what to raise, when
// the pinned budget is too small. `device_is_host`: device-kept states need no host staging.
Result<PinnedPlan> PlanPinnedMemory(const Layout& layout, const EngineConfig& config,
                                    bool device_is_host);

// The CPU optimizer kind of the configured optimizer.
OptimizerKind OptimizerKindFor(OptimizerType type);

// Whether `config` can run on a device with `caps` over `world` ranks, before anything is
// allocated: the optimizer sub-groups stepped on the device need a device that steps this
// optimizer and state dtype (and, on a GPU, parameters in device memory); durable mode needs
// its states on NVMe (and, with the delayed update, one rank and NVMe parameters).
// NotSupported / InvalidArgument naming the keys to change. Pure.
Status CheckFeasible(const EngineConfig& config, const DeviceCaps& caps, int world);

// Every NVMe path must be a writable folder and, when `allowed_roots` is not empty, inside
// one of them after resolving symbolic links.
Status CheckNvmePaths(const std::vector<std::string>& paths,
                      const std::vector<std::string>& allowed_roots);

// The swap store's options for this rank: its folders (a subfolder per rank with more than
// one, created here), backend, chunking, checksums and durability. The reopen fields are the
// caller's (see DurableCommits).
Result<SwapStoreOptions> SwapStoreOptionsFor(const EngineConfig& config, int rank, int world,
                                             const PinnedArena& arena,
                                             std::shared_ptr<FaultPlan> fault_plan);

}  // namespace zinf
