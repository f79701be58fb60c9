// The optimizer math, written once over a vector type V and included by each
// kernels_<variant>.cc after it defines V in namespace zinf::cpu_adam_internal::ZINF_KERNEL_NS.
//
// Why one body: every variant then performs the same sequence of IEEE operations (mul, sub,
// fma, sqrt, div: each correctly rounded), so a SIMD variant's results are bit-identical to
// the scalar reference's. The translation units are compiled with -ffp-contract=off so the
// compiler cannot fuse a mul and an add that the body keeps separate (GCC implements the
// mul/add intrinsics as plain vector arithmetic, which it would otherwise contract).
//
// V provides: F (the vector), kWidth, Set1, Load/Store (fp32), LoadBf16/LoadF16,
// StoreBf16/StoreF16, Add, Sub, Mul, Div, Fma(a, b, c) = a * b + c rounded once, Sqrt,
// Sign (1, -1, +0 for +-0, NaN for NaN), SumState (sum of squares in double + inf/NaN flag),
// and the memory hints: kCanStream with StreamBf16Line/StreamF16Line (one 64-byte line of
// copy from 32 / kWidth vectors, non-temporal) and StreamFence, and kPrefetchElements
// (software prefetch distance, 0 for none). For compressed states, an integer vector I with
// Bits/FromBits (reinterpretation), SetI, AddI, SubI, AndI, OrI, MinI, MaxI (signed),
// SrlI<k>/SllI<k> (logical shifts), SelectLt(a, b, x, y) = a < b ? x : y
// (float compare, integer result), Abs, Min(a, b) =
// a < b ? a : b and MaxOf(a, b) = a > b ? a : b (so a NaN in a gives b, as MINPS/MAXPS do),
// ReduceMax (lanes never NaN), LoadU8/LoadS8/StoreU8 (kWidth bytes, zero- or sign-extended,
// <-> the low byte of each lane), and kF16Codes: whether CodeValues<kSigned>(bytes) decodes
// kWidth codes through fp16 (see DecodeInt8).
//
// Not a normal header: no include guard on purpose, everything lands in the per-variant
// namespace so no symbol is shared between translation units built with different flags.

#ifndef ZINF_KERNEL_NS
#error "define ZINF_KERNEL_NS and the vector type V before including kernel_body.h"
#endif

#include <xmmintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>

