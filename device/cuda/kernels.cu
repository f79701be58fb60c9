// The device kernels of zinf/cuda.h: casts, scale, sum of squares and the fused Adam/AdamW
// step.
//
// Bit-exactness with the CPU reference (cpu_adam/kernels_scalar.cc, kernel_body.h): every
// arithmetic operation of the step is written with an explicit round-to-nearest intrinsic
// (__fmul_rn, __fsub_rn, __fmaf_rn, __fsqrt_rn, __fdiv_rn), which the compiler never contracts
// or reorders, in the same order as the CPU body; this file is also compiled with -fmad=false
// -ftz=false -prec-div=true -prec-sqrt=true (device/cuda/CMakeLists.txt) so that no
// remaining expression can be fused or flushed. The conversions are ports of the CPU bit
// manipulations, so a NaN keeps the same payload bits as on the CPU. The coefficients are
// computed on the host by cpu_adam_internal::ComputeCoefficients, the CPU's own function.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "cpu_adam/kernels.h"
#include "device/cuda/bf16.cuh"
#include "device/cuda/cuda_internal.h"
#include "zinf/cuda.h"

namespace zinf::cuda {
namespace {

using cpu_adam_internal::StepCoefficients;
using cuda_internal::CudaStream;
using cuda_internal::kReduceBlocks;
using cuda_internal::kReduceThreads;
using cuda_internal::ReduceScratch;

constexpr int kThreads = 256;
constexpr size_t kMaxBlocks = size_t{1} << 16;

unsigned BlocksFor(size_t n) {
  const size_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks == 0 ? 1 : (blocks < kMaxBlocks ? blocks : kMaxBlocks));
}

// ---- Conversions: ports of cpu_adam/kernels_scalar.cc (in device/cuda/bf16.cuh) -------------

using cuda_internal::Bf16ToF32;
using cuda_internal::F32ToBf16;

using cuda_internal::F16ToF32;
using cuda_internal::F32ToF16;

// ---- Element-wise kernels ----------------------------------------------------------------------

__global__ void CastBf16ToF32Kernel(const uint16_t* src, float* dst, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    dst[i] = Bf16ToF32(src[i]);
  }
}

__global__ void CastF32ToBf16Kernel(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    dst[i] = F32ToBf16(src[i]);
  }
}

// ---- The quantized parameter gather: ports of cpu_adam/weights_int8.cc --------------------

// One thread per value of a quantization block: blockDim.x is the block size (QuantBlockValid).
constexpr int kMaxQuant = static_cast<int>(kMaxQuantBlock);
static_assert(kMaxQuant <= 1024, "a thread block holds a quantization block");

__device__ __forceinline__ float ParamToF32(const void* src, ParamCopyType type, size_t i) {
  if (type == ParamCopyType::kBf16) return Bf16ToF32(static_cast<const uint16_t*>(src)[i]);
  if (type == ParamCopyType::kF16) return F16ToF32(static_cast<const uint16_t*>(src)[i]);
  return static_cast<const float*>(src)[i];
}

