// The model the end-to-end engine test trains: a deep MLP (Linear + ReLU, last layer linear)
// with an MSE loss, on CPU kernels written here.
//
// The kernels are deterministic on purpose: plain loops, fp32, one fixed summation order, no
// BLAS, no threads. Two runs that feed them the same bits get the same bits back, so any
// difference between two engine placements comes from the engine, not from the model.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace zinf::testing {

// SplitMix64: a well-mixed hash, the source of every "random" value in the test.
inline uint64_t Mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A uniform value in [-1, 1) determined by (seed, a, b): 24 random bits, exact in fp32.
inline float HashUniform(uint64_t seed, uint64_t a, uint64_t b) {
  uint64_t h = Mix64(seed ^ Mix64(a * 0x100000001B3ull ^ Mix64(b + 0x51ED27ull)));
  float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);  // [0, 1)
  return 2.0f * u - 1.0f;
}

// Linear(W: out x in, b: out) layers; ReLU after every layer but the last.
struct MlpShape {
  std::vector<int> widths;  // widths[0] inputs ... widths.back() outputs

  int layers() const { return static_cast<int>(widths.size()) - 1; }
  int in(int layer) const { return widths[layer]; }
  int out(int layer) const { return widths[layer + 1]; }
  // Parameters in registration (layer) order: W0, b0, W1, b1, ...
  int num_params() const { return 2 * layers(); }
  static int layer_of(int param) { return param / 2; }
  static bool is_weight(int param) { return param % 2 == 0; }
  size_t numel(int param) const {
    int l = layer_of(param);
    return is_weight(param) ? static_cast<size_t>(out(l)) * in(l) : static_cast<size_t>(out(l));
  }
  std::vector<int64_t> param_shape(int param) const {
    int l = layer_of(param);
    if (is_weight(param)) return {out(l), in(l)};
    return {out(l)};
  }
  size_t total_numel() const {
    size_t n = 0;
    for (int p = 0; p < num_params(); ++p) n += numel(p);
    return n;
  }
  // Bytes of one layer's full fp32 parameters (W and b).
  size_t layer_bytes(int layer) const {
    return (numel(2 * layer) + numel(2 * layer + 1)) * sizeof(float);
  }
  size_t largest_layer_bytes() const {
    size_t m = 0;
    for (int l = 0; l < layers(); ++l) m = layer_bytes(l) > m ? layer_bytes(l) : m;
    return m;
  }
};

// Like torch.nn.Linear's default: uniform in [-1/sqrt(in), 1/sqrt(in)], here from a hash so
// that every rank (and the simulation) produces the same values.
inline void InitParam(const MlpShape& shape, int param, float* data, size_t numel) {
  const float bound = 1.0f / std::sqrt(static_cast<float>(shape.in(MlpShape::layer_of(param))));
  for (size_t i = 0; i < numel; ++i) data[i] = bound * HashUniform(0x1417, param, i);
}

// The fixed synthetic batch: inputs in [-1, 1), targets in [-2, 2) (large enough that the
// gradient norm stays above the clipping threshold the clipping test uses).
struct Batch {
  int rows = 0;
  int in = 0;
  int out = 0;
  std::vector<float> x;       // rows x in
  std::vector<float> target;  // rows x out
};

inline Batch MakeBatch(const MlpShape& shape, int rows, uint64_t seed) {
  Batch b;
  b.rows = rows;
  b.in = shape.widths.front();
  b.out = shape.widths.back();
  b.x.resize(static_cast<size_t>(rows) * b.in);
  b.target.resize(static_cast<size_t>(rows) * b.out);
  for (size_t i = 0; i < b.x.size(); ++i) b.x[i] = HashUniform(seed, 1, i);
  for (size_t i = 0; i < b.target.size(); ++i) b.target[i] = 2.0f * HashUniform(seed, 2, i);
  return b;
}

// z[n][o] = b[o] + sum_i x[n][i] * W[o][i], summed in i order.
inline void LinearForward(const float* x, int rows, int in, const float* w, const float* b, int out,
                          float* z) {
  for (int n = 0; n < rows; ++n) {
    for (int o = 0; o < out; ++o) {
      float acc = b[o];
      const float* wrow = w + static_cast<size_t>(o) * in;
      const float* xrow = x + static_cast<size_t>(n) * in;
      for (int i = 0; i < in; ++i) acc += xrow[i] * wrow[i];
      z[static_cast<size_t>(n) * out + o] = acc;
    }
  }
}

inline void Relu(const float* z, size_t n, float* a) {
  for (size_t i = 0; i < n; ++i) a[i] = z[i] > 0.0f ? z[i] : 0.0f;
}

// Gradients of a Linear layer given dz (rows x out) and its input x (rows x in):
//   dW[o][i] = sum_n dz[n][o] x[n][i], db[o] = sum_n dz[n][o] (summed in row order),
//   dx[n][i] = sum_o dz[n][o] W[o][i] (summed in o order; skipped when dx is null).
inline void LinearBackward(const float* x, const float* dz, int rows, int in, int out,
                           const float* w, float* dw, float* db, float* dx) {
  for (int o = 0; o < out; ++o) {
    float bacc = 0.0f;
    for (int n = 0; n < rows; ++n) bacc += dz[static_cast<size_t>(n) * out + o];
    db[o] = bacc;
    for (int i = 0; i < in; ++i) {
      float acc = 0.0f;
      for (int n = 0; n < rows; ++n) {
        acc += dz[static_cast<size_t>(n) * out + o] * x[static_cast<size_t>(n) * in + i];
      }
      dw[static_cast<size_t>(o) * in + i] = acc;
    }
  }
  if (dx == nullptr) return;
  for (int n = 0; n < rows; ++n) {
    for (int i = 0; i < in; ++i) {
      float acc = 0.0f;
      for (int o = 0; o < out; ++o) {
        acc += dz[static_cast<size_t>(n) * out + o] * w[static_cast<size_t>(o) * in + i];
      }
      dx[static_cast<size_t>(n) * in + i] = acc;
    }
  }
}

