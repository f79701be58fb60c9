// zinf-train --nproc: N rank processes of one group (ZeRO-3 across them over gloo) train the
// same model as one rank with N times the batch (loss curve within 0.5 %); a rank killed
// mid-run ends the run within seconds, naming it, with no process left behind; what is not
// supported with several ranks yet is refused.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "tests/test_util.h"
#include "train/tests/spawn.h"

namespace {

using zinf::testing::Outcome;
using zinf::testing::Spawn;
using zinf::testing::TempDir;

std::vector<std::string> Args(const std::string& swap, int batch, int steps) {
  return {"--steps",  std::to_string(steps),
          "--batch",  std::to_string(batch),
          "--seq",    "64",
          "--warmup", "2",
          "--data",   ZINF_SOURCE_DATA,
          "--nvme",   swap,
          "--json"};
}

nlohmann::json LastJson(const std::string& out) {
  const size_t nl = out.find_last_of('\n', out.size() >= 2 ? out.size() - 2 : 0);
  return nlohmann::json::parse(out.substr(nl == std::string::npos ? 0 : nl + 1));
}

TEST(ZinfTrainRanks, TwoRanksMatchOneRankWithTwiceTheBatch) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  std::vector<std::string> two = Args(dir.path() + "/swap2", 2, 10);
  two.insert(two.begin(), {"--nproc", "2"});
  Outcome a = Spawn(dir.path(), two, "");
  ASSERT_EQ(a.exit_code, 0) << a.stderr_text;
  const nlohmann::json ja = LastJson(a.stdout_text);
  Outcome b = Spawn(dir.path(), Args(dir.path() + "/swap1", 4, 10), "");
  ASSERT_EQ(b.exit_code, 0) << b.stderr_text;
  const nlohmann::json jb = LastJson(b.stdout_text);
  EXPECT_EQ(ja["ranks"], 2);
  EXPECT_EQ(jb["ranks"], 1);
  ASSERT_EQ(ja["losses"].size(), 10u);
  ASSERT_EQ(jb["losses"].size(), 10u);
  for (size_t i = 0; i < 10; ++i) {
    const double x = ja["losses"][i], y = jb["losses"][i];
    // The same sequences; only the order of the gradient sums differs (two halves summed by
    // the reduce-scatter instead of one GEMM over all rows).
    EXPECT_LT(std::abs(x - y) / y, 0.005) << "step " << i + 1 << ": " << x << " vs " << y;
  }
  // Rank 0 alone reports: one JSON line.
  EXPECT_EQ(a.stdout_text.find("\"ranks\""), a.stdout_text.rfind("\"ranks\""));
}

// --schedule layer-major over 2 ranks (parameters on the host, 3 micro-batches per step, the
// default there: "auto") ends on the micro-batch schedule's checksum and losses, bit for bit.
TEST(ZinfTrainRanks, LayerMajorEndsOnTheMicroBatchSchedulesChecksum) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  nlohmann::json runs[2];
  for (int layer_major = 0; layer_major < 2; ++layer_major) {
    std::vector<std::string> args = Args(dir.path() + "/swap" + std::to_string(layer_major), 2, 3);
    args.insert(args.begin(), {"--nproc", "2", "--grad-accum", "3", "--param-tier", "cpu"});
    if (layer_major == 0) args.insert(args.begin(), {"--schedule", "micro-batch"});
    Outcome o = Spawn(dir.path(), args, "");
    ASSERT_EQ(o.exit_code, 0) << o.stderr_text;
    runs[layer_major] = LastJson(o.stdout_text);
  }
  EXPECT_EQ(runs[0]["schedule"], "micro-batch");
  EXPECT_EQ(runs[1]["schedule"], "layer-major");
  EXPECT_EQ(runs[0]["window_activation_bytes"], 0);
  EXPECT_GT(runs[1]["window_activation_bytes"].get<uint64_t>(), 0u);
  EXPECT_EQ(runs[0]["param_checksum"], runs[1]["param_checksum"]);
  EXPECT_EQ(runs[0]["losses"], runs[1]["losses"]);
}

