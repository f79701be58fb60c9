// The one fp32 <-> bf16 (and fp16) conversion of zinf's device code (the optimizer kernels and the
// trainer's model ops), a port of the CPU reference's (zinf::Fp32ToBf16, cpu_adam.h): round to
// nearest even, a NaN stays a quiet NaN of the same sign and payload top bits, and a
// denormal input flushes to a signed zero, as the CPU kernels do. (__float2bfloat16_rn keeps
// denormals and canonicalises NaN: a GPU run would then round differently from the host's.)
#pragma once

#include <cstdint>

namespace zinf::cuda_internal {

__device__ __forceinline__ uint16_t F32ToBf16(float value) {
  const uint32_t bits = __float_as_uint(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  if ((bits & 0x7f800000u) == 0) return static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

__device__ __forceinline__ float Bf16ToF32(uint16_t value) {
  return __uint_as_float(static_cast<uint32_t>(value) << 16);
}

// fp32 <-> fp16, ports of zinf::Fp32ToFp16 / Fp16ToFp32 (IEEE round to nearest even, fp16
// subnormals kept, NaN made quiet keeping its top payload bits).
__device__ __forceinline__ uint16_t F32ToF16(float value) {
  uint32_t bits = __float_as_uint(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  bits &= 0x7fffffffu;
  if (bits >= 0x7f800000u) {
    if (bits == 0x7f800000u) return sign | 0x7c00u;
    return static_cast<uint16_t>(sign | 0x7e00u | ((bits >> 13) & 0x03ffu));
  }
  if (bits >= 0x477ff000u) return sign | 0x7c00u;
  if (bits < 0x38800000u) {
    const float shifted = __fadd_rn(__uint_as_float(bits), 0.5f);
    return static_cast<uint16_t>(sign | (__float_as_uint(shifted) - __float_as_uint(0.5f)));
  }
  const uint32_t mantissa_odd = (bits >> 13) & 1u;
  bits += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + mantissa_odd;
  return static_cast<uint16_t>(sign | (bits >> 13));
}

__device__ __forceinline__ float F16ToF32(uint16_t value) {
  const uint32_t sign = static_cast<uint32_t>(value & 0x8000u) << 16;
  const uint32_t exponent = (value >> 10) & 0x1fu;
  const uint32_t mantissa = value & 0x03ffu;
  if (exponent == 0x1fu) {
    return __uint_as_float(sign | 0x7f800000u | (mantissa << 13) | (mantissa ? 0x00400000u : 0u));
  }
  if (exponent == 0) {
    const float magnitude = __fmul_rn(static_cast<float>(mantissa), 5.9604644775390625e-8f);
    return __uint_as_float(sign | __float_as_uint(magnitude));
  }
  return __uint_as_float(sign | ((exponent + (127 - 15)) << 23) | (mantissa << 13));
}

}  // namespace zinf::cuda_internal