// This thread's code of x within its thread block's quantization block (one value per
// thread, blockDim.x a power of two; every thread of the block calls it), and the block's
// scale: weights_int8.cc's ScaleOf and Code with `levels` 127 (int8) or 7 (int4).
__device__ int BlockCode(float x, float levels, float* scale_out) {
  __shared__ float largest[kMaxQuant];
  __shared__ int finite[kMaxQuant];
  const float a = fabsf(x);
  largest[threadIdx.x] = a;
  finite[threadIdx.x] = a <= 3.402823466e38f;  // FLT_MAX; false for a NaN too
  __syncthreads();
  for (int half = static_cast<int>(blockDim.x) / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      // (fmaxf of two non-NaN magnitudes: exact and order-free; a NaN block ignores it.)
      largest[threadIdx.x] = fmaxf(largest[threadIdx.x], largest[threadIdx.x + half]);
      finite[threadIdx.x] = finite[threadIdx.x] & finite[threadIdx.x + half];
    }
    __syncthreads();
  }
  const float big = largest[0];
  const bool ok = finite[0] != 0;
  float scale = __fdiv_rn(big, levels);
  if (!(scale >= 1.17549435e-38f)) scale = 0.0f;  // not normal (FLT_MIN): stores as zeros
  if (isinf(__fmul_rn(scale, levels))) scale = nextafterf(scale, 0.0f);  // decodes finite
  if (!ok) scale = __int_as_float(0x7fc00000);
  const double inv =
      ok && scale > 0.0f ? __ddiv_rn(static_cast<double>(levels), static_cast<double>(big)) : 0.0;
  double q = ok ? rint(__dmul_rn(static_cast<double>(x), inv)) : 0.0;
  q = q < -levels ? -levels : (q > levels ? levels : q);
  *scale_out = scale;
  return static_cast<int>(q);
}

// Block b of the n values: thread t encodes element b * blockDim.x + t (a padding code past n).
__global__ void __launch_bounds__(kMaxQuant)
    QuantizeInt8Kernel(const void* src, ParamCopyType type, size_t n, uint8_t* dst) {
  const size_t len = blockDim.x;
  const size_t i = blockIdx.x * len + threadIdx.x;
  float scale;
  const int q = BlockCode(i < n ? ParamToF32(src, type, i) : 0.0f, 127.0f, &scale);
  uint8_t* block = dst + blockIdx.x * (len + sizeof(float));
  reinterpret_cast<int8_t*>(block)[threadIdx.x] = static_cast<int8_t>(q);
  if (threadIdx.x == 0) *reinterpret_cast<float*>(block + len) = scale;
}

// A NaN scale decoded: the CPU's multiply keeps its sign and payload, quieted; the GPU's would
// give the canonical NaN.
__device__ __forceinline__ float DecodeCode(int code, float scale) {
  return isnan(scale) ? __uint_as_float(__float_as_uint(scale) | 0x400000u)
                      : __fmul_rn(static_cast<float>(code), scale);
}

// Blocks of 2^shift values (a power of two: a shift and a mask, not a 64-bit division per value).
__global__ void DequantizeInt8Kernel(const uint8_t* src, size_t n, int shift, ParamCopyType type,
                                     void* dst) {
  const size_t len = size_t{1} << shift;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const uint8_t* block = src + (i >> shift) * (len + sizeof(float));
    const float scale = *reinterpret_cast<const float*>(block + len);
    const float v = DecodeCode(reinterpret_cast<const int8_t*>(block)[i & (len - 1)], scale);
    if (type == ParamCopyType::kBf16) {
      static_cast<uint16_t*>(dst)[i] = F32ToBf16(v);
    } else if (type == ParamCopyType::kF16) {
      static_cast<uint16_t*>(dst)[i] = F32ToF16(v);
    } else {
      static_cast<float*>(dst)[i] = v;
    }
  }
}

// int4 gradient blocks (QuantizeGradsInt4): the codes in shared memory, then packed two per
// byte (element 2j in the low nibble) by the first half of the threads.
__global__ void __launch_bounds__(kMaxQuant)
    QuantizeInt4Kernel(const float* src, size_t n, uint8_t* dst) {
  __shared__ int8_t codes[kMaxQuant];
  const size_t len = blockDim.x;
  const size_t i = blockIdx.x * len + threadIdx.x;
  float scale;
  codes[threadIdx.x] = static_cast<int8_t>(BlockCode(i < n ? src[i] : 0.0f, 7.0f, &scale));
  __syncthreads();
  uint8_t* block = dst + blockIdx.x * (len / 2 + sizeof(float));
  if (threadIdx.x < len / 2) {
    const int lo = codes[2 * threadIdx.x], hi = codes[2 * threadIdx.x + 1];
    block[threadIdx.x] = static_cast<uint8_t>((lo & 0xF) | ((hi & 0xF) << 4));
  }
  if (threadIdx.x == 0) *reinterpret_cast<float*>(block + len / 2) = scale;
}

