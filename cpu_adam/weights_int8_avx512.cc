// The int8 and int4 block encoders and decoders in AVX-512F: 16 values per step,
// bit-identical to the scalar ones (the encoder's products and rounding in double as the scalar's;
// the bf16 rounding spelt out as Fp32ToBf16 does it, NaN and subnormals included).
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

// 16 codes of one block as int32: nearest even of x * inv in double, clamped to
// [-levels, levels].
inline __m512i Codes16(const float* x, __m512d inv, double levels) {
  const __m512 v = _mm512_loadu_ps(x);
  const __m512d lo = _mm512_set1_pd(-levels), hi = _mm512_set1_pd(levels);
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m512d d0 = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
  __m512d d1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  d0 = _mm512_min_pd(_mm512_max_pd(_mm512_roundscale_pd(_mm512_mul_pd(d0, inv), kNearest), lo), hi);
  d1 = _mm512_min_pd(_mm512_max_pd(_mm512_roundscale_pd(_mm512_mul_pd(d1, inv), kNearest), lo), hi);
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtpd_epi32(d0)), _mm512_cvtpd_epi32(d1),
                            1);
}

// A full block's largest magnitude, or false when a value is not finite.
inline bool Largest(const float* x, size_t block, float* largest) {
  const __m512 fmax = _mm512_set1_ps(FLT_MAX);
  __m512 big = _mm512_setzero_ps();
  __mmask16 finite = 0xFFFF;
  for (size_t i = 0; i < block; i += 16) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + i));
    finite &= _mm512_cmp_ps_mask(a, fmax, _CMP_LE_OQ);  // (false for a NaN)
    big = _mm512_max_ps(a, big);
  }
  // The maximum is exact in any order, so the scalar loop's largest.
  *largest = _mm512_reduce_max_ps(big);
  return finite == 0xFFFF;
}

}  // namespace

void EncodeBlockAvx512(const float* x, size_t len, size_t block, int8_t* codes) {
  float largest;
  if (len < block || !Largest(x, block, &largest)) return EncodeBlockScalar(x, len, block, codes);
  const BlockScale s = ScaleOf(largest, true);
  const __m512d inv = _mm512_set1_pd(s.inv);
  for (size_t i = 0; i < block; i += 16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i),
                     _mm512_cvtepi32_epi8(Codes16(x + i, inv, 127.0)));
  }
  std::memcpy(codes + block, &s.scale, sizeof(s.scale));
}

void EncodeInt4BlockAvx512(const float* x, size_t len, size_t block, uint8_t* out) {
  float largest;
  if (len < block || !Largest(x, block, &largest)) {
    return EncodeInt4BlockScalar(x, len, block, out);
  }
  const BlockScale s = ScaleOf(largest, true, 7.0f);
  const __m512d inv = _mm512_set1_pd(s.inv);
  const __m512i low = _mm512_set1_epi64(0xF), high = _mm512_set1_epi64(0xF0);
  for (size_t i = 0; i < block; i += 16) {
    // Each 64-bit lane holds codes 2j (bits 0-31) and 2j + 1 (bits 32-63): their low nibbles
    // into one byte, 2j's low.
    const __m512i c = Codes16(x + i, inv, 7.0);
    const __m512i packed =
        _mm512_or_si512(_mm512_and_si512(c, low), _mm512_and_si512(_mm512_srli_epi64(c, 28), high));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i / 2), _mm512_cvtepi64_epi8(packed));
  }
  std::memcpy(out + block / 2, &s.scale, sizeof(s.scale));
}

void DequantizeInt4Avx512(const void* src, size_t n, size_t block, float* dst) {
  const auto* in = static_cast<const uint8_t*>(src);
  const __m512i lanes = _mm512_set1_epi64(0xFFFFFFFF);
  for (size_t at = 0; at < n; at += block) {
    const uint8_t* codes = in + Int4Bytes(at, block);
    if (n - at < block) {  // the last, partial block
      DequantizeInt4Scalar(codes, n - at, block, dst + at);
      return;
    }
    float scale;
    std::memcpy(&scale, codes + block / 2, sizeof(scale));
    const __m512 sv = _mm512_set1_ps(scale);
    for (size_t i = 0; i < block; i += 16) {
      const __m512i b =
          _mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i / 2)));
      // The nibbles sign-extended (shifted to the top, arithmetically back), 2j's in the
      // lane's low int32, 2j + 1's in its high one.
      const __m512i lo = _mm512_srai_epi64(_mm512_slli_epi64(b, 60), 60);
      const __m512i hi = _mm512_srai_epi64(_mm512_slli_epi64(b, 56), 60);
      const __m512i both = _mm512_or_si512(_mm512_and_si512(lo, lanes), _mm512_slli_epi64(hi, 32));
      _mm512_storeu_ps(dst + at + i, _mm512_mul_ps(_mm512_cvtepi32_ps(both), sv));
    }
  }
}

void DequantizeF32Avx512(const void* src, size_t n, size_t block, float* dst) {
  ForEachBlock(src, n, block, [=](const int8_t* codes, float scale, size_t at, size_t len) {
    if (len < block) {  // the last, partial block (its scale follows a full block)
      DequantizeF32Scalar(codes, len, block, dst + at);
      return;
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (size_t i = 0; i < len; i += 16) _mm512_storeu_ps(dst + at + i, Decode16(codes + i, s));
  });
}

void DequantizeBf16Avx512(const void* src, size_t n, size_t block, uint16_t* dst) {
  ForEachBlock(src, n, block, [=](const int8_t* codes, float scale, size_t at, size_t len) {
    if (len < block) {
      DequantizeBf16Scalar(codes, len, block, dst + at);
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
