// The AVX-512 vector type V (16 lanes), included by kernels_avx512.cc and
// kernels_avx512_bf16.cc inside their own namespaces. ZINF_AVX512_NATIVE_BF16 selects
// VCVTNEPS2BF16 (avx512_bf16) or its exact integer emulation for the fp32 -> bf16 store.
// Not a normal header: no include guard on purpose (see kernel_body.h).

#ifndef ZINF_AVX512_NATIVE_BF16
#error "define ZINF_AVX512_NATIVE_BF16 to 0 or 1 before including vec_avx512.h"
#endif

struct V {
  using F = __m512;
  static constexpr size_t kWidth = 16;
  static F Set1(float x) { return _mm512_set1_ps(x); }
  static F Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F LoadBf16(const uint16_t* p) {
    const __m512i w =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static F LoadF16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // fp32 -> 16 bf16 values, rounded to nearest even (see Fp32ToBf16).
  static __m256i ToBf16(F x) {
#if ZINF_AVX512_NATIVE_BF16
    return (__m256i)_mm512_cvtneps_pbh(x);
#else
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f800000));
    const __mmask16 is_zero_or_subnormal = _mm512_cmpeq_epi32_mask(
        _mm512_and_si512(bits, _mm512_set1_epi32(0x7f800000)), _mm512_setzero_si512());
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb);
    r = _mm512_mask_mov_epi32(r, is_zero_or_subnormal,
                              _mm512_and_si512(bits, _mm512_set1_epi32(int(0x80000000u))));
    r = _mm512_mask_mov_epi32(r, is_nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
  }
  static __m256i ToF16(F x) {
    return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static void StoreBf16(uint16_t* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), ToBf16(x));
  }
  static void StoreF16(uint16_t* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), ToF16(x));
  }
  // One 64-byte line of copy from two vectors, non-temporal; REQUIRES p 64-byte aligned.
  static constexpr bool kCanStream = true;
  static void StreamBf16Line(uint16_t* p, const F* x) {
#if ZINF_AVX512_NATIVE_BF16
    // One VCVTNE2PS2BF16 converts both vectors (x[1] into the upper half), the same rounding
    // as VCVTNEPS2BF16.
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p), (__m512i)_mm512_cvtne2ps_pbh(x[1], x[0]));
#else
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p),
                        _mm512_inserti64x4(_mm512_castsi256_si512(ToBf16(x[0])), ToBf16(x[1]), 1));
#endif
  }
  static void StreamF16Line(uint16_t* p, const F* x) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p),
                        _mm512_inserti64x4(_mm512_castsi256_si512(ToF16(x[0])), ToF16(x[1]), 1));
  }
  static void StreamFence() { _mm_sfence(); }
  // How far ahead the loop prefetches (elements; 1 KiB of each fp32 stream).
  static constexpr size_t kPrefetchElements = 256;
  static F Add(F a, F b) { return _mm512_add_ps(a, b); }
  static F Sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F Div(F a, F b) { return _mm512_div_ps(a, b); }
  static F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F Sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F Sign(F a) {
    const F zero = _mm512_setzero_ps();
    F r = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, zero, _CMP_GT_OQ), _mm512_set1_ps(1.0f));
    r = _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(a, zero, _CMP_LT_OQ), _mm512_set1_ps(-1.0f));
    return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), a);
  }

  // Integer lanes for the compressed states (kernel_body.h).
  using I = __m512i;
  static I Bits(F x) { return _mm512_castps_si512(x); }
  static F FromBits(I x) { return _mm512_castsi512_ps(x); }
  static I SetI(int32_t x) { return _mm512_set1_epi32(x); }
  static I AddI(I a, I b) { return _mm512_add_epi32(a, b); }
  static I SubI(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I SelectLt(F a, F b, I x, I y) {
    return _mm512_mask_mov_epi32(y, _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), x);
  }
  static I AndI(I a, I b) { return _mm512_and_si512(a, b); }
  static I OrI(I a, I b) { return _mm512_or_si512(a, b); }
  static I MinI(I a, I b) { return _mm512_min_epi32(a, b); }
  static I MaxI(I a, I b) { return _mm512_max_epi32(a, b); }
  template <int k>
  static I SrlI(I a) {
    return _mm512_srli_epi32(a, k);
  }
  template <int k>
  static I SllI(I a) {
    return _mm512_slli_epi32(a, k);
  }
  static F Abs(F a) {
    return _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7fffffff)));
  }
  static F Min(F a, F b) { return _mm512_min_ps(a, b); }           // a < b ? a : b
  static F MaxOf(F a, F b) { return _mm512_max_ps(a, b); }         // a > b ? a : b
  static float ReduceMax(F a) { return _mm512_reduce_max_ps(a); }  // no NaN: any order is exact
  static I LoadU8(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static I LoadS8(const uint8_t* p) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void StoreU8(uint8_t* p, I x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x));
  }
  // kWidth int8 state codes as fp32 code values (unscaled), through fp16: a code's bits are
  // placed on an fp16's sign, exponent and mantissa (kernel_body.h, DecodeInt8) and VCVTPH2PS
  // converts them exactly, subnormal codes included, without an fp32 subnormal.
  static constexpr bool kF16Codes = true;
  template <bool kSigned>
  static F CodeValues(const uint8_t* p) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    __m256i h;
    if constexpr (kSigned) {
      h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7),
                           _mm256_set1_epi16(int16_t(0xBF80)));
    } else {
      h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 6);
    }
    return _mm512_cvtph_ps(h);
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
      alignas(64) double d[8];
      _mm512_store_pd(
          d, _mm512_add_pd(_mm512_add_pd(acc_[0], acc_[1]), _mm512_add_pd(acc_[2], acc_[3])));
      return ((d[0] + d[1]) + (d[2] + d[3])) + ((d[4] + d[5]) + (d[6] + d[7]));
    }
    bool HasInfOrNan() const { return inf_or_nan_ != 0; }

   private:
    void Accumulate(F x, __m512d& lo_acc, __m512d& hi_acc) {
      const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
      const __m512d hi =
          _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
      lo_acc = _mm512_fmadd_pd(lo, lo, lo_acc);
      hi_acc = _mm512_fmadd_pd(hi, hi, hi_acc);
      const __m512i exponent_mask = _mm512_set1_epi32(0x7f800000);
      const __m512i exponent = _mm512_and_si512(_mm512_castps_si512(x), exponent_mask);
      inf_or_nan_ =
          static_cast<__mmask16>(inf_or_nan_ | _mm512_cmpeq_epi32_mask(exponent, exponent_mask));
    }
    __m512d acc_[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(),
                       _mm512_setzero_pd()};
    __mmask16 inf_or_nan_ = 0;
  };
};
