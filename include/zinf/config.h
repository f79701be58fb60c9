// Engine configuration: a DeepSpeed-style JSON file (the zero_optimization / aio / optimizer /
// bf16 keys that apply) plus zinf-only keys under "zinf".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "zinf/cpu_adam.h"  // StateType
#include "zinf/field_count.h"
#include "zinf/status.h"

namespace zinf {

// Where a tensor class lives. DeepSpeed's offload "device": none -> kDevice, cpu, nvme.
enum class Tier { kDevice, kCpu, kNvme };
const char* TierName(Tier tier);

struct OffloadConfig {
  Tier tier = Tier::kDevice;
  std::vector<std::string> nvme_paths;  // "nvme_path" (string) plus zinf.nvme_paths
  uint32_t buffer_count = 4;
  uint64_t buffer_size = 100'000'000;   // offload_param.buffer_size (elements)
  uint64_t max_in_cpu = 1'000'000'000;  // offload_param.max_in_cpu (elements)
  bool pin_memory = true;
  bool pipeline_read = false;   // offload_optimizer.pipeline_read
  bool pipeline_write = false;  // offload_optimizer.pipeline_write
  // offload_optimizer.ratio: the share of sub-groups whose states are offloaded (device cpu or
  // nvme) and stepped by the CPU; the rest stay in device memory, stepped on the device.
  double ratio = 1.0;
};

struct AioConfig {
  uint32_t block_size = 1 << 20;
  uint32_t queue_depth = 32;
  uint32_t thread_count = 1;
  bool single_submit = false;
  bool overlap_events = true;
  std::string backend = "io_uring";  // zinf.io_backend: io_uring | libaio | psync
};

enum class OptimizerType { kAdam, kAdamW, kAdagrad, kLion };
// "Adam", "AdamW", "Adagrad" or "Lion": optimizer.type as a config names it (checkpoints
// record the lower-case names of engine/core/layout.h OptimizerTypeName).
const char* OptimizerConfigName(OptimizerType type);

struct OptimizerConfig {
  OptimizerType type = OptimizerType::kAdamW;
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
};

// DeepSpeed's "fp16" block: fp16 parameters (on every tier, fp32 masters) with loss scaling
// (engine/core/loss_scaler.h). loss_scale 0: dynamic, starting at 2^initial_scale_power,
// halved after `hysteresis` overflowing steps (each skipped), doubled after loss_scale_window
// steps without one, never below min_loss_scale; > 0: that static scale.
struct Fp16Config {
  bool enabled = false;
  double loss_scale = 0;
  int initial_scale_power = 16;
  uint64_t loss_scale_window = 1000;
  int hysteresis = 2;
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1;
};

// zinf.speculative_step: whether the CPU optimizer steps a sub-group as soon as its gradients
// are complete, before the global gradient norm (clipping) is known, and validates afterwards.
enum class SpeculativeStep { kOff, kOn, kAuto };

struct EngineConfig {
  // zero_optimization.stage. 3: the parameters, their gradients and the optimizer states are
  // partitioned over the ranks, each parameter gathered when used. 2: every rank keeps each
  // parameter whole in its device memory, gathered once right after each optimizer step (the
  // gradients and states stay partitioned). 1: as 2, and each gradient is summed over the
  // micro-steps on its own rank, then reduced once per optimizer step. 0 (plain data
  // parallelism in DeepSpeed) trains as 1: the same values, with the states still partitioned.
  int zero_stage = 3;
  OffloadConfig offload_param;
  OffloadConfig offload_optimizer;
  uint64_t sub_group_size = 1'000'000'000;         // elements per optimizer sub-group
  uint64_t prefetch_bucket_size = 50'000'000;      // elements in flight ahead of use
  uint64_t max_live_parameters = 1'000'000'000;    // elements resident on the device
  uint64_t max_reuse_distance = 1'000'000'000;     // elements: keep if reused sooner
  uint64_t param_persistence_threshold = 100'000;  // elements: smaller params persist
  // zero_optimization.zero_quantized_weights (ZeRO++'s qwZ): stage 3 with several ranks,
  // every parameter all-gather sends int8 codes with an fp32 scale per block of
  // zinf.quantization_block_size (256) elements (zinf/cpu_adam.h QuantizeParamsInt8: 1 + 4/256
  // bytes per element, a quarter of fp32's and about half of bf16's), decoded into the dtype on
  // arrival; every rank, its own partition included, computes with the decoded values (an
  // element's error at most its block's largest magnitude / 254, plus the dtype's rounding).
  // The masters and the optimizer stay exact. Ignored (with a warning) below stage 3 and
  // without effect on one rank.
  bool quantized_weights = false;
  // zero_optimization.zero_quantized_nontrainable_weights: the same for the frozen parameters
  // only. Frozen weights stored as int8 (zinf.frozen_weight_dtype) are always gathered in
  // their stored form, never quantized twice.
  bool quantized_nontrainable_weights = false;
  // zero_optimization.zero_quantized_gradients (ZeRO++'s qgZ, in one hop): stage 3 with several
  // ranks (ignored with a warning below stage 3, as in DeepSpeed), each gradient's
  // reduce-scatter becomes an all-to-all of int8 blocks (each rank's full
  // gradient, partition by partition, encoded as zero_quantized_weights' blocks: 1 + 4/256
  // bytes per value instead of 4), decoded and summed in fp32 in rank order by each partition's
  // owner. A NaN or inf on any rank reaches the owner as NaN (its block decodes to NaN), so the
  // checks and clipping see it as before. Each rank's contribution is off by at most its
  // block's largest magnitude / 254 (a non-finite value makes its whole block NaN). Partitions
  // under one block (zinf.quantization_block_size) go as they are.
  bool quantized_gradients = false;
  // zinf.quantized_gradient_bits 8 (default) or 4: the code of zero_quantized_gradients'
  // blocks. 4: two codes per byte (cpu_adam.h QuantizeGradsInt4; 0.5 + 4/256 bytes per value,
  // about half of int8's), each rank's contribution off by at most its block's largest
  // magnitude / 14 (int8: / 254); DeepSpeed's qgZ sends int4.
  uint32_t quantized_gradient_bits = 8;
  // zinf.quantization_block_size: the values sharing one fp32 scale in zero_quantized_weights'
  // and zero_quantized_gradients' blocks, a power of two from 64 to 1024 (cpu_adam.h
  // QuantBlockValid; default 256, as the stored int8 formats). Smaller blocks bound each value's
  // error by a smaller largest magnitude and send 4 bytes of scale per block more often (int8:
  // 1 + 4/64 bytes per value at 64, 1 + 4/1024 at 1024). Frozen int8 weights are gathered in
  // their stored blocks of 256 whatever it is.
  uint32_t quantization_block_size = 256;
  // zero_optimization.zero_hpz_partition_size (ZeRO++'s hpZ): K > 1 at stage 3 with several
  // ranks (a multiple of K, each K consecutive ranks one node): after a parameter's gather
  // each rank keeps a secondary shard, the 1/K of the gathered parameter its place in the
  // node is for, in pinned host memory (counted in zinf.pinned_budget_bytes); the parameter's
  // next gathers at the same version (the backward's, every micro-batch's) all-gather the
  // shards inside the node instead of across every rank, and read nothing from NVMe. The
  // values are the same bits. 1: off (the default); ignored with a warning below stage 3.
  uint32_t hpz_partition_size = 1;
  AioConfig aio;
  OptimizerConfig optimizer;
  bool bf16 = false;
  Fp16Config fp16;
  double gradient_clipping = 0.0;  // max global L2 norm; 0 = off
  int gradient_accumulation_steps = 1;
  uint64_t train_micro_batch_size_per_gpu = 0;  // informational, for the trainer
  uint64_t train_batch_size = 0;                // informational, for the trainer

