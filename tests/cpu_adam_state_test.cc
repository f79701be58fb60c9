// Compressed optimizer states (StateType kBf16, kInt8): every kernel variant bit-identical to
// the scalar reference, the step equal to an fp32 step on the decoded states, the int8 map
// checked against an exhaustive nearest-code search written from its definition, its error
// bounds, and the blocks that are easy to get wrong (zeros, one huge value, NaN and inf,
// subnormals).
#include <gtest/gtest.h>
#include <xmmintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_adam/kernels.h"
#include "zinf/cpu_adam.h"

namespace zinf {
namespace {

using cpu_adam_internal::KernelsFor;
using cpu_adam_internal::KernelVariant;
using cpu_adam_internal::KernelVariantName;
using cpu_adam_internal::KernelVariantSupported;

constexpr size_t kB = kInt8StateBlock;
constexpr size_t kBlockBytes = kB + sizeof(float);

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

bool SameFloat(float a, float b) { return (std::isnan(a) && std::isnan(b)) || Bits(a) == Bits(b); }

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {  // splitmix64
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Magnitude log-uniform over [2^lo, 2^hi), random sign when `sign`.
  float Log(int lo, int hi, bool sign) {
    const uint64_t r = Next();
    const int e = lo + static_cast<int>((r >> 32) % static_cast<uint64_t>(hi - lo));
    const float v = std::ldexp(1.0f + static_cast<float>(r & 0xffffff) / 16777216.0f, e);
    return sign && (r & (1ull << 31)) ? -v : v;
  }

 private:
  uint64_t state_;
};

// ---- The int8 map, from its definition (zinf/cpu_adam.h), independent of the kernels ----

// Mantissa bits: 3 for a signed state (sign + 4 + 3), 4 for an unsigned one (4 + 4).
int ManBits(bool is_signed) { return is_signed ? 3 : 4; }

// The value of a magnitude code: 4 exponent bits, bias 15, subnormals.
double CodeValue(int code, int man) {
  const int e = code >> man;
  const int f = code & ((1 << man) - 1);
  if (e == 0) return std::ldexp(static_cast<double>(f), -14 - man);
  return std::ldexp(1.0 + static_cast<double>(f) / (1 << man), e - 15);
}

double LargestCode(int man) { return CodeValue((15 << man) | ((1 << man) - 1), man); }

// Encodes one block of kB values by searching every code for the nearest (ties to the even
// code), with the scaling the header defines.
void ReferenceEncode(const float* x, bool is_signed, uint8_t* out) {
  const int man = ManBits(is_signed);
  const float top = static_cast<float>(LargestCode(man));
  float a = 0.0f;
  for (size_t i = 0; i < kB; ++i) {
    const float m = std::fabs(x[i]);
    if (m > a) a = m;  // NaN passed over
  }
  if (!(a <= std::numeric_limits<float>::max())) a = std::numeric_limits<float>::max();
  std::memset(out, 0, kBlockBytes);
  if (!(a >= std::numeric_limits<float>::min())) return;
  const float scale = a / top;
  const float r = top / a;
  const int codes = 1 << (4 + man);
  for (size_t i = 0; i < kB; ++i) {
    float y = std::fabs(x[i]) * r;
    if (!(y < top)) y = top;  // inf, NaN and rounding past the top
    int best = 0;
    double best_err = INFINITY;
    for (int c = 0; c < codes; ++c) {
      const double err = std::fabs(CodeValue(c, man) - static_cast<double>(y));
      if (err < best_err || (err == best_err && (c & 1) == 0)) {
        best = c;
        best_err = err;
      }
    }
    if (!is_signed && y > 0.0f && best == 0) best = 1;
    if (is_signed && std::signbit(x[i])) best |= 0x80;
    out[i] = static_cast<uint8_t>(best);
  }
  std::memcpy(out + kB, &scale, sizeof(scale));
}

// The decoded values of n elements.
std::vector<float> ReferenceDecodeInt8(const std::vector<uint8_t>& q, size_t n, bool is_signed) {
  const int man = ManBits(is_signed);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    const uint8_t* block = q.data() + i / kB * kBlockBytes;
    float scale;
    std::memcpy(&scale, block + kB, sizeof(scale));
    const int c = block[i % kB];
    const int magnitude = is_signed ? (c & 0x7f) : c;
    float v = static_cast<float>(CodeValue(magnitude, man)) * scale;
    if (is_signed && (c & 0x80)) v = -v;
    out[i] = v;
  }
  return out;
}

std::vector<float> DecodeState(StateType type, const std::vector<uint8_t>& q, size_t n,
                               bool is_signed) {
  if (type == StateType::kInt8) return ReferenceDecodeInt8(q, n, is_signed);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, q.data() + 2 * i, 2);
    out[i] = Bf16ToFp32(h);
  }
  return out;
}

// ---- A step -------------------------------------------------------------------------------

struct State {
  std::vector<float> param;
  std::vector<uint8_t> q1, q2;
  std::vector<uint16_t> copy;
};

OptimizerHyperParams Hp(OptimizerKind kind, int64_t step) {
  OptimizerHyperParams hp;
  hp.kind = kind;
  hp.step = step;
  hp.lr = kind == OptimizerKind::kLion ? 1e-4f : 1e-3f;
  hp.weight_decay = 0.01f;
  hp.grad_scale = step % 2 ? 1.0f : 0.3f;
  if (kind == OptimizerKind::kAdagrad) hp.eps = 1e-10f;
  return hp;
}

