// ModelOps: where the GPT's forward and backward run. The trainer (trainer.cc) drives the
// layers through this interface; HostModelOps runs them on the CPU with the kernels of
// kernels.h, CudaModelOps (model_ops_cuda.cu) on a GPU with cuBLAS GEMMs (bf16 weights:
// bf16 x bf16 products accumulated in fp32) and CUDA kernels for the rest.
//
// Every pointer an op takes is memory of the ops' own kind: host memory for HostModelOps,
// device memory of its CudaDevice for CudaModelOps (from Alloc*, or a parameter the engine
// acquired). Activations and gradients are fp32; a Linear weight is fp32 (w) or bf16 (w16,
// exactly one of the two non-null). The semantics of each op are those of the kernels.h
// function of the same name (backward ops accumulate into their gradient outputs), with one
// exception: with a bf16 weight the GPU also rounds the Linear's fp32 input (and, in the
// backward, the output gradient) to bf16 before its GEMM (cuBLAS has no fp32 x bf16
// product), where the CPU keeps them fp32.
//
// Errors: the ops return nothing; the first failure (a launch error, a cuBLAS status) is
// kept and returned by status(), which the trainer checks at each layer. Work on the device
// is asynchronous, on the stream given at creation, in call order; a kernel's execution
// error surfaces at the next synchronizing call (Download, CrossEntropy, or the engine's).
// On the GPU every reduction has a fixed order, so a run repeats bit for bit on the same GPU
// (cuBLAS picks the same algorithm for the same shapes on one device); it is not
// bit-identical to the CPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "zinf/device.h"
#include "zinf/status.h"

namespace zinf::train {

// The sizes the ops prepare their scratch for.
struct ModelDims {
  int B = 0, T = 0, C = 0, NH = 0, V = 0;
};

class ModelOps {
 public:
  virtual ~ModelOps() = default;
  // True when pointers are device memory (not readable by the CPU).
  virtual bool on_device() const = 0;
  // The first error of any op so far (OK if none).
  virtual Status status() = 0;

  // Memory owned by the ops (freed with them), zero-filled.
  virtual Result<float*> AllocFloats(size_t n) = 0;
  virtual Result<int32_t*> AllocInts(size_t n) = 0;
  // Host -> ops memory (ordered with the ops); the host buffer may be reused on return.
  virtual void UploadInts(int32_t* dst, const int32_t* host_src, size_t n) = 0;
  // Ops memory -> host; waits for every op before it.
  virtual Status Download(float* host_dst, const float* src, size_t n) = 0;

  virtual void Zero(float* p, size_t n) = 0;
  virtual void Copy(float* dst, const float* src, size_t n) = 0;
  virtual void Bf16ToFp32(float* dst, const uint16_t* src, size_t n) = 0;
  virtual void F16ToFp32(float* dst, const uint16_t* src, size_t n) = 0;
  // x[i] rounded to fp16 and widened back (IEEE nearest even; inf beyond fp16's range): the
  // values an fp16 model's gradient holds (fp16 storage: engine's fp16.enabled).
  virtual void RoundToF16(float* x, size_t n) = 0;

  virtual void EncoderForward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                              int B, int T, int C) = 0;
  virtual void EncoderBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                               int B, int T, int C) = 0;
  virtual void LayerNormForward(float* out, float* mean, float* rstd, const float* inp,
                                const float* w, const float* b, int N, int C) = 0;
  virtual void LayerNormBackward(float* dinp, float* dw, float* db, const float* dout,
                                 const float* inp, const float* w, const float* mean,
                                 const float* rstd, int N, int C) = 0;
  // out[N, OC] = inp[N, C] @ W^T + bias (bias may be null).
  virtual void Linear(float* out, const float* inp, const float* w, const uint16_t* w16,
                      const float* bias, int N, int C, int OC) = 0;
  // dinp += dout @ W (dinp may be null); dw += dout^T @ inp; dbias += column sums (may be
  // null).
  virtual void LinearBackward(float* dinp, float* dw, float* dbias, const float* dout,
                              const float* inp, const float* w, const uint16_t* w16, int N, int C,
                              int OC) = 0;
  virtual void AttentionForward(float* out, float* att, const float* qkv, int B, int T, int C,
                                int NH) = 0;
  virtual void AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* att,
                                 int B, int T, int C, int NH) = 0;
  virtual void GeluForward(float* out, const float* inp, size_t n) = 0;
  virtual void GeluBackward(float* dinp, const float* inp, const float* dout, size_t n) = 0;
  virtual void ResidualForward(float* out, const float* a, const float* b, size_t n) = 0;
  // The mean loss over N rows (summed in row order, in double); writes dlogits (overwrites)
  // when not null. Waits for the ops before it (the loss is read on the host).
  virtual Result<double> CrossEntropy(float* dlogits, const float* logits, const int32_t* targets,
                                      int N, int V, double dloss) = 0;
};

// The CPU ops (never fail).
std::unique_ptr<ModelOps> NewHostModelOps();

// The GPU ops on `device` (a CudaDevice), enqueued on its compute stream; scratch for `dims`
// is reserved from the device's pool here. NotSupported when built without CUDA or when
// `device` is not a CudaDevice.
Result<std::unique_ptr<ModelOps>> NewCudaModelOps(Device* device, const ModelDims& dims);
// The device bytes NewCudaModelOps reserves for `dims` (its scratch, not the activations).
size_t CudaModelOpsScratchBytes(const ModelDims& dims);

}  // namespace zinf::train
