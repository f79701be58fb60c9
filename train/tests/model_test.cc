// The GPT trainer end to end through the engine: the model's gradients against finite
// differences, learning, offload placements bit-identical to in-memory training, checkpoints,
// presets and data.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>

#include "tests/test_util.h"
#include "train/checkpoint.h"
#include "train/gpt.h"
#include "train/tests/tiny_model.h"
#include "train/text_data.h"
#include "train/trainer.h"
#include "zinf/comm.h"
#include "zinf/device.h"

namespace zinf::train {
namespace {

using zinf::testing::TempDir;

const char* CorpusPath() { return ZINF_SOURCE_DATA; }

struct Placement {
  Tier param = Tier::kDevice;
  Tier optimizer = Tier::kDevice;
  bool bf16 = false;
  bool delayed = false;  // zinf.delayed_update
};

EngineConfig MakeConfig(const Placement& p, const std::string& nvme) {
  EngineConfig c;
  c.offload_param.tier = p.param;
  c.offload_optimizer.tier = p.optimizer;
  c.offload_param.nvme_paths = {nvme};
  c.offload_optimizer.nvme_paths = {nvme};
  c.bf16 = p.bf16;
  c.delayed_update = p.delayed;
  c.optimizer.type = OptimizerType::kAdamW;
  c.optimizer.lr = 3e-3f;
  c.sub_group_size = 20000;  // several sub-groups even for the tiny model
  c.prefetch_bucket_size = 20000;
  c.param_persistence_threshold = 64;
  c.pinned_budget_bytes = 64ull << 20;
  c.optimizer_threads = 1;
  return c;
}

// One engine (host device, one rank) with the trainer on it.
struct Session {
  std::unique_ptr<Device> device;
  std::vector<std::unique_ptr<Communicator>> comms;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<GptTrainer> trainer;
};

Status Open(const GptConfig& model, const EngineConfig& config, int batch, int seq, uint64_t seed,
            Session* s, const TrainerHooks& hooks = {}) {
  s->device = NewHostDevice(HostDeviceOptions{});
  ZINF_ASSIGN_OR_RETURN(s->comms, NewLocalComms({s->device.get()}));
  ZINF_ASSIGN_OR_RETURN(s->engine, Engine::Create(config, s->device.get(), s->comms[0].get()));
  ZINF_ASSIGN_OR_RETURN(s->trainer, GptTrainer::Create(model, batch, seq, seed, s->engine.get(),
                                                       hooks, s->device.get()));
  return s->engine->FinishRegistration();
}

// Trains `steps` steps from `first` on the corpus; appends the losses.
Status Train(Session* s, const TextData& data, uint64_t seed, int64_t first, int64_t steps,
             std::vector<double>* losses) {
  const int n = s->trainer->batch() * s->trainer->seq();
  std::vector<int32_t> tokens(n), targets(n);
  for (int64_t step = first; step < first + steps; ++step) {
    data.Batch(seed, step, s->trainer->batch(), s->trainer->seq(), tokens.data(), targets.data());
    ZINF_ASSIGN_OR_RETURN(double loss,
                          s->trainer->MicroStep(tokens.data(), targets.data(), 1.0f, nullptr));
    losses->push_back(loss);
  }
  return Status::OK();
}

// ---- Presets ---------------------------------------------------------------------------------

TEST(Presets, ParameterCountsMatchTheGptSizes) {
  // With GPT-2's vocabulary (50,257) and 1,024 positions, the formula gives GPT-2's published
  // counts exactly (tied LM head).
  auto gpt2 = [](int layers, int d, int heads) {
    GptConfig c;
    c.vocab = 50257;
    c.max_seq = 1024;
    c.layers = layers;
    c.d_model = d;
    c.heads = heads;
    return ParamCount(c);
  };
  EXPECT_EQ(gpt2(12, 768, 12), 124'439'808u);
  EXPECT_EQ(gpt2(24, 1024, 16), 354'823'168u);
  EXPECT_EQ(gpt2(36, 1280, 20), 774'030'080u);
  EXPECT_EQ(gpt2(48, 1600, 25), 1'557'611'200u);
  // The GPT-3 presets, with the GPT vocabulary and 2,048 positions, land within 3% of their
  // names (the paper rounds; 2.7B is 2.65B).
  const std::map<std::string, double> nominal = {{"125M", 125e6}, {"350M", 350e6}, {"1.3B", 1.3e9},
                                                 {"2.7B", 2.7e9}, {"6.7B", 6.7e9}, {"13B", 13e9}};
  for (const auto& [name, size] : nominal) {
    Result<GptConfig> c = Preset(name);
    ASSERT_TRUE(c.ok()) << name;
    c->vocab = 50257;
    c->max_seq = 2048;
    const double n = static_cast<double>(ParamCount(*c));
    EXPECT_NEAR(n / size, 1.0, 0.03) << name << ": " << n;
    EXPECT_TRUE(Validate(*c).ok()) << name;
  }
  // The byte-level model the trainer builds: the parameter list sums to ParamCount.
  for (const std::string& name : PresetNames()) {
    GptConfig c = *Preset(name);
    uint64_t sum = 0;
    for (const GptParam& p : ParamList(c)) sum += p.numel();
    EXPECT_EQ(sum, ParamCount(c)) << name;
  }
}

TEST(Presets, BadNamesAndShapesAreClearErrors) {
  Result<GptConfig> bad = Preset("7B");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("125M"), std::string::npos) << bad.status().ToString();
  GptConfig c = TinyModel();
  c.heads = 5;  // 32 is not a multiple of 5
  Status s = Validate(c);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("--heads"), std::string::npos) << s.ToString();
  c = TinyModel();
  c.layers = 0;
  EXPECT_NE(Validate(c).message().find("--layers"), std::string::npos);
}

// Activations that cannot be allocated: a clear error naming the flags, not a crash.
TEST(Presets, ActivationsTooLargeForMemoryAreAClearError) {
  GptConfig c = TinyModel();
  c.max_seq = 4096;
  Session s;
  s.device = NewHostDevice(HostDeviceOptions{});
  auto comms = NewLocalComms({s.device.get()});
  ASSERT_TRUE(comms.ok());
  auto engine = Engine::Create(MakeConfig({}, ""), s.device.get(), (*comms)[0].get());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  // 2^30 tokens x 32 features x 4 bytes: 128 GiB for the first activation alone.
  auto t = GptTrainer::Create(c, 1 << 18, 4096, 1, engine->get(), {}, s.device.get());
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(t.status().message().find("lower --batch or --seq"), std::string::npos)
      << t.status().ToString();
  // More tokens than a step can index (2^31): refused before anything is allocated.
  t = GptTrainer::Create(c, 1 << 20, 4096, 1, engine->get(), {}, s.device.get());
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("--batch x --seq"), std::string::npos)
      << t.status().ToString();
}