  // zinf-only ("zinf": {...}).
  uint64_t device_budget_bytes = 0;  // 0 = whatever the device reports
  uint64_t pinned_budget_bytes = 1ull << 30;
  uint64_t nvme_capacity_bytes = 0;  // per path; 0 = grow until the disk is full
  // Free space the swap files never take (zinf.nvme_reserve_bytes); UINT64_MAX: 2 % of the
  // filesystem, at most 4 GiB.
  uint64_t nvme_reserve_bytes = UINT64_MAX;
  bool delayed_update = false;  // one-step delayed parameter update
  // With delayed_update: the first this-many optimizer steps run undelayed (early training
  // moves fast; a stale step costs most there), the delay starts after them.
  uint64_t delayed_update_after = 0;
  // Crash-consistent swap store (zinf.durable): every optimizer step commits the NVMe store,
  // and Engine::ResumeFromStore continues from the last commit without a checkpoint copy.
  // Needs offload_optimizer on nvme (and offload_param on nvme and one rank with
  // delayed_update); up to
  // twice the NVMe space of the states (three times with several ranks, whose stores retain
  // two commits).
  bool durable = false;
  // A fresh engine (no ResumeFromStore), durable or not, may replace a swap store that any of
  // its NVMe folders holds (a durable store's commits, an index, swap files without a mark);
  // false: refused (AlreadyExists), naming the folder and the committed step
  // (zinf.durable_overwrite).
  bool durable_overwrite = false;
  bool checksums = false;  // per-chunk checksums in the swap store
  // zinf.gradient_transfer_dtype "bf16" (default "fp32"): each gradient partition is rounded
  // to bf16 on the device (nearest even, as Fp32ToBf16) before it is copied to the host, and
  // widened back to fp32 there, where accumulation and the optimizer stay fp32: half the
  // bytes across the link, at one bf16 rounding (8 significant bits) per micro-step's
  // gradient. With several ranks the reduce-scatter sums in fp32 first.
  bool gradient_transfer_bf16 = false;
  // zinf.schedule "layer-major" (default "micro-batch"): how the trainer orders a window's
  // gradient_accumulation_steps micro-batches. "micro-batch": one micro-batch's forward and
  // backward per Step (every parameter fetched once per pass per micro-batch). "layer-major":
  // the trainer runs each layer for every micro-batch before the next layer, so the whole
  // window is one Step and a parameter is fetched once per pass; each gradient names its
  // micro-batch (ReduceGradient(id, grad, j), j in micro-batch order per parameter) and is
  // summed in that order, so the result is the micro-batch schedule's, bit for bit.
  bool layer_major = false;
  // zinf.optimizer_state_dtype "fp32" (default), "bf16" or "int8": how the optimizer states
  // (Adam's two moments, Lion's momentum, Adagrad's sum) are stored on every tier between
  // steps (zinf/cpu_adam.h StateType: bf16 nearest even; int8 blockwise, 1 + 4/256 bytes per
  // element). The master parameters stay fp32. Adagrad refuses int8.
  StateType optimizer_state_type = StateType::kF32;
  // zinf.frozen_weight_dtype "as-is" (default) or "int8": how frozen parameters
  // (ParamSpec::trainable false) are stored on the cpu and nvme tiers. int8: linear blockwise
  // (kInt8StateBlock elements share an fp32 scale, their largest magnitude / 127; 1 + 4/256
  // bytes per element), dequantised into the parameter dtype on the host as they are fetched
  // (several ranks at stage 3: gathered as int8 and dequantised on the device);
  // the error of an element is at most its block's largest magnitude / 254. Needs
  // offload_param.device cpu or nvme.
  bool frozen_int8 = false;
  int optimizer_threads = 0;  // CPU Adam threads; 0 = all cores
  // zinf.speculative_step true | false | "auto" (default): with gradient clipping, each
  // sub-group stepped on the CPU is stepped as soon as its gradients are complete, with the
  // coefficient 1, after its pre-step [master | states] is copied into a snapshot block of the
  // pinned budget; once the global norm is known the step is kept (no clipping), redone from
  // the snapshot with the clipping coefficient, or rolled back (a non-finite norm: the step
  // fails as without speculation). The results are those of the step that waits for the norm,
  // bit for bit. "auto": on when the device is a GPU (on the host device the backward and its
  // copies take the cores speculation would use: slower than waiting there), the optimizer
  // states are in CPU memory (offload_optimizer.device cpu; with nvme the speculated
  // sub-groups' reads and writes compete with the backward's) and
  // half of what the pinned budget leaves has room for a snapshot (it takes at most that half,
  // one block per sub-group; true takes what it needs of all of it), else off, and not in a step
  // after one whose norm was clipped (clipping comes in runs, where speculating steps everything
  // twice); true: always, refused without that room. Without clipping nothing waits for the norm,
  // and this changes nothing: the finite check runs inside the step kernel either way. Sub-groups
  // stepped on the device are not speculated.
  SpeculativeStep speculative_step = SpeculativeStep::kAuto;
  // zinf.collective_timeout_seconds: with ranks as processes, how long a rank waits in one
  // collective (or at the group's creation) for its peers before every rank fails with a
  // message naming the collective. A peer that dies fails the others at once. Read by the
  // front ends that create the group (ProcessGroupOptions::timeout).
  double collective_timeout_seconds = 600;
  double host_copy_gbps = 0;  // HostDevice PCIe simulation; 0 = memcpy speed
  // When not empty, every NVMe path must lie inside one of these folders once symbolic links
  // are resolved (checked by Engine::Create), so a config cannot point the swapper elsewhere.
  std::vector<std::string> allowed_nvme_roots;
};

// The dtype the engine stores parameters in (their stores, fetches and the copies the optimizer
// writes): bf16 (bf16.enabled), fp16 (fp16.enabled) or fp32 (kNone). The masters stay fp32.
inline ParamCopyType StoredParamType(const EngineConfig& c) {
  if (c.bf16) return ParamCopyType::kBf16;
  return c.fp16.enabled ? ParamCopyType::kF16 : ParamCopyType::kNone;
}
// Whether an optimizer step waits for the global gradient norm: with clipping (its coefficient)
// and with fp16 (it decides overflow). Such a step needs every gradient of the window whole
// before any sub-group is stepped for good (no streaming accumulators, no stepping a
// gradient's landed pieces).
inline bool WaitsForGlobalNorm(const EngineConfig& c) {
  return c.gradient_clipping > 0 || c.fp16.enabled;
}
// Stages 0 to 2: every rank keeps each parameter whole in device memory between steps.
inline bool ReplicatesParameters(const EngineConfig& c) { return c.zero_stage < 3; }
// Stages 0 and 1 with accumulation: each gradient is summed over the window's micro-steps in
// a whole-parameter fp32 buffer of its own rank, and reduced once, at the window's end.
inline bool SumsGradientsLocally(const EngineConfig& c) {
  return c.zero_stage <= 1 && c.gradient_accumulation_steps > 1;
}
// "bf16", "fp16" or "fp32".
inline const char* StoredParamName(const EngineConfig& c) {
  switch (StoredParamType(c)) {
    case ParamCopyType::kBf16:
      return "bf16";
    case ParamCopyType::kF16:
      return "fp16";
    case ParamCopyType::kNone:
      break;
  }
  return "fp32";
}
// Bytes per stored parameter element: 2 (bf16, fp16) or 4.
inline size_t StoredParamBytes(const EngineConfig& c) {
  return StoredParamType(c) == ParamCopyType::kNone ? 4 : 2;
}

// Calls visit(name, value) for every EngineConfig field, in declaration order, so that a front
// end (the Python module's parse_config) reports them all without copying field by field.
// Names are the config's keys: DeepSpeed's by their path ("zero_optimization.offload_param.
// device", "optimizer.params.lr"), zinf's own by their name inside "zinf" ("durable"); values
// as a config writes them (an offload device "none", "cpu" or "nvme"; optimizer_state_dtype
// "int8"; speculative_step true, false or "auto"), numbers and lists as parsed. Two fields are
// visited as one key (optimizer.params.betas); an offload's nvme_path includes zinf.nvme_paths.
template <typename Visit>
void VisitEngineConfig(const EngineConfig& c, Visit&& visit) {
  // The keys each offload has (OffloadConfig holds both's).
  auto offload = [&](const std::string& key, const OffloadConfig& o, bool param) {
    visit((key + ".device").c_str(), o.tier == Tier::kDevice ? "none" : TierName(o.tier));
    visit((key + ".nvme_path").c_str(), o.nvme_paths);
    visit((key + ".buffer_count").c_str(), o.buffer_count);
    if (param) {
      visit((key + ".buffer_size").c_str(), o.buffer_size);
      visit((key + ".max_in_cpu").c_str(), o.max_in_cpu);
    }
    visit((key + ".pin_memory").c_str(), o.pin_memory);
    if (!param) {
      visit((key + ".pipeline_read").c_str(), o.pipeline_read);
      visit((key + ".pipeline_write").c_str(), o.pipeline_write);
      visit((key + ".ratio").c_str(), o.ratio);
    }
  };
  visit("zero_optimization.stage", c.zero_stage);
  offload("zero_optimization.offload_param", c.offload_param, true);
  offload("zero_optimization.offload_optimizer", c.offload_optimizer, false);
  visit("zero_optimization.sub_group_size", c.sub_group_size);
  visit("zero_optimization.stage3_prefetch_bucket_size", c.prefetch_bucket_size);
  visit("zero_optimization.stage3_max_live_parameters", c.max_live_parameters);
  visit("zero_optimization.stage3_max_reuse_distance", c.max_reuse_distance);
  visit("zero_optimization.stage3_param_persistence_threshold", c.param_persistence_threshold);
  visit("zero_optimization.zero_quantized_weights", c.quantized_weights);
  visit("zero_optimization.zero_quantized_nontrainable_weights", c.quantized_nontrainable_weights);
  visit("zero_optimization.zero_quantized_gradients", c.quantized_gradients);
  visit("zero_optimization.zero_hpz_partition_size", c.hpz_partition_size);
  visit("aio.block_size", c.aio.block_size);
  visit("aio.queue_depth", c.aio.queue_depth);
  visit("aio.thread_count", c.aio.thread_count);
  visit("aio.single_submit", c.aio.single_submit);
  visit("aio.overlap_events", c.aio.overlap_events);
  visit("io_backend", c.aio.backend);
  visit("optimizer.type", OptimizerConfigName(c.optimizer.type));
  visit("optimizer.params.lr", c.optimizer.lr);
  visit("optimizer.params.betas", std::vector<float>{c.optimizer.beta1, c.optimizer.beta2});
  visit("optimizer.params.eps", c.optimizer.eps);
  visit("optimizer.params.weight_decay", c.optimizer.weight_decay);
  visit("bf16.enabled", c.bf16);
  visit("fp16.enabled", c.fp16.enabled);
  visit("fp16.loss_scale", c.fp16.loss_scale);
  visit("fp16.initial_scale_power", c.fp16.initial_scale_power);
  visit("fp16.loss_scale_window", c.fp16.loss_scale_window);
  visit("fp16.hysteresis", c.fp16.hysteresis);
  visit("fp16.consecutive_hysteresis", c.fp16.consecutive_hysteresis);
  visit("fp16.min_loss_scale", c.fp16.min_loss_scale);
  visit("gradient_clipping", c.gradient_clipping);
  visit("gradient_accumulation_steps", c.gradient_accumulation_steps);
  visit("train_micro_batch_size_per_gpu", c.train_micro_batch_size_per_gpu);
  visit("train_batch_size", c.train_batch_size);
  visit("device_budget_bytes", c.device_budget_bytes);
  visit("pinned_budget_bytes", c.pinned_budget_bytes);
  visit("nvme_capacity_bytes", c.nvme_capacity_bytes);
  visit("nvme_reserve_bytes", c.nvme_reserve_bytes);  // UINT64_MAX: 2 %, at most 4 GiB
  visit("delayed_update", c.delayed_update);
  visit("delayed_update_after", c.delayed_update_after);
  visit("durable", c.durable);
  visit("durable_overwrite", c.durable_overwrite);
  visit("checksums", c.checksums);
  visit("gradient_transfer_dtype", c.gradient_transfer_bf16 ? "bf16" : "fp32");
  visit("schedule", c.layer_major ? "layer-major" : "micro-batch");
  visit("optimizer_state_dtype", StateTypeName(c.optimizer_state_type));
  visit("frozen_weight_dtype", c.frozen_int8 ? "int8" : "as-is");
  visit("quantized_gradient_bits", c.quantized_gradient_bits);
  visit("quantization_block_size", c.quantization_block_size);
  visit("optimizer_threads", c.optimizer_threads);
  if (c.speculative_step == SpeculativeStep::kAuto) {
    visit("speculative_step", "auto");
  } else {
    visit("speculative_step", c.speculative_step == SpeculativeStep::kOn);
  }
  visit("collective_timeout_seconds", c.collective_timeout_seconds);
  visit("host_copy_gbps", c.host_copy_gbps);
  visit("allowed_nvme_roots", c.allowed_nvme_roots);
}

#ifdef ZINF_HAS_FIELD_COUNT_CHECK
// The fields VisitEngineConfig visits: one added without a visit fails here.
static_assert(HasFields<EngineConfig, 40> && HasFields<OffloadConfig, 9> &&
                  HasFields<AioConfig, 6> && HasFields<OptimizerConfig, 6> &&
                  HasFields<Fp16Config, 7>,
              "EngineConfig gained or lost a field: update VisitEngineConfig and these counts");
#endif

// Parses a JSON config. Unknown keys add one warning each to *warnings (key path named);
// wrong types or values fail with a Status naming the key path ("zero_optimization.
// offload_optimizer.device: expected one of none, cpu, nvme, got \"disk\""). The result is
// validated: nvme tiers need at least one nvme path, sizes are positive, betas in [0, 1).
//
// Details a user may meet:
// - Integer fields accept integral floats (DeepSpeed's "sub_group_size": 1e9); 1.5 or -1 fail.
// - "nvme_path" is a string (DeepSpeed) or an array of strings; zinf.nvme_paths adds paths to
//   every offload whose device is nvme.
// - Optimizer type "Adam" means AdamW (decoupled weight decay) unless params.adam_w_mode is
//   false, as in DeepSpeed.
// - zinf.*_bytes accept "4G", "512M", "1.5GiB": units are powers of 1024, case-insensitive.
// - The Hugging Face Trainer placeholder "auto" keeps the zinf default (one warning lists them).
// - DeepSpeed keys with no zinf meaning (steps_per_print, overlap_comm, ...) are accepted
//   silently; "amp" enabled and ZeRO stages 0-2 fail with kNotSupported; "fp16" with "bf16"
//   both enabled fails with kInvalidArgument.
// - A key repeated within one object fails (as in DeepSpeed). Comments are allowed.
// Warnings are appended to *warnings; with warnings == nullptr they go to the zinf log.
Result<EngineConfig> ParseEngineConfig(const std::string& json_text,
                                       std::vector<std::string>* warnings);
// Reads `path` and parses it; a missing or unreadable file is a clear error (kNotFound when it
// does not exist). Errors and warnings from parsing start with "<path>: ".
Result<EngineConfig> LoadEngineConfig(const std::string& path, std::vector<std::string>* warnings);

// The checks ParseEngineConfig applies to what it parsed (nvme tiers have paths, sizes are
// positive, betas in [0, 1), ...), for a config built in code: InvalidArgument naming the key
// path. Engine::Create applies them too, so both ways in are checked the same.
Status ValidateEngineConfig(const EngineConfig& config);

// "4G", "512M", "1.5GiB", "4096": a byte count. Units are case-insensitive powers of 1024
// (K, KB and KiB all mean 1024), as memory sizes usually are. Errors start with `what`.
Result<uint64_t> ParseByteSize(const std::string& text, const std::string& what);

}  // namespace zinf
