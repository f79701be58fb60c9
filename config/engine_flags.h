// The engine flags of zinf's programs (zinf-train, zinf-engine-bench), defined once: each
// flag's name, help and check here, and one way they change an EngineConfig. A program gives
// its defaults as the struct's initial values; a value left at "not given" ("" or < 0) keeps
// the configuration's (a --config file's, or the program's embedded defaults).
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "common/cli.h"
#include "zinf/config.h"
#include "zinf/cpu_adam.h"

namespace zinf {

struct EngineFlags {
  int zero_stage = -1;               // --zero-stage 0 | 1 | 2 | 3
  std::vector<std::string> nvme;     // --nvme, repeatable; empty: the program's default folder
  std::string param_tier;            // --param-tier device | cpu | nvme
  std::string optimizer_tier;        // --optimizer-tier device | cpu | nvme
  double optimizer_ratio = -1;       // --optimizer-ratio in [0, 1]
  std::string state_dtype;           // --state-dtype fp32 | bf16 | int8
  std::string gradient_transfer;     // --gradient-transfer fp32 | bf16
  double gradient_clipping = -1;     // --gradient-clipping (0: off)
  std::string speculative_step;      // --speculative-step on | off | auto
  bool delayed_update = false;       // --delayed-update (given: on)
  bool quantized_weights = false;    // --quantized-weights (given: on)
  bool quantized_gradients = false;  // --quantized-gradients (given: on)
  int quantized_gradient_bits = 0;   // --quantized-gradient-bits 8 | 4 (0: as configured)
  int quantization_block_size = 0;   // --quantization-block-size (0: as configured)
  int hpz_partition_size = 0;        // --hpz-partition-size (0: as configured)
  int optimizer_threads = -1;        // --optimizer-threads (0: every core)
  std::string io_backend;            // --io-backend io_uring | libaio | psync
};

namespace engine_flags_internal {
// "expected a, b or c, got 'x'": the message both programs print for a value not in `names`
// (nor in `aliases`, accepted without being listed).
inline CLI::Validator OneOf(std::vector<std::string> names, std::vector<std::string> aliases = {}) {
  std::string list;
  for (size_t i = 0; i < names.size(); ++i) {
    list += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + names[i];
  }
  names.insert(names.end(), aliases.begin(), aliases.end());
  return CLI::Validator(
      [names, list](std::string& s) {
        for (const std::string& n : names) {
          if (s == n) return std::string();
        }
        return "expected " + list + ", got '" + s + "'";
      },
      [&] {
        std::string set;
        for (size_t i = 0; i < names.size() - aliases.size(); ++i) set += (i ? "," : "") + names[i];
        return "{" + set + "}";
      }());
}
}  // namespace engine_flags_internal

// Adds the engine flags to `app`, writing into `*f` (which must outlive the parse). A program
// may add to a flag's help afterwards (app.get_option("--gradient-clipping")->description()).
inline void AddEngineFlags(CLI::App& app, EngineFlags* f) {
  using engine_flags_internal::OneOf;
  const std::vector<std::string> tiers = {"device", "cpu", "nvme"};
  app.add_option("--zero-stage", f->zero_stage,
                 "zero_optimization.stage: 3 (parameters gathered while used), 2 (each "
                 "parameter whole on every rank's device, gathered once per step), 1 (as 2, "
                 "each gradient summed over the micro-steps locally and reduced once per step) "
                 "or 0 (trains as 1)")
      ->check(CLI::Range(0, 3));
  app.add_option("--nvme", f->nvme, "NVMe swap folder (repeatable)");
  app.add_option("--param-tier", f->param_tier, "where parameters live: device, cpu or nvme")
      ->check(OneOf(tiers, {"none"}));
  app.add_option("--optimizer-tier", f->optimizer_tier,
                 "where optimizer states live: device, cpu or nvme")
      ->check(OneOf(tiers, {"none"}));
  app.add_option("--optimizer-ratio", f->optimizer_ratio,
                 "offload_optimizer.ratio: the share of optimizer sub-groups offloaded to "
                 "--optimizer-tier (the rest stay in device memory, stepped on the device)")
      ->check(FiniteNumber())
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--state-dtype", f->state_dtype,
                 "optimizer states stored as fp32, bf16 or int8 (blockwise 8-bit: about half "
                 "the bytes of a step's optimizer I/O); the masters stay fp32")
      ->check(OneOf({"fp32", "bf16", "int8"}));
  app.add_option("--gradient-transfer", f->gradient_transfer,
                 "zinf.gradient_transfer_dtype: fp32, or bf16 (gradients rounded on the device, "
                 "half the bytes to the host)")
      ->check(OneOf({"fp32", "bf16"}));
  app.add_option("--gradient-clipping", f->gradient_clipping,
                 "gradient_clipping: the max global gradient L2 norm (0: off)")
      ->check(FiniteNumber())
      ->check(CLI::Range(0.0, 1e30));
  app.add_option("--speculative-step", f->speculative_step,
                 "zinf.speculative_step, with clipping: step optimizer sub-groups before the norm "
                 "is known and keep, redo or roll back once it is: on, off or auto")
      ->check(OneOf({"on", "off", "auto"}));
  app.add_flag("--delayed-update", f->delayed_update,
               "zinf.delayed_update: one-step delayed parameter update, a step's optimizer runs "
               "on while the next step computes (on the parameters one update older)");
  app.add_flag("--quantized-weights", f->quantized_weights,
               "zero_optimization.zero_quantized_weights (ZeRO++'s qwZ): stage 3 with several "
               "ranks, the parameter all-gathers send int8 blocks with an fp32 scale per 256 "
               "values (--quantization-block-size; a quarter of fp32's bytes, about half of "
               "bf16's)");
  app.add_flag("--quantized-gradients", f->quantized_gradients,
               "zero_optimization.zero_quantized_gradients (ZeRO++'s qgZ): with several ranks, "
               "each gradient's reduce-scatter sends int8 (or int4: --quantized-gradient-bits) "
               "blocks (an fp32 scale per 256 values: --quantization-block-size) "
               "in an all-to-all, summed in fp32 by the partition's owner (in two hops, inside "
               "the node then across, with --hpz-partition-size)");
  app.add_option("--quantized-gradient-bits", f->quantized_gradient_bits,
                 "zinf.quantized_gradient_bits: the code of --quantized-gradients' blocks, 8 "
                 "(the default) or 4 (two codes per byte: about half the bytes, each value off "
                 "by up to its block's largest magnitude / 14 instead of / 254)")
      ->check(CLI::IsMember({4, 8}));
  app.add_option("--quantization-block-size", f->quantization_block_size,
                 "zinf.quantization_block_size: the values sharing an fp32 scale in "
                 "--quantized-weights' and --quantized-gradients' blocks, 64, 128, 256 (the "
                 "default), 512 or 1024 (smaller: each value's error bounded by a smaller "
                 "largest magnitude, more bytes of scales)")
      ->check(CLI::IsMember({64, 128, 256, 512, 1024}));
  app.add_option("--hpz-partition-size", f->hpz_partition_size,
                 "zero_optimization.zero_hpz_partition_size (ZeRO++'s hpZ): the ranks per node; "
                 "each rank keeps a secondary shard of every gathered parameter in pinned host "
                 "memory, so that its later gathers at the same version stay inside the node "
                 "(1: off)")
      ->check(CLI::Range(1, 1 << 16));
  app.add_option("--optimizer-threads", f->optimizer_threads,
                 "zinf.optimizer_threads: CPU optimizer threads (0: every core)")
      ->check(CLI::Range(0, 1024));
  app.add_option("--io-backend", f->io_backend,
                 "the swap store's I/O backend: io_uring (falling back to libaio, then psync, "
                 "when the kernel refuses it, with a warning), libaio or psync")
      ->check(OneOf({"io_uring", "libaio", "psync"}));
}