__global__ void DequantizeInt4Kernel(const uint8_t* src, size_t n, int shift, float* dst) {
  const size_t len = size_t{1} << shift;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const uint8_t* block = src + (i >> shift) * (len / 2 + sizeof(float));
    const float scale = *reinterpret_cast<const float*>(block + len / 2);
    const uint8_t b = block[(i & (len - 1)) / 2];
    // Sign-extended: the nibble moved to the top of an int8, shifted back.
    const int code = i % 2 == 0 ? static_cast<int8_t>(b << 4) >> 4 : static_cast<int8_t>(b) >> 4;
    dst[i] = DecodeCode(code, scale);
  }
}

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void SpinKernel(uint64_t ns, uint64_t* times) {
  const uint64_t start = GlobalTimerNs();
  uint64_t now = start;
  while (now - start < ns) now = GlobalTimerNs();
  times[0] = start;
  times[1] = now;
}

__global__ void AddKernel(float* dst, const float* src, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    dst[i] = __fadd_rn(dst[i], src[i]);
  }
}

__global__ void ScaleKernel(float* x, size_t n, float s) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    x[i] = __fmul_rn(x[i], s);
  }
}

// ---- Sum of squares ----------------------------------------------------------------------------

// Pass 1: thread t of block b sums x[i]^2 (exact in double) for i = b * T + t + k * B * T in
// increasing k, then the block reduces its T sums in a fixed tree.
__global__ void __launch_bounds__(kReduceThreads)
    SumSquaresPartialKernel(const float* x, size_t n, ReduceScratch* scratch) {
  __shared__ double sums[kReduceThreads];
  __shared__ int flags[kReduceThreads];
  double acc = 0.0;
  int nonfinite = 0;
  for (size_t i = blockIdx.x * size_t{kReduceThreads} + threadIdx.x; i < n;
       i += size_t{kReduceBlocks} * kReduceThreads) {
    const float v = x[i];
    const double d = v;
    acc = __dadd_rn(acc, __dmul_rn(d, d));
    nonfinite |= !isfinite(v);
  }
  sums[threadIdx.x] = acc;
  flags[threadIdx.x] = nonfinite;
  __syncthreads();
  for (int width = kReduceThreads / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) {
      sums[threadIdx.x] = __dadd_rn(sums[threadIdx.x], sums[threadIdx.x + width]);
      flags[threadIdx.x] |= flags[threadIdx.x + width];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    scratch->partial_sum[blockIdx.x] = sums[0];
    scratch->partial_nonfinite[blockIdx.x] = flags[0];
  }
}

// Pass 2: one thread adds the block sums in block order.
__global__ void SumSquaresFinalKernel(ReduceScratch* scratch) {
  double sum = 0.0;
  int nonfinite = 0;
  for (int b = 0; b < kReduceBlocks; ++b) {
    sum = __dadd_rn(sum, scratch->partial_sum[b]);
    nonfinite |= scratch->partial_nonfinite[b];
  }
  scratch->sum = sum;
  scratch->nonfinite = nonfinite;
}

struct SumSquaresDelivery {
  const ReduceScratch* staging;
  double* out_host;
  bool* nonfinite_host;
};

void CUDART_CB DeliverSumSquares(void* arg) {
  std::unique_ptr<SumSquaresDelivery> d(static_cast<SumSquaresDelivery*>(arg));
  *d->out_host = d->staging->sum;
  *d->nonfinite_host = d->staging->nonfinite != 0;
}

// ---- Adam / AdamW -----------------------------------------------------------------------------

template <GradType G>
struct GradElem {
  using T = uint16_t;
};
template <>
struct GradElem<GradType::kF32> {
  using T = float;
};

