// zinf-train never silently starts over or destroys what it was asked to keep: a durable
// resume from folders given in another order, from a store that lost its index, or from a
// replaced disk is refused or falls back to a checkpoint (saying so), never restarted at step
// 0; a fresh run never takes over a store through one of its folders; only names zinf wrote
// are removed; inputs that are not regular files are refused at once; refusals exit 2 and
// name the flag or key.
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <xxhash.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "tests/test_util.h"
#include "train/tests/spawn.h"

namespace {

using zinf::testing::Checksum;
using zinf::testing::Outcome;
using zinf::testing::ReadFile;
using zinf::testing::Spawn;
using zinf::testing::TempDir;

constexpr int kSteps = 6;

std::vector<std::string> Tiny(int steps) {
  return {"--preset", "tiny", "--steps", std::to_string(steps), "--batch", "4", "--seq", "32",
          "--warmup", "2",    "--data",  ZINF_SOURCE_DATA,      "--json"};
}

// Durable run over `nvme` folders (in that order), parameters on NVMe, a checkpoint every
// step into `ckpt` when given.
std::vector<std::string> Durable(int steps, const std::vector<std::string>& nvme,
                                 const std::string& ckpt = "") {
  std::vector<std::string> a = Tiny(steps);
  a.insert(a.end(), {"--durable", "--param-tier", "nvme"});
  for (const std::string& p : nvme) a.insert(a.end(), {"--nvme", p});
  if (!ckpt.empty()) a.insert(a.end(), {"--checkpoint-dir", ckpt, "--save-every", "1"});
  return a;
}

std::vector<std::string> With(std::vector<std::string> a, std::vector<std::string> more) {
  a.insert(a.end(), more.begin(), more.end());
  return a;
}

// Every file under `dirs` (locks aside) with a hash of its bytes: what a refusal must leave.
std::map<std::string, uint64_t> Snapshot(const std::vector<std::string>& dirs) {
  std::map<std::string, uint64_t> out;
  for (const std::string& d : dirs) {
    if (!std::filesystem::exists(d)) continue;
    for (const auto& e : std::filesystem::recursive_directory_iterator(d)) {
      if (!e.is_regular_file() || e.path().extension() == ".lock") continue;
      const std::string bytes = ReadFile(e.path());
      out[e.path()] = XXH3_64bits(bytes.data(), bytes.size());
    }
  }
  return out;
}

// The uninterrupted durable run's final parameters.
const std::string& Reference() {
  static const std::string sum = [] {
    TempDir dir;
    Outcome o = Spawn(dir.path(), Durable(kSteps, {dir.path() + "/s"}), "");
    EXPECT_EQ(o.exit_code, 0) << o.stderr_text;
    return Checksum(o.stdout_text);
  }();
  return sum;
}

class ResumeSafety : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dir_.ok());
    a_ = dir_.path() + "/a";
    b_ = dir_.path() + "/b";
    ckpt_ = dir_.path() + "/ckpt";
  }
  // A durable run over (a, b) with checkpoints, stopped after `steps` steps.
  void FirstRun(int steps, bool checkpoints = true) {
    Outcome o = Spawn(dir_.path(), Durable(steps, {a_, b_}, checkpoints ? ckpt_ : ""), "");
    ASSERT_EQ(o.exit_code, 0) << o.stderr_text;
  }
  TempDir dir_;
  std::string a_, b_, ckpt_;
};

