// The engine's pure components on their own: the layout (partitions, sub-groups, slices, the
// device-kept share), the acquire trace (its three modes, the cursor, reuse distances), the
// pinned memory plan (what it takes, when it refuses, how many streaming blocks) and the
// durable commit every rank agrees to resume at.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <future>
#include <string>
#include <vector>

#include "engine/core/acquire_trace.h"
#include "engine/core/group_board.h"
#include "engine/core/layout.h"
#include "engine/core/memory_plan.h"
#include "engine/persistence/durable_commits.h"
#include "zinf/engine.h"

namespace zinf {
namespace {

// Three parameters of 5,000 / 100 / 9,000 elements on `world` ranks.
Layout ThreeParams(int world, size_t elem_size = 4, bool frozen_middle = false) {
  Layout l(world, elem_size);
  const std::vector<std::pair<std::string, int64_t>> defs = {{"a", 5000}, {"b", 100}, {"c", 9000}};
  for (const auto& [name, n] : defs) {
    Result<ParamLayout> p = l.Describe(name, {n}, !(frozen_middle && name == "b"), 1000);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    l.Add(*p);
  }
  return l;
}

TEST(LayoutTest, PartitionsArePaddedPerRankAndSlicesAligned) {
  Layout l = ThreeParams(/*world=*/3);
  // 5000 / 3 = 1666.67 -> 1667, rounded up to a multiple of 16: 1680 per rank.
  EXPECT_EQ(l.param(0).info.partition_numel, 1680u);
  EXPECT_EQ(l.param(0).padded_numel, 5040u);
  EXPECT_EQ(l.param(1).info.partition_numel, 48u);  // 34 -> 48
  EXPECT_FALSE(l.param(0).info.persistent);
  EXPECT_TRUE(l.param(1).info.persistent);  // 100 <= threshold 1000
  // Sub-groups of at most 4,096 state elements: slices are 2,048-aligned, so "a" (1680 ->
  // 2048) and "b" (48 -> 2048) share one, "c" (3008 -> 4096) has its own.
  EXPECT_EQ(l.Freeze(4096, Tier::kCpu, 1.0), 2u);
  ASSERT_EQ(l.num_groups(), 2u);
  EXPECT_EQ(l.group(0).params, (std::vector<ParamId>{0, 1}));
  EXPECT_EQ(l.group(0).numel, 4096u);
  EXPECT_EQ(l.param(1).slice_offset, 2048u);
  EXPECT_EQ(l.param(1).index_in_group, 1u);
  EXPECT_EQ(l.param(2).info.sub_group, 1u);
  EXPECT_EQ(l.param(2).slice_offset, 0u);
  EXPECT_EQ(l.GroupStateBytes(1), 4096u * 3 * 4);
  EXPECT_EQ(l.GroupOrder(), (std::vector<size_t>{1, 0}));
  EXPECT_FALSE(l.group(0).on_device);
}

TEST(LayoutTest, RatioKeepsTheFirstSubGroupsOnTheDevice) {
  Layout l = ThreeParams(1, 2, /*frozen_middle=*/true);
  // Two trainable groups of one parameter ("a", "c"); llround(0.5 * 2) = 1 offloaded. The
  // frozen "b" is in the last group, neither offloaded nor kept.
  EXPECT_EQ(l.Freeze(1, Tier::kCpu, 0.5), 1u);
  ASSERT_EQ(l.num_groups(), 3u);
  EXPECT_TRUE(l.group(0).on_device);
  EXPECT_FALSE(l.group(1).on_device);
  EXPECT_FALSE(l.group(2).on_device);
  EXPECT_EQ(l.group(2).trainable, 0);    // "b" is frozen
  EXPECT_EQ(l.PartBytes(2), 9008u * 2);  // bf16 storage
  Layout all = ThreeParams(1);
  EXPECT_EQ(all.Freeze(1, Tier::kDevice, 1.0), 0u);
  for (const GroupLayout& g : all.groups()) EXPECT_TRUE(g.on_device);
}

TEST(LayoutTest, FrozenParametersHoldNoStatesAndShareNoSubGroup) {
  // "b" frozen between two trainable ones that fit one sub-group: they share it, "b" gets the
  // last one, without states, and the optimizer's order leaves it out.
  Layout l = ThreeParams(1, 4, /*frozen_middle=*/true);
  EXPECT_EQ(l.Freeze(1 << 20, Tier::kNvme, 1.0), 1u);
  ASSERT_EQ(l.num_groups(), 2u);
  EXPECT_EQ(l.group(0).params, (std::vector<ParamId>{0, 2}));
  EXPECT_FALSE(l.group(0).frozen);
  EXPECT_EQ(l.param(2).slice_offset, 6144u);  // 5000 -> 6144 (2,048-aligned) before it
  EXPECT_EQ(l.group(1).params, (std::vector<ParamId>{1}));
  EXPECT_TRUE(l.group(1).frozen);
  EXPECT_EQ(l.param(1).info.sub_group, 1u);
  EXPECT_EQ(l.group(1).numel, 0u);
  EXPECT_EQ(l.GroupStateBytes(1), 0u);
  EXPECT_EQ(l.GroupGradBytes(1), 0u);
  EXPECT_EQ(l.GroupOrder(), (std::vector<size_t>{0}));
  EXPECT_EQ(l.num_frozen(), 1u);
  EXPECT_EQ(l.frozen_numel(), 100u);
  // All frozen: one state-less group, nothing for the optimizer.
  Layout none(1, 2);
  for (const char* name : {"x", "y"}) none.Add(*none.Describe(name, {64}, false, 0));
  EXPECT_EQ(none.Freeze(1 << 20, Tier::kCpu, 1.0), 0u);
  ASSERT_EQ(none.num_groups(), 1u);
  EXPECT_TRUE(none.GroupOrder().empty());
  EXPECT_EQ(none.LargestGroupStateBytes(), 0u);
}

TEST(LayoutTest, DescribeRefusesBadShapesNamesAndDuplicates) {
  Layout l = ThreeParams(1);
  EXPECT_EQ(l.Describe("a", {4}, true, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(l.Describe("z", {4, 0}, true, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(l.Describe("z", {}, true, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(l.Describe("", {4}, true, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(l.Describe("z", {1 << 25, 1 << 24}, true, 0).status().code(),
            StatusCode::kInvalidArgument);  // 2^49 elements
  l.Freeze(1 << 20, Tier::kCpu, 1.0);
  EXPECT_EQ(l.Describe("z", {4}, true, 0).status().code(), StatusCode::kFailedPrecondition);
}

TEST(AcquireTraceTest, RecordsOnceThenChecksAndInvalidatesOnDivergence) {
  Layout l = ThreeParams(1);
  AcquireTrace t;
  EXPECT_EQ(t.mode(), AcquireTrace::Mode::kRecord);
  EXPECT_EQ(t.ReuseDistance(0, l), UINT64_MAX);  // no valid trace yet
  for (ParamId id : {0u, 1u, 2u, 1u}) EXPECT_EQ(t.Check(id, l), "");
  t.EndMicroStep();
  EXPECT_EQ(t.mode(), AcquireTrace::Mode::kComplete);
  EXPECT_EQ(t.cursor(), 0u);
  // From the start: "b" is next after "a" (5,000 elements away), "c" after "a" and "b".
  EXPECT_EQ(t.ReuseDistance(0, l), 0u);
  EXPECT_EQ(t.ReuseDistance(1, l), 5000u);
  EXPECT_EQ(t.ReuseDistance(2, l), 5100u);
  EXPECT_EQ(t.Check(0, l), "");
  EXPECT_EQ(t.Check(1, l), "");
  EXPECT_EQ(t.ReuseDistance(1, l), 9000u);       // its second use, after "c"
  EXPECT_EQ(t.ReuseDistance(0, l), UINT64_MAX);  // not used again this micro-step
  const std::string warning = t.Check(1, l);     // "c" expected
  EXPECT_NE(warning.find("acquire #2 was 'b'"), std::string::npos) << warning;
  EXPECT_NE(warning.find("expected 'c'"), std::string::npos) << warning;
  EXPECT_EQ(t.mode(), AcquireTrace::Mode::kInvalid);
  t.EndMicroStep();
  EXPECT_EQ(t.mode(), AcquireTrace::Mode::kInvalid);  // stays off
}

TEST(AcquireTraceTest, GivenOrderIsCompleteUnlessEmpty) {
  Layout l = ThreeParams(1);
  AcquireTrace t;
  t.SetOrder({2, 0});
  EXPECT_TRUE(t.valid());
  EXPECT_EQ(t.ReuseDistance(0, l), 9000u);
  t.SetOrder({});
  EXPECT_EQ(t.mode(), AcquireTrace::Mode::kInvalid);
  t.EndMicroStep();  // an empty recording never becomes complete
  EXPECT_FALSE(t.valid());
}

// A sub-group's last gradient landing piece by piece (GradientWindow's inline copy): the
// optimizer may start on it once it is the only one missing and a piece has landed, and then
// steps each piece once it is there; not with clipping (the norm needs every gradient), not
// for a piece of a gradient that is not the last, nor outside the window's end.
TEST(GroupBoardTest, ALandingGradientIsSteppedPieceByPieceOnlyAsTheGroupsLast) {
  Layout l = ThreeParams(/*world=*/3);             // as in LayoutTest.PartitionsArePadded...
  ASSERT_EQ(l.Freeze(4096, Tier::kCpu, 1.0), 2u);  // group 0: "a", "b"; group 1: "c"
  GroupBoard board(&l);
  // Whether `f` is still waiting after a while (it would wait for ever).
  auto waits = [](std::future<Status>& f) {
    return f.wait_for(std::chrono::milliseconds(50)) == std::future_status::timeout;
  };
  using Ready = GroupBoard::GroupReady;
  auto wait_ready = [&](const OptimizerTask& task, Ready* r) {
    return std::async(std::launch::async, [&board, task, r]() -> Status {
      ZINF_ASSIGN_OR_RETURN(*r, board.WaitGroupReady(0, task, /*speculate=*/false,
                                                     /*allow_partial=*/true));
      return Status::OK();
    });
  };
  board.BeginMicroStep(/*boundary=*/true, /*step=*/0);  // the window ends with step 1
  const OptimizerTask step1{1, /*clip=*/false, {ParamGroupHyper{}}};
  Ready r;
  std::future<Status> ready = wait_ready(step1, &r);
  board.MarkHasGrad(0, 1);
  board.LandPiece(0, 1, 1000, 1);  // "a" has not landed: "b" is not the last
  EXPECT_TRUE(waits(ready));
  board.MarkHasGrad(0, 0);
  board.Land(0, 1);  // "a" whole
  EXPECT_TRUE(waits(ready));
  board.LandPiece(0, 1, 0, 1);  // nothing landed yet
  EXPECT_TRUE(waits(ready));
  board.LandPiece(0, 1, 1024, 1);
  ASSERT_TRUE(ready.get().ok());
  EXPECT_EQ(r.partial, 1);
  EXPECT_EQ(r.with_grad, (std::vector<uint8_t>{1, 1}));
  EXPECT_TRUE(board.WaitLanded(0, 1, 1024).ok());
  std::future<Status> more =
      std::async(std::launch::async, [&] { return board.WaitLanded(0, 1, 2048); });
  EXPECT_TRUE(waits(more));
  board.LandPiece(0, 1, 2048, 1);
  EXPECT_TRUE(more.get().ok());
  std::future<Status> whole =
      std::async(std::launch::async, [&] { return board.WaitLanded(0, 1, SIZE_MAX); });
  EXPECT_TRUE(waits(whole));
  board.Land(0, 1);
  EXPECT_TRUE(whole.get().ok());
  board.MarkStepped(0, 1);

  // "a" whole, then the first 1,024 elements of "b", in a micro-step that ends the window with
  // step `ready` (0: not at the window's end).
  auto land_a_then_a_piece_of_b = [&](int64_t ready) {
    board.MarkHasGrad(0, 0);
    board.Land(0, ready);
    board.MarkHasGrad(0, 1);
    board.LandPiece(0, 1, 1024, ready);
  };

  // With clipping the group waits whole, and for the norm.
  board.BeginMicroStep(/*boundary=*/true, /*step=*/1);
  const OptimizerTask step2{2, /*clip=*/true, {ParamGroupHyper{}}};
  Ready c;
  c.partial = -2;  // (so that the -1 below is WaitGroupReady's)
  std::future<Status> clipped = wait_ready(step2, &c);
  land_a_then_a_piece_of_b(2);
  EXPECT_TRUE(waits(clipped));
  board.Land(0, 2);
  board.SetClipCoef(2, 0.5f);
  ASSERT_TRUE(clipped.get().ok());
  EXPECT_EQ(c.partial, -1);
  EXPECT_EQ(c.coef, 0.5f);
  board.MarkStepped(0, 2);

  // A micro-step inside the window (ready 0) lands no pieces.
  board.BeginMicroStep(/*boundary=*/false, /*step=*/2);
  const OptimizerTask step3{3, /*clip=*/false, {ParamGroupHyper{}}};
  Ready n;
  std::future<Status> inside = wait_ready(step3, &n);
  land_a_then_a_piece_of_b(0);
  EXPECT_TRUE(waits(inside));
  // Stopping wakes every waiter with an error.
  EXPECT_TRUE(board.Stop(-1).ok());
  EXPECT_FALSE(inside.get().ok());
  EXPECT_FALSE(board.WaitLanded(0, 3, 1).ok());
}

TEST(PinnedPlanTest, NvmeStatesTakeBuffersStagingAndAccumulators) {
  Layout l = ThreeParams(1);
  l.Freeze(4096, Tier::kNvme, 1.0);
  EngineConfig c;
  c.offload_param.tier = Tier::kNvme;
  c.offload_optimizer.tier = Tier::kNvme;
  c.offload_optimizer.buffer_count = 4;
  c.prefetch_bucket_size = 1000;
  c.gradient_accumulation_steps = 2;  // accumulators stay allocated
  c.pinned_budget_bytes = 1ull << 30;
  Result<PinnedPlan> plan = PlanPinnedMemory(l, c, /*device_is_host=*/true);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_FALSE(plan->stream_grads);
  // One rank: slices of 6,144 ("a"), 2,048 ("b") and 10,240 ("c") elements, one sub-group
  // each (4,096 is below the first two together).
  ASSERT_EQ(l.num_groups(), 3u);
  EXPECT_EQ(plan->state_blocks, 4u);
  EXPECT_EQ(plan->state_block_bytes, 10240u * 3 * 4);  // the largest sub-group, page aligned
  EXPECT_EQ(plan->copy_blocks, 0u);
  // 4 buffers + staging: 4 x the largest partition (9008 floats -> 36 KiB) plus the prefetch
  // bucket (1000 elements x 4 bytes -> 4 KiB).
  EXPECT_EQ(plan->fixed, 4 * 122880u + 4 * 36864u + 4096u);
  EXPECT_EQ(plan->grads_min, (6144u + 2048u + 10240u) * 4);  // every sub-group's accumulators
  c.pinned_budget_bytes = plan->fixed + plan->grads_min - 1;
  Result<PinnedPlan> small = PlanPinnedMemory(l, c, true);
  ASSERT_EQ(small.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(small.status().message().find("zinf.pinned_budget_bytes"), std::string::npos);
}

TEST(PinnedPlanTest, StreamingAccumulatorsGetWhatTheBudgetLeaves) {
  Layout l = ThreeParams(1);
  l.Freeze(2048, Tier::kCpu, 1.0);  // three sub-groups of 6,144, 2,048 and 10,240 elements
  ASSERT_EQ(l.num_groups(), 3u);
  EngineConfig c;
  c.offload_param.tier = Tier::kCpu;
  c.offload_optimizer.tier = Tier::kCpu;
  c.pinned_budget_bytes = 1ull << 30;
  Result<PinnedPlan> plan = PlanPinnedMemory(l, c, true);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_TRUE(plan->stream_grads);
  EXPECT_EQ(plan->grad_block_bytes, 40960u);  // the largest sub-group's accumulators
  EXPECT_EQ(plan->grad_blocks, 3u);           // plenty of budget: one per sub-group
  // Just enough for the least: two blocks.
  c.pinned_budget_bytes = plan->fixed + plan->grads_min;
  plan = PlanPinnedMemory(l, c, true);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->grad_blocks, 2u);
  // With a step that waits for the global norm (clipping, fp16) every accumulator is held
  // until the norm is known: two blocks for three sub-groups would wait for each other.
  for (int which = 0; which < 2; ++which) {
    EngineConfig waits = c;
    waits.pinned_budget_bytes = 1ull << 30;
    if (which == 0) waits.gradient_clipping = 1.0;
    if (which == 1) waits.fp16.enabled = true;
    plan = PlanPinnedMemory(l, waits, true);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    EXPECT_FALSE(plan->stream_grads) << (which == 0 ? "clipping" : "fp16");
  }
}

// Speculative-step snapshots (clipping): one block per sub-group the CPU steps, of the largest
// one's [master | m | v], from what the budget leaves; "auto" goes without on the host device
// or when nothing is left, true is refused then, and nothing is planned without clipping or
// with it off.
TEST(PinnedPlanTest, SpeculationSnapshotsComeFromWhatTheBudgetLeaves) {
  Layout l = ThreeParams(1);
  l.Freeze(2048, Tier::kCpu, 1.0);  // three sub-groups of 6,144, 2,048 and 10,240 elements
  EngineConfig c;
  c.offload_param.tier = Tier::kCpu;
  c.offload_optimizer.tier = Tier::kCpu;
  c.pinned_budget_bytes = 1ull << 30;
  Result<PinnedPlan> plan = PlanPinnedMemory(l, c, true);
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->speculation_wanted);  // no clipping: nothing waits for the norm
  EXPECT_EQ(plan->snapshot_blocks, 0u);
  c.gradient_clipping = 1.0;
  plan = PlanPinnedMemory(l, c, /*device_is_host=*/true);
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->speculation_wanted);  // "auto" on the host device: off
  // "auto" on a GPU (device_is_host false from here on), the optimizer on the CPU.
  plan = PlanPinnedMemory(l, c, false);
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->speculation_wanted);
  EXPECT_EQ(plan->snapshot_block_bytes, 122880u);  // 10,240 x 3 x 4 bytes, page aligned
  EXPECT_EQ(plan->snapshot_blocks, 3u);
  EXPECT_EQ(plan->snapshots_min, 0u);
  // Room for two: "auto" takes half of it (one), true both.
  c.pinned_budget_bytes = plan->fixed + plan->grads_min + 2 * 122880 + 100;
  plan = PlanPinnedMemory(l, c, false);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->snapshot_blocks, 1u);
  c.speculative_step = SpeculativeStep::kOn;
  plan = PlanPinnedMemory(l, c, false);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->snapshot_blocks, 2u);
  c.speculative_step = SpeculativeStep::kAuto;
  // No room: "auto" goes without, true is refused naming the key and the snapshot.
  c.pinned_budget_bytes = plan->fixed + plan->grads_min;
  plan = PlanPinnedMemory(l, c, false);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->snapshot_blocks, 0u);
  c.speculative_step = SpeculativeStep::kOn;
  Result<PinnedPlan> refused = PlanPinnedMemory(l, c, false);
  ASSERT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("speculative"), std::string::npos);
  EXPECT_NE(refused.status().message().find("zinf.pinned_budget_bytes"), std::string::npos);
  c.speculative_step = SpeculativeStep::kOff;
  plan = PlanPinnedMemory(l, c, false);
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->speculation_wanted);
  // The optimizer on the device: "auto" is off.
  c.speculative_step = SpeculativeStep::kAuto;
  c.pinned_budget_bytes = 1ull << 30;
  c.offload_optimizer.tier = Tier::kDevice;
  Layout d = ThreeParams(1);
  d.Freeze(2048, Tier::kDevice, 1.0);
  c.offload_param.tier = Tier::kDevice;
  plan = PlanPinnedMemory(d, c, false);
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->speculation_wanted);
  // NVMe states: "auto" is off (their reads and writes would compete with the backward's);
  // true speculates, in snapshot blocks that can hold a state buffer.
  Layout v = ThreeParams(1);
  v.Freeze(2048, Tier::kNvme, 1.0);
  c.offload_param.tier = Tier::kCpu;
  c.offload_optimizer.tier = Tier::kNvme;
  plan = PlanPinnedMemory(v, c, false);
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->speculation_wanted);
  c.speculative_step = SpeculativeStep::kOn;
  plan = PlanPinnedMemory(v, c, false);
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->speculation_wanted);
  EXPECT_EQ(plan->snapshot_blocks, 3u);
  EXPECT_GE(plan->snapshot_block_bytes, plan->state_block_bytes);
}