// "none" is DeepSpeed's name for staying in device memory.
inline Result<Tier> ParseTierFlag(const std::string& s, const std::string& flag) {
  if (s == "device" || s == "none") return Tier::kDevice;
  if (s == "cpu") return Tier::kCpu;
  if (s == "nvme") return Tier::kNvme;
  return Status::InvalidArgument(flag + ": expected device, cpu or nvme, got '" + s + "'");
}

// The flags given, over `c`. --nvme sets both tiers' folders when given.
inline Status ApplyEngineFlags(const EngineFlags& f, EngineConfig* c) {
  if (f.zero_stage >= 0) c->zero_stage = f.zero_stage;
  if (!f.param_tier.empty()) {
    ZINF_ASSIGN_OR_RETURN(c->offload_param.tier, ParseTierFlag(f.param_tier, "--param-tier"));
  }
  if (!f.optimizer_tier.empty()) {
    ZINF_ASSIGN_OR_RETURN(c->offload_optimizer.tier,
                          ParseTierFlag(f.optimizer_tier, "--optimizer-tier"));
  }
  if (f.optimizer_ratio >= 0) c->offload_optimizer.ratio = f.optimizer_ratio;
  if (!f.state_dtype.empty()) {
    Result<StateType> t = ParseStateType(f.state_dtype);
    if (!t.ok()) {
      return Status::InvalidArgument("--state-dtype: expected fp32, bf16 or int8, got '" +
                                     f.state_dtype + "'");
    }
    c->optimizer_state_type = *t;
  }
  if (!f.gradient_transfer.empty()) c->gradient_transfer_bf16 = f.gradient_transfer == "bf16";
  if (f.gradient_clipping >= 0) c->gradient_clipping = f.gradient_clipping;
  if (!f.speculative_step.empty()) {
    c->speculative_step = f.speculative_step == "on"    ? SpeculativeStep::kOn
                          : f.speculative_step == "off" ? SpeculativeStep::kOff
                                                        : SpeculativeStep::kAuto;
  }
  if (f.delayed_update) c->delayed_update = true;
  if (f.quantized_weights) c->quantized_weights = true;
  if (f.quantized_gradients) c->quantized_gradients = true;
  if (f.quantized_gradient_bits > 0) {
    c->quantized_gradient_bits = static_cast<uint32_t>(f.quantized_gradient_bits);
  }
  if (f.quantization_block_size > 0) {
    c->quantization_block_size = static_cast<uint32_t>(f.quantization_block_size);
  }
  if (f.hpz_partition_size > 0) c->hpz_partition_size = static_cast<uint32_t>(f.hpz_partition_size);
  if (f.optimizer_threads >= 0) c->optimizer_threads = f.optimizer_threads;
  if (!f.io_backend.empty()) c->aio.backend = f.io_backend;
  if (!f.nvme.empty()) {
    c->offload_param.nvme_paths = f.nvme;
    c->offload_optimizer.nvme_paths = f.nvme;
  }
  return Status::OK();
}

}  // namespace zinf
