// The scalar reference: plain C++ that runs on any x86-64. Built with -ffp-contract=off and
// with std::fma wherever the SIMD variants use an FMA, so the SIMD variants can be checked
// against it bit for bit.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu_adam/kernels.h"

namespace zinf {
namespace {

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

}  // namespace

// Matches VCVTNEPS2BF16 exactly: NaN -> quiet NaN with the top payload bits; zero and
// subnormal -> signed zero; otherwise round to nearest even on the low 16 bits (a carry into
// the exponent gives the next binade or infinity, as it should).
uint16_t Fp32ToBf16(float value) {
  const uint32_t bits = FloatBits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  if ((bits & 0x7f800000u) == 0) return static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

float Bf16ToFp32(uint16_t value) { return BitsFloat(static_cast<uint32_t>(value) << 16); }

// IEEE binary32 -> binary16, round to nearest even, with binary16 subnormals (VCVTPS2PH with
// imm8 = 0). NaN -> quiet NaN keeping the top payload bits.
uint16_t Fp32ToFp16(float value) {
  uint32_t bits = FloatBits(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  bits &= 0x7fffffffu;
  if (bits >= 0x7f800000u) {  // inf or NaN
    if (bits == 0x7f800000u) return sign | 0x7c00u;
    return static_cast<uint16_t>(sign | 0x7e00u | ((bits >> 13) & 0x03ffu));
  }
  if (bits >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to infinity
  if (bits < 0x38800000u) {
    // Below the smallest normal half (2^-14): let an FP add do the rounding. Adding 0.5
    // shifts the value so that the half's subnormal bits sit at the bottom of the float's
    // mantissa, rounded to nearest even by the FPU.
    const float shifted = BitsFloat(bits) + 0.5f;
    return static_cast<uint16_t>(sign | (FloatBits(shifted) - FloatBits(0.5f)));
  }
  const uint32_t mantissa_odd = (bits >> 13) & 1u;
  bits += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + mantissa_odd;
  return static_cast<uint16_t>(sign | (bits >> 13));
}

float Fp16ToFp32(uint16_t value) {
  const uint32_t sign = static_cast<uint32_t>(value & 0x8000u) << 16;
  const uint32_t exponent = (value >> 10) & 0x1fu;
  const uint32_t mantissa = value & 0x03ffu;
  if (exponent == 0x1fu) {
    // inf, or NaN made quiet (VCVTPH2PS sets the quiet bit)
    return BitsFloat(sign | 0x7f800000u | (mantissa << 13) | (mantissa ? 0x00400000u : 0u));
  }
  if (exponent == 0) {
    // zero or subnormal: mantissa * 2^-24, exact in fp32
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return BitsFloat(sign | FloatBits(magnitude));
  }
  return BitsFloat(sign | ((exponent + (127 - 15)) << 23) | (mantissa << 13));
}

float ParamCopyToFp32(ParamCopyType type, uint16_t value) {
  switch (type) {
    case ParamCopyType::kBf16:
      return Bf16ToFp32(value);
    case ParamCopyType::kF16:
      return Fp16ToFp32(value);
    case ParamCopyType::kNone:
      break;
  }
  return std::numeric_limits<float>::quiet_NaN();
}

uint16_t Fp32ToParamCopy(ParamCopyType type, float value) {
  switch (type) {
    case ParamCopyType::kBf16:
      return Fp32ToBf16(value);
    case ParamCopyType::kF16:
      return Fp32ToFp16(value);
    case ParamCopyType::kNone:
      break;
  }
  return 0xFFFF;
}

namespace cpu_adam_internal::scalar {

struct V {
  using F = float;
  static constexpr size_t kWidth = 1;
  static F Set1(float x) { return x; }
  static F Load(const float* p) { return *p; }
  static void Store(float* p, F x) { *p = x; }
  static F LoadBf16(const uint16_t* p) { return Bf16ToFp32(*p); }
  static F LoadF16(const uint16_t* p) { return Fp16ToFp32(*p); }
  static void StoreBf16(uint16_t* p, F x) { *p = Fp32ToBf16(x); }
  static void StoreF16(uint16_t* p, F x) { *p = Fp32ToFp16(x); }
  // No streaming stores in the reference (the body never calls these when kCanStream is
  // false; they exist so that it compiles).
  static constexpr size_t kPrefetchElements = 0;  // none in the reference
  static constexpr bool kCanStream = false;
  static constexpr bool kF16Codes = false;  // int8 codes decode through CodeBitsValue
  static void StreamBf16Line(uint16_t* p, const F* x) {
    for (int i = 0; i < 32; ++i) StoreBf16(p + i, x[i]);
  }
  static void StreamF16Line(uint16_t* p, const F* x) {
    for (int i = 0; i < 32; ++i) StoreF16(p + i, x[i]);
  }
  static void StreamFence() {}
  static F Add(F a, F b) { return a + b; }
  static F Sub(F a, F b) { return a - b; }
  static F Mul(F a, F b) { return a * b; }
  static F Div(F a, F b) { return a / b; }
  static F Fma(F a, F b, F c) { return std::fma(a, b, c); }
  static F Sqrt(F a) { return std::sqrt(a); }
  static F Sign(F a) {
    if (a > 0.0f) return 1.0f;
    if (a < 0.0f) return -1.0f;
    if (a != a) return a;
    return 0.0f;
  }

  // Integer lanes for the compressed states (kernel_body.h).
  using I = int32_t;
  static I Bits(F x) { return static_cast<I>(FloatBits(x)); }
  static F FromBits(I x) { return BitsFloat(static_cast<uint32_t>(x)); }
  static I SetI(int32_t x) { return x; }
  static I AddI(I a, I b) { return static_cast<I>(static_cast<uint32_t>(a) + uint32_t(b)); }
  static I SubI(I a, I b) { return static_cast<I>(static_cast<uint32_t>(a) - uint32_t(b)); }
  static I SelectLt(F a, F b, I x, I y) { return a < b ? x : y; }
  static I AndI(I a, I b) { return a & b; }
  static I OrI(I a, I b) { return a | b; }
  static I MinI(I a, I b) { return a < b ? a : b; }
  static I MaxI(I a, I b) { return a > b ? a : b; }
  template <int k>
  static I SrlI(I a) {
    return static_cast<I>(static_cast<uint32_t>(a) >> k);
  }
  template <int k>
  static I SllI(I a) {
    return static_cast<I>(static_cast<uint32_t>(a) << k);
  }
  static F Abs(F a) { return BitsFloat(FloatBits(a) & 0x7fffffffu); }
  static F Min(F a, F b) { return a < b ? a : b; }
  static F MaxOf(F a, F b) { return a > b ? a : b; }
  static float ReduceMax(F a) { return a; }
  static I LoadU8(const uint8_t* p) { return *p; }
  static I LoadS8(const uint8_t* p) { return static_cast<int8_t>(*p); }
  static void StoreU8(uint8_t* p, I x) { *p = static_cast<uint8_t>(x); }

  // One double accumulator: a float squared is exact in double, so only the additions round.
  class SumState {
   public:
    void Add(F x) {
      const double d = x;
      sum_ += d * d;
      inf_or_nan_ = inf_or_nan_ || !std::isfinite(x);
    }
    void AddPair(F x0, F x1) {
      Add(x0);
      Add(x1);
    }
    double Sum() const { return sum_; }
    bool HasInfOrNan() const { return inf_or_nan_; }

   private:
    double sum_ = 0.0;
    bool inf_or_nan_ = false;
  };
};

}  // namespace cpu_adam_internal::scalar
}  // namespace zinf

#define ZINF_KERNEL_NS scalar
#include "cpu_adam/kernel_body.h"
#undef ZINF_KERNEL_NS

namespace zinf::cpu_adam_internal {

const KernelTable& ScalarKernels() {
  static constexpr KernelTable kTable = scalar::MakeKernelTable(KernelVariant::kScalar);
  return kTable;
}

}  // namespace zinf::cpu_adam_internal