bool HasState2(OptimizerKind kind) {
  return kind == OptimizerKind::kAdam || kind == OptimizerKind::kAdamW;
}

// Buffers of n elements: states of random codes (int8: random bytes, finite scales; bf16:
// random finite values, non-negative for the second state), random parameters.
State RandomState(OptimizerKind kind, StateType type, size_t n, uint64_t seed) {
  Rng rng(seed);
  State s;
  s.param.resize(n);
  for (float& p : s.param) p = rng.Log(-10, 2, true);
  const size_t bytes = StateBytes(type, n);
  s.q1.assign(bytes + 4, 0);  // + 4: room to test a misaligned pointer elsewhere
  s.q2.assign(bytes + 4, 0);
  for (int which = 0; which < 2; ++which) {
    std::vector<uint8_t>& q = which == 0 ? s.q1 : s.q2;
    const bool is_signed = which == 0 && kind != OptimizerKind::kAdagrad;
    if (type == StateType::kInt8) {
      for (size_t b = 0; b * kBlockBytes < bytes; ++b) {
        for (size_t i = 0; i < kB; ++i) q[b * kBlockBytes + i] = static_cast<uint8_t>(rng.Next());
        const float scale = rng.Log(-30, 0, false);
        std::memcpy(q.data() + b * kBlockBytes + kB, &scale, 4);
      }
    } else {
      for (size_t i = 0; i < n; ++i) {
        const float v = is_signed ? rng.Log(-30, -2, true) : rng.Log(-40, -4, false);
        const uint16_t h = Fp32ToBf16(v);
        std::memcpy(q.data() + 2 * i, &h, 2);
      }
    }
  }
  s.copy.assign(n, 0);
  return s;
}

std::vector<uint16_t> RandomBf16Grads(size_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<uint16_t> g(n);
  for (uint16_t& x : g) x = Fp32ToBf16(rng.Log(-20, 1, true));
  return g;
}

OptimizerTensors Tensors(State& s, const std::vector<uint16_t>& grad, StateType type,
                         OptimizerKind kind) {
  OptimizerTensors t;
  t.param = s.param.data();
  t.grad = grad.data();
  t.grad_type = GradType::kBf16;
  t.state_type = type;
  t.state1 = s.q1.data();
  t.state2 = HasState2(kind) ? s.q2.data() : nullptr;
  t.param_copy = s.copy.data();
  t.param_copy_type = ParamCopyType::kBf16;
  t.n = s.param.size();
  return t;
}

void RunKernel(KernelVariant variant, const OptimizerHyperParams& hp, const OptimizerTensors& t) {
  ASSERT_TRUE(ValidateOptimizerStep(hp, t).ok()) << ValidateOptimizerStep(hp, t).ToString();
  cpu_adam_internal::SelectStepKernel(KernelsFor(variant), hp, t)(
      cpu_adam_internal::ComputeCoefficients(hp), cpu_adam_internal::BuffersOf(hp, t), 0, t.n);
}

using VariantParam = std::tuple<KernelVariant, OptimizerKind, StateType>;

class CompressedStateTest : public ::testing::TestWithParam<VariantParam> {
 protected:
  void SetUp() override {
    if (!KernelVariantSupported(std::get<0>(GetParam()), DetectCpuFeatures())) {
      GTEST_SKIP() << "this CPU cannot run the " << KernelVariantName(std::get<0>(GetParam()))
                   << " kernels";
    }
  }
};

// Three steps from random codes, on a length with a partial last block and vector tail: every
// byte of the states, every parameter and every copy equal to the scalar reference's.
TEST_P(CompressedStateTest, BitIdenticalToTheScalarReference) {
  const auto [variant, kind, type] = GetParam();
  for (size_t n : {size_t{1}, size_t{255}, size_t{256}, size_t{257}, size_t{3 * 256 + 19}}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    State ref = RandomState(kind, type, n, n);
    State got = ref;
    for (int64_t step = 1; step <= 3; ++step) {
      const std::vector<uint16_t> grad = RandomBf16Grads(n, n * 7 + step);
      const OptimizerHyperParams hp = Hp(kind, step);
      RunKernel(KernelVariant::kScalar, hp, Tensors(ref, grad, type, kind));
      RunKernel(variant, hp, Tensors(got, grad, type, kind));
      const size_t bytes = StateBytes(type, n);
      ASSERT_EQ(std::memcmp(got.q1.data(), ref.q1.data(), bytes), 0) << "state1, step " << step;
      ASSERT_EQ(std::memcmp(got.q2.data(), ref.q2.data(), bytes), 0) << "state2, step " << step;
      for (size_t i = 0; i < n; ++i) {
        ASSERT_TRUE(SameFloat(got.param[i], ref.param[i])) << "param " << i << ", step " << step;
        const bool both_nan = (got.copy[i] & 0x7fff) > 0x7f80 && (ref.copy[i] & 0x7fff) > 0x7f80;
        ASSERT_TRUE(got.copy[i] == ref.copy[i] || both_nan) << "copy " << i << ", step " << step;
      }
    }
  }
}