TEST_F(ResumeSafety, FoldersInAnotherOrderAreRefusedNamingTheOrder) {
  FirstRun(3);
  const auto before = Snapshot({a_, b_, ckpt_});
  Outcome o = Spawn(dir_.path(), With(Durable(kSteps, {b_, a_}, ckpt_), {"--resume"}), "");
  EXPECT_EQ(o.exit_code, 2) << o.stderr_text;
  const std::string order =
      std::filesystem::canonical(a_).string() + ", " + std::filesystem::canonical(b_).string();
  EXPECT_NE(o.stderr_text.find(order), std::string::npos) << o.stderr_text;
  EXPECT_EQ(o.stdout_text.find("param_checksum"), std::string::npos) << "it trained";
  EXPECT_EQ(Snapshot({a_, b_, ckpt_}), before) << "a refused resume changed a file";
  // In the right order it resumes at step 3 and ends on the uninterrupted run's bits.
  Outcome ok = Spawn(dir_.path(), With(Durable(kSteps, {a_, b_}, ckpt_), {"--resume"}), "");
  ASSERT_EQ(ok.exit_code, 0) << ok.stderr_text;
  EXPECT_NE(ok.stderr_text.find("resumed from the durable swap store at step 3"), std::string::npos)
      << ok.stderr_text;
  EXPECT_EQ(Checksum(ok.stdout_text), Reference());
}

TEST_F(ResumeSafety, ALostIndexFallsBackToACheckpointOnlyWhenToldToReplaceTheStore) {
  FirstRun(3);
  ASSERT_EQ(unlink((a_ + "/zinf-swap.index.json").c_str()), 0);
  const auto before = Snapshot({a_, b_, ckpt_});
  // Without checkpoints to fall back to: refused (damaged state: exit 1), nothing changed.
  Outcome none = Spawn(dir_.path(), With(Durable(kSteps, {a_, b_}), {"--resume"}), "");
  EXPECT_EQ(none.exit_code, 1) << none.stderr_text;
  EXPECT_NE(none.stderr_text.find("lost its index"), std::string::npos) << none.stderr_text;
  // With checkpoints: refused all the same unless --overwrite lets the store be replaced.
  Outcome asked = Spawn(dir_.path(), With(Durable(kSteps, {a_, b_}, ckpt_), {"--resume"}), "");
  EXPECT_EQ(asked.exit_code, 1) << asked.stderr_text;
  EXPECT_NE(asked.stderr_text.find("add --overwrite"), std::string::npos) << asked.stderr_text;
  EXPECT_EQ(Snapshot({a_, b_, ckpt_}), before) << "a refused resume changed a file";
  Outcome over =
      Spawn(dir_.path(), With(Durable(kSteps, {a_, b_}, ckpt_), {"--resume", "--overwrite"}), "");
  ASSERT_EQ(over.exit_code, 0) << over.stderr_text;
  EXPECT_NE(over.stderr_text.find("resuming from the newest checkpoint"), std::string::npos)
      << over.stderr_text;
  EXPECT_NE(over.stderr_text.find("resumed from " + ckpt_ + " at step 3"), std::string::npos)
      << over.stderr_text;
  EXPECT_EQ(Checksum(over.stdout_text), Reference());
}

TEST_F(ResumeSafety, AReplacedDiskFallsBackToTheCheckpointsOrIsRefused) {
  FirstRun(3);
  std::filesystem::remove_all(a_);
  std::filesystem::remove_all(b_);
  // No store and no checkpoint: nothing to resume, refused (not a fresh start at step 0).
  const std::string empty_ckpt = dir_.path() + "/none";
  Outcome refused = Spawn(dir_.path(), With(Durable(kSteps, {a_, b_}), {"--resume"}), "");
  EXPECT_EQ(refused.exit_code, 2) << refused.stderr_text;
  EXPECT_NE(refused.stderr_text.find("no swap store"), std::string::npos) << refused.stderr_text;
  EXPECT_EQ(refused.stdout_text.find("param_checksum"), std::string::npos);
  // The checkpoints are there: the run resumes from them, saying so, and ends identical.
  Outcome o = Spawn(dir_.path(), With(Durable(kSteps, {a_, b_}, ckpt_), {"--resume"}), "");
  ASSERT_EQ(o.exit_code, 0) << o.stderr_text;
  EXPECT_NE(o.stderr_text.find("resuming from the newest checkpoint in " + ckpt_),
            std::string::npos)
      << o.stderr_text;
  EXPECT_EQ(Checksum(o.stdout_text), Reference());
}