TEST(ZinfTrainRanks, KilledRankEndsTheRunFast) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  std::vector<std::string> args = Args(dir.path() + "/swap", 2, 10);
  args.insert(args.begin(), {"--nproc", "2"});
  setenv("ZINF_CRASH_RANK", "1", 1);
  const auto start = std::chrono::steady_clock::now();
  Outcome o = Spawn(dir.path(), args, "train.backward:20");
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  unsetenv("ZINF_CRASH_RANK");
  EXPECT_FALSE(o.timed_out);
  EXPECT_NE(o.exit_code, 0) << o.stderr_text;
  EXPECT_LT(took, 60.0) << o.stderr_text;
  EXPECT_NE(o.stderr_text.find("rank 1 (pid"), std::string::npos) << o.stderr_text;
  EXPECT_NE(o.stderr_text.find("signal 9"), std::string::npos) << o.stderr_text;
  // Rank 0 failed by itself, naming rank 1.
  EXPECT_NE(o.stderr_text.find("no longer running"), std::string::npos) << o.stderr_text;
  // Both ranks are gone (their pids, as the supervisor printed them).
  size_t at = 0;
  int seen = 0;
  while ((at = o.stderr_text.find("(pid ", at)) != std::string::npos) {
    const pid_t pid = static_cast<pid_t>(std::strtol(o.stderr_text.c_str() + at + 5, nullptr, 10));
    at += 5;
    if (pid <= 0) continue;
    ++seen;
    EXPECT_TRUE(kill(pid, 0) != 0 && errno == ESRCH) << "pid " << pid << " is still running";
  }
  EXPECT_GE(seen, 2) << o.stderr_text;
}

// Checkpoints with several ranks: every rank writes its part, rank 0 commits; a resume of the
// same command continues bit-identical to an uninterrupted run; the checkpoint also loads into
// one rank with the whole batch (the layout re-partitioned). --durable is refused.
TEST(ZinfTrainRanks, CheckpointsResumeAcrossRuns) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  auto two = [&](const std::string& swap, int steps, std::vector<std::string> more) {
    std::vector<std::string> a = Args(dir.path() + "/" + swap, 2, steps);
    a.insert(a.begin(), {"--nproc", "2"});
    a.insert(a.end(), more.begin(), more.end());
    return a;
  };
  Outcome straight = Spawn(dir.path(), two("s1", 6, {}), "");
  ASSERT_EQ(straight.exit_code, 0) << straight.stderr_text;
  const std::string ckpt = dir.path() + "/ckpt";
  Outcome first = Spawn(dir.path(), two("s2", 3, {"--checkpoint-dir", ckpt}), "");
  ASSERT_EQ(first.exit_code, 0) << first.stderr_text;
  // A copy for the one-rank resume below (each resume saves its own final checkpoint).
  const std::string ckpt1 = dir.path() + "/ckpt1";
  std::filesystem::copy(ckpt, ckpt1, std::filesystem::copy_options::recursive);
  Outcome resumed = Spawn(dir.path(), two("s3", 6, {"--checkpoint-dir", ckpt, "--resume"}), "");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.stderr_text;
  const nlohmann::json js = LastJson(straight.stdout_text), jr = LastJson(resumed.stdout_text);
  EXPECT_EQ(jr["first_step"], 3);
  EXPECT_EQ(js["param_checksum"], jr["param_checksum"]) << "resumed run differs";
  // The same checkpoint into one rank with the whole batch: it resumes at step 3 and ends
  // near the 2-rank run (another reduction order, so not bit for bit).
  std::vector<std::string> one = Args(dir.path() + "/s4", 4, 6);
  one.insert(one.end(), {"--checkpoint-dir", ckpt1, "--resume"});
  Outcome single = Spawn(dir.path(), one, "");
  ASSERT_EQ(single.exit_code, 0) << single.stderr_text;
  const nlohmann::json j1 = LastJson(single.stdout_text);
  EXPECT_EQ(j1["first_step"], 3);
  const double a = js["loss_last"], b = j1["loss_last"];
  EXPECT_LT(std::abs(a - b) / a, 0.005) << a << " vs " << b;

  std::vector<std::string> durable = two("s5", 2, {"--durable"});
  Outcome refused = Spawn(dir.path(), durable, "");
  EXPECT_EQ(refused.exit_code, 2) << refused.stderr_text;
  EXPECT_NE(refused.stderr_text.find("--durable is not supported with several ranks"),
            std::string::npos)
      << refused.stderr_text;
}

