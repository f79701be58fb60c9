// The C API of the CPU optimizers (zinf_adam_step_f32 / zinf_adam_step_bf16): torch semantics
// over many steps, argument errors and their messages.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "zinf/zinf.h"

namespace {

uint16_t ToBf16(float f) {  // round to nearest even (no NaNs here)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
float FromBf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// torch.optim.Adam / AdamW (amsgrad=False) in double, for `steps` steps from zero states.
void TorchAdamDouble(std::vector<double>& p, const std::vector<std::vector<double>>& grads,
                     double lr, double b1, double b2, double eps, double wd, bool adamw) {
  std::vector<double> m(p.size(), 0.0), v(p.size(), 0.0);
  for (size_t s = 0; s < grads.size(); ++s) {
    const double step = static_cast<double>(s + 1);
    const double bc1 = 1.0 - std::pow(b1, step);
    const double bc2 = 1.0 - std::pow(b2, step);
    for (size_t i = 0; i < p.size(); ++i) {
      double g = grads[s][i];
      if (adamw) {
        p[i] *= 1.0 - lr * wd;
      } else if (wd != 0.0) {
        g += wd * p[i];
      }
      m[i] = b1 * m[i] + (1.0 - b1) * g;
      v[i] = b2 * v[i] + (1.0 - b2) * g * g;
      p[i] -= lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + eps);
    }
  }
}

class CApiAdamTest : public ::testing::TestWithParam<int> {};  // adamw = 0 or 1

TEST_P(CApiAdamTest, FollowsTorchOverManySteps) {
  const int adamw = GetParam();
  const size_t n = 1001;
  const int steps = 50;
  const float lr = 1e-2f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.1f;
  std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f);
  std::vector<double> p_ref(n);
  for (size_t i = 0; i < n; ++i) p[i] = p_ref[i] = std::sin(0.1 * i);
  std::vector<std::vector<double>> grads_ref(steps, std::vector<double>(n));
  std::vector<float> g(n);
  for (int s = 0; s < steps; ++s) {
    for (size_t i = 0; i < n; ++i) {
      g[i] = static_cast<float>(0.05 * std::cos(0.37 * i + s) + 0.01 * p[i]);
      grads_ref[s][i] = g[i];  // the reference sees the same gradients
    }
    ASSERT_EQ(zinf_adam_step_f32(p.data(), g.data(), m.data(), v.data(), n, s + 1, lr, b1, b2, eps,
                                 wd, adamw),
              0)
        << zinf_last_error();
    EXPECT_STREQ(zinf_last_error(), "");
  }
  // The double reference uses the float-valued hyper-parameters, so only rounding differs:
  // about 2^-24 relative per operation per step, on parameters of size ~1 moved by
  // ~lr per step, so after 50 steps the difference stays far below 1e-5.
  std::vector<double> torch_p = p_ref;
  TorchAdamDouble(torch_p, grads_ref, lr, b1, b2, eps, wd, adamw == 1);
  double max_err = 0.0;
  for (size_t i = 0; i < n; ++i) max_err = std::max(max_err, std::fabs(p[i] - torch_p[i]));
  EXPECT_LT(max_err, 1e-5) << "parameters drifted from torch's formula";
  // And the update did move them (the test would pass vacuously otherwise).
  double moved = 0.0;
  for (size_t i = 0; i < n; ++i) moved = std::max(moved, std::fabs(p[i] - p_ref[i]));
  EXPECT_GT(moved, 0.1);
}

TEST_P(CApiAdamTest, Bf16VariantEqualsF32OnTheSameGradients) {
  const int adamw = GetParam();
  const size_t n = 4099;  // not a multiple of any vector width
  std::vector<float> p1(n), p2(n), m1(n, 0), v1(n, 0), m2(n, 0), v2(n, 0), g32(n);
  std::vector<uint16_t> g16(n), out(n, 0);
  for (size_t i = 0; i < n; ++i) {
    p1[i] = p2[i] = static_cast<float>(std::cos(0.01 * i));
    g16[i] = ToBf16(static_cast<float>(1e-3 * std::sin(0.3 * i)));
    g32[i] = FromBf16(g16[i]);  // the exact value the bf16 kernel sees
  }
  for (int64_t step = 1; step <= 3; ++step) {
    ASSERT_EQ(zinf_adam_step_f32(p1.data(), g32.data(), m1.data(), v1.data(), n, step, 1e-3f, 0.9f,
                                 0.999f, 1e-8f, 0.01f, adamw),
              0)
        << zinf_last_error();
    ASSERT_EQ(zinf_adam_step_bf16(p2.data(), g16.data(), m2.data(), v2.data(), out.data(), n, step,
                                  1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, adamw),
              0)
        << zinf_last_error();
  }
  EXPECT_EQ(std::memcmp(p1.data(), p2.data(), n * 4), 0);
  EXPECT_EQ(std::memcmp(m1.data(), m2.data(), n * 4), 0);
  EXPECT_EQ(std::memcmp(v1.data(), v2.data(), n * 4), 0);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[i], ToBf16(p2[i])) << i;
  // NULL param_bf16_out: no copy, same update.
  ASSERT_EQ(zinf_adam_step_bf16(p2.data(), g16.data(), m2.data(), v2.data(), nullptr, n, 4, 1e-3f,
                                0.9f, 0.999f, 1e-8f, 0.01f, adamw),
            0);
}

INSTANTIATE_TEST_SUITE_P(AdamAndAdamW, CApiAdamTest, ::testing::Values(0, 1),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::string(info.param ? "adamw" : "adam");
                         });

