// The int8 frozen-weight decoders by instruction set (weights_int8.cc dispatches between
// them; tests compare them). Each decodes n elements laid out as StateBytes(kInt8, n).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "zinf/cpu_adam.h"

namespace zinf {
namespace weights_int8 {

void DequantizeF32Scalar(const void* src, size_t n, float* dst);
void DequantizeBf16Scalar(const void* src, size_t n, uint16_t* dst);
// AVX-512F (and the OS's ZMM state): callers check DetectCpuFeatures() first.
void DequantizeF32Avx512(const void* src, size_t n, float* dst);
void DequantizeBf16Avx512(const void* src, size_t n, uint16_t* dst);
// Whether the AVX-512 decoders run here.
bool Avx512Usable();

// Calls fn(codes, scale, at, len) for each block of the n elements at `src` (its codes, its
// fp32 scale, its first element, its length: kInt8StateBlock but for a partial last block).
template <typename Fn>
inline void ForEachBlock(const void* src, size_t n, Fn&& fn) {
  constexpr size_t kBlock = kInt8StateBlock;
  const auto* in = static_cast<const uint8_t*>(src);
  for (size_t at = 0; at < n; at += kBlock) {
    const int8_t* codes = reinterpret_cast<const int8_t*>(in + StateBytes(StateType::kInt8, at));
    float scale;
    std::memcpy(&scale, codes + kBlock, sizeof(scale));
    fn(codes, scale, at, std::min(kBlock, n - at));
  }
}

}  // namespace weights_int8
}  // namespace zinf