template <GradType G>
__device__ __forceinline__ float LoadGrad(const typename GradElem<G>::T* g, size_t i) {
  if constexpr (G == GradType::kF32) {
    return g[i];
  } else if constexpr (G == GradType::kBf16) {
    return Bf16ToF32(g[i]);
  } else {
    return F16ToF32(g[i]);
  }
}

// The scalar body of cpu_adam/kernel_body.h (UpdateVector for Adam and AdamW), operation for
// operation.
template <OptimizerKind K, GradType G, ParamCopyType O, bool kWeightDecay>
__global__ void AdamKernel(StepCoefficients c, float* __restrict__ p,
                           const typename GradElem<G>::T* __restrict__ g, float* __restrict__ s1,
                           float* __restrict__ s2, uint16_t* __restrict__ out, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    float grad = __fmul_rn(LoadGrad<G>(g, i), c.grad_scale);
    float param = p[i];
    if constexpr (kWeightDecay) {
      if constexpr (K == OptimizerKind::kAdam) {
        grad = __fmaf_rn(c.l2_decay, param, grad);
      } else {
        param = __fmul_rn(param, c.param_decay);
      }
    }
    float m = s1[i];
    float v = s2[i];
    m = __fmaf_rn(c.one_minus_beta1, __fsub_rn(grad, m), m);
    v = __fmaf_rn(__fmul_rn(c.one_minus_beta2, grad), grad, __fmul_rn(c.beta2, v));
    const float denom = __fmaf_rn(__fsqrt_rn(v), c.inv_bias_correction2_sqrt, c.eps);
    param = __fmaf_rn(c.neg_step_size, __fdiv_rn(m, denom), param);
    s1[i] = m;
    s2[i] = v;
    p[i] = param;
    if constexpr (O == ParamCopyType::kBf16) {
      out[i] = F32ToBf16(param);
    } else if constexpr (O == ParamCopyType::kF16) {
      out[i] = F32ToF16(param);
    }
  }
}

template <OptimizerKind K, GradType G, ParamCopyType O>
void LaunchAdam(const StepCoefficients& c, const OptimizerTensors& t, cudaStream_t s) {
  using GT = typename GradElem<G>::T;
  const auto* g = static_cast<const GT*>(t.grad);
  auto* out = static_cast<uint16_t*>(t.param_copy);
  if (c.has_weight_decay) {
    AdamKernel<K, G, O, true>
        <<<BlocksFor(t.n), kThreads, 0, s>>>(c, t.param, g, t.exp_avg, t.exp_avg_sq, out, t.n);
  } else {
    AdamKernel<K, G, O, false>
        <<<BlocksFor(t.n), kThreads, 0, s>>>(c, t.param, g, t.exp_avg, t.exp_avg_sq, out, t.n);
  }
}

template <OptimizerKind K, GradType G>
void DispatchCopy(const StepCoefficients& c, const OptimizerTensors& t, cudaStream_t s) {
  switch (t.param_copy_type) {
    case ParamCopyType::kNone:
      return LaunchAdam<K, G, ParamCopyType::kNone>(c, t, s);
    case ParamCopyType::kBf16:
      return LaunchAdam<K, G, ParamCopyType::kBf16>(c, t, s);
    case ParamCopyType::kF16:
      return LaunchAdam<K, G, ParamCopyType::kF16>(c, t, s);
  }
}

template <OptimizerKind K>
void DispatchGrad(const StepCoefficients& c, const OptimizerTensors& t, cudaStream_t s) {
  switch (t.grad_type) {
    case GradType::kF32:
      return DispatchCopy<K, GradType::kF32>(c, t, s);
    case GradType::kBf16:
      return DispatchCopy<K, GradType::kBf16>(c, t, s);
    case GradType::kF16:
      return DispatchCopy<K, GradType::kF16>(c, t, s);
  }
}

