#include "zinf/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "tests/test_util.h"
#include "zinf/log.h"

namespace zinf {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// A ZeRO-Infinity config as a DeepSpeed user writes it (DeepSpeed tutorial layout), with a
// non-default value wherever zinf reads one, plus the zinf section.
constexpr char kZeroInfinityConfig[] = R"json({
  "train_batch_size": 64,
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 2,
  "gradient_clipping": 1.0,
  "steps_per_print": 100,
  "wall_clock_breakdown": false,
  "zero_allow_untested_optimizer": true,
  "bf16": { "enabled": true },
  "fp16": { "enabled": false, "loss_scale": 0, "initial_scale_power": 16 },
  "optimizer": {
    "type": "AdamW",
    "params": { "lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1 }
  },
  "zero_optimization": {
    "stage": 3,
    "contiguous_gradients": true,
    "overlap_comm": true,
    "reduce_bucket_size": 5e8,
    "reduce_scatter": true,
    "sub_group_size": 1e8,
    "stage3_prefetch_bucket_size": 5e7,
    "stage3_max_live_parameters": 3e9,
    "stage3_max_reuse_distance": 2e9,
    "stage3_param_persistence_threshold": 1e4,
    "stage3_gather_16bit_weights_on_model_save": true,
    "offload_param": {
      "device": "nvme",
      "nvme_path": "/local_nvme",
      "pin_memory": false,
      "buffer_count": 5,
      "buffer_size": 2e8,
      "max_in_cpu": 2e9
    },
    "offload_optimizer": {
      "device": "nvme",
      "nvme_path": "/local_nvme",
      "pin_memory": false,
      "buffer_count": 6,
      "pipeline_read": true,
      "pipeline_write": true,
      "fast_init": false,
      "ratio": 0.5
    }
  },
  "aio": {
    "block_size": 262144,
    "queue_depth": 16,
    "thread_count": 2,
    "single_submit": true,
    "overlap_events": false,
    "use_gds": false
  },
  "activation_checkpointing": { "partition_activations": true, "cpu_checkpointing": true },
  "tensorboard": { "enabled": false },
  "zinf": {
    "device_budget_bytes": "40G",
    "pinned_budget_bytes": 8589934592,
    "nvme_capacity_bytes": "2T",
    "delayed_update": true,
    "delayed_update_after": 50,
    "durable": false,
    "checksums": true,
    "optimizer_threads": 12,
    "host_copy_gbps": 24.5,
    "io_backend": "libaio",
    "gradient_transfer_dtype": "bf16",
    "schedule": "layer-major",
    "optimizer_state_dtype": "int8",
    "nvme_paths": ["/local_nvme", "/nvme2"]
  }
})json";

EngineConfig ParseOk(const std::string& json, std::vector<std::string>* warnings) {
  Result<EngineConfig> config = ParseEngineConfig(json, warnings);
  EXPECT_TRUE(config.ok()) << config.status().ToString() << "\nfor " << json;
  return config.ok() ? config.value() : EngineConfig{};
}

EngineConfig ParseOkNoWarnings(const std::string& json) {
  std::vector<std::string> warnings;
  EngineConfig config = ParseOk(json, &warnings);
  EXPECT_THAT(warnings, IsEmpty()) << "for " << json;
  return config;
}