TEST_F(ResumeSafety, AFreshRunNeverTakesOverAStoreThroughOneOfItsFolders) {
  FirstRun(2, /*checkpoints=*/false);
  const auto before = Snapshot({a_, b_});
  const std::string z = dir_.path() + "/z";
  for (const std::vector<std::string>& nvme :
       {std::vector<std::string>{z, b_}, {b_}, {b_, a_}, {a_}}) {
    Outcome o = Spawn(dir_.path(), Durable(2, nvme), "");
    EXPECT_EQ(o.exit_code, 2) << nvme[0] << ": " << o.stderr_text;
    EXPECT_NE(o.stderr_text.find("--overwrite"), std::string::npos) << o.stderr_text;
    // Not durable either: a scratch store must not truncate another store's files.
    std::vector<std::string> scratch = Tiny(1);
    for (const std::string& p : nvme) scratch.insert(scratch.end(), {"--nvme", p});
    EXPECT_EQ(Spawn(dir_.path(), scratch, "").exit_code, 2);
  }
  EXPECT_EQ(Snapshot({a_, b_}), before) << "a refused run changed the store";
}

TEST_F(ResumeSafety, AStoreThatNeverCommittedResumesFromStepZero) {
  // Killed at the very first commit (the initial state, written once placed): nothing was
  // committed, so a resume starts at step 0, says so, and ends on the reference.
  Outcome killed = Spawn(dir_.path(), Durable(kSteps, {a_}), "swap.commit:1");
  ASSERT_TRUE(killed.killed) << killed.stderr_text;
  Outcome o = Spawn(dir_.path(), With(Durable(kSteps, {a_}), {"--resume"}), "");
  ASSERT_EQ(o.exit_code, 0) << o.stderr_text;
  EXPECT_NE(o.stderr_text.find("never committed"), std::string::npos) << o.stderr_text;
  EXPECT_EQ(Checksum(o.stdout_text), Reference());
}

TEST_F(ResumeSafety, ADurableResumeWithAnotherSeedWarnsAndNothingLeftReportsNoLoss) {
  FirstRun(kSteps, /*checkpoints=*/false);
  Outcome seed =
      Spawn(dir_.path(), With(Durable(kSteps, {a_, b_}), {"--resume", "--seed", "7"}), "");
  ASSERT_EQ(seed.exit_code, 0) << seed.stderr_text;
  EXPECT_NE(seed.stderr_text.find("--seed 1, this run uses 7"), std::string::npos)
      << seed.stderr_text;
  // Resumed at step 6 of 6: no step ran, and the loss is not reported as 0.
  EXPECT_NE(seed.stderr_text.find("no step to run"), std::string::npos) << seed.stderr_text;
  EXPECT_NE(seed.stdout_text.find("\"loss_last\":null"), std::string::npos) << seed.stdout_text;
  EXPECT_NE(seed.stdout_text.find("\"loss_first\":null"), std::string::npos);
}

TEST(TrainSafety, OverwriteRemovesOnlyWhatZinfWrote) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  const std::string ckpt = dir.path() + "/ckpt";
  std::filesystem::create_directories(ckpt + "/step-000000009");
  std::ofstream(ckpt + "/step-notes.txt") << "my notes";
  std::ofstream(ckpt + "/step-000000001-loss.csv") << "1,2";
  std::ofstream(ckpt + "/step-000000009/README") << "mine";
  // Files named like checkpoints are not checkpoints: a fresh run is not refused over them.
  std::vector<std::string> run =
      With(Tiny(2), {"--nvme", dir.path() + "/s", "--checkpoint-dir", ckpt, "--save-every", "1"});
  Outcome first = Spawn(dir.path(), run, "");
  ASSERT_EQ(first.exit_code, 0) << first.stderr_text;
  Outcome again = Spawn(dir.path(), run, "");
  EXPECT_EQ(again.exit_code, 2) << again.stderr_text;
  Outcome over = Spawn(dir.path(), With(run, {"--overwrite"}), "");
  ASSERT_EQ(over.exit_code, 0) << over.stderr_text;
  for (const char* f : {"/step-notes.txt", "/step-000000001-loss.csv", "/step-000000009/README"}) {
    EXPECT_TRUE(std::filesystem::exists(ckpt + f)) << f << " was removed";
  }
}

