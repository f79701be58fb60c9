// HostModelOps: the CPU kernels of kernels.h behind the ModelOps interface.
#include <algorithm>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "train/kernels.h"
#include "train/model_ops.h"
#include "zinf/cpu_adam.h"

namespace zinf::train {
namespace {

class HostModelOps final : public ModelOps {
 public:
  bool on_device() const override { return false; }
  Status status() override { return Status::OK(); }

  Result<float*> AllocFloats(size_t n) override { return Allocate(&floats_, n); }
  Result<int32_t*> AllocInts(size_t n) override { return Allocate(&ints_, n); }
  void UploadInts(int32_t* dst, const int32_t* host_src, size_t n) override {
    if (n > 0) std::memcpy(dst, host_src, n * sizeof(int32_t));
  }
  Status Download(float* host_dst, const float* src, size_t n) override {
    if (n > 0) std::memcpy(host_dst, src, n * sizeof(float));
    return Status::OK();
  }

  void Zero(float* p, size_t n) override { std::fill(p, p + n, 0.0f); }
  void Copy(float* dst, const float* src, size_t n) override { std::copy(src, src + n, dst); }
  void Bf16ToFp32(float* dst, const uint16_t* src, size_t n) override {
    train::Bf16ToFp32(dst, src, n);
  }
  void F16ToFp32(float* dst, const uint16_t* src, size_t n) override {
    for (size_t i = 0; i < n; ++i) dst[i] = zinf::Fp16ToFp32(src[i]);
  }
  void RoundToF16(float* x, size_t n) override {
    for (size_t i = 0; i < n; ++i) x[i] = zinf::Fp16ToFp32(zinf::Fp32ToFp16(x[i]));
  }

  void EncoderForward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int B,
                      int T, int C) override {
    train::EncoderForward(out, tokens, wte, wpe, B, T, C);
  }
  void EncoderBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B,
                       int T, int C) override {
    train::EncoderBackward(dwte, dwpe, dout, tokens, B, T, C);
  }
  void LayerNormForward(float* out, float* mean, float* rstd, const float* inp, const float* w,
                        const float* b, int N, int C) override {
    train::LayerNormForward(out, mean, rstd, inp, w, b, N, C);
  }
  void LayerNormBackward(float* dinp, float* dw, float* db, const float* dout, const float* inp,
                         const float* w, const float* mean, const float* rstd, int N,
                         int C) override {
    train::LayerNormBackward(dinp, dw, db, dout, inp, w, mean, rstd, N, C);
  }
  void Linear(float* out, const float* inp, const float* w, const uint16_t* w16, const float* bias,
              int N, int C, int OC) override {
    if (w16 != nullptr) {
      MatmulForwardBf16(out, inp, w16, bias, N, C, OC);
    } else {
      MatmulForward(out, inp, w, bias, N, C, OC);
    }
  }
  void LinearBackward(float* dinp, float* dw, float* dbias, const float* dout, const float* inp,
                      const float* w, const uint16_t* w16, int N, int C, int OC) override {
    if (w16 != nullptr) {
      MatmulBackwardBf16(dinp, dw, dbias, dout, inp, w16, N, C, OC, /*accumulate_dw=*/true);
    } else {
      MatmulBackward(dinp, dw, dbias, dout, inp, w, N, C, OC);
    }
  }
  void AttentionForward(float* out, float* att, const float* qkv, int B, int T, int C,
                        int NH) override {
    train::AttentionForward(out, att, qkv, B, T, C, NH);
  }
  void AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* att, int B,
                         int T, int C, int NH) override {
    train::AttentionBackward(dqkv, dout, qkv, att, B, T, C, NH);
  }
  void GeluForward(float* out, const float* inp, size_t n) override {
    train::GeluForward(out, inp, n);
  }
  void GeluBackward(float* dinp, const float* inp, const float* dout, size_t n) override {
    train::GeluBackward(dinp, inp, dout, n);
  }
  void ResidualForward(float* out, const float* a, const float* b, size_t n) override {
    train::ResidualForward(out, a, b, n);
  }
  Result<double> CrossEntropy(float* dlogits, const float* logits, const int32_t* targets, int N,
                              int V, double dloss) override {
    return CrossEntropyForwardBackward(dlogits, logits, targets, N, V, dloss);
  }

 private:
  template <typename T>
  static Result<T*> Allocate(std::vector<std::vector<T>>* pool, size_t n) {
    try {
      pool->emplace_back(n, T{});
    } catch (const std::bad_alloc&) {
      return Status::ResourceExhausted("out of host memory for " + std::to_string(n * sizeof(T)) +
                                       " bytes");
    } catch (const std::length_error&) {
      return Status::ResourceExhausted("a buffer of " + std::to_string(n) +
                                       " elements is larger than this machine can allocate");
    }
    return pool->back().data();
  }

  std::vector<std::vector<float>> floats_;
  std::vector<std::vector<int32_t>> ints_;
};

}  // namespace

std::unique_ptr<ModelOps> NewHostModelOps() { return std::make_unique<HostModelOps>(); }

}  // namespace zinf::train