// The step is the fp32 step applied to the decoded states, and its new states are the fp32
// step's states encoded (int8: as the exhaustive nearest-code search encodes them).
TEST_P(CompressedStateTest, IsTheFp32StepOnTheDecodedStatesThenEncoded) {
  const auto [variant, kind, type] = GetParam();
  const size_t n = 5 * 256 + 77;
  const bool signed1 = kind != OptimizerKind::kAdagrad;
  State s = RandomState(kind, type, n, 99);
  std::vector<float> p32 = s.param;
  std::vector<float> s1 = DecodeState(type, s.q1, n, signed1);
  std::vector<float> s2 = DecodeState(type, s.q2, n, false);
  const std::vector<uint16_t> grad = RandomBf16Grads(n, 5);
  const OptimizerHyperParams hp = Hp(kind, 4);
  RunKernel(variant, hp, Tensors(s, grad, type, kind));
  OptimizerTensors t;
  t.param = p32.data();
  t.grad = grad.data();
  t.grad_type = GradType::kBf16;
  (kind == OptimizerKind::kAdagrad ? t.sum : t.exp_avg) = s1.data();
  if (HasState2(kind)) t.exp_avg_sq = s2.data();
  t.n = n;
  ASSERT_TRUE(OptimizerStep(hp, t, CpuIsa::kScalar).ok());
  for (size_t i = 0; i < n; ++i) {
    ASSERT_TRUE(SameFloat(s.param[i], p32[i])) << "param " << i;
    ASSERT_EQ(s.copy[i], Fp32ToBf16(p32[i])) << "copy " << i;
  }
  for (int which = 0; which < (HasState2(kind) ? 2 : 1); ++which) {
    const std::vector<float>& want = which == 0 ? s1 : s2;
    const std::vector<uint8_t>& q = which == 0 ? s.q1 : s.q2;
    const bool is_signed = which == 0 && signed1;
    if (type == StateType::kBf16) {
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, q.data() + 2 * i, 2);
        ASSERT_EQ(h, Fp32ToBf16(want[i])) << "state" << which + 1 << " " << i;
      }
      continue;
    }
    for (size_t b = 0; b * kB < n; ++b) {
      float block[kB] = {};
      for (size_t i = 0; i < kB && b * kB + i < n; ++i) block[i] = want[b * kB + i];
      uint8_t expected[kBlockBytes];
      ReferenceEncode(block, is_signed, expected);
      ASSERT_EQ(std::memcmp(q.data() + b * kBlockBytes, expected, kBlockBytes), 0)
          << "state" << which + 1 << " block " << b;
    }
  }
}

std::string VariantName(const ::testing::TestParamInfo<VariantParam>& info) {
  const auto [variant, kind, type] = info.param;
  return std::string(KernelVariantName(variant)) + "_" + OptimizerKindName(kind) + "_" +
         StateTypeName(type);
}

INSTANTIATE_TEST_SUITE_P(
    Int8, CompressedStateTest,
    ::testing::Combine(::testing::Values(KernelVariant::kScalar, KernelVariant::kAvx2,
                                         KernelVariant::kAvx512, KernelVariant::kAvx512Bf16),
                       ::testing::Values(OptimizerKind::kAdam, OptimizerKind::kAdamW,
                                         OptimizerKind::kLion),
                       ::testing::Values(StateType::kInt8)),
    VariantName);
INSTANTIATE_TEST_SUITE_P(
    Bf16, CompressedStateTest,
    ::testing::Combine(::testing::Values(KernelVariant::kScalar, KernelVariant::kAvx2,
                                         KernelVariant::kAvx512, KernelVariant::kAvx512Bf16),
                       ::testing::Values(OptimizerKind::kAdam, OptimizerKind::kAdamW,
                                         OptimizerKind::kLion, OptimizerKind::kAdagrad),
                       ::testing::Values(StateType::kBf16)),
    VariantName);

// Every one of the 256 codes of each kind, through each variant's decode (the SIMD variants
// go through fp16, the scalar one through fp32 bits): the values the map defines, bit for bit,
// with a scale of 1 and with one that changes every value's bits.
TEST(Int8StateDecode, EveryCodeOfEveryVariantIsTheMapsValue) {
  for (KernelVariant variant : {KernelVariant::kScalar, KernelVariant::kAvx2,
                                KernelVariant::kAvx512, KernelVariant::kAvx512Bf16}) {
    if (!KernelVariantSupported(variant, DetectCpuFeatures())) continue;
    for (bool is_signed : {true, false}) {
      for (float scale : {1.0f, 3.0e-7f}) {
        SCOPED_TRACE(std::string(KernelVariantName(variant)) +
                     (is_signed ? " signed" : " unsigned") + " scale " + std::to_string(scale));
        std::vector<uint8_t> q(kBlockBytes);
        for (size_t i = 0; i < kB; ++i) q[i] = static_cast<uint8_t>(i);
        std::memcpy(q.data() + kB, &scale, sizeof(scale));
        std::vector<float> got(kB);
        KernelsFor(variant).decode_state[int(StateType::kInt8)][is_signed](q.data(), kB,
                                                                           got.data());
        const std::vector<float> want = ReferenceDecodeInt8(q, kB, is_signed);
        for (size_t i = 0; i < kB; ++i) {
          ASSERT_TRUE(SameFloat(got[i], want[i]))
              << "code " << i << ": " << got[i] << " vs " << want[i];
        }
        if (is_signed) EXPECT_TRUE(std::signbit(got[0x80])) << "code 0x80 is -0";
      }
    }
  }
}

