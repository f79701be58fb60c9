// CudaModelOps: the GPT's forward and backward on a GPU (see model_ops.h).
//
// Matrix products of the Linear layers go through cuBLAS: fp32 weights with cublasSgemm
// (CUBLAS_DEFAULT_MATH: no TF32), bf16 weights with cublasGemmEx on bf16 operands (the fp32
// activation or gradient is rounded to bf16 into scratch first) accumulating in fp32 into the
// fp32 output. Everything else is a kernel here, written so that every sum has a fixed order:
//   - LayerNorm, cross-entropy: one block per row, per-thread strided partial sums in double
//     reduced in a fixed tree in shared memory;
//   - column sums (LayerNorm dw/db, bias gradients, embedding gradients): one thread per
//     column walking the rows in order (the CPU's order: the pure sums, db, bias and
//     embedding gradients, are bit-identical to it; dw may differ by a fused multiply-add);
//   - attention: one warp per query row (scores, softmax, output), and its backward in two
//     passes (per query row: dS and dQ; per key row: dK and dV), so no atomics anywhere.
// Row-major [rows, cols] matrices are column-major [cols, rows] for cuBLAS, so
// out[N, OC] = inp[N, C] @ W[OC, C]^T is out^T = W * inp^T, W being op T of the stored
// column-major [C, OC] matrix.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "device/cuda/bf16.cuh"
#include "device/cuda/cuda_internal.h"
#include "train/model_ops.h"
#include "zinf/cuda.h"
#include "zinf/log.h"

namespace zinf::train {
namespace {

using cuda_internal::CudaCallStatus;

constexpr int kThreads = 256;      // element-wise kernels and row reductions (power of two)
constexpr int kWarpsPerBlock = 4;  // attention: one warp per row
constexpr double kLayerNormEps = 1e-5;
constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kGeluCubic = 0.044715f;

// Elements of each bf16 scratch (a Linear's input or output gradient): N x the widest of
// 4C (the MLP) and V (an LM head).
size_t Bf16ScratchElements(const ModelDims& d) {
  return static_cast<size_t>(d.B) * d.T * (4 * d.C > d.V ? 4 * d.C : d.V);
}

unsigned GridFor(size_t n) {
  size_t blocks = (n + kThreads - 1) / kThreads;
  if (blocks == 0) blocks = 1;
  return static_cast<unsigned>(blocks < 65535 * 8 ? blocks : 65535 * 8);
}

#define ZINF_GRID_LOOP(i, n)                                                           \
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<size_t>(gridDim.x) * blockDim.x)

// Sum of `v` over the block (blockDim.x == kThreads), in a fixed tree; every thread gets it.
__device__ double BlockSum(double v, double* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) shared[threadIdx.x] += shared[threadIdx.x + s];
    __syncthreads();
  }
  const double r = shared[0];
  __syncthreads();
  return r;
}
__device__ float BlockMax(float v, float* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) shared[threadIdx.x] = fmaxf(shared[threadIdx.x], shared[threadIdx.x + s]);
    __syncthreads();
  }
  const float r = shared[0];
  __syncthreads();
  return r;
}
__device__ double WarpSum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// ---- Element-wise ---------------------------------------------------------------------------

