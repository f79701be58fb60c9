#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

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

}  // namespace
