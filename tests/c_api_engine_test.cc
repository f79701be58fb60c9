#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tests/process_ranks.h"
#include "tests/test_util.h"
#include "zinf/zinf.h"

namespace {

// Least squares on one parameter through the C API: grad = w - target. AdamW moves w toward
// the target; after 200 steps at lr 0.05 every coordinate is within 0.1 of it (it starts 1-4
// away; Adam moves about lr per step while the gradient sign holds, 4 / 0.05 = 80 steps, and
// the remaining steps settle it).
void TrainToTarget(const std::string& config) {
  zinf_engine* e = nullptr;
  ASSERT_EQ(0, zinf_engine_create(config.c_str(), &e)) << zinf_last_error();
  const int64_t shape[] = {2, 2};
  const float init[] = {0, 0, 0, 0};
  const float target[] = {1, -2, 3, -4};
  uint32_t id = 99;
  ASSERT_EQ(0, zinf_engine_register(e, "w", shape, 2, init, &id)) << zinf_last_error();
  EXPECT_EQ(0u, id);
  zinf_step_stats st{};
  for (int step = 0; step < 200; ++step) {
    void* ptr = nullptr;
    ASSERT_EQ(0, zinf_engine_acquire(e, &id, 1, &ptr)) << zinf_last_error();
    ASSERT_EQ(0, zinf_engine_release(e, &id, 1));
    ASSERT_EQ(0, zinf_engine_acquire(e, &id, 1, &ptr)) << zinf_last_error();
    const float* w = static_cast<const float*>(ptr);
    float grad[4];
    for (int i = 0; i < 4; ++i) grad[i] = w[i] - target[i];
    ASSERT_EQ(0, zinf_engine_reduce_gradient(e, id, grad)) << zinf_last_error();
    ASSERT_EQ(0, zinf_engine_release(e, &id, 1));
    ASSERT_EQ(0, zinf_engine_step(e, &st)) << zinf_last_error();
  }
  EXPECT_EQ(200, st.step);
  EXPECT_EQ(1, st.optimizer_ran);
  float w[4];
  ASSERT_EQ(0, zinf_engine_gather_master(e, id, w)) << zinf_last_error();
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(target[i], w[i], 0.1) << i;
  zinf_engine_destroy(e);
}

TEST(CApiEngine, TrainsInMemory) {
  TrainToTarget(R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.05}}})");
}

// zinf.schedule layer-major through the C API: one step per window of 2 micro-batches, each
// gradient naming its micro-batch; the master is the same as the micro-batch schedule's (two
// steps per window, the plain call), bit for bit.
TEST(CApiEngine, LayerMajorWindowsTrainAsMicroBatches) {
  float result[2][4];
  for (int layer_major = 0; layer_major < 2; ++layer_major) {
    const std::string config =
        std::string(R"({"gradient_accumulation_steps": 2, "optimizer": {"type": "AdamW",
        "params": {"lr": 0.05}}, "zinf": {"schedule": ")") +
        (layer_major ? "layer-major" : "micro-batch") + "\"}}";
    zinf_engine* e = nullptr;
    ASSERT_EQ(0, zinf_engine_create(config.c_str(), &e)) << zinf_last_error();
    const int64_t shape[] = {4};
    const float init[] = {0, 0, 0, 0};
    uint32_t id = 0;
    ASSERT_EQ(0, zinf_engine_register(e, "w", shape, 1, init, &id)) << zinf_last_error();
    zinf_step_stats st{};
    for (int window = 0; window < 3; ++window) {
      void* ptr = nullptr;
      for (int j = 0; j < 2; ++j) {
        if (!layer_major || j == 0) {
          ASSERT_EQ(0, zinf_engine_acquire(e, &id, 1, &ptr)) << zinf_last_error();
        }
        const float* w = static_cast<const float*>(ptr);
        float grad[4];
        for (int i = 0; i < 4; ++i) grad[i] = w[i] - static_cast<float>(i + j) / 3.0f;
        if (layer_major) {
          ASSERT_EQ(0, zinf_engine_reduce_gradient_of(e, id, grad, j)) << zinf_last_error();
        } else {
          EXPECT_EQ(-1, zinf_engine_reduce_gradient_of(e, id, grad, 1 - j));  // not this one
          ASSERT_EQ(0, zinf_engine_reduce_gradient(e, id, grad)) << zinf_last_error();
        }
        if (!layer_major || j == 1) {
          ASSERT_EQ(0, zinf_engine_release(e, &id, 1));
          ASSERT_EQ(0, zinf_engine_step(e, &st)) << zinf_last_error();
          EXPECT_EQ(j == 1 ? 1 : 0, st.optimizer_ran);
        }
      }
    }
    EXPECT_EQ(3, st.step);
    ASSERT_EQ(0, zinf_engine_gather_master(e, id, result[layer_major])) << zinf_last_error();
    zinf_engine_destroy(e);
  }
  EXPECT_EQ(0, std::memcmp(result[0], result[1], sizeof(result[0])));
  EXPECT_NE(result[1][1], 0.0f);
}

