// offload_states / reload_states: between steps the engine's device memory goes to host memory
// (all of it but the 16 KiB of small-collective scratch) and comes back, any number of times,
// blocking or not, and the training continues bit-identically to a run without it.
#include "tests/engine_harness.h"

namespace zinf {
namespace engine_test {
namespace {

// stage, ranks, accumulation, param tier, optimizer tier, optimizer ratio
using OffloadParam = std::tuple<int, int, int, Tier, Tier, double>;

class OffloadStatesTest : public ::testing::TestWithParam<OffloadParam> {};

TEST_P(OffloadStatesTest, FreesTheDeviceAndContinuesBitIdentically) {
  RunOptions o;
  std::tie(o.stage, o.ranks, o.grad_accum, o.param_tier, o.optimizer_tier, o.ratio) = GetParam();
  RunResult plain = RunTraining(o);
  ASSERT_TRUE(plain.status.ok()) << o.Describe() << ": " << plain.status.ToString();
  o.offload_cycles = 10;
  RunResult cycled = RunTraining(o);
  ASSERT_TRUE(cycled.status.ok()) << o.Describe() << ": " << cycled.status.ToString();
  ExpectHealthyRun(o, cycled);
  EXPECT_TRUE(SameBits(cycled.params, plain.params)) << o.Describe();
  EXPECT_EQ(cycled.losses, plain.losses);
  for (int r = 0; r < o.ranks; ++r) {
    // What stays: the small collectives' scratch.
    EXPECT_EQ(cycled.offloaded_device_bytes[r], 16384u) << "rank " << r;  // kSmallScratchBytes
#ifndef ZINF_ENGINE_TEST_CUDA
    // And the memory went back to the system, not only to the pool: what stays backed beyond
    // the allocations is at most the rest of the 4 KiB pages holding the scratch and the
    // trainer's gradient buffer (partly filled pages at either end of each).
    EXPECT_LE(cycled.offloaded_committed_excess[r], 4 * kTestPoolChunk) << "rank " << r;
#endif
  }
}

INSTANTIATE_TEST_SUITE_P(Placements, OffloadStatesTest,
                         ::testing::Values(OffloadParam{3, 1, 1, Tier::kDevice, Tier::kDevice, 1.0},
                                           OffloadParam{3, 2, 2, Tier::kDevice, Tier::kCpu, 0.5},
                                           OffloadParam{3, 2, 1, Tier::kNvme, Tier::kNvme, 1.0},
                                           OffloadParam{2, 2, 2, Tier::kCpu, Tier::kDevice, 1.0},
                                           OffloadParam{1, 2, 2, Tier::kDevice, Tier::kCpu, 0.5}),
                         [](const ::testing::TestParamInfo<OffloadParam>& info) {
                           return "Stage" + std::to_string(std::get<0>(info.param)) + "Ranks" +
                                  std::to_string(std::get<1>(info.param)) + "Accum" +
                                  std::to_string(std::get<2>(info.param)) + "Params" +
                                  TierLabel(std::get<3>(info.param)) + "Optimizer" +
                                  TierLabel(std::get<4>(info.param)) +
                                  (std::get<5>(info.param) < 1 ? "Ratio50" : "");
                         });

// offload_states(device="nvme"): everything goes to a swap store of its own and the pinned host
// memory is released (none of it resident), on every tier and stage; each reload reads it back
// and the training goes on bit-identically, 10 cycles per step (the first with an inference
// Acquire reading everything back and a second offload of the union).
TEST(EngineOffload, ToNvmeReleasesThePinnedMemoryAndContinuesBitIdentically) {
  for (const OffloadParam& p : {OffloadParam{3, 2, 1, Tier::kNvme, Tier::kNvme, 1.0},
                                OffloadParam{3, 1, 2, Tier::kCpu, Tier::kCpu, 1.0},
                                OffloadParam{2, 2, 2, Tier::kDevice, Tier::kCpu, 0.5}}) {
    RunOptions o;
    std::tie(o.stage, o.ranks, o.grad_accum, o.param_tier, o.optimizer_tier, o.ratio) = p;
    RunResult plain = RunTraining(o);
    ASSERT_TRUE(plain.status.ok()) << o.Describe() << ": " << plain.status.ToString();
    o.offload_cycles = 10;
    o.offload_device = Tier::kNvme;
    RunResult cycled = RunTraining(o);
    ASSERT_TRUE(cycled.status.ok()) << o.Describe() << ": " << cycled.status.ToString();
    ExpectHealthyRun(o, cycled);
    EXPECT_TRUE(SameBits(cycled.params, plain.params)) << o.Describe();
    EXPECT_EQ(cycled.losses, plain.losses) << o.Describe();
    for (int r = 0; r < o.ranks; ++r) {
      EXPECT_EQ(cycled.offloaded_device_bytes[r], 16384u) << o.Describe() << ", rank " << r;
      EXPECT_GT(cycled.pinned_resident[r].first, 0u) << o.Describe() << ", rank " << r;
      EXPECT_EQ(cycled.pinned_resident[r].second, 0u) << o.Describe() << ", rank " << r;
    }
  }
}

// Two ranks, device-stepped states: `with_offloads` trains as the same run without them.
void ExpectTheSameAsWithout(const RunOptions& with_offloads, const std::string& what) {
  RunOptions o = with_offloads;
  o.offload_cycles = 0;
  o.nvme_faults = false;
  o.block_acquire_rank = -1;
  RunResult plain = RunTraining(o);
  ASSERT_TRUE(plain.status.ok()) << plain.status.ToString();
  RunResult cycled = RunTraining(with_offloads);
  ASSERT_TRUE(cycled.status.ok()) << what << ": " << cycled.status.ToString();
  EXPECT_TRUE(SameBits(cycled.params, plain.params)) << what;
  EXPECT_EQ(cycled.losses, plain.losses) << what;
}

// An NVMe write that fails (on one rank: every rank's call fails) leaves the states in host
// memory, a read back that fails leaves them on NVMe; called again, each succeeds, and the
// training goes on bit-identically.
TEST(EngineOffload, ToNvmeFailuresLoseNothing) {
  RunOptions o;
  o.ranks = 2;
  o.optimizer_tier = Tier::kDevice;
  o.offload_cycles = 3;
  o.offload_device = Tier::kNvme;
  o.nvme_faults = true;
  o.fault_plan = std::make_shared<FaultPlan>();
  ExpectTheSameAsWithout(o, "faults");
  EXPECT_EQ(o.fault_plan->fired(), 2u * (o.steps - 1));  // a write and a read after each step
}

// A reload that fails on one rank only (an inference Acquire finding its device memory taken)
// fails on every rank, though the others reloaded; called again once the memory is free, every
// rank reloads and gathers (the collectives pair: which reloads agree is decided by what every
// rank agreed was offloaded, not by each rank's own state), for NVMe and host offloads.
TEST(EngineOffload, AReloadThatFailsOnOneRankIsRetriedOnAll) {
  for (Tier device : {Tier::kCpu, Tier::kNvme}) {
    RunOptions o;
    o.ranks = 2;
    o.optimizer_tier = Tier::kDevice;
    o.offload_cycles = 2;
    o.offload_device = device;
    o.block_acquire_rank = 1;
    o.timeout = std::chrono::seconds(60);
    ExpectTheSameAsWithout(o, TierLabel(device));
  }
}

// device="nvme" takes everything; a partial include is refused, naming the way out.
TEST(EngineOffload, ToNvmeNamesWhatItTakes) {
  RunOptions o;
  o.offload_cycles = 1;
  o.offload_device = Tier::kNvme;
  o.offload_include = Engine::kOffloadParams;
  RunResult r = RunTraining(o);
  ASSERT_FALSE(r.status.ok());
  EXPECT_EQ(r.status.code(), StatusCode::kInvalidArgument) << r.status.ToString();
  EXPECT_NE(r.status.message().find("include=None"), std::string::npos) << r.status.ToString();
}

// A reload that finds the device memory taken (the trainer's own tensors, as torch's during
// generation) fails with the states still offloaded, gives back what it took, and succeeds
// once the memory is free; the training goes on bit-identically.
TEST(EngineOffload, AReloadWithoutMemoryFailsCleanlyAndSucceedsLater) {
  RunOptions o;
  o.optimizer_tier = Tier::kDevice;
  o.ranks = 2;
  RunResult plain = RunTraining(o);
  ASSERT_TRUE(plain.status.ok()) << plain.status.ToString();
  o.offload_cycles = 2;
  o.block_first_reload = true;
  RunResult blocked = RunTraining(o);
  ASSERT_TRUE(blocked.status.ok()) << blocked.status.ToString();
  ExpectHealthyRun(o, blocked);
  EXPECT_TRUE(SameBits(blocked.params, plain.params));
  EXPECT_EQ(blocked.losses, plain.losses);
  for (int r = 0; r < o.ranks; ++r) {
    EXPECT_EQ(blocked.blocked_reloads[r].code(), StatusCode::kResourceExhausted)
        << blocked.blocked_reloads[r].ToString();
    EXPECT_NE(blocked.blocked_reloads[r].ToString().find("the states stay offloaded"),
              std::string::npos);
    // What the first half of the buffers took went back at once (a run without that keeps
    // it backed).
    EXPECT_EQ(blocked.committed_around_blocked_reload[r].second,
              blocked.committed_around_blocked_reload[r].first)
        << "rank " << r;
  }
}

// Part of the states: the optimizer states alone, then the parameters and gradients alone,
// each leave the device and come back (the inference Acquire in between reloads the
// parameters only); what each leaves in device memory adds up to all of it.
TEST(EngineOffload, EachTypeOfStateOnItsOwn) {
  RunOptions o;
  o.optimizer_tier = Tier::kDevice;
  o.grad_accum = 2;
  RunResult plain = RunTraining(o);
  ASSERT_TRUE(plain.status.ok()) << plain.status.ToString();
  o.offload_cycles = 2;
  o.offload_include = Engine::kOffloadOptimizerStates;
  RunResult states = RunTraining(o);
  ASSERT_TRUE(states.status.ok()) << states.status.ToString();
  ExpectHealthyRun(o, states);
  o.offload_include = Engine::kOffloadParams | Engine::kOffloadGradients;
  RunResult rest = RunTraining(o);
  ASSERT_TRUE(rest.status.ok()) << rest.status.ToString();
  ExpectHealthyRun(o, rest);
  EXPECT_TRUE(SameBits(states.params, plain.params));
  EXPECT_TRUE(SameBits(rest.params, plain.params));
  EXPECT_EQ(states.losses, plain.losses);
  EXPECT_EQ(rest.losses, plain.losses);
  const size_t all = states.device_bytes_before_offload[0];
  EXPECT_EQ(all, rest.device_bytes_before_offload[0]);
  // The states are 3 x 4 bytes per element of every sub-group, the parameters 4 per element.
  EXPECT_GE(all - states.offloaded_device_bytes[0], 3 * Shape().total_numel() * sizeof(float));
  EXPECT_GE(all - rest.offloaded_device_bytes[0], Shape().total_numel() * sizeof(float));
  EXPECT_EQ(states.offloaded_device_bytes[0] + rest.offloaded_device_bytes[0], all + 16384u);
  // An inference Acquire while offloaded reloads the parameters only: nothing when they stayed
  // on the device; theirs, not the gradients', when they left with them.
  EXPECT_EQ(states.device_bytes_after_inference[0], states.offloaded_device_bytes[0]);
  EXPECT_GT(rest.device_bytes_after_inference[0], rest.offloaded_device_bytes[0]);
  EXPECT_LT(rest.device_bytes_after_inference[0], all);
}

// With the delayed update (the next micro-step reads the parameters one update behind) and a
// checkpoint saved while offloaded (it reloads first): still the run without offloads.
TEST(EngineOffload, DelayedUpdateAndACheckpointWhileOffloaded) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  RunOptions o;
  o.ranks = 2;
  o.param_tier = Tier::kNvme;
  o.optimizer_tier = Tier::kDevice;
  o.delayed = true;
  o.checkpoint_dir = dir.path() + "/ckpt";
  o.save_after_step = 2;
  RunResult plain = RunTraining(o);
  ASSERT_TRUE(plain.status.ok()) << plain.status.ToString();
  o.checkpoint_dir = dir.path() + "/ckpt2";
  o.offload_cycles = 3;
  RunResult cycled = RunTraining(o);
  ASSERT_TRUE(cycled.status.ok()) << cycled.status.ToString();
  ExpectHealthyRun(o, cycled);
  EXPECT_TRUE(SameBits(cycled.params, plain.params));
  EXPECT_EQ(cycled.losses, plain.losses);
}

}  // namespace
}  // namespace engine_test
}  // namespace zinf
