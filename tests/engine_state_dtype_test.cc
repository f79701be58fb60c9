// Compressed optimizer states in the engine (zinf.optimizer_state_dtype bf16 / int8): the
// training is the scalar kernel's on every host tier, the same bits across tiers and ranks'
// placements, through checkpoints and the durable store; a checkpoint of another state dtype is
// converted on load, a durable store of another one refused by name; the sizes the engine plans
// with are the compressed ones.
#include "engine/core/layout.h"
#include "tests/engine_harness.h"

namespace zinf {
namespace engine_test {
namespace {

constexpr StateType kCompressed[] = {StateType::kBf16, StateType::kInt8};

// One rank: every placement of the states on the host (pinned memory, NVMe) and of the
// parameters, with accumulation and clipping, ends bit-identical to the simulation that steps
// with the scalar kernel on compressed states, and differs from fp32 states.
TEST(EngineStateDtype, TrainingIsTheScalarKernelOnEveryHostTier) {
  for (StateType type : kCompressed) {
    RunOptions base;
    base.state_type = type;
    base.grad_accum = 2;
    base.clipping = 0.5;
    const SimResult sim = Simulate(base);
    RunOptions fp32 = base;
    fp32.state_type = StateType::kF32;
    const SimResult sim32 = Simulate(fp32);
    ASSERT_NE(FirstBitDifference(sim.params, sim32.params), "")
        << StateTypeName(type) << " states trained exactly as fp32 ones: nothing was compressed";
    for (auto [param_tier, optimizer_tier] :
         {std::pair{Tier::kDevice, Tier::kCpu}, std::pair{Tier::kCpu, Tier::kNvme},
          std::pair{Tier::kNvme, Tier::kNvme}, std::pair{Tier::kDevice, Tier::kDevice}}) {
      RunOptions o = base;
      o.param_tier = param_tier;
      o.optimizer_tier = optimizer_tier;
      SCOPED_TRACE(o.Describe());
      const RunResult run = RunTraining(o);
      ASSERT_TRUE(run.status.ok()) << run.status.ToString();
      EXPECT_EQ(FirstBitDifference(run.params, sim.params), "");
    }
  }
}

// Two ranks: the partitions' blocks differ from one rank's, so the bits are compared across
// placements and the delayed update's runs, which must all agree.
TEST(EngineStateDtype, TwoRanksAgreeAcrossPlacements) {
  RunOptions base;
  base.ranks = 2;
  base.state_type = StateType::kInt8;
  base.optimizer_tier = Tier::kCpu;
  const RunResult first = RunTraining(base);
  ASSERT_TRUE(first.status.ok()) << first.status.ToString();
  EXPECT_TRUE(first.ranks_agree);
  EXPECT_NE(FirstBitDifference(first.params, Reference(2).params), "")
      << "int8 states trained exactly as fp32 ones: nothing was compressed";
  for (auto [param_tier, optimizer_tier] :
       {std::pair{Tier::kNvme, Tier::kNvme}, std::pair{Tier::kCpu, Tier::kDevice}}) {
    RunOptions o = base;
    o.param_tier = param_tier;
    o.optimizer_tier = optimizer_tier;
    SCOPED_TRACE(o.Describe());
    const RunResult run = RunTraining(o);
    ASSERT_TRUE(run.status.ok()) << run.status.ToString();
    EXPECT_EQ(FirstBitDifference(run.params, first.params), "");
  }
}

// Lion (one state, the signed momentum, in state 1) with int8 states and Adagrad (its sum in
// state 2, the kernel's state1) with bf16 states: the same bits on every host tier, not those
// of fp32 states, and their checkpoints resume bit for bit and convert to fp32 on load.
TEST(EngineStateDtype, LionAndAdagradKeepTheirStatesInTheirRegions) {
  for (auto [optimizer, type] : {std::pair{OptimizerType::kLion, StateType::kInt8},
                                 std::pair{OptimizerType::kAdagrad, StateType::kBf16}}) {
    RunOptions base;
    base.optimizer = optimizer;
    base.state_type = type;
    base.optimizer_tier = Tier::kCpu;
    SCOPED_TRACE(std::string(OptimizerTypeName(optimizer)) + ", " + StateTypeName(type));
    const RunResult cpu = RunTraining(base);
    ASSERT_TRUE(cpu.status.ok()) << cpu.status.ToString();
    EXPECT_TRUE(AllFinite(cpu.params));
    RunOptions fp32 = base;
    fp32.state_type = StateType::kF32;
    const RunResult plain = RunTraining(fp32);
    ASSERT_TRUE(plain.status.ok()) << plain.status.ToString();
    EXPECT_NE(FirstBitDifference(cpu.params, plain.params), "");
    RunOptions nvme = base;
    nvme.param_tier = Tier::kNvme;
    nvme.optimizer_tier = Tier::kNvme;
    const RunResult on_nvme = RunTraining(nvme);
    ASSERT_TRUE(on_nvme.status.ok()) << on_nvme.status.ToString();
    EXPECT_EQ(FirstBitDifference(on_nvme.params, cpu.params), "");

    TempDir ckpt;
    ASSERT_TRUE(ckpt.ok());
    RunOptions save = base;
    save.checkpoint_dir = ckpt.path();
    save.save_after_step = 2;
    ASSERT_TRUE(RunTraining(save).status.ok());
    RunOptions load = base;
    load.checkpoint_dir = ckpt.path();
    load.load_first = true;
    load.first_micro = 2;
    const RunResult resumed = RunTraining(load);
    ASSERT_TRUE(resumed.status.ok()) << resumed.status.ToString();
    EXPECT_EQ(FirstBitDifference(resumed.params, cpu.params), "");
    // Into fp32 states: decoded with their roles. The step after the load then uses the same
    // decoded states as the straight run's (which only encodes its result again), so after
    // that one step the parameters are the same bits; a state decoded with the wrong role or
    // from the wrong region would change them.
    RunOptions three = base;
    three.steps = 3;
    const RunResult straight3 = RunTraining(three);
    ASSERT_TRUE(straight3.status.ok()) << straight3.status.ToString();
    load.state_type = StateType::kF32;
    load.steps = 3;
    const RunResult converted = RunTraining(load);
    ASSERT_TRUE(converted.status.ok()) << converted.status.ToString();
    EXPECT_EQ(FirstBitDifference(converted.params, straight3.params), "");
  }
}

// A checkpoint of int8 states resumes bit for bit; an engine keeping another state dtype
// converts them on load (ConvertOptimizerState) and goes on exactly as the simulation that
// converts its states at that step; and back, an fp32 checkpoint into int8 states.
TEST(EngineStateDtype, CheckpointsResumeBitIdenticalAndConvertBetweenStateDtypes) {
  TempDir ckpt;
  ASSERT_TRUE(ckpt.ok());
  RunOptions o;
  o.state_type = StateType::kInt8;
  o.param_tier = Tier::kNvme;
  o.optimizer_tier = Tier::kNvme;
  const RunResult straight = RunTraining(o);
  ASSERT_TRUE(straight.status.ok()) << straight.status.ToString();
  RunOptions first = o;
  first.checkpoint_dir = ckpt.path();
  first.save_after_step = 2;
  ASSERT_TRUE(RunTraining(first).status.ok());
  RunOptions second = o;
  second.checkpoint_dir = ckpt.path();
  second.load_first = true;
  second.first_micro = 2;
  const RunResult resumed = RunTraining(second);
  ASSERT_TRUE(resumed.status.ok()) << resumed.status.ToString();
  EXPECT_EQ(FirstBitDifference(resumed.params, straight.params), "");

  for (StateType other : {StateType::kF32, StateType::kBf16}) {
    RunOptions converted = second;
    converted.state_type = other;
    SCOPED_TRACE(std::string("int8 checkpoint into ") + StateTypeName(other) + " states");
    const RunResult run = RunTraining(converted);
    ASSERT_TRUE(run.status.ok()) << run.status.ToString();
    RunOptions sim = o;
    sim.state_type = other;
    sim.switch_states_at = 2;
    sim.states_before = StateType::kInt8;
    EXPECT_EQ(FirstBitDifference(run.params, Simulate(sim).params), "");
    EXPECT_NE(FirstBitDifference(run.params, straight.params), "");
  }

  // fp32 states saved, loaded as int8.
  TempDir ckpt32;
  ASSERT_TRUE(ckpt32.ok());
  RunOptions save32 = first;
  save32.state_type = StateType::kF32;
  save32.checkpoint_dir = ckpt32.path();
  ASSERT_TRUE(RunTraining(save32).status.ok());
  RunOptions load8 = second;
  load8.checkpoint_dir = ckpt32.path();
  const RunResult run8 = RunTraining(load8);
  ASSERT_TRUE(run8.status.ok()) << run8.status.ToString();
  RunOptions sim8 = o;
  sim8.switch_states_at = 2;
  sim8.states_before = StateType::kF32;
  EXPECT_EQ(FirstBitDifference(run8.params, Simulate(sim8).params), "");
}

// The durable store: a fresh engine resumes int8 states from it bit for bit, and one keeping
// fp32 states refuses the store.
TEST(EngineStateDtype, DurableStoreResumesAndRefusesAnotherDtype) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  RunOptions o;
  o.state_type = StateType::kInt8;
  o.durable = true;
  o.param_tier = Tier::kNvme;
  o.optimizer_tier = Tier::kNvme;
  const RunResult straight = RunTraining(o);
  ASSERT_TRUE(straight.status.ok()) << straight.status.ToString();
  EXPECT_EQ(FirstBitDifference(straight.params, Simulate(o).params), "");