// ---- Data ------------------------------------------------------------------------------------

TEST(Data, BatchesAreDeterministicWindowsOfTheText) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  const std::string path = dir.path() + "/text.txt";
  std::string text;
  for (int i = 0; i < 1000; ++i) text += static_cast<char>('a' + (i * 7) % 26);
  std::ofstream(path) << text;
  Result<TextData> data = TextData::Load(path, 16);
  ASSERT_TRUE(data.ok()) << data.status().ToString();
  std::vector<int32_t> t1(64), y1(64), t2(64), y2(64);
  data->Batch(7, 3, 4, 16, t1.data(), y1.data());
  data->Batch(7, 3, 4, 16, t2.data(), y2.data());
  EXPECT_EQ(t1, t2);
  data->Batch(7, 4, 4, 16, t2.data(), y2.data());
  EXPECT_NE(t1, t2) << "another step gave the same batch";
  for (int b = 0; b < 4; ++b) {
    // Each row is a window of the text, and targets are the next bytes.
    std::string row;
    for (int t = 0; t < 16; ++t) row += static_cast<char>(t1[b * 16 + t]);
    size_t at = text.find(row);
    ASSERT_NE(at, std::string::npos);
    for (int t = 0; t < 16; ++t) {
      EXPECT_EQ(y1[b * 16 + t], static_cast<unsigned char>(text[at + t + 1]));
    }
  }
  // Too short for the sequence, and missing: errors that say what to do.
  Result<TextData> short_text = TextData::Load(path, 5000);
  EXPECT_FALSE(short_text.ok());
  Result<TextData> missing = TextData::Load(dir.path() + "/none.txt", 16);
  EXPECT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("--data"), std::string::npos);
}

