// Linear layers with bf16 weights for small token counts (see kernels.h).
//
// At a few dozen tokens a Linear layer is bound by reading its weight, not by FLOPs: widening
// the bf16 weight to an fp32 copy and handing that to sgemm reads and writes it three times
// per pass (the copy, then sgemm's packing). These kernels read the bf16 weight once and widen
// it in registers. Vectors are GCC vector extensions compiled for AVX-512, AVX2 and baseline
// x86-64 (target_clones picks one at load time), so one binary runs everywhere.
//
// Determinism: every output element is computed by one task in a fixed order (lanes of 16
// consecutive inputs, then a fixed pairwise sum of the lanes), whatever the thread count.
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cstring>

#include "train/kernels.h"

namespace zinf::train {
namespace {

typedef float F16 __attribute__((vector_size(64)));
typedef uint16_t U16x16 __attribute__((vector_size(32)));
typedef uint32_t U32x16 __attribute__((vector_size(64)));

constexpr int kRows = 8;  // token rows per register block

#define ZINF_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

inline F16 LoadF(const float* p) {
  F16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void StoreF(float* p, F16 v) { std::memcpy(p, &v, sizeof(v)); }
// 16 bf16 values widened exactly to fp32 (the bf16 bits are the upper half of the float).
inline F16 LoadBf16(const uint16_t* p) {
  U16x16 h;
  std::memcpy(&h, p, sizeof(h));
  U32x16 w = __builtin_convertvector(h, U32x16) << 16;
  F16 f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}
inline float WidenBf16(uint16_t h) {
  uint32_t w = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}
// Fixed-order sum of the 16 lanes: pairwise halves.
inline float SumLanes(F16 v) {
  float a[16];
  std::memcpy(a, &v, sizeof(a));
  for (int width = 8; width >= 1; width /= 2) {
    for (int i = 0; i < width; ++i) a[i] += a[i + width];
  }
  return a[0];
}

// out[m, o] for o in [o0, o1), rows m0..m0+rows-1 (rows <= kRows).
ZINF_CLONES void ForwardBlock(float* out, const float* inp, const uint16_t* w, const float* bias,
                              int m0, int rows, int C, int OC, int o0, int o1) {
  const int cv = C / 16 * 16;
  for (int o = o0; o < o1; ++o) {
    const uint16_t* wr = w + static_cast<size_t>(o) * C;
    F16 acc[kRows];
    for (int r = 0; r < rows; ++r) acc[r] = F16{};
    for (int c = 0; c < cv; c += 16) {
      const F16 wv = LoadBf16(wr + c);
      for (int r = 0; r < rows; ++r) {
        acc[r] += LoadF(inp + static_cast<size_t>(m0 + r) * C + c) * wv;
      }
    }
    for (int r = 0; r < rows; ++r) {
      float s = SumLanes(acc[r]);
      const float* x = inp + static_cast<size_t>(m0 + r) * C;
      for (int c = cv; c < C; ++c) s += x[c] * WidenBf16(wr[c]);
      out[static_cast<size_t>(m0 + r) * OC + o] = s + (bias != nullptr ? bias[o] : 0.0f);
    }
  }
}

// dinp[m, c] += sum_o dout[m, o] w[o, c] for c in [c0, c1) (multiples of 16 but the last).
ZINF_CLONES void BackwardInputBlock(float* dinp, const float* dout, const uint16_t* w, int M, int C,
                                    int OC, int c0, int c1) {
  for (int m0 = 0; m0 < M; m0 += kRows) {
    const int rows = std::min(kRows, M - m0);
    int c = c0;
    for (; c + 16 <= c1; c += 16) {
      F16 acc[kRows];
      for (int r = 0; r < rows; ++r) acc[r] = F16{};
      for (int o = 0; o < OC; ++o) {
        const F16 wv = LoadBf16(w + static_cast<size_t>(o) * C + c);
        for (int r = 0; r < rows; ++r) {
          acc[r] += dout[static_cast<size_t>(m0 + r) * OC + o] * wv;
        }
      }
      for (int r = 0; r < rows; ++r) {
        float* d = dinp + static_cast<size_t>(m0 + r) * C + c;
        StoreF(d, LoadF(d) + acc[r]);
      }
    }
    for (; c < c1; ++c) {
      for (int r = 0; r < rows; ++r) {
        float s = 0;
        for (int o = 0; o < OC; ++o) {
          s += dout[static_cast<size_t>(m0 + r) * OC + o] *
               WidenBf16(w[static_cast<size_t>(o) * C + c]);
        }
        dinp[static_cast<size_t>(m0 + r) * C + c] += s;
      }
    }
  }
}

// dw[o, c] (+)= sum_m dout[m, o] inp[m, c] for o in [o0, o1).
ZINF_CLONES void BackwardWeightBlock(float* dw, const float* dout, const float* inp, int M, int C,
                                     int OC, int o0, int o1, bool accumulate) {
  const int cv = C / 16 * 16;
  for (int o = o0; o < o1; ++o) {
    float* d = dw + static_cast<size_t>(o) * C;
    for (int c = 0; c < cv; c += 16) {
      F16 acc = accumulate ? LoadF(d + c) : F16{};
      for (int m = 0; m < M; ++m) {
        acc += dout[static_cast<size_t>(m) * OC + o] * LoadF(inp + static_cast<size_t>(m) * C + c);
      }
      StoreF(d + c, acc);
    }
    for (int c = cv; c < C; ++c) {
      float s = accumulate ? d[c] : 0.0f;
      for (int m = 0; m < M; ++m) {
        s += dout[static_cast<size_t>(m) * OC + o] * inp[static_cast<size_t>(m) * C + c];
      }
      d[c] = s;
    }
  }
}

constexpr int kGrainRows = 64;  // output features per task

}  // namespace

void MatmulForwardBf16(float* out, const float* inp, const uint16_t* w, const float* bias, int N,
                       int C, int OC) {
  if (N <= 0 || OC <= 0) return;
  tbb::parallel_for(
      tbb::blocked_range<int>(0, OC, kGrainRows), [&](const tbb::blocked_range<int>& r) {
        for (int m0 = 0; m0 < N; m0 += kRows) {
          ForwardBlock(out, inp, w, bias, m0, std::min(kRows, N - m0), C, OC, r.begin(), r.end());
        }
      });
}

void MatmulBackwardBf16(float* dinp, float* dw, float* dbias, const float* dout, const float* inp,
                        const uint16_t* w, int N, int C, int OC, bool accumulate_dw) {
  if (N <= 0 || OC <= 0 || C <= 0) return;
  if (dinp != nullptr) {
    // Column blocks of 256 inputs: each task owns its columns of dinp.
    const int blocks = (C + 255) / 256;
    tbb::parallel_for(tbb::blocked_range<int>(0, blocks, 1), [&](const tbb::blocked_range<int>& r) {
      for (int b = r.begin(); b < r.end(); ++b) {
        BackwardInputBlock(dinp, dout, w, N, C, OC, b * 256, std::min(C, (b + 1) * 256));
      }
    });
  }
  tbb::parallel_for(
      tbb::blocked_range<int>(0, OC, kGrainRows), [&](const tbb::blocked_range<int>& r) {
        BackwardWeightBlock(dw, dout, inp, N, C, OC, r.begin(), r.end(), accumulate_dw);
      });
  if (dbias != nullptr) {
    for (int n = 0; n < N; ++n) {
      const float* d = dout + static_cast<size_t>(n) * OC;
      for (int j = 0; j < OC; ++j) dbias[j] += d[j];
    }
  }
}

}  // namespace zinf::train