namespace zinf::cpu_adam_internal::ZINF_KERNEL_NS {

#define ZINF_KERNEL_INLINE inline __attribute__((always_inline))

template <GradType G>
struct GradElem {
  using T = uint16_t;
};
template <>
struct GradElem<GradType::kF32> {
  using T = float;
};

template <GradType G>
ZINF_KERNEL_INLINE typename V::F LoadGrad(const typename GradElem<G>::T* g) {
  if constexpr (G == GradType::kF32) {
    return V::Load(g);
  } else if constexpr (G == GradType::kBf16) {
    return V::LoadBf16(g);
  } else {
    return V::LoadF16(g);
  }
}

template <ParamCopyType O>
ZINF_KERNEL_INLINE void StoreCopy(uint16_t* out, typename V::F p) {
  if constexpr (O == ParamCopyType::kBf16) {
    V::StoreBf16(out, p);
  } else if constexpr (O == ParamCopyType::kF16) {
    V::StoreF16(out, p);
  }
}

// The copy of one block (kBlock elements: one 64-byte line of 16-bit values) written with
// non-temporal stores of whole lines. REQUIRES out 64-byte aligned. The copy is read next by
// a DMA engine or another core, never by this loop: a streaming store skips the read that an
// ordinary store to an uncached line costs (2 of the 30 bytes that would move per element),
// and whole-line streaming stores measured faster than half-line ones.
template <ParamCopyType O>
ZINF_KERNEL_INLINE void StreamCopyBlock(uint16_t* out, const typename V::F* params) {
  if constexpr (O == ParamCopyType::kBf16) {
    V::StreamBf16Line(out, params);
  } else if constexpr (O == ParamCopyType::kF16) {
    V::StreamF16Line(out, params);
  }
}

// Whether the copy of [begin, ...) can be streamed: the variant can, and the block starts
// are 64-byte aligned (tiles start on multiples of 256 elements, so this holds whenever the
// buffer itself is).
template <ParamCopyType O>
ZINF_KERNEL_INLINE bool CanStreamCopy(const void* out, size_t begin) {
  if constexpr (O == ParamCopyType::kNone || !V::kCanStream) {
    return false;
  } else {
    const auto addr = reinterpret_cast<uintptr_t>(static_cast<const uint16_t*>(out) + begin);
    return addr % 64 == 0;
  }
}

// The coefficients broadcast once per kernel call.
struct Consts {
  explicit Consts(const StepCoefficients& c)
      : grad_scale(V::Set1(c.grad_scale)),
        l2_decay(V::Set1(c.l2_decay)),
        param_decay(V::Set1(c.param_decay)),
        beta1(V::Set1(c.beta1)),
        one_minus_beta1(V::Set1(c.one_minus_beta1)),
        beta2(V::Set1(c.beta2)),
        one_minus_beta2(V::Set1(c.one_minus_beta2)),
        neg_step_size(V::Set1(c.neg_step_size)),
        inv_bias_correction2_sqrt(V::Set1(c.inv_bias_correction2_sqrt)),
        eps(V::Set1(c.eps)) {}
  typename V::F grad_scale, l2_decay, param_decay, beta1, one_minus_beta1, beta2, one_minus_beta2,
      neg_step_size, inv_bias_correction2_sqrt, eps;
};

// One vector of elements. The formulas follow torch's single-tensor implementations:
//   Adam:    g += wd * p                       AdamW: p *= 1 - lr * wd
//            m = lerp(m, g, 1 - beta1)  (torch: exp_avg.lerp_(grad, 1 - beta1))
//            v = beta2 * v + (1 - beta2) * g * g
//            p += -lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
//   Adagrad: g += wd * p;  s += g * g;  p += -clr * g / (sqrt(s) + eps)
//   Lion:    p *= 1 - lr * wd;  p += -lr * sign(beta1 * m + (1 - beta1) * g);
//            m = beta2 * m + (1 - beta2) * g
// with the rounding points written out below (torch's own vectorized kernels round at about
// the same points; the 1 / sqrt(bc2) multiply replaces torch's division by sqrt(bc2)).
// Returns the updated parameters (already stored to p) for the caller to copy.
template <OptimizerKind K, GradType G, bool kWeightDecay>
ZINF_KERNEL_INLINE typename V::F UpdateInRegisters(const Consts& k, float* p,
                                                   const typename GradElem<G>::T* g,
                                                   typename V::F& s1, typename V::F& s2) {
  using F = typename V::F;
  F grad = V::Mul(LoadGrad<G>(g), k.grad_scale);
  F param = V::Load(p);
  if constexpr (kWeightDecay) {
    if constexpr (K == OptimizerKind::kAdam || K == OptimizerKind::kAdagrad) {
      grad = V::Fma(k.l2_decay, param, grad);
    } else {
      param = V::Mul(param, k.param_decay);
    }
  }
  if constexpr (K == OptimizerKind::kAdam || K == OptimizerKind::kAdamW) {
    const F m = V::Fma(k.one_minus_beta1, V::Sub(grad, s1), s1);
    const F v = V::Fma(V::Mul(k.one_minus_beta2, grad), grad, V::Mul(k.beta2, s2));
    F denom = V::Fma(V::Sqrt(v), k.inv_bias_correction2_sqrt, k.eps);
    param = V::Fma(k.neg_step_size, V::Div(m, denom), param);
    s1 = m;
    s2 = v;
  } else if constexpr (K == OptimizerKind::kAdagrad) {
    const F sum = V::Fma(grad, grad, s1);
    F denom = V::Add(V::Sqrt(sum), k.eps);
    param = V::Fma(k.neg_step_size, V::Div(grad, denom), param);
    s1 = sum;
  } else {
    static_assert(K == OptimizerKind::kLion);
    const F m = s1;
    F c = V::Fma(k.beta1, m, V::Mul(k.one_minus_beta1, grad));
    param = V::Fma(k.neg_step_size, V::Sign(c), param);
    s1 = V::Fma(k.beta2, m, V::Mul(k.one_minus_beta2, grad));
  }
  V::Store(p, param);
  return param;
}

template <OptimizerKind K>
inline constexpr bool kHasState2 = K == OptimizerKind::kAdam || K == OptimizerKind::kAdamW;

// The same on states in memory (fp32).
template <OptimizerKind K, GradType G, bool kWeightDecay>
ZINF_KERNEL_INLINE typename V::F UpdateVector(const Consts& k, float* p,
                                              const typename GradElem<G>::T* g, float* s1,
                                              float* s2) {
  typename V::F m = V::Load(s1);
  typename V::F v = m;  // unused without a second state
  if constexpr (kHasState2<K>) v = V::Load(s2);
  const typename V::F param = UpdateInRegisters<K, G, kWeightDecay>(k, p, g, m, v);
  V::Store(s1, m);
  if constexpr (kHasState2<K>) V::Store(s2, v);
  return param;
}

inline constexpr size_t kFloatsPerLine = 64 / sizeof(float);
// The main loop's step: one 64-byte line of each 16-bit stream, two of each fp32 stream.
inline constexpr size_t kBlock = 2 * kFloatsPerLine;

// Software prefetch of the block at `at`, issued kPrefetchElements ahead: with 4 to 8 streams
// in flight a single core's hardware prefetchers fall short of the memory bandwidth (measured:
// 2-5 % on Zen 5). Read-write streams are fetched with write intent. A hint only.
template <OptimizerKind K, GradType G>
ZINF_KERNEL_INLINE void PrefetchBlock(const float* p, const typename GradElem<G>::T* g,
                                      const float* s1, const float* s2, size_t at) {
  for (size_t line = at; line < at + kBlock; line += kFloatsPerLine) {
    __builtin_prefetch(p + line, 1, 3);
    __builtin_prefetch(s1 + line, 1, 3);
    if constexpr (kHasState2<K>) __builtin_prefetch(s2 + line, 1, 3);
    if constexpr (G == GradType::kF32) __builtin_prefetch(g + line, 0, 3);
  }
  if constexpr (G != GradType::kF32) __builtin_prefetch(g + at, 0, 3);
}

template <OptimizerKind K, GradType G, ParamCopyType O, bool kWeightDecay, bool kStream>
void StepLoop(const StepCoefficients& c, const StepBuffers& b, size_t begin, size_t end) {
  using GT = typename GradElem<G>::T;
  constexpr size_t W = V::kWidth;
  const Consts k(c);
  float* const p = b.param;
  const GT* const g = static_cast<const GT*>(b.grad);
  float* const s1 = b.state1;
  float* const s2 = b.state2;
  uint16_t* const out = static_cast<uint16_t*>(b.param_copy);
  size_t i = begin;
  // Whole blocks first: one line of each 16-bit stream per iteration.
  for (; i + kBlock <= end; i += kBlock) {
    if constexpr (V::kPrefetchElements > 0) {
      if (i + V::kPrefetchElements + kBlock <= end) {
        PrefetchBlock<K, G>(p, g, s1, s2, i + V::kPrefetchElements);
      }
    }
    typename V::F params[kBlock / W];
    for (size_t v = 0; v < kBlock / W; ++v) {
      const size_t j = i + v * W;
      params[v] = UpdateVector<K, G, kWeightDecay>(k, p + j, g + j, s1 + j,
                                                   kHasState2<K> ? s2 + j : nullptr);
      if constexpr (O != ParamCopyType::kNone && !kStream) StoreCopy<O>(out + j, params[v]);
    }
    if constexpr (O != ParamCopyType::kNone && kStream) StreamCopyBlock<O>(out + i, params);
  }
  for (; i + W <= end; i += W) {
    const typename V::F param =
        UpdateVector<K, G, kWeightDecay>(k, p + i, g + i, s1 + i, kHasState2<K> ? s2 + i : nullptr);
    if constexpr (O != ParamCopyType::kNone) StoreCopy<O>(out + i, param);
  }
  if constexpr (W > 1) {
    if (i < end) {
      // The tail runs through the same vector code on zero-padded copies; the padding lanes
      // compute harmless values (0 / eps or 0 / 0) that are never copied back.
      const size_t rem = end - i;
      alignas(64) float tp[W] = {};
      alignas(64) GT tg[W] = {};
      alignas(64) float ts1[W] = {};
      alignas(64) float ts2[W] = {};
      alignas(64) uint16_t tout[W] = {};
      std::memcpy(tp, p + i, rem * sizeof(float));
      std::memcpy(tg, g + i, rem * sizeof(GT));
      std::memcpy(ts1, s1 + i, rem * sizeof(float));
      if constexpr (kHasState2<K>) std::memcpy(ts2, s2 + i, rem * sizeof(float));
      StoreCopy<O>(tout, UpdateVector<K, G, kWeightDecay>(k, tp, tg, ts1, ts2));
      std::memcpy(p + i, tp, rem * sizeof(float));
      std::memcpy(s1 + i, ts1, rem * sizeof(float));
      if constexpr (kHasState2<K>) std::memcpy(s2 + i, ts2, rem * sizeof(float));
      if constexpr (O != ParamCopyType::kNone) std::memcpy(out + i, tout, rem * sizeof(uint16_t));
    }
  }
}

template <OptimizerKind K, GradType G, ParamCopyType O>
void StepKernel(const StepCoefficients& c, const StepBuffers& b, size_t begin, size_t end) {
  const bool stream = CanStreamCopy<O>(b.param_copy, begin);
  if (c.has_weight_decay) {
    if (stream) {
      StepLoop<K, G, O, true, true>(c, b, begin, end);
    } else {
      StepLoop<K, G, O, true, false>(c, b, begin, end);
    }
  } else {
    if (stream) {
      StepLoop<K, G, O, false, true>(c, b, begin, end);
    } else {
      StepLoop<K, G, O, false, false>(c, b, begin, end);
    }
  }
  // Streaming stores are weakly ordered: fence them before the caller publishes the copy.
  if (stream) V::StreamFence();
}

// ---- Compressed states (StateType kBf16, kInt8) -------------------------------------------
//
// A block of kInt8StateBlock elements at a time: its states are decoded into two local fp32
// arrays, StepLoop runs on them exactly as on fp32 states (the same math, bit for bit, given
// the decoded values), and they are encoded back. The int8 block is one scale and the codes of
// a small float (4 exponent bits, kMan mantissa bits, bias 15: the largest code is
// 2 - 2^-kMan, the smallest normal 2^-14, subnormals down to 2^-(14 + kMan)), scaled so that
// the block's largest magnitude is the largest code.

inline constexpr size_t kQBlock = kInt8StateBlock;
inline constexpr size_t kQBlockBytes = kQBlock + sizeof(float);  // codes, then the scale

template <int kMan>
struct SmallFloat {
  static constexpr float kMax = 2.0f - 1.0f / (1 << kMan);
};

// The code of each y in [0, kMax] (not NaN), rounded to nearest even by the fp32 adder. With
// e = y's binade, floored at the smallest normal's (-14), y + 2^(e + 23 - kMan) rounds y to a
// multiple of 2^(e - kMan): the code grid in that binade, and below 2^-14 the subnormal codes'
// grid. A carry into the next binade is the next code, as it should be. The sum's mantissa
// field is then the code's mantissa with its implicit bit (2^kMan + m; below 2^-14 the code
// itself), and the code is that plus (e + 14) << kMan.
template <int kMan>
ZINF_KERNEL_INLINE typename V::I EncodeMagnitude(typename V::F y) {
  using I = typename V::I;
  const I binade = V::MaxI(V::AndI(V::Bits(y), V::SetI(0x7f800000)), V::SetI((127 - 14) << 23));
  const I sum = V::Bits(V::Add(y, V::FromBits(V::AddI(binade, V::SetI((23 - kMan) << 23)))));
  // The sum's exponent field is E = e + 150 - kMan, and sum >> (23 - kMan) is E << kMan (its
  // mantissa field is below 2^(kMan + 1)): (e + 14) << kMan = (E << kMan) - ((136 - kMan) << kMan).
  return V::SubI(V::AddI(V::AndI(sum, V::SetI(0x7fffff)), V::template SrlI<23 - kMan>(sum)),
                 V::SetI((136 - kMan) << kMan));
}

// The fp32 value of a code whose bits sit in an fp32 word `bits` at the fp32 mantissa's top
// (exponent field = the code's exponent, mantissa = the code's mantissa bits): read as fp32
// that is the code's value times 2^-112, an fp32 subnormal exactly when the code is one, so
// one exact multiply by 2^112 gives the value for normal and subnormal codes alike.
ZINF_KERNEL_INLINE typename V::F CodeBitsValue(typename V::I bits) {
  return V::Mul(V::FromBits(bits), V::Set1(0x1p112f));
}

// Signed states (a first moment): sign + 4 exponent + 3 mantissa bits. Unsigned (a second
// moment, never negative): 4 + 4 bits, and a positive value never takes the code of zero.
template <bool kSigned>
inline constexpr int kManBits = kSigned ? 3 : 4;

// One vector of codes, decoded and multiplied by the block's scale d.
//
// The SIMD variants (V::kF16Codes) place the same bits on an fp16 instead (sign on bit 15, the
// exponent on bits 13-10, the mantissa below it): the fp16 exponent bias is 15 and its
// subnormals are 0.m * 2^-14, so that fp16 has the code's value, and VCVTPH2PS converts it
// exactly. The result is the same; the fp16 path only avoids fp32 subnormal inputs, which cost
// microcode on some CPUs.
template <bool kSigned, typename VV = V>  // VV: CodeValues is looked up only when it exists
ZINF_KERNEL_INLINE typename V::F DecodeInt8(const uint8_t* codes, typename V::F d) {
  if constexpr (VV::kF16Codes) return V::Mul(VV::template CodeValues<kSigned>(codes), d);
  constexpr int M = kManBits<kSigned>;
  typename V::I bits;
  if constexpr (kSigned) {
    // Sign-extended, shifted: the magnitude lands on bits 20-26 and copies of the sign on
    // bits 27-31, of which the mask keeps bit 31.
    bits = V::AndI(V::template SllI<23 - M>(V::LoadS8(codes)),
                   V::SetI(int32_t(0x80000000u | (0x7fu << (23 - M)))));
  } else {
    bits = V::template SllI<23 - M>(V::LoadU8(codes));
  }
  return V::Mul(CodeBitsValue(bits), d);
}

ZINF_KERNEL_INLINE typename V::F BlockScale(const uint8_t* block) {
  float scale;
  std::memcpy(&scale, block + kQBlock, sizeof(scale));
  return V::Set1(scale);
}

template <bool kSigned>
ZINF_KERNEL_INLINE void DecodeInt8Block(const uint8_t* block, float* out) {
  const typename V::F d = BlockScale(block);
  for (size_t j = 0; j < kQBlock; j += V::kWidth) {
    V::Store(out + j, DecodeInt8<kSigned>(block + j, d));
  }
}

// How a block of values whose largest magnitude (NaN passed over) is `a` is encoded: its
// scale and the factor that maps |x| onto [0, kMax]. `zero`: every code and the scale are 0
// (a is 0, or too small for any scale).
struct Int8Encoder {
  bool zero;
  float scale;      // decode: code value * scale
  typename V::F r;  // encode: |x| * r, at most kMax
};

template <bool kSigned>
ZINF_KERNEL_INLINE Int8Encoder MakeInt8Encoder(float a) {
  using C = SmallFloat<kManBits<kSigned>>;
  if (!(a <= std::numeric_limits<float>::max())) a = std::numeric_limits<float>::max();
  if (!(a >= std::numeric_limits<float>::min())) return {true, 0.0f, V::Set1(0.0f)};
  return {false, a / C::kMax, V::Set1(C::kMax / a)};
}

// The codes of in[0, kWidth) into codes[0, kWidth). With a zero encoder they are garbage that
// FinishInt8Block overwrites.
template <bool kSigned>
ZINF_KERNEL_INLINE void EncodeInt8Vector(const Int8Encoder& e, const float* in, uint8_t* codes) {
  constexpr int M = kManBits<kSigned>;
  const typename V::F x = V::Load(in);
  const typename V::F y =
      V::Min(V::Mul(V::Abs(x), e.r), V::Set1(SmallFloat<M>::kMax));  // inf, NaN -> kMax
  typename V::I c = EncodeMagnitude<M>(y);
  if constexpr (kSigned) {
    c = V::OrI(c, V::template SrlI<24>(V::AndI(V::Bits(x), V::SetI(int32_t(0x80000000u)))));
  } else {
    c = V::MaxI(c, V::MinI(V::Bits(y), V::SetI(1)));  // y > 0: at least code 1
  }
  V::StoreU8(codes, c);
}

// Stores the block's scale once its codes are encoded (a zero block: codes and scale are 0).
ZINF_KERNEL_INLINE void FinishInt8Block(const Int8Encoder& e, uint8_t* block) {
  if (e.zero) {
    std::memset(block, 0, kQBlockBytes);  // zeros (and values too small for any scale)
    return;
  }
  std::memcpy(block + kQBlock, &e.scale, sizeof(e.scale));
}

// Encodes a block of values whose largest magnitude (NaN passed over) is `a`.
template <bool kSigned>
ZINF_KERNEL_INLINE void EncodeInt8Codes(const float* in, float a, uint8_t* block) {
  const Int8Encoder e = MakeInt8Encoder<kSigned>(a);
  if (!e.zero) {
    for (size_t j = 0; j < kQBlock; j += V::kWidth) EncodeInt8Vector<kSigned>(e, in + j, block + j);
  }
  FinishInt8Block(e, block);
}

template <bool kSigned>
ZINF_KERNEL_INLINE void EncodeInt8Block(const float* in, uint8_t* block) {
  typename V::F largest = V::Set1(0.0f);
  for (size_t j = 0; j < kQBlock; j += V::kWidth) {
    largest = V::MaxOf(V::Abs(V::Load(in + j)), largest);  // a NaN is passed over
  }
  EncodeInt8Codes<kSigned>(in, V::ReduceMax(largest), block);
}

// bf16 states: [0, len) of a block, whole vectors and then a zero-padded one.
ZINF_KERNEL_INLINE void DecodeBf16(const uint16_t* in, size_t len, float* out) {
  size_t j = 0;
  for (; j + V::kWidth <= len; j += V::kWidth) V::Store(out + j, V::LoadBf16(in + j));
  if (j < len) {
    alignas(64) uint16_t t[V::kWidth] = {};
    std::memcpy(t, in + j, (len - j) * sizeof(uint16_t));
    V::Store(out + j, V::LoadBf16(t));
  }
}

ZINF_KERNEL_INLINE void EncodeBf16(const float* in, size_t len, uint16_t* out) {
  size_t j = 0;
  for (; j + V::kWidth <= len; j += V::kWidth) V::StoreBf16(out + j, V::Load(in + j));
  if (j < len) {
    alignas(64) uint16_t t[V::kWidth];
    V::StoreBf16(t, V::Load(in + j));
    std::memcpy(out + j, t, (len - j) * sizeof(uint16_t));
  }
}

template <StateType S, bool kSigned>
ZINF_KERNEL_INLINE void DecodeState(const void* q, size_t at, size_t len, float* out) {
  if constexpr (S == StateType::kBf16) {
    DecodeBf16(static_cast<const uint16_t*>(q) + at, len, out);
  } else {
    static_assert(S == StateType::kInt8);
    DecodeInt8Block<kSigned>(static_cast<const uint8_t*>(q) + at / kQBlock * kQBlockBytes, out);
    // The stored padding of a last, partial block is not trusted: the block's scale comes
    // from [0, len) only.
    if (len < kQBlock) std::memset(out + len, 0, (kQBlock - len) * sizeof(float));
  }
}

template <StateType S, bool kSigned>
ZINF_KERNEL_INLINE void EncodeState(const float* in, size_t at, size_t len, void* q) {
  if constexpr (S == StateType::kBf16) {
    EncodeBf16(in, len, static_cast<uint16_t*>(q) + at);
  } else {
    EncodeInt8Block<kSigned>(in, static_cast<uint8_t*>(q) + at / kQBlock * kQBlockBytes);
  }
}

// An int8 block updated but not yet encoded: its new states (in the loop's s1/s2 buffers) and
// their encoders, encoded vector by vector while the next block updates.
template <OptimizerKind K>
struct PendingInt8Block {
  uint8_t* block1 = nullptr;  // nullptr: nothing pending
  uint8_t* block2 = nullptr;
  const float* s1 = nullptr;
  const float* s2 = nullptr;
  Int8Encoder e1{};
  Int8Encoder e2{};
};

template <OptimizerKind K>
ZINF_KERNEL_INLINE void EncodePendingVector(const PendingInt8Block<K>& q, size_t j) {
  EncodeInt8Vector<K != OptimizerKind::kAdagrad>(q.e1, q.s1 + j, q.block1 + j);
  if constexpr (kHasState2<K>) EncodeInt8Vector<false>(q.e2, q.s2 + j, q.block2 + j);
}

template <OptimizerKind K>
ZINF_KERNEL_INLINE void FinishPending(PendingInt8Block<K>* q) {
  FinishInt8Block(q->e1, q->block1);
  if constexpr (kHasState2<K>) FinishInt8Block(q->e2, q->block2);
  q->block1 = nullptr;
}

template <OptimizerKind K>
ZINF_KERNEL_INLINE void FlushPending(PendingInt8Block<K>* q) {
  if (q->block1 == nullptr) return;
  for (size_t j = 0; j < kQBlock; j += V::kWidth) EncodePendingVector(*q, j);
  FinishPending(q);
}

// A whole block in one pass: each vector's states are decoded into registers and updated with
// the parameters; bf16 states are stored encoded right away. int8 ones are kept in s1/s2 with
// the block's largest magnitudes, and are encoded during the next block's pass (`pending`):
// interleaved with the update's divisions and square roots, the encoding fills issue slots
// the update leaves idle (measured in cache: 0.43 -> 0.41 ns/elem; the core stays
// issue-bound). The order of the stores to different blocks changes, not their values.
template <OptimizerKind K, GradType G, ParamCopyType O, StateType S, bool kWeightDecay,
          bool kStream>
ZINF_KERNEL_INLINE void CompressedWholeBlock(const Consts& k, const StepBuffers& b, size_t at,
                                             float* s1, float* s2,
                                             [[maybe_unused]] PendingInt8Block<K>* pending) {
  using GT = typename GradElem<G>::T;
  using F = typename V::F;
  constexpr size_t W = V::kWidth;
  constexpr bool kSigned1 = K != OptimizerKind::kAdagrad;
  float* const p = b.param + at;
  const GT* const g = static_cast<const GT*>(b.grad) + at;
  uint16_t* const out =
      O != ParamCopyType::kNone ? static_cast<uint16_t*>(b.param_copy) + at : nullptr;
  [[maybe_unused]] uint16_t* h1 = nullptr;
  [[maybe_unused]] uint16_t* h2 = nullptr;
  [[maybe_unused]] uint8_t* block1 = nullptr;
  [[maybe_unused]] uint8_t* block2 = nullptr;
  [[maybe_unused]] F d1 = V::Set1(0.0f);
  [[maybe_unused]] F d2 = V::Set1(0.0f);
  // A local copy: the code stores may alias anything, so *pending would be reloaded per vector.
  [[maybe_unused]] PendingInt8Block<K> q;
  if constexpr (S == StateType::kBf16) {
    h1 = static_cast<uint16_t*>(b.q1) + at;
    if constexpr (kHasState2<K>) h2 = static_cast<uint16_t*>(b.q2) + at;
  } else {
    block1 = static_cast<uint8_t*>(b.q1) + at / kQBlock * kQBlockBytes;
    d1 = BlockScale(block1);
    if constexpr (kHasState2<K>) {
      block2 = static_cast<uint8_t*>(b.q2) + at / kQBlock * kQBlockBytes;
      d2 = BlockScale(block2);
    }
    q = *pending;
  }
  F largest1 = V::Set1(0.0f);
  F largest2 = V::Set1(0.0f);
  for (size_t i = 0; i < kQBlock; i += kBlock) {
    F params[kBlock / W];
    for (size_t u = 0; u < kBlock / W; ++u) {
      const size_t j = i + u * W;
      F m, v;
      if constexpr (S == StateType::kBf16) {
        m = V::LoadBf16(h1 + j);
        v = m;
        if constexpr (kHasState2<K>) v = V::LoadBf16(h2 + j);
      } else {
        m = DecodeInt8<kSigned1>(block1 + j, d1);
        v = m;
        if constexpr (kHasState2<K>) v = DecodeInt8<false>(block2 + j, d2);
      }
      params[u] = UpdateInRegisters<K, G, kWeightDecay>(k, p + j, g + j, m, v);
      if constexpr (O != ParamCopyType::kNone && !kStream) StoreCopy<O>(out + j, params[u]);
      if constexpr (S == StateType::kBf16) {
        V::StoreBf16(h1 + j, m);
        if constexpr (kHasState2<K>) V::StoreBf16(h2 + j, v);
      } else {
        V::Store(s1 + j, m);
        largest1 = V::MaxOf(V::Abs(m), largest1);  // a NaN is passed over
        if constexpr (kHasState2<K>) {
          V::Store(s2 + j, v);
          largest2 = V::MaxOf(V::Abs(v), largest2);
        }
        if (q.block1 != nullptr) EncodePendingVector(q, j);
      }
    }
    if constexpr (O != ParamCopyType::kNone && kStream) StreamCopyBlock<O>(out + i, params);
  }
  if constexpr (S == StateType::kInt8) {
    if (q.block1 != nullptr) FinishPending(&q);
    pending->block1 = block1;
    pending->block2 = block2;
    pending->s1 = s1;
    pending->s2 = s2;
    pending->e1 = MakeInt8Encoder<kSigned1>(V::ReduceMax(largest1));
    if constexpr (kHasState2<K>) pending->e2 = MakeInt8Encoder<false>(V::ReduceMax(largest2));
  }
}

template <OptimizerKind K, GradType G, ParamCopyType O, StateType S, bool kWeightDecay,
          bool kStream>
void CompressedStepLoop(const StepCoefficients& c, const StepBuffers& b, size_t begin, size_t end) {
  using GT = typename GradElem<G>::T;
  constexpr bool kSigned1 = K != OptimizerKind::kAdagrad;
  // Two sets of state buffers: one block's new states wait in one while the next updates into
  // the other.
  alignas(64) float s1[2][kQBlock];
  alignas(64) float s2[2][kQBlock];
  PendingInt8Block<K> pending;
  int buffer = 0;
  const Consts k(c);
  for (size_t at = begin; at < end; at += kQBlock) {
    const size_t len = std::min(kQBlock, end - at);
    if (len == kQBlock) {
      CompressedWholeBlock<K, G, O, S, kWeightDecay, kStream>(k, b, at, s1[buffer], s2[buffer],
                                                              &pending);
      buffer ^= 1;
      continue;
    }
    if constexpr (S == StateType::kInt8) FlushPending(&pending);
    // The last, partial block: decoded, stepped by StepLoop (which handles the vector tail),
    // encoded.
    DecodeState<S, kSigned1>(b.q1, at, len, s1[0]);
    if constexpr (kHasState2<K>) DecodeState<S, false>(b.q2, at, len, s2[0]);
    StepBuffers local;
    local.param = b.param + at;
    local.grad = static_cast<const GT*>(b.grad) + at;
    local.state1 = s1[0];
    local.state2 = s2[0];
    if constexpr (O != ParamCopyType::kNone) {
      local.param_copy = static_cast<uint16_t*>(b.param_copy) + at;
    }
    StepLoop<K, G, O, kWeightDecay, kStream>(c, local, 0, len);
    EncodeState<S, kSigned1>(s1[0], at, len, b.q1);
    if constexpr (kHasState2<K>) EncodeState<S, false>(s2[0], at, len, b.q2);
  }
  if constexpr (S == StateType::kInt8) FlushPending(&pending);
}

// A thread with denormals-are-zero or flush-to-zero set (by torch.set_flush_denormal, or a
// library built with -ffast-math) would change the results: the scalar int8 decode reads
// subnormal codes as fp32 subnormals (CodeBitsValue) and would read them as 0 (a second moment
// of 0 divides the first by eps alone), small scales may be subnormal, and a subnormal value on
// its way to a code would flush to 0. The compressed kernels clear both MXCSR bits while they
// run and restore them after (MXCSR is per thread).
class ExactSubnormals {
 public:
  ExactSubnormals() : saved_(_mm_getcsr()) {
    if ((saved_ & kFlushBits) != 0) _mm_setcsr(saved_ & ~kFlushBits);
  }
  ~ExactSubnormals() {
    if ((saved_ & kFlushBits) != 0) _mm_setcsr(saved_);
  }
  ExactSubnormals(const ExactSubnormals&) = delete;
  ExactSubnormals& operator=(const ExactSubnormals&) = delete;

