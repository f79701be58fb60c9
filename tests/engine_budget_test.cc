// Device and pinned budgets: never exceeded, refused at registration when too small, and
// the streaming gradient accumulators' share.
#include "tests/engine_harness.h"

namespace zinf {
namespace engine_test {
namespace {

// ---- Budgets --------------------------------------------------------------------------------

TEST(EngineTest, DeviceAndPinnedBudgetsAreNeverExceeded) {
  // About four layers of full parameters plus slack (209.5 KiB): room for the acquired layer,
  // its gradient scratch and some prefetch, not for every layer with its gradient.
  const uint64_t budget = 4 * Shape().largest_layer_bytes() + (64 << 10);
  for (auto [ranks, param_tier] :
       {std::pair{1, Tier::kCpu}, std::pair{2, Tier::kCpu}, std::pair{2, Tier::kNvme}}) {
    RunOptions o;
    o.ranks = ranks;
    o.param_tier = param_tier;
    o.optimizer_tier = Tier::kCpu;
    o.device_budget_bytes = budget;
    SCOPED_TRACE(o.Describe());
    RunResult run = RunTraining(o);
    ASSERT_TRUE(run.status.ok()) << run.status.ToString();
    ExpectHealthyRun(o, run);  // peak_device_bytes <= budget, peak_pinned_bytes <= pinned
    for (int rank = 0; rank < o.ranks; ++rank) {
      for (const StepStats& st : run.stats[rank]) {
        EXPECT_GT(st.peak_device_bytes, 0u) << "no device use reported";
        EXPECT_LE(st.peak_device_bytes, budget);
        EXPECT_LE(st.peak_pinned_bytes, kPinnedBudget);
      }
      // The device's own count of what the engine allocated agrees.
      EXPECT_LE(run.device_peaks[rank], budget) << "rank " << rank;
    }
    // A budget changes when data moves, never the arithmetic.
    const RunResult& ref = Reference(o.ranks);
    ASSERT_TRUE(ref.status.ok()) << ref.status.ToString();
    EXPECT_EQ(FirstBitDifference(run.params, ref.params), "");
  }
}

TEST(EngineTest, BudgetTooSmallForTheLargestLayerFailsAtRegistration) {
  // Half of the largest layer: no schedule can acquire it.
  RunOptions o;
  o.param_tier = Tier::kCpu;
  o.optimizer_tier = Tier::kCpu;
  o.device_budget_bytes = Shape().largest_layer_bytes() / 2;
  std::unique_ptr<Device> device = NewTestHostDevice();
  auto comms = NewLocalComms({device.get()});
  ASSERT_TRUE(comms.ok()) << comms.status().ToString();
  Status failure;
  std::string where;
  RunGuarded("registration under a small budget", std::chrono::seconds(60), [&] {
    Result<std::unique_ptr<Engine>> engine =
        Engine::Create(MakeConfig(o, ""), device.get(), (*comms)[0].get());
    if (!engine.ok()) {
      failure = engine.status();
      where = "Engine::Create";
      return;
    }
    RankTrainer trainer(engine->get(), device.get());
    failure = trainer.Register();
    where = "registration";
  });
  ASSERT_FALSE(failure.ok()) << "a " << o.device_budget_bytes
                             << "-byte device budget was accepted for a "
                             << Shape().largest_layer_bytes() << "-byte layer";
  std::printf("  %s: %s\n", where.c_str(), failure.ToString().c_str());
  EXPECT_EQ(where, "registration") << failure.ToString();
  EXPECT_TRUE(failure.code() == StatusCode::kResourceExhausted ||
              failure.code() == StatusCode::kInvalidArgument)
      << failure.ToString();
  EXPECT_NE(failure.message().find("budget"), std::string::npos) << failure.ToString();
}

TEST(EngineTest, StreamingGradientAccumulatorsNeedTwoSubGroupsNotAllGradients) {
  // Without accumulation and clipping, a sub-group holds pinned gradient memory only from its
  // first gradient until it is stepped. Small sub-groups make the difference visible: the
  // model's 180 KB of gradients in ~10 sub-groups of at most 37 KB.
  TempDir nvme_dir;
  ASSERT_TRUE(nvme_dir.ok());
  RunOptions o;
  o.param_tier = Tier::kCpu;
  o.optimizer_tier = Tier::kNvme;
  o.sub_group_size = 5000;
  RunOptions clipped = o;
  clipped.clipping = 1e30;  // never clips, but the norm needs every gradient at once
  const uint64_t streaming = SmallestPinnedBudget(o, nvme_dir.path());
  const uint64_t resident = SmallestPinnedBudget(clipped, nvme_dir.path());
  size_t grad_bytes = 0;
  for (int p = 0; p < Shape().num_params(); ++p) grad_bytes += Shape().numel(p) * sizeof(float);
  std::printf("  smallest pinned budget: streaming %llu, resident %llu; gradients %zu bytes\n",
              static_cast<unsigned long long>(streaming), static_cast<unsigned long long>(resident),
              grad_bytes);
  // Resident accumulators need all gradients; streaming ones at most two 9,216-element
  // sub-groups (plus 4 KiB rounding each), so at least grad_bytes - 2 * 40 KiB less.
  EXPECT_GE(resident, streaming + grad_bytes - 2 * (40 << 10));

  // At the smallest budget the backward must wait for the optimizer to free accumulators;
  // the training is still bit-identical to the all-in-memory run.
  o.pinned_budget_bytes = streaming;
  RunResult run = RunTraining(o);
  ASSERT_TRUE(run.status.ok()) << run.status.ToString();
  ExpectHealthyRun(o, run);  // peak pinned <= the budget
  const RunResult& ref = Reference(1);
  ASSERT_TRUE(ref.status.ok()) << ref.status.ToString();
  EXPECT_EQ(FirstBitDifference(run.params, ref.params), "");

  // The same budget with clipping fails at registration, naming the key to raise.
  clipped.pinned_budget_bytes = streaming;
  Status s = RegisterOnly(clipped, nvme_dir.path());
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  EXPECT_NE(s.message().find("zinf.pinned_budget_bytes"), std::string::npos) << s.ToString();
}

}  // namespace
}  // namespace engine_test
}  // namespace zinf
