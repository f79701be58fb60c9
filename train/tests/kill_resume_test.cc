// Kill and resume: zinf-train is killed with SIGKILL at named points of a step (inside a swap
// write, between optimizer sub-groups, in the backward, at every stage of a checkpoint
// commit), resumed with --resume, and must end with parameters bit-identical to a run that
// was never interrupted. The kill points come from ZINF_CRASH_AT (zinf/crash_point.h), so each
// lands exactly where it says, not at a random time.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tests/test_util.h"
#include "train/tests/spawn.h"
#include "zinf/cuda.h"

extern char** environ;

namespace {

using zinf::testing::Checksum;
using zinf::testing::Outcome;
using zinf::testing::ReadFile;
using zinf::testing::Spawn;
using zinf::testing::TempDir;

constexpr int kSteps = 6;

// The tiny model with checkpoints every step, parameters and states on NVMe.
Outcome RunTrain(const std::string& work, bool resume, const std::string& crash) {
  // clang-format off
  std::vector<std::string> args = {
      "--preset", "tiny", "--steps", std::to_string(kSteps), "--batch", "4", "--seq", "32",
      "--warmup", "2", "--save-every", "1", "--checkpoint-dir", work + "/ckpt",
      "--nvme", work + "/swap", "--param-tier", "nvme", "--data", ZINF_SOURCE_DATA, "--json"};
  // clang-format on
  if (resume) args.push_back("--resume");
  return Spawn(work, args, crash);
}

const std::string& Reference() {
  static const std::string sum = [] {
    TempDir dir;
    Outcome o = RunTrain(dir.path(), false, "");
    EXPECT_EQ(o.exit_code, 0) << o.stderr_text;
    return Checksum(o.stdout_text);
  }();
  return sum;
}

class KillResumeTest : public ::testing::TestWithParam<std::string> {};

TEST_P(KillResumeTest, ResumedRunEqualsUninterruptedRunBitForBit) {
  const std::string& ref = Reference();
  ASSERT_EQ(ref.size(), 16u) << "the uninterrupted run printed no checksum";
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  Outcome crashed = RunTrain(dir.path(), false, GetParam());
  ASSERT_TRUE(crashed.killed) << "ZINF_CRASH_AT=" << GetParam() << " never fired (exit code "
                              << crashed.exit_code << "); stderr:\n"
                              << crashed.stderr_text;
  Outcome resumed = RunTrain(dir.path(), true, "");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.stderr_text;
  EXPECT_EQ(Checksum(resumed.stdout_text), ref)
      << "after a kill at " << GetParam() << "; resume log:\n"
      << resumed.stderr_text;
}

// 24 kill points: each named point at several hits, spread over the six steps (the tiny model
// has two blocks, one optimizer sub-group; with parameters and states on NVMe, 29 swap writes
// per step after 29 at initialisation).
INSTANTIATE_TEST_SUITE_P(
    Points, KillResumeTest,
    ::testing::Values("train.backward:1", "train.backward:4", "train.backward:7",
                      "train.backward:12", "optimizer.group:1", "optimizer.group:2",
                      "optimizer.group:4", "optimizer.group:6", "swap.write:1", "swap.write:9",
                      "swap.write:23", "swap.write:47", "swap.write:80", "checkpoint.files:1",
                      "checkpoint.files:3", "checkpoint.files:6", "checkpoint.renamed:1",
                      "checkpoint.renamed:2", "checkpoint.renamed:5", "checkpoint.latest:1",
                      "checkpoint.latest:3", "checkpoint.latest:6", "checkpoint.latest:4",
                      "swap.write:120"),
    [](const ::testing::TestParamInfo<std::string>& info) {
      std::string n = info.param;
      for (char& c : n) {
        if (c == '.' || c == ':') c = '_';
      }
      return n;
    });

// Durable mode: no checkpoints at all; the swap store commits every step and --resume
// continues from its last commit. Killed inside swap writes, between optimizer sub-groups, in
// the backward, before the commit's index is written (the first one, at initialisation,
// included) and after it, the resumed run still ends on the uninterrupted run's bits.
Outcome RunDurable(const std::string& work, bool resume, const std::string& crash,
                   bool delayed = false) {
  // clang-format off
  std::vector<std::string> args = {
      "--preset", "tiny", "--steps", std::to_string(kSteps), "--batch", "4", "--seq", "32",
      "--warmup", "2", "--durable", "--nvme", work + "/swap", "--param-tier", "nvme",
      "--data", ZINF_SOURCE_DATA, "--json"};
  // clang-format on
  if (resume) args.push_back("--resume");
  if (delayed) args.push_back("--delayed-update");
  return Spawn(work, args, crash);
}

class DurableKillResumeTest : public ::testing::TestWithParam<std::string> {};

TEST_P(DurableKillResumeTest, ResumedFromTheStoreEqualsUninterruptedRunBitForBit) {
  const std::string& ref = Reference();
  ASSERT_EQ(ref.size(), 16u) << "the uninterrupted run printed no checksum";
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  Outcome crashed = RunDurable(dir.path(), false, GetParam());
  ASSERT_TRUE(crashed.killed) << "ZINF_CRASH_AT=" << GetParam() << " never fired (exit code "
                              << crashed.exit_code << "); stderr:\n"
                              << crashed.stderr_text;
  Outcome resumed = RunDurable(dir.path(), true, "");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.stderr_text;
  EXPECT_EQ(Checksum(resumed.stdout_text), ref)
      << "after a kill at " << GetParam() << "; resume log:\n"
      << resumed.stderr_text;
  // A kill after the first commit resumes from the store (not from step 0).
  if (GetParam() != "swap.commit:1") {
    EXPECT_NE(resumed.stderr_text.find("resumed from the durable swap store"), std::string::npos)
        << resumed.stderr_text;
  }
}

// 12 kill points (one commit at initialisation, then one per step).
INSTANTIATE_TEST_SUITE_P(Points, DurableKillResumeTest,
                         ::testing::Values("swap.commit:1", "swap.committed:1", "train.backward:5",
                                           "optimizer.group:2", "optimizer.group:5",
                                           "swap.write:31", "swap.write:50", "swap.write:100",
                                           "swap.commit:3", "swap.commit:5", "swap.committed:2",
                                           "swap.committed:6"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string n = info.param;
                           for (char& c : n) {
                             if (c == '.' || c == ':') c = '_';
                           }
                           return n;
                         });

// Durable mode with the delayed update: every step's update runs on the optimizer thread
// while the next step's forward and backward run, and that thread commits it once written;
// the micro-step after a commit reads the parameters one step older, which the store keeps.
// Killed anywhere, the resumed run (delayed too) ends on the uninterrupted delayed run's bits.
const std::string& DelayedReference() {
  static const std::string sum = [] {
    TempDir dir;
    Outcome o = RunDurable(dir.path(), false, "", /*delayed=*/true);
    EXPECT_EQ(o.exit_code, 0) << o.stderr_text;
    return Checksum(o.stdout_text);
  }();
  return sum;
}

class DurableDelayedKillResumeTest : public ::testing::TestWithParam<std::string> {};

TEST_P(DurableDelayedKillResumeTest, ResumedFromTheStoreEqualsUninterruptedRunBitForBit) {
  const std::string& ref = DelayedReference();
  ASSERT_EQ(ref.size(), 16u) << "the uninterrupted run printed no checksum";
  EXPECT_NE(ref, Reference()) << "the delayed update changed nothing";
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  Outcome crashed = RunDurable(dir.path(), false, GetParam(), true);
  ASSERT_TRUE(crashed.killed) << "ZINF_CRASH_AT=" << GetParam() << " never fired (exit code "
                              << crashed.exit_code << "); stderr:\n"
                              << crashed.stderr_text;
  Outcome resumed = RunDurable(dir.path(), true, "", true);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.stderr_text;
  EXPECT_EQ(Checksum(resumed.stdout_text), ref)
      << "after a kill at " << GetParam() << "; resume log:\n"
      << resumed.stderr_text;
  EXPECT_NE(resumed.stderr_text.find("resumed from the durable swap store"), std::string::npos)
      << resumed.stderr_text;
}

// 8 kill points: commits (made by the optimizer thread for delayed steps), their index
// renames, sub-groups, swap writes, the backward of the step that overlaps an update.
INSTANTIATE_TEST_SUITE_P(Points, DurableDelayedKillResumeTest,
                         ::testing::Values("swap.commit:2", "swap.commit:4", "swap.committed:3",
                                           "swap.committed:5", "optimizer.group:3", "swap.write:45",
                                           "swap.write:90", "train.backward:7"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string n = info.param;
                           for (char& c : n) {
                             if (c == '.' || c == ':') c = '_';
                           }
                           return n;
                         });

}  // namespace