// The conversions of device/cuda/bf16.cuh (the CPU reference's rounding), as everywhere.
__global__ void Bf16ToF32Kernel(float* dst, const uint16_t* src, size_t n) {
  ZINF_GRID_LOOP(i, n) dst[i] = cuda_internal::Bf16ToF32(src[i]);
}
__global__ void F16ToF32Kernel(float* dst, const uint16_t* src, size_t n) {
  ZINF_GRID_LOOP(i, n) dst[i] = cuda_internal::F16ToF32(src[i]);
}
// x rounded to fp16 and back (inf past fp16's range): the gradient an fp16 model produces.
__global__ void RoundToF16Kernel(float* x, size_t n) {
  ZINF_GRID_LOOP(i, n) x[i] = cuda_internal::F16ToF32(cuda_internal::F32ToF16(x[i]));
}
__global__ void F32ToBf16Kernel(__nv_bfloat16* dst, const float* src, size_t n) {
  uint16_t* bits = reinterpret_cast<uint16_t*>(dst);
  ZINF_GRID_LOOP(i, n) bits[i] = cuda_internal::F32ToBf16(src[i]);
}
__global__ void AddBiasKernel(float* out, const float* bias, size_t n, int oc) {
  ZINF_GRID_LOOP(i, n) out[i] += bias[i % oc];
}
__global__ void ColumnSumKernel(float* dst, const float* src, int rows, int cols) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float acc = dst[c];
  for (int r = 0; r < rows; ++r) acc += src[static_cast<size_t>(r) * cols + c];
  dst[c] = acc;
}
__global__ void ResidualKernel(float* out, const float* a, const float* b, size_t n) {
  ZINF_GRID_LOOP(i, n) out[i] = a[i] + b[i];
}
__global__ void GeluForwardKernel(float* out, const float* inp, size_t n) {
  ZINF_GRID_LOOP(i, n) {
    const float x = inp[i];
    const float u = kSqrt2OverPi * (x + kGeluCubic * x * x * x);
    out[i] = 0.5f * x * (1.0f + tanhf(u));
  }
}
__global__ void GeluBackwardKernel(float* dinp, const float* inp, const float* dout, size_t n) {
  ZINF_GRID_LOOP(i, n) {
    const float x = inp[i];
    const float u = kSqrt2OverPi * (x + kGeluCubic * x * x * x);
    const float th = tanhf(u);
    const float du = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
    const float grad = 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du;
    dinp[i] += grad * dout[i];
  }
}

// ---- Embeddings -----------------------------------------------------------------------------

__global__ void EncoderForwardKernel(float* out, const int32_t* tokens, const float* wte,
                                     const float* wpe, int T, int C, size_t n) {
  ZINF_GRID_LOOP(i, n) {
    const size_t row = i / C;
    const int c = static_cast<int>(i % C);
    const int t = static_cast<int>(row % T);
    out[i] = wte[static_cast<size_t>(tokens[row]) * C + c] + wpe[static_cast<size_t>(t) * C + c];
  }
}
// One thread per channel walks the tokens in order: no two threads touch the same element.
__global__ void EncoderBackwardKernel(float* dwte, float* dwpe, const float* dout,
                                      const int32_t* tokens, int N, int T, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  for (int row = 0; row < N; ++row) {
    const float d = dout[static_cast<size_t>(row) * C + c];
    dwte[static_cast<size_t>(tokens[row]) * C + c] += d;
    dwpe[static_cast<size_t>(row % T) * C + c] += d;
  }
}

// ---- LayerNorm ------------------------------------------------------------------------------

__global__ void LayerNormForwardKernel(float* out, float* mean, float* rstd, const float* inp,
                                       const float* w, const float* b, int C) {
  __shared__ double shared[kThreads];
  const size_t n = blockIdx.x;
  const float* x = inp + n * C;
  float* o = out + n * C;
  double sum = 0.0;
  for (int i = threadIdx.x; i < C; i += kThreads) sum += x[i];
  const double m = BlockSum(sum, shared) / C;
  double sq = 0.0;
  for (int i = threadIdx.x; i < C; i += kThreads) {
    const double d = x[i] - m;
    sq += d * d;
  }
  const double var = BlockSum(sq, shared) / C;
  const float mu = static_cast<float>(m);
  const float rs = static_cast<float>(1.0 / sqrt(var + kLayerNormEps));
  for (int i = threadIdx.x; i < C; i += kThreads) o[i] = (x[i] - mu) * rs * w[i] + b[i];
  if (threadIdx.x == 0) {
    mean[n] = mu;
    rstd[n] = rs;
  }
}
__global__ void LayerNormBackwardInputKernel(float* dinp, const float* dout, const float* inp,
                                             const float* w, const float* mean, const float* rstd,
                                             int C) {
  __shared__ double shared[kThreads];
  const size_t n = blockIdx.x;
  const float* x = inp + n * C;
  const float* d = dout + n * C;
  float* dx = dinp + n * C;
  const float mu = mean[n], rs = rstd[n];
  double sum_g = 0.0, sum_gx = 0.0;
  for (int i = threadIdx.x; i < C; i += kThreads) {
    const float xhat = (x[i] - mu) * rs;
    const float g = d[i] * w[i];
    sum_g += g;
    sum_gx += static_cast<double>(g) * xhat;
  }
  const float mean_g = static_cast<float>(BlockSum(sum_g, shared) / C);
  const float mean_gx = static_cast<float>(BlockSum(sum_gx, shared) / C);
  for (int i = threadIdx.x; i < C; i += kThreads) {
    const float xhat = (x[i] - mu) * rs;
    const float g = d[i] * w[i];
    dx[i] += rs * (g - mean_g - xhat * mean_gx);
  }
}
__global__ void LayerNormBackwardParamsKernel(float* dw, float* db, const float* dout,
                                              const float* inp, const float* mean,
                                              const float* rstd, int N, int C) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= C) return;
  float aw = dw[i], ab = db[i];
  for (int n = 0; n < N; ++n) {
    const float d = dout[static_cast<size_t>(n) * C + i];
    const float xhat = (inp[static_cast<size_t>(n) * C + i] - mean[n]) * rstd[n];
    ab += d;
    aw += d * xhat;
  }
  dw[i] = aw;
  db[i] = ab;
}

