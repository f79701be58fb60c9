#include "engine/core/memory_plan.h"

#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <filesystem>

#include "zinf/io.h"
#include "zinf/log.h"
#include "zinf/plan.h"

namespace zinf {

namespace {

// The parameters' share of the plan.
struct ParamTotals {
  uint64_t cpu_tier_bytes = 0;  // cpu-tier partitions, pinned
  uint64_t max_part = 0;        // the largest partition in fp32, page rounded
  uint64_t hpz_bytes = 0;       // hpZ's secondary shards, pinned
};

// The trainable sub-groups' share of the plan (frozen ones have no states, no gradients).
struct GroupTotals {
  uint64_t max_group = 0;     // the largest one's elements
  size_t kept_on_device = 0;  // those whose states stay in device memory
  uint64_t host_groups = 0;   // those whose gradients accumulate in pinned memory
  uint64_t grads_all = 0;     // their accumulators, page rounded
  uint64_t max_group_grads = 0;
  uint64_t cpu_stepped = 0;  // those the CPU steps
  uint64_t max_cpu_group_states = 0;
};

// The cpu-tier partitions (two of a trainable one with the delayed update) and the largest
// partition.
ParamTotals TallyParams(const Layout& layout, const EngineConfig& config) {
  const bool delayed = config.delayed_update;
  ParamTotals t;
  for (ParamId id = 0; id < layout.num_params(); ++id) {
    const ParamLayout& p = layout.param(id);
    const uint64_t part = RoundUp(layout.PartBytes(id), 4096);
    // (A frozen parameter's value never changes: one buffer.)
    const bool two = delayed && p.info.trainable;
    if (config.offload_param.tier == Tier::kCpu) t.cpu_tier_bytes += two ? 2 * part : part;
    if (HpzActive(config, layout.world()) && !p.info.persistent) {
      t.hpz_bytes += RoundUp(layout.SecondaryBytes(id, config.hpz_partition_size), 4096);
    }
    t.max_part =
        std::max<uint64_t>(t.max_part, RoundUp(p.info.partition_numel * sizeof(float), 4096));
  }
  return t;
}

// Which trainable sub-groups keep states on the device, which the CPU steps and what their
// gradient accumulators take.
GroupTotals TallyGroups(const Layout& layout, const EngineConfig& config) {
  GroupTotals t;
  for (size_t gi = 0; gi < layout.num_groups(); ++gi) {
    if (layout.group(gi).frozen) continue;  // no states, no gradients
    t.max_group = std::max<uint64_t>(t.max_group, layout.group(gi).numel);
    if (layout.group(gi).on_device) ++t.kept_on_device;
    // A sub-group the device steps accumulates its gradients in device memory.
    if (layout.group(gi).on_device && config.offload_param.tier == Tier::kDevice) continue;
    ++t.cpu_stepped;
    t.max_cpu_group_states = std::max<uint64_t>(t.max_cpu_group_states, layout.GroupStateBytes(gi));
    ++t.host_groups;
    t.grads_all += RoundUp(layout.GroupGradBytes(gi), 4096);
    t.max_group_grads =
        std::max<uint64_t>(t.max_group_grads, RoundUp(layout.GroupGradBytes(gi), 4096));
  }
  return t;
}

// The optimizer's pools into *plan: state blocks (NVMe states' swap buffers, or one for
// initialising device states) and bf16 parameter copy blocks. Returns the bytes they take.
uint64_t PlanOptimizerPools(const Layout& layout, const EngineConfig& config,
                            const GroupTotals& groups, bool device_is_host, PinnedPlan* plan) {
  const uint64_t buffers = std::max<uint32_t>(config.offload_optimizer.buffer_count, 3);
  plan->state_block_bytes = RoundUp(layout.LargestGroupStateBytes(), 4096);
  if (config.offload_optimizer.tier == Tier::kNvme) {
    plan->state_blocks = buffers;
  } else if (groups.kept_on_device > 0 && !device_is_host) {
    plan->state_blocks = 1;  // initialising device states
  }
  const bool copies = StoredParamType(config) != ParamCopyType::kNone;
  plan->copy_block_bytes = groups.max_group * 2;
  plan->copy_blocks = copies ? buffers : 0;
  return plan->state_blocks * plan->state_block_bytes +
         buffers * RoundUp(groups.max_group * (copies ? 2 : 0), 4096);
}

// Staging for nvme parameter reads and gradient landing: a few partitions at a time; with
// int8 frozen weights also a block of the parameter dtype to dequantise into per fetch.
uint64_t StagingBytes(const Layout& layout, const EngineConfig& config, uint64_t max_part) {
  uint64_t total_part = 0;
  for (const ParamLayout& p : layout.params()) total_part += p.info.partition_numel;
  const uint64_t staging =
      4 * max_part +
      RoundUp(std::min<uint64_t>(config.prefetch_bucket_size / std::max(layout.world(), 1),
                                 total_part) *
                  layout.elem_size(),
              4096);
  const uint64_t dequantise = config.frozen_int8 && layout.num_frozen() > 0 ? max_part : 0;
  return staging + dequantise;
}

// Gradient accumulators into *plan. Streaming: two sub-groups' worth is enough (the one the
// backward fills and the one being stepped); whatever the budget has left goes to them
// (SharePinnedSpare), so backward can run ahead of the optimizer.
void PlanGradientAccumulators(const EngineConfig& config, const GroupTotals& groups,
                              PinnedPlan* plan) {
  // (A layer-major window is one micro-step: each sub-group's gradients of every micro-batch
  // arrive before it is stepped, as with one micro-batch.)
  plan->stream_grads = (config.gradient_accumulation_steps <= 1 || config.layer_major) &&
                       !WaitsForGlobalNorm(config) && groups.max_group_grads > 0;
  plan->grad_block_bytes = groups.max_group_grads;
  plan->grads_min = plan->stream_grads
                        ? std::min<uint64_t>(groups.host_groups, 2) * groups.max_group_grads
                        : groups.grads_all;
}

// Whether speculative steps are wanted and, if so, their snapshot block and least share, into
// *plan (after PlanOptimizerPools: an NVMe state block bounds the snapshot block from below).
void PlanSpeculation(const EngineConfig& config, const GroupTotals& groups, bool device_is_host,
                     PinnedPlan* plan) {
  // Speculation acts only where the optimizer waits for the norm: with clipping or fp16. "auto":
  // with the states in CPU memory, on a GPU. With NVMe states it moves their reads and writes into
  // the backward, where they compete with its parameter fetches (slower on the 3.15B run); on
  // the host device the backward and its copies run on the cores speculation would use, and
  // its snapshots cost more than waiting saves (bench/RESULTS.md, issue 31).
  plan->speculation_wanted =
      WaitsForGlobalNorm(config) && groups.cpu_stepped > 0 &&
      (config.speculative_step == SpeculativeStep::kOn ||
       (config.speculative_step == SpeculativeStep::kAuto && !device_is_host &&
        config.offload_optimizer.tier == Tier::kCpu && config.offload_optimizer.ratio > 0));
  if (!plan->speculation_wanted) return;
  // (NVMe states are redone in their snapshot block, so it is a state buffer's size.)
  plan->snapshot_block_bytes = RoundUp(groups.max_cpu_group_states, 4096);
  if (config.offload_optimizer.tier == Tier::kNvme) {
    plan->snapshot_block_bytes = std::max(plan->snapshot_block_bytes, plan->state_block_bytes);
  }
  if (config.speculative_step == SpeculativeStep::kOn) {
    plan->snapshots_min = plan->snapshot_block_bytes;
  }
}

// ResourceExhausted, naming what to raise, when `fixed` bytes and the accumulators' and
// snapshots' least shares do not fit the pinned budget.
Status CheckPinnedBudget(const EngineConfig& config, uint64_t fixed, const PinnedPlan& plan) {
  if (fixed + plan.grads_min + plan.snapshots_min <= config.pinned_budget_bytes) {
    return Status::OK();
  }
  return Status::ResourceExhausted(
             "the pinned host budget of " + FormatBytes(config.pinned_budget_bytes) +
             " is too small: this model needs about " +
             FormatBytes(fixed + plan.grads_min + plan.snapshots_min) +
             " (gradient partitions, cpu-tier parameters, optimizer swap buffers and staging" +
             (plan.hpz_bytes > 0 ? ", " + FormatBytes(plan.hpz_bytes) +
                                       " of hpZ's secondary shards (zero_hpz_partition_size)"
                                 : std::string()) +
             (plan.snapshots_min > 0
                  ? ", and one speculative-step snapshot of " + FormatBytes(plan.snapshots_min) +
                        " for zinf.speculative_step true (\"auto\" goes without)"
                  : std::string()) +
             "); raise zinf.pinned_budget_bytes or lower sub_group_size")
      .WithKey("zinf.pinned_budget_bytes");
}

// What the budget has left beyond `fixed` bytes, shared out into *plan: snapshot blocks for
// speculation, and streaming gradient blocks beyond the least two.
void SharePinnedSpare(const EngineConfig& config, uint64_t fixed, const GroupTotals& groups,
                      PinnedPlan* plan) {
  if (plan->speculation_wanted && plan->snapshot_block_bytes > 0) {
    // What the budget has left (the accumulators stay whole with clipping). The arena's rest
    // is staging for prefetches and gradient landing, which run deeper with more: "auto" takes
    // half of it at most, true all it needs.
    uint64_t spare = config.pinned_budget_bytes - fixed - plan->grads_min;
    if (config.speculative_step == SpeculativeStep::kAuto) spare /= 2;
    plan->snapshot_blocks =
        std::min<uint64_t>(groups.cpu_stepped, spare / plan->snapshot_block_bytes);
  }
  if (plan->stream_grads) {
    const uint64_t spare = config.pinned_budget_bytes - fixed;
    plan->grad_blocks = std::min<uint64_t>(
        groups.host_groups, std::max<uint64_t>(spare / groups.max_group_grads,
                                               std::min<uint64_t>(groups.host_groups, 2)));
  }
}

}  // namespace

Result<PinnedPlan> PlanPinnedMemory(const Layout& layout, const EngineConfig& config,
                                    bool device_is_host) {
  // Pinned memory: cpu-tier partitions, gradient accumulators, staging for nvme reads and
  // optimizer buffers. All of it must fit the pinned budget.
  PinnedPlan plan;
  const ParamTotals params = TallyParams(layout, config);
  const GroupTotals groups = TallyGroups(layout, config);
  plan.hpz_bytes = params.hpz_bytes;
  uint64_t pinned = params.cpu_tier_bytes + params.hpz_bytes;
  pinned += PlanOptimizerPools(layout, config, groups, device_is_host, &plan);
  pinned += StagingBytes(layout, config, params.max_part);
  PlanGradientAccumulators(config, groups, &plan);
  plan.fixed = pinned;
  PlanSpeculation(config, groups, device_is_host, &plan);
  ZINF_RETURN_IF_ERROR(CheckPinnedBudget(config, pinned, plan));
  SharePinnedSpare(config, pinned, groups, &plan);
  return plan;
}

OptimizerKind OptimizerKindFor(OptimizerType type) {
  switch (type) {
    case OptimizerType::kAdam:
      return OptimizerKind::kAdam;
    case OptimizerType::kAdamW:
      return OptimizerKind::kAdamW;
    case OptimizerType::kAdagrad:
      return OptimizerKind::kAdagrad;
    case OptimizerType::kLion:
      return OptimizerKind::kLion;
  }
  return OptimizerKind::kAdamW;
}

Status CheckFeasible(const EngineConfig& config, const DeviceCaps& caps, int world) {
  // hpZ's nodes are K consecutive ranks each: K must divide the world (K = world: one node).
  const uint32_t k = config.hpz_partition_size;
  // (K >= world: one node, whose gathers all stay inside it; hpZ has nothing to do there.)
  if (config.zero_stage >= 3 && k > 1 && static_cast<int64_t>(k) < world && world % k != 0) {
    return Status::InvalidArgument(
               "zero_optimization.zero_hpz_partition_size " + std::to_string(k) +
               " does not divide the world size " + std::to_string(world) +
               "; give the ranks per node (LOCAL_WORLD_SIZE), each node's ranks consecutive, or 1 "
               "(off)")
        .WithKey("zero_optimization.zero_hpz_partition_size");
  }
  // Sub-groups stepped on the device: all of them (offload_optimizer.device none) or those
  // beyond offload_optimizer.ratio.
  const bool device_optimizer =
      config.offload_optimizer.tier == Tier::kDevice || config.offload_optimizer.ratio < 1;
  if (device_optimizer) {
    const char* what =
        config.offload_optimizer.tier == Tier::kDevice
            ? "offload_optimizer.device none (the optimizer on the device)"
            : "offload_optimizer.ratio below 1 (part of the optimizer on the device)";
    if (caps.step_needs_device_params && config.offload_param.tier != Tier::kDevice) {
      return Status::NotSupported(
          std::string(what) +
          " needs offload_param.device none: the device writes the updated parameters straight "
          "into their device stores; set offload_optimizer.ratio 1 and device cpu or nvme");
    }
    if (!caps.Steps(OptimizerKindFor(config.optimizer.type))) {
      return Status::NotSupported(std::string(what) +
                                  ": this device's optimizer kernel does not run " +
                                  OptimizerTypeName(config.optimizer.type) +
                                  " (a GPU runs Adam and AdamW); step it on the CPU (ratio 1, "
                                  "device cpu or nvme)");
    }
    if (config.optimizer_state_type != StateType::kF32 && !caps.step_compressed_states) {
      return Status::NotSupported(
          std::string(what) +
          ": this device's optimizer kernel keeps fp32 states, not zinf.optimizer_state_dtype \"" +
          StateTypeName(config.optimizer_state_type) +
          "\"; step the optimizer on the CPU (offload_optimizer.ratio 1, device cpu or nvme) or "
          "keep fp32 states");
    }
  }
  if (config.durable) {
    if (config.offload_optimizer.tier != Tier::kNvme || config.offload_optimizer.ratio < 1) {
      return Status::InvalidArgument(
          "zinf.durable needs offload_optimizer.device nvme and offload_optimizer.ratio 1 (the "
          "states to resume from live in the swap store)");
    }
    if (config.delayed_update && world > 1) {
      return Status::NotSupported(
          "zinf.durable with zinf.delayed_update and more than one rank is not supported: each "
          "rank's optimizer commits on its own, so ranks can end up more than the one retained "
          "commit apart; turn one off");
    }
    if (config.delayed_update && config.offload_param.tier != Tier::kNvme) {
      return Status::InvalidArgument(
          "zinf.durable with zinf.delayed_update needs offload_param.device nvme: a resume "
          "needs the parameters one step behind the states, which only the NVMe parameter "
          "store keeps");
    }
  }
  return Status::OK();
}

Result<uint64_t> PinnedBytesNeeded(const EngineConfig& config, const std::vector<ParamSpec>& params,
                                   int world_size, bool device_is_host) {
  if (world_size < 1) return Status::InvalidArgument("PinnedBytesNeeded: world_size must be >= 1");
  // The layout the engine builds for these parameters (Engine::Impl and RegisterParameter),
  // planned under an unlimited budget: what the plan takes is what the budget must hold.
  Layout layout(world_size, StoredParamBytes(config), config.optimizer_state_type,
                config.frozen_int8);
  for (const ParamSpec& spec : params) {
    ZINF_ASSIGN_OR_RETURN(ParamLayout p, layout.Describe(spec.name, spec.shape, spec.trainable,
                                                         config.param_persistence_threshold));
    layout.Add(std::move(p));
  }
  if (layout.num_params() == 0) return uint64_t{0};
  layout.Freeze(config.sub_group_size, config.offload_optimizer.tier,
                config.offload_optimizer.ratio);
  EngineConfig unlimited = config;
  unlimited.pinned_budget_bytes = UINT64_MAX;
  ZINF_ASSIGN_OR_RETURN(PinnedPlan plan, PlanPinnedMemory(layout, unlimited, device_is_host));
  return plan.fixed + plan.grads_min + plan.snapshots_min;
}

Status CheckNvmePaths(const std::vector<std::string>& paths,
                      const std::vector<std::string>& allowed_roots) {
  std::vector<std::string> roots;
  for (const std::string& r : allowed_roots) {
    char* real = realpath(r.c_str(), nullptr);
    if (real == nullptr) {
      return ErrnoToStatus(errno, "zinf.allowed_nvme_roots: cannot resolve " + r);
    }
    roots.emplace_back(real);
    std::free(real);
  }
  for (const std::string& p : paths) {
    char* real = realpath(p.c_str(), nullptr);
    if (real == nullptr) {
      return ErrnoToStatus(errno, "nvme_path " + p + " (create the folder, or fix the path)");
    }
    std::string resolved(real);
    std::free(real);
    struct stat st {};
    if (stat(resolved.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      return Status::InvalidArgument("nvme_path " + p + " is not a folder");
    }
    if (access(resolved.c_str(), W_OK | X_OK) != 0) {
      return ErrnoToStatus(errno, "nvme_path " + p +
                                      " is not writable (the swap files go there); pick a "
                                      "writable folder");
    }
    if (roots.empty()) continue;
    bool inside = false;
    for (const std::string& r : roots) {
      if (resolved == r || resolved.rfind(r == "/" ? r : r + "/", 0) == 0) inside = true;
    }
    if (!inside) {
      std::string list;
      for (const std::string& r : allowed_roots) list += (list.empty() ? "" : ", ") + r;
      return Status::InvalidArgument(
          "nvme_path " + p + " (" + resolved +
          ") is outside the allowed folders (zinf.allowed_nvme_roots: " + list + ")");
    }
  }
  return Status::OK();
}

Result<SwapStoreOptions> SwapStoreOptionsFor(const EngineConfig& config, int rank, int world,
                                             const PinnedArena& arena,
                                             std::shared_ptr<FaultPlan> fault_plan) {
  SwapStoreOptions so;
  so.paths = config.offload_optimizer.tier == Tier::kNvme ? config.offload_optimizer.nvme_paths
                                                          : config.offload_param.nvme_paths;
  for (const std::string& extra : config.offload_param.nvme_paths) {
    if (config.offload_param.tier == Tier::kNvme &&
        std::find(so.paths.begin(), so.paths.end(), extra) == so.paths.end()) {
      so.paths.push_back(extra);
    }
  }
  ZINF_RETURN_IF_ERROR(CheckNvmePaths(so.paths, config.allowed_nvme_roots));
  if (world > 1) {
    // Each rank keeps its own swap files: a subfolder per rank.
    for (std::string& path : so.paths) {
      path += "/rank" + std::to_string(rank);
      if (mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) {
        return ErrnoToStatus(errno, "creating swap folder " + path);
      }
    }
  }
  Result<IoBackendKind> kind = ParseIoBackendKind(config.aio.backend);
  if (!kind.ok()) return kind.status().WithContext("aio.backend");
  so.backend = kind.value();
  so.backend_options.queue_depth = config.aio.queue_depth;
  so.block_size = config.aio.block_size;
  // One request per stripe chunk: chunks as large as the aio block size, so that
  // aio.block_size really is the request size (1 MiB chunks would cap it).
  so.chunk_size = std::max<uint64_t>(RoundUp(config.aio.block_size, 4096), 4096);
  // A durable store is meant to survive the process: its chunks are always checksummed, so
  // that a resume never trusts a flipped byte.
  so.checksums = config.checksums || config.durable;
  so.max_capacity_per_path = config.nvme_capacity_bytes;
  so.registered_regions = {arena.region()};
  so.fault_plan = std::move(fault_plan);
  so.durable = config.durable;
  // A store only a durable engine reopens: otherwise its files go when the engine does.
  so.remove_on_close = !config.durable;
  so.reserve_bytes = config.nvme_reserve_bytes;
  so.retained_commits = world > 1 ? 2 : 1;
  return so;
}

// ---- The NVMe plan (zinf/plan.h) --------------------------------------------------------------

namespace {

bool UsesNvme(const EngineConfig& c) {
  return c.offload_param.tier == Tier::kNvme || c.offload_optimizer.tier == Tier::kNvme;
}

// The swap folders a store of `config` uses (the optimizer's, then the parameters' others).
std::vector<std::string> NvmeFolders(const EngineConfig& config) {
  std::vector<std::string> paths = config.offload_optimizer.tier == Tier::kNvme
                                       ? config.offload_optimizer.nvme_paths
                                       : config.offload_param.nvme_paths;
  for (const std::string& extra : config.offload_param.nvme_paths) {
    if (config.offload_param.tier == Tier::kNvme &&
        std::find(paths.begin(), paths.end(), extra) == paths.end()) {
      paths.push_back(extra);
    }
  }
  return paths;
}

}  // namespace

uint64_t NvmeBytesNeeded(const EngineConfig& c, uint64_t params, uint64_t frozen) {
  // In 128 bits: a count beyond any disk must not wrap into one that fits.
  unsigned __int128 need = 0;
  const unsigned __int128 n = params;
  const unsigned __int128 param_bytes = n * StoredParamBytes(c);
  if (c.offload_param.tier == Tier::kNvme) need += param_bytes;
  if (c.offload_optimizer.tier == Tier::kNvme) {
    // The fp32 master and two states as stored (12 bytes with fp32 states, 8 bf16, ~6 int8).
    constexpr size_t kN = size_t{1} << 20;
    need += n * 4 + n * 2 * StateBytes(c.optimizer_state_type, kN) / kN;
  }
  // The delayed update double-buffers NVMe parameters; durable mode keeps the committed copy
  // of everything while a step writes the next one.
  if (c.delayed_update && c.offload_param.tier == Tier::kNvme) need += param_bytes;
  if (c.durable) need *= 2;
  // Frozen parameters: their stored copy alone, written once (no states, one buffer).
  if (c.offload_param.tier == Tier::kNvme) {
    constexpr size_t kN = size_t{1} << 20;
    need += c.frozen_int8
                ? static_cast<unsigned __int128>(frozen) * StateBytes(StateType::kInt8, kN) / kN
                : static_cast<unsigned __int128>(frozen) * StoredParamBytes(c);
  }
  need += need / 50;  // alignment and padding
  return need > UINT64_MAX ? UINT64_MAX : static_cast<uint64_t>(need);
}

Status PrepareNvmeFolders(const EngineConfig& c, uint64_t params, uint64_t frozen) {
  if (!UsesNvme(c)) return Status::OK();
  const std::vector<std::string> paths = NvmeFolders(c);
  const uint64_t need = NvmeBytesNeeded(c, params, frozen);
  uint64_t free_bytes = 0;
  for (size_t i = 0; i < paths.size(); ++i) {
    const std::string& p = paths[i];
    // A swap file already there is reused (resume) or replaced (--overwrite): its space counts.
    struct stat st {};
    const std::string swap_file = SwapStore::FileName(p, i);
    if (stat(swap_file.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
      free_bytes += static_cast<uint64_t>(st.st_blocks) * 512;
    }
    std::error_code ec;
    if (!c.allowed_nvme_roots.empty()) {
      // Refused before anything is created: the existing part of the path resolved (links
      // followed), the rest taken as written.
      const std::filesystem::path resolved = std::filesystem::weakly_canonical(p, ec);
      bool inside = false;
      for (const std::string& r : c.allowed_nvme_roots) {
        std::error_code rec;
        const std::filesystem::path root = std::filesystem::canonical(r, rec);
        if (rec) continue;
        const auto rel = resolved.lexically_relative(root);
        inside = inside || (!rel.empty() && *rel.begin() != "..");
      }
      if (ec || !inside) {
        return Status::InvalidArgument("the NVMe swap folder " + p +
                                       " is outside zinf.allowed_nvme_roots (nothing was "
                                       "created): give a folder inside one of them")
            .WithKey("zinf.allowed_nvme_roots");
      }
    }
    std::filesystem::create_directories(p, ec);
    if (ec) {
      return Status(StatusCode::kIoError,
                    "cannot create the NVMe swap folder " + p + ": " + ec.message() +
                        "; give a writable folder",
                    ec.value())
          .WithKey("nvme_path");
    }
    struct statvfs vfs {};
    if (statvfs(p.c_str(), &vfs) != 0) {
      return ErrnoToStatus(errno, "statvfs on the NVMe swap folder " + p).WithKey("nvme_path");
    }
    free_bytes += static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  }
  if (need > free_bytes) {
    return Status::ResourceExhausted(
               "not enough space on the NVMe path" + std::string(paths.size() > 1 ? "s" : "") +
               " (" + paths.front() + (paths.size() > 1 ? ", ..." : "") + "): this model's " +
               (c.offload_param.tier == Tier::kNvme ? "parameters and " : "") +
               "optimizer states need about " + FormatBytes(need) + " but " +
               FormatBytes(free_bytes) +
               " is free; free space, add NVMe paths on other disks, or pick a smaller model")
        .WithKey("nvme_path");
  }
  return Status::OK();
}

}  // namespace zinf