TEST(ConfigTest, ZeroInfinityConfigParsesEveryField) {
  EngineConfig c = ParseOkNoWarnings(kZeroInfinityConfig);
  EXPECT_EQ(64u, c.train_batch_size);
  EXPECT_EQ(4u, c.train_micro_batch_size_per_gpu);
  EXPECT_EQ(2, c.gradient_accumulation_steps);
  EXPECT_DOUBLE_EQ(1.0, c.gradient_clipping);
  EXPECT_TRUE(c.bf16);

  EXPECT_EQ(OptimizerType::kAdamW, c.optimizer.type);
  EXPECT_FLOAT_EQ(3e-4f, c.optimizer.lr);
  EXPECT_FLOAT_EQ(0.9f, c.optimizer.beta1);
  EXPECT_FLOAT_EQ(0.95f, c.optimizer.beta2);
  EXPECT_FLOAT_EQ(1e-6f, c.optimizer.eps);
  EXPECT_FLOAT_EQ(0.1f, c.optimizer.weight_decay);

  EXPECT_EQ(3, c.zero_stage);
  EXPECT_EQ(100'000'000u, c.sub_group_size);
  EXPECT_EQ(50'000'000u, c.prefetch_bucket_size);
  EXPECT_EQ(3'000'000'000u, c.max_live_parameters);
  EXPECT_EQ(2'000'000'000u, c.max_reuse_distance);
  EXPECT_EQ(10'000u, c.param_persistence_threshold);

  const OffloadConfig& p = c.offload_param;
  EXPECT_EQ(Tier::kNvme, p.tier);
  // The offload's own path first, then zinf.nvme_paths without repeats.
  EXPECT_THAT(p.nvme_paths, ElementsAre("/local_nvme", "/nvme2"));
  EXPECT_EQ(5u, p.buffer_count);
  EXPECT_EQ(200'000'000u, p.buffer_size);
  EXPECT_EQ(2'000'000'000u, p.max_in_cpu);
  EXPECT_FALSE(p.pin_memory);
  EXPECT_FALSE(p.pipeline_read);
  EXPECT_FALSE(p.pipeline_write);
  EXPECT_DOUBLE_EQ(1.0, p.ratio);

  const OffloadConfig& o = c.offload_optimizer;
  EXPECT_EQ(Tier::kNvme, o.tier);
  EXPECT_THAT(o.nvme_paths, ElementsAre("/local_nvme", "/nvme2"));
  EXPECT_EQ(6u, o.buffer_count);
  EXPECT_EQ(OffloadConfig{}.buffer_size, o.buffer_size);
  EXPECT_EQ(OffloadConfig{}.max_in_cpu, o.max_in_cpu);
  EXPECT_FALSE(o.pin_memory);
  EXPECT_TRUE(o.pipeline_read);
  EXPECT_TRUE(o.pipeline_write);
  EXPECT_DOUBLE_EQ(0.5, o.ratio);

  EXPECT_EQ(262144u, c.aio.block_size);
  EXPECT_EQ(16u, c.aio.queue_depth);
  EXPECT_EQ(2u, c.aio.thread_count);
  EXPECT_TRUE(c.aio.single_submit);
  EXPECT_FALSE(c.aio.overlap_events);
  EXPECT_EQ("libaio", c.aio.backend);

  EXPECT_EQ(40ull << 30, c.device_budget_bytes);
  EXPECT_EQ(8ull << 30, c.pinned_budget_bytes);
  EXPECT_EQ(2ull << 40, c.nvme_capacity_bytes);
  EXPECT_TRUE(c.delayed_update);
  EXPECT_EQ(50u, c.delayed_update_after);
  EXPECT_FALSE(c.durable);
  EXPECT_TRUE(c.checksums);
  EXPECT_TRUE(c.gradient_transfer_bf16);
  EXPECT_TRUE(c.layer_major);
  EXPECT_EQ(StateType::kInt8, c.optimizer_state_type);
  EXPECT_EQ(12, c.optimizer_threads);
  EXPECT_DOUBLE_EQ(24.5, c.host_copy_gbps);
}

void ExpectDefaults(const EngineConfig& c) {
  const EngineConfig d;
  EXPECT_EQ(3, c.zero_stage);
  for (const OffloadConfig* o : {&c.offload_param, &c.offload_optimizer}) {
    EXPECT_EQ(Tier::kDevice, o->tier);
    EXPECT_THAT(o->nvme_paths, IsEmpty());
    EXPECT_EQ(4u, o->buffer_count);
    EXPECT_EQ(100'000'000u, o->buffer_size);
    EXPECT_EQ(1'000'000'000u, o->max_in_cpu);
    EXPECT_TRUE(o->pin_memory);
    EXPECT_FALSE(o->pipeline_read);
    EXPECT_FALSE(o->pipeline_write);
    EXPECT_DOUBLE_EQ(1.0, o->ratio);
  }
  EXPECT_EQ(d.sub_group_size, c.sub_group_size);
  EXPECT_EQ(d.prefetch_bucket_size, c.prefetch_bucket_size);
  EXPECT_EQ(d.max_live_parameters, c.max_live_parameters);
  EXPECT_EQ(d.max_reuse_distance, c.max_reuse_distance);
  EXPECT_EQ(d.param_persistence_threshold, c.param_persistence_threshold);
  EXPECT_EQ(1u << 20, c.aio.block_size);
  EXPECT_EQ(32u, c.aio.queue_depth);
  EXPECT_EQ(1u, c.aio.thread_count);
  EXPECT_FALSE(c.aio.single_submit);
  EXPECT_TRUE(c.aio.overlap_events);
  EXPECT_EQ("io_uring", c.aio.backend);
  EXPECT_EQ(OptimizerType::kAdamW, c.optimizer.type);
  EXPECT_FLOAT_EQ(1e-3f, c.optimizer.lr);
  EXPECT_FLOAT_EQ(0.9f, c.optimizer.beta1);
  EXPECT_FLOAT_EQ(0.999f, c.optimizer.beta2);
  EXPECT_FLOAT_EQ(1e-8f, c.optimizer.eps);
  EXPECT_FLOAT_EQ(0.0f, c.optimizer.weight_decay);
  EXPECT_FALSE(c.bf16);
  EXPECT_DOUBLE_EQ(0.0, c.gradient_clipping);
  EXPECT_EQ(1, c.gradient_accumulation_steps);
  EXPECT_EQ(0u, c.train_micro_batch_size_per_gpu);
  EXPECT_EQ(0u, c.train_batch_size);
  EXPECT_EQ(0u, c.device_budget_bytes);
  EXPECT_EQ(1ull << 30, c.pinned_budget_bytes);
  EXPECT_EQ(0u, c.nvme_capacity_bytes);
  EXPECT_FALSE(c.delayed_update);
  EXPECT_FALSE(c.checksums);
  EXPECT_FALSE(c.gradient_transfer_bf16);
  EXPECT_FALSE(c.layer_major);
  EXPECT_EQ(StateType::kF32, c.optimizer_state_type);
  EXPECT_EQ(0, c.optimizer_threads);
  EXPECT_DOUBLE_EQ(0.0, c.host_copy_gbps);
}

TEST(ConfigTest, DefaultsWhenKeysAreAbsent) {
  ExpectDefaults(ParseOkNoWarnings("{}"));
  // Empty sections, null sections and a comment change nothing.
  ExpectDefaults(ParseOkNoWarnings(R"({
    // zinf allows comments
    "zero_optimization": {"offload_param": null, "offload_optimizer": {}},
    "aio": {}, "zinf": {}, "optimizer": {"type": "AdamW"}, "bf16": {}
  })"));
}

// zinf.speculative_step: true, false, or "auto" as a value of its own (no Trainer warning).
TEST(ConfigTest, SpeculativeStepTakesTrueFalseOrAuto) {
  EXPECT_EQ(EngineConfig{}.speculative_step, SpeculativeStep::kAuto);
  EXPECT_EQ(ParseOkNoWarnings(R"({"zinf": {"speculative_step": true}})").speculative_step,
            SpeculativeStep::kOn);
  EXPECT_EQ(ParseOkNoWarnings(R"({"zinf": {"speculative_step": false}})").speculative_step,
            SpeculativeStep::kOff);
  EXPECT_EQ(ParseOkNoWarnings(R"({"zinf": {"speculative_step": "auto"}})").speculative_step,
            SpeculativeStep::kAuto);
}

TEST(ConfigTest, TierNames) {
  EXPECT_STREQ("device", TierName(Tier::kDevice));
  EXPECT_STREQ("cpu", TierName(Tier::kCpu));
  EXPECT_STREQ("nvme", TierName(Tier::kNvme));
}

// A Hugging Face Trainer config: "auto" placeholders keep the defaults, with one warning.
TEST(ConfigTest, HuggingFaceAutoValuesKeepDefaultsWithOneWarning) {
  std::vector<std::string> warnings;
  EngineConfig c = ParseOk(R"({
    "fp16": {"enabled": "auto", "loss_scale": 0},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW",
                  "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
    "zero_optimization": {
      "stage": 3,
      "offload_optimizer": {"device": "cpu", "pin_memory": true},
      "offload_param": {"device": "cpu", "pin_memory": true},
      "overlap_comm": true, "contiguous_gradients": true, "sub_group_size": 1e9,
      "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
      "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
      "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": true
    },
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "steps_per_print": 2000, "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": false
  })",
                           &warnings);
  EXPECT_EQ(Tier::kCpu, c.offload_param.tier);
  EXPECT_EQ(Tier::kCpu, c.offload_optimizer.tier);
  EXPECT_FLOAT_EQ(1e-3f, c.optimizer.lr);
  EXPECT_FLOAT_EQ(0.999f, c.optimizer.beta2);
  EXPECT_EQ(50'000'000u, c.prefetch_bucket_size);
  EXPECT_EQ(1, c.gradient_accumulation_steps);
  ASSERT_EQ(2u, warnings.size());
  EXPECT_THAT(warnings[0], HasSubstr("scheduler: ignored"));
  EXPECT_THAT(warnings[1], HasSubstr("optimizer.params.lr, optimizer.params.betas"));
  EXPECT_THAT(warnings[1], HasSubstr("zero_optimization.stage3_prefetch_bucket_size"));
  EXPECT_THAT(warnings[1], HasSubstr("train_batch_size"));
  EXPECT_THAT(warnings[1], HasSubstr("\"auto\" is filled in by the Hugging Face Trainer"));
}

TEST(ConfigTest, IntegralFloatsAreIntegers) {
  EngineConfig c = ParseOkNoWarnings(R"({"zero_optimization": {
      "stage": 3.0, "stage3_prefetch_bucket_size": 5e7, "sub_group_size": 1E9,
      "offload_param": {"buffer_count": 8.0}}})");
  EXPECT_EQ(50'000'000u, c.prefetch_bucket_size);
  EXPECT_EQ(1'000'000'000u, c.sub_group_size);
  EXPECT_EQ(8u, c.offload_param.buffer_count);
  // Above 2^53 a JSON integer keeps every digit.
  c = ParseOkNoWarnings(R"({"zero_optimization": {"sub_group_size": 18446744073709551615}})");
  EXPECT_EQ(18446744073709551615ull, c.sub_group_size);

  Result<EngineConfig> bad =
      ParseEngineConfig(R"({"zero_optimization": {"stage3_prefetch_bucket_size": 1.5}})", nullptr);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(StatusCode::kInvalidArgument, bad.status().code());
  EXPECT_EQ(
      "zero_optimization.stage3_prefetch_bucket_size: expected a non-negative integer, got 1.5",
      bad.status().message());
}

TEST(ConfigTest, NvmePathForms) {
  // A string, an array, and zinf.nvme_paths appended to each nvme tier without repeats.
  EngineConfig c = ParseOkNoWarnings(R"({"zero_optimization": {
      "offload_param": {"device": "nvme", "nvme_path": "/a"},
      "offload_optimizer": {"device": "NVMe", "nvme_path": ["/b", "/c", "/b"]}},
      "zinf": {"nvme_paths": ["/c", "/d"]}})");
  EXPECT_THAT(c.offload_param.nvme_paths, ElementsAre("/a", "/c", "/d"));
  EXPECT_THAT(c.offload_optimizer.nvme_paths, ElementsAre("/b", "/c", "/d"));

  // zinf.nvme_paths alone satisfies an nvme tier; a cpu tier does not take them.
  c = ParseOkNoWarnings(R"({"zero_optimization": {
      "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "nvme"}},
      "zinf": {"nvme_paths": ["/x"]}})");
  EXPECT_THAT(c.offload_param.nvme_paths, IsEmpty());
  EXPECT_THAT(c.offload_optimizer.nvme_paths, ElementsAre("/x"));

  // A path on a non-nvme tier is legal in DeepSpeed, but zinf says it is unused.
  std::vector<std::string> warnings;
  c = ParseOk(R"({"zero_optimization": {"offload_param": {"device": "cpu", "nvme_path": "/a"},
                  "offload_optimizer": {"device": "none", "nvme_path": null}},
                  "zinf": {"nvme_paths": ["/x"]}})",
              &warnings);
  EXPECT_EQ(Tier::kDevice, c.offload_optimizer.tier);
  EXPECT_THAT(warnings, ElementsAre("zero_optimization.offload_param.nvme_path: used only by "
                                    "offload_states(device=\"nvme\"), because device is \"cpu\"",
                                    HasSubstr("zinf.nvme_paths: not used")));
}