// ---- Gradients -------------------------------------------------------------------------------

TEST(Model, GradientsMatchFiniteDifferencesThroughTheEngine) {
  // The kernels have their own double-precision gradient checks (kernels_test); this checks
  // the model's wiring (residuals, tied LM head, every parameter's gradient reaching the
  // engine) in the trainer's fp32 arithmetic. For each tensor, the coordinate with the largest
  // gradient is perturbed by +-h in a fresh engine and the central difference of the loss is
  // compared with the gradient. fp32 logits put ~1e-6 noise on a loss of ~5.5, so with
  // h = 1e-2 the difference is good to ~1e-4 absolute, plus O(h^2) curvature: tolerance
  // 5% of the gradient + 2e-4.
  const GptConfig model = TinyModel();
  const int batch = 2, seq = 8;
  const uint64_t seed = 11;
  Result<TextData> data = TextData::Load(CorpusPath(), seq);
  ASSERT_TRUE(data.ok()) << data.status().ToString();
  std::vector<int32_t> tokens(batch * seq), targets(batch * seq);
  data->Batch(seed, 0, batch, seq, tokens.data(), targets.data());
  const EngineConfig config = MakeConfig({}, "");

  std::vector<std::vector<float>> grads(ParamList(model).size());
  double loss0;
  {
    Session s;
    TrainerHooks hooks;
    hooks.grad_observer = [&](size_t i, const float* g, size_t n) { grads[i].assign(g, g + n); };
    ASSERT_TRUE(Open(model, config, batch, seq, seed, &s, hooks).ok());
    Result<double> l = s.trainer->MicroStep(tokens.data(), targets.data(), 1.0f, nullptr);
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    loss0 = *l;
  }
  EXPECT_NEAR(loss0, std::log(256.0), 0.1) << "a fresh model predicts ~uniform bytes";
  auto loss_with = [&](size_t index, size_t j, float delta) {
    Session s;
    TrainerHooks hooks;
    hooks.post_init = [&](size_t i, float* d, size_t) {
      if (i == index) d[j] += delta;
    };
    EXPECT_TRUE(Open(model, config, batch, seq, seed, &s, hooks).ok());
    Result<double> l = s.trainer->MicroStep(tokens.data(), targets.data(), 1.0f, nullptr);
    EXPECT_TRUE(l.ok());
    return l.ok() ? *l : NAN;
  };
  const std::vector<GptParam> list = ParamList(model);
  const float h = 1e-2f;
  for (size_t i = 0; i < list.size(); ++i) {
    ASSERT_EQ(grads[i].size(), list[i].numel()) << list[i].name << ": no gradient reached it";
    size_t j = 0;
    for (size_t k = 0; k < grads[i].size(); ++k) {
      if (std::fabs(grads[i][k]) > std::fabs(grads[i][j])) j = k;
    }
    const double g = grads[i][j];
    const double fd = (loss_with(i, j, h) - loss_with(i, j, -h)) / (2.0 * h);
    EXPECT_NEAR(fd, g, 0.05 * std::fabs(g) + 2e-4)
        << list[i].name << "[" << j << "]: finite difference " << fd << ", gradient " << g;
    EXPECT_GT(std::fabs(g), 1e-3) << list[i].name << ": largest gradient is tiny; test too weak";
  }
}