// An IEEE half's value (the compiler's own conversion: libzinf exports the C API alone).
float HalfValue(uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, sizeof(h));
  return static_cast<float>(h);
}

// fp16: the parameter reads as fp16, the trainer multiplies its gradient by the engine's loss
// scale, and a step whose gradient overflows is skipped and halves the scale (hysteresis 1).
TEST(CApiEngine, TrainsInFp16WithTheEnginesLossScale) {
  zinf_engine* e = nullptr;
  ASSERT_EQ(0, zinf_engine_create(R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
                                      "fp16": {"enabled": true, "initial_scale_power": 8,
                                               "hysteresis": 1}})",
                                  &e))
      << zinf_last_error();
  EXPECT_EQ(256.0, zinf_engine_loss_scale(e));
  const int64_t shape[] = {2, 2};
  const float init[] = {0, 0, 0, 0};
  const float target[] = {1, -2, 3, -4};
  uint32_t id = 0;
  ASSERT_EQ(0, zinf_engine_register(e, "w", shape, 2, init, &id)) << zinf_last_error();
  zinf_step_stats st{};
  for (int step = 0; step < 200; ++step) {
    void* ptr = nullptr;
    ASSERT_EQ(0, zinf_engine_acquire(e, &id, 1, &ptr)) << zinf_last_error();
    const auto* w = static_cast<const uint16_t*>(ptr);
    const float scale = static_cast<float>(zinf_engine_loss_scale(e));
    float grad[4];
    for (int i = 0; i < 4; ++i) grad[i] = (HalfValue(w[i]) - target[i]) * scale;
    if (step == 5) grad[2] = INFINITY;
    ASSERT_EQ(0, zinf_engine_reduce_gradient(e, id, grad)) << zinf_last_error();
    ASSERT_EQ(0, zinf_engine_release(e, &id, 1));
    ASSERT_EQ(0, zinf_engine_step(e, &st)) << zinf_last_error();
    if (step == 5) {
      EXPECT_EQ(128.0, zinf_engine_loss_scale(e));
      EXPECT_EQ(1, zinf_engine_skipped_steps(e));
    }
  }
  EXPECT_EQ(200, st.step);
  EXPECT_EQ(1, zinf_engine_skipped_steps(e));
  float w[4];
  ASSERT_EQ(0, zinf_engine_gather_master(e, id, w)) << zinf_last_error();
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(target[i], w[i], 0.1) << i;
  zinf_engine_destroy(e);
  EXPECT_EQ(-1.0, zinf_engine_loss_scale(nullptr));
  EXPECT_EQ(-1, zinf_engine_skipped_steps(nullptr));
}