// dz *= (z > 0): back through a ReLU whose pre-activation was z.
inline void ReluBackward(const float* z, size_t n, float* d) {
  for (size_t i = 0; i < n; ++i) {
    if (!(z[i] > 0.0f)) d[i] = 0.0f;
  }
}

// loss = scale * sum (y - t)^2 over rows x out; dy = 2 * scale * (y - t). The loss is returned
// in double (it is only reported); dy is fp32, computed element by element.
inline double MseLoss(const float* y, const float* target, size_t n, float scale, float* dy) {
  double loss = 0.0;
  for (size_t i = 0; i < n; ++i) {
    float diff = y[i] - target[i];
    loss += static_cast<double>(diff) * diff;
    dy[i] = 2.0f * scale * diff;
  }
  return loss * scale;
}

// Forward and backward of the whole MLP over `rows` rows starting at x/target, with the
// parameters given per parameter index (W0, b0, W1, ...). Writes every parameter's gradient
// into grads[p] (numel(p) floats) and returns the (scaled) loss. The engine test calls the
// same per-layer kernels layer by layer between Acquire and Release; this whole-model form is
// what the test's own simulation of the training uses.
struct MlpWorkspace {
  std::vector<std::vector<float>> acts;  // acts[l]: input of layer l (rows x in(l)); acts[L]: y
  std::vector<std::vector<float>> pre;   // pre[l]: pre-activation z of layer l
  std::vector<float> dz, dx;
};

inline void ForwardLayer(const MlpShape& shape, int l, int rows, const float* w, const float* b,
                         MlpWorkspace* ws) {
  ws->pre[l].resize(static_cast<size_t>(rows) * shape.out(l));
  ws->acts[l + 1].resize(ws->pre[l].size());
  LinearForward(ws->acts[l].data(), rows, shape.in(l), w, b, shape.out(l), ws->pre[l].data());
  if (l + 1 < shape.layers()) {
    Relu(ws->pre[l].data(), ws->pre[l].size(), ws->acts[l + 1].data());
  } else {
    ws->acts[l + 1] = ws->pre[l];
  }
}

// REQUIRES: ws->dz holds dL/dz of layer l (rows x out(l)). Leaves dL/dz of layer l-1 in
// ws->dz (when l > 0).
inline void BackwardLayer(const MlpShape& shape, int l, int rows, const float* w, float* dw,
                          float* db, MlpWorkspace* ws) {
  const bool need_dx = l > 0;
  ws->dx.resize(static_cast<size_t>(rows) * shape.in(l));
  LinearBackward(ws->acts[l].data(), ws->dz.data(), rows, shape.in(l), shape.out(l), w, dw, db,
                 need_dx ? ws->dx.data() : nullptr);
  if (need_dx) {
    ReluBackward(ws->pre[l - 1].data(), ws->dx.size(), ws->dx.data());
    ws->dz.swap(ws->dx);
  }
}

inline void StartForward(const MlpShape& shape, const Batch& batch, int row_begin, int rows,
                         MlpWorkspace* ws) {
  ws->acts.assign(shape.layers() + 1, {});
  ws->pre.assign(shape.layers(), {});
  ws->acts[0].assign(batch.x.begin() + static_cast<size_t>(row_begin) * batch.in,
                     batch.x.begin() + static_cast<size_t>(row_begin + rows) * batch.in);
}

// After the last ForwardLayer: the loss over the rows, and dL/dz of the last layer in ws->dz.
inline double FinishForward(const MlpShape& shape, const Batch& batch, int row_begin, int rows,
                            float scale, MlpWorkspace* ws) {
  const std::vector<float>& y = ws->acts[shape.layers()];
  ws->dz.resize(y.size());
  return MseLoss(y.data(), batch.target.data() + static_cast<size_t>(row_begin) * batch.out,
                 y.size(), scale, ws->dz.data());
}

inline double MlpGradients(const MlpShape& shape, const Batch& batch, int row_begin, int rows,
                           float scale, const std::vector<std::vector<float>>& params,
                           std::vector<std::vector<float>>* grads) {
  MlpWorkspace ws;
  StartForward(shape, batch, row_begin, rows, &ws);
  for (int l = 0; l < shape.layers(); ++l) {
    ForwardLayer(shape, l, rows, params[2 * l].data(), params[2 * l + 1].data(), &ws);
  }
  double loss = FinishForward(shape, batch, row_begin, rows, scale, &ws);
  grads->resize(shape.num_params());
  for (int l = shape.layers() - 1; l >= 0; --l) {
    (*grads)[2 * l].resize(shape.numel(2 * l));
    (*grads)[2 * l + 1].resize(shape.numel(2 * l + 1));
    BackwardLayer(shape, l, rows, params[2 * l].data(), (*grads)[2 * l].data(),
                  (*grads)[2 * l + 1].data(), &ws);
  }
  return loss;
}

}  // namespace zinf::testing