// ---- Training --------------------------------------------------------------------------------

TEST(Model, TinyModelLossFallsOver50Steps) {
  const GptConfig model = TinyModel();
  Result<TextData> data = TextData::Load(CorpusPath(), 16);
  ASSERT_TRUE(data.ok()) << data.status().ToString();
  Session s;
  ASSERT_TRUE(Open(model, MakeConfig({}, ""), 8, 16, 3, &s).ok());
  std::vector<double> losses;
  Status st = Train(&s, *data, 3, 0, 50, &losses);
  ASSERT_TRUE(st.ok()) << st.ToString();
  double first = 0, last = 0;
  for (int i = 0; i < 5; ++i) {
    first += losses[i] / 5;
    last += losses[45 + i] / 5;
  }
  std::printf("  loss: first 5 steps %.3f, last 5 steps %.3f\n", first, last);
  // Starts at log(256) = 5.55 (uniform over bytes); English text has a unigram entropy of
  // ~3.3 nats per byte, so a model that has learnt byte frequencies is well under 4.
  EXPECT_NEAR(first, std::log(256.0), 0.3);
  EXPECT_LT(last, 4.0);
  for (double l : losses) EXPECT_TRUE(std::isfinite(l));
}

// fp16 (V100s): parameters stored in fp16, the gradients rounded to fp16 as an fp16 model's
// are, dynamic loss scaling from 2^32 (a start that overflows until the scale has come down,
// each overflowing step skipped). Its losses end within 2 % of bf16's (the bar), after
// DeepSpeed's hysteresis 2 took the scale down to where the gradients fit fp16.
// (400 steps of the tiny model: about 2 s.)
TEST(Model, Fp16FromAScaleOf2To32TrainsWithin2PercentOfBf16) {
  const GptConfig model = TinyModel();
  Result<TextData> data = TextData::Load(CorpusPath(), 16);
  ASSERT_TRUE(data.ok()) << data.status().ToString();
  constexpr int kSteps = 400;
  auto run = [&](bool fp16, std::vector<double>* losses, StepStats* last) {
    Placement p;
    p.param = Tier::kCpu;
    p.optimizer = Tier::kCpu;
    p.bf16 = !fp16;
    EngineConfig c = MakeConfig(p, "");
    if (fp16) {
      c.fp16.enabled = true;
      c.fp16.initial_scale_power = 32;
    }
    Session s;
    ASSERT_TRUE(Open(model, c, 8, 16, 3, &s).ok());
    const int n = s.trainer->batch() * s.trainer->seq();
    std::vector<int32_t> tokens(n), targets(n);
    for (int64_t step = 0; step < kSteps; ++step) {
      data->Batch(3, step, s.trainer->batch(), s.trainer->seq(), tokens.data(), targets.data());
      Result<double> loss = s.trainer->MicroStep(tokens.data(), targets.data(), 1.0f, last);
      ASSERT_TRUE(loss.ok()) << loss.status().ToString();
      losses->push_back(*loss);
    }
  };
  std::vector<double> half, bf16;
  StepStats half_last, bf16_last;
  run(true, &half, &half_last);
  run(false, &bf16, &bf16_last);
  if (::testing::Test::HasFatalFailure()) return;
  auto tail = [](const std::vector<double>& l) {
    double sum = 0;
    for (size_t i = l.size() - 20; i < l.size(); ++i) sum += l[i];
    return sum / 20;
  };
  std::printf("  last 20 steps' loss: fp16 %.4f, bf16 %.4f; fp16 skipped %llu steps, scale %g\n",
              tail(half), tail(bf16), static_cast<unsigned long long>(half_last.skipped_steps),
              half_last.loss_scale);
  // The start overflowed: the scale came down from 2^32 by halving (hysteresis 2: one step
  // more than halvings), and then the model trained.
  EXPECT_GE(half_last.skipped_steps, 10u);
  EXPECT_LT(half_last.loss_scale, 4294967296.0);
  EXPECT_EQ(bf16_last.skipped_steps, 0u);
  EXPECT_EQ(bf16_last.loss_scale, 1.0);
  // Not worse than bf16 by more than 2 %. (It ends lower: fp16 keeps 10 mantissa bits to bf16's
  // 7, here 2.48 against 2.52 after 400 steps, 17 of them skipped.)
  EXPECT_LT((tail(half) - tail(bf16)) / tail(bf16), 0.02);
  // The first step (the loss before any update) is the same model, rounded to fp16 or bf16.
  EXPECT_NEAR(half[0], bf16[0], 0.02);
}