// offload_states / reload_states through the C API: the parameter and the optimizer states in
// device memory leave it after every step (blocking and not, the reload left to the next
// acquire every third step) and the training ends on the same bits as without.
std::vector<float> TrainWithOffloads(bool offload) {
  zinf_engine* e = nullptr;
  EXPECT_EQ(0, zinf_engine_create(R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
                                      "zero_optimization": {"offload_param": {"device": "none"},
                                        "offload_optimizer": {"device": "none"}}})",
                                  &e))
      << zinf_last_error();
  const int64_t shape[] = {2, 2};
  const float init[] = {0, 0, 0, 0};
  const float target[] = {1, -2, 3, -4};
  uint32_t id = 0;
  EXPECT_EQ(0, zinf_engine_register(e, "w", shape, 2, init, &id)) << zinf_last_error();
  // Before registration ends (the first acquire) there is nothing to offload.
  if (offload) EXPECT_EQ(-1, zinf_engine_offload_states(e, 0, "cpu", 1, 0));
  zinf_step_stats st{};
  for (int step = 0; step < 30; ++step) {
    void* ptr = nullptr;
    EXPECT_EQ(0, zinf_engine_acquire(e, &id, 1, &ptr)) << zinf_last_error();
    const float* w = static_cast<const float*>(ptr);
    float grad[4];
    for (int i = 0; i < 4; ++i) grad[i] = w[i] - target[i];
    EXPECT_EQ(0, zinf_engine_reduce_gradient(e, id, grad)) << zinf_last_error();
    EXPECT_EQ(0, zinf_engine_release(e, &id, 1));
    EXPECT_EQ(0, zinf_engine_step(e, &st)) << zinf_last_error();
    if (!offload) continue;
    EXPECT_EQ(0, zinf_engine_offload_states(e, 0, nullptr, step % 2, step % 2))
        << zinf_last_error();
    EXPECT_EQ(1, zinf_engine_states_offloaded(e));
    if (step % 3 != 2) {
      EXPECT_EQ(0, zinf_engine_reload_states(e, step % 2)) << zinf_last_error();
      EXPECT_EQ(0, zinf_engine_states_offloaded(e));
    }
  }
  if (offload) {
    EXPECT_EQ(-1, zinf_engine_offload_states(e, 0, "disk", 1, 0));
    EXPECT_NE(std::string(zinf_last_error()).find("\"cpu\" or \"nvme\""), std::string::npos)
        << zinf_last_error();
    EXPECT_EQ(-1, zinf_engine_offload_states(e, 1, "nvme", 1, 0));  // (everything goes)
    EXPECT_NE(std::string(zinf_last_error()).find("include=None"), std::string::npos)
        << zinf_last_error();
  }
  std::vector<float> w(4);
  EXPECT_EQ(0, zinf_engine_gather_master(e, id, w.data())) << zinf_last_error();
  zinf_engine_destroy(e);
  return w;
}

TEST(CApiEngine, OffloadAndReloadStatesContinueBitIdentically) {
  const std::vector<float> plain = TrainWithOffloads(false);
  const std::vector<float> cycled = TrainWithOffloads(true);
  EXPECT_EQ(0, std::memcmp(plain.data(), cycled.data(), 4 * sizeof(float)));
  EXPECT_EQ(-1, zinf_engine_states_offloaded(nullptr));
  EXPECT_EQ(-1, zinf_engine_offload_states(nullptr, 0, "cpu", 1, 0));
}

// Two processes, each a rank of one group (the launcher's variables set in the child): both
// train to the target and hold the same masters, bit for bit.
TEST(CApiEngine, TwoProcessRanksFromTheLaunchersVariables) {
  zinf::testing::TempDir store;
  ASSERT_TRUE(store.ok());
  std::vector<zinf::test::RankExit> exits = zinf::test::RunProcessRanks(
      2, std::chrono::seconds(120), [&](int rank) -> zinf::test::ChildResult {
        setenv("RANK", std::to_string(rank).c_str(), 1);
        setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
        setenv("WORLD_SIZE", "2", 1);
        setenv("LOCAL_WORLD_SIZE", "2", 1);
        setenv("ZINF_STORE_FOLDER", store.path().c_str(), 1);
        zinf_engine* e = nullptr;
        if (zinf_engine_create(R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
                                  "zinf": {"collective_timeout_seconds": 60}})",
                               &e) != 0) {
          return {zinf::Status::Internal(zinf_last_error()), ""};
        }
        const int64_t shape[] = {2, 2};
        const float init[] = {0, 0, 0, 0};
        const float target[] = {1, -2, 3, -4};
        uint32_t id = 0;
        if (zinf_engine_register(e, "w", shape, 2, init, &id) != 0) {
          return {zinf::Status::Internal(zinf_last_error()), ""};
        }
        zinf_step_stats st{};
        for (int step = 0; step < 200; ++step) {
          void* ptr = nullptr;
          if (zinf_engine_acquire(e, &id, 1, &ptr) != 0) {
            return {zinf::Status::Internal(zinf_last_error()), ""};
          }
          const float* w = static_cast<const float*>(ptr);
          float grad[4];
          for (int i = 0; i < 4; ++i) grad[i] = (w[i] - target[i]) / 2;  // a mean of 2 ranks
          if (zinf_engine_reduce_gradient(e, id, grad) != 0 ||
              zinf_engine_release(e, &id, 1) != 0 || zinf_engine_step(e, &st) != 0) {
            return {zinf::Status::Internal(zinf_last_error()), ""};
          }
        }
        float w[4];
        if (zinf_engine_gather_master(e, id, w) != 0) {
          return {zinf::Status::Internal(zinf_last_error()), ""};
        }
        zinf_engine_destroy(e);
        return {zinf::Status::OK(), std::string(reinterpret_cast<const char*>(w), sizeof(w))};
      });
  const float target[] = {1, -2, 3, -4};
  std::string first;
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(exits[r].report.rfind("OK\n", 0), 0u) << "rank " << r << ": " << exits[r].report;
    const std::string w = exits[r].report.substr(3);
    ASSERT_EQ(w.size(), 4 * sizeof(float));
    if (r == 0) first = w;
    EXPECT_EQ(w, first) << "the ranks' masters differ";
    float v[4];
    std::memcpy(v, w.data(), sizeof(v));
    for (int i = 0; i < 4; ++i) EXPECT_NEAR(target[i], v[i], 0.1) << "rank " << r << " " << i;
  }
}