TEST(ConfigTest, OptimizerTypesAndAdamWMode) {
  struct Case {
    const char* json;
    OptimizerType expected;
  };
  const Case cases[] = {
      // DeepSpeed: type Adam is AdamW unless adam_w_mode is false.
      {R"({"optimizer": {"type": "Adam"}})", OptimizerType::kAdamW},
      {R"({"optimizer": {"type": "adam", "params": {"adam_w_mode": true}}})",
       OptimizerType::kAdamW},
      {R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false}}})",
       OptimizerType::kAdam},
      {R"({"optimizer": {"type": "ADAMW"}})", OptimizerType::kAdamW},
      {R"({"optimizer": {"type": "Adagrad", "params": {"lr": 0.01}}})", OptimizerType::kAdagrad},
      {R"({"optimizer": {"type": "lion", "params": {"betas": [0.95, 0.98]}}})",
       OptimizerType::kLion},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(c.expected, ParseOkNoWarnings(c.json).optimizer.type) << c.json;
  }
  std::vector<std::string> warnings;
  ParseOk(
      R"({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": false, "torch_adam": true}}})",
      &warnings);
  EXPECT_THAT(warnings,
              ElementsAre(HasSubstr("optimizer.params.adam_w_mode: false has no effect")));
}

TEST(ConfigTest, PipelineSetsReadAndWrite) {
  EngineConfig c = ParseOkNoWarnings(
      R"({"zero_optimization": {"offload_optimizer": {"device": "cpu", "pipeline": true}}})");
  EXPECT_TRUE(c.offload_optimizer.pipeline_read);
  EXPECT_TRUE(c.offload_optimizer.pipeline_write);
  // An explicit pipeline_write overrides the shorthand.
  c = ParseOkNoWarnings(R"({"zero_optimization": {"offload_optimizer":
        {"device": "cpu", "pipeline": true, "pipeline_write": false}}})");
  EXPECT_TRUE(c.offload_optimizer.pipeline_read);
  EXPECT_FALSE(c.offload_optimizer.pipeline_write);
}

