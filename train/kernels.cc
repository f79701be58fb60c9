// CPU kernels of the GPT model: forward and backward of every layer (see kernels.h).
//
// Matrix products go through OpenBLAS (cblas_sgemm / cblas_dgemm, row-major); everything else
// is plain loops over contiguous rows that the compiler can vectorise.
#include "train/kernels.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace zinf::train {
namespace {

// Row-major C[m, n] = alpha * op(A)[m, k] @ op(B)[k, n] + beta * C, one overload per type.
void Gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int m, int n, int k, float alpha, const float* a,
          int lda, const float* b, int ldb, float beta, float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
void Gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int m, int n, int k, double alpha,
          const double* a, int lda, const double* b, int ldb, double beta, double* c, int ldc) {
  cblas_dgemm(CblasRowMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

constexpr double kLayerNormEps = 1e-5;

}  // namespace

// ---------------------------------------------------------------------------------------------
// Encoder: token embedding plus position embedding.

template <typename T>
void EncoderForward(T* out, const int32_t* tokens, const T* wte, const T* wpe, int B, int Tn,
                    int C) {
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < Tn; ++t) {
      const size_t row = static_cast<size_t>(b) * Tn + t;
      T* o = out + row * C;
      const T* te = wte + static_cast<size_t>(tokens[row]) * C;
      const T* pe = wpe + static_cast<size_t>(t) * C;
      for (int i = 0; i < C; ++i) o[i] = te[i] + pe[i];
    }
  }
}

