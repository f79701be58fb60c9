// Injected I/O errors (every fault kind reported or absorbed) and the durable store: resume
// after a failed step, across tiers, across ranks one commit apart and after a checkpoint
// load, and its refusals.
#include "tests/engine_harness.h"

namespace zinf {
namespace engine_test {
namespace {

// ---- An injected I/O error ------------------------------------------------------------------

struct FaultOutcome {
  Status setup;                             // creation, registration and two clean micro-steps
  std::vector<uint64_t> requests_per_step;  // I/O requests of the clean micro-steps
  uint64_t fault_at = 0;
  uint64_t requests_after = 0;           // requests seen when the faulty steps ended
  uint64_t fired = 0;                    // requests the fault fired on
  Status fault_error;                    // the first failing call's status once the fault is armed
  bool failed_before_gradients = false;  // fault_error came before any ReduceGradient
  int clean_micro_steps = 0;             // micro-steps that succeeded, before and after the failure
  Status recovery;                       // the first failure after the plan is cleared (OK: none)
  int recovered_steps = 0;
  Status gather;
  std::vector<std::vector<float>> params;
};

// One rank, parameters and optimizer states on NVMe: two clean micro-steps, then an EIO on
// the request `ahead` requests from now, then up to 3 micro-steps until a call fails, then
// (the plan cleared) up to 2 more micro-steps, and the masters when those succeeded.
FaultOutcome RunWithInjectedFault(uint64_t ahead, IoFault fault = IoFault{}, bool checksums = false,
                                  bool delayed = false) {
  FaultOutcome out;
  RunOptions o;
  o.delayed = delayed;
  o.param_tier = Tier::kNvme;
  o.optimizer_tier = Tier::kNvme;
  TempDir dir;
  if (!dir.ok()) {
    out.setup = Status::IoError("mkdtemp under $ZINF_TEST_DIR or /var/tmp failed");
    return out;
  }
  std::unique_ptr<Device> device = NewTestHostDevice();
  auto comms = NewLocalComms({device.get()});
  if (!comms.ok()) {
    out.setup = comms.status();
    return out;
  }
  auto plan = std::make_shared<FaultPlan>();
  EngineHooks hooks;
  hooks.fault_plan = plan;
  EngineConfig config = MakeConfig(o, dir.path());
  config.checksums = checksums;
  Result<std::unique_ptr<Engine>> engine =
      Engine::Create(config, device.get(), (*comms)[0].get(), hooks);
  if (!engine.ok()) {
    out.setup = engine.status();
    return out;
  }
  RankTrainer trainer(engine->get(), device.get());
  out.setup = trainer.Register();
  double loss;
  StepStats stats;
  for (int m = 0; m < 2 && out.setup.ok(); ++m) {
    uint64_t before = plan->requests();
    out.setup = trainer.MicroStep(0, kGlobalBatch, false, &loss, &stats);
    out.requests_per_step.push_back(plan->requests() - before);
  }
  if (!out.setup.ok()) return out;
  // The error may surface in the call that needs the request or, for a prefetch or a
  // write-back, in a later one.
  out.fault_at = plan->AddAhead(fault, ahead);
  out.clean_micro_steps = 2;
  for (int attempt = 0; attempt < 3 && out.fault_error.ok(); ++attempt) {
    out.fault_error = trainer.MicroStep(0, kGlobalBatch, false, &loss, &stats);
    if (out.fault_error.ok()) ++out.clean_micro_steps;
  }
  out.failed_before_gradients = !out.fault_error.ok() && trainer.gradients_reduced() == 0 &&
                                out.fault_error.message().rfind("Step", 0) != 0;
  out.requests_after = plan->requests();
  out.fired = plan->fired();
  plan->Clear();
  if (out.fault_error.ok()) {  // absorbed: the masters after the faulty steps
    out.gather = trainer.GatherAll(&out.params);
    return out;
  }
  for (int m = 0; m < 2 && out.recovery.ok(); ++m) {
    out.recovery = trainer.MicroStep(0, kGlobalBatch, false, &loss, &stats);
    if (out.recovery.ok()) {
      ++out.recovered_steps;
      ++out.clean_micro_steps;
    }
  }
  if (out.recovered_steps > 0) out.gather = trainer.GatherAll(&out.params);
  return out;
}

// An EIO on each of a spread of request positions (parameter reads in the forward and the
// backward, optimizer state reads and write-backs, parameter write-backs): the step fails
// with an IoError that names the file or the tensor; with the fault gone the engine either
// trains on, with finite masters, or refuses further steps with kFailedPrecondition and a
// reason. It never repeats a stale error for data that could now be read.
void InjectedIoErrorFailsTheStepAndTheEngineStaysConsistent(bool delayed) {
  // Requests per clean micro-step, to spread the fault over a whole step.
  FaultOutcome probe;
  RunGuarded("training with an injected I/O error", std::chrono::seconds(60),
             [&] { probe = RunWithInjectedFault(1'000'000, IoFault{}, false, delayed); });
  ASSERT_TRUE(probe.setup.ok()) << probe.setup.ToString();
  ASSERT_TRUE(probe.fault_error.ok()) << "no fault should fire: " << probe.fault_error.ToString();
  const uint64_t per_step = probe.requests_per_step.back();
  ASSERT_GT(per_step, 0u) << "a micro-step with everything on NVMe did no I/O";
  std::printf("  %llu I/O requests per micro-step\n", static_cast<unsigned long long>(per_step));

  const uint64_t stride = std::max<uint64_t>(1, per_step / 12);
  for (uint64_t ahead = 0; ahead < per_step; ahead += stride) {
    SCOPED_TRACE("EIO on request +" + std::to_string(ahead));
    FaultOutcome f;
    RunGuarded("training with an injected I/O error at +" + std::to_string(ahead),
               std::chrono::seconds(60),
               [&] { f = RunWithInjectedFault(ahead, IoFault{}, false, delayed); });
    ASSERT_TRUE(f.setup.ok()) << f.setup.ToString();
    ASSERT_GT(f.requests_after, f.fault_at) << "the faulted request was never issued";
    ASSERT_EQ(f.fired, 1u) << "the fault did not fire on request " << f.fault_at;
    ASSERT_FALSE(f.fault_error.ok())
        << "an EIO on request " << f.fault_at << " was not reported by any engine call";
    std::printf("  +%llu: %s\n", static_cast<unsigned long long>(ahead),
                f.fault_error.ToString().c_str());
    EXPECT_EQ(f.fault_error.code(), StatusCode::kIoError) << f.fault_error.ToString();
    EXPECT_TRUE(f.fault_error.message().find("zinf-swap") != std::string::npos ||
                f.fault_error.message().find('\'') != std::string::npos)
        << "the message names neither the swap file nor a tensor: " << f.fault_error.ToString();
    if (!f.recovery.ok()) {
      std::printf("      then: %s\n", f.recovery.ToString().c_str());
      EXPECT_EQ(f.recovery.code(), StatusCode::kFailedPrecondition)
          << "with the fault cleared, the engine must train on or refuse with a reason, not "
             "fail with: "
          << f.recovery.ToString();
      EXPECT_GT(f.recovery.message().size(), 20u) << f.recovery.ToString();
    } else {
      std::printf("      then: %d clean micro-steps\n", f.recovered_steps);
      ASSERT_TRUE(f.gather.ok()) << f.gather.ToString();
      EXPECT_TRUE(AllFinite(f.params)) << "the store holds non-finite values after recovery";
      // A micro-step abandoned before any gradient reached the engine leaves no trace: the
      // masters are those of a clean run with as many (whole-batch) steps as succeeded.
      if (f.failed_before_gradients) {
        RunOptions clean;
        clean.steps = f.clean_micro_steps;
        clean.delayed = delayed;
        RunResult ref = RunTraining(clean);
        ASSERT_TRUE(ref.status.ok()) << ref.status.ToString();
        EXPECT_EQ(FirstBitDifference(f.params, ref.params), "")
            << "after recovering from a failed parameter read, vs " << clean.steps
            << " clean steps";
      }
    }
  }
}

TEST(EngineTest, InjectedIoErrorFailsTheStepAndTheEngineStaysConsistent) {
  InjectedIoErrorFailsTheStepAndTheEngineStaysConsistent(false);
}

// Durable mode: a step that dies part-way (an EIO at a spread of request positions: parameter
// reads, state reads, write-backs) leaves the store at its last commit; a fresh engine resumes
// from the store alone and ends bit-identical to a run that never failed.
TEST(EngineDurable, ResumeFromTheStoreAfterAFailedStepIsBitIdentical) {
  for (auto [param_tier, delayed] : {std::pair{Tier::kNvme, false}, std::pair{Tier::kCpu, false},
                                     std::pair{Tier::kNvme, true}}) {
    RunOptions o;
    o.durable = true;
    o.param_tier = param_tier;
    o.optimizer_tier = Tier::kNvme;
    o.delayed = delayed;
    SCOPED_TRACE(o.Describe());
    const RunResult straight = RunTraining(o);
    ASSERT_TRUE(straight.status.ok()) << straight.status.ToString();
    ExpectHealthyRun(o, straight);
    EXPECT_EQ(FirstBitDifference(straight.params, Reference(1, delayed).params), "")
        << "durable mode changed the training";
    for (int fifth = 0; fifth < 5; ++fifth) {
      TempDir dir;
      ASSERT_TRUE(dir.ok());
      std::unique_ptr<Device> device = NewTestHostDevice();
      auto comms = NewLocalComms({device.get()});
      ASSERT_TRUE(comms.ok());
      double loss;
      StepStats stats;
      Status failed;
      int done = 0;  // micro-steps completed (= optimizer steps)
      {
        auto plan = std::make_shared<FaultPlan>();
        EngineHooks hooks;
        hooks.fault_plan = plan;
        auto engine =
            Engine::Create(MakeConfig(o, dir.path()), device.get(), (*comms)[0].get(), hooks);
        ASSERT_TRUE(engine.ok()) << engine.status().ToString();
        RankTrainer trainer(engine->get(), device.get());
        ASSERT_TRUE(trainer.Register().ok());
        uint64_t per_step = 0;
        for (; done < 2; ++done) {
          const uint64_t before = plan->requests();
          ASSERT_TRUE(trainer.MicroStep(0, kGlobalBatch, false, &loss, &stats).ok());
          per_step = plan->requests() - before;
        }
        ASSERT_GT(per_step, 0u);
        // Spread over the step: at 0, 1/5, ... 4/5 of its requests.
        const uint64_t ahead = per_step * fifth / 5;
        SCOPED_TRACE("EIO on request +" + std::to_string(ahead) + " of " +
                     std::to_string(per_step));
        const uint64_t fault_at = plan->AddAhead(IoFault{}, ahead);
        for (int attempt = 0; attempt < 2 && failed.ok(); ++attempt) {
          failed = trainer.MicroStep(0, kGlobalBatch, false, &loss, &stats);
          if (failed.ok()) ++done;
        }
        if (failed.ok()) {
          // Rarely (thread timing) the failed request is a read-ahead of a copy that is
          // dropped before use and fetched again: nothing failed, nothing to resume from.
          ASSERT_GT(plan->requests(), fault_at) << "the faulted request was never issued";
          ASSERT_EQ(plan->fired(), 1u) << "the fault did not fire";
          std::printf("  EIO at +%llu absorbed (a read-ahead dropped before use)\n",
                      static_cast<unsigned long long>(ahead));
          continue;
        }
        // The engine (and its store) go away here, as in a crash: nothing more is committed.
      }
      auto engine = Engine::Create(MakeConfig(o, dir.path()), device.get(), (*comms)[0].get());
      ASSERT_TRUE(engine.ok()) << engine.status().ToString();
      RankTrainer trainer(engine->get(), device.get());
      ASSERT_TRUE(trainer.Register(/*finish=*/false).ok());
      Status resumed = (*engine)->ResumeFromStore();
      ASSERT_TRUE(resumed.ok()) << resumed.ToString();
      // The failed step never committed: the store is at the last completed one. With the
      // delayed update, the failure of step s's update surfaces in micro-step s + 1 (the
      // store is then at s - 1) or in micro-step s + 2 (a fault in step s + 1's update).
      const int at = static_cast<int>((*engine)->global_step());
      if (delayed) {
        EXPECT_TRUE(at == done || at == done - 1)
            << at << " vs " << done << " after: " << failed.ToString();
      } else {
        EXPECT_EQ(at, done) << "after: " << failed.ToString();
      }
      for (int m = at; m < o.steps; ++m) {
        Status st = trainer.MicroStep(0, kGlobalBatch, false, &loss, &stats);
        ASSERT_TRUE(st.ok()) << "micro-step " << m << ": " << st.ToString();
      }
      std::vector<std::vector<float>> params;
      ASSERT_TRUE(trainer.GatherAll(&params).ok());
      EXPECT_EQ(FirstBitDifference(params, straight.params), "");
    }
  }
}

// Resuming a durable store with the parameters on another tier: NVMe -> CPU -> NVMe. The
// second resume must not trust the NVMe parameter stores the first run left behind (they are
// two steps old by then): the three legs end bit-identical to one uninterrupted run.
TEST(EngineDurable, ResumeAcrossParameterTiersRebuildsStaleParameterStores) {
  RunOptions o;
  o.durable = true;
  o.optimizer_tier = Tier::kNvme;
  o.param_tier = Tier::kNvme;
  const RunResult straight = RunTraining(o);  // kSteps = 4
  ASSERT_TRUE(straight.status.ok()) << straight.status.ToString();
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  std::unique_ptr<Device> device = NewTestHostDevice();
  auto comms = NewLocalComms({device.get()});
  ASSERT_TRUE(comms.ok());
  double loss;
  StepStats stats;
  std::vector<std::vector<float>> params;
  const Tier legs[] = {Tier::kNvme, Tier::kCpu, Tier::kNvme};
  const int steps[] = {2, 1, 1};
  for (int leg = 0; leg < 3; ++leg) {
    SCOPED_TRACE("leg " + std::to_string(leg));
    RunOptions lo = o;
    lo.param_tier = legs[leg];
    auto engine = Engine::Create(MakeConfig(lo, dir.path()), device.get(), (*comms)[0].get());
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    RankTrainer trainer(engine->get(), device.get());
    ASSERT_TRUE(trainer.Register(/*finish=*/leg == 0).ok());
    if (leg > 0) {
      Status s = (*engine)->ResumeFromStore();
      ASSERT_TRUE(s.ok()) << s.ToString();
    }
    for (int m = 0; m < steps[leg]; ++m) {
      ASSERT_TRUE(trainer.MicroStep(0, kGlobalBatch, false, &loss, &stats).ok());
    }
    if (leg == 2) {
      ASSERT_TRUE(trainer.GatherAll(&params).ok());
    }
  }
  EXPECT_EQ(FirstBitDifference(params, straight.params), "");
}

// Durable mode with several ranks: each rank commits its own store, so a crash can leave one
// rank a commit ahead of another. The stores keep the commit before the last; ResumeFromStore
// agrees on the earliest last commit, which every rank holds.
struct DurableLeg {
  int from_micro = 0;  // resume from the stores first when > 0
  int to_micro = 0;    // run micro-steps [from_micro, to_micro)
  int fail_rank = -1;  // this rank's writes fail with EIO from micro-step fail_micro on
  int fail_micro = -1;
  // With a failing rank, the other one's queued collectives (its next prefetch) wait this
  // long for it before the group fails, when its engine is destroyed.
  std::chrono::milliseconds comm_timeout{60000};
  // Called on every rank before micro-step m (collective calls such as checkpoints go here).
  std::function<Status(Engine* engine, int rank, int m)> before_micro;
  std::vector<Status> status;              // per rank: the first failure
  std::vector<int64_t> resumed_step;       // per rank: global_step() after the resume
  std::vector<std::vector<float>> params;  // rank 0's gathered masters (no failing rank)
};

void RunDurableLeg(const RunOptions& o, const std::string& dir, DurableLeg* leg) {
  std::vector<std::unique_ptr<Device>> devices;
  std::vector<Device*> raw;
  for (int r = 0; r < o.ranks; ++r) {
    HostDeviceOptions dopt;
    dopt.memory_budget = kHostDeviceMemory;
    devices.push_back(NewTestHostDevice(dopt));
    raw.push_back(devices.back().get());
  }
  LocalCommOptions copt;
  copt.timeout = leg->comm_timeout;
  auto comms = NewLocalComms(raw, copt);
  ASSERT_TRUE(comms.ok()) << comms.status().ToString();
  leg->status.assign(o.ranks, Status::OK());
  leg->resumed_step.assign(o.ranks, -1);
  RunGuarded("durable leg (" + o.Describe() + ")", o.timeout, [&] {
    std::vector<std::thread> threads;
    for (int r = 0; r < o.ranks; ++r) {
      threads.emplace_back([&, r] {
        auto plan = std::make_shared<FaultPlan>();
        EngineHooks hooks;
        hooks.fault_plan = plan;
        auto run = [&]() -> Status {
          auto engine = Engine::Create(MakeConfig(o, dir), raw[r], (*comms)[r].get(), hooks);
          if (!engine.ok()) return engine.status();
          RankTrainer trainer(engine->get(), raw[r]);
          ZINF_RETURN_IF_ERROR(trainer.Register(/*finish=*/leg->from_micro == 0));
          if (leg->from_micro > 0) {
            ZINF_RETURN_IF_ERROR((*engine)->ResumeFromStore());
            leg->resumed_step[r] = (*engine)->global_step();
          }
          for (int m = leg->from_micro; m < leg->to_micro; ++m) {
            if (leg->before_micro) ZINF_RETURN_IF_ERROR(leg->before_micro(engine->get(), r, m));
            if (r == leg->fail_rank && m == leg->fail_micro) {
              IoFault fault;  // every write from here on: the optimizer's write-backs
              fault.count = 1u << 30;
              fault.any_op = false;
              fault.op = IoOp::kWrite;
              plan->AddAhead(fault, 0);
            }
            double loss;
            StepStats stats;
            ZINF_RETURN_IF_ERROR(
                trainer.MicroStep(RowBegin(o, m, r), RowsPerRank(o), false, &loss, &stats)
                    .WithContext("micro-step " + std::to_string(m)));
          }
          if (leg->fail_rank >= 0) return Status::OK();  // a collective the failed rank skips
          std::vector<std::vector<float>> params;
          ZINF_RETURN_IF_ERROR(trainer.GatherAll(&params));
          if (r == 0) leg->params = std::move(params);
          return Status::OK();
        };
        leg->status[r] = run();
      });
    }
    for (std::thread& t : threads) t.join();
  });
}

TEST(EngineDurable, RanksOneCommitApartResumeAtTheCommitTheyShare) {
  RunOptions o;
  o.ranks = 2;
  o.durable = true;
  o.param_tier = Tier::kCpu;  // the only writes of a step: the optimizer's write-backs
  o.optimizer_tier = Tier::kNvme;
  const RunResult straight = RunTraining(o);
  ASSERT_TRUE(straight.status.ok()) << straight.status.ToString();
  EXPECT_EQ(FirstBitDifference(straight.params, Reference(2).params), "")
      << "durable mode changed the training";
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  {
    // Two steps on both ranks; in the third, rank 1's write-backs fail: rank 0 commits step
    // 3, rank 1 stays at step 2. Then both "crash".
    DurableLeg leg;
    leg.to_micro = 3;
    leg.fail_rank = 1;
    leg.fail_micro = 2;
    leg.comm_timeout = std::chrono::seconds(5);
    RunDurableLeg(o, dir.path(), &leg);
    ASSERT_TRUE(leg.status[0].ok()) << leg.status[0].ToString();
    ASSERT_EQ(leg.status[1].code(), StatusCode::kIoError) << leg.status[1].ToString();
    auto rank0 = SwapStore::ListCommits(dir.path() + "/rank0");
    auto rank1 = SwapStore::ListCommits(dir.path() + "/rank1");
    ASSERT_TRUE(rank0.ok() && rank1.ok());
    ASSERT_EQ(rank0->size(), 2u);
    EXPECT_NE((*rank0)[0].find("\"step\":3"), std::string::npos) << (*rank0)[0];
    EXPECT_NE((*rank1)[0].find("\"step\":2"), std::string::npos) << (*rank1)[0];
  }
  {
    DurableLeg leg;
    leg.from_micro = 2;
    leg.to_micro = o.steps;
    RunDurableLeg(o, dir.path(), &leg);
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(leg.status[r].ok()) << "rank " << r << ": " << leg.status[r].ToString();
      EXPECT_EQ(leg.resumed_step[r], 2) << "rank " << r;
    }
    EXPECT_EQ(FirstBitDifference(leg.params, straight.params), "");
  }
  // Stores from different runs (rank 1's from a run one step long): no commit in common;
  // both ranks refuse, neither waits for the other.
  TempDir other;
  ASSERT_TRUE(other.ok());
  {
    DurableLeg leg;
    leg.to_micro = 1;
    RunDurableLeg(o, other.path(), &leg);
    ASSERT_TRUE(leg.status[0].ok() && leg.status[1].ok());
  }
  std::filesystem::remove_all(dir.path() + "/rank1");
  std::filesystem::rename(other.path() + "/rank1", dir.path() + "/rank1");
  DurableLeg leg;
  leg.from_micro = 1;
  leg.to_micro = 2;
  RunDurableLeg(o, dir.path(), &leg);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(leg.status[r].code(), StatusCode::kFailedPrecondition) << leg.status[r].ToString();
    EXPECT_NE(leg.status[r].message().find("no commit in common"), std::string::npos)
        << leg.status[r].ToString();
  }
}

// A durable store resumed with another number of ranks than wrote it: refused naming both
// counts (before: "no swap store", as if nothing were there).
TEST(EngineDurable, ResumeWithAnotherNumberOfRanksNamesBothCounts) {
  RunOptions o;
  o.ranks = 2;
  o.durable = true;
  o.param_tier = Tier::kCpu;
  o.optimizer_tier = Tier::kNvme;
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  {
    DurableLeg leg;
    leg.to_micro = 1;
    RunDurableLeg(o, dir.path(), &leg);
    ASSERT_TRUE(leg.status[0].ok() && leg.status[1].ok()) << leg.status[0].ToString();
  }
  o.ranks = 1;
  DurableLeg leg;
  leg.from_micro = 1;
  leg.to_micro = 2;
  RunDurableLeg(o, dir.path(), &leg);
  ASSERT_FALSE(leg.status[0].ok());
  EXPECT_NE(leg.status[0].message().find("written by 2 ranks, and this run has 1"),
            std::string::npos)
      << leg.status[0].ToString();
}

// A checkpoint load starts a new history. Two ranks at step 3 load a step-2 checkpoint and
// train step 3 again with another learning rate; rank 0 commits it, rank 1 fails first. Both
// stores now hold a "step 3", from different histories: the resume must take the step 3 both
// hold (the one before the load), not mix rank 0's new one with rank 1's old one.
TEST(EngineDurable, RanksResumeOnTheHistoryTheyShareAfterACheckpointLoad) {
  RunOptions o;
  o.ranks = 2;
  o.durable = true;
  o.param_tier = Tier::kCpu;
  o.optimizer_tier = Tier::kNvme;
  const RunResult straight = RunTraining(o);
  ASSERT_TRUE(straight.status.ok()) << straight.status.ToString();
  TempDir dir, ckpt;
  ASSERT_TRUE(dir.ok() && ckpt.ok());
  {
    DurableLeg leg;
    leg.to_micro = 4;
    leg.fail_rank = 1;
    leg.fail_micro = 3;
    leg.comm_timeout = std::chrono::seconds(5);
    leg.before_micro = [&](Engine* e, int, int m) -> Status {
      if (m == 2) return e->SaveCheckpoint(ckpt.path());
      if (m == 3) {
        ZINF_RETURN_IF_ERROR(e->LoadCheckpoint(ckpt.path()));
        return e->SetLearningRate(kLr * 3);
      }
      return Status::OK();
    };
    RunDurableLeg(o, dir.path(), &leg);
    ASSERT_TRUE(leg.status[0].ok()) << leg.status[0].ToString();
    ASSERT_EQ(leg.status[1].code(), StatusCode::kIoError) << leg.status[1].ToString();
    for (const char* r : {"/rank0", "/rank1"}) {
      auto commits = SwapStore::ListCommits(dir.path() + r);
      ASSERT_TRUE(commits.ok());
      EXPECT_NE((*commits)[0].find("\"step\":3"), std::string::npos) << r << (*commits)[0];
    }
  }
  DurableLeg leg;
  leg.from_micro = 3;
  leg.to_micro = o.steps;
  RunDurableLeg(o, dir.path(), &leg);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(leg.status[r].ok()) << "rank " << r << ": " << leg.status[r].ToString();
    EXPECT_EQ(leg.resumed_step[r], 3) << "rank " << r;
  }
  // Both resumed from the step 3 before the load: the run ends as one that never loaded.
  EXPECT_EQ(FirstBitDifference(leg.params, straight.params), "");
}