// The encoder's rounding (the fp32 adder, kernel_body.h EncodeMagnitude) against a second
// derivation of round-to-nearest-even, on the fp32 bits: above the smallest normal, round the
// bits to kMan mantissa bits; below it, round y * 2^(14 + kMan) to an integer. On every code
// value, every midpoint between two codes and the fp32 values on either side of it (the
// ties), and every 97th fp32 value in [0, kMax] (11M of them; all 2^30 agree too, in 13 s),
// through the best variant: a block whose largest value is kMax has scale 1 and r = 1, so each
// other element's code is its y's.
uint32_t BitRoundedCode(float y, int man) {
  uint32_t bits;
  std::memcpy(&bits, &y, sizeof(bits));
  if (y < 0x1p-14f) return static_cast<uint32_t>(std::nearbyint(std::ldexp(double(y), 14 + man)));
  const uint32_t odd = (bits >> (23 - man)) & 1;
  return ((bits + (1u << (22 - man)) - 1 + odd) >> (23 - man)) - ((127 - 15) << man);
}

TEST(Int8StateMap, Fp32MagnitudesRoundToTheNearestEvenCode) {
  const KernelVariant variant = cpu_adam_internal::BestVariantOf(BestCpuIsa(), DetectCpuFeatures());
  for (bool is_signed : {true, false}) {
    const int man = ManBits(is_signed);
    const int codes = is_signed ? 128 : 256;
    const float top = static_cast<float>(LargestCode(man));
    std::vector<float> values;
    for (int c = 0; c < codes; ++c) {
      const float v = static_cast<float>(CodeValue(c, man));
      values.push_back(v);
      if (c + 1 == codes) break;
      const float mid = static_cast<float>((CodeValue(c, man) + CodeValue(c + 1, man)) / 2);
      values.insert(values.end(), {std::nextafter(mid, 0.0f), mid, std::nextafter(mid, 2.0f)});
    }
    uint32_t top_bits;
    std::memcpy(&top_bits, &top, sizeof(top_bits));
    for (uint32_t bits = 0; bits <= top_bits; bits += 97) {
      float v;
      std::memcpy(&v, &bits, sizeof(v));
      values.push_back(v);
    }
    std::vector<float> block(kB);
    std::vector<uint8_t> q(kBlockBytes);
    uint64_t wrong = 0;
    for (size_t next = 0; next < values.size();) {
      block[0] = top;
      size_t n = 1;
      for (; n < kB && next < values.size(); ++n, ++next) block[n] = values[next];
      std::fill(block.begin() + n, block.end(), 0.0f);
      KernelsFor(variant).encode_state[int(StateType::kInt8)][is_signed](block.data(), kB,
                                                                         q.data());
      for (size_t i = 1; i < n; ++i) {
        uint32_t want = BitRoundedCode(block[i], man);
        if (!is_signed && block[i] > 0 && want == 0) want = 1;  // never zero when positive
        if (q[i] != want && ++wrong <= 5) {
          ADD_FAILURE() << (is_signed ? "signed" : "unsigned") << " y=" << block[i] << " code "
                        << int(q[i]) << ", expected " << want;
        }
      }
    }
    EXPECT_EQ(wrong, 0u);
  }
}

// ---- The int8 map on chosen blocks --------------------------------------------------------

// Stores one block of first moments (signed) and second moments (unsigned) as a Lion / Adam
// step would leave them: an AdamW step with lr 0, beta1 = beta2 = 0 and zero states makes
// m = g and v = g * g exactly when g * g is exact, so the block's values are chosen through
// the gradient. Returns the two encoded blocks.
struct EncodedBlock {
  std::vector<uint8_t> m, v;  // the stored bytes: block b's codes at b * kBlockBytes
  float m_scale = 0, v_scale = 0;
  std::vector<float> m_value, v_value;  // decoded
  std::vector<float> param;
};

EncodedBlock EncodeThroughAStep(const std::vector<float>& grad, KernelVariant variant) {
  const size_t n = grad.size();
  EncodedBlock out;
  out.param.assign(n, 1.0f);
  std::vector<uint8_t> q1(StateBytes(StateType::kInt8, n), 0), q2(q1.size(), 0);
  OptimizerHyperParams hp;
  hp.kind = OptimizerKind::kAdamW;
  hp.lr = 0.0f;
  hp.beta1 = 0.0f;
  hp.beta2 = 0.0f;
  OptimizerTensors t;
  t.param = out.param.data();
  t.grad = grad.data();
  t.state_type = StateType::kInt8;
  t.state1 = q1.data();
  t.state2 = q2.data();
  t.n = n;
  if (variant == KernelVariant::kScalar || KernelVariantSupported(variant, DetectCpuFeatures())) {
    RunKernel(variant, hp, t);
  }
  out.m = q1;
  out.v = q2;
  std::memcpy(&out.m_scale, q1.data() + kB, 4);
  std::memcpy(&out.v_scale, q2.data() + kB, 4);
  out.m_value = ReferenceDecodeInt8(q1, n, true);
  out.v_value = ReferenceDecodeInt8(q2, n, false);
  return out;
}