TEST(ConfigTest, ByteSizesWithUnits) {
  struct Case {
    const char* text;
    uint64_t bytes;
  };
  const Case cases[] = {
      {"\"4G\"", 4ull << 30},
      {"\"512M\"", 512ull << 20},
      {"\"512 MiB\"", 512ull << 20},
      {"\"1.5GiB\"", 3ull << 29},
      {"\"64kb\"", 64ull << 10},
      {"\"4096\"", 4096},
      {"\"100B\"", 100},
      {"\"1t\"", 1ull << 40},
      {"5e9", 5'000'000'000ull},
      {"123", 123},
  };
  for (const Case& c : cases) {
    std::string json = std::string(R"({"zinf": {"pinned_budget_bytes": )") + c.text + "}}";
    EXPECT_EQ(c.bytes, ParseOkNoWarnings(json).pinned_budget_bytes) << json;
  }
}

TEST(ConfigTest, AioAliasesAndGdsWarning) {
  std::vector<std::string> warnings;
  EngineConfig c = ParseOk(R"({"aio": {"intra_op_parallelism": 4, "use_gds": true}})", &warnings);
  EXPECT_EQ(4u, c.aio.thread_count);
  EXPECT_THAT(warnings, ElementsAre(HasSubstr("aio.use_gds: GPUDirect Storage is not supported")));
}

TEST(ConfigTest, UnknownKeysWarnOncePerKeyWithPathAndSuggestion) {
  std::vector<std::string> warnings;
  EngineConfig c = ParseOk(R"({
    "zero_optimization": {
      "stage": 3,
      "offload_optimzer": {"device": "nvme"},
      "offload_param": {"device": "cpu", "pin_memroy": true, "colour": 1},
      "max_live_parameters": 5
    },
    "aio": {"queue_dept": 8},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "Betas": [0.9, 0.99]}},
    "device_budget_bytes": 100,
    "zinf": {"checksum": true},
    "my_setting": {"a": 1}
  })",
                           &warnings);
  // Unknown keys are ignored: the misspelt offload_optimizer did not make a tier nvme.
  EXPECT_EQ(Tier::kDevice, c.offload_optimizer.tier);
  EXPECT_FLOAT_EQ(0.1f, c.optimizer.lr);
  EXPECT_THAT(
      warnings,
      ElementsAre(
          "optimizer.params.Betas: unknown key, ignored (did you mean betas?)",
          "zero_optimization.offload_param.colour: unknown key, ignored",
          "zero_optimization.offload_param.pin_memroy: unknown key, ignored (did you mean "
          "pin_memory?)",
          "zero_optimization.max_live_parameters: unknown key, ignored (did you mean "
          "stage3_max_live_parameters?)",
          "zero_optimization.offload_optimzer: unknown key, ignored (did you mean "
          "offload_optimizer?)",
          "aio.queue_dept: unknown key, ignored (did you mean queue_depth?)",
          "zinf.checksum: unknown key, ignored (did you mean checksums?)",
          "device_budget_bytes: unknown key, ignored (did you mean zinf.device_budget_bytes?)",
          "my_setting: unknown key, ignored"));
}

TEST(ConfigTest, DeepSpeedKeysWithoutZinfMeaningAreAcceptedSilently) {
  ParseOkNoWarnings(R"({
    "steps_per_print": 10, "wall_clock_breakdown": true, "zero_allow_untested_optimizer": true,
    "gradient_predivide_factor": 1.0, "prescale_gradients": false,
    "communication_data_type": "fp32", "flops_profiler": {"enabled": false},
    "tensorboard": {"enabled": true, "output_path": "tb/"}, "wandb": {"enabled": false},
    "csv_monitor": {"enabled": false}, "comms_logger": {"enabled": false},
    "activation_checkpointing": {"partition_activations": false}, "memory_breakdown": false,
    "zero_force_ds_cpu_optimizer": false, "data_types": {"grad_accum_dtype": "fp32"},
    "amp": {"enabled": false, "opt_level": "O1"},
    "zero_optimization": {"stage": 3, "allgather_partitions": true, "allgather_bucket_size": 2e8,
      "round_robin_gradients": true, "memory_efficient_linear": false,
      "ignore_unused_parameters": true, "stage3_gather_fp16_weights_on_model_save": false}
  })");
}

TEST(ConfigTest, NullWarningsGoToTheLog) {
  std::vector<std::string> logged;
  LogSink previous = SetLogSink([&logged](LogLevel level, const std::string& line) {
    if (level == LogLevel::kWarning) logged.push_back(line);
  });
  Result<EngineConfig> c = ParseEngineConfig(R"({"stepz_per_print": 1})", nullptr);
  SetLogSink(std::move(previous));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_THAT(logged, ElementsAre("stepz_per_print: unknown key, ignored (did you mean "
                                  "steps_per_print?)"));
}

TEST(ConfigTest, InvalidJsonReportsLineAndColumn) {
  Result<EngineConfig> c =
      ParseEngineConfig("{\n  \"zero_optimization\": {\n    \"stage\": 3,\n  }\n}", nullptr);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(StatusCode::kInvalidArgument, c.status().code());
  EXPECT_THAT(c.status().message(), HasSubstr("invalid JSON at line 4, column 3: "));
  EXPECT_THAT(c.status().message(), HasSubstr("unexpected '}'"));

  c = ParseEngineConfig("{\"a\": 1", nullptr);  // truncated
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("invalid JSON at line 1, column 8"));
  EXPECT_THAT(c.status().message(), HasSubstr("end of input"));

  c = ParseEngineConfig("  \n", nullptr);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("the config is empty"));

  c = ParseEngineConfig(R"({"gradient_clipping": 1e400})", nullptr);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("invalid JSON: number overflow"));
}

// A case of an invalid config: the code and a message fragment that names the key path.
struct BadConfig {
  const char* name;
  const char* json;
  StatusCode code;
  const char* message;
};

class BadConfigTest : public ::testing::TestWithParam<BadConfig> {};

TEST_P(BadConfigTest, FailsWithCodeAndKeyPath) {
  const BadConfig& bad = GetParam();
  Result<EngineConfig> c = ParseEngineConfig(bad.json, nullptr);
  ASSERT_FALSE(c.ok()) << bad.json;
  EXPECT_EQ(bad.code, c.status().code()) << c.status().ToString();
  EXPECT_THAT(c.status().message(), HasSubstr(bad.message));
}

constexpr StatusCode kInvalid = StatusCode::kInvalidArgument;
constexpr StatusCode kNotSupported = StatusCode::kNotSupported;