// Durable + delayed update with several ranks: refused at Create, naming both keys (each
// rank's optimizer thread commits on its own, so ranks could drift two commits apart).
TEST(EngineDurable, DelayedUpdateWithSeveralRanksIsRefused) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  std::unique_ptr<Device> d0 = NewTestHostDevice();
  std::unique_ptr<Device> d1 = NewTestHostDevice();
  auto comms = NewLocalComms({d0.get(), d1.get()});
  ASSERT_TRUE(comms.ok());
  RunOptions o;
  o.ranks = 2;
  o.durable = true;
  o.delayed = true;
  o.param_tier = Tier::kNvme;
  o.optimizer_tier = Tier::kNvme;
  auto e = Engine::Create(MakeConfig(o, dir.path()), d0.get(), (*comms)[0].get());
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kNotSupported);
  EXPECT_NE(e.status().message().find("more than one rank"), std::string::npos)
      << e.status().ToString();
}

// What ResumeFromStore refuses: no commit, another model, durable mode off, a call after
// registration ended; and the configurations durable mode does not support.
TEST(EngineDurable, RefusalsNameTheReason) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  std::unique_ptr<Device> device = NewTestHostDevice();
  auto comms = NewLocalComms({device.get()});
  ASSERT_TRUE(comms.ok());
  RunOptions o;
  o.durable = true;
  o.param_tier = Tier::kCpu;
  o.optimizer_tier = Tier::kNvme;
  auto open = [&](const RunOptions& ro) {
    auto e = Engine::Create(MakeConfig(ro, dir.path()), device.get(), (*comms)[0].get());
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return e.ok() ? std::move(*e) : nullptr;
  };
  {  // An empty folder: nothing to resume.
    auto e = open(o);
    ASSERT_NE(e, nullptr);
    RankTrainer t(e.get(), device.get());
    ASSERT_TRUE(t.Register(false).ok());
    Status s = e->ResumeFromStore();
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("index"), std::string::npos) << s.ToString();
    // The engine refuses to go on after a failed resume.
    double loss;
    StepStats stats;
    EXPECT_EQ(t.MicroStep(0, kGlobalBatch, false, &loss, &stats).code(),
              StatusCode::kFailedPrecondition);
  }
  {  // One committed step, then a model with another sub-group layout.
    auto e = open(o);
    RankTrainer t(e.get(), device.get());
    ASSERT_TRUE(t.Register().ok());
    double loss;
    StepStats stats;
    ASSERT_TRUE(t.MicroStep(0, kGlobalBatch, false, &loss, &stats).ok());
    EXPECT_EQ(e->ResumeFromStore().code(), StatusCode::kFailedPrecondition);  // too late
  }
  {
    RunOptions other = o;
    other.sub_group_size = kSubGroupSize / 2;
    auto e = open(other);
    RankTrainer t(e.get(), device.get());
    ASSERT_TRUE(t.Register(false).ok());
    Status s = e->ResumeFromStore();
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
    EXPECT_NE(s.message().find("different model"), std::string::npos) << s.ToString();
  }
  {
    RunOptions plain = o;
    plain.durable = false;
    auto e = open(plain);
    EXPECT_EQ(e->ResumeFromStore().code(), StatusCode::kFailedPrecondition);
  }
  // Unsupported combinations fail at Create, naming the keys.
  struct Bad {
    Tier optimizer;
    bool delayed;
    const char* expect;
  };
  for (const Bad& b :
       {Bad{Tier::kCpu, false, "offload_optimizer"}, Bad{Tier::kNvme, true, "delayed_update"}}) {
    RunOptions ro = o;
    ro.optimizer_tier = b.optimizer;
    ro.delayed = b.delayed;
    auto e = Engine::Create(MakeConfig(ro, dir.path()), device.get(), (*comms)[0].get());
    ASSERT_FALSE(e.ok()) << b.expect;
    EXPECT_NE(e.status().message().find(b.expect), std::string::npos) << e.status().ToString();
  }
}

