// Frozen weights as linear blockwise int8 (zinf.frozen_weight_dtype "int8"): each block of
// kInt8StateBlock elements is kInt8StateBlock signed codes followed by its fp32 scale (the
// layout, and so the size, of StateBytes(kInt8, n)). Written for the compiler to vectorise
// (built with the kernels' -O3): the dequantisation runs on every fetch of a frozen weight.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_adam/weights_int8_impl.h"
#include "zinf/cpu_adam.h"

namespace zinf {

namespace {

constexpr size_t kBlock = kInt8StateBlock;  // the stored weights' blocks

inline uint16_t ToBf16(float v) {  // as Fp32ToBf16
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  // (A NaN scale: the blocks a failed read leaves, which must reach the peers as NaN.)
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  if ((bits & 0x7f800000u) == 0) return static_cast<uint16_t>((bits >> 16) & 0x8000u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

using EncodeFn = void (*)(const float*, size_t, size_t, int8_t*);
using EncodeInt4Fn = void (*)(const float*, size_t, size_t, uint8_t*);

// The block encoder for this CPU.
EncodeFn Encoder() {
  static const EncodeFn fn = weights_int8::Avx512Usable() ? weights_int8::EncodeBlockAvx512
                                                          : weights_int8::EncodeBlockScalar;
  return fn;
}

EncodeInt4Fn Int4Encoder() {
  static const EncodeInt4Fn fn = weights_int8::Avx512Usable() ? weights_int8::EncodeInt4BlockAvx512
                                                              : weights_int8::EncodeInt4BlockScalar;
  return fn;
}

// A block size the encoders take (the config and the devices refuse others first).
void CheckBlock(size_t block) {
  ZINF_CHECK_MSG(QuantBlockValid(block), "int8/int4 blocks: a block size outside QuantBlockValid");
}

}  // namespace

void QuantizeGradsInt4(const float* src, size_t n, void* dst, size_t block) {
  CheckBlock(block);
  auto* out = static_cast<uint8_t*>(dst);
  const EncodeInt4Fn encode = Int4Encoder();
  for (size_t at = 0; at < n; at += block) {
    encode(src + at, std::min(block, n - at), block, out + Int4Bytes(at, block));
  }
}

void DequantizeGradsInt4(const void* src, size_t n, float* dst, size_t block) {
  CheckBlock(block);
  static const bool avx512 = weights_int8::Avx512Usable();
  if (avx512) return weights_int8::DequantizeInt4Avx512(src, n, block, dst);
  weights_int8::DequantizeInt4Scalar(src, n, block, dst);
}

Status QuantizeWeightsInt8(const float* src, size_t n, void* dst) {
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(src[i])) {
      return Status::InvalidArgument("int8 frozen weights: element " + std::to_string(i) +
                                     " is inf or NaN, which int8 cannot store");
    }
  }
  auto* out = static_cast<uint8_t*>(dst);
  const EncodeFn encode = Encoder();
  for (size_t at = 0; at < n; at += kBlock) {
    encode(src + at, std::min(kBlock, n - at), kBlock,
           reinterpret_cast<int8_t*>(out + Int8Bytes(at, kBlock)));
  }
  return Status::OK();
}

void QuantizeParamsInt8(const void* src, ParamCopyType type, size_t n, void* dst, size_t block) {
  CheckBlock(block);
  auto* out = static_cast<uint8_t*>(dst);
  const EncodeFn encode = Encoder();
  float wide[kMaxQuantBlock];
  for (size_t at = 0; at < n; at += block) {
    const size_t len = std::min(block, n - at);
    const float* x = wide;
    if (type == ParamCopyType::kNone) {
      x = static_cast<const float*>(src) + at;
    } else {
      const uint16_t* in = static_cast<const uint16_t*>(src) + at;
      if (type == ParamCopyType::kBf16) {
        for (size_t i = 0; i < len; ++i) {
          const uint32_t bits = uint32_t{in[i]} << 16;  // bf16 is fp32's upper half
          std::memcpy(&wide[i], &bits, sizeof(bits));
        }
      } else {
        for (size_t i = 0; i < len; ++i) wide[i] = Fp16ToFp32(in[i]);
      }
    }
    encode(x, len, block, reinterpret_cast<int8_t*>(out + Int8Bytes(at, block)));
  }
}

void DequantizeParamsInt8(const void* src, size_t n, ParamCopyType type, void* dst, size_t block) {
  switch (type) {
    case ParamCopyType::kNone:
      return DequantizeWeightsInt8(src, n, static_cast<float*>(dst), block);
    case ParamCopyType::kBf16:
      return DequantizeWeightsInt8Bf16(src, n, static_cast<uint16_t*>(dst), block);
    case ParamCopyType::kF16:
      return DequantizeWeightsInt8F16(src, n, static_cast<uint16_t*>(dst), block);
  }
}

namespace weights_int8 {

BlockScale ScaleOf(float largest, bool finite, float levels) {
  // A block whose scale is not a normal float (its largest magnitude below levels x FLT_MIN)
  // stores as zeros: within the bound, as every value is below a step.
  float scale = largest / levels;
  if (!std::isnormal(scale)) scale = 0;
  // Near FLT_MAX, levels x the rounded scale can overflow: the scale one ulp lower decodes the
  // largest code finite (the codes come from the exact ratio: still within the bound).
  if (std::isinf(scale * levels)) scale = std::nextafter(scale, 0.0f);
  if (!finite) scale = std::numeric_limits<float>::quiet_NaN();
  // (In double: never inf.)
  const double inv = finite && scale > 0 ? static_cast<double>(levels) / largest : 0.0;
  return {scale, inv};
}

namespace {

// The largest magnitude of len values, and whether every one is finite.
float Largest(const float* x, size_t len, bool* finite) {
  float largest = 0;
  *finite = true;
  for (size_t i = 0; i < len; ++i) {
    const float a = std::fabs(x[i]);
    *finite = *finite && a <= std::numeric_limits<float>::max();  // (false for a NaN too)
    largest = std::max(largest, a);
  }
  return largest;
}

// Nearest even of x * inv in double; |x * inv| <= levels up to rounding, clamped so a
// rounding up stays a code.
inline int Code(float x, double inv, double levels) {
  return static_cast<int>(
      std::clamp(std::nearbyint(static_cast<double>(x) * inv), -levels, levels));
}

}  // namespace

// A block holding an inf or a NaN stores zeros and a NaN scale (it decodes to NaN).
void EncodeBlockScalar(const float* x, size_t len, size_t block, int8_t* codes) {
  bool finite;
  const float largest = Largest(x, len, &finite);
  const BlockScale s = ScaleOf(largest, finite);
  for (size_t i = 0; i < len; ++i) {
    codes[i] = static_cast<int8_t>(finite ? Code(x[i], s.inv, 127.0) : 0);
  }
  for (size_t i = len; i < block; ++i) codes[i] = 0;
  std::memcpy(codes + block, &s.scale, sizeof(s.scale));
}

void EncodeInt4BlockScalar(const float* x, size_t len, size_t block, uint8_t* out) {
  bool finite;
  const float largest = Largest(x, len, &finite);
  const BlockScale s = ScaleOf(largest, finite, 7.0f);
  for (size_t i = 0; i < block; i += 2) {
    const int lo = finite && i < len ? Code(x[i], s.inv, 7.0) : 0;
    const int hi = finite && i + 1 < len ? Code(x[i + 1], s.inv, 7.0) : 0;
    out[i / 2] = static_cast<uint8_t>((lo & 0xF) | ((hi & 0xF) << 4));
  }
  std::memcpy(out + block / 2, &s.scale, sizeof(s.scale));
}

void DequantizeInt4Scalar(const void* src, size_t n, size_t block, float* dst) {
  const auto* in = static_cast<const uint8_t*>(src);
  for (size_t at = 0; at < n; at += block) {
    const uint8_t* codes = in + Int4Bytes(at, block);
    float scale;
    std::memcpy(&scale, codes + block / 2, sizeof(scale));
    const size_t len = std::min(block, n - at);
    for (size_t i = 0; i < len; ++i) {
      const uint8_t b = codes[i / 2];
      // Sign-extended: the nibble moved to the top of an int8, shifted back.
      const int code = i % 2 == 0 ? static_cast<int8_t>(b << 4) >> 4 : static_cast<int8_t>(b) >> 4;
      dst[at + i] = static_cast<float>(code) * scale;
    }
  }
}

void DequantizeF32Scalar(const void* src, size_t n, size_t block, float* dst) {
  ForEachBlock(src, n, block, [dst](const int8_t* codes, float scale, size_t at, size_t len) {
    for (size_t i = 0; i < len; ++i) dst[at + i] = static_cast<float>(codes[i]) * scale;
  });
}

void DequantizeBf16Scalar(const void* src, size_t n, size_t block, uint16_t* dst) {
  ForEachBlock(src, n, block, [dst](const int8_t* codes, float scale, size_t at, size_t len) {
    for (size_t i = 0; i < len; ++i) dst[at + i] = ToBf16(static_cast<float>(codes[i]) * scale);
  });
}

bool Avx512Usable() {
  const CpuFeatures& f = DetectCpuFeatures();
  return f.avx512f && f.os_avx512;
}

}  // namespace weights_int8

void DequantizeWeightsInt8(const void* src, size_t n, float* dst, size_t block) {
  CheckBlock(block);
  static const bool avx512 = weights_int8::Avx512Usable();
  if (avx512) return weights_int8::DequantizeF32Avx512(src, n, block, dst);
  weights_int8::DequantizeF32Scalar(src, n, block, dst);
}

void DequantizeWeightsInt8Bf16(const void* src, size_t n, uint16_t* dst, size_t block) {
  CheckBlock(block);
  static const bool avx512 = weights_int8::Avx512Usable();
  if (avx512) return weights_int8::DequantizeBf16Avx512(src, n, block, dst);
  weights_int8::DequantizeBf16Scalar(src, n, block, dst);
}

void DequantizeWeightsInt8F16(const void* src, size_t n, uint16_t* dst, size_t block) {
  // (Rare: int8 frozen weights under fp16 storage, decoded once per fetch; no SIMD variant.)
  std::vector<float> full(n);
  DequantizeWeightsInt8(src, n, full.data(), block);
  for (size_t i = 0; i < n; ++i) dst[i] = Fp32ToFp16(full[i]);
}

}  // namespace zinf
