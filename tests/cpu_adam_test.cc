// Tests of zinf/cpu_adam.h: every kernel variant against the scalar reference (bit for bit)
// and against a double-precision evaluation of the optimizer math (within a bound derived
// below), run-time dispatch, the conversions, the parallel driver and argument checks.
#include "zinf/cpu_adam.h"

#include <gtest/gtest.h>
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_adam/kernels.h"

namespace zinf {
namespace {

using cpu_adam_internal::KernelsFor;
using cpu_adam_internal::KernelTable;
using cpu_adam_internal::KernelVariant;
using cpu_adam_internal::KernelVariantName;
using cpu_adam_internal::KernelVariantSupported;

constexpr double kU = 1.0 / (1 << 24);  // unit roundoff of fp32 (half an ulp at 1)

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Equal bits, or both NaN (a NaN's payload may differ between variants: which operand's NaN
// an instruction propagates depends on operand order, which the compiler chooses).
bool SameFloat(float a, float b) { return (std::isnan(a) && std::isnan(b)) || Bits(a) == Bits(b); }

bool IsNan16(uint16_t h, ParamCopyType type) {
  return type == ParamCopyType::kBf16 ? (h & 0x7fffu) > 0x7f80u : (h & 0x7fffu) > 0x7c00u;
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {  // splitmix64
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1).
  double Unit() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }
  float Uniform(float lo, float hi) { return static_cast<float>(lo + (hi - lo) * Unit()); }
  // Magnitude log-uniform in [2^lo_exp, 2^hi_exp), random sign when `sign`.
  float LogUniform(int lo_exp, int hi_exp, bool sign) {
    const uint64_t r = Next();
    const int e = lo_exp + static_cast<int>((r >> 32) % static_cast<uint64_t>(hi_exp - lo_exp));
    const uint32_t bits = (static_cast<uint32_t>(e + 127) << 23) | (static_cast<uint32_t>(r) >> 9);
    const float v = FromBits(bits);
    return sign && (r & (1ull << 31)) ? -v : v;
  }

 private:
  uint64_t state_;
};

struct Problem {
  OptimizerHyperParams hp;
  GradType grad_type = GradType::kF32;
  size_t n = 0;
  std::vector<float> param, state1, state2;
  std::vector<float> grad32;      // kF32 gradients
  std::vector<uint16_t> grad16;   // kBf16 / kF16 gradients
  std::vector<float> grad_value;  // the gradients as fp32 values (exact conversions)

  const void* grad() const {
    return grad_type == GradType::kF32 ? static_cast<const void*>(grad32.data())
                                       : static_cast<const void*>(grad16.data());
  }
};

OptimizerHyperParams HyperParamsFor(OptimizerKind kind, int64_t step, bool weight_decay) {
  OptimizerHyperParams hp;
  hp.kind = kind;
  hp.step = step;
  hp.weight_decay = weight_decay ? 0.01f : 0.0f;
  // An inexact scale on half of the cases, so the scaling multiply really rounds.
  hp.grad_scale = step == 1 ? 1.0f : 0.3f;
  switch (kind) {
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW:
      hp.lr = 1e-3f;
      break;
    case OptimizerKind::kAdagrad:
      hp.lr = 1e-2f;
      hp.eps = 1e-10f;
      hp.lr_decay = 1e-3f;
      break;
    case OptimizerKind::kLion:
      hp.lr = 1e-4f;
      hp.beta2 = 0.99f;
      break;
  }
  return hp;
}

uint16_t EncodeGrad(float g, GradType type) {
  return type == GradType::kBf16 ? Fp32ToBf16(g) : Fp32ToFp16(g);
}

// Random values over many binades, plus (when n >= 17) NaN, +-inf, signalling NaN, zero and
// subnormal gradients, and a parameter beyond fp16's range, at fixed places including the
// vector tail.
//
// Fills `pr` in place: the test reuses its buffers, because touching fresh pages (about 12 us
// per 4 KiB page on this VM) would cost more than the arithmetic.
void FillProblem(OptimizerKind kind, GradType grad_type, size_t n, int64_t step, bool weight_decay,
                 uint64_t seed, Problem& pr) {
  pr.hp = HyperParamsFor(kind, step, weight_decay);
  pr.grad_type = grad_type;
  pr.n = n;
  Rng rng(seed);
  pr.param.resize(n);
  pr.state1.resize(n);
  pr.state2.resize(n);
  pr.grad_value.resize(n);
  std::vector<float>& g = pr.grad32;
  g.resize(n);
  for (size_t i = 0; i < n; ++i) {
    pr.param[i] = rng.Uniform(-1.0f, 1.0f);
    g[i] = rng.LogUniform(-20, 0, true);
    switch (kind) {
      case OptimizerKind::kAdam:
      case OptimizerKind::kAdamW:
        pr.state1[i] = rng.LogUniform(-20, -3, true);
        pr.state2[i] = rng.LogUniform(-34, -6, false);
        break;
      case OptimizerKind::kAdagrad:
        pr.state1[i] = rng.LogUniform(-20, 0, false);
        break;
      case OptimizerKind::kLion:
        pr.state1[i] = rng.LogUniform(-14, -3, true);
        break;
    }
  }
  if (n >= 17) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const float inf = std::numeric_limits<float>::infinity();
    g[2] = nan;
    g[5] = inf;
    g[11] = -inf;
    g[7] = 0.0f;
    g[8] = grad_type == GradType::kF16 ? 3e-6f : 1e-40f;  // subnormal in the gradient's type
    g[n - 1] = nan;           // in the vector tail when n is not a multiple of the width
    pr.param[10] = 70000.0f;  // beyond fp16: its copy becomes inf
  }
  if (grad_type == GradType::kF32) {
    if (n >= 17) pr.grad32[13] = FromBits(0x7f800001u);  // signalling NaN
    pr.grad_value.assign(pr.grad32.begin(), pr.grad32.end());
  } else {
    pr.grad16.resize(n);
    for (size_t i = 0; i < n; ++i) pr.grad16[i] = EncodeGrad(g[i], grad_type);
    if (n >= 17) pr.grad16[13] = grad_type == GradType::kBf16 ? 0x7f81u : 0x7c01u;  // sNaN
    for (size_t i = 0; i < n; ++i) {
      pr.grad_value[i] =
          grad_type == GradType::kBf16 ? Bf16ToFp32(pr.grad16[i]) : Fp16ToFp32(pr.grad16[i]);
    }
  }
}

Problem MakeProblem(OptimizerKind kind, GradType grad_type, size_t n, int64_t step,
                    bool weight_decay, uint64_t seed) {
  Problem pr;
  FillProblem(kind, grad_type, n, step, weight_decay, seed, pr);
  return pr;
}

// The updated buffers. The parameter copy sits at a chosen alignment inside `copy_storage`:
// 64-byte aligned, SIMD variants write it with streaming stores; one element off, they take
// the ordinary-store path. Tests run both.
struct Outputs {
  std::vector<float> param, state1, state2;
  std::vector<uint16_t> copy_storage;
  size_t copy_offset = 0;
  uint16_t* copy() { return copy_storage.data() + copy_offset; }
  uint16_t copy_at(size_t i) const { return copy_storage[copy_offset + i]; }