TEST(PinnedPlanTest, PinnedBytesNeededIsWhatThePlanTakes) {
  // The same three parameters through the public function: its answer is the plan's least
  // need, so a budget of exactly that passes and one byte less is refused.
  EngineConfig c;
  c.offload_param.tier = Tier::kNvme;
  c.offload_optimizer.tier = Tier::kNvme;
  c.offload_optimizer.buffer_count = 4;
  c.prefetch_bucket_size = 1000;
  c.gradient_accumulation_steps = 2;
  c.sub_group_size = 4096;
  c.param_persistence_threshold = 1000;
  std::vector<ParamSpec> specs;
  for (const auto& [name, n] :
       std::vector<std::pair<std::string, int64_t>>{{"a", 5000}, {"b", 100}, {"c", 9000}}) {
    ParamSpec s;
    s.name = name;
    s.shape = {n};
    specs.push_back(s);
  }
  Result<uint64_t> need = PinnedBytesNeeded(c, specs, 1, /*device_is_host=*/true);
  ASSERT_TRUE(need.ok()) << need.status().ToString();
  EXPECT_EQ(*need, 4 * 122880u + 4 * 36864u + 4096u + (6144u + 2048u + 10240u) * 4);
  Layout l = ThreeParams(1);
  l.Freeze(4096, Tier::kNvme, 1.0);
  c.pinned_budget_bytes = *need;
  EXPECT_TRUE(PlanPinnedMemory(l, c, true).ok());
  c.pinned_budget_bytes = *need - 1;
  EXPECT_EQ(PlanPinnedMemory(l, c, true).status().code(), StatusCode::kResourceExhausted);
  // A parameter RegisterParameter would refuse is refused here too.
  specs[1].shape = {0};
  EXPECT_EQ(PinnedBytesNeeded(c, specs, 1, true).status().code(), StatusCode::kInvalidArgument);
}