namespace {

// ---- Errors a user meets: one sentence with the fix, exit code 1 or 2, no crash ----

// --optimizer-ratio 0: every optimizer sub-group stays in device memory and is stepped by
// the device (here the host device's CPU kernel): the same bits as the states on NVMe.
TEST(TrainCli, OptimizerRatioZeroTrainsTheSameBits) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  Outcome on_device = Spawn(dir.path(),
                            {"--preset",
                             "tiny",
                             "--steps",
                             std::to_string(kSteps),
                             "--batch",
                             "4",
                             "--seq",
                             "32",
                             "--warmup",
                             "2",
                             "--nvme",
                             dir.path() + "/swap",
                             "--param-tier",
                             "nvme",
                             "--optimizer-tier",
                             "nvme",
                             "--optimizer-ratio",
                             "0",
                             "--data",
                             ZINF_SOURCE_DATA,
                             "--json"},
                            "");
  ASSERT_EQ(on_device.exit_code, 0) << on_device.stderr_text;
  EXPECT_EQ(Checksum(on_device.stdout_text), Reference());
}

// Without a GPU (or without the CUDA backend) --device cuda is one clear error, not a crash.
TEST(TrainCli, DeviceCudaWithoutAGpuIsAClearError) {
  if (zinf::CudaDeviceCount() > 0) GTEST_SKIP() << "a GPU is visible: --device cuda would train";
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  Outcome o = Spawn(dir.path(),
                    {"--preset", "tiny", "--device", "cuda", "--nvme", dir.path() + "/swap",
                     "--steps", "1", "--data", ZINF_SOURCE_DATA},
                    "");
  EXPECT_EQ(o.exit_code, 1) << o.stderr_text;
  EXPECT_FALSE(o.killed);
  EXPECT_NE(o.stderr_text.find("zinf-train: --device cuda: "), std::string::npos) << o.stderr_text;
}