// The stream, with its device made current.
Result<CudaStream*> KernelStream(Stream* stream, const char* what) {
  ZINF_ASSIGN_OR_RETURN(CudaStream * cs, cuda_internal::AsCudaStream(stream, what));
  ZINF_RETURN_IF_ERROR(cuda_internal::MakeCurrent(cs->device()));
  return cs;
}

Status NullArgument(const char* what, const char* name, size_t n) {
  return Status::InvalidArgument(std::string(what) + " of " + std::to_string(n) +
                                 " elements: " + name + " is null");
}

// log2 of a valid block size (a power of two).
int BlockShift(size_t block) {
  int shift = 0;
  while ((size_t{1} << shift) < block) ++shift;
  return shift;
}

}  // namespace

Status CastBf16ToF32(const uint16_t* src, float* dst, size_t n, Stream* stream) {
  ZINF_ASSIGN_OR_RETURN(CudaStream * cs, KernelStream(stream, "cuda::CastBf16ToF32"));
  if (n == 0) return Status::OK();
  if (src == nullptr) return NullArgument("cuda::CastBf16ToF32", "src", n);
  if (dst == nullptr) return NullArgument("cuda::CastBf16ToF32", "dst", n);
  CastBf16ToF32Kernel<<<BlocksFor(n), kThreads, 0, cs->handle()>>>(src, dst, n);
  ZINF_CUDA_CHECK(cudaGetLastError());
  return Status::OK();
}

Status CastF32ToBf16(const float* src, uint16_t* dst, size_t n, Stream* stream) {
  ZINF_ASSIGN_OR_RETURN(CudaStream * cs, KernelStream(stream, "cuda::CastF32ToBf16"));
  if (n == 0) return Status::OK();
  if (src == nullptr) return NullArgument("cuda::CastF32ToBf16", "src", n);
  if (dst == nullptr) return NullArgument("cuda::CastF32ToBf16", "dst", n);
  CastF32ToBf16Kernel<<<BlocksFor(n), kThreads, 0, cs->handle()>>>(src, dst, n);
  ZINF_CUDA_CHECK(cudaGetLastError());
  return Status::OK();
}

Status Add(float* dst, const float* src, size_t n, Stream* stream) {
  ZINF_ASSIGN_OR_RETURN(CudaStream * cs, KernelStream(stream, "cuda::Add"));
  if (n == 0) return Status::OK();
  if (dst == nullptr) return NullArgument("cuda::Add", "dst", n);
  if (src == nullptr) return NullArgument("cuda::Add", "src", n);
  AddKernel<<<BlocksFor(n), kThreads, 0, cs->handle()>>>(dst, src, n);
  ZINF_CUDA_CHECK(cudaGetLastError());
  return Status::OK();
}

Status QuantizeInt8(const void* src, ParamCopyType type, size_t n, size_t block, void* dst,
                    Stream* stream) {
  ZINF_ASSIGN_OR_RETURN(CudaStream * cs, KernelStream(stream, "cuda::QuantizeInt8"));
  if (n == 0) return Status::OK();
  if (src == nullptr) return NullArgument("cuda::QuantizeInt8", "src", n);
  if (dst == nullptr) return NullArgument("cuda::QuantizeInt8", "dst", n);
  ZINF_RETURN_IF_ERROR(CheckQuantBlocks("cuda::QuantizeInt8", dst, block));
  // One thread block per quantization block; a grid's x dimension holds 2^31 - 1 of them.
  size_t blocks = (n + block - 1) / block;
  for (size_t first = 0; first < blocks;) {
    const size_t count = blocks - first < (size_t{1} << 30) ? blocks - first : (size_t{1} << 30);
    const size_t at = first * block;
    const size_t elem = type == ParamCopyType::kNone ? sizeof(float) : sizeof(uint16_t);
    QuantizeInt8Kernel<<<static_cast<unsigned>(count), static_cast<unsigned>(block), 0,
                         cs->handle()>>>(static_cast<const char*>(src) + at * elem, type, n - at,
                                         static_cast<uint8_t*>(dst) + Int8Bytes(at, block));
    ZINF_CUDA_CHECK(cudaGetLastError());
    first += count;
  }
  return Status::OK();
}