// What each rank holds -> the commit all resume at. Each row: per rank (last step, lineage,
// previous step, lineage); the expected step (-1: refused) and which ranks go back to their
// previous commit.
struct CommitCase {
  const char* what;
  std::vector<int64_t> all;
  int64_t step;
  std::vector<bool> previous;
};

// What a device can do decides what runs, from its capabilities alone: a GPU-like device (the
// CUDA backend's caps) refuses the device-stepped optimizer without device parameters, other
// optimizers than Adam/AdamW and compressed states; a host device runs them all. Tested here,
// without a GPU, for every refusal the CUDA backend relies on.
TEST(CheckFeasibleTest, TheDevicesCapabilitiesDecideNotItsKind) {
  DeviceCaps gpu;
  gpu.step_kinds = DeviceCaps::Kind(OptimizerKind::kAdam) | DeviceCaps::Kind(OptimizerKind::kAdamW);
  gpu.step_needs_device_params = true;
  DeviceCaps host;
  host.host_memory = true;
  host.step_kinds = ~0u;
  host.step_compressed_states = true;
  EngineConfig c;
  c.offload_optimizer.tier = Tier::kDevice;
  c.offload_param.tier = Tier::kCpu;
  Status s = CheckFeasible(c, gpu, 1);
  EXPECT_EQ(s.code(), StatusCode::kNotSupported) << s.ToString();
  EXPECT_NE(s.message().find("offload_param.device none"), std::string::npos) << s.ToString();
  EXPECT_TRUE(CheckFeasible(c, host, 1).ok());
  c.offload_param.tier = Tier::kDevice;
  EXPECT_TRUE(CheckFeasible(c, gpu, 1).ok());
  c.optimizer.type = OptimizerType::kLion;
  s = CheckFeasible(c, gpu, 1);
  EXPECT_EQ(s.code(), StatusCode::kNotSupported);
  EXPECT_NE(s.message().find("lion"), std::string::npos) << s.ToString();
  EXPECT_TRUE(CheckFeasible(c, host, 1).ok());
  c.optimizer.type = OptimizerType::kAdamW;
  c.optimizer_state_type = StateType::kInt8;
  s = CheckFeasible(c, gpu, 1);
  EXPECT_NE(s.message().find("zinf.optimizer_state_dtype"), std::string::npos) << s.ToString();
  EXPECT_TRUE(CheckFeasible(c, host, 1).ok());
  // offload_optimizer.ratio below 1 is the same question for part of the sub-groups.
  c.optimizer_state_type = StateType::kF32;
  c.offload_optimizer.tier = Tier::kCpu;
  c.offload_optimizer.ratio = 0.5;
  c.offload_param.tier = Tier::kCpu;
  EXPECT_EQ(CheckFeasible(c, gpu, 1).code(), StatusCode::kNotSupported);
  c.offload_optimizer.ratio = 1;
  EXPECT_TRUE(CheckFeasible(c, gpu, 1).ok());  // everything on the CPU: any device
  // Durable mode, whatever the device.
  c.durable = true;
  EXPECT_EQ(CheckFeasible(c, host, 1).code(), StatusCode::kInvalidArgument);  // states on cpu
  c.offload_optimizer.tier = Tier::kNvme;
  EXPECT_TRUE(CheckFeasible(c, host, 2).ok());
  c.delayed_update = true;
  EXPECT_EQ(CheckFeasible(c, host, 2).code(), StatusCode::kNotSupported);
  EXPECT_EQ(CheckFeasible(c, host, 1).code(), StatusCode::kInvalidArgument);  // params not nvme
  c.offload_param.tier = Tier::kNvme;
  EXPECT_TRUE(CheckFeasible(c, host, 1).ok());
}