const BadConfig kBadConfigs[] = {
    // Wrong types.
    {"QuotedNumber", R"({"train_batch_size": "8"})", kInvalid,
     "train_batch_size: expected a non-negative integer, got \"8\"; write the value without "
     "quotes"},
    {"BoolAsInt", R"({"bf16": {"enabled": 1}})", kInvalid,
     "bf16.enabled: expected true or false, got 1"},
    {"QuotedBool", R"({"aio": {"single_submit": "false"}})", kInvalid,
     "aio.single_submit: expected true or false, got \"false\"; write the value without quotes"},
    {"SectionNotObject", R"({"zero_optimization": [3]})", kInvalid,
     "zero_optimization: expected an object {...}, got an array"},
    {"OffloadNotObject", R"({"zero_optimization": {"offload_param": "nvme"}})", kInvalid,
     "zero_optimization.offload_param: expected an object {...}, got \"nvme\""},
    {"LrString", R"({"optimizer": {"type": "AdamW", "params": {"lr": "fast"}}})", kInvalid,
     "optimizer.params.lr: expected a number, got \"fast\""},
    {"BetasOne", R"({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}})", kInvalid,
     "optimizer.params.betas: expected an array of two numbers [beta1, beta2], got an array of "
     "length 1"},
    {"BetasElement", R"({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, "x"]}}})",
     kInvalid, "optimizer.params.betas[1]: expected a number, got \"x\""},
    {"GradientClippingBool", R"({"gradient_clipping": true})", kInvalid,
     "gradient_clipping: expected a number, got true"},
    {"NvmePathNumber", R"({"zero_optimization": {"offload_param": {"nvme_path": 5}}})", kInvalid,
     "zero_optimization.offload_param.nvme_path: expected a path string or an array of path "
     "strings, got 5"},
    {"NvmePathElement", R"({"zero_optimization": {"offload_optimizer": {"nvme_path": ["/a", 3]}}})",
     kInvalid, "zero_optimization.offload_optimizer.nvme_path[1]: expected a path string"},
    {"NvmePathEmpty", R"({"zero_optimization": {"offload_param": {"nvme_path": ""}}})", kInvalid,
     "zero_optimization.offload_param.nvme_path: empty path"},
    {"ZinfNvmePathsString", R"({"zinf": {"nvme_paths": "/a"}})", kInvalid,
     "zinf.nvme_paths: expected an array of path strings, got \"/a\""},
    {"BudgetBool", R"({"zinf": {"device_budget_bytes": true}})", kInvalid,
     "zinf.device_budget_bytes: expected a byte count"},
    {"BudgetBadUnit", R"({"zinf": {"pinned_budget_bytes": "4X"}})", kInvalid,
     "zinf.pinned_budget_bytes: expected a byte count such as 4294967296 or \"4G\""},
    {"BudgetFraction", R"({"zinf": {"pinned_budget_bytes": "0.3K"}})", kInvalid,
     "zinf.pinned_budget_bytes: \"0.3K\" is not a whole number of bytes"},
    {"ThreadsString", R"({"zinf": {"optimizer_threads": "all"}})", kInvalid,
     "zinf.optimizer_threads: expected a non-negative integer"},
    {"TopLevelArray", R"([1, 2])", kInvalid, "expected a JSON object {...} at the top level"},
    // Negative sizes and non-integers.
    {"NegativeSubGroup", R"({"zero_optimization": {"sub_group_size": -1}})", kInvalid,
     "zero_optimization.sub_group_size: expected a non-negative integer, got -1"},
    {"NegativeBufferSize", R"({"zero_optimization": {"offload_param": {"buffer_size": -5e7}}})",
     kInvalid, "zero_optimization.offload_param.buffer_size: expected a non-negative integer"},
    {"NegativeQueueDepth", R"({"aio": {"queue_depth": -1}})", kInvalid,
     "aio.queue_depth: expected a non-negative integer, got -1"},
    {"NegativeCapacity", R"({"zinf": {"nvme_capacity_bytes": -1}})", kInvalid,
     "zinf.nvme_capacity_bytes: expected a non-negative integer"},
    {"NegativeAccumulation", R"({"gradient_accumulation_steps": -2})", kInvalid,
     "gradient_accumulation_steps: expected a non-negative integer, got -2"},
    {"FractionalBufferCount",
     R"({"zero_optimization": {"offload_optimizer": {"buffer_count": 2.5}}})", kInvalid,
     "zero_optimization.offload_optimizer.buffer_count: expected a non-negative integer, got 2.5"},
    {"BufferCountTooLarge", R"({"zero_optimization": {"offload_param": {"buffer_count": 5e9}}})",
     kInvalid,
     "zero_optimization.offload_param.buffer_count: expected an integer no larger than "
     "4294967295"},
    // Bad enums.
    {"BadDevice", R"({"zero_optimization": {"offload_optimizer": {"device": "disk"}}})", kInvalid,
     "zero_optimization.offload_optimizer.device: expected one of none, cpu, nvme, got \"disk\""},
    {"DeviceNotString", R"({"zero_optimization": {"offload_param": {"device": 2}}})", kInvalid,
     "zero_optimization.offload_param.device: expected one of none, cpu, nvme, got 2"},
    {"BadOptimizer", R"({"optimizer": {"type": "Lamb"}})", kInvalid,
     "optimizer.type: expected one of Adam, AdamW, Adagrad, Lion, got \"Lamb\""},
    {"OptimizerWithoutType", R"({"optimizer": {"params": {"lr": 1e-4}}})", kInvalid,
     "optimizer.type: missing"},
    {"BadIoBackend", R"({"zinf": {"io_backend": "spdk"}})", kInvalid,
     "zinf.io_backend: expected one of io_uring, libaio, psync, got \"spdk\""},
    {"BadGradientTransfer", R"({"zinf": {"gradient_transfer_dtype": "fp16"}})", kInvalid,
     "zinf.gradient_transfer_dtype: expected one of fp32, bf16, got \"fp16\""},
    {"BadSchedule", R"({"zinf": {"schedule": "layer_major"}})", kInvalid,
     "zinf.schedule: expected one of micro-batch, layer-major, got \"layer_major\""},
    {"BadSpeculativeStep", R"({"zinf": {"speculative_step": "yes"}})", kInvalid,
     "zinf.speculative_step: expected true, false or \"auto\", got \"yes\""},
    {"BadStateDtype", R"({"zinf": {"optimizer_state_dtype": "fp8"}})", kInvalid,
     "zinf.optimizer_state_dtype: expected one of fp32, bf16, int8, got \"fp8\""},
    {"AdagradInt8States",
     R"({"optimizer": {"type": "Adagrad"}, "zinf": {"optimizer_state_dtype": "int8"}})", kInvalid,
     "zinf.optimizer_state_dtype: \"int8\" is not supported with optimizer type Adagrad"},
    {"Stage4", R"({"zero_optimization": {"stage": 4}})", kInvalid,
     "zero_optimization.stage: expected 0, 1, 2 or 3 (DeepSpeed's ZeRO stages), got 4"},
    {"Stage2WithTheDelayedUpdate",
     R"({"zero_optimization": {"stage": 2}, "zinf": {"delayed_update": true}})", kInvalid,
     "zinf.delayed_update: needs zero_optimization.stage 3"},
    {"Fp16AndBf16", R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})", kInvalid,
     "fp16.enabled: fp16 and bf16 are both enabled"},
    {"Fp16Window", R"({"fp16": {"enabled": true, "loss_scale_window": 0}})", kInvalid,
     "fp16.loss_scale_window: must be at least 1"},
    {"Fp16Hysteresis", R"({"fp16": {"enabled": true, "hysteresis": 0}})", kInvalid,
     "fp16.hysteresis: must be at least 1"},
    {"Fp16Power", R"({"fp16": {"enabled": true, "initial_scale_power": 65}})", kInvalid,
     "fp16.initial_scale_power: must be in 0..64"},
    {"Fp16MinScale", R"({"fp16": {"enabled": true, "min_loss_scale": 0}})", kInvalid,
     "fp16.min_loss_scale: must be a positive number"},
    {"Fp16Static", R"({"fp16": {"loss_scale": -1}})", kInvalid,
     "fp16.loss_scale: must be 0 (dynamic) or a positive static scale"},
    {"Amp", R"({"amp": {"enabled": true}})", kNotSupported, "amp.enabled: Apex AMP"},
    {"NoBiasCorrection", R"({"optimizer": {"type": "Adam", "params": {"bias_correction": false}}})",
     kNotSupported, "optimizer.params.bias_correction"},
    {"AmsGrad", R"({"optimizer": {"type": "Adam", "params": {"amsgrad": true}}})", kNotSupported,
     "optimizer.params.amsgrad: AMSGrad is not supported"},
    // NVMe tier without a path.
    {"ParamNvmeWithoutPath", R"({"zero_optimization": {"offload_param": {"device": "nvme"}}})",
     kInvalid,
     "zero_optimization.offload_param.nvme_path: device is \"nvme\" but no NVMe path is set; set "
     "\"nvme_path\""},
    {"OptimizerNvmeWithoutPath",
     R"({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": null}}})",
     kInvalid, "zero_optimization.offload_optimizer.nvme_path: device is \"nvme\""},
    // Values out of range.
    {"Beta1One", R"({"optimizer": {"type": "AdamW", "params": {"betas": [1.0, 0.999]}}})", kInvalid,
     "optimizer.params.betas: beta1 must be in [0, 1), got 1"},
    {"Beta2Negative", R"({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, -0.1]}}})",
     kInvalid, "optimizer.params.betas: beta2 must be in [0, 1), got -0.1"},
    {"NegativeLr", R"({"optimizer": {"type": "AdamW", "params": {"lr": -1}}})", kInvalid,
     "optimizer.params.lr: must be >= 0, got -1"},
    {"ZeroEps", R"({"optimizer": {"type": "AdamW", "params": {"eps": 0}}})", kInvalid,
     "optimizer.params.eps: must be > 0"},
    {"NegativeWeightDecay", R"({"optimizer": {"type": "AdamW", "params": {"weight_decay": -0.1}}})",
     kInvalid, "optimizer.params.weight_decay: must be >= 0"},
    {"ZeroAccumulation", R"({"gradient_accumulation_steps": 0})", kInvalid,
     "gradient_accumulation_steps: must be at least 1, got 0"},
    {"NegativeClipping", R"({"gradient_clipping": -1.0})", kInvalid,
     "gradient_clipping: must be >= 0"},
    {"ZeroSubGroup", R"({"zero_optimization": {"sub_group_size": 0}})", kInvalid,
     "zero_optimization.sub_group_size: must be positive"},
    {"ZeroMaxLive", R"({"zero_optimization": {"stage3_max_live_parameters": 0}})", kInvalid,
     "zero_optimization.stage3_max_live_parameters: must be positive"},
    {"ZeroBufferCount", R"({"zero_optimization": {"offload_optimizer": {"buffer_count": 0}}})",
     kInvalid, "zero_optimization.offload_optimizer.buffer_count: must be at least 1"},
    {"ZeroBufferSize", R"({"zero_optimization": {"offload_param": {"buffer_size": 0}}})", kInvalid,
     "zero_optimization.offload_param.buffer_size: must be positive"},
    {"RatioAboveOne", R"({"zero_optimization": {"offload_optimizer": {"ratio": 1.5}}})", kInvalid,
     "zero_optimization.offload_optimizer.ratio: must be in [0, 1]"},
    {"BlockSizeUnaligned", R"({"aio": {"block_size": 1000}})", kInvalid,
     "aio.block_size: must be a positive multiple of 4096"},
    {"BlockSizeZero", R"({"aio": {"block_size": 0}})", kInvalid,
     "aio.block_size: must be a positive multiple of 4096"},
    {"QueueDepthZero", R"({"aio": {"queue_depth": 0}})", kInvalid,
     "aio.queue_depth: must be in 1..4096, got 0"},
    {"QueueDepthHuge", R"({"aio": {"queue_depth": 5000}})", kInvalid,
     "aio.queue_depth: must be in 1..4096, got 5000"},
    {"ThreadCountZero", R"({"aio": {"thread_count": 0}})", kInvalid, "aio.thread_count"},
    {"PinnedBudgetZero", R"({"zinf": {"pinned_budget_bytes": 0}})", kInvalid,
     "zinf.pinned_budget_bytes: must be positive"},
    {"NegativeCopySpeed", R"({"zinf": {"host_copy_gbps": -3}})", kInvalid,
     "zinf.host_copy_gbps: must be >= 0"},
    {"BatchNotMultiple",
     R"({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,
         "gradient_accumulation_steps": 2})",
     kInvalid, "train_batch_size: 30 is not a multiple of train_micro_batch_size_per_gpu (4)"},
    {"DuplicateKey", R"({"zero_optimization": {"stage": 3, "sub_group_size": 1, "stage": 3}})",
     kInvalid, "zero_optimization.stage: key appears twice"},
};