// A failed call returns non-zero, leaves the buffers alone, and names the function and the
// bad argument.
class CApiAdamErrorTest : public ::testing::Test {
 protected:
  int Call(float* param, const float* grad, float* m, float* v, size_t n, int64_t step, float lr,
           float b1, float b2, float eps, float wd, int adamw) {
    return zinf_adam_step_f32(param, grad, m, v, n, step, lr, b1, b2, eps, wd, adamw);
  }
  void ExpectError(int rc, const char* text) {
    EXPECT_NE(rc, 0);
    const std::string msg = zinf_last_error();
    EXPECT_NE(msg.find(text), std::string::npos) << "message: " << msg;
    EXPECT_NE(msg.find("zinf_adam_step_f32"), std::string::npos) << "message: " << msg;
    EXPECT_EQ(p_[0], 1.0f) << "a failed call must not touch the parameters";
  }
  float p_[4] = {1, 1, 1, 1}, g_[4] = {1, 1, 1, 1}, m_[4] = {}, v_[4] = {};
};

TEST_F(CApiAdamErrorTest, ArgumentErrors) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  ExpectError(Call(nullptr, g_, m_, v_, 4, 1, 1e-3f, 0.9f, 0.999f, 1e-8f, 0, 1),
              "param is NULL but n > 0");
  ExpectError(Call(p_, nullptr, m_, v_, 4, 1, 1e-3f, 0.9f, 0.999f, 1e-8f, 0, 1), "grad is NULL");
  ExpectError(Call(p_, g_, nullptr, v_, 4, 1, 1e-3f, 0.9f, 0.999f, 1e-8f, 0, 1), "exp_avg is NULL");
  ExpectError(Call(p_, g_, m_, nullptr, 4, 1, 1e-3f, 0.9f, 0.999f, 1e-8f, 0, 1),
              "exp_avg_sq is NULL");
  ExpectError(Call(p_, g_, m_, v_, 4, 0, 1e-3f, 0.9f, 0.999f, 1e-8f, 0, 1),
              "step must be >= 1 (got 0)");
  ExpectError(Call(p_, g_, m_, v_, 4, -5, 1e-3f, 0.9f, 0.999f, 1e-8f, 0, 1),
              "step must be >= 1 (got -5)");
  ExpectError(Call(p_, g_, m_, v_, 4, 1, -1e-3f, 0.9f, 0.999f, 1e-8f, 0, 1),
              "lr must be finite and >= 0");
  ExpectError(Call(p_, g_, m_, v_, 4, 1, nan, 0.9f, 0.999f, 1e-8f, 0, 1), "lr must be finite");
  ExpectError(Call(p_, g_, m_, v_, 4, 1, 1e-3f, nan, 0.999f, 1e-8f, 0, 1),
              "beta1 must be in [0, 1)");
  ExpectError(Call(p_, g_, m_, v_, 4, 1, 1e-3f, 1.0f, 0.999f, 1e-8f, 0, 1),
              "beta1 must be in [0, 1) (got 1)");
  ExpectError(Call(p_, g_, m_, v_, 4, 1, 1e-3f, 0.9f, nan, 1e-8f, 0, 1), "beta2 must be in [0, 1)");
  ExpectError(Call(p_, g_, m_, v_, 4, 1, 1e-3f, 0.9f, 1.5f, 1e-8f, 0, 1),
              "beta2 must be in [0, 1)");
  ExpectError(Call(p_, g_, m_, v_, 4, 1, 1e-3f, 0.9f, 0.999f, nan, 0, 1), "eps must be finite");
  ExpectError(Call(p_, g_, m_, v_, 4, 1, 1e-3f, 0.9f, 0.999f, 1e-8f, nan, 1),
              "weight_decay must be finite");
  ExpectError(Call(p_, g_, m_, v_, 4, 1, 1e-3f, 0.9f, 0.999f, 1e-8f, -0.1f, 1),
              "weight_decay must be finite and >= 0");
  ExpectError(Call(p_, g_, m_, v_, 4, 1, 1e-3f, 0.9f, 0.999f, 1e-8f, 0, 2),
              "adamw must be 0 (Adam) or 1 (AdamW), got 2");
  ExpectError(Call(p_, g_, p_ + 1, v_, 3, 1, 1e-3f, 0.9f, 0.999f, 1e-8f, 0, 1),
              "param and exp_avg overlap");
  // The bf16 variant names itself.
  uint16_t g16[4] = {};
  EXPECT_NE(zinf_adam_step_bf16(p_, g16, m_, v_, nullptr, 4, 0, 1e-3f, 0.9f, 0.999f, 1e-8f, 0, 1),
            0);
  EXPECT_NE(
      std::string(zinf_last_error()).find("zinf_adam_step_bf16: adamw step: step must be >= 1"),
      std::string::npos)
      << zinf_last_error();
}

TEST_F(CApiAdamErrorTest, EmptyStepSucceedsAndClearsTheError) {
  ASSERT_NE(Call(nullptr, nullptr, nullptr, nullptr, 1, 1, 1e-3f, 0.9f, 0.999f, 1e-8f, 0, 0), 0);
  EXPECT_STRNE(zinf_last_error(), "");
  EXPECT_EQ(Call(nullptr, nullptr, nullptr, nullptr, 0, 1, 1e-3f, 0.9f, 0.999f, 1e-8f, 0, 0), 0);
  EXPECT_STREQ(zinf_last_error(), "");
}

TEST(CApiAdamKernelTest, ReportsTheKernelInUse) {
  const char* kernel = zinf_cpu_adam_kernel();
  ASSERT_NE(kernel, nullptr) << zinf_last_error();
  const std::string k = kernel;
  EXPECT_TRUE(k == "scalar" || k == "avx2" || k == "avx512" || k == "avx512_bf16") << k;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) {
    EXPECT_EQ(k.rfind("avx512", 0), 0u) << "this CPU has AVX-512F: " << k;
  }
}

}  // namespace