 private:
  static constexpr unsigned kFlushBits = 0x8040;  // FTZ (bit 15), DAZ (bit 6)
  const unsigned saved_;
};

template <OptimizerKind K, GradType G, ParamCopyType O, StateType S>
void CompressedStepKernel(const StepCoefficients& c, const StepBuffers& b, size_t begin,
                          size_t end) {
  const ExactSubnormals exact;
  const bool stream = CanStreamCopy<O>(b.param_copy, begin);
  if (c.has_weight_decay) {
    if (stream) {
      CompressedStepLoop<K, G, O, S, true, true>(c, b, begin, end);
    } else {
      CompressedStepLoop<K, G, O, S, true, false>(c, b, begin, end);
    }
  } else {
    if (stream) {
      CompressedStepLoop<K, G, O, S, false, true>(c, b, begin, end);
    } else {
      CompressedStepLoop<K, G, O, S, false, false>(c, b, begin, end);
    }
  }
  if (stream) V::StreamFence();
}

// A state of n elements (a buffer of its own: its first block starts at element 0) decoded to
// fp32 / encoded from fp32, as a step decodes and stores it. kSigned: a first moment.
template <StateType S, bool kSigned>
void DecodeStateKernel(const void* q, size_t n, float* out) {
  const ExactSubnormals exact;
  alignas(64) float block[kQBlock];
  for (size_t at = 0; at < n; at += kQBlock) {
    const size_t len = std::min(kQBlock, n - at);
    DecodeState<S, kSigned>(q, at, len, block);
    std::memcpy(out + at, block, len * sizeof(float));
  }
}

template <StateType S, bool kSigned>
void EncodeStateKernel(const float* in, size_t n, void* q) {
  const ExactSubnormals exact;
  alignas(64) float block[kQBlock];
  for (size_t at = 0; at < n; at += kQBlock) {
    const size_t len = std::min(kQBlock, n - at);
    std::memcpy(block, in + at, len * sizeof(float));
    if (len < kQBlock) std::memset(block + len, 0, (kQBlock - len) * sizeof(float));
    EncodeState<S, kSigned>(block, at, len, q);
  }
}

template <GradType G>
void SumSquaresKernel(const void* grad, size_t begin, size_t end, double* sum_squares,
                      bool* has_inf_or_nan) {
  using GT = typename GradElem<G>::T;
  constexpr size_t W = V::kWidth;
  const GT* g = static_cast<const GT*>(grad);
  typename V::SumState state;
  size_t i = begin;
  for (; i + 2 * W <= end; i += 2 * W) state.AddPair(LoadGrad<G>(g + i), LoadGrad<G>(g + i + W));
  for (; i + W <= end; i += W) state.Add(LoadGrad<G>(g + i));
  if constexpr (W > 1) {
    if (i < end) {
      alignas(64) GT tg[W] = {};  // zeros add nothing
      std::memcpy(tg, g + i, (end - i) * sizeof(GT));
      state.Add(LoadGrad<G>(tg));
    }
  }
  *sum_squares += state.Sum();
  *has_inf_or_nan = *has_inf_or_nan || state.HasInfOrNan();
}

// An inf or a NaN has an exponent field of all ones: adding one to the field carries into the
// bit above it only then. OR-ing those sums needs no branch and no compare, so the loop is
// vectorized in each variant's instruction set.
template <GradType G>
bool AllFiniteKernel(const void* grad, size_t begin, size_t end) {
  const char* bytes = static_cast<const char*>(grad);
  if constexpr (G == GradType::kF32) {
    uint32_t acc = 0;
    for (size_t i = begin; i < end; ++i) {
      uint32_t u;
      std::memcpy(&u, bytes + i * 4, 4);
      acc |= (u & 0x7f800000u) + 0x00800000u;
    }
    return (acc & 0x80000000u) == 0;
  } else {
    // bf16: 8 exponent bits at 0x7f80; fp16: 5 at 0x7c00. Either carries into 0x8000.
    constexpr uint16_t kMask = G == GradType::kBf16 ? 0x7f80 : 0x7c00;
    constexpr uint16_t kOne = G == GradType::kBf16 ? 0x0080 : 0x0400;
    uint16_t acc = 0;
    for (size_t i = begin; i < end; ++i) {
      uint16_t u;
      std::memcpy(&u, bytes + i * 2, 2);
      acc = static_cast<uint16_t>(acc | static_cast<uint16_t>((u & kMask) + kOne));
    }
    return (acc & 0x8000u) == 0;
  }
}

template <ParamCopyType O, bool kStream>
void ConvertLoop(const float* src, uint16_t* out, size_t begin, size_t end) {
  constexpr size_t W = V::kWidth;
  for (size_t i = begin; i + kBlock <= end; i += kBlock) {
    if constexpr (V::kPrefetchElements > 0) {
      if (i + V::kPrefetchElements + kBlock <= end) {
        __builtin_prefetch(src + i + V::kPrefetchElements, 0, 3);
        __builtin_prefetch(src + i + V::kPrefetchElements + kFloatsPerLine, 0, 3);
      }
    }
    typename V::F values[kBlock / W];
    for (size_t v = 0; v < kBlock / W; ++v) {
      values[v] = V::Load(src + i + v * W);
      if constexpr (!kStream) StoreCopy<O>(out + i + v * W, values[v]);
    }
    if constexpr (kStream) StreamCopyBlock<O>(out + i, values);
  }
}

// The separate conversion pass, with the same store policy as the fused step's copy.
template <ParamCopyType O>
void ConvertKernel(const float* src, void* dst, size_t begin, size_t end) {
  constexpr size_t W = V::kWidth;
  uint16_t* out = static_cast<uint16_t*>(dst);
  const size_t block_end = begin + (end - begin) / kBlock * kBlock;
  if (CanStreamCopy<O>(dst, begin)) {
    ConvertLoop<O, true>(src, out, begin, block_end);
    V::StreamFence();
  } else {
    ConvertLoop<O, false>(src, out, begin, block_end);
  }
  size_t i = block_end;
  for (; i + W <= end; i += W) StoreCopy<O>(out + i, V::Load(src + i));
  if constexpr (W > 1) {
    if (i < end) {
      const size_t rem = end - i;
      alignas(64) float ts[W] = {};
      alignas(64) uint16_t tout[W] = {};
      std::memcpy(ts, src + i, rem * sizeof(float));
      StoreCopy<O>(tout, V::Load(ts));
      std::memcpy(out + i, tout, rem * sizeof(uint16_t));
    }
  }
}

template <OptimizerKind K, GradType G, ParamCopyType O>
constexpr void FillStateTypes(KernelTable& t) {
  auto& slot = t.step[int(K)][int(G)][int(O)];
  slot[int(StateType::kF32)] = &StepKernel<K, G, O>;
  slot[int(StateType::kBf16)] = &CompressedStepKernel<K, G, O, StateType::kBf16>;
  if constexpr (K != OptimizerKind::kAdagrad) {
    slot[int(StateType::kInt8)] = &CompressedStepKernel<K, G, O, StateType::kInt8>;
  } else {
    slot[int(StateType::kInt8)] = nullptr;  // refused by ValidateOptimizerStep
  }
}

template <OptimizerKind K, GradType G>
constexpr void FillCopyTypes(KernelTable& t) {
  FillStateTypes<K, G, ParamCopyType::kNone>(t);
  FillStateTypes<K, G, ParamCopyType::kBf16>(t);
  FillStateTypes<K, G, ParamCopyType::kF16>(t);
}

template <OptimizerKind K>
constexpr void FillGradTypes(KernelTable& t) {
  FillCopyTypes<K, GradType::kF32>(t);
  FillCopyTypes<K, GradType::kBf16>(t);
  FillCopyTypes<K, GradType::kF16>(t);
}

// constexpr so that each variant's table is constant data: fetching the table of a variant
// the CPU lacks runs none of that variant's instructions.
constexpr KernelTable MakeKernelTable(KernelVariant variant) {
  KernelTable t{};
  t.variant = variant;
  FillGradTypes<OptimizerKind::kAdam>(t);
  FillGradTypes<OptimizerKind::kAdamW>(t);
  FillGradTypes<OptimizerKind::kAdagrad>(t);
  FillGradTypes<OptimizerKind::kLion>(t);
  t.sum_squares[int(GradType::kF32)] = &SumSquaresKernel<GradType::kF32>;
  t.sum_squares[int(GradType::kBf16)] = &SumSquaresKernel<GradType::kBf16>;
  t.sum_squares[int(GradType::kF16)] = &SumSquaresKernel<GradType::kF16>;
  t.all_finite[int(GradType::kF32)] = &AllFiniteKernel<GradType::kF32>;
  t.all_finite[int(GradType::kBf16)] = &AllFiniteKernel<GradType::kBf16>;
  t.all_finite[int(GradType::kF16)] = &AllFiniteKernel<GradType::kF16>;
  t.decode_state[int(StateType::kBf16)][1] = &DecodeStateKernel<StateType::kBf16, true>;
  t.decode_state[int(StateType::kBf16)][0] = &DecodeStateKernel<StateType::kBf16, false>;
  t.decode_state[int(StateType::kInt8)][1] = &DecodeStateKernel<StateType::kInt8, true>;
  t.decode_state[int(StateType::kInt8)][0] = &DecodeStateKernel<StateType::kInt8, false>;
  t.encode_state[int(StateType::kBf16)][1] = &EncodeStateKernel<StateType::kBf16, true>;
  t.encode_state[int(StateType::kBf16)][0] = &EncodeStateKernel<StateType::kBf16, false>;
  t.encode_state[int(StateType::kInt8)][1] = &EncodeStateKernel<StateType::kInt8, true>;
  t.encode_state[int(StateType::kInt8)][0] = &EncodeStateKernel<StateType::kInt8, false>;
  t.convert[int(ParamCopyType::kNone)] = nullptr;
  t.convert[int(ParamCopyType::kBf16)] = &ConvertKernel<ParamCopyType::kBf16>;
  t.convert[int(ParamCopyType::kF16)] = &ConvertKernel<ParamCopyType::kF16>;
  return t;
}

#undef ZINF_KERNEL_INLINE

}  // namespace zinf::cpu_adam_internal::ZINF_KERNEL_NS
