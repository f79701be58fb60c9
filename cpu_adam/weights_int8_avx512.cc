// The int8 block encoder and decoders in AVX-512F: 16 values per step, bit-identical to the
// scalar ones (the encoder's products and rounding in double as the scalar's; the bf16
// rounding spelt out as Fp32ToBf16 does it, NaN and subnormals included).
#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cstring>

#include "cpu_adam/weights_int8_impl.h"
#include "zinf/cpu_adam.h"

namespace zinf {
namespace weights_int8 {

namespace {

inline __m512 Decode16(const int8_t* codes, __m512 scale) {
  const __m128i c8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c8)), scale);
}

inline __m256i ToBf16x16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i high = _mm512_srli_epi32(bits, 16);
  const __m512i abs = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f800000));
  const __mmask16 tiny = _mm512_cmpeq_epi32_mask(
      _mm512_and_si512(bits, _mm512_set1_epi32(0x7f800000)), _mm512_setzero_si512());
  const __m512i bias =
      _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(high, _mm512_set1_epi32(1)));
  __m512i out = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  out = _mm512_mask_mov_epi32(out, tiny, _mm512_and_si512(high, _mm512_set1_epi32(0x8000)));
  out = _mm512_mask_mov_epi32(out, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x0040)));
  return _mm512_cvtepi32_epi16(out);
}

// 16 codes of one block: nearest even of x * inv in double, clamped to [-127, 127].
inline __m128i Encode16(const float* x, __m512d inv) {
  const __m512 v = _mm512_loadu_ps(x);
  const __m512d lo = _mm512_set1_pd(-127.0), hi = _mm512_set1_pd(127.0);
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m512d d0 = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
  __m512d d1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  d0 = _mm512_min_pd(_mm512_max_pd(_mm512_roundscale_pd(_mm512_mul_pd(d0, inv), kNearest), lo), hi);
  d1 = _mm512_min_pd(_mm512_max_pd(_mm512_roundscale_pd(_mm512_mul_pd(d1, inv), kNearest), lo), hi);
  const __m512i all =
      _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtpd_epi32(d0)), _mm512_cvtpd_epi32(d1), 1);
  return _mm512_cvtepi32_epi8(all);
}

}  // namespace

void EncodeBlockAvx512(const float* x, size_t len, int8_t* codes) {
  if (len < kInt8StateBlock) return EncodeBlockScalar(x, len, codes);
  const __m512 fmax = _mm512_set1_ps(FLT_MAX);
  __m512 big = _mm512_setzero_ps();
  __mmask16 finite = 0xFFFF;
  for (size_t i = 0; i < kInt8StateBlock; i += 16) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + i));
    finite &= _mm512_cmp_ps_mask(a, fmax, _CMP_LE_OQ);  // (false for a NaN)
    big = _mm512_max_ps(a, big);
  }
  if (finite != 0xFFFF) return EncodeBlockScalar(x, len, codes);  // NaN scale, zero codes
  // The maximum is exact in any order, so the scalar loop's largest.
  const BlockScale s = ScaleOf(_mm512_reduce_max_ps(big), true);
  const __m512d inv = _mm512_set1_pd(s.inv);
  for (size_t i = 0; i < kInt8StateBlock; i += 16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), Encode16(x + i, inv));
  }
  std::memcpy(codes + kInt8StateBlock, &s.scale, sizeof(s.scale));
}

void DequantizeF32Avx512(const void* src, size_t n, float* dst) {
  ForEachBlock(src, n, [dst](const int8_t* codes, float scale, size_t at, size_t len) {
    if (len < kInt8StateBlock) {  // the last, partial block (its scale follows a full block)
      DequantizeF32Scalar(codes, len, dst + at);
      return;
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (size_t i = 0; i < len; i += 16) _mm512_storeu_ps(dst + at + i, Decode16(codes + i, s));
  });
}

void DequantizeBf16Avx512(const void* src, size_t n, uint16_t* dst) {
  ForEachBlock(src, n, [dst](const int8_t* codes, float scale, size_t at, size_t len) {
    if (len < kInt8StateBlock) {
      DequantizeBf16Scalar(codes, len, dst + at);
      return;
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (size_t i = 0; i < len; i += 16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + at + i),
                          ToBf16x16(Decode16(codes + i, s)));
    }
  });
}

}  // namespace weights_int8
}  // namespace zinf