// ---- Attention ------------------------------------------------------------------------------
// qkv rows hold q | k | v (each C = NH * hs); head h uses columns h*hs.. of each part. One
// warp per (b, h, t): lane j handles keys j, j+32, ..; lane d handles features d, d+32, ...

struct AttnRow {
  int b, h, t, lane, hs;
  size_t ld;        // row stride of qkv (3C)
  size_t head;      // offset of this (b, h)'s T x T block in att
  const float* q0;  // qkv of (b, row 0), head h's columns of q (k at +C, v at +2C)
};
__device__ bool RowOfWarp(const float* qkv, int B, int T, int C, int NH, AttnRow* r) {
  const int warp = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  if (warp >= B * NH * T) return false;
  r->t = warp % T;
  r->h = (warp / T) % NH;
  r->b = warp / (T * NH);
  r->lane = threadIdx.x % 32;
  r->hs = C / NH;
  r->ld = 3 * static_cast<size_t>(C);
  r->head = (static_cast<size_t>(r->b) * NH + r->h) * T * T;
  r->q0 = qkv + static_cast<size_t>(r->b) * T * r->ld + r->h * r->hs;
  return true;
}

__global__ void AttentionForwardKernel(float* out, float* att, const float* qkv, int B, int T,
                                       int C, int NH, float scale) {
  AttnRow r;
  if (!RowOfWarp(qkv, B, T, C, NH, &r)) return;
  const float* q = r.q0 + r.t * r.ld;
  float* p = att + r.head + static_cast<size_t>(r.t) * T;
  float mx = -INFINITY;
  for (int j = r.lane; j <= r.t; j += 32) {
    const float* k = r.q0 + j * r.ld + C;
    float s = 0.0f;
    for (int d = 0; d < r.hs; ++d) s += q[d] * k[d];
    s *= scale;
    p[j] = s;
    mx = fmaxf(mx, s);
  }
  mx = WarpMax(mx);
  double sum = 0.0;
  for (int j = r.lane; j <= r.t; j += 32) {
    const float e = expf(p[j] - mx);
    p[j] = e;
    sum += e;
  }
  const float inv = static_cast<float>(1.0 / WarpSum(sum));
  for (int j = r.lane; j < T; j += 32) p[j] = j <= r.t ? p[j] * inv : 0.0f;
  __syncwarp();
  float* o = out + (static_cast<size_t>(r.b) * T + r.t) * C + r.h * r.hs;
  for (int d = r.lane; d < r.hs; d += 32) {
    float acc = 0.0f;
    for (int j = 0; j <= r.t; ++j) acc += p[j] * r.q0[j * r.ld + 2 * C + d];
    o[d] = acc;
  }
}