TEST(ChooseCommitTest, LatestCommitEveryRankHolds) {
  const std::vector<CommitCase> cases = {
      {"one rank, one commit", {7, 1, -1, 0}, 7, {false}},
      {"two ranks in step", {7, 1, 6, 1, 7, 1, 6, 1}, 7, {false, false}},
      {"rank 1 one commit behind", {7, 1, 6, 1, 6, 1, 5, 1}, 6, {true, false}},
      {"rank 0 one commit behind", {6, 1, 5, 1, 7, 1, 6, 1}, 6, {false, true}},
      {"fresh stores at step 0", {0, 0, -1, 0, 0, 0, -1, 0}, 0, {false, false}},
      // Same step, different histories (a load one rank committed): the common earlier one.
      {"lineages differ at the last", {5, 9, 5, 1, 5, 1, 4, 1}, 5, {true, false}},
      {"nothing in common", {9, 1, 8, 1, 6, 1, 5, 1}, -1, {}},
      {"other runs", {3, 2, 2, 2, 3, 1, 2, 1}, -1, {}},
  };
  for (const CommitCase& c : cases) {
    for (size_t r = 0; r < c.previous.size() || (c.step < 0 && r == 0); ++r) {
      Result<CommitChoice> got = ChooseCommit(c.all, static_cast<int>(r));
      if (c.step < 0) {
        ASSERT_EQ(got.status().code(), StatusCode::kFailedPrecondition) << c.what;
        EXPECT_NE(got.status().message().find("no commit in common"), std::string::npos);
        break;
      }
      ASSERT_TRUE(got.ok()) << c.what << ": " << got.status().ToString();
      EXPECT_EQ(got->step, c.step) << c.what;
      EXPECT_EQ(got->previous, c.previous[r]) << c.what << ", rank " << r;
    }
  }
}

TEST(ChooseCommitTest, AnUnreadableStoreOnOneRankIsEveryRanksError) {
  const int64_t corrupt = -100 - static_cast<int64_t>(StatusCode::kCorruption);
  Result<CommitChoice> got = ChooseCommit({7, 1, 6, 1, corrupt, 0, corrupt, 0}, 0);
  ASSERT_EQ(got.status().code(), StatusCode::kCorruption);
  EXPECT_NE(got.status().message().find("rank 1 cannot resume"), std::string::npos);
}

}  // namespace
}  // namespace zinf
