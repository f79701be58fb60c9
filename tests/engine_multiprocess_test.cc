// ZeRO-3 across processes: the engine test's training run with its ranks as forked processes
// on GlooComm gives the same bits as the same run with its ranks as threads on LocalComm
// (partitioning, gather on acquire, reduce-scatter of gradients, global norm and clipping,
// accumulation, every tier, the delayed update), and a checkpoint written by process ranks
// resumes in thread ranks to the same bits.
#include <cstring>
#include <string>
#include <vector>

#include "tests/engine_harness.h"
#include "tests/process_ranks.h"

namespace zinf {
namespace engine_test {
namespace {

// What a rank process sends back: its losses and its gathered masters.
std::string Serialize(const RankOutput& out) {
  std::string s;
  const uint64_t nl = out.losses.size();
  s.append(reinterpret_cast<const char*>(&nl), sizeof(nl));
  s.append(reinterpret_cast<const char*>(out.losses.data()), nl * sizeof(double));
  const uint64_t np = out.params.size();
  s.append(reinterpret_cast<const char*>(&np), sizeof(np));
  for (const std::vector<float>& p : out.params) {
    const uint64_t n = p.size();
    s.append(reinterpret_cast<const char*>(&n), sizeof(n));
    s.append(reinterpret_cast<const char*>(p.data()), n * sizeof(float));
  }
  return s;
}

bool Deserialize(const std::string& s, std::vector<double>* losses,
                 std::vector<std::vector<float>>* params) {
  size_t pos = 0;
  auto take = [&](void* dst, size_t bytes) {
    if (pos + bytes > s.size()) return false;
    std::memcpy(dst, s.data() + pos, bytes);
    pos += bytes;
    return true;
  };
  uint64_t nl = 0;
  if (!take(&nl, sizeof(nl)) || nl > (1u << 20)) return false;
  losses->resize(nl);
  if (!take(losses->data(), nl * sizeof(double))) return false;
  uint64_t np = 0;
  if (!take(&np, sizeof(np)) || np > (1u << 20)) return false;
  params->resize(np);
  for (auto& p : *params) {
    uint64_t n = 0;
    if (!take(&n, sizeof(n)) || n > (1u << 28)) return false;
    p.resize(n);
    if (!take(p.data(), n * sizeof(float))) return false;
  }
  return pos == s.size();
}

// RunTraining's result, with the ranks as processes on GlooComm (a store folder rendezvous).
RunResult RunAsProcesses(const RunOptions& o) {
  RunResult res;
  testing::TempDir nvme_dir;
  testing::TempDir store;
  if (!nvme_dir.ok() || !store.ok()) {
    res.status = Status::IoError("mkdtemp failed");
    return res;
  }
  std::vector<test::RankExit> exits =
      test::RunProcessRanks(o.ranks, o.timeout, [&](int rank) -> test::ChildResult {
        HostDeviceOptions dopt;
        dopt.memory_budget = kHostDeviceMemory;
        std::unique_ptr<Device> device = NewTestHostDevice(dopt);
        ProcessGroupOptions g;
        g.rank = rank;
        g.world_size = o.ranks;
        g.store_folder = store.path();
        g.timeout = std::chrono::milliseconds(60000);
        Result<std::unique_ptr<Communicator>> comm = NewGlooComm(device.get(), g);
        if (!comm.ok()) return {comm.status(), ""};
        RankOutput out;
        Status s = RankMain(o, rank, device.get(), comm->get(), nvme_dir.path(), &out);
        return {s, s.ok() ? Serialize(out) : ""};
      });
  std::vector<std::vector<double>> losses(o.ranks);
  std::vector<std::vector<std::vector<float>>> params(o.ranks);
  for (int r = 0; r < o.ranks; ++r) {
    const test::RankExit& e = exits[r];
    if (e.report.rfind("OK\n", 0) != 0) {
      const std::string line = "rank process " + std::to_string(r) + " (exit " +
                               std::to_string(e.exit_code) + ", signal " +
                               std::to_string(e.signal) + "): " + e.report.substr(0, 2000);
      res.status = res.status.ok() ? Status::Internal(line)
                                   : Status::Internal(res.status.message() + " | " + line);
      continue;
    }
    if (!Deserialize(e.report.substr(3), &losses[r], &params[r])) {
      res.status = Status::Internal("rank process " + std::to_string(r) + ": a torn report");
    }
  }
  if (!res.status.ok()) return res;
  res.params = params[0];
  for (int r = 1; r < o.ranks; ++r) {
    if (params[r] != params[0]) res.ranks_agree = false;  // float ==: exact, NaN never agrees
  }
  res.losses.assign(losses[0].size(), 0.0);
  for (int r = 0; r < o.ranks; ++r) {
    for (size_t m = 0; m < res.losses.size(); ++m) res.losses[m] += losses[r][m];
  }
  return res;
}

// `in_threads`: the thread ranks' options when they differ (otherwise o's).
void ExpectSameBits(const RunOptions& o, const RunOptions* in_threads = nullptr) {
  SCOPED_TRACE(o.Describe());
  // Processes first: the fork needs this process to have one thread.
  RunResult processes = RunAsProcesses(o);
  RunResult threads = RunTraining(in_threads != nullptr ? *in_threads : o);
  ASSERT_TRUE(threads.status.ok()) << threads.status.ToString();
  ASSERT_TRUE(processes.status.ok()) << processes.status.ToString();
  EXPECT_TRUE(processes.ranks_agree);
  ASSERT_EQ(processes.params.size(), threads.params.size());
  EXPECT_EQ(FirstBitDifference(processes.params, threads.params), "");
  ASSERT_EQ(processes.losses.size(), threads.losses.size());
  for (size_t m = 0; m < threads.losses.size(); ++m) {
    EXPECT_EQ(std::memcmp(&processes.losses[m], &threads.losses[m], sizeof(double)), 0)
        << "micro-step " << m << ": " << processes.losses[m] << " vs " << threads.losses[m];
  }
}

TEST(EngineMultiProcess, TwoRanksAllOnDeviceWithClippingAndAccumulation) {
  RunOptions o;
  o.ranks = 2;
  o.grad_accum = 2;
  o.clipping = 0.05;  // small enough to clip
  ExpectSameBits(o);
}

// Speculative steps in rank processes (every step clips, so every speculated sub-group is
// redone with the coefficient the all-reduced norm gives each rank) end bit-identical to
// thread ranks that wait for the norm.
TEST(EngineMultiProcess, TwoRanksSpeculatingMatchThreadsWaitingForTheNorm) {
  RunOptions o;
  o.ranks = 2;
  o.param_tier = Tier::kCpu;
  o.optimizer_tier = Tier::kNvme;
  o.clipping = 0.05;
  o.speculative = SpeculativeStep::kOn;
  RunOptions waiting = o;
  waiting.speculative = SpeculativeStep::kOff;
  ExpectSameBits(o, &waiting);
}

TEST(EngineMultiProcess, TwoRanksEverythingOnNvme) {
  RunOptions o;
  o.ranks = 2;
  o.param_tier = Tier::kNvme;
  o.optimizer_tier = Tier::kNvme;
  ExpectSameBits(o);
}

// ZeRO stage 2 in rank processes ends bit-identical to stage 3 in threads (the same sums);
// stage 1 (each rank sums its micro-steps first) to stage 1 in threads.
TEST(EngineMultiProcess, TwoRanksAtStages2And1) {
  RunOptions o;
  o.ranks = 2;
  o.param_tier = Tier::kNvme;
  o.optimizer_tier = Tier::kCpu;
  o.grad_accum = 2;
  o.clipping = 0.05;
  o.stage = 2;
  RunOptions three = o;
  three.stage = 3;
  ExpectSameBits(o, &three);
  o.stage = 1;
  o.param_tier = Tier::kCpu;
  o.optimizer_tier = Tier::kNvme;
  ExpectSameBits(o);
}

TEST(EngineMultiProcess, FourRanksStatesOnCpuDelayedUpdate) {
  RunOptions o;
  o.ranks = 4;
  o.optimizer_tier = Tier::kCpu;
  o.delayed = true;
  ExpectSameBits(o);
}

TEST(EngineMultiProcess, CheckpointFromProcessesResumesInThreads) {
  testing::TempDir ckpt;
  ASSERT_TRUE(ckpt.ok());
  RunOptions o;
  o.ranks = 2;
  o.optimizer_tier = Tier::kCpu;
  o.grad_accum = 2;
  RunOptions first = o;
  first.checkpoint_dir = ckpt.path();
  first.save_after_step = 2;
  RunResult a = RunAsProcesses(first);
  ASSERT_TRUE(a.status.ok()) << a.status.ToString();
  RunOptions second = o;
  second.checkpoint_dir = ckpt.path();
  second.load_first = true;
  second.first_micro = 2 * o.grad_accum;
  RunResult b = RunTraining(second);
  ASSERT_TRUE(b.status.ok()) << b.status.ToString();
  RunResult straight = RunTraining(o);
  ASSERT_TRUE(straight.status.ok()) << straight.status.ToString();
  EXPECT_EQ(FirstBitDifference(b.params, straight.params), "");
  EXPECT_EQ(FirstBitDifference(a.params, straight.params), "");
}

// Rank processes with different models (rank 1 a layer more) or settings (another learning
// rate): before, the first gather of another size aborted rank 0 inside gloo (SIGABRT,
// "op.preamble.length <= op.nbytes") or the ranks trained each by its own rules; now every
// rank fails FinishRegistration with the first difference named, and exits by itself.
TEST(EngineMultiProcess, RanksThatDisagreeAreRefusedNotAborted) {
  struct Case {
    int layers1;
    float lr1;
    const char* names;
  };
  for (const Case& c : {Case{3, 1e-2f, "parameters: rank 0 has 2, rank 1 has 3"},
                        Case{2, 2e-2f, "optimizer.lr: rank 0 has 0.0099999"}}) {
    SCOPED_TRACE(c.names);
    testing::TempDir store;
    ASSERT_TRUE(store.ok());
    std::vector<test::RankExit> exits =
        test::RunProcessRanks(2, std::chrono::seconds(120), [&](int rank) -> test::ChildResult {
          std::unique_ptr<Device> device = NewTestHostDevice(HostDeviceOptions{});
          ProcessGroupOptions g;
          g.rank = rank;
          g.world_size = 2;
          g.store_folder = store.path();
          g.timeout = std::chrono::milliseconds(60000);
          Result<std::unique_ptr<Communicator>> comm = NewGlooComm(device.get(), g);
          if (!comm.ok()) return {comm.status(), ""};
          EngineConfig cfg;
          cfg.offload_param.tier = Tier::kCpu;
          cfg.offload_optimizer.tier = Tier::kCpu;
          cfg.param_persistence_threshold = 0;
          cfg.optimizer_threads = 1;
          cfg.pinned_budget_bytes = 16ull << 20;
          cfg.optimizer.lr = rank == 1 ? c.lr1 : 1e-2f;
          Result<std::unique_ptr<Engine>> engine = Engine::Create(cfg, device.get(), comm->get());
          if (!engine.ok()) return {engine.status(), ""};
          std::vector<ParamId> ids;
          for (int l = 0; l < (rank == 1 ? c.layers1 : 2); ++l) {
            ParamSpec p;
            p.name = "layer" + std::to_string(l);
            p.shape = {1000 * (l + 1)};
            p.init = [](float* d, size_t n) {
              for (size_t i = 0; i < n; ++i) d[i] = 0.001f * static_cast<float>(i % 50);
            };
            Result<ParamId> id = (*engine)->RegisterParameter(p);
            if (!id.ok()) return {id.status(), ""};
            ids.push_back(*id);
          }
          // What aborted before: the first acquire's gathers, of other sizes on the two ranks.
          Result<std::vector<void*>> views = (*engine)->Acquire(ids);
          return {views.ok() ? Status::OK() : views.status(), ""};
        });
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(exits[r].signal, 0) << "rank " << r << ": " << exits[r].report;
      EXPECT_EQ(exits[r].exit_code, 1) << "rank " << r << ": " << exits[r].report;
      EXPECT_NE(exits[r].report.find("the ranks disagree on the model and its training settings"),
                std::string::npos)
          << "rank " << r << ": " << exits[r].report;
      EXPECT_NE(exits[r].report.find(c.names), std::string::npos)
          << "rank " << r << ": " << exits[r].report;
    }
  }
}

}  // namespace
}  // namespace engine_test
}  // namespace zinf