// Pass 1, per query row t: dP[j] = dO[t] . V[j], dS[j] = P[j] (dP[j] - P . dP) into ds,
// dQ[t] += scale * dS @ K.
__global__ void AttentionBackwardQueryKernel(float* dqkv, float* ds, const float* dout,
                                             const float* qkv, const float* att, int B, int T,
                                             int C, int NH, float scale) {
  AttnRow r;
  if (!RowOfWarp(qkv, B, T, C, NH, &r)) return;
  const size_t row_off = r.head + static_cast<size_t>(r.t) * T;
  const float* p = att + row_off;
  float* s = ds + row_off;
  const float* dO = dout + (static_cast<size_t>(r.b) * T + r.t) * C + r.h * r.hs;
  double dot = 0.0;
  for (int j = r.lane; j <= r.t; j += 32) {
    const float* v = r.q0 + j * r.ld + 2 * C;
    float dp = 0.0f;
    for (int d = 0; d < r.hs; ++d) dp += dO[d] * v[d];
    s[j] = dp;
    dot += static_cast<double>(p[j]) * dp;
  }
  const float pdp = static_cast<float>(WarpSum(dot));
  for (int j = r.lane; j < T; j += 32) s[j] = j <= r.t ? p[j] * (s[j] - pdp) : 0.0f;
  __syncwarp();
  float* dq = dqkv + (static_cast<size_t>(r.b) * T + r.t) * r.ld + r.h * r.hs;
  for (int d = r.lane; d < r.hs; d += 32) {
    float acc = 0.0f;
    for (int j = 0; j <= r.t; ++j) acc += s[j] * r.q0[j * r.ld + C + d];
    dq[d] += scale * acc;
  }
}

// Pass 2, per key row j: dK[j] += scale * sum_{t >= j} dS[t, j] Q[t], dV[j] += sum_{t >= j}
// P[t, j] dO[t].
__global__ void AttentionBackwardKeyKernel(float* dqkv, const float* ds, const float* dout,
                                           const float* qkv, const float* att, int B, int T, int C,
                                           int NH, float scale) {
  AttnRow r;
  if (!RowOfWarp(qkv, B, T, C, NH, &r)) return;
  const int j = r.t;
  const float* dO = dout + static_cast<size_t>(r.b) * T * C + r.h * r.hs;
  float* drow = dqkv + (static_cast<size_t>(r.b) * T + j) * r.ld + r.h * r.hs;
  for (int d = r.lane; d < r.hs; d += 32) {
    float dk = 0.0f, dv = 0.0f;
    for (int t = j; t < T; ++t) {
      const size_t e = r.head + static_cast<size_t>(t) * T + j;
      dk += ds[e] * r.q0[t * r.ld + d];
      dv += att[e] * dO[static_cast<size_t>(t) * C + d];
    }
    drow[C + d] += scale * dk;
    drow[2 * C + d] += dv;
  }
}

// ---- Cross-entropy --------------------------------------------------------------------------

__global__ void CrossEntropyKernel(float* dlogits, double* losses, const float* logits,
                                   const int32_t* targets, int V, double row_scale) {
  __shared__ double shared[kThreads];
  __shared__ float fshared[kThreads];
  const size_t n = blockIdx.x;
  const float* x = logits + n * V;
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < V; j += kThreads) mx = fmaxf(mx, x[j]);
  mx = BlockMax(mx, fshared);
  double sum = 0.0;
  for (int j = threadIdx.x; j < V; j += kThreads) sum += expf(x[j] - mx);
  sum = BlockSum(sum, shared);
  const int target = targets[n];
  if (dlogits != nullptr) {
    float* d = dlogits + n * V;
    const float f = static_cast<float>(row_scale / sum);
    for (int j = threadIdx.x; j < V; j += kThreads) {
      float g = expf(x[j] - mx) * f;
      if (j == target) g -= static_cast<float>(row_scale);
      d[j] = g;
    }
  }
  if (threadIdx.x == 0) {
    losses[n] = static_cast<double>(mx) + log(sum) - static_cast<double>(x[target]);
  }
}

// ---- The ops --------------------------------------------------------------------------------

// cuBLAS's workspace (cublasSetWorkspace), from the device pool: what NVIDIA recommends for
// Hopper (32 MiB; 4 MiB suffice before it).
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

const char* CublasName(cublasStatus_t s) {
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION >= 110600
  return cublasGetStatusName(s);
#else
  return s == CUBLAS_STATUS_SUCCESS ? "success" : "cuBLAS error";
#endif
}

class CudaModelOps final : public ModelOps {
 public:
  CudaModelOps(Device* device, cudaStream_t stream, int ordinal, const ModelDims& dims)
      : device_(device), stream_(stream), ordinal_(ordinal), dims_(dims) {}
  ~CudaModelOps() override {
    // The stream may still run kernels (cuBLAS's among them) reading these: drain it before
    // the handle and the memory go. A failure here cannot be reported any more: a destructor.
    const cudaError_t drained = cudaStreamSynchronize(stream_);
    if (drained != cudaSuccess) {
      LogWarning(std::string("CudaModelOps: draining the compute stream failed: ") +
                 cudaGetErrorString(drained));
    }
    if (handle_ != nullptr) cublasDestroy(handle_);
    for (TokenStaging& t : token_staging_) {
      if (t.data != nullptr) cudaFreeHost(t.data);
      if (t.copied != nullptr) cudaEventDestroy(t.copied);
    }
    for (void* p : allocations_) device_->Free(p);
  }