TEST(CApiEngine, TrainsWithEverythingOnNvme) {
  zinf::testing::TempDir dir;
  ASSERT_TRUE(dir.ok());
  TrainToTarget(R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
    "zero_optimization": {"stage": 3,
      "offload_param": {"device": "nvme", "nvme_path": ")" +
                dir.path() + R"("},
      "offload_optimizer": {"device": "nvme", "nvme_path": ")" +
                dir.path() + R"("}},
    "zinf": {"pinned_budget_bytes": "64M"}})");
}

#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
// (The sanitizers reserve terabytes of address space: under ulimit -v nothing starts.)

// In a child (a death test): lowers the address-space limit to `limit`, creates an engine from
// `config`, trains one step of the least-squares problem, and exits 0; or prints the error and
// exits 1.
[[noreturn]] void CreateAndStepUnderALimit(uint64_t limit, const char* config) {
  rlimit as{};
  getrlimit(RLIMIT_AS, &as);
  as.rlim_cur = limit;
  if (setrlimit(RLIMIT_AS, &as) != 0) {
    std::fprintf(stderr, "setrlimit failed\n");
    std::_Exit(2);
  }
  zinf_engine* e = nullptr;
  const int64_t shape[] = {4};
  const float init[] = {0, 0, 0, 0};
  const float grad[] = {1, 1, 1, 1};
  uint32_t id = 0;
  void* ptr = nullptr;
  if (zinf_engine_create(config, &e) != 0 || zinf_engine_register(e, "w", shape, 1, init, &id) ||
      zinf_engine_acquire(e, &id, 1, &ptr) != 0 || zinf_engine_reduce_gradient(e, id, grad) ||
      zinf_engine_release(e, &id, 1) != 0 || zinf_engine_step(e, nullptr) != 0) {
    std::fprintf(stderr, "error: %s\n", zinf_last_error());
    std::fflush(stderr);
    std::_Exit(1);
  }
  zinf_engine_destroy(e);
  std::fflush(stderr);
  std::_Exit(0);
}

// zinf.device_budget_bytes 0 means what the device reports, as in C++ and zinf-train: the
// machine's memory for the host device (it used to be 4 GiB in the C API alone), lowered to
// fit an address-space limit, with a warning that names both.
TEST(CApiEngineDeathTest, ADeviceBudgetOfZeroIsTheMachinesMemoryAsInCpp) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const uint64_t phys = static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  // Room for the program (3 GiB), the pinned arena (64 MiB) and twice half the machine's memory:
  // the default budget becomes half of it.
  const uint64_t limit = phys + (uint64_t{3} << 30) + (uint64_t{64} << 20);
  EXPECT_EXIT(CreateAndStepUnderALimit(
                  limit, R"({"zinf": {"device_budget_bytes": 0, "pinned_budget_bytes": "64M"}})"),
              ::testing::ExitedWithCode(0),
              "the host device's budget is [0-9.]+ [KMGT]iB instead of the machine's");
}