// The decoded value is the nearest code: within half a code step of the scaled value, i.e.
// 2^-(man+1) relative above the smallest normal code and half a subnormal step below it (plus
// a few fp32 roundings of the scaling, 2^-22 relative).
TEST(Int8StateMap, ErrorWithinHalfACodeStepOverTheDynamicRange) {
  Rng rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<float> grad(4 * kB);
    // Magnitudes over 2^-40 .. 2^0 within a block: both moments need the dynamic range.
    for (float& g : grad) g = rng.Log(-20, 0, true);
    const EncodedBlock e = EncodeThroughAStep(grad, KernelVariant::kScalar);
    for (size_t b = 0; b < 4; ++b) {
      for (int which = 0; which < 2; ++which) {
        const bool is_signed = which == 0;
        const int man = ManBits(is_signed);
        const std::vector<uint8_t>& q = is_signed ? e.m : e.v;
        float scale;
        std::memcpy(&scale, q.data() + b * kBlockBytes + kB, 4);
        double largest = 0;
        for (size_t i = b * kB; i < (b + 1) * kB; ++i) {
          const double x = is_signed ? grad[i] : double(grad[i]) * grad[i];
          largest = std::max(largest, std::fabs(x));
        }
        EXPECT_NEAR(scale * LargestCode(man), largest, largest * 1e-6);
        for (size_t i = b * kB; i < (b + 1) * kB; ++i) {
          const double x = is_signed ? grad[i] : double(grad[i]) * grad[i];
          const double got = is_signed ? e.m_value[i] : e.v_value[i];
          const double smallest_normal = std::ldexp(1.0, -14) * scale;
          const double step_below = std::ldexp(1.0, -14 - man) * scale;
          double bound = std::fabs(x) >= smallest_normal ? std::fabs(x) * std::ldexp(1.0, -man - 1)
                                                         : step_below / 2;
          if (!is_signed && x > 0 && got == step_below) bound = step_below;  // never zero
          bound += std::fabs(x) * std::ldexp(1.0, -21);
          ASSERT_LE(std::fabs(got - x), bound)
              << (is_signed ? "first" : "second") << " moment " << i << ": " << x << " -> " << got;
          if (!is_signed && x > 0) {
            ASSERT_GT(got, 0.0) << "a positive second moment became 0";
          }
          if (is_signed && got != 0) {
            ASSERT_EQ(std::signbit(got), std::signbit(x));
          }
        }
      }
    }
  }
}

TEST(Int8StateMap, AZeroBlockIsAllZeroBytesAndDecodesToZero) {
  for (KernelVariant variant : {KernelVariant::kScalar, KernelVariant::kAvx2,
                                KernelVariant::kAvx512, KernelVariant::kAvx512Bf16}) {
    if (!KernelVariantSupported(variant, DetectCpuFeatures())) continue;
    const EncodedBlock e = EncodeThroughAStep(std::vector<float>(kB + 3, 0.0f), variant);
    for (uint8_t b : e.m) EXPECT_EQ(b, 0) << KernelVariantName(variant);
    for (uint8_t b : e.v) EXPECT_EQ(b, 0) << KernelVariantName(variant);
    for (float p : e.param) EXPECT_EQ(p, 1.0f);
  }
}

// One huge value: it takes the largest code exactly; the first moments far below the range
// round to zero (no update from them: safe), the second moments take the smallest code (a
// zero there would divide by eps alone).
TEST(Int8StateMap, OneHugeValueLeavesTinyFirstMomentsZeroAndSecondMomentsNonZero) {
  std::vector<float> grad(kB, 1e-12f);
  grad[17] = 1e3f;
  grad[18] = -1.0f;  // 1e-3 of the largest first moment: inside its normal range
  for (KernelVariant variant : {KernelVariant::kScalar, KernelVariant::kAvx2,
                                KernelVariant::kAvx512, KernelVariant::kAvx512Bf16}) {
    if (!KernelVariantSupported(variant, DetectCpuFeatures())) continue;
    SCOPED_TRACE(KernelVariantName(variant));
    const EncodedBlock e = EncodeThroughAStep(grad, variant);
    EXPECT_EQ(e.m[17], 0x7f);
    EXPECT_EQ(e.v[17], 0xff);
    EXPECT_NEAR(e.m_value[17], 1e3f, 1e3f * 1e-6);
    EXPECT_NEAR(e.v_value[17], 1e6f, 1e6f * 1e-6);
    EXPECT_LT(e.m_value[18], 0.0f);
    EXPECT_NEAR(e.m_value[18], -1.0f, 1.0f / 16);
    for (size_t i = 0; i < kB; ++i) {
      if (i == 17 || i == 18) continue;
      ASSERT_EQ(e.m[i], 0) << i;
      ASSERT_EQ(e.v[i], 1) << i;  // 1e-24 is 2^-60 of 1e6: far below, floored to code 1
    }
  }
}

