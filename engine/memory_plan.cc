#include "engine/memory_plan.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>

#include "zinf/io.h"
#include "zinf/log.h"

namespace zinf {

Result<PinnedPlan> PlanPinnedMemory(const Layout& layout, const EngineConfig& config,
                                    bool device_is_host) {
  // Pinned memory: cpu-tier partitions, gradient accumulators, staging for nvme reads and
  // optimizer buffers. All of it must fit the pinned budget.
  PinnedPlan plan;
  const bool delayed = config.delayed_update;
  uint64_t pinned = 0;
  uint64_t max_part = 0, max_group = 0;
  for (ParamId id = 0; id < layout.num_params(); ++id) {
    const ParamLayout& p = layout.param(id);
    const uint64_t part = RoundUp(layout.PartBytes(id), 4096);
    if (config.offload_param.tier == Tier::kCpu) pinned += delayed ? 2 * part : part;
    max_part = std::max<uint64_t>(max_part, RoundUp(p.info.partition_numel * sizeof(float), 4096));
  }
  uint64_t grads_all = 0, max_group_grads = 0;
  uint64_t host_groups = 0;  // sub-groups whose gradients accumulate in pinned memory
  size_t kept_on_device = 0;
  for (size_t gi = 0; gi < layout.num_groups(); ++gi) {
    max_group = std::max<uint64_t>(max_group, layout.group(gi).numel);
    if (layout.group(gi).on_device) ++kept_on_device;
    // A sub-group the device steps accumulates its gradients in device memory.
    if (layout.group(gi).on_device && config.offload_param.tier == Tier::kDevice) continue;
    ++host_groups;
    grads_all += RoundUp(layout.GroupGradBytes(gi), 4096);
    max_group_grads = std::max<uint64_t>(max_group_grads, RoundUp(layout.GroupGradBytes(gi), 4096));
  }
  const uint64_t buffers = std::max<uint32_t>(config.offload_optimizer.buffer_count, 3);
  plan.state_block_bytes = RoundUp(layout.LargestGroupStateBytes(), 4096);
  if (config.offload_optimizer.tier == Tier::kNvme) {
    plan.state_blocks = buffers;
  } else if (kept_on_device > 0 && !device_is_host) {
    plan.state_blocks = 1;  // initialising device states
  }
  pinned += plan.state_blocks * plan.state_block_bytes;
  const bool copies = config.bf16;
  plan.copy_block_bytes = max_group * 2;
  plan.copy_blocks = copies ? buffers : 0;
  pinned += buffers * RoundUp(max_group * (copies ? 2 : 0), 4096);
  // Staging for nvme parameter reads and gradient landing: a few partitions at a time.
  uint64_t total_part = 0;
  for (const ParamLayout& p : layout.params()) total_part += p.info.partition_numel;
  const uint64_t staging =
      4 * max_part +
      RoundUp(std::min<uint64_t>(config.prefetch_bucket_size / std::max(layout.world(), 1),
                                 total_part) *
                  layout.elem_size(),
              4096);
  pinned += staging;
  // Gradient accumulators. Streaming: two sub-groups' worth is enough (the one the backward
  // fills and the one being stepped); whatever the budget has left goes to them, so backward
  // can run ahead of the optimizer.
  plan.stream_grads = config.gradient_accumulation_steps <= 1 && config.gradient_clipping <= 0 &&
                      max_group_grads > 0;
  const uint64_t groups = host_groups;
  plan.grad_block_bytes = max_group_grads;
  plan.grads_min = plan.stream_grads ? std::min<uint64_t>(groups, 2) * max_group_grads : grads_all;
  plan.fixed = pinned;
  if (pinned + plan.grads_min > config.pinned_budget_bytes) {
    return Status::ResourceExhausted(
        "the pinned host budget of " + FormatBytes(config.pinned_budget_bytes) +
        " is too small: this model needs about " + FormatBytes(pinned + plan.grads_min) +
        " (gradient partitions, cpu-tier parameters, optimizer swap buffers and staging); "
        "raise zinf.pinned_budget_bytes or lower sub_group_size");
  }
  if (plan.stream_grads) {
    const uint64_t spare = config.pinned_budget_bytes - pinned;
    plan.grad_blocks = std::min<uint64_t>(
        groups, std::max<uint64_t>(spare / max_group_grads, std::min<uint64_t>(groups, 2)));
  }
  return plan;
}

Result<uint64_t> PinnedBytesNeeded(const EngineConfig& config, const std::vector<ParamSpec>& params,
                                   int world_size, bool device_is_host) {
  if (world_size < 1) return Status::InvalidArgument("PinnedBytesNeeded: world_size must be >= 1");
  // The layout the engine builds for these parameters (Engine::Impl and RegisterParameter),
  // planned under an unlimited budget: what the plan takes is what the budget must hold.
  Layout layout(world_size, config.bf16 ? 2 : 4, config.optimizer_state_type);
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
  return plan.fixed + plan.grads_min;
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
                                             const PinnedArena& arena, const EngineHooks& hooks) {
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
  so.fault_plan = hooks.fault_plan;
  so.durable = config.durable;
  // A store only a durable engine reopens: otherwise its files go when the engine does.
  so.remove_on_close = !config.durable;
  so.reserve_bytes = config.nvme_reserve_bytes;
  so.retained_commits = world > 1 ? 2 : 1;
  return so;
}

}  // namespace zinf