TEST(TrainCli, ModelTooLargeForTheNvmeDiskIsRefusedBeforeWriting) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  // 13B parameters with states on NVMe need ~190 GB.
  struct statvfs vfs {};
  ASSERT_EQ(statvfs(dir.path().c_str(), &vfs), 0);
  if (static_cast<double>(vfs.f_bavail) * vfs.f_frsize > 190e9) {
    GTEST_SKIP() << "the test folder's disk has room for a 13B model's states";
  }
  Outcome o = Spawn(dir.path(),
                    {"--preset", "13B", "--param-tier", "nvme", "--optimizer-tier", "nvme",
                     "--nvme", dir.path() + "/swap", "--steps", "1", "--data", ZINF_SOURCE_DATA},
                    "");
  EXPECT_EQ(o.exit_code, 1) << o.stderr_text;
  EXPECT_NE(o.stderr_text.find("not enough space on the NVMe path"), std::string::npos)
      << o.stderr_text;
  EXPECT_NE(o.stderr_text.find("free space"), std::string::npos) << o.stderr_text;
}

// The space check counts the optimizer states as stored: 13B parameters on NVMe need 2 B each
// (bf16) plus 12 (fp32 master and states) or about 6 (int8 states), so the int8 need is
// (2 + 6.03) / (2 + 12) = 0.57 of the fp32 one.
TEST(TrainCli, NvmeSpaceCheckCountsTheStateDtype) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  struct statvfs vfs {};
  ASSERT_EQ(statvfs(dir.path().c_str(), &vfs), 0);
  if (static_cast<double>(vfs.f_bavail) * vfs.f_frsize > 100e9) {
    GTEST_SKIP() << "the test folder's disk has room for a 13B model's int8 states";
  }
  auto need = [&](const char* dtype) -> double {
    Outcome o = Spawn(
        dir.path(),
        {"--preset", "13B", "--param-tier", "nvme", "--optimizer-tier", "nvme", "--state-dtype",
         dtype, "--nvme", dir.path() + "/swap", "--steps", "1", "--data", ZINF_SOURCE_DATA},
        "");
    EXPECT_EQ(o.exit_code, 1) << o.stderr_text;
    const std::string key = "optimizer states need about ";
    const size_t at = o.stderr_text.find(key);
    if (at == std::string::npos) {
      ADD_FAILURE() << o.stderr_text;
      return 0;
    }
    char* end = nullptr;
    const double gib = std::strtod(o.stderr_text.c_str() + at + key.size(), &end);
    EXPECT_EQ(std::string(end, 4), " GiB") << o.stderr_text;  // both are tens of GiB
    return gib;
  };
  const double fp32 = need("fp32");
  const double int8 = need("int8");
  ASSERT_GT(fp32, 0);
  EXPECT_NEAR(int8 / fp32, (2 + 6.03125) / 14.0, 0.01) << int8 << " vs " << fp32;
  Outcome bad = Spawn(dir.path(), {"--state-dtype", "fp8", "--steps", "1"}, "");
  EXPECT_EQ(bad.exit_code, 2) << bad.stderr_text;
  EXPECT_NE(bad.stderr_text.find("--state-dtype"), std::string::npos) << bad.stderr_text;
}