// A NaN or infinite gradient gives NaN parameters as with fp32 states, but every scale stays
// finite: an infinity saturates, a NaN takes the largest code, the other values keep theirs.
TEST(Int8StateMap, NanAndInfNeverReachAScale) {
  std::vector<float> grad(2 * kB, 0.5f);
  grad[3] = std::numeric_limits<float>::quiet_NaN();
  grad[kB + 5] = std::numeric_limits<float>::infinity();
  for (KernelVariant variant : {KernelVariant::kScalar, KernelVariant::kAvx2,
                                KernelVariant::kAvx512, KernelVariant::kAvx512Bf16}) {
    if (!KernelVariantSupported(variant, DetectCpuFeatures())) continue;
    SCOPED_TRACE(KernelVariantName(variant));
    const EncodedBlock e = EncodeThroughAStep(grad, variant);
    for (const std::vector<uint8_t>* q : {&e.m, &e.v}) {
      for (size_t b = 0; b < 2; ++b) {
        float scale;
        std::memcpy(&scale, q->data() + b * kBlockBytes + kB, 4);
        EXPECT_TRUE(std::isfinite(scale)) << "block " << b << " scale " << scale;
      }
    }
    EXPECT_TRUE(std::isnan(e.param[3]));
    // Block 0: the NaN is passed over, 0.5 is the largest; the NaN takes the largest code.
    EXPECT_NEAR(e.m_value[0], 0.5f, 0.5f * 1e-6f);
    EXPECT_EQ(e.m[0], 0x7f);
    EXPECT_EQ(e.m[3] & 0x7f, 0x7f);
    // Block 1: the infinity saturates (the scale is FLT_MAX's); 0.5 is far below: zero.
    EXPECT_EQ(e.m[kBlockBytes + 5], 0x7f);
    EXPECT_EQ(e.v[kBlockBytes + 5], 0xff);
    EXPECT_EQ(e.m[kBlockBytes], 0);
  }
}

// Subnormal moments: a block whose largest magnitude is below FLT_MIN stores as zeros; next
// to a normal value, subnormal first moments round to zero and second moments keep code 1.
TEST(Int8StateMap, SubnormalBlocksStoreAsZeros) {
  const float tiny = std::numeric_limits<float>::denorm_min() * 1000;
  std::vector<float> grad(2 * kB, tiny);
  grad[kB] = 1e-3f;
  const EncodedBlock e = EncodeThroughAStep(grad, KernelVariant::kScalar);
  for (size_t i = 0; i < kBlockBytes; ++i) EXPECT_EQ(e.m[i], 0) << i;
  EXPECT_EQ(e.m_value[0], 0.0f);
  EXPECT_EQ(e.m[kBlockBytes + 1], 0);
  // v = tiny^2 underflows to zero in fp32 itself: stays zero.
  EXPECT_EQ(e.v_value[kB + 1], 0.0f);
  EXPECT_GT(e.v_value[kB], 0.0f);
}

// A caller with denormals-are-zero and flush-to-zero set (torch.set_flush_denormal(True), a
// -ffast-math library) gets the same bytes: the scalar decode reads subnormal codes as fp32
// subnormals, which DAZ would read as 0 (a second moment of 0 divides by eps alone), and small
// values on their way to a code, or through the update, would flush to 0. Its MXCSR is given
// back. (The SIMD decode goes through fp16 and never sees an fp32 subnormal code.)
TEST(CompressedStateMxcsr, FlushToZeroInTheCallerChangesNothing) {
  const size_t n = 3 * kB + 19;
  const std::vector<uint16_t> grad = RandomBf16Grads(n, 9);
  const OptimizerHyperParams hp = Hp(OptimizerKind::kAdamW, 3);
  for (CpuIsa isa : {CpuIsa::kScalar, BestCpuIsa()}) {
    SCOPED_TRACE(CpuIsaName(isa));
    State plain = RandomState(OptimizerKind::kAdamW, StateType::kInt8, n, 21);
    State flushed = plain;
    ASSERT_TRUE(
        OptimizerStep(hp, Tensors(plain, grad, StateType::kInt8, OptimizerKind::kAdamW), isa).ok());
    std::vector<float> decoded_plain(n), decoded_flushed(n);
    ASSERT_TRUE(ConvertOptimizerState(StateType::kInt8, plain.q2.data(), StateType::kF32,
                                      decoded_plain.data(), n, StateRole::kNonNegative)
                    .ok());
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);  // FTZ | DAZ
    const Status step =
        OptimizerStep(hp, Tensors(flushed, grad, StateType::kInt8, OptimizerKind::kAdamW), isa);
    const Status convert =
        ConvertOptimizerState(StateType::kInt8, plain.q2.data(), StateType::kF32,
                              decoded_flushed.data(), n, StateRole::kNonNegative);
    const unsigned after = _mm_getcsr();
    _mm_setcsr(csr);
    ASSERT_TRUE(step.ok() && convert.ok());
    EXPECT_EQ(after, csr | 0x8040) << "the caller's MXCSR was not given back";
    EXPECT_EQ(flushed.q1, plain.q1);
    EXPECT_EQ(flushed.q2, plain.q2);
    EXPECT_EQ(std::memcmp(flushed.param.data(), plain.param.data(), n * 4), 0);
    EXPECT_EQ(std::memcmp(decoded_flushed.data(), decoded_plain.data(), n * 4), 0);
    size_t subnormal = 0;  // second-moment codes with exponent 0 and a mantissa
    for (size_t b = 0; b < (n + kB - 1) / kB; ++b) {
      for (size_t i = 0; i < kB; ++i) {
        const uint8_t c = plain.q2[b * kBlockBytes + i];
        subnormal += c > 0 && c < 16;
      }
    }
    EXPECT_GT(subnormal, 0u) << "no subnormal codes: the test does not reach the case";
  }
}

// ---- Converting a state between types (a checkpoint of another state dtype) ----------------