Status DequantizeInt8(const void* src, size_t n, size_t block, ParamCopyType type, void* dst,
                      Stream* stream) {
  ZINF_ASSIGN_OR_RETURN(CudaStream * cs, KernelStream(stream, "cuda::DequantizeInt8"));
  if (n == 0) return Status::OK();
  if (src == nullptr) return NullArgument("cuda::DequantizeInt8", "src", n);
  if (dst == nullptr) return NullArgument("cuda::DequantizeInt8", "dst", n);
  ZINF_RETURN_IF_ERROR(CheckQuantBlocks("cuda::DequantizeInt8", src, block));
  DequantizeInt8Kernel<<<BlocksFor(n), kThreads, 0, cs->handle()>>>(
      static_cast<const uint8_t*>(src), n, BlockShift(block), type, dst);
  ZINF_CUDA_CHECK(cudaGetLastError());
  return Status::OK();
}

Status QuantizeInt4(const float* src, size_t n, size_t block, void* dst, Stream* stream) {
  ZINF_ASSIGN_OR_RETURN(CudaStream * cs, KernelStream(stream, "cuda::QuantizeInt4"));
  if (n == 0) return Status::OK();
  if (src == nullptr) return NullArgument("cuda::QuantizeInt4", "src", n);
  if (dst == nullptr) return NullArgument("cuda::QuantizeInt4", "dst", n);
  ZINF_RETURN_IF_ERROR(CheckQuantBlocks("cuda::QuantizeInt4", dst, block));
  // One thread block per quantization block, at most 2^30 per launch (as QuantizeInt8).
  const size_t blocks = (n + block - 1) / block;
  for (size_t first = 0; first < blocks;) {
    const size_t count = blocks - first < (size_t{1} << 30) ? blocks - first : (size_t{1} << 30);
    const size_t at = first * block;
    QuantizeInt4Kernel<<<static_cast<unsigned>(count), static_cast<unsigned>(block), 0,
                         cs->handle()>>>(src + at, n - at,
                                         static_cast<uint8_t*>(dst) + Int4Bytes(at, block));
    ZINF_CUDA_CHECK(cudaGetLastError());
    first += count;
  }
  return Status::OK();
}

Status DequantizeInt4(const void* src, size_t n, size_t block, float* dst, Stream* stream) {
  ZINF_ASSIGN_OR_RETURN(CudaStream * cs, KernelStream(stream, "cuda::DequantizeInt4"));
  if (n == 0) return Status::OK();
  if (src == nullptr) return NullArgument("cuda::DequantizeInt4", "src", n);
  if (dst == nullptr) return NullArgument("cuda::DequantizeInt4", "dst", n);
  ZINF_RETURN_IF_ERROR(CheckQuantBlocks("cuda::DequantizeInt4", src, block));
  DequantizeInt4Kernel<<<BlocksFor(n), kThreads, 0, cs->handle()>>>(
      static_cast<const uint8_t*>(src), n, BlockShift(block), dst);
  ZINF_CUDA_CHECK(cudaGetLastError());
  return Status::OK();
}

Status Scale(float* x, size_t n, float s, Stream* stream) {
  ZINF_ASSIGN_OR_RETURN(CudaStream * cs, KernelStream(stream, "cuda::Scale"));
  if (n == 0) return Status::OK();
  if (x == nullptr) return NullArgument("cuda::Scale", "x", n);
  ScaleKernel<<<BlocksFor(n), kThreads, 0, cs->handle()>>>(x, n, s);
  ZINF_CUDA_CHECK(cudaGetLastError());
  return Status::OK();
}