// Each progress line and the JSON summary give the optimizer's bytes per parameter as stored:
// the fp32 master (4) and two int8 states of 1 + 4/256 bytes each.
TEST(TrainCli, ProgressLinesShowTheStateBytesPerParameter) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  Outcome o = Spawn(dir.path(),
                    {"--preset", "tiny", "--steps", "2", "--batch", "4", "--seq", "32",
                     "--log-every", "1", "--state-dtype", "int8", "--nvme", dir.path() + "/swap",
                     "--data", ZINF_SOURCE_DATA, "--json"},
                    "");
  ASSERT_EQ(o.exit_code, 0) << o.stderr_text;
  int lines = 0;
  std::istringstream progress(o.stderr_text);
  for (std::string line; std::getline(progress, line);) {
    if (line.rfind("step ", 0) != 0) continue;
    ++lines;
    EXPECT_NE(line.find("  state 6.03 B/param"), std::string::npos) << line;
  }
  EXPECT_EQ(lines, 2) << o.stderr_text;
  EXPECT_NE(o.stdout_text.find("\"state_bytes_per_param\":6.03125"), std::string::npos)
      << o.stdout_text;
}

// --fp16: each progress line and the JSON summary give the loss scale and the skipped steps,
// and the summary the parameters' dtype.
TEST(TrainCli, Fp16RunsReportTheScaleAndTheSkippedSteps) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  Outcome o =
      Spawn(dir.path(),
            {"--preset", "tiny", "--steps", "3", "--batch", "4", "--seq", "32", "--log-every", "1",
             "--fp16", "--nvme", dir.path() + "/swap", "--data", ZINF_SOURCE_DATA, "--json"},
            "");
  ASSERT_EQ(o.exit_code, 0) << o.stderr_text;
  int lines = 0;
  std::istringstream progress(o.stderr_text);
  for (std::string line; std::getline(progress, line);) {
    if (line.rfind("step ", 0) != 0) continue;
    ++lines;
    EXPECT_NE(line.find("  scale "), std::string::npos) << line;
    EXPECT_NE(line.find(" skipped "), std::string::npos) << line;
  }
  EXPECT_EQ(lines, 3) << o.stderr_text;
  EXPECT_NE(o.stdout_text.find("\"param_dtype\":\"fp16\""), std::string::npos) << o.stdout_text;
  EXPECT_NE(o.stdout_text.find("\"loss_scale\":"), std::string::npos) << o.stdout_text;
  EXPECT_NE(o.stdout_text.find("\"skipped_steps\":"), std::string::npos) << o.stdout_text;
}

// --zero-stage 2 on two rank processes trains stage 3's values (the same sums), with each
// parameter whole on each rank; the JSON line names the stage.
TEST(TrainCli, Stage2OnTwoRanksEndsOnStage3sChecksum) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  std::string checksum[2];
  for (int k = 0; k < 2; ++k) {
    const std::string stage = k == 0 ? "3" : "2";
    Outcome o = Spawn(dir.path(),
                      {"--preset", "tiny", "--steps", "4", "--batch", "2", "--seq", "32",
                       "--grad-accum", "2", "--nproc", "2", "--zero-stage", stage, "--nvme",
                       dir.path() + "/swap" + stage, "--data", ZINF_SOURCE_DATA, "--json"},
                      "");
    ASSERT_EQ(o.exit_code, 0) << o.stderr_text;
    EXPECT_NE(o.stdout_text.find("\"zero_stage\":" + stage), std::string::npos) << o.stdout_text;
    const size_t at = o.stdout_text.find("\"param_checksum\":");
    ASSERT_NE(at, std::string::npos) << o.stdout_text;
    checksum[k] = o.stdout_text.substr(at, o.stdout_text.find(',', at) - at);
  }
  EXPECT_EQ(checksum[0], checksum[1]);
}