  std::unique_ptr<Device> device = NewTestHostDevice();
  auto comms = NewLocalComms({device.get()});
  ASSERT_TRUE(comms.ok());
  double loss;
  StepStats stats;
  {
    auto engine = Engine::Create(MakeConfig(o, dir.path()), device.get(), (*comms)[0].get());
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    RankTrainer trainer(engine->get(), device.get());
    ASSERT_TRUE(trainer.Register().ok());
    for (int m = 0; m < 2; ++m) {
      ASSERT_TRUE(trainer.MicroStep(0, kGlobalBatch, false, &loss, &stats).ok());
    }
  }
  {
    RunOptions fp32 = o;
    fp32.state_type = StateType::kF32;
    auto engine = Engine::Create(MakeConfig(fp32, dir.path()), device.get(), (*comms)[0].get());
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    RankTrainer trainer(engine->get(), device.get());
    ASSERT_TRUE(trainer.Register(/*finish=*/false).ok());
    Status s = (*engine)->ResumeFromStore();
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("optimizer states stored as int8"), std::string::npos)
        << s.ToString();
  }
  auto engine = Engine::Create(MakeConfig(o, dir.path()), device.get(), (*comms)[0].get());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  RankTrainer trainer(engine->get(), device.get());
  ASSERT_TRUE(trainer.Register(/*finish=*/false).ok());
  Status resumed = (*engine)->ResumeFromStore();
  ASSERT_TRUE(resumed.ok()) << resumed.ToString();
  EXPECT_EQ((*engine)->global_step(), 2);
  for (int m = 2; m < kSteps; ++m) {
    ASSERT_TRUE(trainer.MicroStep(0, kGlobalBatch, false, &loss, &stats).ok());
  }
  std::vector<std::vector<float>> params;
  ASSERT_TRUE(trainer.GatherAll(&params).ok());
  EXPECT_EQ(FirstBitDifference(params, straight.params), "");
}

// The sizes planned with: a sub-group's buffer is the fp32 masters plus two compressed state
// regions, a slice's states start on a whole int8 block.
TEST(EngineStateDtype, SubGroupBuffersHoldTheCompressedBytes) {
  for (StateType type : {StateType::kF32, StateType::kBf16, StateType::kInt8}) {
    Layout layout(1, 4, type);
    for (auto [name, numel] : {std::pair{"a", int64_t{3000}}, std::pair{"b", int64_t{10}}}) {
      Result<ParamLayout> p = layout.Describe(name, {numel}, true, 0);
      ASSERT_TRUE(p.ok()) << p.status().ToString();
      layout.Add(*p);
    }
    layout.Freeze(1u << 20, Tier::kCpu, 1.0);
    ASSERT_EQ(layout.num_groups(), 1u);
    const size_t n = layout.group(0).numel;  // slices of 2048-element multiples: 4096 + 2048
    EXPECT_EQ(n, 4096u + 2048u);
    const size_t state = type == StateType::kF32    ? 4 * n
                         : type == StateType::kBf16 ? 2 * n
                                                    : (n + 255) / 256 * 260;
    EXPECT_EQ(layout.GroupStateBytes(0), 4 * n + 2 * state) << StateTypeName(type);
    EXPECT_EQ(layout.StateRegionOffset(0, 2), 4 * n + state);
    EXPECT_EQ(layout.SliceOffsetIn(1, 0), 4096u * 4);
    EXPECT_EQ(layout.SliceOffsetIn(1, 1), 4 * n + StateBytes(type, 4096));
    EXPECT_EQ(layout.param(1).info.partition_numel, 16u);  // padded to kPartitionAlign
    EXPECT_EQ(layout.SliceBytesIn(1, 2), StateBytes(type, 16));
  }
}

}  // namespace
}  // namespace engine_test
}  // namespace zinf
