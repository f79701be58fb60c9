#include "zinf/config.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <span>
#include <string_view>
#include <utility>

#include "common/file_io.h"
#include "config/json_reader.h"
#include "zinf/log.h"

namespace zinf {

// The reader (config/json_reader.h); this file maps the keys onto EngineConfig.
using namespace config_json;

const char* TierName(Tier tier) {
  switch (tier) {
    case Tier::kDevice:
      return "device";
    case Tier::kCpu:
      return "cpu";
    case Tier::kNvme:
      return "nvme";
  }
  return "unknown";
}

const char* OptimizerConfigName(OptimizerType type) {
  switch (type) {
    case OptimizerType::kAdam:
      return "Adam";
    case OptimizerType::kAdamW:
      return "AdamW";
    case OptimizerType::kAdagrad:
      return "Adagrad";
    case OptimizerType::kLion:
      return "Lion";
  }
  return "unknown";
}

namespace {

// Key paths of the sections, used in messages and in validation.
constexpr char kZero[] = "zero_optimization";
constexpr char kOffloadParam[] = "zero_optimization.offload_param";
constexpr char kOffloadOptimizer[] = "zero_optimization.offload_optimizer";

// Keys of the sections a user may write at the wrong level; an unknown top-level key that is
// one of these gets "did you mean zero_optimization.<key>?".
constexpr std::string_view kZeroKeys[] = {
    "stage",
    "offload_param",
    "offload_optimizer",
    "sub_group_size",
    "stage3_prefetch_bucket_size",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_param_persistence_threshold",
    "contiguous_gradients",
    "overlap_comm",
    "reduce_bucket_size",
    "reduce_scatter",
    "allgather_bucket_size",
    "stage3_gather_16bit_weights_on_model_save",
    "round_robin_gradients",
    "zero_quantized_weights",
    "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients",
    "zero_hpz_partition_size",
};
constexpr std::string_view kZinfKeys[] = {
    "device_budget_bytes",
    "pinned_budget_bytes",
    "nvme_capacity_bytes",
    "nvme_reserve_bytes",
    "delayed_update",
    "checksums",
    "optimizer_threads",
    "host_copy_gbps",
    "io_backend",
    "nvme_paths",
    "allowed_nvme_roots",
    "durable",
    "durable_overwrite",
    "delayed_update_after",
    "gradient_transfer_dtype",
    "schedule",
    "optimizer_state_dtype",
    "frozen_weight_dtype",
    "quantized_gradient_bits",
    "quantization_block_size",
    "collective_timeout_seconds",
    "speculative_step",
};
constexpr std::string_view kAioKeys[] = {
    "block_size", "queue_depth", "thread_count", "single_submit", "overlap_events", "use_gds",
};

}  // namespace

Result<uint64_t> ParseByteSize(const std::string& text, const std::string& path) {
  auto bad = [&] {
    return Status::InvalidArgument(path + ": expected a byte count such as 4294967296 or \"4G\" " +
                                   "(units B, K, M, G, T; powers of 1024), got \"" + text + "\"");
  };
  size_t i = 0;
  while (i < text.size() && text[i] == ' ') ++i;
  const size_t number_begin = i;
  while (i < text.size() && ((text[i] >= '0' && text[i] <= '9') || text[i] == '.')) ++i;
  std::string number = text.substr(number_begin, i - number_begin);
  if (number.empty() || number == "." || std::count(number.begin(), number.end(), '.') > 1) {
    return bad();
  }
  while (i < text.size() && text[i] == ' ') ++i;
  std::string unit = Lower(std::string_view(text).substr(i));
  while (!unit.empty() && unit.back() == ' ') unit.pop_back();
  int shift = -1;
  const std::pair<const char*, int> kUnits[] = {
      {"", 0},    {"b", 0},    {"k", 10}, {"kb", 10}, {"kib", 10}, {"m", 20},
      {"mb", 20}, {"mib", 20}, {"g", 30}, {"gb", 30}, {"gib", 30}, {"t", 40},
      {"tb", 40}, {"tib", 40}, {"p", 50}, {"pb", 50}, {"pib", 50},
  };
  for (const auto& [name, unit_shift] : kUnits) {
    if (unit == name) shift = unit_shift;
  }
  if (shift < 0) return bad();
  long double value = std::strtold(number.c_str(), nullptr) * std::ldexp(1.0L, shift);
  if (std::floor(value) != value) {
    return Status::InvalidArgument(path + ": \"" + text + "\" is not a whole number of bytes");
  }
  if (value >= 18446744073709551616.0L) {
    return Status::InvalidArgument(path + ": \"" + text + "\" is too large");
  }
  return static_cast<uint64_t>(value);
}

namespace {

// "betas": [beta1, beta2].
Status ReadBetas(ObjectReader& params, OptimizerConfig* optimizer) {
  const Json* v = params.Find("betas");
  if (v == nullptr || params.IsAuto(*v, "betas")) return Status::OK();
  const std::string path = params.PathOf("betas");
  if (!v->is_array() || v->size() != 2) {
    std::string got = Describe(*v);
    if (v->is_array()) got = "an array of length " + std::to_string(v->size());
    return Status::InvalidArgument(path +
                                   ": expected an array of two numbers [beta1, beta2], got " + got);
  }
  ZINF_ASSIGN_OR_RETURN(optimizer->beta1, ToFloat((*v)[0], path + "[0]"));
  ZINF_ASSIGN_OR_RETURN(optimizer->beta2, ToFloat((*v)[1], path + "[1]"));
  return Status::OK();
}

// offload_param or offload_optimizer (is_optimizer): the keys DeepSpeed defines for each.
Status ParseOffload(ObjectReader& r, bool is_optimizer, OffloadConfig* offload, ParseContext* ctx) {
  ZINF_RETURN_IF_ERROR(r.ReadEnum<Tier>(
      "device", {{"none", Tier::kDevice}, {"cpu", Tier::kCpu}, {"nvme", Tier::kNvme}},
      &offload->tier));
  bool has_path = false;
  ZINF_RETURN_IF_ERROR(r.ReadPaths("nvme_path", &offload->nvme_paths, &has_path));
  if (has_path && offload->tier != Tier::kNvme) {
    ctx->warnings.Add(r.PathOf("nvme_path") +
                      ": used only by offload_states(device=\"nvme\"), because device is \"" +
                      (offload->tier == Tier::kCpu ? "cpu" : "none") + "\"");
  }
  ZINF_RETURN_IF_ERROR(r.ReadUint32("buffer_count", &offload->buffer_count));
  ZINF_RETURN_IF_ERROR(r.ReadBool("pin_memory", &offload->pin_memory));
  if (!is_optimizer) {
    ZINF_RETURN_IF_ERROR(r.ReadUint64("buffer_size", &offload->buffer_size));
    ZINF_RETURN_IF_ERROR(r.ReadUint64("max_in_cpu", &offload->max_in_cpu));
  } else {
    bool pipeline = false;
    ZINF_RETURN_IF_ERROR(r.ReadBool("pipeline", &pipeline));
    if (pipeline) offload->pipeline_read = offload->pipeline_write = true;
    ZINF_RETURN_IF_ERROR(r.ReadBool("pipeline_read", &offload->pipeline_read));
    ZINF_RETURN_IF_ERROR(r.ReadBool("pipeline_write", &offload->pipeline_write));
    bool fast_init = false;  // DeepSpeed's swap-file initialisation shortcut; zinf fallocates
    ZINF_RETURN_IF_ERROR(r.ReadBool("fast_init", &fast_init));
    ZINF_RETURN_IF_ERROR(r.ReadDouble("ratio", &offload->ratio));
  }
  r.Finish();
  return Status::OK();
}

Status ParseZeroOptimization(ObjectReader& r, EngineConfig* config, ParseContext* ctx) {
  if (const Json* stage = r.Find("stage"); stage != nullptr) {
    ZINF_ASSIGN_OR_RETURN(uint64_t value, ToUnsigned(*stage, r.PathOf("stage"), UINT64_MAX));
    if (value > 3) {
      return Status::InvalidArgument(r.PathOf("stage") + ": expected 0, 1, 2 or 3 (DeepSpeed's " +
                                     "ZeRO stages), got " + Describe(*stage));
    }
    config->zero_stage = static_cast<int>(value);
  }
  ZINF_ASSIGN_OR_RETURN(std::optional<ObjectReader> param, r.Object("offload_param"));
  if (param) ZINF_RETURN_IF_ERROR(ParseOffload(*param, false, &config->offload_param, ctx));
  ZINF_ASSIGN_OR_RETURN(std::optional<ObjectReader> opt, r.Object("offload_optimizer"));
  if (opt) ZINF_RETURN_IF_ERROR(ParseOffload(*opt, true, &config->offload_optimizer, ctx));
  ZINF_RETURN_IF_ERROR(r.ReadUint64("sub_group_size", &config->sub_group_size));
  ZINF_RETURN_IF_ERROR(r.ReadUint64("stage3_prefetch_bucket_size", &config->prefetch_bucket_size));
  ZINF_RETURN_IF_ERROR(r.ReadUint64("stage3_max_live_parameters", &config->max_live_parameters));
  ZINF_RETURN_IF_ERROR(r.ReadUint64("stage3_max_reuse_distance", &config->max_reuse_distance));
  ZINF_RETURN_IF_ERROR(
      r.ReadUint64("stage3_param_persistence_threshold", &config->param_persistence_threshold));
  // Communication and bucketing knobs of DeepSpeed's own implementation: no zinf meaning.
  r.Ignore({"contiguous_gradients", "overlap_comm", "reduce_bucket_size", "reduce_scatter",
            "allgather_bucket_size", "allgather_partitions",
            "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
            "round_robin_gradients", "memory_efficient_linear", "ignore_unused_parameters",
            "elastic_checkpoint", "load_from_fp32_weights", "stage3_model_persistence_threshold",
            "stage3_module_granularity_threshold", "log_trace_cache_warnings",
            "use_multi_rank_bucket_allreduce", "legacy_stage1"});
  for (std::string_view key : {"cpu_offload", "cpu_offload_params", "cpu_offload_use_pin_memory"}) {
    r.IgnoreWithWarning(key,
                        "deprecated DeepSpeed key, ignored; use offload_optimizer / offload_param "
                        "with \"device\": \"cpu\"");
  }
  ZINF_RETURN_IF_ERROR(r.ReadBool("zero_quantized_weights", &config->quantized_weights));
  ZINF_RETURN_IF_ERROR(
      r.ReadBool("zero_quantized_nontrainable_weights", &config->quantized_nontrainable_weights));
  ZINF_RETURN_IF_ERROR(r.ReadBool("zero_quantized_gradients", &config->quantized_gradients));
  ZINF_RETURN_IF_ERROR(r.ReadUint32("zero_hpz_partition_size", &config->hpz_partition_size));
  if (config->hpz_partition_size == 0) {
    return Status::InvalidArgument(r.PathOf("zero_hpz_partition_size") +
                                   ": 0; give the ranks per node (1: off, the default)");
  }
  for (std::string_view key : {"mics_shard_size", "mics_hierarchical_params_gather"}) {
    r.IgnoreWithWarning(key, "DeepSpeed feature not implemented by zinf, ignored");
  }
  r.Finish();
  return Status::OK();
}

Status ParseOptimizer(ObjectReader& r, OptimizerConfig* optimizer, ParseContext* ctx) {
  const Json* type = r.Find("type");
  if (type == nullptr) {
    return Status::InvalidArgument(r.PathOf("type") +
                                   ": missing; set \"type\" to one of Adam, AdamW, Adagrad, Lion");
  }
  OptimizerType kind = OptimizerType::kAdamW;
  ZINF_RETURN_IF_ERROR(r.ReadEnum<OptimizerType>("type",
                                                 {{"Adam", OptimizerType::kAdam},
                                                  {"AdamW", OptimizerType::kAdamW},
                                                  {"Adagrad", OptimizerType::kAdagrad},
                                                  {"Lion", OptimizerType::kLion}},
                                                 &kind));
  r.Ignore({"legacy_fusion"});
  std::optional<bool> adam_w_mode;
  ZINF_ASSIGN_OR_RETURN(std::optional<ObjectReader> params, r.Object("params"));
  if (params) {
    ZINF_RETURN_IF_ERROR(params->ReadFloat("lr", &optimizer->lr));
    ZINF_RETURN_IF_ERROR(ReadBetas(*params, optimizer));
    ZINF_RETURN_IF_ERROR(params->ReadFloat("eps", &optimizer->eps));
    ZINF_RETURN_IF_ERROR(params->ReadFloat("weight_decay", &optimizer->weight_decay));
    if (params->Find("adam_w_mode") != nullptr) {
      bool mode = true;
      ZINF_RETURN_IF_ERROR(params->ReadBool("adam_w_mode", &mode));
      adam_w_mode = mode;
    }
    bool bias_correction = true;
    ZINF_RETURN_IF_ERROR(params->ReadBool("bias_correction", &bias_correction));
    if (!bias_correction) {
      return Status::NotSupported(params->PathOf("bias_correction") +
                                  ": zinf always applies Adam bias correction; remove the key or "
                                  "set it to true");
    }
    bool amsgrad = false;
    ZINF_RETURN_IF_ERROR(params->ReadBool("amsgrad", &amsgrad));
    if (amsgrad) {
      return Status::NotSupported(params->PathOf("amsgrad") +
                                  ": AMSGrad is not supported; remove the key or set it to false");
    }
    params->Ignore({"torch_adam", "fused"});  // implementation choices; zinf has its own
    if (adam_w_mode.has_value() &&
        (kind == OptimizerType::kAdagrad || kind == OptimizerType::kLion)) {
      ctx->warnings.Add(params->PathOf("adam_w_mode") + ": applies only to type Adam; ignored");
    } else if (adam_w_mode == false && kind == OptimizerType::kAdamW) {
      ctx->warnings.Add(params->PathOf("adam_w_mode") +
                        ": false has no effect with type AdamW; use type Adam for L2 weight decay");
    }
    params->Finish();
  }
  // As in DeepSpeed, type Adam means AdamW (decoupled weight decay) unless adam_w_mode is false.
  if (kind == OptimizerType::kAdam && adam_w_mode.value_or(true)) kind = OptimizerType::kAdamW;
  optimizer->type = kind;
  r.Finish();
  return Status::OK();
}

Status ParseAio(ObjectReader& r, AioConfig* aio, ParseContext* ctx) {
  ZINF_RETURN_IF_ERROR(r.ReadUint32("block_size", &aio->block_size));
  ZINF_RETURN_IF_ERROR(r.ReadUint32("queue_depth", &aio->queue_depth));
  ZINF_RETURN_IF_ERROR(r.ReadUint32("intra_op_parallelism", &aio->thread_count));  // newer name
  ZINF_RETURN_IF_ERROR(r.ReadUint32("thread_count", &aio->thread_count));
  ZINF_RETURN_IF_ERROR(r.ReadBool("single_submit", &aio->single_submit));
  ZINF_RETURN_IF_ERROR(r.ReadBool("overlap_events", &aio->overlap_events));
  bool use_gds = false;
  ZINF_RETURN_IF_ERROR(r.ReadBool("use_gds", &use_gds));
  if (use_gds) {
    ctx->warnings.Add(r.PathOf("use_gds") +
                      ": GPUDirect Storage is not supported; ignored, NVMe I/O goes through "
                      "pinned host buffers");
  }
  r.Finish();
  return Status::OK();
}

// "zinf": {...}. zinf.nvme_paths go to *extra_nvme_paths; the caller adds them to nvme tiers.
Status ParseZinf(ObjectReader& r, EngineConfig* config, std::vector<std::string>* extra_nvme_paths,
                 bool* has_extra_paths) {
  ZINF_RETURN_IF_ERROR(r.ReadByteSize("device_budget_bytes", &config->device_budget_bytes));
  ZINF_RETURN_IF_ERROR(r.ReadByteSize("pinned_budget_bytes", &config->pinned_budget_bytes));
  ZINF_RETURN_IF_ERROR(r.ReadByteSize("nvme_capacity_bytes", &config->nvme_capacity_bytes));
  ZINF_RETURN_IF_ERROR(r.ReadByteSize("nvme_reserve_bytes", &config->nvme_reserve_bytes));
  ZINF_RETURN_IF_ERROR(r.ReadBool("delayed_update", &config->delayed_update));
  ZINF_RETURN_IF_ERROR(r.ReadBool("durable", &config->durable));
  ZINF_RETURN_IF_ERROR(r.ReadBool("durable_overwrite", &config->durable_overwrite));
  ZINF_RETURN_IF_ERROR(r.ReadUint64("delayed_update_after", &config->delayed_update_after));
  ZINF_RETURN_IF_ERROR(r.ReadBool("checksums", &config->checksums));
  ZINF_RETURN_IF_ERROR(r.ReadInt("optimizer_threads", &config->optimizer_threads));
  ZINF_RETURN_IF_ERROR(r.ReadDouble("host_copy_gbps", &config->host_copy_gbps));
  ZINF_RETURN_IF_ERROR(
      r.ReadDouble("collective_timeout_seconds", &config->collective_timeout_seconds));
  ZINF_RETURN_IF_ERROR(r.ReadEnum<std::string>(
      "io_backend", {{"io_uring", "io_uring"}, {"libaio", "libaio"}, {"psync", "psync"}},
      &config->aio.backend));
  ZINF_RETURN_IF_ERROR(r.ReadEnum<bool>("gradient_transfer_dtype",
                                        {{"fp32", false}, {"bf16", true}},
                                        &config->gradient_transfer_bf16));
  ZINF_RETURN_IF_ERROR(r.ReadEnum<bool>("schedule", {{"micro-batch", false}, {"layer-major", true}},
                                        &config->layer_major));
  ZINF_RETURN_IF_ERROR(r.ReadEnum<StateType>(
      "optimizer_state_dtype",
      {{"fp32", StateType::kF32}, {"bf16", StateType::kBf16}, {"int8", StateType::kInt8}},
      &config->optimizer_state_type));
  ZINF_RETURN_IF_ERROR(r.ReadEnum<bool>("frozen_weight_dtype", {{"as-is", false}, {"int8", true}},
                                        &config->frozen_int8));
  ZINF_RETURN_IF_ERROR(r.ReadUint32("quantized_gradient_bits", &config->quantized_gradient_bits));
  ZINF_RETURN_IF_ERROR(r.ReadUint32("quantization_block_size", &config->quantization_block_size));
  {
    std::optional<bool> speculative =
        config->speculative_step == SpeculativeStep::kAuto
            ? std::nullopt
            : std::optional<bool>(config->speculative_step == SpeculativeStep::kOn);
    ZINF_RETURN_IF_ERROR(r.ReadBoolOrAuto("speculative_step", &speculative));
    config->speculative_step = !speculative.has_value() ? SpeculativeStep::kAuto
                               : *speculative           ? SpeculativeStep::kOn
                                                        : SpeculativeStep::kOff;
  }
  if (const Json* paths = r.Find("nvme_paths"); paths != nullptr && !paths->is_null()) {
    if (!paths->is_array()) {
      return TypeError(r.PathOf("nvme_paths"), "an array of path strings", *paths);
    }
    ZINF_RETURN_IF_ERROR(r.ReadPaths("nvme_paths", extra_nvme_paths, has_extra_paths));
  }
  if (const Json* roots = r.Find("allowed_nvme_roots"); roots != nullptr && !roots->is_null()) {
    if (!roots->is_array()) {
      return TypeError(r.PathOf("allowed_nvme_roots"), "an array of folder strings", *roots);
    }
    bool present = false;
    ZINF_RETURN_IF_ERROR(r.ReadPaths("allowed_nvme_roots", &config->allowed_nvme_roots, &present));
  }
  r.Finish();
  return Status::OK();
}

// Precision sections: "bf16" (and its old name "bfloat16"), "fp16", "amp".
Status ParsePrecision(ObjectReader& root, EngineConfig* config) {
  for (const char* name : {"bfloat16", "bf16"}) {
    ZINF_ASSIGN_OR_RETURN(std::optional<ObjectReader> bf16, root.Object(name));
    if (!bf16) continue;
    ZINF_RETURN_IF_ERROR(bf16->ReadBool("enabled", &config->bf16));
    bf16->Ignore({"immediate_grad_update", "check_grad_overflow"});
    bf16->Finish();
  }
  ZINF_ASSIGN_OR_RETURN(std::optional<ObjectReader> fp16, root.Object("fp16"));
  if (fp16) {
    Fp16Config& f = config->fp16;
    ZINF_RETURN_IF_ERROR(fp16->ReadBool("enabled", &f.enabled));
    ZINF_RETURN_IF_ERROR(fp16->ReadDouble("loss_scale", &f.loss_scale));
    ZINF_RETURN_IF_ERROR(fp16->ReadInt("initial_scale_power", &f.initial_scale_power));
    ZINF_RETURN_IF_ERROR(fp16->ReadUint64("loss_scale_window", &f.loss_scale_window));
    ZINF_RETURN_IF_ERROR(fp16->ReadInt("hysteresis", &f.hysteresis));
    ZINF_RETURN_IF_ERROR(fp16->ReadBool("consecutive_hysteresis", &f.consecutive_hysteresis));
    ZINF_RETURN_IF_ERROR(fp16->ReadDouble("min_loss_scale", &f.min_loss_scale));
    // (fp32 masters and states are zinf's anyway; autocast is the trainer's business.)
    fp16->Ignore({"fp16_master_weights_and_grads"});
    bool auto_cast = false;
    ZINF_RETURN_IF_ERROR(fp16->ReadBool("auto_cast", &auto_cast));
    if (auto_cast) {
      fp16->IgnoreWithWarning("auto_cast",
                              "zinf does not cast the model's inputs; run the forward under "
                              "torch.autocast(dtype=torch.float16) in the trainer");
    }
    fp16->Finish();
  }
  ZINF_ASSIGN_OR_RETURN(std::optional<ObjectReader> amp, root.Object("amp"));
  if (amp) {
    bool enabled = false;
    ZINF_RETURN_IF_ERROR(amp->ReadBool("enabled", &enabled));
    if (enabled) {
      return Status::NotSupported(amp->PathOf("enabled") +
                                  ": Apex AMP is not supported; use bf16 (set \"amp\": "
                                  "{\"enabled\": false} and \"bf16\": {\"enabled\": true})");
    }
    amp->IgnoreOtherKeys();
  }
  return Status::OK();
}

Status ParseRoot(ObjectReader& root, EngineConfig* config, ParseContext* ctx) {
  ZINF_RETURN_IF_ERROR(root.ReadUint64("train_batch_size", &config->train_batch_size));
  ZINF_RETURN_IF_ERROR(
      root.ReadUint64("train_micro_batch_size_per_gpu", &config->train_micro_batch_size_per_gpu));
  ZINF_RETURN_IF_ERROR(
      root.ReadInt("gradient_accumulation_steps", &config->gradient_accumulation_steps));
  ZINF_RETURN_IF_ERROR(root.ReadDouble("gradient_clipping", &config->gradient_clipping));
  ZINF_RETURN_IF_ERROR(ParsePrecision(root, config));

  ZINF_ASSIGN_OR_RETURN(std::optional<ObjectReader> optimizer, root.Object("optimizer"));
  if (optimizer) ZINF_RETURN_IF_ERROR(ParseOptimizer(*optimizer, &config->optimizer, ctx));
  ZINF_ASSIGN_OR_RETURN(std::optional<ObjectReader> zero, root.Object(kZero));
  if (zero) ZINF_RETURN_IF_ERROR(ParseZeroOptimization(*zero, config, ctx));
  ZINF_ASSIGN_OR_RETURN(std::optional<ObjectReader> aio, root.Object("aio"));
  if (aio) ZINF_RETURN_IF_ERROR(ParseAio(*aio, &config->aio, ctx));

  std::vector<std::string> extra_paths;
  bool has_extra_paths = false;
  ZINF_ASSIGN_OR_RETURN(std::optional<ObjectReader> zinf, root.Object("zinf"));
  if (zinf) ZINF_RETURN_IF_ERROR(ParseZinf(*zinf, config, &extra_paths, &has_extra_paths));
  bool any_nvme = false;
  for (OffloadConfig* offload : {&config->offload_param, &config->offload_optimizer}) {
    if (offload->tier != Tier::kNvme) continue;
    any_nvme = true;
    for (const std::string& path : extra_paths) {
      if (std::find(offload->nvme_paths.begin(), offload->nvme_paths.end(), path) ==
          offload->nvme_paths.end()) {
        offload->nvme_paths.push_back(path);
      }
    }
  }
  if (has_extra_paths && !any_nvme) {
    ctx->warnings.Add(
        "zinf.nvme_paths: not used, because neither offload_param nor offload_optimizer has "
        "\"device\": \"nvme\"");
  }

  // Keys a DeepSpeed config carries that have no zinf meaning (logging, monitoring,
  // communication dtype, activation checkpointing that the trainer owns).
  root.Ignore({"steps_per_print",
               "wall_clock_breakdown",
               "zero_allow_untested_optimizer",
               "gradient_predivide_factor",
               "prescale_gradients",
               "communication_data_type",
               "seq_parallel_communication_data_type",
               "flops_profiler",
               "tensorboard",
               "wandb",
               "csv_monitor",
               "comet",
               "comms_logger",
               "activation_checkpointing",
               "memory_breakdown",
               "dump_state",
               "zero_force_ds_cpu_optimizer",
               "checkpoint",
               "load_universal_checkpoint",
               "data_types",
               "disable_allgather"});
  root.IgnoreWithWarning("scheduler",
                         "ignored; zinf does not run DeepSpeed learning-rate schedulers, the "
                         "trainer sets the learning rate each step");
  for (std::string_view key :
       {"elasticity", "autotuning", "compression_training", "data_efficiency",
        "curriculum_learning", "sparse_attention", "pipeline", "sparse_gradients"}) {
    root.IgnoreWithWarning(key, "DeepSpeed feature not implemented by zinf, ignored");
  }
  root.Finish({{kZero, kZeroKeys}, {"zinf", kZinfKeys}, {"aio", kAioKeys}});
  return Status::OK();
}

// The InvalidArgument for key `path`: "<path>: <what>", with the key attached for front ends.
Status InvalidKey(const std::string& path, const std::string& what) {
  return Status::InvalidArgument(path + ": " + what).WithKey(path);
}

// The zero_optimization section: both offloads, then the sub-group and live-parameter sizes.
Status ValidateZeroOptimization(const EngineConfig& c) {
  if (c.zero_stage < 0 || c.zero_stage > 3) {
    return InvalidKey("zero_optimization.stage",
                      "expected 0, 1, 2 or 3, got " + std::to_string(c.zero_stage));
  }
  if (c.zero_stage < 3 && c.delayed_update) {
    return InvalidKey("zinf.delayed_update",
                      "needs zero_optimization.stage 3 (with stage " +
                          std::to_string(c.zero_stage) +
                          " every rank gathers the updated parameters right after the step, "
                          "so there is no step to overlap); set \"stage\": 3 or turn it off");
  }
  const std::pair<const OffloadConfig*, const char*> offloads[] = {
      {&c.offload_param, kOffloadParam}, {&c.offload_optimizer, kOffloadOptimizer}};
  for (const auto& [offload, path] : offloads) {
    if (offload->tier == Tier::kNvme && offload->nvme_paths.empty()) {
      return InvalidKey(std::string(path) + ".nvme_path",
                        "device is \"nvme\" but no NVMe path is set; set \"nvme_path\": "
                        "\"/local_nvme\" (a directory on an NVMe drive) there, or list paths in "
                        "zinf.nvme_paths");
    }
    if (offload->buffer_count < 1) {
      return InvalidKey(std::string(path) + ".buffer_count", "must be at least 1, got 0");
    }
  }
  if (c.offload_param.buffer_size == 0) {
    return InvalidKey(std::string(kOffloadParam) + ".buffer_size",
                      "must be positive (elements per swap buffer), got 0");
  }
  if (!(c.offload_optimizer.ratio >= 0 && c.offload_optimizer.ratio <= 1)) {
    return InvalidKey(std::string(kOffloadOptimizer) + ".ratio",
                      "must be in [0, 1] (the fraction of optimizer state offloaded), got " +
                          FormatNumber(c.offload_optimizer.ratio));
  }
  if (c.sub_group_size == 0) {
    return InvalidKey(std::string(kZero) + ".sub_group_size",
                      "must be positive (elements per optimizer sub-group, e.g. 1e9), got 0");
  }
  if (c.max_live_parameters == 0) {
    return InvalidKey(std::string(kZero) + ".stage3_max_live_parameters",
                      "must be positive (elements resident on the device, e.g. 1e9), got 0");
  }
  return Status::OK();
}

// The optimizer section's params: lr, betas, eps, weight_decay.
Status ValidateOptimizer(const OptimizerConfig& o) {
  if (!(o.lr >= 0))
    return InvalidKey("optimizer.params.lr", "must be >= 0, got " + FormatNumber(o.lr));
  const std::pair<float, const char*> betas[] = {{o.beta1, "beta1"}, {o.beta2, "beta2"}};
  for (const auto& [beta, name] : betas) {
    if (!(beta >= 0 && beta < 1)) {
      return InvalidKey("optimizer.params.betas", std::string(name) + " must be in [0, 1), got " +
                                                      FormatNumber(beta) +
                                                      "; typical values are [0.9, 0.999]");
    }
  }
  if (!(o.eps > 0)) {
    return InvalidKey("optimizer.params.eps",
                      "must be > 0 (e.g. 1e-8), got " + FormatNumber(o.eps));
  }
  if (!(o.weight_decay >= 0)) {
    return InvalidKey("optimizer.params.weight_decay",
                      "must be >= 0, got " + FormatNumber(o.weight_decay));
  }
  return Status::OK();
}

// The top-level batch keys: accumulation steps, clipping, and a train_batch_size that the
// micro batch times the accumulation steps divides.
Status ValidateBatch(const EngineConfig& c) {
  if (c.gradient_accumulation_steps < 1) {
    return InvalidKey("gradient_accumulation_steps",
                      "must be at least 1, got " + std::to_string(c.gradient_accumulation_steps));
  }
  if (!(c.gradient_clipping >= 0)) {
    return InvalidKey("gradient_clipping", "must be >= 0 (0 turns clipping off), got " +
                                               FormatNumber(c.gradient_clipping));
  }
  if (c.train_batch_size > 0 && c.train_micro_batch_size_per_gpu > 0) {
    unsigned __int128 per_rank = static_cast<unsigned __int128>(c.train_micro_batch_size_per_gpu) *
                                 static_cast<unsigned>(c.gradient_accumulation_steps);
    if (c.train_batch_size % per_rank != 0) {
      return InvalidKey("train_batch_size",
                        std::to_string(c.train_batch_size) +
                            " is not a multiple of train_micro_batch_size_per_gpu (" +
                            std::to_string(c.train_micro_batch_size_per_gpu) +
                            ") x gradient_accumulation_steps (" +
                            std::to_string(c.gradient_accumulation_steps) +
                            "); it must equal micro batch x accumulation steps x data-parallel "
                            "ranks");
    }
  }
  return Status::OK();
}

// The aio section: block size, queue depth, thread count.
Status ValidateAio(const AioConfig& aio) {
  if (aio.block_size == 0 || aio.block_size % 4096 != 0) {
    return InvalidKey("aio.block_size",
                      "must be a positive multiple of 4096 bytes (e.g. 1048576), got " +
                          std::to_string(aio.block_size));
  }
  if (aio.queue_depth < 1 || aio.queue_depth > 4096) {
    return InvalidKey("aio.queue_depth",
                      "must be in 1..4096, got " + std::to_string(aio.queue_depth));
  }
  if (aio.thread_count < 1 || aio.thread_count > 1024) {
    return InvalidKey("aio.thread_count",
                      "must be in 1..1024, got " + std::to_string(aio.thread_count));
  }
  return Status::OK();
}

// The zinf section: its ranges, then the combinations it refuses (int8 frozen weights on the
// device tier, int8 states with Adagrad).
Status ValidateZinf(const EngineConfig& c) {
  if (c.quantized_gradient_bits != 4 && c.quantized_gradient_bits != 8) {
    return InvalidKey("zinf.quantized_gradient_bits",
                      std::to_string(c.quantized_gradient_bits) +
                          "; zero_quantized_gradients' blocks are 8 (the default) or 4 bits");
  }
  if (!QuantBlockValid(c.quantization_block_size)) {
    return InvalidKey("zinf.quantization_block_size",
                      std::to_string(c.quantization_block_size) +
                          "; the values per scale of the quantized collectives' blocks: a power "
                          "of two from 64 to 1024 (default 256)");
  }
  if (!(c.collective_timeout_seconds >= 1 && c.collective_timeout_seconds <= 7 * 86400)) {
    return InvalidKey("zinf.collective_timeout_seconds",
                      "must be in 1..604800 seconds (how long a rank waits in a collective for "
                      "its peers), got " +
                          std::to_string(c.collective_timeout_seconds));
  }
  if (c.optimizer_threads < 0 || c.optimizer_threads > 4096) {
    return InvalidKey("zinf.optimizer_threads", "must be in 0..4096 (0: every CPU), got " +
                                                    std::to_string(c.optimizer_threads));
  }
  if (c.nvme_capacity_bytes != 0 &&
      (c.nvme_capacity_bytes % 4096 != 0 || c.nvme_capacity_bytes < (uint64_t{1} << 20))) {
    return InvalidKey("zinf.nvme_capacity_bytes",
                      "must be 0 (no limit) or a multiple of 4096 bytes of at least 1 MiB (the "
                      "swap file's growth limit per folder, e.g. \"64G\"), got " +
                          std::to_string(c.nvme_capacity_bytes));
  }
  if (c.pinned_budget_bytes == 0) {
    return InvalidKey("zinf.pinned_budget_bytes",
                      "must be positive (pinned host memory for transfers), e.g. \"1G\"; got 0");
  }
  if (!(c.host_copy_gbps >= 0)) {
    return InvalidKey("zinf.host_copy_gbps",
                      "must be >= 0 (0 means memcpy speed), got " + FormatNumber(c.host_copy_gbps));
  }
  if (c.frozen_int8 && c.offload_param.tier == Tier::kDevice) {
    return InvalidKey("zinf.frozen_weight_dtype",
                      "\"int8\" stores frozen weights on the cpu or nvme tier (dequantised on "
                      "the host as they are fetched); set offload_param.device cpu or nvme, or "
                      "keep \"as-is\"");
  }
  if (c.optimizer_state_type == StateType::kInt8 && c.optimizer.type == OptimizerType::kAdagrad) {
    return InvalidKey("zinf.optimizer_state_dtype",
                      "\"int8\" is not supported with optimizer type Adagrad (its sum of squares "
                      "only grows, which a blockwise 8-bit code cannot follow); use \"fp32\" or "
                      "\"bf16\"");
  }
  return Status::OK();
}

// The fp16 block: fp16 against bf16; the dynamic scale's settings once they are used (as
// DeepSpeed, which checks them only with fp16 enabled and loss_scale 0).
Status ValidateFp16(const EngineConfig& c) {
  const Fp16Config& f = c.fp16;
  if (!(f.loss_scale >= 0 && std::isfinite(f.loss_scale))) {
    return InvalidKey("fp16.loss_scale", "must be 0 (dynamic) or a positive static scale, got " +
                                             FormatNumber(f.loss_scale));
  }
  if (f.enabled && c.bf16) {
    return InvalidKey("fp16.enabled",
                      "fp16 and bf16 are both enabled; enable one (bf16 needs no loss scaling, "
                      "where the hardware has it)");
  }
  if (!f.enabled || f.loss_scale > 0) return Status::OK();
  if (f.initial_scale_power > 64) {
    return InvalidKey("fp16.initial_scale_power",
                      "must be in 0..64 (the first dynamic scale is 2^this; DeepSpeed's default "
                      "16, 32 in many configs), got " +
                          std::to_string(f.initial_scale_power));
  }
  if (f.loss_scale_window == 0) {
    return InvalidKey("fp16.loss_scale_window",
                      "must be at least 1 (steps without overflow before the scale doubles), got "
                      "0");
  }
  if (f.hysteresis < 1) {
    return InvalidKey("fp16.hysteresis",
                      "must be at least 1 (overflows taken before the scale halves), got " +
                          std::to_string(f.hysteresis));
  }
  if (!(f.min_loss_scale > 0 && std::isfinite(f.min_loss_scale))) {
    return InvalidKey("fp16.min_loss_scale",
                      "must be a positive number, got " + FormatNumber(f.min_loss_scale));
  }
  return Status::OK();
}

// Every section in the order a user reads the config; the first failing key is reported.
Status Validate(const EngineConfig& c) {
  ZINF_RETURN_IF_ERROR(ValidateFp16(c));
  ZINF_RETURN_IF_ERROR(ValidateZeroOptimization(c));
  ZINF_RETURN_IF_ERROR(ValidateOptimizer(c.optimizer));
  ZINF_RETURN_IF_ERROR(ValidateBatch(c));
  ZINF_RETURN_IF_ERROR(ValidateAio(c.aio));
  return ValidateZinf(c);
}

}  // namespace

Status ValidateEngineConfig(const EngineConfig& config) { return Validate(config); }

Result<EngineConfig> ParseEngineConfig(const std::string& json_text,
                                       std::vector<std::string>* warnings) {
  ZINF_ASSIGN_OR_RETURN(Json root, ParseJsonObject(json_text));
  ParseContext ctx(warnings);
  EngineConfig config;
  ObjectReader reader(root, "", &ctx);
  Status status = ParseRoot(reader, &config, &ctx);
  if (!ctx.auto_keys.empty()) {
    std::string list;
    for (const std::string& key : ctx.auto_keys) list += (list.empty() ? "" : ", ") + key;
    ctx.warnings.Add(list + ": \"auto\" is filled in by the Hugging Face Trainer, not by zinf; " +
                     "using the zinf defaults (write explicit values to choose others)");
  }
  ZINF_RETURN_IF_ERROR(status);
  ZINF_RETURN_IF_ERROR(Validate(config));
  return config;
}

Result<EngineConfig> LoadEngineConfig(const std::string& path, std::vector<std::string>* warnings) {
  if (path.empty()) {
    return Status::InvalidArgument("config file path is empty; pass the path of a JSON config");
  }
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    int err = errno;
    if (err == ENOENT || err == ENOTDIR) {
      return Status::NotFound("config file " + path + " does not exist");
    }
    return ErrnoToStatus(err, "stat config file " + path);
  }
  if (S_ISDIR(st.st_mode)) {
    return Status::InvalidArgument("config file " + path +
                                   " is a directory; pass the path of the JSON file inside it "
                                   "(e.g. " +
                                   path + "/ds_config.json)");
  }
  // A regular file only (a FIFO or a device would block or never end), of a sane size.
  Result<std::string> read = ReadSmallFile(path, 64 << 20);
  if (!read.ok()) return read.status().WithContext("config file " + path);
  std::string text = std::move(read).value();

  std::vector<std::string> local_warnings;
  Result<EngineConfig> config = ParseEngineConfig(text, &local_warnings);
  WarningSink sink(warnings);
  for (std::string& warning : local_warnings) sink.Add(path + ": " + warning);
  if (!config.ok()) return config.status().WithContext(path);
  return config;
}

}  // namespace zinf
