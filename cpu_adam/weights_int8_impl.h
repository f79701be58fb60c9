// The int8 frozen-weight decoders by instruction set (weights_int8.cc dispatches between
// them; tests compare them). Each decodes n elements laid out as StateBytes(kInt8, n).
#pragma once

#include <cstddef>
#include <cstdint>

namespace zinf {
namespace weights_int8 {

void DequantizeF32Scalar(const void* src, size_t n, float* dst);
void DequantizeBf16Scalar(const void* src, size_t n, uint16_t* dst);
// AVX-512F (and the OS's ZMM state): callers check DetectCpuFeatures() first.
void DequantizeF32Avx512(const void* src, size_t n, float* dst);
void DequantizeBf16Avx512(const void* src, size_t n, uint16_t* dst);
// Whether the AVX-512 decoders run here.
bool Avx512Usable();

}  // namespace weights_int8
}  // namespace zinf
