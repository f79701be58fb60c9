// The int8 and int4 block encoders and decoders by instruction set (weights_int8.cc
// dispatches between them; tests compare them). The int8 layout is Int8Bytes(n, block): per
// block of `block` elements its codes, then its fp32 scale; int4's is Int4Bytes(n, block):
// half as many bytes of codes, then the scale.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "zinf/cpu_adam.h"

namespace zinf {
namespace weights_int8 {

// A block's scale and its codes' multiplier, from its largest magnitude (and whether every
// value is finite) and the largest code (127 for int8, 7 for int4): what every encoder uses.
struct BlockScale {
  float scale;
  double inv;
};
BlockScale ScaleOf(float largest, bool finite, float levels = 127.0f);

// Every function takes the block size (`block`, QuantBlockValid: a multiple of 16).

// One block of len <= block fp32 values: its codes (nearest even of x * inv, in double), the
// padding of a partial block, its scale. The AVX-512 one gives the same bytes; it leaves
// partial and non-finite blocks to the scalar one.
void EncodeBlockScalar(const float* x, size_t len, size_t block, int8_t* codes);
void EncodeBlockAvx512(const float* x, size_t len, size_t block, int8_t* codes);

// One int4 block of len <= block fp32 values (Int4Bytes(block, block) at `out`); the AVX-512
// one leaves partial and non-finite blocks to the scalar one.
void EncodeInt4BlockScalar(const float* x, size_t len, size_t block, uint8_t* out);
void EncodeInt4BlockAvx512(const float* x, size_t len, size_t block, uint8_t* out);
// n values' int4 blocks decoded.
void DequantizeInt4Scalar(const void* src, size_t n, size_t block, float* dst);
void DequantizeInt4Avx512(const void* src, size_t n, size_t block, float* dst);

void DequantizeF32Scalar(const void* src, size_t n, size_t block, float* dst);
void DequantizeBf16Scalar(const void* src, size_t n, size_t block, uint16_t* dst);
// AVX-512F (and the OS's ZMM state): callers check DetectCpuFeatures() first.
void DequantizeF32Avx512(const void* src, size_t n, size_t block, float* dst);
void DequantizeBf16Avx512(const void* src, size_t n, size_t block, uint16_t* dst);
// Whether the AVX-512 decoders run here.
bool Avx512Usable();

// Calls fn(codes, scale, at, len) for each block of the n elements at `src` (its codes, its
// fp32 scale, its first element, its length: `block` but for a partial last block).
template <typename Fn>
inline void ForEachBlock(const void* src, size_t n, size_t block, Fn&& fn) {
  const auto* in = static_cast<const uint8_t*>(src);
  for (size_t at = 0; at < n; at += block) {
    const int8_t* codes = reinterpret_cast<const int8_t*>(in + Int8Bytes(at, block));
    float scale;
    std::memcpy(&scale, codes + block, sizeof(scale));
    fn(codes, scale, at, std::min(block, n - at));
  }
}

}  // namespace weights_int8
}  // namespace zinf