  Status Init() {
    ZINF_RETURN_IF_ERROR(cuda_internal::MakeCurrent(ordinal_));
    const cublasStatus_t s = cublasCreate(&handle_);
    if (s != CUBLAS_STATUS_SUCCESS) {
      handle_ = nullptr;
      return Status::Internal(std::string("cublasCreate failed: ") + CublasName(s));
    }
    ZINF_RETURN_IF_ERROR(Cublas(cublasSetStream(handle_, stream_), "cublasSetStream"));
    ZINF_RETURN_IF_ERROR(
        Cublas(cublasSetMathMode(handle_, CUBLAS_DEFAULT_MATH), "cublasSetMathMode"));
    // cuBLAS's workspace comes from the device pool (and its budget), not from a hidden
    // cudaMalloc of its own.
    ZINF_ASSIGN_OR_RETURN(void* workspace, Allocate(kCublasWorkspaceBytes));
    ZINF_RETURN_IF_ERROR(Cublas(cublasSetWorkspace(handle_, workspace, kCublasWorkspaceBytes),
                                "cublasSetWorkspace"));
    const size_t wide = Bf16ScratchElements(dims_);
    ZINF_ASSIGN_OR_RETURN(void* a, Allocate(wide * sizeof(__nv_bfloat16)));
    ZINF_ASSIGN_OR_RETURN(void* b, Allocate(wide * sizeof(__nv_bfloat16)));
    a16_ = static_cast<__nv_bfloat16*>(a);
    b16_ = static_cast<__nv_bfloat16*>(b);
    ZINF_ASSIGN_OR_RETURN(
        void* ds, Allocate(static_cast<size_t>(dims_.B) * dims_.NH * dims_.T * dims_.T * 4));
    ds_ = static_cast<float*>(ds);
    ZINF_ASSIGN_OR_RETURN(void* losses,
                          Allocate(static_cast<size_t>(dims_.B) * dims_.T * sizeof(double)));
    losses_ = static_cast<double*>(losses);
    return Status::OK();
  }

  bool on_device() const override { return true; }
  Status status() override {
    Note(cudaGetLastError(), "a kernel launch");
    return error_;
  }

  Result<float*> AllocFloats(size_t n) override {
    ZINF_ASSIGN_OR_RETURN(void* p, Allocate(n * sizeof(float)));
    return static_cast<float*>(p);
  }
  Result<int32_t*> AllocInts(size_t n) override {
    ZINF_ASSIGN_OR_RETURN(void* p, Allocate(n * sizeof(int32_t)));
    return static_cast<int32_t*>(p);
  }
  void UploadInts(int32_t* dst, const int32_t* host_src, size_t n) override {
    Enter();
    if (n == 0) return;
    // Through pinned staging, two blocks used in turn (the trainer uploads the inputs, then
    // the targets): the caller's pageable buffer may be reused at once, and a block is
    // refilled only once the copy before last out of it has run, so the host does not wait
    // for the copy it just issued.
    TokenStaging& t = token_staging_[next_token_staging_];
    next_token_staging_ = 1 - next_token_staging_;
    if (t.copied == nullptr) {
      Note(cudaEventCreateWithFlags(&t.copied, cudaEventDisableTiming), "cudaEventCreate");
      if (t.copied == nullptr) return;  // the failure is the ops' error
    } else {
      Note(cudaEventSynchronize(t.copied), "cudaEventSynchronize(tokens)");
    }
    if (n > t.capacity) {
      if (t.data != nullptr) Note(cudaFreeHost(t.data), "cudaFreeHost");
      t.data = nullptr;
      t.capacity = 0;
      void* p = nullptr;
      Note(cudaHostAlloc(&p, n * sizeof(int32_t), cudaHostAllocDefault), "cudaHostAlloc(tokens)");
      if (p == nullptr) return;  // the failure is the ops' error
      t.data = static_cast<int32_t*>(p);
      t.capacity = n;
    }
    std::memcpy(t.data, host_src, n * sizeof(int32_t));
    Note(cudaMemcpyAsync(dst, t.data, n * sizeof(int32_t), cudaMemcpyHostToDevice, stream_),
         "cudaMemcpyAsync(tokens)");
    Note(cudaEventRecord(t.copied, stream_), "cudaEventRecord(tokens)");
  }
  Status Download(float* host_dst, const float* src, size_t n) override {
    Enter();
    Note(cudaMemcpyAsync(host_dst, src, n * sizeof(float), cudaMemcpyDeviceToHost, stream_),
         "cudaMemcpyAsync(download)");
    Note(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    return status();
  }

  void Zero(float* p, size_t n) override {
    Enter();
    Note(cudaMemsetAsync(p, 0, n * sizeof(float), stream_), "cudaMemsetAsync");
  }
  void Copy(float* dst, const float* src, size_t n) override {
    Enter();
    Note(cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, stream_),
         "cudaMemcpyAsync(device to device)");
  }
  void Bf16ToFp32(float* dst, const uint16_t* src, size_t n) override {
    Enter();
    if (n > 0) Bf16ToF32Kernel<<<GridFor(n), kThreads, 0, stream_>>>(dst, src, n);
  }
  void F16ToFp32(float* dst, const uint16_t* src, size_t n) override {
    Enter();
    if (n > 0) F16ToF32Kernel<<<GridFor(n), kThreads, 0, stream_>>>(dst, src, n);
  }
  void RoundToF16(float* x, size_t n) override {
    Enter();
    if (n > 0) RoundToF16Kernel<<<GridFor(n), kThreads, 0, stream_>>>(x, n);
  }

