// zinf.schedule "layer-major": the trainer runs each layer for every micro-batch of a window
// before the next layer, and the window is one Step, so a parameter is fetched once per pass
// whatever the accumulation. Each gradient names its micro-batch and is summed in micro-batch
// order: the parameters are the micro-batch schedule's, bit for bit.
#include "tests/engine_harness.h"

namespace zinf {
namespace engine_test {
namespace {

struct LayerMajorCase {
  std::string name;
  int ranks = 1;
  int accum = 2;
  Tier param_tier = Tier::kDevice;
  Tier optimizer_tier = Tier::kDevice;
  int stage = 3;
  double clipping = 0.0;
  bool delayed = false;
  bool bf16 = false;
  bool quantized_gradients = false;
  int first_micro_only = -1;  // this parameter's gradient in each window's first micro-batch
  uint64_t device_budget = 0;
};

RunOptions Options(const LayerMajorCase& c, bool layer_major) {
  RunOptions o;
  o.ranks = c.ranks;
  o.grad_accum = c.accum;
  o.param_tier = c.param_tier;
  o.optimizer_tier = c.optimizer_tier;
  o.stage = c.stage;
  o.clipping = c.clipping;
  o.delayed = c.delayed;
  o.bf16_transfer = c.bf16;
  o.quantized_gradients = c.quantized_gradients;
  o.first_micro_only = c.first_micro_only;
  o.device_budget_bytes = c.device_budget;
  o.layer_major = layer_major;
  return o;
}

class LayerMajorTest : public ::testing::TestWithParam<LayerMajorCase> {};

// The same parameters and losses as the micro-batch schedule, bit for bit, on every route a
// gradient takes (tiers, ranks, stages 1 and 3, bf16 transfer, qgZ, clipping, the delayed
// update, a parameter without a gradient in the window's last micro-batch).
TEST_P(LayerMajorTest, TrainsTheMicroBatchSchedulesBits) {
  const LayerMajorCase& c = GetParam();
  RunResult micro = RunTraining(Options(c, false));
  ASSERT_TRUE(micro.status.ok()) << micro.status.ToString();
  RunResult layer = RunTraining(Options(c, true));
  ASSERT_TRUE(layer.status.ok()) << layer.status.ToString();
  ExpectHealthyRun(Options(c, true), layer);  // budgets held, a step per window
  Diff d = Compare(layer.params, micro.params);
  EXPECT_TRUE(SameBits(layer.params, micro.params))
      << c.name << ": max |diff| " << d.max_abs << " at " << d.where;
  ASSERT_EQ(layer.losses.size(), micro.losses.size());
  for (size_t m = 0; m < micro.losses.size(); ++m) {
    EXPECT_EQ(layer.losses[m], micro.losses[m]) << c.name << ", micro-batch " << m;
  }
  // The parameters moved (the optimizer ran on the windows' sums).
  std::vector<float> init(Shape().numel(0));
  testing::InitParam(Shape(), 0, init.data(), init.size());
  EXPECT_NE(std::memcmp(init.data(), layer.params[0].data(), init.size() * sizeof(float)), 0);
}

std::vector<LayerMajorCase> Cases() {
  std::vector<LayerMajorCase> v;
  auto add = [&v](LayerMajorCase c) { v.push_back(std::move(c)); };
  add({.name = "OneRankDevice", .accum = 4});
  add({.name = "OneRankCpu", .accum = 4, .param_tier = Tier::kCpu, .optimizer_tier = Tier::kCpu});
  add({.name = "OneRankNvme",
       .accum = 2,
       .param_tier = Tier::kNvme,
       .optimizer_tier = Tier::kNvme});
  add({.name = "OneRankBf16Clipped",
       .accum = 4,
       .param_tier = Tier::kCpu,
       .optimizer_tier = Tier::kCpu,
       .clipping = 0.05,
       .bf16 = true});
  add({.name = "TwoRanks", .ranks = 2, .accum = 4, .optimizer_tier = Tier::kCpu});
  add({.name = "TwoRanksBf16Delayed",
       .ranks = 2,
       .accum = 2,
       .param_tier = Tier::kCpu,
       .optimizer_tier = Tier::kCpu,
       .delayed = true,
       .bf16 = true});
  add({.name = "TwoRanksStage1",
       .ranks = 2,
       .accum = 4,
       .param_tier = Tier::kCpu,
       .optimizer_tier = Tier::kCpu,
       .stage = 1});
  add({.name = "TwoRanksQuantized",
       .ranks = 2,
       .accum = 2,
       .optimizer_tier = Tier::kCpu,
       .quantized_gradients = true});
  add({.name = "AGradientInTheFirstMicroBatchOnly",
       .ranks = 2,
       .accum = 2,
       .optimizer_tier = Tier::kCpu,
       .first_micro_only = 4});
  add({.name = "Stage1AGradientInTheFirstMicroBatchOnly",
       .ranks = 2,
       .accum = 4,
       .optimizer_tier = Tier::kCpu,
       .stage = 1,
       .first_micro_only = 4});
  add({.name = "TightDeviceBudget",
       .accum = 8,
       .param_tier = Tier::kCpu,
       .optimizer_tier = Tier::kCpu,
       .device_budget = 160 << 10});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Schedules, LayerMajorTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<LayerMajorCase>& info) {
                           return info.param.name;
                         });

// A parameter is gathered once per pass whatever the accumulation: 2 ranks, stage 3, 4
// micro-batches per window gather what 1 micro-batch per window gathers, while the
// micro-batch schedule gathers it per micro-batch; every gradient is still reduced.
TEST(LayerMajor, GathersEachParameterOncePerPass) {
  auto run = [](int accum, bool layer_major) {
    RunOptions o;
    o.ranks = 2;
    o.grad_accum = accum;
    o.param_tier = Tier::kCpu;
    o.optimizer_tier = Tier::kCpu;
    o.steps = 2;
    o.layer_major = layer_major;
    RunResult r = RunTraining(o);
    EXPECT_TRUE(r.status.ok()) << r.status.ToString();
    if (!r.status.ok()) return CollectiveCounts{};
    EXPECT_EQ(r.collectives[0].all_gather, r.collectives[1].all_gather);
    return r.collectives[0];
  };
  const CollectiveCounts one = run(1, false), micro = run(4, false), layer = run(4, true);
  EXPECT_EQ(layer.all_gather, one.all_gather);
  // The micro-batch schedule gathers the evicted weights again in each of the 3 later
  // micro-batches of both windows (at least one each).
  EXPECT_GE(micro.all_gather, one.all_gather + 2 * 3);
  const int params = Shape().num_params();
  EXPECT_EQ(layer.reduce_scatter, 2 * 4 * params);  // every micro-batch's gradients
  EXPECT_EQ(micro.reduce_scatter, layer.reduce_scatter);
}

// A layer-major window is one micro-step: each sub-group's gradients of all micro-batches
// arrive before it is stepped, so its pinned accumulators stream (two sub-groups' worth, not
// every gradient) as without accumulation. The smallest pinned budget with 4 micro-batches is
// that of 1, below the micro-batch schedule's by about the gradients; there it trains the
// micro-batch schedule's bits (waiting for the optimizer to free accumulators).
TEST(LayerMajor, StreamsTheGradientAccumulators) {
  TempDir nvme_dir;
  ASSERT_TRUE(nvme_dir.ok());
  RunOptions o;
  o.param_tier = Tier::kCpu;
  o.optimizer_tier = Tier::kNvme;
  o.sub_group_size = 5000;
  RunOptions one = o, micro = o, layer = o;
  micro.grad_accum = layer.grad_accum = 4;
  layer.layer_major = true;
  const uint64_t b_one = SmallestPinnedBudget(one, nvme_dir.path());
  const uint64_t b_micro = SmallestPinnedBudget(micro, nvme_dir.path());
  const uint64_t b_layer = SmallestPinnedBudget(layer, nvme_dir.path());
  size_t grad_bytes = 0;
  for (int p = 0; p < Shape().num_params(); ++p) grad_bytes += Shape().numel(p) * sizeof(float);
  std::printf(
      "  smallest pinned budget: 1 micro-batch %llu, 4 micro-batch-major %llu, 4 "
      "layer-major %llu; gradients %zu bytes\n",
      static_cast<unsigned long long>(b_one), static_cast<unsigned long long>(b_micro),
      static_cast<unsigned long long>(b_layer), grad_bytes);
  EXPECT_EQ(b_layer, b_one);
  EXPECT_GE(b_micro, b_layer + grad_bytes - 2 * (40 << 10));  // as the budget test's bound

  layer.pinned_budget_bytes = b_layer;
  RunResult run = RunTraining(layer);
  ASSERT_TRUE(run.status.ok()) << run.status.ToString();
  ExpectHealthyRun(layer, run);  // peak pinned <= the budget
  RunResult ref = RunTraining(micro);
  ASSERT_TRUE(ref.status.ok()) << ref.status.ToString();
  EXPECT_EQ(FirstBitDifference(run.params, ref.params), "");
}

// Engine and trainer for the refusal tests: one rank, the host device, registered.
struct Rig {
  std::unique_ptr<Device> device = NewTestHostDevice(HostDeviceOptions{});
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<RankTrainer> trainer;
  Status Make(int accum, bool layer_major) {
    ZINF_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Communicator>> comms,
                          NewLocalComms({device.get()}));
    comm = std::move(comms[0]);
    RunOptions o;
    o.grad_accum = accum;
    o.layer_major = layer_major;
    ZINF_ASSIGN_OR_RETURN(engine, Engine::Create(MakeConfig(o, ""), device.get(), comm.get()));
    trainer = std::make_unique<RankTrainer>(engine.get(), device.get());
    return trainer->Register();
  }
};

// Each refusal names the call and what to do, and changes nothing: the window then completes
// and trains.
TEST(LayerMajor, RefusesGradientsOutOfTheSchedule) {
  Rig rig;
  ASSERT_TRUE(rig.Make(2, true).ok());
  Engine* e = rig.engine.get();
  const ParamId w = rig.trainer->id(0);
  ASSERT_TRUE(e->Acquire({w}).ok());
  std::vector<float> grad(Shape().numel(0), 0.01f);
  Status s = e->ReduceGradient(w, grad.data());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("names its micro-batch"), std::string::npos) << s.ToString();
  s = e->ReduceGradient(w, grad.data(), 2);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("a window has 2 micro-batches"), std::string::npos) << s.ToString();
  s = e->ReduceGradient(w, grad.data(), -1);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(e->ReduceGradient(w, grad.data(), 1).ok());
  s = e->ReduceGradient(w, grad.data(), 0);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("increasing micro-batch order"), std::string::npos) << s.ToString();
  s = e->ReduceGradient(w, grad.data(), 1);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(e->Release({w}).ok());
  Result<StepStats> st = e->Step();
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  EXPECT_TRUE(st->optimizer_ran);  // one Step is the whole window
  EXPECT_EQ(e->global_step(), 1);
}

// The micro-batch schedule takes the form naming the micro-batch when it names the current
// micro-step's place in its window.
TEST(LayerMajor, TheMicroBatchScheduleChecksTheNamedMicroBatch) {
  Rig rig;
  ASSERT_TRUE(rig.Make(2, false).ok());
  Engine* e = rig.engine.get();
  const ParamId w = rig.trainer->id(0);
  std::vector<float> grad(Shape().numel(0), 0.01f);
  for (int m = 0; m < 2; ++m) {
    ASSERT_TRUE(e->Acquire({w}).ok());
    Status s = e->ReduceGradient(w, grad.data(), 1 - m);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("this micro-step is micro-batch " + std::to_string(m)),
              std::string::npos)
        << s.ToString();
    ASSERT_TRUE(e->ReduceGradient(w, grad.data(), m).ok());
    ASSERT_TRUE(e->Release({w}).ok());
    Result<StepStats> st = e->Step();
    ASSERT_TRUE(st.ok()) << st.status().ToString();
    EXPECT_EQ(st->optimizer_ran, m == 1);
  }
}

}  // namespace
}  // namespace engine_test
}  // namespace zinf