  void Reset(const Problem& pr, bool aligned_copy);
};

void Outputs::Reset(const Problem& pr, bool aligned_copy) {
  param.assign(pr.param.begin(), pr.param.end());
  state1.assign(pr.state1.begin(), pr.state1.end());
  state2.assign(pr.state2.begin(), pr.state2.end());
  copy_storage.assign(pr.n + 64, 0xdeadu);
  const auto addr = reinterpret_cast<uintptr_t>(copy_storage.data());
  copy_offset = ((64 - addr % 64) % 64) / sizeof(uint16_t) + (aligned_copy ? 0 : 1);
}

OptimizerTensors TensorsFor(const Problem& pr, Outputs& out, ParamCopyType copy_type) {
  OptimizerTensors t;
  t.param = out.param.data();
  t.grad = pr.grad();
  t.grad_type = pr.grad_type;
  if (pr.hp.kind == OptimizerKind::kAdagrad) {
    t.sum = out.state1.data();
  } else {
    t.exp_avg = out.state1.data();
  }
  if (pr.hp.kind == OptimizerKind::kAdam || pr.hp.kind == OptimizerKind::kAdamW) {
    t.exp_avg_sq = out.state2.data();
  }
  t.param_copy = copy_type == ParamCopyType::kNone ? nullptr : out.copy();
  t.param_copy_type = copy_type;
  t.n = pr.n;
  return t;
}

// Runs one kernel variant directly (single-threaded, whole range) into `out` (reused).
void RunVariant(const Problem& pr, KernelVariant variant, ParamCopyType copy_type, Outputs& out,
                bool aligned_copy = true) {
  out.Reset(pr, aligned_copy);
  const OptimizerTensors t = TensorsFor(pr, out, copy_type);
  EXPECT_TRUE(ValidateOptimizerStep(pr.hp, t).ok());
  if (pr.n == 0) return;
  const KernelTable& table = KernelsFor(variant);
  cpu_adam_internal::SelectStepKernel(table, pr.hp, t)(
      cpu_adam_internal::ComputeCoefficients(pr.hp), cpu_adam_internal::BuffersOf(pr.hp, t), 0,
      pr.n);
}

// The optimizer math in double from the same fp32 inputs, and a bound on how far an fp32
// evaluation may be from it.
//
// Why these bounds: each fp32 operation (mul, sub, fma, sqrt, div, and the rounding of each
// coefficient from double) adds a relative error of at most u = 2^-24 to its result. A
// moment m' = b1*m + (1-b1)*g goes through at most 4 roundings, each bounded by
// u*(|m| + |g|), so |err m'| <= 4u(|m| + |g|); v' = b2*v + (1-b2)*g^2 has only positive terms,
// and g's own error (<= 2u) doubles in g^2, so |err v'| <= 8u*v'. sqrt halves a relative error
// and eps > 0 adds no cancellation, so the denominator is within ~6u relative. The update
// m'/d then errs by err(m')/d + 8u|m'/d|, and the new parameter by that times lr/bc1 plus the
// roundings of the decay multiply and of the final fma (u each, on |p| and |p'|). Each bound
// below is twice that sum, to stay clear of second-order terms, and is still a few ulp: an
// algebra error (a wrong sign, a missing bias correction) is off by orders of magnitude more.
struct RefValue {
  double value = 0.0;
  double tol = 0.0;
};
struct RefOutputs {
  RefValue param, state1, state2;
  bool state2_used = false;
};

struct RefConstants {
  explicit RefConstants(const OptimizerHyperParams& hp)
      : bc1(1.0 - std::pow(static_cast<double>(hp.beta1), static_cast<double>(hp.step))),
        bc2(1.0 - std::pow(static_cast<double>(hp.beta2), static_cast<double>(hp.step))) {}
  double bc1, bc2;
};

RefOutputs Reference(const OptimizerHyperParams& hp, const RefConstants& rc, float p_in, float g_in,
                     float s1_in, float s2_in) {
  const double u = kU;
  const double lr = hp.lr, b1 = hp.beta1, b2 = hp.beta2, eps = hp.eps, wd = hp.weight_decay;
  const double step = static_cast<double>(hp.step);
  double p = p_in;
  double g = static_cast<double>(g_in) * hp.grad_scale;
  // The effective gradient g*scale (+ wd*p) is formed with two roundings, each relative to
  // its operands, which may cancel: its absolute error is bounded by 2u(|g*scale| + |wd*p|).
  double g_mag = std::fabs(g);
  const double s1 = s1_in, s2 = s2_in;
  RefOutputs r;
  switch (hp.kind) {
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW: {
      if (wd != 0 && hp.kind == OptimizerKind::kAdam) {
        g += wd * p;
        g_mag += std::fabs(wd * p);
      }
      if (wd != 0 && hp.kind == OptimizerKind::kAdamW) p *= 1.0 - lr * wd;
      const double tol_g = 2 * u * g_mag;
      const double m = b1 * s1 + (1.0 - b1) * g;
      const double v = b2 * s2 + (1.0 - b2) * g * g;
      const double denom = std::sqrt(v) / std::sqrt(rc.bc2) + eps;
      const double upd = m / denom;
      const double tol_m = 8 * u * (std::fabs(s1) + g_mag);
      const double tol_upd = tol_m / denom + 16 * u * std::fabs(upd);
      r.param.value = p - lr / rc.bc1 * upd;
      r.param.tol = 4 * u * (std::fabs(r.param.value) + std::fabs(p)) +
                    lr / rc.bc1 * (tol_upd + 2 * u * std::fabs(upd));
      r.state1 = {m, tol_m};
      r.state2 = {v, 16 * u * v + 4 * (1.0 - b2) * std::fabs(g) * tol_g};
      r.state2_used = true;
      break;
    }
    case OptimizerKind::kAdagrad: {
      if (wd != 0) {
        g += wd * p;
        g_mag += std::fabs(wd * p);
      }
      const double tol_g = 2 * u * g_mag;
      const double sum = s1 + g * g;
      const double clr = lr / (1.0 + (step - 1.0) * hp.lr_decay);
      const double denom = std::sqrt(sum) + eps;
      const double upd = g / denom;
      const double tol_upd = 2 * tol_g / denom + 16 * u * std::fabs(upd);
      r.param.value = p - clr * upd;
      r.param.tol = 4 * u * (std::fabs(r.param.value) + std::fabs(p)) +
                    clr * (tol_upd + 2 * u * std::fabs(upd));
      r.state1 = {sum, 16 * u * sum + 4 * std::fabs(g) * tol_g};
      break;
    }
    case OptimizerKind::kLion: {
      if (wd != 0) p *= 1.0 - lr * wd;
      const double c = b1 * s1 + (1.0 - b1) * g;
      const double tol_c = 8 * u * (std::fabs(s1) + g_mag);
      const double sign = c > 0 ? 1.0 : (c < 0 ? -1.0 : (std::isnan(c) ? c : 0.0));
      if (std::fabs(c) <= tol_c) {
        // fp32 may round c to the other sign or to zero: any of p - lr, p, p + lr is right.
        r.param.value = p;
        r.param.tol = lr * (1 + 4 * u) + 4 * u * std::fabs(p);
      } else {
        r.param.value = p - lr * sign;
        r.param.tol = 4 * u * (std::fabs(r.param.value) + std::fabs(p)) + 2 * u * lr;
      }
      const double m = b2 * s1 + (1.0 - b2) * g;
      r.state1 = {m, 8 * u * (std::fabs(s1) + g_mag)};
      break;
    }
  }
  return r;
}

// NaN where the reference is NaN, the same infinity where it is infinite, else within tol.
bool Near(float got, const RefValue& ref) {
  if (std::isnan(ref.value)) return std::isnan(got);
  if (std::isinf(ref.value)) return static_cast<double>(got) == ref.value;
  return std::isfinite(got) && std::fabs(got - ref.value) <= ref.tol;
}

using KernelParam = std::tuple<KernelVariant, OptimizerKind, GradType, ParamCopyType>;

class KernelTest : public ::testing::TestWithParam<KernelParam> {
 protected:
  void SetUp() override {
    if (!KernelVariantSupported(std::get<0>(GetParam()), DetectCpuFeatures())) {
      GTEST_SKIP() << "this CPU cannot run the " << KernelVariantName(std::get<0>(GetParam()))
                   << " kernels";
    }
  }
};

TEST_P(KernelTest, BitIdenticalToScalarAndCloseToDoubleReference) {
  const auto [variant, kind, grad_type, copy_type] = GetParam();
  const bool has_state2 = kind == OptimizerKind::kAdam || kind == OptimizerKind::kAdamW;
  static Problem pr;  // reused: see FillProblem
  static Outputs ref, got_buf, unaligned_buf;
  for (size_t n : {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{17}, size_t{1000003}}) {
    for (int64_t step : {int64_t{1}, int64_t{10000}}) {
      for (bool wd : {false, true}) {
        SCOPED_TRACE("n=" + std::to_string(n) + " step=" + std::to_string(step) +
                     " weight_decay=" + (wd ? "on" : "off"));
        FillProblem(kind, grad_type, n, step, wd, n * 31 + step * 7 + wd, pr);
        RunVariant(pr, KernelVariant::kScalar, copy_type, ref);
        if (variant != KernelVariant::kScalar) RunVariant(pr, variant, copy_type, got_buf);
        const Outputs& got = variant == KernelVariant::kScalar ? ref : got_buf;
        if (copy_type != ParamCopyType::kNone && variant != KernelVariant::kScalar) {
          // The same step with the copy one element off alignment (ordinary stores).
          RunVariant(pr, variant, copy_type, unaligned_buf, /*aligned_copy=*/false);
          bool same_copy = true;
          for (size_t i = 0; i < n; ++i) same_copy &= unaligned_buf.copy_at(i) == got.copy_at(i);
          EXPECT_TRUE(same_copy) << "streaming and ordinary stores wrote different copies";
        }
        const RefConstants rc(pr.hp);
        int failures = 0;
        for (size_t i = 0; i < n && failures < 5; ++i) {
          // Bit-identical to the scalar reference.
          bool same = SameFloat(got.param[i], ref.param[i]) &&
                      SameFloat(got.state1[i], ref.state1[i]) &&
                      (!has_state2 || SameFloat(got.state2[i], ref.state2[i]));
          if (copy_type != ParamCopyType::kNone) {
            const uint16_t expected = copy_type == ParamCopyType::kBf16 ? Fp32ToBf16(got.param[i])
                                                                        : Fp32ToFp16(got.param[i]);
            same = same && (got.copy_at(i) == expected ||
                            (IsNan16(got.copy_at(i), copy_type) && IsNan16(expected, copy_type)));
          }
          if (!same) {
            ++failures;
            ADD_FAILURE() << "element " << i << " differs from the scalar reference: param "
                          << got.param[i] << " vs " << ref.param[i] << ", state1 " << got.state1[i]
                          << " vs " << ref.state1[i] << ", state2 " << got.state2[i] << " vs "
                          << ref.state2[i] << ", copy 0x" << std::hex << got.copy_at(i) << std::dec;
          }
          // Close to the math.
          const RefOutputs r =
              Reference(pr.hp, rc, pr.param[i], pr.grad_value[i], pr.state1[i], pr.state2[i]);
          auto check = [&](const char* what, float value, const RefValue& want) {
            if (Near(value, want)) return;
            ++failures;
            ADD_FAILURE() << what << "[" << i << "] = " << value << " but the double reference is "
                          << want.value << " +- " << want.tol;
          };
          check("param", got.param[i], r.param);
          check("state1", got.state1[i], r.state1);
          if (has_state2) check("state2", got.state2[i], r.state2);
        }
        // NaN and inf gradients propagate as the reference says (spot checks of the rule
        // above on the planted values).
        if (n >= 17) {
          EXPECT_TRUE(std::isnan(got.param[2])) << "a NaN gradient must give a NaN parameter";
          EXPECT_TRUE(std::isnan(got.param[n - 1])) << "NaN in the tail";
          EXPECT_TRUE(std::isnan(got.param[13])) << "a signalling-NaN gradient";
          if (kind == OptimizerKind::kLion) {
            EXPECT_TRUE(std::isfinite(got.param[5])) << "Lion's sign() bounds an inf gradient";
            EXPECT_TRUE(std::isinf(got.state1[5]));
          } else {
            EXPECT_TRUE(std::isnan(got.param[5])) << "inf / inf in the update is NaN";
          }
          if (copy_type == ParamCopyType::kF16) {
            EXPECT_EQ(got.copy_at(10), 0x7c00u) << "a parameter beyond fp16's range copies as inf";
          }
        }
      }
    }
  }
}

std::string KernelParamName(const ::testing::TestParamInfo<KernelParam>& info) {
  const auto [variant, kind, grad_type, copy_type] = info.param;
  return std::string(KernelVariantName(variant)) + "_" + OptimizerKindName(kind) + "_grad_" +
         GradTypeName(grad_type) + "_copy_" + ParamCopyTypeName(copy_type);
}

INSTANTIATE_TEST_SUITE_P(
    AllVariants, KernelTest,
    ::testing::Combine(::testing::Values(KernelVariant::kScalar, KernelVariant::kAvx2,
                                         KernelVariant::kAvx512, KernelVariant::kAvx512Bf16),
                       ::testing::Values(OptimizerKind::kAdam, OptimizerKind::kAdamW,
                                         OptimizerKind::kAdagrad, OptimizerKind::kLion),
                       ::testing::Values(GradType::kF32, GradType::kBf16, GradType::kF16),
                       ::testing::Values(ParamCopyType::kNone, ParamCopyType::kBf16,
                                         ParamCopyType::kF16)),
    KernelParamName);

// ---- Known values (independent of the reference above) ----

TEST(AdamSemanticsTest, FirstStepMatchesTorchByHand) {
  // torch.optim.Adam(lr=0.1), one step from zero states with grad 0.5 on param 1.0:
  // m = 0.05, v = 0.00025, bc1 = 0.1, bc2 = 0.001, denom = 0.5 + 1e-8,
  // param = 1 - (0.1 / 0.1) * 0.05 / (0.5 + 1e-8) = 0.9 (+2e-9).
  float p = 1.0f, g = 0.5f, m = 0.0f, v = 0.0f;
  OptimizerHyperParams hp;
  hp.kind = OptimizerKind::kAdam;
  hp.lr = 0.1f;
  OptimizerTensors t;
  t.param = &p;
  t.grad = &g;
  t.exp_avg = &m;
  t.exp_avg_sq = &v;
  t.n = 1;
  ASSERT_TRUE(OptimizerStep(hp, t, CpuIsa::kScalar).ok());
  // Tolerances: beta1 = 0.9f and beta2 = 0.999f are not 0.9 and 0.999, so 1 - beta is off by
  // about 2e-7 relative (m) and 1.3e-5 relative (v) from torch's double-valued betas.
  EXPECT_NEAR(p, 0.9f, 1e-6f);
  EXPECT_NEAR(m, 0.05f, 0.05f * 1e-6f);
  EXPECT_NEAR(v, 0.00025f, 0.00025f * 2e-5f);
}

TEST(AdamSemanticsTest, AdamAddsDecayToGradientAdamWDecaysParameter) {
  // With a zero gradient, Adam's L2 term becomes the gradient (a step of about lr at step 1);
  // AdamW multiplies the parameter by 1 - lr * wd and the moment stays 0.
  float p_adam = 2.0f, p_adamw = 2.0f, g = 0.0f;
  float m1 = 0, v1 = 0, m2 = 0, v2 = 0;
  OptimizerHyperParams hp;
  hp.lr = 0.01f;
  hp.weight_decay = 0.5f;
  OptimizerTensors t;
  t.grad = &g;
  t.n = 1;
  hp.kind = OptimizerKind::kAdam;
  t.param = &p_adam;
  t.exp_avg = &m1;
  t.exp_avg_sq = &v1;
  ASSERT_TRUE(OptimizerStep(hp, t, BestCpuIsa()).ok());
  EXPECT_NEAR(p_adam, 2.0f - 0.01f, 1e-6f);
  EXPECT_NEAR(m1, 0.1f * 0.5f * 2.0f, 1e-7f);
  hp.kind = OptimizerKind::kAdamW;
  t.param = &p_adamw;
  t.exp_avg = &m2;
  t.exp_avg_sq = &v2;
  ASSERT_TRUE(OptimizerStep(hp, t, BestCpuIsa()).ok());
  EXPECT_FLOAT_EQ(p_adamw, 2.0f * (1.0f - 0.01f * 0.5f));
  EXPECT_EQ(m2, 0.0f);
}

TEST(AdamSemanticsTest, LionMovesByLrTimesSign) {
  float p[3] = {1.0f, 1.0f, 1.0f}, g[3] = {0.3f, -2.0f, 0.0f}, m[3] = {0, 0, 0};
  OptimizerHyperParams hp;
  hp.kind = OptimizerKind::kLion;
  hp.lr = 0.125f;
  hp.beta2 = 0.99f;
  OptimizerTensors t;
  t.param = p;
  t.grad = g;
  t.exp_avg = m;
  t.n = 3;
  ASSERT_TRUE(OptimizerStep(hp, t, BestCpuIsa()).ok());
  EXPECT_EQ(p[0], 0.875f);
  EXPECT_EQ(p[1], 1.125f);
  EXPECT_EQ(p[2], 1.0f);
  EXPECT_NEAR(m[1], -2.0f * 0.01f, 1e-7f);
}

TEST(AdamSemanticsTest, AdagradFirstStep) {
  // sum = 0.1 + 0.25; param -= lr * g / (sqrt(sum) + eps)
  float p = 1.0f, g = 0.5f, s = 0.1f;
  OptimizerHyperParams hp;
  hp.kind = OptimizerKind::kAdagrad;
  hp.lr = 0.1f;
  hp.eps = 1e-10f;
  OptimizerTensors t;
  t.param = &p;
  t.grad = &g;
  t.sum = &s;
  t.n = 1;
  ASSERT_TRUE(OptimizerStep(hp, t, BestCpuIsa()).ok());
  EXPECT_NEAR(s, 0.35f, 1e-7f);
  EXPECT_NEAR(p, 1.0f - 0.1f * 0.5f / std::sqrt(0.35f), 1e-6f);
}

// ---- Conversions ----

TEST(ConversionTest, KnownValues) {
  EXPECT_EQ(Fp32ToBf16(1.0f), 0x3f80u);
  EXPECT_EQ(Fp32ToBf16(FromBits(0x3f808000u)), 0x3f80u);  // tie -> even (down)
  EXPECT_EQ(Fp32ToBf16(FromBits(0x3f818000u)), 0x3f82u);  // tie -> even (up)
  EXPECT_EQ(Fp32ToBf16(FromBits(0x3f808001u)), 0x3f81u);  // above the tie
  EXPECT_EQ(Fp32ToBf16(FromBits(0x7f7fffffu)), 0x7f80u);  // max float rounds to inf
  EXPECT_EQ(Fp32ToBf16(FromBits(0x00400000u)), 0x0000u);  // subnormal flushed
  EXPECT_EQ(Fp32ToBf16(FromBits(0x80400000u)), 0x8000u);  // keeping its sign
  EXPECT_EQ(Fp32ToBf16(FromBits(0x7f800001u)), 0x7fc0u);  // sNaN -> qNaN
  EXPECT_EQ(Fp32ToBf16(-std::numeric_limits<float>::infinity()), 0xff80u);
  EXPECT_EQ(Bf16ToFp32(0x3f80u), 1.0f);
  EXPECT_EQ(Fp32ToFp16(1.0f), 0x3c00u);
  EXPECT_EQ(Fp32ToFp16(65504.0f), 0x7bffu);
  EXPECT_EQ(Fp32ToFp16(65519.0f), 0x7bffu);
  EXPECT_EQ(Fp32ToFp16(65520.0f), 0x7c00u);               // tie between 65504 and 2^16 -> inf
  EXPECT_EQ(Fp32ToFp16(std::ldexp(1.0f, -24)), 0x0001u);  // smallest subnormal
  EXPECT_EQ(Fp32ToFp16(std::ldexp(1.0f, -25)), 0x0000u);  // tie -> even (zero)
  EXPECT_EQ(Fp32ToFp16(std::ldexp(1.5f, -25)), 0x0001u);
  EXPECT_EQ(Fp32ToFp16(std::ldexp(1.0f, -14)), 0x0400u);  // smallest normal
  EXPECT_EQ(Fp32ToFp16(-0.0f), 0x8000u);
  EXPECT_EQ(Fp16ToFp32(0x0001u), std::ldexp(1.0f, -24));
  EXPECT_EQ(Fp16ToFp32(0xfc00u), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(Fp16ToFp32(0x7c01u)));
  for (uint32_t h = 0; h < 0x10000u; ++h) {  // fp16 -> fp32 -> fp16 is the identity
    const uint16_t x = static_cast<uint16_t>(h);
    if (IsNan16(x, ParamCopyType::kF16)) continue;
    ASSERT_EQ(Fp32ToFp16(Fp16ToFp32(x)), x) << std::hex << h;
  }
}

class ConvertVariantTest : public ::testing::TestWithParam<KernelVariant> {
 protected:
  void SetUp() override {
    if (!KernelVariantSupported(GetParam(), DetectCpuFeatures())) {
      GTEST_SKIP() << "this CPU cannot run the " << KernelVariantName(GetParam()) << " kernels";
    }
  }
};

// Every variant's fp32 -> bf16 / fp16 store against the scalar conversion, over every
// combination of sign, exponent and the mantissa bits next to the rounding point (ties, just
// above and below), subnormals, infinities and NaNs. On avx512_bf16 machines this checks the
// scalar reference against the VCVTNEPS2BF16 instruction itself.
TEST_P(ConvertVariantTest, MatchesScalarConversionOnEveryRoundingCase) {
  std::vector<float> src;
  for (uint32_t hi = 0; hi < 0x10000u; ++hi) {  // bf16: rounding point at bit 16
    for (uint32_t lo : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      src.push_back(FromBits(hi << 16 | lo));
    }
  }
  for (uint32_t hi = 0; hi < 0x80000u; ++hi) {  // fp16: rounding point at bit 13
    for (uint32_t lo : {0x0000u, 0x0fffu, 0x1000u, 0x1001u}) src.push_back(FromBits(hi << 13 | lo));
  }
  const KernelTable& table = KernelsFor(GetParam());
  std::vector<uint16_t> storage(src.size() + 64);
  const size_t aligned = ((64 - reinterpret_cast<uintptr_t>(storage.data()) % 64) % 64) / 2;
  for (auto [type, offset] :
       {std::pair{ParamCopyType::kBf16, aligned},  // streaming stores
        std::pair{ParamCopyType::kBf16, aligned + 1}, std::pair{ParamCopyType::kF16, aligned},
        std::pair{ParamCopyType::kF16, aligned + 1}}) {
    uint16_t* got = storage.data() + offset;
    table.convert[static_cast<int>(type)](src.data(), got, 0, src.size());
    int failures = 0;
    for (size_t i = 0; i < src.size() && failures < 10; ++i) {
      const uint16_t want = type == ParamCopyType::kBf16 ? Fp32ToBf16(src[i]) : Fp32ToFp16(src[i]);
      if (got[i] != want) {
        ++failures;
        ADD_FAILURE() << ParamCopyTypeName(type) << " of 0x" << std::hex << Bits(src[i])
                      << ": got 0x" << got[i] << ", scalar 0x" << want;
      }
    }
  }
  // The loads: every 16-bit pattern as a gradient through a Lion step with beta2 = 0, whose
  // new exp_avg is exactly the loaded gradient.
  std::vector<uint16_t> all(0x10000);
  for (uint32_t h = 0; h < 0x10000u; ++h) all[h] = static_cast<uint16_t>(h);
  for (GradType type : {GradType::kBf16, GradType::kF16}) {
    OptimizerHyperParams hp;
    hp.kind = OptimizerKind::kLion;  // exp_avg = beta2 * 0 + (1 - beta2) * g: g scaled exactly
    hp.beta2 = 0.0f;
    hp.lr = 0.0f;
    std::vector<float> p(all.size(), 0.0f), m_ref(all.size(), 0.0f), m_got(all.size(), 0.0f);
    OptimizerTensors t;
    t.param = p.data();
    t.grad = all.data();
    t.grad_type = type;
    t.exp_avg = m_got.data();
    t.n = all.size();
    const auto c = cpu_adam_internal::ComputeCoefficients(hp);
    cpu_adam_internal::SelectStepKernel(table, hp, t)(c, cpu_adam_internal::BuffersOf(hp, t), 0,
                                                      t.n);
    for (size_t i = 0; i < all.size(); ++i) {
      const float want = type == GradType::kBf16 ? Bf16ToFp32(all[i]) : Fp16ToFp32(all[i]);
      // (fma(0, 0, -0) is +0, so a negative zero comes out positive: compare zeros by value.)
      ASSERT_TRUE(SameFloat(m_got[i], want) || (want == 0.0f && m_got[i] == 0.0f))
          << GradTypeName(type) << " 0x" << std::hex << i << " loaded as 0x" << Bits(m_got[i]);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllVariants, ConvertVariantTest,
                         ::testing::Values(KernelVariant::kScalar, KernelVariant::kAvx2,
                                           KernelVariant::kAvx512, KernelVariant::kAvx512Bf16),
                         [](const ::testing::TestParamInfo<KernelVariant>& info) {
                           return std::string(KernelVariantName(info.param));
                         });

// ---- Dispatch ----

// Restores ZINF_CPU_ISA when a test that changes it ends.
class ScopedIsaEnv {
 public:
  explicit ScopedIsaEnv(const char* value) {
    const char* old = std::getenv("ZINF_CPU_ISA");
    had_ = old != nullptr;
    if (had_) old_ = old;
    if (value) {
      setenv("ZINF_CPU_ISA", value, 1);
    } else {
      unsetenv("ZINF_CPU_ISA");
    }
  }
  ~ScopedIsaEnv() {
    if (had_) {
      setenv("ZINF_CPU_ISA", old_.c_str(), 1);
    } else {
      unsetenv("ZINF_CPU_ISA");
    }
  }

 private:
  bool had_ = false;
  std::string old_;
};

TEST(DispatchTest, PicksAvx512WhereTheCpuHasIt) {
  // libgcc's own detection (which also checks the OS-enabled register state) as the oracle.
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f")) {
    GTEST_SKIP() << "this CPU has no AVX-512F; dispatch cannot pick it";
  }
  ScopedIsaEnv env(nullptr);
  EXPECT_TRUE(DetectCpuFeatures().avx512f);
  EXPECT_TRUE(DetectCpuFeatures().os_avx512);
  EXPECT_EQ(BestCpuIsa(), CpuIsa::kAvx512);
  Result<CpuIsa> isa = SelectCpuIsa();
  ASSERT_TRUE(isa.ok()) << isa.status().ToString();
  EXPECT_EQ(*isa, CpuIsa::kAvx512);
  auto opt = CpuOptimizer::Create();
  ASSERT_TRUE(opt.ok()) << opt.status().ToString();
  EXPECT_EQ((*opt)->isa(), CpuIsa::kAvx512);
  if (__builtin_cpu_supports("avx512bf16")) {
    EXPECT_TRUE(DetectCpuFeatures().avx512_bf16);
    EXPECT_STREQ((*opt)->kernel_name(), "avx512_bf16");
  } else {
    EXPECT_STREQ((*opt)->kernel_name(), "avx512");
  }
}

TEST(DispatchTest, FeatureFlagsAgreeWithLibgcc) {
  __builtin_cpu_init();
  const CpuFeatures& f = DetectCpuFeatures();
  EXPECT_EQ(f.avx2 && f.os_avx, static_cast<bool>(__builtin_cpu_supports("avx2")));
  EXPECT_EQ(f.fma && f.os_avx, static_cast<bool>(__builtin_cpu_supports("fma")));
  EXPECT_EQ(f.avx512f && f.os_avx512, static_cast<bool>(__builtin_cpu_supports("avx512f")));
  EXPECT_EQ(f.avx512bw && f.os_avx512, static_cast<bool>(__builtin_cpu_supports("avx512bw")));
}

TEST(DispatchTest, EnvironmentForcesAnIsa) {
  {
    ScopedIsaEnv env("scalar");
    Result<CpuIsa> isa = SelectCpuIsa();
    ASSERT_TRUE(isa.ok());
    EXPECT_EQ(*isa, CpuIsa::kScalar);
    auto opt = CpuOptimizer::Create();
    ASSERT_TRUE(opt.ok());
    EXPECT_STREQ((*opt)->kernel_name(), "scalar");
  }
  if (CpuIsaSupported(CpuIsa::kAvx2)) {
    ScopedIsaEnv env("avx2");
    Result<CpuIsa> isa = SelectCpuIsa();
    ASSERT_TRUE(isa.ok());
    EXPECT_EQ(*isa, CpuIsa::kAvx2);
  }
  {
    ScopedIsaEnv env("auto");
    EXPECT_EQ(SelectCpuIsa().value(), BestCpuIsa());
  }
  {
    ScopedIsaEnv env("avx1024");
    Result<CpuIsa> isa = SelectCpuIsa();
    ASSERT_FALSE(isa.ok());
    EXPECT_EQ(isa.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(isa.status().message().find("ZINF_CPU_ISA=avx1024"), std::string::npos)
        << isa.status().message();
    auto opt = CpuOptimizer::Create();
    ASSERT_FALSE(opt.ok());
    EXPECT_EQ(opt.status().code(), StatusCode::kInvalidArgument);
  }
  {
    // An explicit request wins over the environment.
    ScopedIsaEnv env("avx1024");
    Result<CpuIsa> isa = SelectCpuIsa(CpuIsa::kScalar);
    ASSERT_TRUE(isa.ok());
    EXPECT_EQ(*isa, CpuIsa::kScalar);
  }
}

TEST(DispatchTest, ForcingAnUnsupportedIsaIsAClearError) {
  CpuFeatures old_cpu;  // nothing beyond x86-64
  Result<CpuIsa> isa = cpu_adam_internal::SelectCpuIsaFrom(std::nullopt, "avx512", old_cpu);
  ASSERT_FALSE(isa.ok());
  EXPECT_EQ(isa.status().code(), StatusCode::kNotSupported);
  const std::string& msg = isa.status().message();
  EXPECT_NE(msg.find("ZINF_CPU_ISA=avx512"), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing: avx512f"), std::string::npos) << msg;
  EXPECT_NE(msg.find("the best it supports is scalar"), std::string::npos) << msg;

  CpuFeatures no_os_state;  // the CPU has AVX-512 but the OS does not save ZMM registers
  no_os_state.avx = no_os_state.avx2 = no_os_state.fma = no_os_state.f16c = true;
  no_os_state.os_avx = true;
  no_os_state.avx512f = true;
  isa = cpu_adam_internal::SelectCpuIsaFrom(CpuIsa::kAvx512, nullptr, no_os_state);
  ASSERT_FALSE(isa.ok());
  EXPECT_NE(isa.status().message().find("OS support for AVX-512"), std::string::npos);
  EXPECT_EQ(cpu_adam_internal::SelectCpuIsaFrom(std::nullopt, nullptr, no_os_state).value(),
            CpuIsa::kAvx2);
  EXPECT_EQ(cpu_adam_internal::SelectCpuIsaFrom(std::nullopt, nullptr, old_cpu).value(),
            CpuIsa::kScalar);

  // And on the real machine: forcing what the CPU lacks fails cleanly, without a crash.
  for (CpuIsa wanted : {CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (CpuIsaSupported(wanted)) continue;
    ScopedIsaEnv env(CpuIsaName(wanted));
    auto opt = CpuOptimizer::Create();
    ASSERT_FALSE(opt.ok());
    EXPECT_EQ(opt.status().code(), StatusCode::kNotSupported);
  }
}

// ---- The parallel driver ----

int CpusAvailable() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return CPU_COUNT(&set);
}

Outputs RunDriver(CpuOptimizer& opt, const Problem& pr, ParamCopyType copy_type) {
  Outputs out;
  out.Reset(pr, /*aligned_copy=*/true);
  const Status s = opt.Step(pr.hp, TensorsFor(pr, out, copy_type));
  EXPECT_TRUE(s.ok()) << s.ToString();
  return out;
}

bool SameOutputs(const Outputs& a, const Outputs& b) {
  if (a.param.size() != b.param.size()) return false;
  for (size_t i = 0; i < a.param.size(); ++i) {
    if (!SameFloat(a.param[i], b.param[i]) || !SameFloat(a.state1[i], b.state1[i]) ||
        !SameFloat(a.state2[i], b.state2[i])) {
      return false;
    }
  }
  for (size_t i = 0; i < a.param.size(); ++i) {
    if (a.copy_at(i) != b.copy_at(i)) return false;
  }
  return true;
}

TEST(DriverTest, ThreadCountsGiveBitIdenticalResults) {
  const Problem pr = MakeProblem(OptimizerKind::kAdamW, GradType::kBf16, 1000003, 10, true, 42);
  Outputs serial;
  serial.Reset(pr, /*aligned_copy=*/true);
  ASSERT_TRUE(
      OptimizerStep(pr.hp, TensorsFor(pr, serial, ParamCopyType::kBf16), BestCpuIsa()).ok());
  for (int threads : {1, 2, 3}) {
    for (size_t tile : {size_t{64}, size_t{4096}, size_t{1} << 16}) {
      CpuOptimizer::Options o;
      o.num_threads = threads;
      o.tile_elements = tile;
      auto opt = CpuOptimizer::Create(o);
      ASSERT_TRUE(opt.ok()) << opt.status().ToString();
      EXPECT_EQ((*opt)->num_threads(), std::min(threads, CpusAvailable()));
      EXPECT_TRUE(SameOutputs(RunDriver(**opt, pr, ParamCopyType::kBf16), serial))
          << threads << " threads, tile " << tile;
    }
  }
}

TEST(DriverTest, PartitionCoversEveryElementOnceInAlignedTiles) {
  CpuOptimizer::Options o;
  o.num_threads = 2;
  o.tile_elements = 100;  // rounded up to 256 (whole int8 state blocks)
  auto opt = CpuOptimizer::Create(o);
  ASSERT_TRUE(opt.ok());
  EXPECT_EQ((*opt)->tile_elements(), 256u);
  for (size_t n : {size_t{1}, size_t{255}, size_t{256}, size_t{257}, size_t{513}, size_t{100000}}) {
    std::mutex mu;
    std::vector<std::pair<size_t, size_t>> ranges;
    (*opt)->ParallelFor(n, [&](size_t b, size_t e) {
      std::lock_guard<std::mutex> lock(mu);
      ranges.emplace_back(b, e);
    });
    std::sort(ranges.begin(), ranges.end());
    size_t next = 0;
    for (auto [b, e] : ranges) {
      EXPECT_EQ(b, next);
      EXPECT_LT(b, e);
      EXPECT_EQ(b % 256, 0u);
      next = e;
    }
    EXPECT_EQ(next, n);
    EXPECT_LE(ranges.size(), 2u);
  }
}

TEST(DriverTest, BindToCoresPinsWorkersAndRestoresTheCaller) {
  cpu_set_t before;
  ASSERT_EQ(sched_getaffinity(0, sizeof(before), &before), 0);
  const int cpus = CPU_COUNT(&before);
  CpuOptimizer::Options o;
  o.num_threads = std::min(cpus, 2);
  o.bind_to_cores = true;
  o.tile_elements = 64;
  auto opt = CpuOptimizer::Create(o);
  ASSERT_TRUE(opt.ok()) << opt.status().ToString();
  EXPECT_TRUE((*opt)->bound_to_cores());
  std::mutex mu;
  std::vector<int> cpus_per_call;
  (*opt)->ParallelFor(4096, [&](size_t, size_t) {
    cpu_set_t set;
    sched_getaffinity(0, sizeof(set), &set);
    std::lock_guard<std::mutex> lock(mu);
    cpus_per_call.push_back(CPU_COUNT(&set));
  });
  ASSERT_FALSE(cpus_per_call.empty());
  for (int c : cpus_per_call) EXPECT_EQ(c, 1) << "a bound thread may run on exactly one CPU";
  cpu_set_t after;
  ASSERT_EQ(sched_getaffinity(0, sizeof(after), &after), 0);
  EXPECT_TRUE(CPU_EQUAL(&before, &after)) << "the caller's binding must be restored";
  // And the step gives the same numbers bound as unbound.
  const Problem pr = MakeProblem(OptimizerKind::kAdam, GradType::kF32, 10007, 3, true, 7);
  auto unbound = CpuOptimizer::Create();
  ASSERT_TRUE(unbound.ok());
  EXPECT_TRUE(SameOutputs(RunDriver(**opt, pr, ParamCopyType::kF16),
                          RunDriver(**unbound, pr, ParamCopyType::kF16)));
}

TEST(DriverTest, ConvertParamsMatchesScalarConversion) {
  auto opt = CpuOptimizer::Create();
  ASSERT_TRUE(opt.ok());
  Rng rng(5);
  std::vector<float> src(100003);
  for (float& x : src) x = rng.LogUniform(-30, 20, true);
  src[17] = std::numeric_limits<float>::infinity();
  for (ParamCopyType type : {ParamCopyType::kBf16, ParamCopyType::kF16}) {
    std::vector<uint16_t> dst(src.size());
    ASSERT_TRUE((*opt)->ConvertParams(src.data(), dst.data(), type, src.size()).ok());
    for (size_t i = 0; i < src.size(); ++i) {
      ASSERT_EQ(dst[i], type == ParamCopyType::kBf16 ? Fp32ToBf16(src[i]) : Fp32ToFp16(src[i]))
          << i;
    }
  }
  EXPECT_FALSE((*opt)->ConvertParams(src.data(), nullptr, ParamCopyType::kBf16, 1).ok());
  EXPECT_FALSE((*opt)->ConvertParams(src.data(), src.data(), ParamCopyType::kNone, 1).ok());
}

// ---- Sum of squares and the inf/NaN flag ----

TEST(GradSumSquaresTest, MatchesDoubleAndIsIdenticalForAnyThreadCount) {
  const size_t n = 1000003;
  Rng rng(11);
  std::vector<float> g32(n);
  for (float& x : g32) x = rng.LogUniform(-20, 4, true);
  std::vector<uint16_t> g16(n);
  for (GradType type : {GradType::kF32, GradType::kBf16, GradType::kF16}) {
    const void* data = g32.data();
    double want = 0.0;
    if (type == GradType::kF32) {
      for (float x : g32) want += static_cast<double>(x) * x;
    } else {
      for (size_t i = 0; i < n; ++i) {
        g16[i] = EncodeGrad(g32[i], type);
        const double v = type == GradType::kBf16 ? Bf16ToFp32(g16[i]) : Fp16ToFp32(g16[i]);
        want += v * v;
      }
      data = g16.data();
    }
    for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
      if (!CpuIsaSupported(isa)) continue;
      double first = 0.0;
      for (int threads : {1, 2, 3}) {
        CpuOptimizer::Options o;
        o.isa = isa;
        o.num_threads = threads;
        o.tile_elements = 4096;
        auto opt = CpuOptimizer::Create(o);
        ASSERT_TRUE(opt.ok());
        Result<GradStats> stats = (*opt)->GradSumSquares(data, type, n);
        ASSERT_TRUE(stats.ok());
        EXPECT_FALSE(stats->has_inf_or_nan);
        // n additions of positive terms in double: relative error <= n * 2^-53 ~ 1e-10.
        EXPECT_NEAR(stats->sum_squares, want, want * 1e-9) << CpuIsaName(isa);
        if (threads == 1) first = stats->sum_squares;
        EXPECT_EQ(stats->sum_squares, first)
            << CpuIsaName(isa) << ": " << threads << " threads must add in the same order";
      }
    }
  }
}

TEST(GradSumSquaresTest, FlagsInfAndNanAnywhere) {
  CpuOptimizer::Options o;
  o.num_threads = 2;
  o.tile_elements = 64;
  auto opt = CpuOptimizer::Create(o);
  ASSERT_TRUE(opt.ok());
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (size_t n : {size_t{1}, size_t{17}, size_t{1000}}) {
    for (size_t at : {size_t{0}, n / 2, n - 1}) {
      for (float bad : {nan, inf, -inf}) {
        std::vector<float> g(n, 0.5f);
        g[at] = bad;
        Result<GradStats> s32 = (*opt)->GradSumSquares(g.data(), GradType::kF32, n);
        ASSERT_TRUE(s32.ok());
        EXPECT_TRUE(s32->has_inf_or_nan) << n << " " << at;
        for (GradType type : {GradType::kBf16, GradType::kF16}) {
          std::vector<uint16_t> h(n);
          for (size_t i = 0; i < n; ++i) h[i] = EncodeGrad(g[i], type);
          Result<GradStats> s = (*opt)->GradSumSquares(h.data(), type, n);
          ASSERT_TRUE(s.ok());
          EXPECT_TRUE(s->has_inf_or_nan) << GradTypeName(type) << " " << n << " " << at;
        }
      }
      std::vector<float> fine(n, 0.5f);
      fine[at] = std::numeric_limits<float>::max();  // large but finite
      Result<GradStats> s = (*opt)->GradSumSquares(fine.data(), GradType::kF32, n);
      ASSERT_TRUE(s.ok());
      EXPECT_FALSE(s->has_inf_or_nan);
    }
  }
  // fp16 overflow: 70000 does not fit, so a loss-scaled gradient that overflowed is flagged.
  const uint16_t overflowed = Fp32ToFp16(70000.0f);
  Result<GradStats> s = (*opt)->GradSumSquares(&overflowed, GradType::kF16, 1);
  ASSERT_TRUE(s.ok());
  EXPECT_TRUE(s->has_inf_or_nan);
  Result<GradStats> empty = (*opt)->GradSumSquares(nullptr, GradType::kF32, 0);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->sum_squares, 0.0);
  EXPECT_FALSE((*opt)->GradSumSquares(nullptr, GradType::kF32, 1).ok());
}

// ---- Argument checks ----

// ---- The finite check inside the step (StepIfFinite) ----

// Every variant's bit test agrees with std::isfinite: every bf16 and fp16 pattern, and fp32
// patterns over every exponent with the mantissa's edges, at every position in a buffer
// (vector bodies and tails).
TEST_P(ConvertVariantTest, AllFiniteAgreesWithIsfinite) {
  const cpu_adam_internal::KernelTable& k = cpu_adam_internal::KernelsFor(GetParam());
  for (uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    const bool bf16_finite = std::isfinite(Bf16ToFp32(h));
    const bool fp16_finite = std::isfinite(Fp16ToFp32(h));
    ASSERT_EQ(k.all_finite[int(GradType::kBf16)](&h, 0, 1), bf16_finite) << std::hex << bits;
    ASSERT_EQ(k.all_finite[int(GradType::kF16)](&h, 0, 1), fp16_finite) << std::hex << bits;
  }
  std::vector<float> edges;
  for (uint32_t exp = 0; exp < 256; ++exp) {
    for (uint32_t mant : {0u, 1u, 0x400000u, 0x7fffffu}) {
      for (uint32_t sign : {0u, 0x80000000u}) edges.push_back(FromBits(sign | exp << 23 | mant));
    }
  }
  for (float x : edges) {
    ASSERT_EQ(k.all_finite[int(GradType::kF32)](&x, 0, 1), std::isfinite(x)) << x;
  }
  for (size_t n : {size_t{1}, size_t{15}, size_t{16}, size_t{17}, size_t{100}}) {
    for (size_t at = 0; at < n; ++at) {
      std::vector<float> g(n, 1.5f);
      std::vector<uint16_t> h(n, Fp32ToBf16(1.5f));
      EXPECT_TRUE(k.all_finite[int(GradType::kF32)](g.data(), 0, n));
      g[at] = std::numeric_limits<float>::infinity();
      h[at] = Fp32ToBf16(std::nanf(""));
      EXPECT_FALSE(k.all_finite[int(GradType::kF32)](g.data(), 0, n)) << n << " " << at;
      EXPECT_FALSE(k.all_finite[int(GradType::kBf16)](h.data(), 0, n)) << n << " " << at;
      // Only [begin, end) is read.
      EXPECT_EQ(k.all_finite[int(GradType::kF32)](g.data(), at + 1, n), true);
      EXPECT_EQ(k.all_finite[int(GradType::kF32)](g.data(), 0, at), true);
    }
  }
}

// Without a non-finite gradient StepIfFinite is Step, bit for bit. With one, that gradient's
// tile is not stepped, every element is either as it was or Step's value (never one computed
// from the inf or NaN), and the flag says so.
TEST(DriverTest, StepIfFiniteIsStepOrLeavesNonFiniteTilesUnstepped) {
  CpuOptimizer::Options o;
  o.num_threads = 2;
  o.tile_elements = 256;
  auto opt = CpuOptimizer::Create(o);
  ASSERT_TRUE(opt.ok());
  for (GradType type : {GradType::kF32, GradType::kBf16}) {
    Problem pr = MakeProblem(OptimizerKind::kAdamW, type, 5000, 3, true, 7);
    for (size_t i = 0; i < pr.n; ++i) {  // (MakeProblem plants infs and NaNs: finite ones here)
      if (std::isfinite(pr.grad_value[i])) continue;
      pr.grad_value[i] = 0.25f;
      if (type == GradType::kF32) {
        pr.grad32[i] = 0.25f;
      } else {
        pr.grad16[i] = Fp32ToBf16(0.25f);
      }
    }
    const Outputs stepped = RunDriver(**opt, pr, ParamCopyType::kBf16);
    Outputs checked;
    checked.Reset(pr, /*aligned_copy=*/true);
    bool non_finite = true;
    ASSERT_TRUE(
        (*opt)
            ->StepIfFinite(pr.hp, TensorsFor(pr, checked, ParamCopyType::kBf16), &non_finite)
            .ok());
    EXPECT_FALSE(non_finite);
    EXPECT_TRUE(SameOutputs(checked, stepped)) << GradTypeName(type);
    for (size_t at : {size_t{0}, size_t{2600}, size_t{4999}}) {
      Problem bad = pr;
      if (type == GradType::kF32) {
        bad.grad32[at] = std::nanf("");
      } else {
        bad.grad16[at] = Fp32ToBf16(std::numeric_limits<float>::infinity());
      }
      Outputs out;
      out.Reset(bad, /*aligned_copy=*/true);
      Outputs before;
      before.Reset(bad, /*aligned_copy=*/true);
      ASSERT_TRUE(
          (*opt)
              ->StepIfFinite(bad.hp, TensorsFor(bad, out, ParamCopyType::kBf16), &non_finite)
              .ok());
      EXPECT_TRUE(non_finite) << at;
      const size_t tile_begin = at / 256 * 256, tile_end = std::min<size_t>(tile_begin + 256, 5000);
      for (size_t i = 0; i < out.param.size(); ++i) {
        ASSERT_TRUE(std::isfinite(out.param[i]) && std::isfinite(out.state1[i]) &&
                    std::isfinite(out.state2[i]))
            << i;
        const bool unchanged = SameFloat(out.param[i], before.param[i]) &&
                               SameFloat(out.state1[i], before.state1[i]) &&
                               SameFloat(out.state2[i], before.state2[i]);
        const bool as_step = SameFloat(out.param[i], stepped.param[i]) &&
                             SameFloat(out.state1[i], stepped.state1[i]) &&
                             SameFloat(out.state2[i], stepped.state2[i]);
        ASSERT_TRUE(unchanged || as_step) << i;
        if (i >= tile_begin && i < tile_end) ASSERT_TRUE(unchanged) << i << " in the bad tile";
      }
    }
  }
}

class ValidationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    t_.param = p_;
    t_.grad = g_;
    t_.exp_avg = m_;
    t_.exp_avg_sq = v_;
    t_.n = 4;
  }
  std::string Error() {
    const Status s = ValidateOptimizerStep(hp_, t_);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    return s.message();
  }
  float p_[4] = {}, g_[4] = {}, m_[4] = {}, v_[4] = {}, s_[4] = {};
  uint16_t copy_[4] = {};
  OptimizerHyperParams hp_;
  OptimizerTensors t_;
};