INSTANTIATE_TEST_SUITE_P(All, BadConfigTest, ::testing::ValuesIn(kBadConfigs),
                         [](const ::testing::TestParamInfo<BadConfig>& info) {
                           return std::string(info.param.name);
                         });

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

TEST(LoadEngineConfigTest, ReadsFileAndPrefixesWarnings) {
  testing::TempDir dir;
  ASSERT_TRUE(dir.ok());
  const std::string path = dir.path() + "/ds_config.json";
  WriteFile(path, kZeroInfinityConfig);
  std::vector<std::string> warnings;
  Result<EngineConfig> c = LoadEngineConfig(path, &warnings);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(Tier::kNvme, c->offload_optimizer.tier);
  EXPECT_THAT(warnings, IsEmpty());

  WriteFile(path, R"({"zero_optimization": {"stgae": 3}})");
  c = LoadEngineConfig(path, &warnings);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_THAT(warnings, ElementsAre(path + ": zero_optimization.stgae: unknown key, ignored (did "
                                           "you mean stage?)"));
}

TEST(LoadEngineConfigTest, MissingFileIsNotFound) {
  testing::TempDir dir;
  ASSERT_TRUE(dir.ok());
  const std::string path = dir.path() + "/missing.json";
  Result<EngineConfig> c = LoadEngineConfig(path, nullptr);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(StatusCode::kNotFound, c.status().code());
  EXPECT_EQ("config file " + path + " does not exist", c.status().message());
}

TEST(LoadEngineConfigTest, FolderIsAClearError) {
  testing::TempDir dir;
  ASSERT_TRUE(dir.ok());
  Result<EngineConfig> c = LoadEngineConfig(dir.path(), nullptr);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(StatusCode::kInvalidArgument, c.status().code());
  EXPECT_THAT(c.status().message(), HasSubstr("config file " + dir.path() + " is a directory"));
}

