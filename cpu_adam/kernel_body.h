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
// (software prefetch distance, 0 for none).
//
// Not a normal header: no include guard on purpose, everything lands in the per-variant
// namespace so no symbol is shared between translation units built with different flags.

#ifndef ZINF_KERNEL_NS
#error "define ZINF_KERNEL_NS and the vector type V before including kernel_body.h"
#endif

#include <cstring>

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
// are 64-byte aligned (tiles start on multiples of 64 elements, so this holds whenever the
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
ZINF_KERNEL_INLINE typename V::F UpdateVector(const Consts& k, float* p,
                                              const typename GradElem<G>::T* g, float* s1,
                                              float* s2) {
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
    F m = V::Load(s1);
    F v = V::Load(s2);
    m = V::Fma(k.one_minus_beta1, V::Sub(grad, m), m);
    v = V::Fma(V::Mul(k.one_minus_beta2, grad), grad, V::Mul(k.beta2, v));
    F denom = V::Fma(V::Sqrt(v), k.inv_bias_correction2_sqrt, k.eps);
    param = V::Fma(k.neg_step_size, V::Div(m, denom), param);
    V::Store(s1, m);
    V::Store(s2, v);
  } else if constexpr (K == OptimizerKind::kAdagrad) {
    F sum = V::Fma(grad, grad, V::Load(s1));
    F denom = V::Add(V::Sqrt(sum), k.eps);
    param = V::Fma(k.neg_step_size, V::Div(grad, denom), param);
    V::Store(s1, sum);
  } else {
    static_assert(K == OptimizerKind::kLion);
    F m = V::Load(s1);
    F c = V::Fma(k.beta1, m, V::Mul(k.one_minus_beta1, grad));
    param = V::Fma(k.neg_step_size, V::Sign(c), param);
    m = V::Fma(k.beta2, m, V::Mul(k.one_minus_beta2, grad));
    V::Store(s1, m);
  }
  V::Store(p, param);
  return param;
}

template <OptimizerKind K>
inline constexpr bool kHasState2 = K == OptimizerKind::kAdam || K == OptimizerKind::kAdamW;

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

template <OptimizerKind K, GradType G>
constexpr void FillCopyTypes(KernelTable& t) {
  t.step[int(K)][int(G)][int(ParamCopyType::kNone)] = &StepKernel<K, G, ParamCopyType::kNone>;
  t.step[int(K)][int(G)][int(ParamCopyType::kBf16)] = &StepKernel<K, G, ParamCopyType::kBf16>;
  t.step[int(K)][int(G)][int(ParamCopyType::kF16)] = &StepKernel<K, G, ParamCopyType::kF16>;
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
  t.convert[int(ParamCopyType::kNone)] = nullptr;
  t.convert[int(ParamCopyType::kBf16)] = &ConvertKernel<ParamCopyType::kBf16>;
  t.convert[int(ParamCopyType::kF16)] = &ConvertKernel<ParamCopyType::kF16>;
  return t;
}

#undef ZINF_KERNEL_INLINE

}  // namespace zinf::cpu_adam_internal::ZINF_KERNEL_NS