#define EXPECT_MESSAGE(expr, text) \
  EXPECT_NE((expr).find(text), std::string::npos) << "message: " << (expr)

TEST_F(ValidationTest, AcceptsAGoodStep) {
  EXPECT_TRUE(ValidateOptimizerStep(hp_, t_).ok());
  t_.param_copy = copy_;
  t_.param_copy_type = ParamCopyType::kBf16;
  EXPECT_TRUE(ValidateOptimizerStep(hp_, t_).ok());
  OptimizerTensors empty;  // n = 0: nothing to touch, NULLs are fine
  EXPECT_TRUE(ValidateOptimizerStep(hp_, empty).ok());
}

TEST_F(ValidationTest, RejectsNullAndOverlappingBuffers) {
  t_.exp_avg_sq = nullptr;
  EXPECT_MESSAGE(Error(), "adamw step: exp_avg_sq is NULL but n > 0");
  t_.exp_avg_sq = v_;
  t_.param_copy_type = ParamCopyType::kF16;
  EXPECT_MESSAGE(Error(), "param_copy is NULL");
  t_.param_copy_type = ParamCopyType::kNone;
  t_.exp_avg = p_ + 2;
  EXPECT_MESSAGE(Error(), "param and exp_avg overlap");
  t_.exp_avg = m_;
  hp_.kind = OptimizerKind::kAdagrad;
  EXPECT_MESSAGE(Error(), "adagrad step: sum is NULL");
  t_.sum = s_;
  EXPECT_TRUE(ValidateOptimizerStep(hp_, t_).ok());
  hp_.kind = OptimizerKind::kLion;
  t_.exp_avg_sq = nullptr;  // Lion has one state
  EXPECT_TRUE(ValidateOptimizerStep(hp_, t_).ok());
}