TEST(ConvertOptimizerStateTest, DecodesAndEncodesAsTheMapDefines) {
  const size_t n = 3 * kB + 77;  // a partial last block
  Rng rng(5);
  for (StateRole role : {StateRole::kSigned, StateRole::kNonNegative}) {
    const bool is_signed = role == StateRole::kSigned;
    SCOPED_TRACE(is_signed ? "signed" : "non-negative");
    std::vector<float> x(n);
    for (float& v : x) v = rng.Log(-30, 3, is_signed);
    // fp32 -> int8: each block as the reference encoder stores it.
    std::vector<uint8_t> q(StateBytes(StateType::kInt8, n));
    ASSERT_TRUE(
        ConvertOptimizerState(StateType::kF32, x.data(), StateType::kInt8, q.data(), n, role).ok());
    for (size_t b = 0; b * kB < n; ++b) {
      float block[kB] = {};
      for (size_t i = 0; i < kB && b * kB + i < n; ++i) block[i] = x[b * kB + i];
      uint8_t want[kBlockBytes];
      ReferenceEncode(block, is_signed, want);
      ASSERT_EQ(std::memcmp(q.data() + b * kBlockBytes, want, kBlockBytes), 0) << "block " << b;
    }
    // int8 -> fp32: the decoded values.
    std::vector<float> back(n);
    ASSERT_TRUE(
        ConvertOptimizerState(StateType::kInt8, q.data(), StateType::kF32, back.data(), n, role)
            .ok());
    EXPECT_EQ(back, ReferenceDecodeInt8(q, n, is_signed));
    // int8 -> bf16: the decoded values rounded; bf16 -> fp32: widened.
    std::vector<uint16_t> h(n);
    ASSERT_TRUE(
        ConvertOptimizerState(StateType::kInt8, q.data(), StateType::kBf16, h.data(), n, role)
            .ok());
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(h[i], Fp32ToBf16(back[i])) << i;
    std::vector<float> wide(n);
    ASSERT_TRUE(
        ConvertOptimizerState(StateType::kBf16, h.data(), StateType::kF32, wide.data(), n, role)
            .ok());
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(wide[i], Bf16ToFp32(h[i])) << i;
    // The same type: a copy.
    std::vector<uint8_t> same(q.size());
    ASSERT_TRUE(
        ConvertOptimizerState(StateType::kInt8, q.data(), StateType::kInt8, same.data(), n, role)
            .ok());
    EXPECT_EQ(same, q);
  }
}

TEST(ConvertOptimizerStateTest, RefusesOverlapMisalignmentAndNull) {
  std::vector<uint8_t> buf(4 * 1024 + 8);
  const StateRole r = StateRole::kSigned;
  EXPECT_NE(ConvertOptimizerState(StateType::kF32, buf.data(), StateType::kInt8, buf.data() + 1024,
                                  1024, r)
                .message()
                .find("overlap"),
            std::string::npos);
  EXPECT_NE(ConvertOptimizerState(StateType::kBf16, buf.data(), StateType::kInt8,
                                  buf.data() + 2048 + 1, 256, r)
                .message()
                .find("4-byte aligned"),
            std::string::npos);
  EXPECT_EQ(
      ConvertOptimizerState(StateType::kF32, nullptr, StateType::kInt8, buf.data(), 4, r).code(),
      StatusCode::kInvalidArgument);
  EXPECT_TRUE(
      ConvertOptimizerState(StateType::kF32, nullptr, StateType::kInt8, nullptr, 0, r).ok());
}

// ---- Driver and arguments -----------------------------------------------------------------

TEST(CompressedStateDriver, ThreadCountsAndTilesGiveTheSameBytes) {
  const size_t n = 100000 + 13;
  const std::vector<uint16_t> grad = RandomBf16Grads(n, 3);
  for (StateType type : {StateType::kBf16, StateType::kInt8}) {
    State serial = RandomState(OptimizerKind::kAdamW, type, n, 11);
    State start = serial;
    const OptimizerHyperParams hp = Hp(OptimizerKind::kAdamW, 2);
    ASSERT_TRUE(
        OptimizerStep(hp, Tensors(serial, grad, type, OptimizerKind::kAdamW), BestCpuIsa()).ok());
    for (int threads : {1, 2, 3}) {
      for (size_t tile : {size_t{100}, size_t{4096}}) {
        CpuOptimizer::Options o;
        o.num_threads = threads;
        o.tile_elements = tile;
        auto opt = CpuOptimizer::Create(o);
        ASSERT_TRUE(opt.ok());
        State s = start;
        ASSERT_TRUE((*opt)->Step(hp, Tensors(s, grad, type, OptimizerKind::kAdamW)).ok());
        EXPECT_EQ(s.q1, serial.q1) << threads << " threads, tile " << tile;
        EXPECT_EQ(s.q2, serial.q2) << threads << " threads, tile " << tile;
        EXPECT_EQ(std::memcmp(s.param.data(), serial.param.data(), n * 4), 0);
      }
    }
  }
}