class OffloadTest : public ::testing::TestWithParam<Placement> {};

TEST_P(OffloadTest, LossesAndParametersBitIdenticalToInMemory) {
  const GptConfig model = TinyModel();
  Result<TextData> data = TextData::Load(CorpusPath(), 16);
  ASSERT_TRUE(data.ok()) << data.status().ToString();
  TempDir nvme;
  ASSERT_TRUE(nvme.ok());
  Placement in_memory;
  in_memory.bf16 = GetParam().bf16;
  in_memory.delayed = GetParam().delayed;
  std::vector<double> ref_losses, losses;
  uint64_t ref_sum = 0, sum = 0;
  {
    Session s;
    ASSERT_TRUE(Open(model, MakeConfig(in_memory, ""), 4, 16, 5, &s).ok());
    ASSERT_TRUE(Train(&s, *data, 5, 0, 5, &ref_losses).ok());
    ref_sum = *s.trainer->ParamChecksum();
  }
  {
    Session s;
    Status st = Open(model, MakeConfig(GetParam(), nvme.path()), 4, 16, 5, &s);
    ASSERT_TRUE(st.ok()) << st.ToString();
    st = Train(&s, *data, 5, 0, 5, &losses);
    ASSERT_TRUE(st.ok()) << st.ToString();
    sum = *s.trainer->ParamChecksum();
  }
  ASSERT_EQ(losses.size(), 5u);
  for (size_t i = 0; i < losses.size(); ++i) {
    EXPECT_EQ(std::memcmp(&losses[i], &ref_losses[i], sizeof(double)), 0)
        << "step " << i << ": " << losses[i] << " vs " << ref_losses[i];
  }
  EXPECT_EQ(sum, ref_sum);
  EXPECT_LT(losses.back(), losses.front());
  if (GetParam().delayed) {
    // Steps 1 and 2 both ran on the initial parameters, on different batches: the second
    // loss is close to the first (no update yet), not bit-equal.
    EXPECT_NEAR(losses[1], losses[0], 0.05);
  }
}

INSTANTIATE_TEST_SUITE_P(Placements, OffloadTest,
                         ::testing::Values(Placement{Tier::kNvme, Tier::kNvme, true},
                                           Placement{Tier::kCpu, Tier::kNvme, true},
                                           Placement{Tier::kNvme, Tier::kCpu, false},
                                           Placement{Tier::kNvme, Tier::kNvme, true, true},
                                           Placement{Tier::kCpu, Tier::kCpu, true, true}),
                         [](const ::testing::TestParamInfo<Placement>& info) {
                           return std::string("Param") + TierName(info.param.param) + "_Optimizer" +
                                  TierName(info.param.optimizer) +
                                  (info.param.bf16 ? "_bf16" : "_fp32") +
                                  (info.param.delayed ? "_Delayed" : "");
                         });

