// Training through the engine: the model's gradients, every placement and optimizer ratio
// bit-identical to the all-in-memory run, that run against the simulation, gradient
// accumulation, clipping, and a step that leaves the recorded trace.
#include "tests/engine_harness.h"

namespace zinf {
namespace engine_test {
namespace {

// ---- The model itself -----------------------------------------------------------------------

// The test's kernels are right (so a failure below is the engine's): analytic gradients agree
// with central differences, computed in double from the fp32 forward.
TEST(EngineTestModel, GradientsMatchFiniteDifferences) {
  const MlpShape& shape = Shape();
  std::vector<std::vector<float>> params(shape.num_params());
  for (int p = 0; p < shape.num_params(); ++p) {
    params[p].resize(shape.numel(p));
    testing::InitParam(shape, p, params[p].data(), shape.numel(p));
  }
  const float scale = LossScale();
  std::vector<std::vector<float>> grads, unused;
  testing::MlpGradients(shape, TheBatch(), 0, kGlobalBatch, scale, params, &grads);
  for (int p = 0; p < shape.num_params(); ++p) {
    // The element with the largest gradient: its finite difference is well above fp32 noise.
    size_t i = std::max_element(grads[p].begin(), grads[p].end(),
                                [](float a, float b) { return std::fabs(a) < std::fabs(b); }) -
               grads[p].begin();
    const float h = 1e-2f;
    const float x = params[p][i];
    params[p][i] = x + h;
    double up = testing::MlpGradients(shape, TheBatch(), 0, kGlobalBatch, scale, params, &unused);
    params[p][i] = x - h;
    double down = testing::MlpGradients(shape, TheBatch(), 0, kGlobalBatch, scale, params, &unused);
    params[p][i] = x;
    double numeric = (up - down) / (2.0 * h);
    EXPECT_NEAR(numeric, grads[p][i], 0.05 * std::fabs(grads[p][i]) + 1e-6)
        << ParamName(p) << "[" << i << "]";
  }
}

// ---- Every placement is bit-identical to the all-in-memory run ------------------------------

// ranks, param tier, optimizer tier, delayed update
using PlacementParam = std::tuple<int, Tier, Tier, bool>;

class PlacementTest : public ::testing::TestWithParam<PlacementParam> {};

TEST_P(PlacementTest, BitIdenticalToAllInMemoryRun) {
  ZINF_SKIP_WITHOUT_CUDA();  // the GPU build only
  RunOptions o;
  std::tie(o.ranks, o.param_tier, o.optimizer_tier, o.delayed) = GetParam();
  const RunResult& ref = Reference(o.ranks, o.delayed);
  ASSERT_TRUE(ref.status.ok()) << "all-in-memory run: " << ref.status.ToString();
  RunResult run = RunTraining(o);
  ASSERT_TRUE(run.status.ok()) << o.Describe() << ": " << run.status.ToString();
  ExpectHealthyRun(o, run);
  EXPECT_EQ(FirstBitDifference(run.params, ref.params), "")
      << o.Describe() << " vs the all-in-memory run";
  ASSERT_EQ(run.losses.size(), ref.losses.size());
  for (size_t m = 0; m < run.losses.size(); ++m) {
    EXPECT_EQ(std::memcmp(&run.losses[m], &ref.losses[m], sizeof(double)), 0)
        << "micro-step " << m << " loss " << run.losses[m] << " vs " << ref.losses[m];
  }
}

std::string PlacementName(const ::testing::TestParamInfo<PlacementParam>& info) {
  return "Ranks" + std::to_string(std::get<0>(info.param)) + "_Param" +
         TierLabel(std::get<1>(info.param)) + "_Optimizer" + TierLabel(std::get<2>(info.param)) +
         (std::get<3>(info.param) ? "_Delayed" : "");
}

INSTANTIATE_TEST_SUITE_P(
    AllPlacements, PlacementTest,
    ::testing::Combine(::testing::Values(1, 2, 4),
                       ::testing::Values(Tier::kDevice, Tier::kCpu, Tier::kNvme),
                       ::testing::Values(Tier::kCpu, Tier::kNvme), ::testing::Bool()),
    PlacementName);

// ---- offload_optimizer.ratio: part of the sub-groups stepped on the device --------------------

// ranks, param tier, optimizer tier, ratio
using RatioParam = std::tuple<int, Tier, Tier, double>;

class RatioTest : public ::testing::TestWithParam<RatioParam> {};

// The sub-groups beyond the ratio keep their states in device memory and are stepped there
// (Device::OptimizerStep; with the parameters on the device it writes them straight into
// their stores): bit-identical to the all-in-memory run, and the device holds their states.
TEST_P(RatioTest, BitIdenticalToAllInMemoryRunWithTheRestOnTheDevice) {
  ZINF_SKIP_WITHOUT_CUDA();
  RunOptions o;
  std::tie(o.ranks, o.param_tier, o.optimizer_tier, o.ratio) = GetParam();
  const RunResult& ref = Reference(o.ranks);
  ASSERT_TRUE(ref.status.ok()) << ref.status.ToString();
  RunResult run = RunTraining(o);
  ASSERT_TRUE(run.status.ok()) << o.Describe() << ": " << run.status.ToString();
  ExpectHealthyRun(o, run);
  EXPECT_EQ(FirstBitDifference(run.params, ref.params), "") << o.Describe();
  if (run.device_peaks.empty()) return;  // the CUDA build: no HostDevice to ask
  // The device holds the states of the sub-groups kept there: compare with ratio 1.
  RunOptions offloaded = o;
  offloaded.ratio = 1.0;
  RunResult all_cpu = RunTraining(offloaded);
  ASSERT_TRUE(all_cpu.status.ok()) << all_cpu.status.ToString();
  size_t group_states_min = SIZE_MAX;  // the smallest sub-group's [master|m|v]
  std::map<size_t, size_t> group_numel;
  for (const ParamInfo& info : run.infos) group_numel[info.sub_group] += info.partition_numel;
  ASSERT_GE(group_numel.size(), 2u) << "the test model needs several sub-groups";
  for (const auto& [g, n] : group_numel) group_states_min = std::min(group_states_min, 12 * n);
  for (int r = 0; r < o.ranks; ++r) {
    EXPECT_GE(run.device_peaks[r], all_cpu.device_peaks[r] + group_states_min)
        << "rank " << r << ": no optimizer states on the device";
  }
}

std::string RatioName(const ::testing::TestParamInfo<RatioParam>& info) {
  return "Ranks" + std::to_string(std::get<0>(info.param)) + "_Param" +
         TierLabel(std::get<1>(info.param)) + "_Optimizer" + TierLabel(std::get<2>(info.param)) +
         "_Ratio" + std::to_string(static_cast<int>(std::get<3>(info.param) * 100));
}

INSTANTIATE_TEST_SUITE_P(AllPlacements, RatioTest,
                         ::testing::Combine(::testing::Values(1, 2),
                                            ::testing::Values(Tier::kDevice, Tier::kCpu),
                                            ::testing::Values(Tier::kCpu, Tier::kNvme),
                                            ::testing::Values(0.0, 0.5)),
                         RatioName);

// ---- The all-in-memory run is the right training --------------------------------------------

class ReferenceTest : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(ReferenceTest, MatchesSimulationAndLearns) {
  RunOptions o;
  std::tie(o.ranks, o.delayed) = GetParam();
  const RunResult& ref = Reference(o.ranks, o.delayed);
  ASSERT_TRUE(ref.status.ok()) << ref.status.ToString();
  ExpectHealthyRun(o, ref);