// An explicit budget that the limit cannot hold is refused at create, naming the limit, the
// reservation and the key to lower (it used to create a device whose every allocation failed).
TEST(CApiEngineDeathTest, AnExplicitDeviceBudgetBeyondTheAddressSpaceLimitIsRefused) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(CreateAndStepUnderALimit(
                  uint64_t{6} << 30,
                  R"({"zinf": {"device_budget_bytes": "8G", "pinned_budget_bytes": "64M"}})"),
              ::testing::ExitedWithCode(1),
              "error: .*the address-space limit \\(ulimit -v\\) is 6.0 GiB.*2 x 8.0 GiB.*"
              "lower zinf.device_budget_bytes");
}
#endif

// One step of the least-squares problem above.
void OneStep(zinf_engine* e, uint32_t id) {
  const float target[] = {1, -2, 3, -4};
  void* ptr = nullptr;
  ASSERT_EQ(0, zinf_engine_acquire(e, &id, 1, &ptr)) << zinf_last_error();
  const float* w = static_cast<const float*>(ptr);
  float grad[4];
  for (int i = 0; i < 4; ++i) grad[i] = w[i] - target[i];
  ASSERT_EQ(0, zinf_engine_reduce_gradient(e, id, grad)) << zinf_last_error();
  ASSERT_EQ(0, zinf_engine_release(e, &id, 1));
  ASSERT_EQ(0, zinf_engine_step(e, nullptr)) << zinf_last_error();
}

// Checkpoints with user data, the durable store's resume and the learning rate through the C
// API: each restores the step counter and the masters bit for bit.
TEST(CApiEngine, CheckpointDurableResumeAndLearningRate) {
  zinf::testing::TempDir swap, ckpt;
  ASSERT_TRUE(swap.ok() && ckpt.ok());
  const std::string config = R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ")" +
                             swap.path() + R"("}},
    "zinf": {"pinned_budget_bytes": "64M", "durable": true}})";
  const int64_t shape[] = {4};
  const float init[] = {0, 0, 0, 0};
  float saved[4], back[4];
  uint32_t id = 0;
  {
    zinf_engine* e = nullptr;
    ASSERT_EQ(0, zinf_engine_create(config.c_str(), &e)) << zinf_last_error();
    ASSERT_EQ(0, zinf_engine_register(e, "w", shape, 1, init, &id)) << zinf_last_error();
    OneStep(e, id);
    EXPECT_NE(0, zinf_engine_set_learning_rate(e, -1.0f));
    ASSERT_EQ(0, zinf_engine_set_learning_rate(e, 0.0f)) << zinf_last_error();
    float before[4];
    ASSERT_EQ(0, zinf_engine_gather_master(e, id, before));
    OneStep(e, id);  // lr 0: AdamW without weight decay leaves the weights where they are
    ASSERT_EQ(0, zinf_engine_gather_master(e, id, saved));
    EXPECT_EQ(0, std::memcmp(before, saved, sizeof saved));
    ASSERT_EQ(0, zinf_engine_set_learning_rate(e, 0.05f));
    OneStep(e, id);
    EXPECT_EQ(3, zinf_engine_global_step(e));
    ASSERT_EQ(0, zinf_engine_gather_master(e, id, saved));
    EXPECT_NE(0, std::memcmp(before, saved, sizeof saved));
    ASSERT_EQ(0, zinf_engine_save_checkpoint(e, ckpt.path().c_str(), "position=3"))
        << zinf_last_error();
    zinf_engine_destroy(e);  // as a crash would: the store is at its last commit
  }
  {  // Resume from the durable store alone.
    zinf_engine* e = nullptr;
    ASSERT_EQ(0, zinf_engine_create(config.c_str(), &e)) << zinf_last_error();
    ASSERT_EQ(0, zinf_engine_register(e, "w", shape, 1, init, &id));
    ASSERT_EQ(0, zinf_engine_resume_from_store(e)) << zinf_last_error();
    EXPECT_EQ(3, zinf_engine_global_step(e));
    ASSERT_EQ(0, zinf_engine_gather_master(e, id, back));
    EXPECT_EQ(0, std::memcmp(back, saved, sizeof saved));
    EXPECT_NE(0, zinf_engine_resume_from_store(e));  // only once, before training
    zinf_engine_destroy(e);
  }
  {  // Load the checkpoint into an in-memory engine; a short user-data buffer truncates.
    zinf_engine* e = nullptr;
    ASSERT_EQ(0, zinf_engine_create(R"({"optimizer": {"type": "AdamW"}})", &e));
    ASSERT_EQ(0, zinf_engine_register(e, "w", shape, 1, init, &id));
    char text[9];
    size_t len = 0;
    ASSERT_EQ(0, zinf_engine_load_checkpoint(e, ckpt.path().c_str(), text, sizeof text, &len))
        << zinf_last_error();
    EXPECT_STREQ("position", text);
    EXPECT_EQ(10u, len);
    EXPECT_EQ(3, zinf_engine_global_step(e));
    ASSERT_EQ(0, zinf_engine_gather_master(e, id, back));
    EXPECT_EQ(0, std::memcmp(back, saved, sizeof saved));
    EXPECT_NE(0,
              zinf_engine_load_checkpoint(e, (ckpt.path() + "/none").c_str(), nullptr, 0, nullptr));
    EXPECT_NE(std::string::npos, std::string(zinf_last_error()).find("no checkpoint"))
        << zinf_last_error();
    zinf_engine_destroy(e);
  }
  EXPECT_EQ(-1, zinf_engine_global_step(nullptr));
  EXPECT_NE(0, zinf_engine_save_checkpoint(nullptr, "x", nullptr));
}