// The trainer as it runs on a GPU (--device cuda): every acquired layer copied to host memory
// and every gradient to device memory through the Device API. Forced on the host device, it
// trains the same bits as the direct path (bf16 and fp32 storage, the bf16 matmul kernels
// reading the staged copy, parameters on the device and on NVMe).
TEST(Model, StagingThroughTheDeviceIsBitIdentical) {
  const GptConfig model = TinyModel();
  Result<TextData> data = TextData::Load(CorpusPath(), 16);
  ASSERT_TRUE(data.ok()) << data.status().ToString();
  for (const Placement& p :
       {Placement{Tier::kDevice, Tier::kDevice, true},
        Placement{Tier::kDevice, Tier::kDevice, false}, Placement{Tier::kNvme, Tier::kCpu, true}}) {
    SCOPED_TRACE(std::string("params ") + TierName(p.param) + (p.bf16 ? " bf16" : " fp32"));
    TempDir nvme;
    ASSERT_TRUE(nvme.ok());
    std::vector<double> losses[2];
    uint64_t sums[2] = {0, 1};
    for (int staged = 0; staged < 2; ++staged) {
      TrainerHooks hooks;
      hooks.stage_through_device = staged == 1;
      int observed = 0;
      hooks.grad_observer = [&observed](size_t, const float*, size_t) { ++observed; };
      Session s;
      Status st = Open(model, MakeConfig(p, nvme.path()), 4, 16, 5, &s, hooks);
      ASSERT_TRUE(st.ok()) << st.ToString();
      st = Train(&s, *data, 5, 0, 4, &losses[staged]);
      ASSERT_TRUE(st.ok()) << st.ToString();
      sums[staged] = *s.trainer->ParamChecksum();
      EXPECT_GT(observed, 0);
    }
    EXPECT_EQ(sums[1], sums[0]);
    ASSERT_EQ(losses[1].size(), losses[0].size());
    for (size_t i = 0; i < losses[0].size(); ++i) {
      EXPECT_EQ(std::memcmp(&losses[1][i], &losses[0][i], sizeof(double)), 0) << "step " << i;
    }
  }
}

// zinf.schedule layer-major: GptTrainer::Window over k micro-batches (each block for every
// micro-batch, block inputs kept, blocks recomputed in the backward) gives MicroStep's
// losses and parameters bit for bit: fp32 and bf16 (its bf16 matmuls), in memory and with
// the parameters on NVMe, staged through the device, with several sub-groups; and it
// acquires each block twice per window where MicroStep acquires it twice per micro-batch.
TEST(Model, LayerMajorWindowsAreBitIdenticalToMicroSteps) {
  const GptConfig model = TinyModel();
  Result<TextData> data = TextData::Load(CorpusPath(), 16);
  ASSERT_TRUE(data.ok()) << data.status().ToString();
  constexpr int kAccum = 3, kSteps = 3, kBatch = 2, kSeq = 16;
  for (const Placement& p :
       {Placement{Tier::kDevice, Tier::kDevice, false}, Placement{Tier::kDevice, Tier::kCpu, true},
        Placement{Tier::kNvme, Tier::kNvme, true}}) {
    for (bool staged : {false, true}) {
      SCOPED_TRACE(std::string("params ") + TierName(p.param) + (p.bf16 ? " bf16" : " fp32") +
                   (staged ? ", staged" : ""));
      TempDir nvme;
      ASSERT_TRUE(nvme.ok());
      std::vector<double> losses[2];
      uint64_t sums[2] = {0, 1};
      uint64_t acquires[2] = {0, 0};
      for (int layer_major = 0; layer_major < 2; ++layer_major) {
        EngineConfig c = MakeConfig(p, nvme.path());
        c.gradient_accumulation_steps = kAccum;
        c.layer_major = layer_major == 1;
        TrainerHooks hooks;
        hooks.stage_through_device = staged;
        Session s;
        Status st = Open(model, c, kBatch, kSeq, 5, &s, hooks);
        ASSERT_TRUE(st.ok()) << st.ToString();
        const int n = kBatch * kSeq;
        std::vector<int32_t> tokens(n * kAccum), targets(n * kAccum);
        for (int step = 0; step < kSteps; ++step) {
          for (int j = 0; j < kAccum; ++j) {
            data->Batch(5, step * kAccum + j, kBatch, kSeq, tokens.data() + j * n,
                        targets.data() + j * n);
          }
          StepStats stats;
          if (layer_major == 1) {
            Result<std::vector<double>> l =
                s.trainer->Window(tokens.data(), targets.data(), 1.0f / kAccum, &stats);
            ASSERT_TRUE(l.ok()) << l.status().ToString();
            ASSERT_EQ(l->size(), static_cast<size_t>(kAccum));
            losses[1].insert(losses[1].end(), l->begin(), l->end());
            EXPECT_TRUE(stats.optimizer_ran);
            acquires[1] += stats.prefetch_hits + stats.prefetch_misses;
          } else {
            for (int j = 0; j < kAccum; ++j) {
              Result<double> l = s.trainer->MicroStep(tokens.data() + j * n, targets.data() + j * n,
                                                      1.0f / kAccum, &stats);
              ASSERT_TRUE(l.ok()) << l.status().ToString();
              losses[0].push_back(*l);
              acquires[0] += stats.prefetch_hits + stats.prefetch_misses;
            }
          }
        }
        sums[layer_major] = *s.trainer->ParamChecksum();
        // The other schedule's call is refused, naming the one to make.
        Status wrong =
            layer_major == 1
                ? s.trainer->MicroStep(tokens.data(), targets.data(), 1.0f, nullptr).status()
                : s.trainer->Window(tokens.data(), targets.data(), 1.0f, nullptr).status();
        EXPECT_EQ(wrong.code(), StatusCode::kFailedPrecondition) << wrong.ToString();
      }
      EXPECT_EQ(sums[1], sums[0]);
      ASSERT_EQ(losses[1].size(), losses[0].size());
      for (size_t i = 0; i < losses[0].size(); ++i) {
        EXPECT_EQ(std::memcmp(&losses[1][i], &losses[0][i], sizeof(double)), 0) << i;
      }
      // Embeddings, blocks and head once in the forward, blocks once in the backward: per
      // window, not per micro-batch.
      EXPECT_EQ(acquires[0], kAccum * acquires[1]);
    }
  }
}