  void EncoderForward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int B,
                      int T, int C) override {
    Enter();
    const size_t n = static_cast<size_t>(B) * T * C;
    if (n > 0)
      EncoderForwardKernel<<<GridFor(n), kThreads, 0, stream_>>>(out, tokens, wte, wpe, T, C, n);
  }
  void EncoderBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B,
                       int T, int C) override {
    Enter();
    if (C > 0) {
      EncoderBackwardKernel<<<(C + kThreads - 1) / kThreads, kThreads, 0, stream_>>>(
          dwte, dwpe, dout, tokens, B * T, T, C);
    }
  }
  void LayerNormForward(float* out, float* mean, float* rstd, const float* inp, const float* w,
                        const float* b, int N, int C) override {
    Enter();
    if (N > 0) LayerNormForwardKernel<<<N, kThreads, 0, stream_>>>(out, mean, rstd, inp, w, b, C);
  }
  void LayerNormBackward(float* dinp, float* dw, float* db, const float* dout, const float* inp,
                         const float* w, const float* mean, const float* rstd, int N,
                         int C) override {
    Enter();
    if (N <= 0 || C <= 0) return;
    LayerNormBackwardInputKernel<<<N, kThreads, 0, stream_>>>(dinp, dout, inp, w, mean, rstd, C);
    LayerNormBackwardParamsKernel<<<(C + kThreads - 1) / kThreads, kThreads, 0, stream_>>>(
        dw, db, dout, inp, mean, rstd, N, C);
  }

  void Linear(float* out, const float* inp, const float* w, const uint16_t* w16, const float* bias,
              int N, int C, int OC) override {
    Enter();
    if (N <= 0 || OC <= 0) return;
    const float one = 1.0f, zero = 0.0f;
    if (w16 != nullptr) {
      if (!ToBf16(a16_, inp, static_cast<size_t>(N) * C)) return;
      Note(cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, &one, w16, CUDA_R_16BF, C,
                        a16_, CUDA_R_16BF, C, &zero, out, CUDA_R_32F, OC, CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT),
           "cublasGemmEx(forward)");
    } else {
      Note(cublasSgemm(handle_, CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, &one, w, C, inp, C, &zero, out,
                       OC),
           "cublasSgemm(forward)");
    }
    if (bias != nullptr) {
      const size_t n = static_cast<size_t>(N) * OC;
      AddBiasKernel<<<GridFor(n), kThreads, 0, stream_>>>(out, bias, n, OC);
    }
  }
  void LinearBackward(float* dinp, float* dw, float* dbias, const float* dout, const float* inp,
                      const float* w, const uint16_t* w16, int N, int C, int OC) override {
    Enter();
    if (N <= 0 || OC <= 0) return;
    const float one = 1.0f;
    if (w16 != nullptr) {
      if (!ToBf16(b16_, dout, static_cast<size_t>(N) * OC)) return;
      if (dinp != nullptr) {
        // dinp^T [C, N] += W^T [C, OC] (the stored W) * dout^T [OC, N].
        Note(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, &one, w16, CUDA_R_16BF, C,
                          b16_, CUDA_R_16BF, OC, &one, dinp, CUDA_R_32F, C, CUBLAS_COMPUTE_32F,
                          CUBLAS_GEMM_DEFAULT),
             "cublasGemmEx(input gradient)");
      }
      // dW^T [C, OC] += inp^T [C, N] * dout [N, OC].
      if (!ToBf16(a16_, inp, static_cast<size_t>(N) * C)) return;
      Note(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, &one, a16_, CUDA_R_16BF, C,
                        b16_, CUDA_R_16BF, OC, &one, dw, CUDA_R_32F, C, CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT),
           "cublasGemmEx(weight gradient)");
    } else {
      if (dinp != nullptr) {
        Note(cublasSgemm(handle_, CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, &one, w, C, dout, OC, &one,
                         dinp, C),
             "cublasSgemm(input gradient)");
      }
      Note(cublasSgemm(handle_, CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, &one, inp, C, dout, OC, &one,
                       dw, C),
           "cublasSgemm(weight gradient)");
    }
    if (dbias != nullptr) {
      ColumnSumKernel<<<(OC + kThreads - 1) / kThreads, kThreads, 0, stream_>>>(dbias, dout, N, OC);
    }
  }

  void AttentionForward(float* out, float* att, const float* qkv, int B, int T, int C,
                        int NH) override {
    Enter();
    const int rows = B * NH * T;
    if (rows <= 0) return;
    AttentionForwardKernel<<<Warps(rows), 32 * kWarpsPerBlock, 0, stream_>>>(out, att, qkv, B, T, C,
                                                                             NH, Scale(C, NH));
  }
  void AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* att, int B,
                         int T, int C, int NH) override {
    Enter();
    const int rows = B * NH * T;
    if (rows <= 0) return;
    if (B > dims_.B || T > dims_.T || NH > dims_.NH) {
      Fail(
          Status::InvalidArgument("AttentionBackward: shape larger than the ops were created for"));
      return;
    }
    AttentionBackwardQueryKernel<<<Warps(rows), 32 * kWarpsPerBlock, 0, stream_>>>(
        dqkv, ds_, dout, qkv, att, B, T, C, NH, Scale(C, NH));
    AttentionBackwardKeyKernel<<<Warps(rows), 32 * kWarpsPerBlock, 0, stream_>>>(
        dqkv, ds_, dout, qkv, att, B, T, C, NH, Scale(C, NH));
  }
  void GeluForward(float* out, const float* inp, size_t n) override {
    Enter();
    if (n > 0) GeluForwardKernel<<<GridFor(n), kThreads, 0, stream_>>>(out, inp, n);
  }
  void GeluBackward(float* dinp, const float* inp, const float* dout, size_t n) override {
    Enter();
    if (n > 0) GeluBackwardKernel<<<GridFor(n), kThreads, 0, stream_>>>(dinp, inp, dout, n);
  }
  void ResidualForward(float* out, const float* a, const float* b, size_t n) override {
    Enter();
    if (n > 0) ResidualKernel<<<GridFor(n), kThreads, 0, stream_>>>(out, a, b, n);
  }
  Result<double> CrossEntropy(float* dlogits, const float* logits, const int32_t* targets, int N,
                              int V, double dloss) override {
    Enter();
    if (N <= 0 || V <= 0) return 0.0;
    if (N > dims_.B * dims_.T) {
      return Status::InvalidArgument("CrossEntropy: more rows than the ops were created for");
    }
    CrossEntropyKernel<<<N, kThreads, 0, stream_>>>(dlogits, losses_, logits, targets, V,
                                                    dloss / N);
    host_losses_.resize(N);
    Note(cudaMemcpyAsync(host_losses_.data(), losses_, N * sizeof(double), cudaMemcpyDeviceToHost,
                         stream_),
         "cudaMemcpyAsync(losses)");
    Note(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    ZINF_RETURN_IF_ERROR(status());
    double total = 0.0;
    for (double l : host_losses_) total += l;  // row order, like the CPU
    return total / N;
  }

 private:
  static unsigned Warps(int rows) { return (rows + kWarpsPerBlock - 1) / kWarpsPerBlock; }
  static float Scale(int C, int NH) {
    return static_cast<float>(1.0 / std::sqrt(static_cast<double>(C / NH)));
  }
  // False (and the error kept) when `n` exceeds the scratch: the caller must skip its GEMM.
  bool ToBf16(__nv_bfloat16* dst, const float* src, size_t n) {
    if (n > Bf16ScratchElements(dims_)) {
      Fail(Status::InvalidArgument(
          "Linear: " + std::to_string(n) +
          " elements exceed the ops' bf16 scratch (created for B=" + std::to_string(dims_.B) +
          ", T=" + std::to_string(dims_.T) + ")"));
      return false;
    }
    if (n > 0) F32ToBf16Kernel<<<GridFor(n), kThreads, 0, stream_>>>(dst, src, n);
    return true;
  }
  // Makes the ops' device current on the calling thread (kernels and cuBLAS use it).
  void Enter() {
    Status s = cuda_internal::MakeCurrent(ordinal_);
    if (!s.ok()) Fail(s);
  }
  Result<void*> Allocate(size_t bytes) {
    ZINF_ASSIGN_OR_RETURN(void* p, device_->Alloc(bytes == 0 ? 1 : bytes));
    allocations_.push_back(p);
    const cudaError_t err = cudaMemsetAsync(p, 0, bytes, stream_);
    if (err != cudaSuccess)
      return CudaCallStatus(err, "cudaMemsetAsync(alloc)", __FILE__, __LINE__);
    return p;
  }
  void Fail(const Status& s) {
    if (error_.ok()) error_ = s;
  }
  void Note(cudaError_t err, const char* call) {
    if (err != cudaSuccess) Fail(CudaCallStatus(err, call, __FILE__, __LINE__));
  }
  void Note(cublasStatus_t s, const char* call) {
    if (s != CUBLAS_STATUS_SUCCESS) {
      Fail(Status::Internal(std::string(call) + " failed in " + __FILE__ + ": " + CublasName(s)));
    }
  }
  Status Cublas(cublasStatus_t s, const char* call) {
    Note(s, call);
    return error_;
  }

  Device* const device_;
  const cudaStream_t stream_;
  const int ordinal_;
  const ModelDims dims_;
  cublasHandle_t handle_ = nullptr;
  std::vector<void*> allocations_;
  __nv_bfloat16* a16_ = nullptr;
  __nv_bfloat16* b16_ = nullptr;
  float* ds_ = nullptr;
  double* losses_ = nullptr;
  std::vector<double> host_losses_;
  // Tokens go up through pinned memory (a pageable source makes the copy synchronous).
  struct TokenStaging {
    int32_t* data = nullptr;  // pinned (cudaHostAlloc)
    size_t capacity = 0;      // elements
    cudaEvent_t copied = nullptr;
  };
  TokenStaging token_staging_[2];
  int next_token_staging_ = 0;
  Status error_;
};

}  // namespace