// A parameter in a group of its own with lr 0 stays where it is while one in group 0 moves;
// a group that does not exist, or a bad value, is an error naming it.
TEST(CApiEngine, ParameterGroups) {
  zinf_engine* e = nullptr;
  ASSERT_EQ(0,
            zinf_engine_create(R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.05}}})", &e))
      << zinf_last_error();
  const int64_t shape[] = {4};
  const float init[] = {1, 2, 3, 4};
  uint32_t moving = 0, still = 0;
  EXPECT_NE(0, zinf_engine_register_in_group(e, "still", shape, 1, init, 1, &still));
  EXPECT_NE(std::string::npos,
            std::string(zinf_last_error()).find("parameter group 1 does not exist"))
      << zinf_last_error();
  EXPECT_NE(0, zinf_engine_set_param_group(e, 1, 0.0f, 0.9f, 1.5f, 1e-8f, 0.0f));
  EXPECT_NE(std::string::npos, std::string(zinf_last_error()).find("betas[1]"))
      << zinf_last_error();
  ASSERT_EQ(0, zinf_engine_set_param_group(e, 1, 0.0f, 0.9f, 0.999f, 1e-8f, 0.0f))
      << zinf_last_error();
  ASSERT_EQ(0, zinf_engine_register(e, "moving", shape, 1, init, &moving)) << zinf_last_error();
  ASSERT_EQ(0, zinf_engine_register_in_group(e, "still", shape, 1, init, 1, &still))
      << zinf_last_error();
  const uint32_t ids[] = {moving, still};
  void* ptrs[2] = {nullptr, nullptr};
  ASSERT_EQ(0, zinf_engine_acquire(e, ids, 2, ptrs)) << zinf_last_error();
  const float grad[] = {0.5f, -0.5f, 0.25f, 1.0f};
  ASSERT_EQ(0, zinf_engine_reduce_gradient(e, moving, grad)) << zinf_last_error();
  ASSERT_EQ(0, zinf_engine_reduce_gradient(e, still, grad)) << zinf_last_error();
  ASSERT_EQ(0, zinf_engine_release(e, ids, 2));
  ASSERT_EQ(0, zinf_engine_step(e, nullptr)) << zinf_last_error();
  float a[4], b[4];
  ASSERT_EQ(0, zinf_engine_gather_master(e, moving, a)) << zinf_last_error();
  ASSERT_EQ(0, zinf_engine_gather_master(e, still, b)) << zinf_last_error();
  EXPECT_NE(0, std::memcmp(a, init, sizeof a));
  EXPECT_EQ(0, std::memcmp(b, init, sizeof b));
  zinf_engine_destroy(e);
}