// ---- Checkpoints -----------------------------------------------------------------------------

TEST(Checkpoint, ResumeIsBitIdenticalToAnUninterruptedRun) {
  const GptConfig model = TinyModel();
  Result<TextData> data = TextData::Load(CorpusPath(), 16);
  ASSERT_TRUE(data.ok());
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const std::string ckpt = tmp.path() + "/ckpt";
  const Placement nvme{Tier::kNvme, Tier::kNvme, true};
  for (const char* sub : {"/a", "/b", "/c"}) std::filesystem::create_directory(tmp.path() + sub);
  std::vector<double> straight, resumed;
  uint64_t straight_sum, resumed_sum;
  {
    Session s;
    ASSERT_TRUE(Open(model, MakeConfig(nvme, tmp.path() + "/a"), 4, 16, 9, &s).ok());
    ASSERT_TRUE(Train(&s, *data, 9, 0, 6, &straight).ok());
    straight_sum = *s.trainer->ParamChecksum();
  }
  {
    Session s;
    ASSERT_TRUE(Open(model, MakeConfig(nvme, tmp.path() + "/b"), 4, 16, 9, &s).ok());
    ASSERT_TRUE(Train(&s, *data, 9, 0, 2, &resumed).ok());
    ASSERT_TRUE(SaveCheckpoint(ckpt, model, 9, s.engine.get()).ok());
    ASSERT_TRUE(Train(&s, *data, 9, 2, 1, &resumed).ok());
    Status st = SaveCheckpoint(ckpt, model, 9, s.engine.get());
    ASSERT_TRUE(st.ok()) << st.ToString();
    // A step that is never saved: the resumed run must not see it.
    std::vector<double> lost;
    ASSERT_TRUE(Train(&s, *data, 9, 3, 1, &lost).ok());
  }
  // The older checkpoint was kept as the previous one; latest names step 3.
  int folders = 0;
  for (const auto& e : std::filesystem::directory_iterator(ckpt)) {
    folders += e.path().filename().string().rfind("step-", 0) == 0;
    EXPECT_NE(e.path().filename().string(), ".incoming");
  }
  EXPECT_EQ(folders, 2);
  {
    Session s;
    ASSERT_TRUE(Open(model, MakeConfig(nvme, tmp.path() + "/c"), 4, 16, 9, &s).ok());
    Result<int64_t> step = LoadCheckpoint(ckpt, model, 9, s.engine.get());
    ASSERT_TRUE(step.ok()) << step.status().ToString();
    EXPECT_EQ(*step, 3);
    ASSERT_TRUE(Train(&s, *data, 9, 3, 3, &resumed).ok());
    resumed_sum = *s.trainer->ParamChecksum();
  }
  ASSERT_EQ(resumed.size(), straight.size());
  for (size_t i = 0; i < straight.size(); ++i) {
    EXPECT_EQ(std::memcmp(&straight[i], &resumed[i], sizeof(double)), 0) << "step " << i;
  }
  EXPECT_EQ(resumed_sum, straight_sum);
}

