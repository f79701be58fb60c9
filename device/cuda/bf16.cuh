// The one fp32 <-> bf16 conversion of zinf's device code (the optimizer kernels and the
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

}  // namespace zinf::cuda_internal
