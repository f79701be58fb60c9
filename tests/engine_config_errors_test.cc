// Configurations the engine refuses at Create, naming the cause: NVMe paths outside the
// allowed roots, not folders, read-only, or missing.
#include "tests/engine_harness.h"

namespace zinf {
namespace engine_test {
namespace {

// ---- Configuration errors -------------------------------------------------------------------

TEST(EngineTest, NvmePathsOutsideTheAllowedRootsOrNotFoldersAreRefused) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  const std::string allowed = dir.path() + "/allowed", other = dir.path() + "/other";
  ASSERT_EQ(mkdir(allowed.c_str(), 0700), 0);
  ASSERT_EQ(mkdir(other.c_str(), 0700), 0);
  ASSERT_EQ(symlink(other.c_str(), (allowed + "/escape").c_str()), 0);
  std::ofstream(dir.path() + "/file") << "x";
  struct Case {
    std::string path;
    std::string expect;  // empty: accepted
  };
  const std::vector<Case> cases = {
      {allowed, ""},
      {other, "outside the allowed folders"},
      {allowed + "/escape", "outside the allowed folders"},  // a link out of the root
      {allowed + "/../other", "outside the allowed folders"},
      {dir.path() + "/file", "not a folder"},
      {dir.path() + "/missing", "create the folder"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.path);
    std::unique_ptr<Device> device = NewTestHostDevice();
    auto comms = NewLocalComms({device.get()});
    ASSERT_TRUE(comms.ok());
    RunOptions o;
    o.optimizer_tier = Tier::kNvme;
    EngineConfig config = MakeConfig(o, c.path);
    config.allowed_nvme_roots = {allowed};
    Result<std::unique_ptr<Engine>> engine =
        Engine::Create(config, device.get(), (*comms)[0].get());
    if (c.expect.empty()) {
      EXPECT_TRUE(engine.ok()) << engine.status().ToString();
      continue;
    }
    ASSERT_FALSE(engine.ok());
    EXPECT_NE(engine.status().message().find(c.expect), std::string::npos)
        << engine.status().ToString();
  }
  // The key parses, with a type check.
  std::vector<std::string> warnings;
  Result<EngineConfig> parsed =
      ParseEngineConfig(R"({"zinf": {"allowed_nvme_roots": ["/a", "/b"]}})", &warnings);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->allowed_nvme_roots, (std::vector<std::string>{"/a", "/b"}));
  EXPECT_TRUE(warnings.empty());
  parsed = ParseEngineConfig(R"({"zinf": {"allowed_nvme_roots": "/a"}})", &warnings);
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.status().message().find("zinf.allowed_nvme_roots"), std::string::npos);
}

// Read-only folders (a read-only filesystem: root ignores permission bits) as the NVMe path
// and as the checkpoint folder: one clear error naming the path, nothing crashes, and the
// engine trains on after a refused checkpoint. Needs mount(2) (root); skipped otherwise.
TEST(EngineTest, ReadOnlyPathsAreRefusedNamingThePath) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  const std::string ro = dir.path() + "/ro";
  ASSERT_EQ(mkdir(ro.c_str(), 0700), 0);
  const std::string cmd = "mount -t tmpfs -o ro,size=1m zinf-ro " + ro + " 2>/dev/null";
  if (std::system(cmd.c_str()) != 0) {
    GTEST_SKIP() << "cannot mount a read-only tmpfs here (needs root and mount(2))";
  }
  struct Unmount {
    std::string path;
    ~Unmount() { (void)std::system(("umount " + path).c_str()); }
  } unmount{ro};
  std::unique_ptr<Device> device = NewTestHostDevice();
  auto comms = NewLocalComms({device.get()});
  ASSERT_TRUE(comms.ok());
  RunOptions o;
  o.param_tier = Tier::kNvme;
  o.optimizer_tier = Tier::kNvme;
  Result<std::unique_ptr<Engine>> refused =
      Engine::Create(MakeConfig(o, ro), device.get(), (*comms)[0].get());
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find(ro), std::string::npos) << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("not writable"), std::string::npos)
      << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("Read-only file system"), std::string::npos)
      << refused.status().ToString();

  // A checkpoint into the read-only folder fails; training goes on.
  o.param_tier = o.optimizer_tier = Tier::kCpu;
  auto engine = Engine::Create(MakeConfig(o, ""), device.get(), (*comms)[0].get());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  RankTrainer trainer(engine->get(), device.get());
  ASSERT_TRUE(trainer.Register().ok());
  double loss;
  StepStats stats;
  ASSERT_TRUE(trainer.MicroStep(0, kGlobalBatch, false, &loss, &stats).ok());
  Status saved = (*engine)->SaveCheckpoint(ro + "/ckpt");
  ASSERT_FALSE(saved.ok());
  EXPECT_NE(saved.message().find(ro), std::string::npos) << saved.ToString();
  ASSERT_TRUE(trainer.MicroStep(0, kGlobalBatch, false, &loss, &stats).ok());
}

TEST(EngineTest, NvmeTierWithoutPathFailsAtCreate) {
  std::unique_ptr<Device> device = NewTestHostDevice();
  auto comms = NewLocalComms({device.get()});
  ASSERT_TRUE(comms.ok()) << comms.status().ToString();
  for (int which = 0; which < 2; ++which) {
    EngineConfig c = MakeConfig(RunOptions{}, "");
    (which == 0 ? c.offload_param : c.offload_optimizer).tier = Tier::kNvme;
    Result<std::unique_ptr<Engine>> engine = Engine::Create(c, device.get(), (*comms)[0].get());
    ASSERT_FALSE(engine.ok()) << (which == 0 ? "offload_param" : "offload_optimizer")
                              << " on nvme without a path was accepted";
    EXPECT_EQ(engine.status().code(), StatusCode::kInvalidArgument) << engine.status().ToString();
    EXPECT_NE(engine.status().message().find("nvme"), std::string::npos)
        << engine.status().ToString();
  }
}

}  // namespace
}  // namespace engine_test
}  // namespace zinf