TEST(Checkpoint, CorruptTornAndMismatchedCheckpointsAreRefused) {
  const GptConfig model = TinyModel();
  Result<TextData> data = TextData::Load(CorpusPath(), 16);
  ASSERT_TRUE(data.ok());
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const std::string ckpt = tmp.path() + "/ckpt";
  const Placement cpu{Tier::kCpu, Tier::kCpu, true};
  uint64_t before;
  {
    Session s;
    ASSERT_TRUE(Open(model, MakeConfig(cpu, ""), 4, 16, 1, &s).ok());
    std::vector<double> losses;
    ASSERT_TRUE(Train(&s, *data, 1, 0, 2, &losses).ok());
    ASSERT_TRUE(SaveCheckpoint(ckpt, model, 1, s.engine.get()).ok());
  }
  std::string latest;
  std::ifstream(ckpt + "/latest") >> latest;
  const std::string states = ckpt + "/" + latest + "/rank0.states";
  struct stat st {};
  ASSERT_EQ(stat(states.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u) << "checkpoint files must be private";

  Session s;
  ASSERT_TRUE(Open(model, MakeConfig(cpu, ""), 4, 16, 1, &s).ok());
  before = *s.trainer->ParamChecksum();
  // One flipped bit in the first tensor's master values (the file starts with sub-group 0,
  // whose first slice is wte's): refused, naming the tensor; nothing changed.
  {
    std::fstream f(states, std::ios::in | std::ios::out | std::ios::binary);
    char c;
    f.seekg(13);
    f.get(c);
    f.seekp(13);
    f.put(static_cast<char>(c ^ 0x10));
  }
  Result<int64_t> r = LoadCheckpoint(ckpt, model, 1, s.engine.get());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << r.status().ToString();
  EXPECT_NE(r.status().message().find("checkpoint tensor 'wte' (master weights)"),
            std::string::npos)
      << r.status().ToString();
  EXPECT_EQ(*s.trainer->ParamChecksum(), before);
  // Torn (truncated): refused.
  ASSERT_EQ(truncate(states.c_str(), st.st_size - 4096), 0);
  r = LoadCheckpoint(ckpt, model, 1, s.engine.get());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("torn"), std::string::npos) << r.status().ToString();
  // Another model: refused with a message naming the difference.
  GptConfig other = model;
  other.layers = 3;
  Session s2;
  ASSERT_TRUE(Open(other, MakeConfig(cpu, ""), 4, 16, 1, &s2).ok());
  r = LoadCheckpoint(ckpt, other, 1, s2.engine.get());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("does not match this model"), std::string::npos)
      << r.status().ToString();
  // No checkpoint at all.
  r = LoadCheckpoint(tmp.path() + "/nothing", model, 1, s.engine.get());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound) << r.status().ToString();
}

}  // namespace
}  // namespace zinf::train