TEST(TrainCli, DeviceBudgetTooSmallForALayerNamesTheFlag) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  Outcome o = Spawn(dir.path(),
                    {"--preset", "small", "--device-budget", "64K", "--nvme", dir.path() + "/swap",
                     "--steps", "1", "--data", ZINF_SOURCE_DATA},
                    "");
  EXPECT_EQ(o.exit_code, 1) << o.stderr_text;
  EXPECT_NE(o.stderr_text.find("--device-budget"), std::string::npos) << o.stderr_text;
}

TEST(TrainCli, BadFlagsAndInputsAreOneLineErrors) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  const std::string swap = dir.path() + "/swap";
  struct Case {
    std::vector<std::string> args;
    std::string expect;
  };
  std::ofstream(dir.path() + "/file") << "x";
  const std::vector<Case> cases = {
      {{"--preset", "7B"}, "unknown model preset"},
      {{"--layers", "2", "--d-model", "30", "--heads", "4"}, "multiple of --heads"},
      {{"--layers", "2"}, "need all of --layers, --d-model and --heads"},
      {{"--param-tier", "disk"}, "expected device, cpu or nvme"},
      {{"--pinned-budget", "lots"}, "--pinned-budget"},
      {{"--data", dir.path() + "/none.txt"}, "--data"},
      {{"--nvme", dir.path() + "/file/swap"}, "NVMe swap folder"},
      {{"--resume"}, "--resume needs --checkpoint-dir"},
      {{"--preset", "tiny", "--seq", "65"}, "--seq must be in 1..64"},
      {{"--optimizer-ratio", "1.5"}, "--optimizer-ratio"},
      // Values that used to be replaced by defaults without a word.
      {{"--save-every", "-2"}, "--save-every"},
      {{"--lr", "-1"}, "--lr"},
      {{"--lr", "nan"}, "--lr"},
      {{"--lr", "1e10"}, "--lr"},
      {{"--grad-accum", "-3"}, "--grad-accum"},
      {{"--warmup", "-5"}, "--warmup"},
      {{"--log-every", "0"}, "--log-every"},
      {{"--fp16", "--fp32"}, "--fp32 and --fp16: pick one"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = c.args;
    if (std::find(args.begin(), args.end(), "--nvme") == args.end()) {
      args.insert(args.end(), {"--nvme", swap});
    }
    if (std::find(args.begin(), args.end(), "--data") == args.end()) {
      args.insert(args.end(), {"--data", ZINF_SOURCE_DATA});
    }
    args.insert(args.end(), {"--steps", "1"});
    Outcome o = Spawn(dir.path(), args, "");
    std::string joined;
    for (const std::string& a : c.args) joined += a + " ";
    EXPECT_TRUE(o.exit_code == 1 || o.exit_code == 2) << joined << ": " << o.stderr_text;
    EXPECT_FALSE(o.killed) << joined;
    EXPECT_NE(o.stderr_text.find(c.expect), std::string::npos)
        << joined << ": expected \"" << c.expect << "\" in:\n"
        << o.stderr_text;
  }
}