TEST_F(ValidationTest, RejectsBadHyperParameters) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  hp_.step = 0;
  EXPECT_MESSAGE(Error(), "step must be >= 1 (got 0)");
  hp_.step = 1;
  hp_.lr = -1e-3f;
  EXPECT_MESSAGE(Error(), "lr must be finite and >= 0 (got -0.00100000005)");
  hp_.lr = nan;
  EXPECT_MESSAGE(Error(), "lr must be finite");
  hp_.lr = 1e-3f;
  hp_.beta1 = 1.0f;
  EXPECT_MESSAGE(Error(), "beta1 must be in [0, 1) (got 1)");
  hp_.beta1 = nan;
  EXPECT_MESSAGE(Error(), "beta1 must be in [0, 1)");
  hp_.beta1 = 0.9f;
  hp_.beta2 = -0.5f;
  EXPECT_MESSAGE(Error(), "beta2 must be in [0, 1)");
  hp_.beta2 = 0.999f;
  hp_.eps = nan;
  EXPECT_MESSAGE(Error(), "eps must be finite");
  hp_.eps = 1e-8f;
  hp_.weight_decay = inf;
  EXPECT_MESSAGE(Error(), "weight_decay must be finite");
  hp_.weight_decay = 0.0f;
  hp_.grad_scale = 0.0f;
  EXPECT_MESSAGE(Error(), "grad_scale must be finite and > 0");
  hp_.grad_scale = 1.0f;
  hp_.kind = OptimizerKind::kLion;
  hp_.beta1 = 1.0f;  // Lion accepts [0, 1]
  EXPECT_TRUE(ValidateOptimizerStep(hp_, t_).ok());
  hp_.kind = OptimizerKind::kAdagrad;
  t_.sum = s_;
  hp_.lr_decay = -1.0f;
  EXPECT_MESSAGE(Error(), "lr_decay must be finite and >= 0");
}

TEST_F(ValidationTest, AStepWithBadArgumentsChangesNothing) {
  auto opt = CpuOptimizer::Create();
  ASSERT_TRUE(opt.ok());
  p_[0] = 1.0f;
  g_[0] = 1.0f;
  hp_.step = 0;
  EXPECT_FALSE((*opt)->Step(hp_, t_).ok());
  EXPECT_FALSE(OptimizerStep(hp_, t_, CpuIsa::kScalar).ok());
  EXPECT_EQ(p_[0], 1.0f);
  EXPECT_EQ(m_[0], 0.0f);
}

TEST(CreateTest, RejectsBadOptions) {
  CpuOptimizer::Options o;
  o.num_threads = -1;
  auto opt = CpuOptimizer::Create(o);
  ASSERT_FALSE(opt.ok());
  EXPECT_NE(opt.status().message().find("num_threads"), std::string::npos);
}

}  // namespace
}  // namespace zinf
