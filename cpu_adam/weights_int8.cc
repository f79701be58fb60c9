// Frozen weights as linear blockwise int8 (zinf.frozen_weight_dtype "int8"): each block of
// kInt8StateBlock elements is kInt8StateBlock signed codes followed by its fp32 scale (the
// layout, and so the size, of StateBytes(kInt8, n)). Written for the compiler to vectorise
// (built with the kernels' -O3): the dequantisation runs on every fetch of a frozen weight.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_adam/weights_int8_impl.h"
#include "zinf/cpu_adam.h"

namespace zinf {

namespace {

constexpr size_t kBlock = kInt8StateBlock;
constexpr size_t kBlockBytes = kInt8StateBlock + sizeof(float);

inline uint16_t ToBf16(float v) {  // as Fp32ToBf16
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  // (A NaN scale: the blocks a failed read leaves, which must reach the peers as NaN.)
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  if ((bits & 0x7f800000u) == 0) return static_cast<uint16_t>((bits >> 16) & 0x8000u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace

Status QuantizeWeightsInt8(const float* src, size_t n, void* dst) {
  auto* out = static_cast<uint8_t*>(dst);
  for (size_t at = 0; at < n; at += kBlock) {
    const size_t len = std::min(kBlock, n - at);
    const float* x = src + at;
    int8_t* codes = reinterpret_cast<int8_t*>(out + at / kBlock * kBlockBytes);
    float largest = 0;
    for (size_t i = 0; i < len; ++i) {
      if (!std::isfinite(x[i])) {
        return Status::InvalidArgument("int8 frozen weights: element " + std::to_string(at + i) +
                                       " is inf or NaN, which int8 cannot store");
      }
      largest = std::max(largest, std::fabs(x[i]));
    }
    // A block whose scale is not a normal float (its largest magnitude below 127 x FLT_MIN)
    // stores as zeros: within the bound, as every value is below a step.
    float scale = largest / 127.0f;
    if (!std::isnormal(scale)) scale = 0;
    const double inv = scale > 0 ? 127.0 / largest : 0.0;  // (in double: never inf)
    for (size_t i = 0; i < len; ++i) {
      // Nearest even; |x * inv| <= 127 up to rounding, clamped so a rounding up stays a code.
      const double q = std::nearbyint(static_cast<double>(x[i]) * inv);
      codes[i] = static_cast<int8_t>(std::clamp(q, -127.0, 127.0));
    }
    for (size_t i = len; i < kBlock; ++i) codes[i] = 0;  // the last block's padding
    std::memcpy(codes + kBlock, &scale, sizeof(scale));
  }
  return Status::OK();
}

namespace weights_int8 {

void DequantizeF32Scalar(const void* src, size_t n, float* dst) {
  ForEachBlock(src, n, [dst](const int8_t* codes, float scale, size_t at, size_t len) {
    for (size_t i = 0; i < len; ++i) dst[at + i] = static_cast<float>(codes[i]) * scale;
  });
}

void DequantizeBf16Scalar(const void* src, size_t n, uint16_t* dst) {
  ForEachBlock(src, n, [dst](const int8_t* codes, float scale, size_t at, size_t len) {
    for (size_t i = 0; i < len; ++i) dst[at + i] = ToBf16(static_cast<float>(codes[i]) * scale);
  });
}

bool Avx512Usable() {
  const CpuFeatures& f = DetectCpuFeatures();
  return f.avx512f && f.os_avx512;
}

}  // namespace weights_int8

void DequantizeWeightsInt8(const void* src, size_t n, float* dst) {
  static const bool avx512 = weights_int8::Avx512Usable();
  if (avx512) return weights_int8::DequantizeF32Avx512(src, n, dst);
  weights_int8::DequantizeF32Scalar(src, n, dst);
}

void DequantizeWeightsInt8Bf16(const void* src, size_t n, uint16_t* dst) {
  static const bool avx512 = weights_int8::Avx512Usable();
  if (avx512) return weights_int8::DequantizeBf16Avx512(src, n, dst);
  weights_int8::DequantizeBf16Scalar(src, n, dst);
}

void DequantizeWeightsInt8F16(const void* src, size_t n, uint16_t* dst) {
  // (Rare: int8 frozen weights under fp16 storage, decoded once per fetch; no SIMD variant.)
  std::vector<float> full(n);
  DequantizeWeightsInt8(src, n, full.data());
  for (size_t i = 0; i < n; ++i) dst[i] = Fp32ToFp16(full[i]);
}

}  // namespace zinf
