// CPU kernels of the GPT model zinf-train trains: forward and backward of every layer.
//
// Layout: activations are row-major [N, C] with N = B * T tokens (batch-major); a Linear
// weight is [OC, C] (out features first, as in torch), so y = x W^T + b.
//
// Conventions:
// - Every backward kernel ACCUMULATES (+=) into its gradient outputs; the caller zeroes them.
//   A null gradient pointer means "not needed" where the comment says so.
// - Templates on the element type: float (training, OpenBLAS sgemm) and double (the gradient
//   check of the tests, OpenBLAS dgemm). Both are explicitly instantiated in kernels.cc.
// - Deterministic: a fixed summation order for a fixed thread count of OpenBLAS.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zinf::train {

// out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:].   wte: [V, C], wpe: [maxT, C], out: [B*T, C].
template <typename T>
void EncoderForward(T* out, const int32_t* tokens, const T* wte, const T* wpe, int B, int Tn,
                    int C);
// dwte[tokens[b,t],:] += dout[b,t,:]; dwpe[t,:] += dout[b,t,:].
template <typename T>
void EncoderBackward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int B, int Tn, int C);

// out = (inp - mean) * rstd * w + b per row; saves mean[N] and rstd[N] for the backward.
// eps = 1e-5.
template <typename T>
void LayerNormForward(T* out, T* mean, T* rstd, const T* inp, const T* w, const T* b, int N, int C);
// dinp += ..., dw += ..., db += ...
template <typename T>
void LayerNormBackward(T* dinp, T* dw, T* db, const T* dout, const T* inp, const T* w,
                       const T* mean, const T* rstd, int N, int C);

// out[N, OC] = inp[N, C] @ w[OC, C]^T + bias[OC]; bias may be null.
template <typename T>
void MatmulForward(T* out, const T* inp, const T* w, const T* bias, int N, int C, int OC);
// dinp[N, C] += dout @ w; dw[OC, C] += dout^T @ inp; dbias[OC] += column sums of dout.
// dinp and dbias may be null.
template <typename T>
void MatmulBackward(T* dinp, T* dw, T* dbias, const T* dout, const T* inp, const T* w, int N, int C,
                    int OC);

// Causal multi-head self-attention. qkv: [B*T, 3C] holding q | k | v, each C = NH * hs wide
// (head h uses columns h*hs .. h*hs+hs-1 of its part). out: [B*T, C] (heads concatenated).
// att: [B, NH, T, T] softmax probabilities (entries above the diagonal are 0); scale
// 1/sqrt(hs).
template <typename T>
void AttentionForward(T* out, T* att, const T* qkv, int B, int Tn, int C, int NH);
// dqkv += ...   (uses the saved probabilities att).
template <typename T>
void AttentionBackward(T* dqkv, const T* dout, const T* qkv, const T* att, int B, int Tn, int C,
                       int NH);

// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
template <typename T>
void GeluForward(T* out, const T* inp, size_t n);
// dinp += gelu'(inp) * dout.
template <typename T>
void GeluBackward(T* dinp, const T* inp, const T* dout, size_t n);

// out = a + b.
template <typename T>
void ResidualForward(T* out, const T* a, const T* b, size_t n);

// Softmax cross-entropy over V classes for N rows of logits. Returns the mean loss over the
// rows (accumulated in double). Writes dlogits = (softmax - onehot(target)) * dloss / N, i.e.
// the gradient of dloss * mean-loss (overwrites, does not accumulate). dlogits may be null.
template <typename T>
double CrossEntropyForwardBackward(T* dlogits, const T* logits, const int32_t* targets, int N,
                                   int V, double dloss);

// Linear layers whose weight w[OC, C] is bf16, for small token counts N (a few dozen): the
// weight is read once and widened in registers instead of converted to an fp32 copy for
// sgemm (matmul_bf16.cc). fp32 inputs, outputs and gradients; deterministic for any thread
// count (not bit-identical to the sgemm path: another summation order).
// out[N, OC] = inp @ widen(w)^T + bias (bias may be null).
void MatmulForwardBf16(float* out, const float* inp, const uint16_t* w, const float* bias, int N,
                       int C, int OC);
// dinp += dout @ widen(w) (dinp may be null); dw = dout^T @ inp, added to dw when
// accumulate_dw, else overwriting it; dbias += column sums of dout (may be null).
void MatmulBackwardBf16(float* dinp, float* dw, float* dbias, const float* dout, const float* inp,
                        const uint16_t* w, int N, int C, int OC, bool accumulate_dw);

// bf16 (the upper 16 bits of an IEEE float) -> fp32, exact.
void Bf16ToFp32(float* out, const uint16_t* in, size_t n);

}  // namespace zinf::train