TEST(CApiEngine, Errors) {
  zinf_engine* e = nullptr;
  EXPECT_NE(0, zinf_engine_create("{\"zero_optimization\": {\"stage\": \"three\"}}", &e));
  EXPECT_NE(std::string::npos, std::string(zinf_last_error()).find("zero_optimization.stage"))
      << zinf_last_error();
  EXPECT_NE(0, zinf_engine_create("{", &e));
  ASSERT_EQ(0, zinf_engine_create(nullptr, &e)) << zinf_last_error();
  const int64_t bad_shape[] = {0};
  const float init[] = {0};
  uint32_t id;
  EXPECT_NE(0, zinf_engine_register(e, "w", bad_shape, 1, init, &id));
  EXPECT_NE(0, zinf_engine_gather_master(e, 7, nullptr));
  zinf_engine_destroy(e);
}

TEST(CApiEngine, HostileShapesNamesSizesAndHandlesAreErrorsNotCrashes) {
  zinf_engine* e = nullptr;
  ASSERT_EQ(0, zinf_engine_create(nullptr, &e)) << zinf_last_error();
  const float init[4] = {1, 2, 3, 4};
  uint32_t id = 0;
  // {2^40}: used to abort with bad_alloc copying 4 TiB of initial values.
  const int64_t huge[] = {int64_t{1} << 50};
  EXPECT_NE(0, zinf_engine_register(e, "huge", huge, 1, init, &id));
  EXPECT_NE(std::string::npos, std::string(zinf_last_error()).find("2^48")) << zinf_last_error();
  // A product that overflows 64 bits: used to register a wrapped size.
  const int64_t wrap[] = {int64_t{1} << 33, int64_t{1} << 33};
  EXPECT_NE(0, zinf_engine_register(e, "wrap", wrap, 2, init, &id));
  const int64_t four[] = {4};
  ASSERT_EQ(0, zinf_engine_register(e, "w", four, 1, init, &id)) << zinf_last_error();
  EXPECT_NE(0, zinf_engine_register(e, "w", four, 1, init, &id)) << "a duplicate name";
  EXPECT_NE(std::string::npos, std::string(zinf_last_error()).find("twice"));
  EXPECT_NE(0, zinf_engine_register(e, "\xff\xfe", four, 1, init, &id)) << "not UTF-8";
  zinf_engine_destroy(e);
  // Destroyed: a second destroy and a later use are refused (the memory is not reused here).
  zinf_engine_destroy(e);
  EXPECT_NE(std::string::npos, std::string(zinf_last_error()).find("not a live engine"));
  EXPECT_NE(0, zinf_engine_step(e, nullptr));
  EXPECT_EQ(-1, zinf_engine_global_step(e));

  EXPECT_EQ(nullptr, zinf_alloc_aligned(SIZE_MAX));
  EXPECT_NE(std::string::npos, std::string(zinf_last_error()).find("more than any memory"));
  EXPECT_EQ(nullptr, zinf_alloc_aligned(SIZE_MAX - 4095 + 1));

  zinf::testing::TempDir dir;
  const char* paths[] = {dir.path().c_str()};
  zinf_swap_options o;
  zinf_swap_options_init(&o);
  o.paths = paths;
  o.num_paths = 1;
  zinf_swap_store* store = nullptr;
  ASSERT_EQ(0, zinf_swap_open(&o, &store)) << zinf_last_error();
  void* buf = zinf_alloc_aligned(4096);
  uint64_t t = 0;
  // 1 TiB in one write: refused at the call.
  EXPECT_NE(0, zinf_swap_write(store, "big", buf, size_t{1} << 40, size_t{1} << 41, &t));
  ASSERT_EQ(0, zinf_swap_close(store)) << zinf_last_error();
  EXPECT_NE(0, zinf_swap_close(store)) << "a double close";
  EXPECT_NE(std::string::npos, std::string(zinf_last_error()).find("not a live swap store"));
  EXPECT_NE(0, zinf_swap_write(store, "x", buf, 4096, 4096, &t));
  zinf_free_aligned(buf);
}

}  // namespace