TEST(LoadEngineConfigTest, ParseErrorsStartWithThePath) {
  testing::TempDir dir;
  ASSERT_TRUE(dir.ok());
  const std::string path = dir.path() + "/ds_config.json";
  WriteFile(path, "{\n  \"fp16\": {\"enabled\": true, \"hysteresis\": 0}\n}\n");
  Result<EngineConfig> c = LoadEngineConfig(path, nullptr);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(StatusCode::kInvalidArgument, c.status().code());
  EXPECT_EQ(path +
                ": fp16.hysteresis: must be at least 1 (overflows taken before the scale halves), "
                "got 0",
            c.status().message());

  WriteFile(path, "{\n  \"bf16\": {\"enabled\": true},\n  \"aio\": {\"block_size\": 4096,}\n}\n");
  c = LoadEngineConfig(path, nullptr);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr(path + ": invalid JSON at line 3, column "));
}

// VisitEngineConfig names every field by its config key, once, with the value a config writes:
// a config built from what it visits parses back to the same config, and a config that sets
// every key (but the stage, which has one value) to something other than its default shows each
// visited value changed, so no key is visited under another field's name.
// A visited key's place in a config: its path, zinf's own keys under "zinf".
std::vector<std::string> KeyPath(const std::string& key) {
  static const std::set<std::string> top = {"gradient_clipping", "gradient_accumulation_steps",
                                            "train_micro_batch_size_per_gpu", "train_batch_size"};
  std::string path = key;
  if (path.find('.') == std::string::npos && !top.count(path)) path = "zinf." + path;
  std::vector<std::string> parts;
  for (size_t dot; (dot = path.find('.')) != std::string::npos; path.erase(0, dot + 1)) {
    parts.push_back(path.substr(0, dot));
  }
  parts.push_back(path);
  return parts;
}

nlohmann::json VisitedTree(const EngineConfig& c, std::map<std::string, std::string>* flat) {
  nlohmann::json tree = nlohmann::json::object();
  VisitEngineConfig(c, [&](const char* key, const auto& value) {
    const nlohmann::json v = value;
    EXPECT_TRUE(flat->emplace(key, v.dump()).second) << key << " visited twice";
    nlohmann::json* at = &tree;
    for (const std::string& part : KeyPath(key)) at = &(*at)[part];
    *at = v;
  });
  return tree;
}

TEST(ConfigTest, TheVisitorNamesEveryFieldByItsKey) {
  const char* every = R"({
    "zero_optimization": {"stage": 3, "sub_group_size": 1234, "stage3_prefetch_bucket_size": 99,
      "stage3_max_live_parameters": 200, "stage3_max_reuse_distance": 300,
      "stage3_param_persistence_threshold": 10, "zero_quantized_weights": true,
      "zero_quantized_nontrainable_weights": true, "zero_quantized_gradients": true,
      "zero_hpz_partition_size": 2,
      "offload_param": {"device": "nvme", "nvme_path": "/tmp/zinf_p", "buffer_count": 5,
        "buffer_size": 1000, "max_in_cpu": 2000, "pin_memory": false},
      "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/zinf_o", "buffer_count": 6,
        "pin_memory": false, "pipeline_read": true, "pipeline_write": true, "ratio": 0.25}},
    "aio": {"block_size": 65536, "queue_depth": 8, "thread_count": 2, "single_submit": true,
      "overlap_events": false},
    "optimizer": {"type": "Lion", "params": {"lr": 0.01, "betas": [0.8, 0.95], "eps": 1e-6,
      "weight_decay": 0.1}},
    "bf16": {"enabled": true}, "fp16": {"enabled": false, "loss_scale": 128,
      "initial_scale_power": 32, "loss_scale_window": 500, "hysteresis": 3,
      "consecutive_hysteresis": true, "min_loss_scale": 0.25}, "gradient_clipping": 1.5, "gradient_accumulation_steps": 2,
    "train_micro_batch_size_per_gpu": 4, "train_batch_size": 8,
    "zinf": {"io_backend": "psync", "device_budget_bytes": "1G", "pinned_budget_bytes": "256M",
      "nvme_capacity_bytes": "10G", "nvme_reserve_bytes": "1G", "delayed_update": true,
      "delayed_update_after": 3, "durable": true, "durable_overwrite": true, "checksums": true,
      "gradient_transfer_dtype": "bf16", "schedule": "layer-major", "optimizer_state_dtype": "bf16",
      "frozen_weight_dtype": "int8", "quantized_gradient_bits": 4, "quantization_block_size": 64, "optimizer_threads": 2,
      "speculative_step": true, "collective_timeout_seconds": 60, "host_copy_gbps": 10, "allowed_nvme_roots": ["/tmp"]}
  })";
  std::vector<std::string> warnings;
  Result<EngineConfig> c = ParseEngineConfig(every, &warnings);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_THAT(warnings, ::testing::IsEmpty());
  std::map<std::string, std::string> flat, defaults, again;
  const nlohmann::json tree = VisitedTree(*c, &flat);
  VisitedTree(EngineConfig{}, &defaults);
  // 6 offload_param keys, 7 offload_optimizer, 10 other zero_optimization keys, 5 aio and the
  // backend, 5 optimizer keys (betas one), bf16 and 4 other top-level keys, 7 fp16 keys, 20
  // zinf keys.
  EXPECT_EQ(flat.size(), 6 + 7 + 10 + 6 + 5 + 5 + 7 + 20u);
  for (const auto& [key, value] : flat) {
    // (The stage has one value; fp16 and bf16 exclude each other: fp16.enabled is below.)
    if (key == "zero_optimization.stage" || key == "fp16.enabled") continue;
    EXPECT_NE(value, defaults.at(key)) << key << " reads as its default";
  }
  Result<EngineConfig> back = ParseEngineConfig(tree.dump(), &warnings);
  ASSERT_TRUE(back.ok()) << back.status().ToString() << "\n" << tree.dump(2);
  EXPECT_THAT(warnings, ::testing::IsEmpty());
  VisitedTree(*back, &again);
  EXPECT_EQ(again, flat);
  // Each key left out of the config alone reads as its default, and no other key changes: a
  // visit under another field's name would show that field change instead (whatever the two
  // values are). Keys the parser needs beside others are named.
  std::vector<std::string> needed;
  for (const auto& [key, value] : flat) {
    if (key == "zero_optimization.stage") continue;
    nlohmann::json without = tree;
    const std::vector<std::string> path = KeyPath(key);
    nlohmann::json* at = &without;
    for (size_t i = 0; i + 1 < path.size(); ++i) at = &(*at)[path[i]];
    ASSERT_EQ(at->erase(path.back()), 1u) << key;
    Result<EngineConfig> left = ParseEngineConfig(without.dump(), &warnings);
    if (!left.ok()) {
      needed.push_back(key);
      std::printf("%s left out: %s\n", key.c_str(), left.status().ToString().c_str());
      continue;
    }
    std::map<std::string, std::string> seen;
    VisitedTree(*left, &seen);
    for (const auto& [k, v] : seen) {
      EXPECT_EQ(v, k == key ? defaults.at(k) : flat.at(k)) << k << " with " << key << " left out";
    }
  }
  // (An optimizer block names its type; an nvme device its path; int8 frozen weights need an
  // offloaded parameter device.)
  EXPECT_THAT(needed, ::testing::ElementsAre("optimizer.type",
                                             "zero_optimization.offload_optimizer.nvme_path",
                                             "zero_optimization.offload_param.device",
                                             "zero_optimization.offload_param.nvme_path"));
  std::map<std::string, std::string> fp16;
  Result<EngineConfig> f = ParseEngineConfig(R"({"fp16": {"enabled": true}})", &warnings);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  VisitedTree(*f, &fp16);
  EXPECT_EQ(fp16.at("fp16.enabled"), "true");
  EXPECT_EQ(fp16.at("bf16.enabled"), "false");
  // "auto", a string, for the default speculative step.
  EXPECT_EQ(defaults.at("speculative_step"), "\"auto\"");
  EXPECT_EQ(defaults.at("zero_optimization.offload_param.device"), "\"none\"");
}