size_t CudaModelOpsScratchBytes(const ModelDims& d) {
  const size_t wide = Bf16ScratchElements(d);
  const size_t ds = static_cast<size_t>(d.B) * d.NH * d.T * d.T * sizeof(float);
  const size_t losses = static_cast<size_t>(d.B) * d.T * sizeof(double);
  // Each allocation rounded to the pool's 256-byte alignment.
  return kCublasWorkspaceBytes + 256 + 2 * (wide * 2 + 256) + ds + 256 + losses + 256;
}

Result<std::unique_ptr<ModelOps>> NewCudaModelOps(Device* device, const ModelDims& dims) {
  if (device == nullptr) return Status::InvalidArgument("NewCudaModelOps: no device");
  Result<cuda_internal::CudaStream*> stream =
      cuda_internal::AsCudaStream(device->ComputeStream(), "NewCudaModelOps");
  if (!stream.ok()) {
    return Status::NotSupported("the GPU model ops need a CUDA device (got '" + device->Name() +
                                "')");
  }
  auto ops = std::make_unique<CudaModelOps>(device, (*stream)->handle(), (*stream)->device(), dims);
  ZINF_RETURN_IF_ERROR(ops->Init());
  return std::unique_ptr<ModelOps>(std::move(ops));
}

}  // namespace zinf::train
