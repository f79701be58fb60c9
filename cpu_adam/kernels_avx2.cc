// AVX2 + FMA + F16C variant (8 lanes). bf16 conversion is emulated with integer ops that
// reproduce VCVTNEPS2BF16 (and the scalar reference) exactly.
// Compiled with -mavx2 -mfma -mf16c; must not include anything that instantiates inline code
// shared with other translation units (see kernel_body.h).
#include <immintrin.h>

#include <cstdint>

#include "cpu_adam/kernels.h"

namespace zinf::cpu_adam_internal::avx2 {

struct V {
  using F = __m256;
  static constexpr size_t kWidth = 8;
  static F Set1(float x) { return _mm256_set1_ps(x); }
  static F Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F LoadBf16(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static F LoadF16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // fp32 -> 8 bf16 values, rounded to nearest even (see Fp32ToBf16).
  static __m128i ToBf16(F x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
    const __m256i is_nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000));
    const __m256i is_zero_or_subnormal = _mm256_cmpeq_epi32(
        _mm256_and_si256(bits, _mm256_set1_epi32(0x7f800000)), _mm256_setzero_si256());
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb);
    r = _mm256_blendv_epi8(r, _mm256_and_si256(bits, _mm256_set1_epi32(int(0x80000000u))),
                           is_zero_or_subnormal);
    r = _mm256_blendv_epi8(r, _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000)), is_nan);
    r = _mm256_srli_epi32(r, 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
  static __m128i ToF16(F x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT); }
  static void StoreBf16(uint16_t* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), ToBf16(x));
  }
  static void StoreF16(uint16_t* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), ToF16(x));
  }
  // One 64-byte line of copy from four vectors, as two 32-byte non-temporal stores;
  // REQUIRES p 64-byte aligned.
  static constexpr bool kCanStream = true;
  static void StreamBf16Line(uint16_t* p, const F* x) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p),
                        _mm256_set_m128i(ToBf16(x[1]), ToBf16(x[0])));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p + 16),
                        _mm256_set_m128i(ToBf16(x[3]), ToBf16(x[2])));
  }
  static void StreamF16Line(uint16_t* p, const F* x) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), _mm256_set_m128i(ToF16(x[1]), ToF16(x[0])));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p + 16),
                        _mm256_set_m128i(ToF16(x[3]), ToF16(x[2])));
  }
  static void StreamFence() { _mm_sfence(); }
  // How far ahead the loop prefetches (elements; 1 KiB of each fp32 stream).
  static constexpr size_t kPrefetchElements = 256;
  static F Add(F a, F b) { return _mm256_add_ps(a, b); }
  static F Sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F Div(F a, F b) { return _mm256_div_ps(a, b); }
  static F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F Sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F Sign(F a) {
    const F zero = _mm256_setzero_ps();
    const F pos = _mm256_and_ps(_mm256_cmp_ps(a, zero, _CMP_GT_OQ), _mm256_set1_ps(1.0f));
    const F neg = _mm256_and_ps(_mm256_cmp_ps(a, zero, _CMP_LT_OQ), _mm256_set1_ps(-1.0f));
    return _mm256_blendv_ps(_mm256_or_ps(pos, neg), a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }

  // Integer lanes for the compressed states (kernel_body.h).
  using I = __m256i;
  static I Bits(F x) { return _mm256_castps_si256(x); }
  static F FromBits(I x) { return _mm256_castsi256_ps(x); }
  static I SetI(int32_t x) { return _mm256_set1_epi32(x); }
  static I AddI(I a, I b) { return _mm256_add_epi32(a, b); }
  static I SubI(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I SelectLt(F a, F b, I x, I y) {
    return _mm256_blendv_epi8(y, x, _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_LT_OQ)));
  }
  static I AndI(I a, I b) { return _mm256_and_si256(a, b); }
  static I OrI(I a, I b) { return _mm256_or_si256(a, b); }
  static I MinI(I a, I b) { return _mm256_min_epi32(a, b); }
  static I MaxI(I a, I b) { return _mm256_max_epi32(a, b); }
  template <int k>
  static I SrlI(I a) {
    return _mm256_srli_epi32(a, k);
  }
  template <int k>
  static I SllI(I a) {
    return _mm256_slli_epi32(a, k);
  }
  static F Abs(F a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
  static F Min(F a, F b) { return _mm256_min_ps(a, b); }    // a < b ? a : b
  static F MaxOf(F a, F b) { return _mm256_max_ps(a, b); }  // a > b ? a : b
  static float ReduceMax(F a) {
    alignas(32) float v[8];
    _mm256_store_ps(v, a);
    float m = v[0];
    for (int i = 1; i < 8; ++i) m = v[i] > m ? v[i] : m;
    return m;
  }
  static I LoadU8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static I LoadS8(const uint8_t* p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  // kWidth int8 state codes as fp32 code values (unscaled), through fp16 (see vec_avx512.h).
  static constexpr bool kF16Codes = true;
  template <bool kSigned>
  static F CodeValues(const uint8_t* p) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    __m128i h;
    if constexpr (kSigned) {
      h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(bytes), 7),
                        _mm_set1_epi16(int16_t(0xBF80)));
    } else {
      h = _mm_slli_epi16(_mm_cvtepu8_epi16(bytes), 6);
    }
    return _mm256_cvtph_ps(h);
  }
  static void StoreU8(uint8_t* p, I x) {
    // The low byte of each lane, per 128-bit half, then the halves side by side.
    const __m256i pick =
        _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12,
                         -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i s = _mm256_shuffle_epi8(x, pick);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p),
                     _mm_unpacklo_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1)));
  }

  // Four double accumulators (two per vector half); the result depends only on the element
  // order, which is fixed by the caller's range.
  class SumState {
   public:
    void Add(F x) { Accumulate(x, acc_[0], acc_[1]); }
    void AddPair(F x0, F x1) {
      Accumulate(x0, acc_[0], acc_[1]);
      Accumulate(x1, acc_[2], acc_[3]);
    }
    double Sum() const {
      alignas(32) double d[4];
      _mm256_store_pd(
          d, _mm256_add_pd(_mm256_add_pd(acc_[0], acc_[1]), _mm256_add_pd(acc_[2], acc_[3])));
      return (d[0] + d[1]) + (d[2] + d[3]);
    }
    bool HasInfOrNan() const { return !_mm256_testz_si256(inf_or_nan_, inf_or_nan_); }

   private:
    void Accumulate(F x, __m256d& lo_acc, __m256d& hi_acc) {
      const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
      const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
      lo_acc = _mm256_fmadd_pd(lo, lo, lo_acc);
      hi_acc = _mm256_fmadd_pd(hi, hi, hi_acc);
      const __m256i exponent_mask = _mm256_set1_epi32(0x7f800000);
      const __m256i exponent = _mm256_and_si256(_mm256_castps_si256(x), exponent_mask);
      inf_or_nan_ = _mm256_or_si256(inf_or_nan_, _mm256_cmpeq_epi32(exponent, exponent_mask));
    }
    __m256d acc_[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                       _mm256_setzero_pd()};
    __m256i inf_or_nan_ = _mm256_setzero_si256();
  };
};

}  // namespace zinf::cpu_adam_internal::avx2

#define ZINF_KERNEL_NS avx2
#include "cpu_adam/kernel_body.h"
#undef ZINF_KERNEL_NS

namespace zinf::cpu_adam_internal {

const KernelTable& Avx2Kernels() {
  static constexpr KernelTable kTable = avx2::MakeKernelTable(KernelVariant::kAvx2);
  return kTable;
}

}  // namespace zinf::cpu_adam_internal