// The same with the delayed update: a failure of the optimizer step that runs on during the
// next micro-step surfaces in that micro-step's Step() (or the next call that waits for it).
TEST(EngineTest, InjectedIoErrorWithTheDelayedUpdate) {
  InjectedIoErrorFailsTheStepAndTheEngineStaysConsistent(true);
}

// Every kind of fault the FaultyBackend injects, on parameter and optimizer-state traffic (a
// rule covers the next 1,000 requests of its op, so it meets whatever the step moves):
// errors (EIO on reads, EIO and ENOSPC on writes) fail a call with a Status naming the file
// or tensor; a torn write (the device drops data but reports success) is caught by the
// checksums when the tensor is read back; short transfers and slow requests are absorbed, and
// the training is then bit-identical to a clean run.
TEST(EngineTest, EveryFaultKindIsReportedOrAbsorbed) {
  struct Case {
    const char* name;
    IoFault fault;
    bool checksums;
    bool absorbed;
    StatusCode code;
  };
  auto make = [](IoFault::Kind kind, bool any_op, IoOp op, int err, uint64_t count) {
    IoFault f;
    f.kind = kind;
    f.any_op = any_op;
    f.op = op;
    f.errno_value = err;
    f.count = count;
    f.short_bytes = 4096;
    f.delay_us = 3000;
    return f;
  };
  const std::vector<Case> cases = {
      {"EIO on a read", make(IoFault::Kind::kError, false, IoOp::kRead, EIO, 1000), false, false,
       StatusCode::kIoError},
      {"EIO on a write", make(IoFault::Kind::kError, false, IoOp::kWrite, EIO, 1000), false, false,
       StatusCode::kIoError},
      {"ENOSPC on a write", make(IoFault::Kind::kError, false, IoOp::kWrite, ENOSPC, 1000), false,
       false, StatusCode::kResourceExhausted},
      {"torn writes", make(IoFault::Kind::kTorn, false, IoOp::kWrite, 0, 1000), true, false,
       StatusCode::kCorruption},
      {"short transfers", make(IoFault::Kind::kShort, true, IoOp::kRead, 0, 40), false, true,
       StatusCode::kOk},
      {"slow requests", make(IoFault::Kind::kDelay, true, IoOp::kRead, 0, 40), false, true,
       StatusCode::kOk},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    FaultOutcome f;
    RunGuarded(std::string("training with ") + c.name, std::chrono::seconds(60),
               [&] { f = RunWithInjectedFault(3, c.fault, c.checksums); });
    ASSERT_TRUE(f.setup.ok()) << f.setup.ToString();
    std::printf("  %s: %s\n", c.name, f.fault_error.ToString().c_str());
    if (c.absorbed) {
      ASSERT_TRUE(f.fault_error.ok()) << f.fault_error.ToString();
      ASSERT_TRUE(f.gather.ok()) << f.gather.ToString();
      RunOptions clean;
      clean.steps = f.clean_micro_steps;
      RunResult ref = RunTraining(clean);
      ASSERT_TRUE(ref.status.ok()) << ref.status.ToString();
      EXPECT_EQ(FirstBitDifference(f.params, ref.params), "")
          << "after " << c.name << ", vs " << clean.steps << " clean steps";
      continue;
    }
    ASSERT_FALSE(f.fault_error.ok()) << c.name << " was not reported by any engine call";
    EXPECT_EQ(f.fault_error.code(), c.code) << f.fault_error.ToString();
    EXPECT_TRUE(f.fault_error.message().find("zinf-swap") != std::string::npos ||
                f.fault_error.message().find('\'') != std::string::npos)
        << "names neither the swap file nor a tensor: " << f.fault_error.ToString();
    // With the fault gone: trains on with finite masters, or refuses with a reason. The same
    // kind of error may come once more: a prefetch issued while the fault was armed reports
    // at the Acquire that needs it, and after a torn write the data on disk stays damaged.
    if (!f.recovery.ok()) {
      std::printf("      then: %s\n", f.recovery.ToString().c_str());
      EXPECT_TRUE(f.recovery.code() == StatusCode::kFailedPrecondition ||
                  f.recovery.code() == c.code)
          << f.recovery.ToString();
    } else if (f.recovered_steps > 0) {
      ASSERT_TRUE(f.gather.ok()) << f.gather.ToString();
      EXPECT_TRUE(AllFinite(f.params));
    }
  }
}

}  // namespace
}  // namespace engine_test
}  // namespace zinf