Status SumSquares(const float* x, size_t n, double* out_host, bool* nonfinite_host,
                  Stream* stream) {
  ZINF_ASSIGN_OR_RETURN(CudaStream * cs, KernelStream(stream, "cuda::SumSquares"));
  if (out_host == nullptr || nonfinite_host == nullptr) {
    return Status::InvalidArgument("cuda::SumSquares: an output pointer is null");
  }
  if (n > 0 && x == nullptr) return NullArgument("cuda::SumSquares", "x", n);
  ReduceScratch* scratch = cs->scratch();
  SumSquaresPartialKernel<<<kReduceBlocks, kReduceThreads, 0, cs->handle()>>>(x, n, scratch);
  ZINF_CUDA_CHECK(cudaGetLastError());
  SumSquaresFinalKernel<<<1, 1, 0, cs->handle()>>>(scratch);
  ZINF_CUDA_CHECK(cudaGetLastError());
  // sum and nonfinite are adjacent: one small copy into the stream's pinned staging block.
  constexpr size_t kResultOffset = offsetof(ReduceScratch, sum);
  constexpr size_t kResultBytes = sizeof(ReduceScratch) - kResultOffset;
  ZINF_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<char*>(cs->staging()) + kResultOffset,
                                  reinterpret_cast<const char*>(scratch) + kResultOffset,
                                  kResultBytes, cudaMemcpyDeviceToHost, cs->handle()));
  auto delivery = std::make_unique<SumSquaresDelivery>(
      SumSquaresDelivery{cs->staging(), out_host, nonfinite_host});
  ZINF_CUDA_CHECK(cudaLaunchHostFunc(cs->handle(), DeliverSumSquares, delivery.get()));
  delivery.release();  // owned by the host function now
  return Status::OK();
}

Status Spin(double seconds, uint64_t* times, Stream* stream) {
  ZINF_ASSIGN_OR_RETURN(CudaStream * cs, KernelStream(stream, "cuda::Spin"));
  if (!(seconds >= 0 && seconds <= 60)) {
    return Status::InvalidArgument("cuda::Spin: seconds must be in [0, 60], got " +
                                   std::to_string(seconds));
  }
  if (times == nullptr) return NullArgument("cuda::Spin", "times", 2);
  SpinKernel<<<1, 1, 0, cs->handle()>>>(static_cast<uint64_t>(seconds * 1e9), times);
  ZINF_CUDA_CHECK(cudaGetLastError());
  return Status::OK();
}

Status AdamStep(const OptimizerHyperParams& hp, const OptimizerTensors& t, Stream* stream) {
  ZINF_ASSIGN_OR_RETURN(CudaStream * cs, KernelStream(stream, "cuda::AdamStep"));
  if (hp.kind != OptimizerKind::kAdam && hp.kind != OptimizerKind::kAdamW) {
    return Status::NotSupported(std::string("cuda::AdamStep: optimizer '") +
                                OptimizerKindName(hp.kind) +
                                "' has no CUDA kernel (adam and adamw do)");
  }
  ZINF_RETURN_IF_ERROR(ValidateOptimizerStep(hp, t).WithContext("cuda::AdamStep"));
  if (t.state_type != StateType::kF32) {
    return Status::NotSupported(std::string("cuda::AdamStep: ") + StateTypeName(t.state_type) +
                                " optimizer states are not supported on the GPU (fp32 only)");
  }
  if (t.n == 0) return Status::OK();
  const StepCoefficients c = cpu_adam_internal::ComputeCoefficients(hp);
  if (hp.kind == OptimizerKind::kAdam) {
    DispatchGrad<OptimizerKind::kAdam>(c, t, cs->handle());
  } else {
    DispatchGrad<OptimizerKind::kAdamW>(c, t, cs->handle());
  }
  ZINF_CUDA_CHECK(cudaGetLastError());
  return Status::OK();
}

}  // namespace zinf::cuda