TEST(TrainCli, AFreshRunNeverReplacesCheckpointsOrADurableStoreSilently) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  // Checkpoints of an earlier run: a fresh run into the folder is refused; --resume continues;
  // --overwrite removes them and starts afresh.
  Outcome first = RunTrain(dir.path(), false, "");
  ASSERT_EQ(first.exit_code, 0) << first.stderr_text;
  Outcome again = RunTrain(dir.path(), false, "");
  EXPECT_EQ(again.exit_code, 2) << again.stderr_text;
  EXPECT_NE(again.stderr_text.find("holds checkpoints"), std::string::npos) << again.stderr_text;
  EXPECT_NE(again.stderr_text.find("--overwrite"), std::string::npos);
  std::vector<std::string> args = {"--preset",
                                   "tiny",
                                   "--steps",
                                   "2",
                                   "--batch",
                                   "4",
                                   "--seq",
                                   "32",
                                   "--save-every",
                                   "1",
                                   "--checkpoint-dir",
                                   dir.path() + "/ckpt",
                                   "--nvme",
                                   dir.path() + "/swap2",
                                   "--data",
                                   ZINF_SOURCE_DATA,
                                   "--json",
                                   "--overwrite"};
  Outcome over = Spawn(dir.path(), args, "");
  EXPECT_EQ(over.exit_code, 0) << over.stderr_text;
  EXPECT_NE(over.stderr_text.find("removed"), std::string::npos) << over.stderr_text;
  // A durable store with commits: a fresh --durable run is refused, naming the step.
  const std::string swap = dir.path() + "/dswap";
  std::vector<std::string> durable = {"--preset",  "tiny",   "--steps",        "2",
                                      "--batch",   "4",      "--seq",          "32",
                                      "--nvme",    swap,     "--param-tier",   "nvme",
                                      "--durable", "--data", ZINF_SOURCE_DATA, "--json"};
  ASSERT_EQ(Spawn(dir.path(), durable, "").exit_code, 0);
  Outcome fresh = Spawn(dir.path(), durable, "");
  EXPECT_EQ(fresh.exit_code, 2) << fresh.stderr_text;
  EXPECT_NE(fresh.stderr_text.find("hold a durable store committed at step 2"), std::string::npos)
      << fresh.stderr_text;
  durable.push_back("--overwrite");
  EXPECT_EQ(Spawn(dir.path(), durable, "").exit_code, 0);
}

TEST(TrainCli, TwoRunsOnOneSwapFolderOrCheckpointFolderAreRefused) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  // The first run holds the folders while a second tries them (a long first run: many steps).
  std::vector<std::string> args = {"--preset",
                                   "tiny",
                                   "--steps",
                                   "100000",
                                   "--batch",
                                   "4",
                                   "--seq",
                                   "32",
                                   "--checkpoint-dir",
                                   dir.path() + "/ckpt",
                                   "--nvme",
                                   dir.path() + "/swap",
                                   "--data",
                                   ZINF_SOURCE_DATA,
                                   "--json"};
  args.insert(args.begin(), ZINF_TRAIN_BIN);
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const std::string log = dir.path() + "/first.log";
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 2, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  pid_t first;
  ASSERT_EQ(posix_spawn(&first, argv[0], &fa, nullptr, argv.data(), environ), 0);
  posix_spawn_file_actions_destroy(&fa);
  // Wait until it trains (it has placed its parameters and prepared its folders by then).
  for (int i = 0; i < 300 && ReadFile(log).find("step ") == std::string::npos; ++i) usleep(100000);
  ASSERT_NE(ReadFile(log).find("step "), std::string::npos) << ReadFile(log);
  const std::vector<std::pair<std::vector<std::string>, std::string>> seconds = {
      {{"--checkpoint-dir", dir.path() + "/other", "--nvme", dir.path() + "/swap"},
       "swap folder " + dir.path() + "/swap is in use by pid " + std::to_string(first)},
      {{"--checkpoint-dir", dir.path() + "/ckpt", "--nvme", dir.path() + "/swap3", "--resume"},
       "checkpoint folder " + dir.path() + "/ckpt is in use by pid " + std::to_string(first)},
  };
  for (const auto& [extra, expect] : seconds) {
    std::vector<std::string> a = {"--preset", "tiny",  "--steps", "2",      "--batch",
                                  "4",        "--seq", "32",      "--data", ZINF_SOURCE_DATA};
    a.insert(a.end(), extra.begin(), extra.end());
    Outcome o = Spawn(dir.path(), a, "");
    EXPECT_EQ(o.exit_code, 2) << "a folder in use: refused before anything ran\n" << o.stderr_text;
    EXPECT_NE(o.stderr_text.find(expect), std::string::npos) << o.stderr_text;
  }
  kill(first, SIGKILL);
  int status = 0;
  waitpid(first, &status, 0);
  // Killed: nothing left locked.
  std::vector<std::string> a = {"--preset",
                                "tiny",
                                "--steps",
                                "1",
                                "--batch",
                                "4",
                                "--seq",
                                "32",
                                "--data",
                                ZINF_SOURCE_DATA,
                                "--checkpoint-dir",
                                dir.path() + "/ckpt",
                                "--nvme",
                                dir.path() + "/swap",
                                "--overwrite"};
  Outcome after = Spawn(dir.path(), a, "");
  EXPECT_EQ(after.exit_code, 0) << after.stderr_text;
}