// Starts zinf-train as rank `rank` of `world` (a store folder rendezvous), stdout and stderr
// into work/out<rank> and work/err<rank>; the pid, or -1.
pid_t StartRank(const std::string& work, int rank, int world, const std::string& store,
                std::vector<std::string> args) {
  args.insert(args.begin(), ZINF_TRAIN_BIN);
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    if (kv.rfind("RANK=", 0) == 0 || kv.rfind("WORLD_SIZE=", 0) == 0 ||
        kv.rfind("LOCAL_RANK=", 0) == 0 || kv.rfind("LOCAL_WORLD_SIZE=", 0) == 0 ||
        kv.rfind("ZINF_", 0) == 0) {
      continue;
    }
    env.push_back(kv);
  }
  for (const std::string& kv :
       {"RANK=" + std::to_string(rank), "WORLD_SIZE=" + std::to_string(world),
        "LOCAL_RANK=" + std::to_string(rank), "LOCAL_WORLD_SIZE=" + std::to_string(world),
        "ZINF_STORE_FOLDER=" + store, std::string("OPENBLAS_NUM_THREADS=1")}) {
    env.push_back(kv);
  }
  std::vector<char*> envp;
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  const std::string out = work + "/out" + std::to_string(rank);
  const std::string err = work + "/err" + std::to_string(rank);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_addopen(&fa, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  return rc == 0 ? pid : -1;
}

// Waits for `pid` at most `seconds` (then kills it, by its pid: the test's own child); its
// exit code, 128 + signal, or -1 when it had to be killed.
int WaitRank(pid_t pid, int seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  int status = 0;
  for (;;) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0 && errno != EINTR) return -1;
    if (std::chrono::steady_clock::now() > until) {
      kill(pid, SIGKILL);
      while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      return -1;
    }
    usleep(20000);
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Ranks started by hand with different flags (issue 38): before, another --seed, --lr,
// --state-dtype or --batch trained to exit 0 with each rank stepping by its own rules, and
// another --steps or clipping waited for the collective timeout; now both ranks fail at
// setup naming the flag and both values.
TEST(ZinfTrainRanks, RanksStartedWithDifferentFlagsAreRefusedNamingTheFlag) {
  struct Case {
    std::vector<std::string> rank1;
    std::string names;
  };
  for (const Case& c : std::vector<Case>{
           {{"--seed", "2"}, "zinf-train --seed: rank 0 has 1, rank 1 has 2"},
           {{"--lr", "0.003"}, "optimizer.lr: rank 0 has 0.00100"},
           {{"--state-dtype", "bf16"},
            "zinf.optimizer_state_dtype: rank 0 has fp32, rank 1 has bf16"},
           {{"--steps", "5"}, "zinf-train --steps: rank 0 has 4, rank 1 has 5"},
           {{"--gradient-clipping", "1"}, "gradient_clipping: rank 0 has"},
       }) {
    SCOPED_TRACE(c.names);
    TempDir dir;
    ASSERT_TRUE(dir.ok());
    const std::string store = dir.path() + "/store";
    ASSERT_TRUE(std::filesystem::create_directory(store));
    std::vector<std::string> a0 = Args(dir.path() + "/swap", 2, 4);
    a0.insert(a0.end(), {"--lr", "0.001"});
    // Rank 1: the same flags, one of them given another value (or added).
    std::vector<std::string> a1 = a0;
    auto flag = std::find(a1.begin(), a1.end(), c.rank1[0]);
    if (flag != a1.end()) {
      *(flag + 1) = c.rank1[1];
    } else {
      a1.insert(a1.end(), c.rank1.begin(), c.rank1.end());
    }
    const pid_t p0 = StartRank(dir.path(), 0, 2, store, a0);
    const pid_t p1 = StartRank(dir.path(), 1, 2, store, a1);
    ASSERT_GT(p0, 0);
    ASSERT_GT(p1, 0);
    const int rc0 = WaitRank(p0, 240), rc1 = WaitRank(p1, 240);
    for (int r : {0, 1}) {
      const std::string err = zinf::testing::ReadFile(dir.path() + "/err" + std::to_string(r));
      EXPECT_EQ(r == 0 ? rc0 : rc1, 2) << "rank " << r << ": " << err;  // a setup error
      EXPECT_NE(err.find("the ranks disagree on the model and its training settings"),
                std::string::npos)
          << "rank " << r << ": " << err;
      EXPECT_NE(err.find(c.names), std::string::npos) << "rank " << r << ": " << err;
    }
  }
}