// The fp16 block as DeepSpeed reads it: the dynamic scale's settings are checked once they are
// used (fp16 on, loss_scale 0), so a disabled block with odd values parses; auto_cast warns.
TEST(ConfigTest, Fp16SettingsAreCheckedWhenTheyApply) {
  std::vector<std::string> warnings;
  Result<EngineConfig> off = ParseEngineConfig(
      R"({"fp16": {"enabled": false, "hysteresis": 0, "min_loss_scale": 0}})", &warnings);
  ASSERT_TRUE(off.ok()) << off.status().ToString();
  Result<EngineConfig> fixed = ParseEngineConfig(
      R"({"fp16": {"enabled": true, "loss_scale": 1024, "loss_scale_window": 0}})", &warnings);
  ASSERT_TRUE(fixed.ok()) << fixed.status().ToString();
  EXPECT_EQ(fixed->fp16.loss_scale, 1024.0);
  EXPECT_THAT(warnings, ::testing::IsEmpty());
  Result<EngineConfig> cast =
      ParseEngineConfig(R"({"fp16": {"enabled": true, "auto_cast": true}})", &warnings);
  ASSERT_TRUE(cast.ok()) << cast.status().ToString();
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_THAT(warnings[0], HasSubstr("fp16.auto_cast: zinf does not cast"));
  // DeepSpeed's defaults.
  EXPECT_EQ(cast->fp16.initial_scale_power, 16);
  EXPECT_EQ(cast->fp16.loss_scale_window, 1000u);
  EXPECT_EQ(cast->fp16.hysteresis, 2);
  EXPECT_EQ(cast->fp16.min_loss_scale, 1.0);
}

// DeepSpeed's stages 0 to 3 are all taken, as given (zinf/config.h says what each keeps whole).
TEST(ConfigTest, EveryZeroStageParses) {
  for (int stage = 0; stage <= 3; ++stage) {
    Result<EngineConfig> c = ParseEngineConfig(
        R"({"zero_optimization": {"stage": )" + std::to_string(stage) + "}}", nullptr);
    ASSERT_TRUE(c.ok()) << stage << ": " << c.status().ToString();
    EXPECT_EQ(c->zero_stage, stage);
  }
}

// zinf.quantized_gradient_bits: 8 (the default) or 4; anything else refused, naming the key and
// what it takes; zero_hpz_partition_size 0 refused the same way.
TEST(ConfigTest, QuantizedGradientBitsAndHpzSizesAreChecked) {
  Result<EngineConfig> c = ParseEngineConfig("{}", nullptr);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->quantized_gradient_bits, 8u);
  c = ParseEngineConfig(R"({"zinf": {"quantized_gradient_bits": 4}})", nullptr);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->quantized_gradient_bits, 4u);
  for (const char* bad : {"2", "16", "0", "\"4\""}) {
    c = ParseEngineConfig(std::string(R"({"zinf": {"quantized_gradient_bits": )") + bad + "}}",
                          nullptr);
    ASSERT_FALSE(c.ok()) << bad;
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(c.status().message().find("zinf.quantized_gradient_bits"), std::string::npos)
        << c.status().ToString();
  }
  c = ParseEngineConfig(R"({"zinf": {"quantized_gradient_bits": 16}})", nullptr);
  EXPECT_NE(c.status().message().find("8 (the default) or 4"), std::string::npos)
      << c.status().ToString();
  // A config built in code is checked the same way (Engine::Create validates it).
  EngineConfig built;
  built.quantized_gradient_bits = 2;
  const Status v = ValidateEngineConfig(built);
  EXPECT_EQ(v.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(v.message().find("zinf.quantized_gradient_bits"), std::string::npos) << v.ToString();
  c = ParseEngineConfig(R"({"zero_optimization": {"zero_hpz_partition_size": 0}})", nullptr);
  EXPECT_NE(c.status().message().find("give the ranks per node"), std::string::npos)
      << c.status().ToString();
}

// zinf.quantization_block_size: 256 by default, any power of two from 64 to 1024; anything
// else refused naming the key and what it takes, from JSON and from a config built in code.
TEST(ConfigTest, QuantizationBlockSizeIsChecked) {
  Result<EngineConfig> c = ParseEngineConfig("{}", nullptr);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->quantization_block_size, 256u);
  for (uint32_t good : {64u, 128u, 256u, 512u, 1024u}) {
    c = ParseEngineConfig(R"({"zinf": {"quantization_block_size": )" + std::to_string(good) + "}}",
                          nullptr);
    ASSERT_TRUE(c.ok()) << good << ": " << c.status().ToString();
    EXPECT_EQ(c->quantization_block_size, good);
  }
  for (const char* bad : {"0", "32", "100", "2048", "-256", "\"256\""}) {
    c = ParseEngineConfig(std::string(R"({"zinf": {"quantization_block_size": )") + bad + "}}",
                          nullptr);
    ASSERT_FALSE(c.ok()) << bad;
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(c.status().message().find("zinf.quantization_block_size"), std::string::npos)
        << c.status().ToString();
  }
  c = ParseEngineConfig(R"({"zinf": {"quantization_block_size": 100}})", nullptr);
  EXPECT_NE(c.status().message().find("a power of two from 64 to 1024"), std::string::npos)
      << c.status().ToString();
  EngineConfig built;
  built.quantization_block_size = 48;
  const Status v = ValidateEngineConfig(built);
  EXPECT_EQ(v.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(v.message().find("zinf.quantization_block_size"), std::string::npos) << v.ToString();
}

}  // namespace
}  // namespace zinf