#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
// (The sanitizers reserve terabytes of address space: under ulimit -v nothing starts.)
TEST(TrainCli, AnAddressSpaceLimitIsCheckedBeforeAllocating) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  const std::string swap = dir.path() + "/swap";
  const uint64_t limit_kib = uint64_t{6} << 20;  // 6 GiB
  // A budget that cannot fit: refused before anything is allocated, with the numbers and
  // the fix.
  Outcome o = Spawn(dir.path(),
                    {"--preset", "tiny", "--device-budget", "8G", "--nvme", swap, "--steps", "1",
                     "--data", ZINF_SOURCE_DATA},
                    "", limit_kib);
  EXPECT_EQ(o.exit_code, 2) << o.stderr_text;
  EXPECT_NE(o.stderr_text.find("the address-space limit (ulimit -v) is 6.0 GiB"), std::string::npos)
      << o.stderr_text;
  EXPECT_NE(o.stderr_text.find("2 x 8.0 GiB"), std::string::npos) << o.stderr_text;
  EXPECT_NE(o.stderr_text.find("ulimit -v unlimited"), std::string::npos) << o.stderr_text;
  // The default budget (the machine's memory) is lowered to fit, with a warning, and the run
  // trains (before: the 2 x 24 GiB reservation failed and every allocation reported
  // fragmentation).
  Outcome d = Spawn(
      dir.path(),
      {"--preset", "tiny", "--nvme", swap, "--steps", "2", "--data", ZINF_SOURCE_DATA, "--json"},
      "", limit_kib);
  EXPECT_EQ(d.exit_code, 0) << d.stderr_text;
  EXPECT_NE(d.stderr_text.find("instead of the machine's"), std::string::npos) << d.stderr_text;
  EXPECT_EQ(Checksum(d.stdout_text).size(), 16u) << d.stdout_text;
}
#endif

TEST(TrainCli, AnNvmeFolderOutsideTheAllowedRootsIsRefusedAndNotCreated) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  const std::string allowed = dir.path() + "/allowed";
  ASSERT_EQ(mkdir(allowed.c_str(), 0700), 0);
  const std::string config = dir.path() + "/config.json";
  {
    std::ofstream c(config);
    c << R"({"zinf": {"allowed_nvme_roots": [")" << allowed << R"("]}})";
  }
  const std::string outside = dir.path() + "/elsewhere/swap";
  Outcome o = Spawn(dir.path(),
                    {"--preset", "tiny", "--config", config, "--param-tier", "nvme", "--nvme",
                     outside, "--steps", "1", "--data", ZINF_SOURCE_DATA},
                    "");
  EXPECT_EQ(o.exit_code, 2) << o.stderr_text;
  EXPECT_NE(o.stderr_text.find("outside zinf.allowed_nvme_roots"), std::string::npos)
      << o.stderr_text;
  struct stat st {};
  EXPECT_NE(stat((dir.path() + "/elsewhere").c_str(), &st), 0) << "the refused folder was created";
  // A link inside the root that points outside is outside too.
  ASSERT_EQ(mkdir((dir.path() + "/out").c_str(), 0700), 0);
  ASSERT_EQ(symlink((dir.path() + "/out").c_str(), (allowed + "/link").c_str()), 0);
  o = Spawn(dir.path(),
            {"--preset", "tiny", "--config", config, "--param-tier", "nvme", "--nvme",
             allowed + "/link/swap", "--steps", "1", "--data", ZINF_SOURCE_DATA},
            "");
  EXPECT_EQ(o.exit_code, 2) << o.stderr_text;
  EXPECT_NE(stat((dir.path() + "/out/swap").c_str(), &st), 0);
  // Inside: trains.
  o = Spawn(dir.path(),
            {"--preset", "tiny", "--config", config, "--param-tier", "nvme", "--nvme",
             allowed + "/swap", "--steps", "1", "--data", ZINF_SOURCE_DATA},
            "");
  EXPECT_EQ(o.exit_code, 0) << o.stderr_text;
}

}  // namespace