// --nproc ranks show as zinf-train in ps and top (before: "exe", from exec of /proc/self/exe),
// and carry a job id of their own (the rendezvous answers only the job's ranks).
TEST(ZinfTrainRanks, RankProcessesAreNamedAndCarryAJobId) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  std::vector<std::string> args = Args(dir.path() + "/swap", 2, 400);
  args.insert(args.begin(), {ZINF_TRAIN_BIN, "--nproc", "2"});
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  const std::string out = dir.path() + "/out", err = dir.path() + "/err";
  posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_addopen(&fa, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  // Without a job id of the test's own (the supervisor passes a given one on).
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::string(*e).rfind("ZINF_JOB_ID=", 0) != 0) env.emplace_back(*e);
  }
  std::vector<char*> envp;
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_t supervisor = -1;
  ASSERT_EQ(posix_spawn(&supervisor, argv[0], &fa, nullptr, argv.data(), envp.data()), 0);
  posix_spawn_file_actions_destroy(&fa);
  // The supervisor's children, once both have exec'd (their names are then the program's).
  std::vector<std::string> names, jobs;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < until) {
    names.clear();
    jobs.clear();
    std::istringstream children(zinf::testing::ReadFile("/proc/" + std::to_string(supervisor) +
                                                        "/task/" + std::to_string(supervisor) +
                                                        "/children"));
    for (pid_t child; children >> child;) {
      std::string comm = zinf::testing::ReadFile("/proc/" + std::to_string(child) + "/comm");
      if (!comm.empty() && comm.back() == '\n') comm.pop_back();
      names.push_back(comm);
      const std::string env =
          zinf::testing::ReadFile("/proc/" + std::to_string(child) + "/environ");
      const size_t at = env.find("ZINF_JOB_ID=");
      jobs.push_back(at == std::string::npos ? ""
                                             : env.substr(at + 12, env.find('\0', at) - at - 12));
    }
    // Exec'd: the environment is the one the supervisor built (a forked child not yet
    // exec'd still has the supervisor's name and environment).
    if (names.size() == 2 && !jobs[0].empty() && !jobs[1].empty()) {
      break;
    }
    usleep(20000);
  }
  kill(supervisor, SIGTERM);  // our own child: it passes the signal on to its ranks
  const int rc = WaitRank(supervisor, 60);
  EXPECT_NE(rc, -1);
  ASSERT_EQ(names.size(), 2u) << zinf::testing::ReadFile(err);
  EXPECT_EQ(names[0], "zinf-train");
  EXPECT_EQ(names[1], "zinf-train");
  ASSERT_EQ(jobs.size(), 2u);
  EXPECT_EQ(jobs[0].size(), 32u) << jobs[0];
  EXPECT_EQ(jobs[0], jobs[1]);
}

}  // namespace