  // What the engine knows of the parameters.
  const MlpShape& shape = Shape();
  ASSERT_EQ(ref.infos.size(), static_cast<size_t>(shape.num_params()));
  size_t max_sub_group = 0;
  for (int p = 0; p < shape.num_params(); ++p) {
    const ParamInfo& info = ref.infos[p];
    SCOPED_TRACE(ParamName(p));
    EXPECT_EQ(info.name, ParamName(p));
    EXPECT_EQ(info.shape, shape.param_shape(p));
    EXPECT_EQ(info.numel, shape.numel(p));
    EXPECT_GE(info.partition_numel, (shape.numel(p) + o.ranks - 1) / o.ranks);
    EXPECT_EQ(info.persistent, shape.numel(p) <= kPersistenceThreshold);
    max_sub_group = std::max(max_sub_group, info.sub_group);
  }
  EXPECT_GE(max_sub_group, 1u) << "sub_group_size " << kSubGroupSize << " over "
                               << shape.total_numel() << " elements gives one sub-group";

  SimResult sim = Simulate(o);
  // The first forward runs on the registered initial values: bit-identical loss.
  ASSERT_EQ(ref.losses.size(), sim.losses.size());
  EXPECT_EQ(ref.losses[0], sim.losses[0]);
  Diff d = Compare(ref.params, sim.params);
  std::printf("  vs simulation: max |diff| %.3g, rms %.3g\n", d.max_abs, d.rms);
  EXPECT_LE(d.max_abs, kSimMaxAbs) << "largest difference at " << d.where;
  EXPECT_LE(d.rms, kSimRms);
  // The training moved the parameters by much more than the tolerance.
  std::vector<std::vector<float>> init(shape.num_params());
  for (int p = 0; p < shape.num_params(); ++p) {
    init[p].resize(shape.numel(p));
    testing::InitParam(shape, p, init[p].data(), shape.numel(p));
  }
  EXPECT_GT(Compare(ref.params, init).rms, 100 * kSimRms);
  if (o.delayed) {
    // Every step trains on the same rows: steps 1 and 2 both run on the initial parameters
    // (bit-identical losses), step 3 on the first update.
    ASSERT_GE(ref.losses.size(), 3u);
    EXPECT_EQ(std::memcmp(&ref.losses[0], &ref.losses[1], sizeof(double)), 0)
        << ref.losses[0] << " vs " << ref.losses[1];
    EXPECT_LT(ref.losses[2], ref.losses[1]);
    // A different training from the undelayed one, by far more than the tolerance.
    const RunResult& undelayed = Reference(o.ranks, false);
    ASSERT_TRUE(undelayed.status.ok()) << undelayed.status.ToString();
    EXPECT_GT(Compare(ref.params, undelayed.params).rms, 100 * kSimRms);
    EXPECT_NE(ref.losses[1], undelayed.losses[1]);
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, ReferenceTest,
                         ::testing::Combine(::testing::Values(1, 2, 4), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<int, bool>>& info) {
                           return "Ranks" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_Delayed" : "");
                         });

// ---- Gradient accumulation ------------------------------------------------------------------

// Two half micro-batches per optimizer step against one step over the whole batch. Not
// bit-exact: each gradient element is summed as (rows 0-7) + (rows 8-15) instead of one
// running sum over 16 rows, which differs by a few ulps of the sum of |terms|, ~1e-7 relative.
// Through 4 Adam steps that bounds the parameter difference as for kSimMaxAbs (at worst
// lr / eps * dg ~ 1e-4 on an element whose gradient is near eps; ~1e-8 typically); a missing
// or doubled micro-step would change the gradient by 2x and the parameters by ~lr. (Measured
// on this problem: max 1.6e-5, rms 7.8e-8.)
TEST(EngineTest, GradientAccumulationMatchesOneStepOverTheWholeBatch) {
  RunOptions o;
  o.ranks = 2;
  o.param_tier = Tier::kNvme;
  o.optimizer_tier = Tier::kCpu;
  o.grad_accum = 2;
  RunResult acc = RunTraining(o);
  ASSERT_TRUE(acc.status.ok()) << o.Describe() << ": " << acc.status.ToString();
  ExpectHealthyRun(o, acc);  // optimizer_ran false, true, false, true, ...
  for (int rank = 0; rank < o.ranks; ++rank) {
    ASSERT_EQ(acc.stats[rank].size(), 8u);
    EXPECT_FALSE(acc.stats[rank][0].optimizer_ran);
    EXPECT_TRUE(acc.stats[rank][1].optimizer_ran);
  }

  const RunResult& whole = Reference(o.ranks);
  ASSERT_TRUE(whole.status.ok()) << whole.status.ToString();
  Diff d = Compare(acc.params, whole.params);
  std::printf("  accumulated vs whole batch: max |diff| %.3g, rms %.3g\n", d.max_abs, d.rms);
  EXPECT_LE(d.max_abs, 1e-4) << "largest difference at " << d.where;
  EXPECT_LE(d.rms, 1e-6);
  std::vector<double> acc_losses = StepLosses(acc.losses, 2);
  std::vector<double> whole_losses = StepLosses(whole.losses, 1);
  ASSERT_EQ(acc_losses.size(), whole_losses.size());
  for (size_t k = 0; k < acc_losses.size(); ++k) {
    EXPECT_NEAR(acc_losses[k], whole_losses[k], 1e-5 * whole_losses[k]) << "step " << k;
  }

  // And against the simulation that accumulates in the same order: as tight as the reference.
  SimResult sim = Simulate(o);
  Diff ds = Compare(acc.params, sim.params);
  std::printf("  accumulated vs simulation: max |diff| %.3g, rms %.3g\n", ds.max_abs, ds.rms);
  EXPECT_LE(ds.max_abs, kSimMaxAbs) << "largest difference at " << ds.where;
  EXPECT_LE(ds.rms, kSimRms);
}

// ---- Gradient clipping ----------------------------------------------------------------------

TEST(EngineTest, ClippingIsActiveAndBitIdenticalAcrossPlacements) {
  const int ranks = 2;
  const std::vector<std::pair<Tier, Tier>> placements = {
      {Tier::kDevice, Tier::kDevice}, {Tier::kCpu, Tier::kNvme}, {Tier::kNvme, Tier::kCpu}};
  RunOptions base;
  base.ranks = ranks;
  base.clipping = kClip;
  SimResult sim = Simulate(base);
  for (double norm : sim.grad_norms) {
    std::printf("  simulated gradient norm %.6f\n", norm);
    ASSERT_GT(norm, 1.5 * kClip) << "clipping would be inactive";
  }

  std::vector<RunResult> runs;
  for (const auto& [param_tier, optimizer_tier] : placements) {
    RunOptions o = base;
    o.param_tier = param_tier;
    o.optimizer_tier = optimizer_tier;
    SCOPED_TRACE(o.Describe());
    runs.push_back(RunTraining(o));
    const RunResult& run = runs.back();
    ASSERT_TRUE(run.status.ok()) << run.status.ToString();
    ExpectHealthyRun(o, run);
    for (int rank = 0; rank < ranks; ++rank) {
      for (int k = 0; k < o.steps; ++k) {
        const StepStats& st = run.stats[rank][k];
        EXPECT_GT(st.grad_norm, kClip) << "rank " << rank << " step " << k;
        // Same gradients as the simulation up to the optimizer's rounding (see kSimMaxAbs).
        EXPECT_NEAR(st.grad_norm, sim.grad_norms[k], 1e-4 * sim.grad_norms[k])
            << "rank " << rank << " step " << k;
      }
    }
    EXPECT_EQ(FirstBitDifference(run.params, runs.front().params), "")
        << "vs the clipped all-in-memory run";
  }
  Diff ds = Compare(runs.front().params, sim.params);
  std::printf("  clipped vs simulation: max |diff| %.3g, rms %.3g\n", ds.max_abs, ds.rms);
  EXPECT_LE(ds.max_abs, kSimMaxAbs) << "vs the clipped simulation, largest at " << ds.where;
  EXPECT_LE(ds.rms, kSimRms);

  // Clipping changed the training by far more than the tolerance: it was applied.
  const RunResult& unclipped = Reference(ranks);
  ASSERT_TRUE(unclipped.status.ok()) << unclipped.status.ToString();
  Diff du = Compare(runs.front().params, unclipped.params);
  std::printf("  clipped vs unclipped: max |diff| %.3g, rms %.3g\n", du.max_abs, du.rms);
  EXPECT_GT(du.rms, 100 * kSimRms) << "clipping had no effect";
}

// zinf.speculative_step: with clipping, the CPU optimizer steps each sub-group as soon as its
// gradients are complete and settles it once the norm is known: kept when the norm is below the
// threshold, redone from its snapshot with the coefficient when above. Either way the run ends
// bit-identical to the one that waits for the norm, on every host tier, with one and two ranks,
// delayed or not, with fp32 and compressed states; the counters say which path ran.
TEST(EngineTest, SpeculativeStepIsBitIdenticalToWaitingForTheNorm) {
  struct Case {
    int ranks;
    Tier params, states;
    bool delayed;
    StateType state_type;
  };
  const Case cases[] = {
      {1, Tier::kCpu, Tier::kCpu, false, StateType::kF32},
      {1, Tier::kCpu, Tier::kNvme, false, StateType::kF32},
      {1, Tier::kNvme, Tier::kNvme, false, StateType::kF32},
      {1, Tier::kDevice, Tier::kCpu, false, StateType::kF32},
      {2, Tier::kCpu, Tier::kNvme, false, StateType::kF32},
      {1, Tier::kCpu, Tier::kCpu, true, StateType::kF32},
      {1, Tier::kNvme, Tier::kNvme, true, StateType::kInt8},
      {2, Tier::kDevice, Tier::kCpu, true, StateType::kBf16},
  };
  // kClip is below every step's norm (every step clips); 1e3 is above all of them (none does).
  for (double clip : {kClip, 1e3}) {
    // Whether a sub-group is stepped before the norm is known depends on the threads' timing
    // (the optimizer must reach it during the backward), so this is asserted over all cases.
    uint64_t speculated_in_all = 0;
    for (const Case& c : cases) {
      RunOptions o;
      o.ranks = c.ranks;
      o.param_tier = c.params;
      o.optimizer_tier = c.states;
      o.delayed = c.delayed;
      o.state_type = c.state_type;
      o.clipping = clip;
      o.speculative = SpeculativeStep::kOff;
      SCOPED_TRACE(o.Describe());
      const RunResult off = RunTraining(o);
      ASSERT_TRUE(off.status.ok()) << off.status.ToString();
      o.speculative = SpeculativeStep::kOn;
      const RunResult on = RunTraining(o);
      ASSERT_TRUE(on.status.ok()) << on.status.ToString();
      EXPECT_EQ(FirstBitDifference(on.params, off.params), "") << "speculation on vs off";
      uint64_t speculated = 0, kept = 0, redone = 0, rolled_back = 0, off_speculated = 0;
      for (int rank = 0; rank < c.ranks; ++rank) {
        for (const StepStats& st : on.stats[rank]) {
          speculated += st.speculated_groups;
          kept += st.kept_groups;
          redone += st.redone_groups;
          rolled_back += st.rolled_back_groups;
        }
        for (const StepStats& st : off.stats[rank]) off_speculated += st.speculated_groups;
      }
      EXPECT_EQ(off_speculated, 0u);
      speculated_in_all += speculated;
      EXPECT_EQ(rolled_back, 0u);
      // (A delayed run's last step settles after the last Step's statistics were taken.)
      if (clip == kClip) {
        EXPECT_EQ(kept, 0u);
        EXPECT_LE(redone, speculated);
        if (!c.delayed) EXPECT_EQ(redone, speculated);
      } else {
        EXPECT_EQ(redone, 0u);
        EXPECT_LE(kept, speculated);
        if (!c.delayed) EXPECT_EQ(kept, speculated);
      }
    }
    std::printf("  clipping %g: %llu sub-group steps speculated in all cases\n", clip,
                static_cast<unsigned long long>(speculated_in_all));
    EXPECT_GT(speculated_in_all, 0u) << "nothing was stepped before the norm was known";
  }
}

// ---- A step that deviates from the recorded trace -------------------------------------------

// Captures log lines for the duration of a test.
class LogCapture {
 public:
  LogCapture() {
    previous_ = SetLogSink([this](LogLevel level, const std::string& line) {
      std::lock_guard<std::mutex> lock(mu_);
      lines_.emplace_back(level, line);
    });
  }
  ~LogCapture() { SetLogSink(previous_); }
  // Warnings whose text contains `word` (case-insensitive).
  std::vector<std::string> Warnings(const std::string& word) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> out;
    for (const auto& [level, line] : lines_) {
      std::string lower = line;
      std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
      if (level == LogLevel::kWarning && lower.find(word) != std::string::npos) {
        out.push_back(line);
      }
    }
    return out;
  }
  void Clear() {
    std::lock_guard<std::mutex> lock(mu_);
    lines_.clear();
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<LogLevel, std::string>> lines_;
  LogSink previous_;
};

TEST(EngineTest, TraceMismatchMidRunCompletesWithAWarning) {
  for (int ranks : {1, 2}) {
    RunOptions o;
    o.ranks = ranks;
    o.param_tier = Tier::kNvme;  // prefetch from NVMe follows the trace
    o.optimizer_tier = Tier::kCpu;
    // Past LocalComm's own 60 s collective timeout, so that its diagnosis (which rank
    // stopped issuing collectives) wins the race when the ranks fall out of step.
    o.timeout = std::chrono::seconds(90);
    SCOPED_TRACE(o.Describe());
    LogCapture log;
    RunResult normal = RunTraining(o);
    ASSERT_TRUE(normal.status.ok()) << normal.status.ToString();
    EXPECT_TRUE(log.Warnings("trace").empty())
        << "a run that follows its trace warned: " << log.Warnings("trace").front();
    log.Clear();

    // Micro-steps 0 and 1 record and follow the trace; 2 swaps the first two acquires; 3 is
    // normal again.
    o.swapped_micro_step = 2;
    RunResult swapped = RunTraining(o);
    ASSERT_TRUE(swapped.status.ok()) << swapped.status.ToString();
    ExpectHealthyRun(o, swapped);
    std::vector<std::string> warnings = log.Warnings("trace");
    EXPECT_GE(warnings.size(), 1u) << "no warning about the trace mismatch";
    for (const std::string& w : warnings) std::printf("  warning: %s\n", w.c_str());
    // The acquire order changes nothing in the arithmetic.
    EXPECT_EQ(FirstBitDifference(swapped.params, normal.params), "");
  }
}

// ---- Parameter groups -----------------------------------------------------------------------

// The biases in a parameter group of their own (another lr, betas, eps, no weight decay): the
// engine steps each parameter with its group's values, on every placement and with 1 and 2
// ranks, as the simulation stepping each with its group's values does; the placements agree
// bit for bit (the same sums, the same kernels); and the run differs from the one-group run by
// far more than the tolerance (the groups are not ignored).
TEST(EngineParamGroups, EachParameterStepsWithItsGroupsValues) {
  for (const int ranks : {1, 2}) {
    RunOptions base;
    base.ranks = ranks;
    base.param_groups = true;
    base.host = true;
    const RunResult first = RunTraining(base);
    ASSERT_TRUE(first.status.ok()) << base.Describe() << ": " << first.status.ToString();
    ExpectHealthyRun(base, first);
    for (int p = 0; p < Shape().num_params(); ++p) {
      EXPECT_EQ(first.infos[p].param_group, p % 2 == 1 ? 1u : 0u) << ParamName(p);
    }
    const SimResult sim = Simulate(base);
    const Diff d = Compare(first.params, sim.params);
    EXPECT_LE(d.max_abs, kSimMaxAbs) << base.Describe() << ": largest difference at " << d.where;
    EXPECT_LE(d.rms, kSimRms) << base.Describe();
    const RunResult& one_group = Reference(ranks);
    ASSERT_TRUE(one_group.status.ok()) << one_group.status.ToString();
    EXPECT_GT(Compare(first.params, one_group.params).rms, 100 * kSimRms) << base.Describe();
    // Offloaded states and parameters (NVMe, cpu) and a device-stepped part: the same bits.
    RunOptions o = base;
    o.param_tier = Tier::kNvme;
    o.optimizer_tier = Tier::kNvme;
    RunResult nvme = RunTraining(o);
    ASSERT_TRUE(nvme.status.ok()) << o.Describe() << ": " << nvme.status.ToString();
    EXPECT_EQ(FirstBitDifference(nvme.params, first.params), "") << o.Describe();
    o = base;
    o.optimizer_tier = Tier::kCpu;
    o.ratio = 0.5;
    RunResult half = RunTraining(o);
    ASSERT_TRUE(half.status.ok()) << o.Describe() << ": " << half.status.ToString();
    EXPECT_EQ(FirstBitDifference(half.params, first.params), "") << o.Describe();
  }
}

}  // namespace
}  // namespace engine_test
}  // namespace zinf