// out is linear in both tables, so each output row's gradient flows unchanged into the row it
// was read from (several tokens may hit the same wte row: their gradients add up).
template <typename T>
void EncoderBackward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int B, int Tn, int C) {
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < Tn; ++t) {
      const size_t row = static_cast<size_t>(b) * Tn + t;
      const T* d = dout + row * C;
      T* dte = dwte + static_cast<size_t>(tokens[row]) * C;
      T* dpe = dwpe + static_cast<size_t>(t) * C;
      for (int i = 0; i < C; ++i) {
        dte[i] += d[i];
        dpe[i] += d[i];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// LayerNorm over the C features of each row.

template <typename T>
void LayerNormForward(T* out, T* mean, T* rstd, const T* inp, const T* w, const T* b, int N,
                      int C) {
  for (int n = 0; n < N; ++n) {
    const T* x = inp + static_cast<size_t>(n) * C;
    T* o = out + static_cast<size_t>(n) * C;
    // Two passes: mean, then the biased variance (1/C) sum (x - mean)^2; sums in double.
    double sum = 0.0;
    for (int i = 0; i < C; ++i) sum += x[i];
    const double m = sum / C;
    double sq = 0.0;
    for (int i = 0; i < C; ++i) {
      const double d = x[i] - m;
      sq += d * d;
    }
    const double var = sq / C;
    const T mu = static_cast<T>(m);
    const T rs = static_cast<T>(1.0 / std::sqrt(var + kLayerNormEps));
    for (int i = 0; i < C; ++i) o[i] = (x[i] - mu) * rs * w[i] + b[i];
    mean[n] = mu;
    rstd[n] = rs;
  }
}

// With xhat = (x - mean) * rstd and g = dout * w (the gradient wrt xhat):
//   db += dout, dw += dout * xhat,
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),
// the last from differentiating mean and rstd (both functions of the whole row) through xhat.
template <typename T>
void LayerNormBackward(T* dinp, T* dw, T* db, const T* dout, const T* inp, const T* w,
                       const T* mean, const T* rstd, int N, int C) {
  for (int n = 0; n < N; ++n) {
    const T* x = inp + static_cast<size_t>(n) * C;
    const T* d = dout + static_cast<size_t>(n) * C;
    T* dx = dinp + static_cast<size_t>(n) * C;
    const T mu = mean[n];
    const T rs = rstd[n];
    // The two row means of the dx formula, accumulated in double.
    double sum_g = 0.0;
    double sum_gx = 0.0;
    for (int i = 0; i < C; ++i) {
      const T xhat = (x[i] - mu) * rs;
      const T g = d[i] * w[i];
      sum_g += g;
      sum_gx += static_cast<double>(g) * xhat;
    }
    const T mean_g = static_cast<T>(sum_g / C);
    const T mean_gx = static_cast<T>(sum_gx / C);
    for (int i = 0; i < C; ++i) {
      const T xhat = (x[i] - mu) * rs;
      const T g = d[i] * w[i];
      db[i] += d[i];
      dw[i] += d[i] * xhat;
      dx[i] += rs * (g - mean_g - xhat * mean_gx);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Linear layer: out = inp @ w^T + bias.

template <typename T>
void MatmulForward(T* out, const T* inp, const T* w, const T* bias, int N, int C, int OC) {
  if (N <= 0 || OC <= 0) return;
  if (C > 0) {
    Gemm(CblasNoTrans, CblasTrans, N, OC, C, T(1), inp, C, w, C, T(0), out, OC);
  } else {
    std::fill(out, out + static_cast<size_t>(N) * OC, T(0));  // empty product
  }
  if (bias != nullptr) {
    for (int n = 0; n < N; ++n) {
      T* o = out + static_cast<size_t>(n) * OC;
      for (int j = 0; j < OC; ++j) o[j] += bias[j];
    }
  }
}

// out[n, j] = sum_i inp[n, i] w[j, i] + bias[j], hence
//   dinp[n, i] += sum_j dout[n, j] w[j, i]     (dout @ w)
//   dw[j, i]   += sum_n dout[n, j] inp[n, i]   (dout^T @ inp)
//   dbias[j]   += sum_n dout[n, j].
template <typename T>
void MatmulBackward(T* dinp, T* dw, T* dbias, const T* dout, const T* inp, const T* w, int N, int C,
                    int OC) {
  if (N <= 0 || OC <= 0) return;
  if (C > 0) {  // with C == 0, dinp and dw are empty
    if (dinp != nullptr) {
      Gemm(CblasNoTrans, CblasNoTrans, N, C, OC, T(1), dout, OC, w, C, T(1), dinp, C);
    }
    Gemm(CblasTrans, CblasNoTrans, OC, C, N, T(1), dout, OC, inp, C, T(1), dw, C);
  }
  if (dbias != nullptr) {
    for (int n = 0; n < N; ++n) {
      const T* d = dout + static_cast<size_t>(n) * OC;
      for (int j = 0; j < OC; ++j) dbias[j] += d[j];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Causal multi-head self-attention, one (batch, head) pair at a time. For one pair let Q, K, V
// be the [Tn, hs] slices of qkv (row stride 3C), S = Q K^T / sqrt(hs) the scores, P the
// row-wise softmax of S restricted to the causal part (key j <= query t), and O = P V.

template <typename T>
void AttentionForward(T* out, T* att, const T* qkv, int B, int Tn, int C, int NH) {
  if (B <= 0 || Tn <= 0 || C <= 0 || NH <= 0) return;
  const int hs = C / NH;
  const int ld = 3 * C;  // row stride of qkv
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(hs)));
  for (int b = 0; b < B; ++b) {
    const T* base = qkv + static_cast<size_t>(b) * Tn * ld;
    for (int h = 0; h < NH; ++h) {
      const T* q = base + h * hs;
      const T* k = q + C;
      const T* v = q + 2 * C;
      T* p = att + (static_cast<size_t>(b) * NH + h) * Tn * Tn;
      // S = scale * Q K^T over the full square (the part above the diagonal is discarded).
      Gemm(CblasNoTrans, CblasTrans, Tn, Tn, hs, scale, q, ld, k, ld, T(0), p, Tn);
      // Stable softmax of each row over keys 0..t: subtract the row max before exp.
      for (int t = 0; t < Tn; ++t) {
        T* row = p + static_cast<size_t>(t) * Tn;
        T mx = row[0];
        for (int j = 1; j <= t; ++j) mx = std::max(mx, row[j]);
        double sum = 0.0;
        for (int j = 0; j <= t; ++j) {
          row[j] = std::exp(row[j] - mx);
          sum += row[j];
        }
        const T inv = static_cast<T>(1.0 / sum);
        for (int j = 0; j <= t; ++j) row[j] *= inv;
        for (int j = t + 1; j < Tn; ++j) row[j] = T(0);  // masked (future) keys
      }
      // O = P V, written into this head's columns of out (row stride C).
      T* o = out + static_cast<size_t>(b) * Tn * C + h * hs;
      Gemm(CblasNoTrans, CblasNoTrans, Tn, hs, Tn, T(1), p, Tn, v, ld, T(0), o, C);
    }
  }
}

// Given dO:
//   dV += P^T dO,   dP = dO V^T,
//   dS[t, j] = P[t, j] (dP[t, j] - sum_k P[t, k] dP[t, k])   (softmax backward; 0 if j > t),
//   dQ += scale * dS K,   dK += scale * dS^T Q.
template <typename T>
void AttentionBackward(T* dqkv, const T* dout, const T* qkv, const T* att, int B, int Tn, int C,
                       int NH) {
  if (B <= 0 || Tn <= 0 || C <= 0 || NH <= 0) return;
  const int hs = C / NH;
  const int ld = 3 * C;
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(hs)));
  std::vector<T> ds(static_cast<size_t>(Tn) * Tn);  // dP, turned into dS in place
  for (int b = 0; b < B; ++b) {
    const size_t qkv_off = static_cast<size_t>(b) * Tn * ld;
    for (int h = 0; h < NH; ++h) {
      const T* q = qkv + qkv_off + h * hs;
      const T* k = q + C;
      const T* v = q + 2 * C;
      T* dq = dqkv + qkv_off + h * hs;
      T* dk = dq + C;
      T* dv = dq + 2 * C;
      const T* p = att + (static_cast<size_t>(b) * NH + h) * Tn * Tn;
      const T* dout_h = dout + static_cast<size_t>(b) * Tn * C + h * hs;

      Gemm(CblasTrans, CblasNoTrans, Tn, hs, Tn, T(1), p, Tn, dout_h, C, T(1), dv, ld);
      Gemm(CblasNoTrans, CblasTrans, Tn, Tn, hs, T(1), dout_h, C, v, ld, T(0), ds.data(), Tn);
      for (int t = 0; t < Tn; ++t) {
        const T* prow = p + static_cast<size_t>(t) * Tn;
        T* row = ds.data() + static_cast<size_t>(t) * Tn;
        double dot = 0.0;
        for (int j = 0; j <= t; ++j) dot += static_cast<double>(prow[j]) * row[j];
        const T pdp = static_cast<T>(dot);
        for (int j = 0; j <= t; ++j) row[j] = prow[j] * (row[j] - pdp);
        for (int j = t + 1; j < Tn; ++j) row[j] = T(0);
      }
      Gemm(CblasNoTrans, CblasNoTrans, Tn, hs, Tn, scale, ds.data(), Tn, k, ld, T(1), dq, ld);
      Gemm(CblasTrans, CblasNoTrans, Tn, hs, Tn, scale, ds.data(), Tn, q, ld, T(1), dk, ld);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// GELU (tanh approximation) and the residual add.

namespace {
constexpr double kSqrt2OverPi = 0.79788456080286535588;  // sqrt(2 / pi)
constexpr double kGeluCubic = 0.044715;
}  // namespace

// tanh for the GELU. double: std::tanh (the gradient checks). float: 1 - 2 / (exp(2u) + 1)
// with an exp written so that the loops vectorise (std::tanh is a scalar libm call and was
// a third of the demo's step): |error| < 2e-7 absolute, which is what 0.5 x (1 + tanh)
// and 1 - tanh^2 need.
inline double TanhForGelu(double u) { return std::tanh(u); }
inline float TanhForGelu(float u) {
  u = std::min(std::max(u, -9.0f), 9.0f);  // tanh(9) = 1 - 3e-8
  const float x = 2.0f * u;
  // exp(x) = 2^n exp(r), n = round(x / ln 2), |r| <= ln(2) / 2; round to nearest by the
  // 1.5 * 2^23 trick (exact for |x / ln 2| < 2^22).
  const float t = x * 1.44269504088896341f;
  const float n = (t + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  // Taylor to degree 7: relative error < r^8 / 8! < 6e-9 on |r| <= 0.347.
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-26, 26]
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return 1.0f - 2.0f / (p * scale + 1.0f);
}

template <typename T>
void GeluForward(T* out, const T* inp, size_t n) {
  const T s = static_cast<T>(kSqrt2OverPi);
  const T c = static_cast<T>(kGeluCubic);
  for (size_t i = 0; i < n; ++i) {
    const T x = inp[i];
    const T u = s * (x + c * x * x * x);
    out[i] = T(0.5) * x * (T(1) + TanhForGelu(u));
  }
}

// With u = s (x + c x^3) and th = tanh(u):
//   gelu'(x) = 0.5 (1 + th) + 0.5 x (1 - th^2) s (1 + 3 c x^2).
template <typename T>
void GeluBackward(T* dinp, const T* inp, const T* dout, size_t n) {
  const T s = static_cast<T>(kSqrt2OverPi);
  const T c = static_cast<T>(kGeluCubic);
  for (size_t i = 0; i < n; ++i) {
    const T x = inp[i];
    const T u = s * (x + c * x * x * x);
    const T th = TanhForGelu(u);
    const T du = s * (T(1) + T(3) * c * x * x);
    const T grad = T(0.5) * (T(1) + th) + T(0.5) * x * (T(1) - th * th) * du;
    dinp[i] += grad * dout[i];
  }
}

template <typename T>
void ResidualForward(T* out, const T* a, const T* b, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

// ---------------------------------------------------------------------------------------------
// Softmax cross-entropy. Per row, with m = max_j x_j and lse = m + log sum_j exp(x_j - m):
//   loss = lse - x[target],   dloss_row/dx_j = softmax_j - [j == target].
// The mean over N rows scales every row's gradient by 1/N, and the caller's dloss on top.

template <typename T>
double CrossEntropyForwardBackward(T* dlogits, const T* logits, const int32_t* targets, int N,
                                   int V, double dloss) {
  if (N <= 0 || V <= 0) return 0.0;
  const double row_scale = dloss / N;
  double total = 0.0;
  for (int n = 0; n < N; ++n) {
    const T* x = logits + static_cast<size_t>(n) * V;
    T mx = x[0];
    for (int j = 1; j < V; ++j) mx = std::max(mx, x[j]);
    double sum = 0.0;
    if (dlogits != nullptr) {
      // Keep exp(x - m) in dlogits; normalised below.
      T* d = dlogits + static_cast<size_t>(n) * V;
      for (int j = 0; j < V; ++j) {
        d[j] = std::exp(x[j] - mx);
        sum += d[j];
      }
      const T f = static_cast<T>(row_scale / sum);  // softmax_j * dloss / N = e_j * f
      for (int j = 0; j < V; ++j) d[j] *= f;
      d[targets[n]] -= static_cast<T>(row_scale);
    } else {
      for (int j = 0; j < V; ++j) sum += std::exp(x[j] - mx);
    }
    const double lse = static_cast<double>(mx) + std::log(sum);
    total += lse - static_cast<double>(x[targets[n]]);
  }
  return total / N;
}

// ---------------------------------------------------------------------------------------------
// bf16 holds the upper 16 bits of an IEEE binary32, so widening is a 16-bit left shift (exact
// for every pattern: normals, denormals, infinities, NaNs).
void Bf16ToFp32(float* out, const uint16_t* in, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(in[i]) << 16;
    std::memcpy(out + i, &bits, sizeof(bits));
  }
}

// ---------------------------------------------------------------------------------------------
// Explicit instantiations: float (training) and double (gradient checks).

#define ZINF_TRAIN_INSTANTIATE(T)                                                                  \
  template void EncoderForward<T>(T*, const int32_t*, const T*, const T*, int, int, int);          \
  template void EncoderBackward<T>(T*, T*, const T*, const int32_t*, int, int, int);               \
  template void LayerNormForward<T>(T*, T*, T*, const T*, const T*, const T*, int, int);           \
  template void LayerNormBackward<T>(T*, T*, T*, const T*, const T*, const T*, const T*, const T*, \
                                     int, int);                                                    \
  template void MatmulForward<T>(T*, const T*, const T*, const T*, int, int, int);                 \
  template void MatmulBackward<T>(T*, T*, T*, const T*, const T*, const T*, int, int, int);        \
  template void AttentionForward<T>(T*, T*, const T*, int, int, int, int);                         \
  template void AttentionBackward<T>(T*, const T*, const T*, const T*, int, int, int, int);        \
  template void GeluForward<T>(T*, const T*, size_t);                                              \
  template void GeluBackward<T>(T*, const T*, const T*, size_t);                                   \
  template void ResidualForward<T>(T*, const T*, const T*, size_t);                                \
  template double CrossEntropyForwardBackward<T>(T*, const T*, const int32_t*, int, int, double);

ZINF_TRAIN_INSTANTIATE(float)
ZINF_TRAIN_INSTANTIATE(double)

#undef ZINF_TRAIN_INSTANTIATE

}  // namespace zinf::train