TEST(TrainSafety, InputsThatAreNotRegularFilesAreRefusedAtOnce) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  const std::string fifo = dir.path() + "/fifo.safetensors";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--data", fifo}, "FIFO"},
      {{"--data", "/dev/zero"}, "character device"},
      {{"--data", dir.path()}, "a folder"},
  };
  for (const auto& [extra, expect] : cases) {
    std::vector<std::string> a = {"--preset", "tiny", "--steps", "1", "--nvme", dir.path() + "/s"};
    a.insert(a.end(), extra.begin(), extra.end());
    const auto t0 = std::chrono::steady_clock::now();
    Outcome o = Spawn(dir.path(), a, "");
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(o.exit_code, 2) << extra[1] << ": " << o.stderr_text;
    EXPECT_NE(o.stderr_text.find(expect), std::string::npos) << o.stderr_text;
    EXPECT_NE(o.stderr_text.find("--data"), std::string::npos) << o.stderr_text;
    EXPECT_LT(secs, 30) << "it read " << extra[1];
  }
  // A config that is a FIFO: refused, not waited on.
  Outcome o = Spawn(dir.path(), {"--preset", "tiny", "--steps", "1", "--config", fifo}, "");
  EXPECT_EQ(o.exit_code, 2) << o.stderr_text;
}

TEST(TrainSafety, RefusalsBeforeAnythingRanExit2NamingTheKeyOrFlag) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  auto config = [&](const std::string& name, const std::string& json) {
    const std::string path = dir.path() + "/" + name;
    std::ofstream(path) << json;
    return path;
  };
  const std::string nul_path = config(
      "nul.json", R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",)"
                  R"( "nvme_path": "/var/tmp/a\u0000b"}}})");
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--config", config("threads.json", R"({"zinf": {"optimizer_threads": 100000}})")},
       "zinf.optimizer_threads"},
      {{"--config",
        config("cap.json", R"({"zero_optimization": {"stage": 3, "offload_optimizer": )"
                           R"({"device": "nvme", "nvme_path": ")" +
                               dir.path() + R"(/s"}}, "zinf": {"nvme_capacity_bytes": 1}})")},
       "zinf.nvme_capacity_bytes"},
      {{"--config", nul_path}, "NUL"},
      // A parameter count that does not fit 64 bits: refused at once, not grown until killed.
      {{"--layers", "100000000", "--d-model", "1048576", "--heads", "16"}, "--layers"},
  };
  for (const auto& [extra, expect] : cases) {
    std::vector<std::string> a = {"--steps", "1", "--data", ZINF_SOURCE_DATA};
    a.insert(a.end(), extra.begin(), extra.end());
    if (extra[0] != "--config") a.insert(a.end(), {"--nvme", dir.path() + "/s2"});
    Outcome o = Spawn(dir.path(), a, "");
    EXPECT_EQ(o.exit_code, 2) << expect << ": " << o.stderr_text;
    EXPECT_NE(o.stderr_text.find(expect), std::string::npos) << o.stderr_text;
  }
}

// A read-only --nvme folder: refused before anything ran (exit 2), naming the folder.
TEST(TrainSafety, AReadOnlyNvmeFolderExits2) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  const std::string ro = dir.path() + "/ro";
  ASSERT_EQ(mkdir(ro.c_str(), 0700), 0);
  if (geteuid() != 0 || mount("none", ro.c_str(), "tmpfs", MS_RDONLY, "size=4m") != 0) {
    GTEST_SKIP() << "mounting a read-only tmpfs needs root";
  }
  Outcome o =
      Spawn(dir.path(),
            {"--preset", "tiny", "--steps", "1", "--data", ZINF_SOURCE_DATA, "--nvme", ro}, "");
  umount(ro.c_str());
  EXPECT_EQ(o.exit_code, 2) << o.stderr_text;
  EXPECT_NE(o.stderr_text.find(ro), std::string::npos) << o.stderr_text;
}

}  // namespace