// The engine steps a parameter in pieces (the last sub-group's upload): the pieces stepped one
// after another are the whole step, bit for bit, in every state type, and a piece of int8
// states must start on a block.
TEST(SliceOptimizerTensors, PiecesSteppedInTurnAreTheWholeStep) {
  const size_t n = 100000 + 13;
  const std::vector<uint16_t> grad = RandomBf16Grads(n, 5);
  const size_t cuts[] = {0, 512, 66048, 99840, n};
  const OptimizerHyperParams hp = Hp(OptimizerKind::kAdamW, 3);
  for (StateType type : {StateType::kF32, StateType::kBf16, StateType::kInt8}) {
    SCOPED_TRACE(StateTypeName(type));
    // fp32 states: random moments in buffers of their own, pointed at by exp_avg/exp_avg_sq.
    State whole = RandomState(OptimizerKind::kAdamW,
                              type == StateType::kF32 ? StateType::kBf16 : type, n, 17);
    std::vector<float> m(n), v(n);
    Rng rng(23);
    for (size_t i = 0; i < n; ++i) {
      m[i] = rng.Log(-30, -2, true);
      v[i] = rng.Log(-40, -4, false);
    }
    State pieces = whole;
    std::vector<float> pm = m, pv = v;
    auto tensors = [&](State& s, std::vector<float>& sm, std::vector<float>& sv) {
      OptimizerTensors t = Tensors(s, grad, type, OptimizerKind::kAdamW);
      if (type == StateType::kF32) {
        t.state1 = t.state2 = nullptr;
        t.exp_avg = sm.data();
        t.exp_avg_sq = sv.data();
      }
      return t;
    };
    ASSERT_TRUE(OptimizerStep(hp, tensors(whole, m, v), BestCpuIsa()).ok());
    const OptimizerTensors all = tensors(pieces, pm, pv);
    for (size_t k = 0; k + 1 < std::size(cuts); ++k) {
      Result<OptimizerTensors> t = SliceOptimizerTensors(all, cuts[k], cuts[k + 1]);
      ASSERT_TRUE(t.ok()) << t.status().ToString();
      EXPECT_EQ(t->n, cuts[k + 1] - cuts[k]);
      ASSERT_TRUE(OptimizerStep(hp, *t, BestCpuIsa()).ok());
    }
    EXPECT_EQ(std::memcmp(pieces.param.data(), whole.param.data(), n * 4), 0);
    EXPECT_EQ(pieces.copy, whole.copy);
    if (type == StateType::kF32) {
      EXPECT_EQ(std::memcmp(pm.data(), m.data(), n * 4), 0);
      EXPECT_EQ(std::memcmp(pv.data(), v.data(), n * 4), 0);
    } else {
      EXPECT_EQ(pieces.q1, whole.q1);
      EXPECT_EQ(pieces.q2, whole.q2);
    }
    // Refusals: outside [0, n), reversed, and (int8) a piece that starts inside a block.
    EXPECT_EQ(SliceOptimizerTensors(all, 0, n + 1).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(SliceOptimizerTensors(all, 512, 256).status().code(), StatusCode::kInvalidArgument);
    Result<OptimizerTensors> inside = SliceOptimizerTensors(all, 100, 612);
    EXPECT_EQ(inside.ok(), type != StateType::kInt8) << inside.status().ToString();
    if (!inside.ok()) {
      EXPECT_NE(inside.status().message().find("multiple of 256"), std::string::npos)
          << inside.status().ToString();
    }
  }
}

TEST(CompressedStateArgs, RefusalsNameTheProblem) {
  State s = RandomState(OptimizerKind::kAdamW, StateType::kInt8, 300, 1);
  const std::vector<uint16_t> grad = RandomBf16Grads(300, 2);
  OptimizerHyperParams hp = Hp(OptimizerKind::kAdagrad, 1);
  OptimizerTensors t = Tensors(s, grad, StateType::kInt8, OptimizerKind::kAdagrad);
  Status st = ValidateOptimizerStep(hp, t);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("not supported for Adagrad"), std::string::npos) << st.ToString();

  hp = Hp(OptimizerKind::kAdamW, 1);
  t = Tensors(s, grad, StateType::kInt8, OptimizerKind::kAdamW);
  std::vector<float> fp32(300);
  t.exp_avg = fp32.data();
  st = ValidateOptimizerStep(hp, t);
  EXPECT_NE(st.message().find("must be null"), std::string::npos) << st.ToString();

  t = Tensors(s, grad, StateType::kInt8, OptimizerKind::kAdamW);
  t.state2 = s.q2.data() + 1;
  st = ValidateOptimizerStep(hp, t);
  EXPECT_NE(st.message().find("4-byte aligned"), std::string::npos) << st.ToString();

  t = Tensors(s, grad, StateType::kInt8, OptimizerKind::kAdamW);
  t.state2 = s.q1.data() + 4;  // overlaps state1
  st = ValidateOptimizerStep(hp, t);
  EXPECT_NE(st.message().find("overlap"), std::string::npos) << st.ToString();

  t = Tensors(s, grad, StateType::kInt8, OptimizerKind::kAdamW);
  t.state1 = nullptr;
  EXPECT_EQ(ValidateOptimizerStep(hp, t).code(), StatusCode::kInvalidArgument);

  EXPECT_EQ(ParseStateType("int8").value(), StateType::kInt8);
  EXPECT_EQ(ParseStateType("bf16").value(), StateType::kBf16);
  EXPECT_EQ(ParseStateType("fp32").value(), StateType::kF32);
  EXPECT_EQ(ParseStateType("fp16").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(StateBytes(StateType::kInt8, 1), kBlockBytes);
  EXPECT_EQ(StateBytes(StateType::kInt8, 257), 2 * kBlockBytes);
  EXPECT_EQ(StateBytes(StateType::kBf16, 257), 514u);
  EXPECT_EQ(StateBytes(StateType::kF32, 257), 1028u);
}

}  // namespace
}  // namespace zinf
