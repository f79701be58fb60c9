// The GPT CPU kernels (train/kernels.h): every backward against central finite differences in
// double, the += semantics of the gradient outputs, forward values against naive references,
// float against double, and the bf16 widening.
#include "train/kernels.h"

#include <gtest/gtest.h>
#include <tbb/global_control.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

namespace zinf::train {
namespace {

using Vec = std::vector<double>;

// Small sizes of the double-precision checks (all different, so that a swapped dimension or
// leading dimension shows up).
constexpr int kB = 2;
constexpr int kT = 5;
constexpr int kC = 8;
constexpr int kNH = 2;
constexpr int kV = 11;
constexpr int kN = 7;
constexpr int kOC = 6;

Vec RandVec(std::mt19937_64& rng, size_t n, double lo = -1.0, double hi = 1.0) {
  std::uniform_real_distribution<double> dist(lo, hi);
  Vec v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

std::vector<int32_t> RandTokens(std::mt19937_64& rng, size_t n, int V) {
  std::uniform_int_distribution<int32_t> dist(0, V - 1);
  std::vector<int32_t> v(n);
  for (int32_t& x : v) x = dist(rng);
  return v;
}

double Dot(const Vec& a, const Vec& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

double MaxAbs(const Vec& v) {
  double m = 0.0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

double MaxAbsDiff(const Vec& a, const Vec& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0.0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

// Central finite differences: d L / d x[i] ~ (L(x + h e_i) - L(x - h e_i)) / (2h), compared
// with analytic[i]. Error budget with h = 1e-6: truncation h^2/6 |L'''| ~ 1e-12 for the smooth,
// O(1) functions here; rounding ~ 2 eps |L| / (2h) ~ 1e-10 |L|, and |L| < 50 here, so < 1e-8.
// The bound 1e-6 * max(1, |g|) keeps a > 50x margin, while a wrong or missing gradient term
// shows as an error of order 1e-2 .. 1.
void ExpectGradMatches(const std::string& what, Vec& x, const Vec& analytic,
                       const std::function<double()>& loss) {
  ASSERT_EQ(x.size(), analytic.size()) << what;
  // The check would be vacuous for an all-zero gradient.
  EXPECT_GT(MaxAbs(analytic), 1e-3) << what;
  constexpr double kH = 1e-6;
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + kH;
    const double lp = loss();
    x[i] = saved - kH;
    const double lm = loss();
    x[i] = saved;
    const double numeric = (lp - lm) / (2 * kH);
    EXPECT_LE(std::abs(numeric - analytic[i]), 1e-6 * std::max(1.0, std::abs(analytic[i])))
        << what << "[" << i << "]: analytic " << analytic[i] << ", numeric " << numeric;
  }
}

// A backward called on gradients pre-filled with `prefill` must leave prefill + fresh (fresh:
// the result on zeroed gradients). The two differ only by the rounding of the extra additions;
// all values are O(10) at most, whose double ulp is ~2e-15, so 1e-12 is ample, while an
// overwrite instead of += would be off by the O(1) prefill.
void ExpectAccumulated(const std::string& what, const Vec& prefill, const Vec& fresh,
                       const Vec& after) {
  ASSERT_EQ(prefill.size(), fresh.size()) << what;
  ASSERT_EQ(prefill.size(), after.size()) << what;
  for (size_t i = 0; i < after.size(); ++i) {
    EXPECT_NEAR(after[i], prefill[i] + fresh[i], 1e-12) << what << "[" << i << "]";
  }
}

// ---------------------------------------------------------------------------------------------
// Encoder.

TEST(EncoderTest, ForwardAddsTokenAndPositionRows) {
  std::mt19937_64 rng(1);
  const int max_t = kT + 2;
  const Vec wte = RandVec(rng, kV * kC), wpe = RandVec(rng, max_t * kC);
  const std::vector<int32_t> tokens = RandTokens(rng, kB * kT, kV);
  Vec out(kB * kT * kC, -7.0);
  EncoderForward(out.data(), tokens.data(), wte.data(), wpe.data(), kB, kT, kC);
  for (int b = 0; b < kB; ++b) {
    for (int t = 0; t < kT; ++t) {
      const int row = b * kT + t;
      for (int i = 0; i < kC; ++i) {
        EXPECT_EQ(out[row * kC + i], wte[tokens[row] * kC + i] + wpe[t * kC + i]);
      }
    }
  }
}

TEST(EncoderTest, GradCheck) {
  std::mt19937_64 rng(2);
  const int max_t = kT + 2;  // rows of wpe past kT get no gradient
  Vec wte = RandVec(rng, kV * kC), wpe = RandVec(rng, max_t * kC);
  // Repeated tokens, so that several rows add into one wte row.
  const std::vector<int32_t> tokens = {3, 3, 0, 10, 5, 3, 7, 7, 1, 2};
  ASSERT_EQ(tokens.size(), static_cast<size_t>(kB * kT));
  const Vec r = RandVec(rng, kB * kT * kC);
  Vec out(kB * kT * kC);
  auto loss = [&] {
    EncoderForward(out.data(), tokens.data(), wte.data(), wpe.data(), kB, kT, kC);
    return Dot(out, r);
  };
  Vec dwte(wte.size(), 0.0), dwpe(wpe.size(), 0.0);
  EncoderBackward(dwte.data(), dwpe.data(), r.data(), tokens.data(), kB, kT, kC);
  ExpectGradMatches("dwte", wte, dwte, loss);
  ExpectGradMatches("dwpe", wpe, dwpe, loss);
}

TEST(EncoderTest, Accumulates) {
  std::mt19937_64 rng(3);
  const std::vector<int32_t> tokens = RandTokens(rng, kB * kT, kV);
  const Vec dout = RandVec(rng, kB * kT * kC);
  Vec dwte(kV * kC, 0.0), dwpe(kT * kC, 0.0);
  EncoderBackward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), kB, kT, kC);
  const Vec pte = RandVec(rng, dwte.size()), ppe = RandVec(rng, dwpe.size());
  Vec ate = pte, ape = ppe;
  EncoderBackward(ate.data(), ape.data(), dout.data(), tokens.data(), kB, kT, kC);
  ExpectAccumulated("dwte", pte, dwte, ate);
  ExpectAccumulated("dwpe", ppe, dwpe, ape);

  // One batch row of distinct tokens: every gradient element gets a single addition per call,
  // so two calls give exactly twice one call.
  const std::vector<int32_t> distinct = {4, 0, 9, 2, 6};
  Vec once_te(kV * kC, 0.0), once_pe(kT * kC, 0.0);
  EncoderBackward(once_te.data(), once_pe.data(), dout.data(), distinct.data(), 1, kT, kC);
  Vec twice_te = once_te, twice_pe = once_pe;
  EncoderBackward(twice_te.data(), twice_pe.data(), dout.data(), distinct.data(), 1, kT, kC);
  for (size_t i = 0; i < once_te.size(); ++i) EXPECT_EQ(twice_te[i], 2 * once_te[i]);
  for (size_t i = 0; i < once_pe.size(); ++i) EXPECT_EQ(twice_pe[i], 2 * once_pe[i]);
}

// ---------------------------------------------------------------------------------------------
// LayerNorm.

TEST(LayerNormTest, ForwardMatchesReference) {
  std::mt19937_64 rng(4);
  const Vec inp = RandVec(rng, kN * kC, -2.0, 3.0);
  const Vec w = RandVec(rng, kC), b = RandVec(rng, kC);
  Vec out(kN * kC), mean(kN), rstd(kN);
  LayerNormForward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), kN, kC);
  for (int n = 0; n < kN; ++n) {
    double m = 0.0;
    for (int i = 0; i < kC; ++i) m += inp[n * kC + i];
    m /= kC;
    double var = 0.0;  // biased: divided by C
    for (int i = 0; i < kC; ++i) var += (inp[n * kC + i] - m) * (inp[n * kC + i] - m);
    var /= kC;
    const double rs = 1.0 / std::sqrt(var + 1e-5);
    EXPECT_NEAR(mean[n], m, 1e-14);
    EXPECT_NEAR(rstd[n], rs, 1e-13 * rs);
    for (int i = 0; i < kC; ++i) {
      EXPECT_NEAR(out[n * kC + i], (inp[n * kC + i] - m) * rs * w[i] + b[i], 1e-13);
    }
  }

  // With w = 1 and b = 0 each row comes out with mean 0 and variance var / (var + eps).
  const Vec ones(kC, 1.0), zeros(kC, 0.0);
  LayerNormForward(out.data(), mean.data(), rstd.data(), inp.data(), ones.data(), zeros.data(), kN,
                   kC);
  for (int n = 0; n < kN; ++n) {
    double m = 0.0, sq = 0.0;
    for (int i = 0; i < kC; ++i) m += out[n * kC + i];
    for (int i = 0; i < kC; ++i) sq += out[n * kC + i] * out[n * kC + i];
    EXPECT_NEAR(m / kC, 0.0, 1e-14);
    const double var = 1.0 / (rstd[n] * rstd[n]) - 1e-5;
    EXPECT_NEAR(sq / kC, var / (var + 1e-5), 1e-13);
  }
}

TEST(LayerNormTest, GradCheck) {
  std::mt19937_64 rng(5);
  Vec inp = RandVec(rng, kN * kC, -2.0, 2.0);
  Vec w = RandVec(rng, kC, 0.5, 1.5), b = RandVec(rng, kC);
  const Vec r = RandVec(rng, kN * kC);
  Vec out(kN * kC), mean(kN), rstd(kN);
  auto loss = [&] {
    LayerNormForward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), kN, kC);
    return Dot(out, r);
  };
  loss();  // mean and rstd at the unperturbed point
  Vec dinp(inp.size(), 0.0), dw(kC, 0.0), db(kC, 0.0);
  LayerNormBackward(dinp.data(), dw.data(), db.data(), r.data(), inp.data(), w.data(), mean.data(),
                    rstd.data(), kN, kC);
  ExpectGradMatches("dinp", inp, dinp, loss);
  ExpectGradMatches("dw", w, dw, loss);
  ExpectGradMatches("db", b, db, loss);
}

TEST(LayerNormTest, Accumulates) {
  std::mt19937_64 rng(6);
  const Vec inp = RandVec(rng, kN * kC), w = RandVec(rng, kC), b = RandVec(rng, kC);
  const Vec dout = RandVec(rng, kN * kC);
  Vec out(kN * kC), mean(kN), rstd(kN);
  LayerNormForward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), kN, kC);
  Vec dinp(inp.size(), 0.0), dw(kC, 0.0), db(kC, 0.0);
  LayerNormBackward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(),
                    mean.data(), rstd.data(), kN, kC);
  const Vec pinp = RandVec(rng, dinp.size()), pw = RandVec(rng, kC), pb = RandVec(rng, kC);
  Vec ainp = pinp, aw = pw, ab = pb;
  LayerNormBackward(ainp.data(), aw.data(), ab.data(), dout.data(), inp.data(), w.data(),
                    mean.data(), rstd.data(), kN, kC);
  ExpectAccumulated("dinp", pinp, dinp, ainp);
  ExpectAccumulated("dw", pw, dw, aw);
  ExpectAccumulated("db", pb, db, ab);

  // dinp gets one addition per element and call: a second call gives exactly twice.
  Vec twice = dinp, scratch_w(kC, 0.0), scratch_b(kC, 0.0);
  LayerNormBackward(twice.data(), scratch_w.data(), scratch_b.data(), dout.data(), inp.data(),
                    w.data(), mean.data(), rstd.data(), kN, kC);
  for (size_t i = 0; i < dinp.size(); ++i) EXPECT_EQ(twice[i], 2 * dinp[i]);
}

// ---------------------------------------------------------------------------------------------
// Matmul.

// out[n, j] = sum_i inp[n, i] w[j, i] + bias[j], by a triple loop.
Vec NaiveMatmul(const Vec& inp, const Vec& w, const Vec* bias, int N, int C, int OC) {
  Vec out(static_cast<size_t>(N) * OC);
  for (int n = 0; n < N; ++n) {
    for (int j = 0; j < OC; ++j) {
      double s = bias != nullptr ? (*bias)[j] : 0.0;
      for (int i = 0; i < C; ++i) s += inp[n * C + i] * w[j * C + i];
      out[n * OC + j] = s;
    }
  }
  return out;
}

TEST(MatmulTest, ForwardMatchesTripleLoop) {
  std::mt19937_64 rng(7);
  // The small shape and one large enough for OpenBLAS to block and pack.
  for (const auto& [n, c, oc] : {std::tuple{kN, kC, kOC}, std::tuple{37, 300, 29}}) {
    const Vec inp = RandVec(rng, n * c), w = RandVec(rng, oc * c), bias = RandVec(rng, oc);
    // Values O(1), sums of <= 300 products: the rounding difference is ~ 300 eps ~ 1e-13.
    Vec out(n * oc, 99.0);
    MatmulForward(out.data(), inp.data(), w.data(), bias.data(), n, c, oc);
    EXPECT_LE(MaxAbsDiff(out, NaiveMatmul(inp, w, &bias, n, c, oc)), 1e-12) << n << "x" << c;
    std::fill(out.begin(), out.end(), 99.0);
    MatmulForward(out.data(), inp.data(), w.data(), static_cast<const double*>(nullptr), n, c, oc);
    EXPECT_LE(MaxAbsDiff(out, NaiveMatmul(inp, w, nullptr, n, c, oc)), 1e-12) << n << "x" << c;
  }
}

TEST(MatmulTest, GradCheck) {
  std::mt19937_64 rng(8);
  Vec inp = RandVec(rng, kN * kC), w = RandVec(rng, kOC * kC), bias = RandVec(rng, kOC);
  const Vec r = RandVec(rng, kN * kOC);
  Vec out(kN * kOC);
  auto loss = [&] {
    MatmulForward(out.data(), inp.data(), w.data(), bias.data(), kN, kC, kOC);
    return Dot(out, r);
  };
  Vec dinp(inp.size(), 0.0), dw(w.size(), 0.0), dbias(kOC, 0.0);
  MatmulBackward(dinp.data(), dw.data(), dbias.data(), r.data(), inp.data(), w.data(), kN, kC, kOC);
  ExpectGradMatches("dinp", inp, dinp, loss);
  ExpectGradMatches("dw", w, dw, loss);
  ExpectGradMatches("dbias", bias, dbias, loss);
}

TEST(MatmulTest, BackwardMatchesLoopsOnLargeShape) {
  std::mt19937_64 rng(9);
  const int n = 41, c = 290, oc = 33;
  const Vec inp = RandVec(rng, n * c), w = RandVec(rng, oc * c), dout = RandVec(rng, n * oc);
  Vec dinp(n * c, 0.0), dw(oc * c, 0.0), dbias(oc, 0.0);
  MatmulBackward(dinp.data(), dw.data(), dbias.data(), dout.data(), inp.data(), w.data(), n, c, oc);
  Vec rinp(n * c, 0.0), rw(oc * c, 0.0), rbias(oc, 0.0);
  for (int r = 0; r < n; ++r) {
    for (int j = 0; j < oc; ++j) {
      const double d = dout[r * oc + j];
      rbias[j] += d;
      for (int i = 0; i < c; ++i) {
        rinp[r * c + i] += d * w[j * c + i];
        rw[j * c + i] += d * inp[r * c + i];
      }
    }
  }
  EXPECT_LE(MaxAbsDiff(dinp, rinp), 1e-12);
  EXPECT_LE(MaxAbsDiff(dw, rw), 1e-12);
  EXPECT_LE(MaxAbsDiff(dbias, rbias), 1e-12);
}

TEST(MatmulTest, OptionalGradientsMayBeNull) {
  std::mt19937_64 rng(10);
  const Vec inp = RandVec(rng, kN * kC), w = RandVec(rng, kOC * kC), dout = RandVec(rng, kN * kOC);
  Vec dinp(inp.size(), 0.0), dw(w.size(), 0.0), dbias(kOC, 0.0);
  MatmulBackward(dinp.data(), dw.data(), dbias.data(), dout.data(), inp.data(), w.data(), kN, kC,
                 kOC);
  Vec dw_only(w.size(), 0.0);
  MatmulBackward(static_cast<double*>(nullptr), dw_only.data(), static_cast<double*>(nullptr),
                 dout.data(), inp.data(), w.data(), kN, kC, kOC);
  for (size_t i = 0; i < dw.size(); ++i) EXPECT_EQ(dw_only[i], dw[i]);
}

TEST(MatmulTest, Accumulates) {
  std::mt19937_64 rng(11);
  const Vec inp = RandVec(rng, kN * kC), w = RandVec(rng, kOC * kC), dout = RandVec(rng, kN * kOC);
  Vec dinp(inp.size(), 0.0), dw(w.size(), 0.0), dbias(kOC, 0.0);
  MatmulBackward(dinp.data(), dw.data(), dbias.data(), dout.data(), inp.data(), w.data(), kN, kC,
                 kOC);
  const Vec pinp = RandVec(rng, dinp.size()), pw = RandVec(rng, dw.size()),
            pbias = RandVec(rng, kOC);
  Vec ainp = pinp, aw = pw, abias = pbias;
  MatmulBackward(ainp.data(), aw.data(), abias.data(), dout.data(), inp.data(), w.data(), kN, kC,
                 kOC);
  ExpectAccumulated("dinp", pinp, dinp, ainp);
  ExpectAccumulated("dw", pw, dw, aw);
  ExpectAccumulated("dbias", pbias, dbias, abias);
}

// ---------------------------------------------------------------------------------------------
// Attention.

// Straight from the definition, one query at a time: probabilities over keys 0..t of
// exp(q.k_j / sqrt(hs)) (normalised), out = sum_j p_j v_j.
void NaiveAttention(Vec& out, Vec& att, const Vec& qkv, int B, int Tn, int C, int NH) {
  const int hs = C / NH;
  out.assign(static_cast<size_t>(B) * Tn * C, 0.0);
  att.assign(static_cast<size_t>(B) * NH * Tn * Tn, 0.0);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < NH; ++h) {
      for (int t = 0; t < Tn; ++t) {
        const double* q = &qkv[(b * Tn + t) * 3 * C + h * hs];
        double* p = &att[((b * NH + h) * Tn + t) * Tn];
        double sum = 0.0;
        for (int j = 0; j <= t; ++j) {
          const double* k = &qkv[(b * Tn + j) * 3 * C + C + h * hs];
          double s = 0.0;
          for (int i = 0; i < hs; ++i) s += q[i] * k[i];
          p[j] = std::exp(s / std::sqrt(static_cast<double>(hs)));
          sum += p[j];
        }
        for (int j = 0; j <= t; ++j) p[j] /= sum;
        for (int j = 0; j <= t; ++j) {
          const double* v = &qkv[(b * Tn + j) * 3 * C + 2 * C + h * hs];
          for (int i = 0; i < hs; ++i) out[(b * Tn + t) * C + h * hs + i] += p[j] * v[i];
        }
      }
    }
  }
}

TEST(AttentionTest, ForwardMatchesReference) {
  std::mt19937_64 rng(12);
  const Vec qkv = RandVec(rng, kB * kT * 3 * kC, -2.0, 2.0);
  Vec out(kB * kT * kC, 5.0), att(kB * kNH * kT * kT, 5.0);
  AttentionForward(out.data(), att.data(), qkv.data(), kB, kT, kC, kNH);
  Vec rout, ratt;
  NaiveAttention(rout, ratt, qkv, kB, kT, kC, kNH);
  EXPECT_LE(MaxAbsDiff(out, rout), 1e-13);
  EXPECT_LE(MaxAbsDiff(att, ratt), 1e-13);
  // The first query sees only the first key: its output is exactly that v.
  const int hs = kC / kNH;
  for (int b = 0; b < kB; ++b) {
    for (int h = 0; h < kNH; ++h) {
      EXPECT_EQ(att[(b * kNH + h) * kT * kT], 1.0);
      for (int i = 0; i < hs; ++i) {
        EXPECT_EQ(out[b * kT * kC + h * hs + i], qkv[b * kT * 3 * kC + 2 * kC + h * hs + i]);
      }
    }
  }
}

TEST(AttentionTest, ProbabilitiesAreCausalAndNormalised) {
  std::mt19937_64 rng(13);
  // Large scores as well: the softmax must stay finite (max subtracted).
  const Vec qkv = RandVec(rng, kB * kT * 3 * kC, -30.0, 30.0);
  Vec out(kB * kT * kC), att(kB * kNH * kT * kT, 5.0);
  AttentionForward(out.data(), att.data(), qkv.data(), kB, kT, kC, kNH);
  for (int bh = 0; bh < kB * kNH; ++bh) {
    for (int t = 0; t < kT; ++t) {
      const double* row = &att[(bh * kT + t) * kT];
      double sum = 0.0;
      for (int j = 0; j <= t; ++j) {
        EXPECT_TRUE(std::isfinite(row[j]));
        EXPECT_GE(row[j], 0.0);
        sum += row[j];
      }
      EXPECT_NEAR(sum, 1.0, 1e-14);
      for (int j = t + 1; j < kT; ++j) EXPECT_EQ(row[j], 0.0) << "above the diagonal";
    }
  }
  for (double x : out) EXPECT_TRUE(std::isfinite(x));
}

TEST(AttentionTest, GradCheck) {
  std::mt19937_64 rng(14);
  Vec qkv = RandVec(rng, kB * kT * 3 * kC, -1.5, 1.5);
  const Vec r = RandVec(rng, kB * kT * kC);
  Vec out(kB * kT * kC), att(kB * kNH * kT * kT);
  auto loss = [&] {
    AttentionForward(out.data(), att.data(), qkv.data(), kB, kT, kC, kNH);
    return Dot(out, r);
  };
  loss();  // att at the unperturbed point
  Vec dqkv(qkv.size(), 0.0);
  AttentionBackward(dqkv.data(), r.data(), qkv.data(), att.data(), kB, kT, kC, kNH);
  ExpectGradMatches("dqkv", qkv, dqkv, loss);
}

TEST(AttentionTest, Accumulates) {
  std::mt19937_64 rng(15);
  const Vec qkv = RandVec(rng, kB * kT * 3 * kC), dout = RandVec(rng, kB * kT * kC);
  Vec out(kB * kT * kC), att(kB * kNH * kT * kT);
  AttentionForward(out.data(), att.data(), qkv.data(), kB, kT, kC, kNH);
  Vec dqkv(qkv.size(), 0.0);
  AttentionBackward(dqkv.data(), dout.data(), qkv.data(), att.data(), kB, kT, kC, kNH);
  const Vec pre = RandVec(rng, qkv.size());
  Vec after = pre;
  AttentionBackward(after.data(), dout.data(), qkv.data(), att.data(), kB, kT, kC, kNH);
  ExpectAccumulated("dqkv", pre, dqkv, after);
}

// ---------------------------------------------------------------------------------------------
// GELU and residual.

TEST(GeluTest, KnownValues) {
  const Vec x = {0.0, 1.0, -1.0, 2.0, 10.0, -10.0};
  Vec y(x.size());
  GeluForward(y.data(), x.data(), x.size());
  EXPECT_EQ(y[0], 0.0);
  // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), evaluated independently in high precision.
  EXPECT_NEAR(y[1], 0.8411919906082768, 1e-15);
  EXPECT_NEAR(y[2], -0.15880800939172324, 1e-15);  // gelu(-x) = gelu(x) - x
  EXPECT_NEAR(y[3], 1.954597694087775, 1e-15);
  EXPECT_NEAR(y[4], 10.0, 1e-15);
  EXPECT_NEAR(y[5], 0.0, 1e-15);

  // The tanh form stays within 1e-3 of the exact x Phi(x) (a wrong constant would not).
  Vec xs, ys;
  for (int i = -50; i <= 50; ++i) xs.push_back(i / 10.0);
  ys.resize(xs.size());
  GeluForward(ys.data(), xs.data(), xs.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    const double exact = 0.5 * xs[i] * (1.0 + std::erf(xs[i] / std::sqrt(2.0)));
    EXPECT_NEAR(ys[i], exact, 1e-3) << xs[i];
  }
}

TEST(GeluTest, GradCheck) {
  std::mt19937_64 rng(16);
  Vec inp = RandVec(rng, 37, -4.0, 4.0);
  const Vec r = RandVec(rng, inp.size());
  Vec out(inp.size());
  auto loss = [&] {
    GeluForward(out.data(), inp.data(), inp.size());
    return Dot(out, r);
  };
  Vec dinp(inp.size(), 0.0);
  GeluBackward(dinp.data(), inp.data(), r.data(), inp.size());
  ExpectGradMatches("dinp", inp, dinp, loss);
}

TEST(GeluTest, Accumulates) {
  std::mt19937_64 rng(17);
  const Vec inp = RandVec(rng, 37, -4.0, 4.0), dout = RandVec(rng, inp.size());
  Vec once(inp.size(), 0.0);
  GeluBackward(once.data(), inp.data(), dout.data(), inp.size());
  Vec twice = once;
  GeluBackward(twice.data(), inp.data(), dout.data(), inp.size());
  for (size_t i = 0; i < once.size(); ++i) EXPECT_EQ(twice[i], 2 * once[i]);
  const Vec pre = RandVec(rng, inp.size());
  Vec after = pre;
  GeluBackward(after.data(), inp.data(), dout.data(), inp.size());
  ExpectAccumulated("dinp", pre, once, after);
}

TEST(ResidualTest, Adds) {
  std::mt19937_64 rng(18);
  const Vec a = RandVec(rng, 29), b = RandVec(rng, 29);
  Vec out(a.size());
  ResidualForward(out.data(), a.data(), b.data(), a.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(out[i], a[i] + b[i]);
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy.

TEST(CrossEntropyTest, UniformLogitsGiveLogV) {
  const Vec logits(kN * kV, 0.3);
  const std::vector<int32_t> targets = {0, 10, 5, 5, 1, 2, 9};
  Vec dlogits(logits.size());
  const double dloss = 1.7;
  const double loss =
      CrossEntropyForwardBackward(dlogits.data(), logits.data(), targets.data(), kN, kV, dloss);
  EXPECT_NEAR(loss, std::log(static_cast<double>(kV)), 1e-14);
  for (int n = 0; n < kN; ++n) {
    for (int j = 0; j < kV; ++j) {
      const double expect = (1.0 / kV - (j == targets[n] ? 1.0 : 0.0)) * dloss / kN;
      EXPECT_NEAR(dlogits[n * kV + j], expect, 1e-15);
    }
  }
}

TEST(CrossEntropyTest, MatchesReferenceAndIsStable) {
  std::mt19937_64 rng(19);
  const Vec logits = RandVec(rng, kN * kV, -3.0, 3.0);
  const std::vector<int32_t> targets = RandTokens(rng, kN, kV);
  double expect = 0.0;
  for (int n = 0; n < kN; ++n) {
    double z = 0.0;
    for (int j = 0; j < kV; ++j) z += std::exp(logits[n * kV + j]);
    expect += std::log(z) - logits[n * kV + targets[n]];
  }
  expect /= kN;
  Vec dlogits(logits.size(), 123.0);  // overwritten, not accumulated
  const double loss =
      CrossEntropyForwardBackward(dlogits.data(), logits.data(), targets.data(), kN, kV, 1.0);
  EXPECT_NEAR(loss, expect, 1e-13);
  // Each row of softmax - onehot sums to 0.
  for (int n = 0; n < kN; ++n) {
    double s = 0.0;
    for (int j = 0; j < kV; ++j) s += dlogits[n * kV + j];
    EXPECT_NEAR(s, 0.0, 1e-15);
  }
  // The loss is the same without dlogits, and dlogits did not depend on its old contents.
  EXPECT_EQ(CrossEntropyForwardBackward(static_cast<double*>(nullptr), logits.data(),
                                        targets.data(), kN, kV, 1.0),
            loss);
  Vec fresh(logits.size(), 0.0);
  CrossEntropyForwardBackward(fresh.data(), logits.data(), targets.data(), kN, kV, 1.0);
  for (size_t i = 0; i < fresh.size(); ++i) EXPECT_EQ(dlogits[i], fresh[i]);

  // Logits far beyond exp's range: one row [1000, 0, ..., 0] with target 0 (loss
  // log(1 + (V-1) e^-1000) = 0 in double) and the same row with target 1 (loss 1000).
  Vec big(2 * kV, 0.0);
  big[0] = 1000.0;
  big[kV] = 1000.0;
  const std::vector<int32_t> big_targets = {0, 1};
  Vec dbig(big.size());
  const double big_loss =
      CrossEntropyForwardBackward(dbig.data(), big.data(), big_targets.data(), 2, kV, 1.0);
  EXPECT_NEAR(big_loss, 500.0, 1e-12);
  for (double d : dbig) EXPECT_TRUE(std::isfinite(d));
  EXPECT_NEAR(dbig[0], 0.0, 1e-15);   // softmax 1, target: (1 - 1) / 2
  EXPECT_NEAR(dbig[kV], 0.5, 1e-15);  // softmax 1, not the target: 1 / 2
  EXPECT_NEAR(dbig[kV + 1], -0.5, 1e-15);
}

TEST(CrossEntropyTest, GradCheck) {
  std::mt19937_64 rng(20);
  Vec logits = RandVec(rng, kN * kV, -2.0, 2.0);
  const std::vector<int32_t> targets = RandTokens(rng, kN, kV);
  const double dloss = 1.7;
  auto loss = [&] {
    return dloss * CrossEntropyForwardBackward(static_cast<double*>(nullptr), logits.data(),
                                               targets.data(), kN, kV, dloss);
  };
  Vec dlogits(logits.size());
  CrossEntropyForwardBackward(dlogits.data(), logits.data(), targets.data(), kN, kV, dloss);
  // The gradients here are ~ 1/N; the check's absolute bound of 1e-6 is still ~1e-4 of them.
  ExpectGradMatches("dlogits", logits, dlogits, loss);
}

// ---------------------------------------------------------------------------------------------
// float against double: every kernel forward and backward on the same (float-representable)
// inputs. Sizes are training-like in shape: reductions of length C = 64, T = 16, OC = 48 and
// V = 50, on O(1) values. A float reduction of length K errs by at most ~K * 6e-8 (~4e-6 for
// K = 64) relative to the magnitudes summed, and in practice by ~sqrt(K) * 6e-8 (the observed
// worst case over all outputs is 3e-7). So 1e-5 relative to the largest magnitude of each output
// is above the worst-case bound, while a formula bug on the float path (a wrong cast, a
// float-only branch, an overflow) shows as O(1e-2 .. 1) differences.

constexpr int kFB = 2, kFT = 16, kFC = 64, kFNH = 4, kFV = 50, kFOC = 48;
constexpr int kFN = kFB * kFT;

struct FloatVsDoubleInputs {
  std::vector<int32_t> tokens, targets;
  Vec wte, wpe, x, ln_w, ln_b, mm_w, mm_bias, qkv, gelu_in, logits, dout_c, dout_oc;
};

Vec RoundToFloat(Vec v) {
  for (double& x : v) x = static_cast<float>(x);
  return v;
}

FloatVsDoubleInputs MakeFloatVsDoubleInputs() {
  std::mt19937_64 rng(21);
  FloatVsDoubleInputs in;
  in.tokens = RandTokens(rng, kFN, kFV);
  in.targets = RandTokens(rng, kFN, kFV);
  in.wte = RoundToFloat(RandVec(rng, kFV * kFC));
  in.wpe = RoundToFloat(RandVec(rng, kFT * kFC));
  in.x = RoundToFloat(RandVec(rng, kFN * kFC, -2.0, 2.0));
  in.ln_w = RoundToFloat(RandVec(rng, kFC, 0.5, 1.5));
  in.ln_b = RoundToFloat(RandVec(rng, kFC));
  in.mm_w = RoundToFloat(RandVec(rng, kFOC * kFC, -0.2, 0.2));
  in.mm_bias = RoundToFloat(RandVec(rng, kFOC));
  in.qkv = RoundToFloat(RandVec(rng, kFN * 3 * kFC, -1.0, 1.0));
  in.gelu_in = RoundToFloat(RandVec(rng, kFN * kFC, -4.0, 4.0));
  in.logits = RoundToFloat(RandVec(rng, kFN * kFV, -4.0, 4.0));
  in.dout_c = RoundToFloat(RandVec(rng, kFN * kFC));
  in.dout_oc = RoundToFloat(RandVec(rng, kFN * kFOC));
  return in;
}

template <typename T>
std::vector<T> Cast(const Vec& v) {
  return std::vector<T>(v.begin(), v.end());
}
template <typename T>
Vec ToDouble(const std::vector<T>& v) {
  return Vec(v.begin(), v.end());
}

// Runs every kernel in precision T; returns each output and gradient, widened to double.
template <typename T>
std::map<std::string, Vec> RunAllKernels(const FloatVsDoubleInputs& in) {
  std::map<std::string, Vec> res;
  const std::vector<T> wte = Cast<T>(in.wte), wpe = Cast<T>(in.wpe), x = Cast<T>(in.x),
                       ln_w = Cast<T>(in.ln_w), ln_b = Cast<T>(in.ln_b), mm_w = Cast<T>(in.mm_w),
                       mm_bias = Cast<T>(in.mm_bias), qkv = Cast<T>(in.qkv),
                       gelu_in = Cast<T>(in.gelu_in), logits = Cast<T>(in.logits),
                       dout_c = Cast<T>(in.dout_c), dout_oc = Cast<T>(in.dout_oc);

  std::vector<T> enc(kFN * kFC), dwte(wte.size(), T(0)), dwpe(wpe.size(), T(0));
  EncoderForward(enc.data(), in.tokens.data(), wte.data(), wpe.data(), kFB, kFT, kFC);
  EncoderBackward(dwte.data(), dwpe.data(), dout_c.data(), in.tokens.data(), kFB, kFT, kFC);
  res["encoder.out"] = ToDouble(enc);
  res["encoder.dwte"] = ToDouble(dwte);
  res["encoder.dwpe"] = ToDouble(dwpe);

  std::vector<T> ln(kFN * kFC), mean(kFN), rstd(kFN), dx(x.size(), T(0)), dlw(kFC, T(0)),
      dlb(kFC, T(0));
  LayerNormForward(ln.data(), mean.data(), rstd.data(), x.data(), ln_w.data(), ln_b.data(), kFN,
                   kFC);
  LayerNormBackward(dx.data(), dlw.data(), dlb.data(), dout_c.data(), x.data(), ln_w.data(),
                    mean.data(), rstd.data(), kFN, kFC);
  res["layernorm.out"] = ToDouble(ln);
  res["layernorm.mean"] = ToDouble(mean);
  res["layernorm.rstd"] = ToDouble(rstd);
  res["layernorm.dinp"] = ToDouble(dx);
  res["layernorm.dw"] = ToDouble(dlw);
  res["layernorm.db"] = ToDouble(dlb);

  std::vector<T> mm(kFN * kFOC), dmx(x.size(), T(0)), dmw(mm_w.size(), T(0)), dmb(kFOC, T(0));
  MatmulForward(mm.data(), x.data(), mm_w.data(), mm_bias.data(), kFN, kFC, kFOC);
  MatmulBackward(dmx.data(), dmw.data(), dmb.data(), dout_oc.data(), x.data(), mm_w.data(), kFN,
                 kFC, kFOC);
  res["matmul.out"] = ToDouble(mm);
  res["matmul.dinp"] = ToDouble(dmx);
  res["matmul.dw"] = ToDouble(dmw);
  res["matmul.dbias"] = ToDouble(dmb);

  std::vector<T> att_out(kFN * kFC), att(kFB * kFNH * kFT * kFT), dqkv(qkv.size(), T(0));
  AttentionForward(att_out.data(), att.data(), qkv.data(), kFB, kFT, kFC, kFNH);
  AttentionBackward(dqkv.data(), dout_c.data(), qkv.data(), att.data(), kFB, kFT, kFC, kFNH);
  res["attention.out"] = ToDouble(att_out);
  res["attention.att"] = ToDouble(att);
  res["attention.dqkv"] = ToDouble(dqkv);

  std::vector<T> g(gelu_in.size()), dg(gelu_in.size(), T(0));
  GeluForward(g.data(), gelu_in.data(), g.size());
  GeluBackward(dg.data(), gelu_in.data(), dout_c.data(), g.size());
  res["gelu.out"] = ToDouble(g);
  res["gelu.dinp"] = ToDouble(dg);

  std::vector<T> resid(x.size());
  ResidualForward(resid.data(), x.data(), dout_c.data(), x.size());
  res["residual.out"] = ToDouble(resid);

  std::vector<T> dlogits(logits.size());
  const double loss =
      CrossEntropyForwardBackward(dlogits.data(), logits.data(), in.targets.data(), kFN, kFV, 1.0);
  res["crossentropy.loss"] = Vec{loss};
  // dlogits are ~ 1/N: compare them at the scale of one row's gradient.
  res["crossentropy.dlogits_times_n"] = ToDouble(dlogits);
  for (double& d : res["crossentropy.dlogits_times_n"]) d *= kFN;
  return res;
}

TEST(FloatVsDoubleTest, EveryKernelAgrees) {
  const FloatVsDoubleInputs in = MakeFloatVsDoubleInputs();
  const std::map<std::string, Vec> f = RunAllKernels<float>(in);
  const std::map<std::string, Vec> d = RunAllKernels<double>(in);
  ASSERT_EQ(f.size(), d.size());
  for (const auto& [name, dv] : d) {
    const Vec& fv = f.at(name);
    ASSERT_EQ(fv.size(), dv.size()) << name;
    const double scale = std::max(1.0, MaxAbs(dv));
    EXPECT_LE(MaxAbsDiff(fv, dv), 1e-5 * scale) << name;
    EXPECT_GT(MaxAbs(dv), 0.0) << name;
  }
}

// ---------------------------------------------------------------------------------------------
// bf16 -> fp32.

float FloatFromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

TEST(Bf16Test, KnownPatterns) {
  const std::vector<uint16_t> in = {0x3F80, 0xC000, 0x7F80, 0xFF80, 0x7FC0,
                                    0x0001, 0x8000, 0x4049, 0x0000};
  std::vector<float> out(in.size(), -1.0f);
  Bf16ToFp32(out.data(), in.data(), in.size());
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -2.0f);
  EXPECT_EQ(out[2], std::numeric_limits<float>::infinity());
  EXPECT_EQ(out[3], -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(out[4]));
  // Smallest bf16 denormal: mantissa bit 16 of the float, i.e. 2^16 * 2^-149 = 2^-133.
  EXPECT_EQ(out[5], std::ldexp(1.0f, -133));
  EXPECT_EQ(std::fpclassify(out[5]), FP_SUBNORMAL);
  EXPECT_EQ(out[6], 0.0f);
  EXPECT_TRUE(std::signbit(out[6]));
  EXPECT_EQ(out[7], 3.140625f);
  EXPECT_EQ(out[8], 0.0f);
  EXPECT_FALSE(std::signbit(out[8]));
}

TEST(Bf16Test, EveryPatternWidensExactly) {
  std::vector<uint16_t> in(65536);
  for (uint32_t i = 0; i < in.size(); ++i) in[i] = static_cast<uint16_t>(i);
  std::vector<float> out(in.size());
  Bf16ToFp32(out.data(), in.data(), in.size());
  for (uint32_t i = 0; i < in.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &out[i], sizeof(bits));
    ASSERT_EQ(bits, i << 16) << "pattern " << i;  // NaN payloads and signs kept too
  }
  EXPECT_EQ(out[0x3F80], FloatFromBits(0x3F800000u));
}

}  // namespace
}  // namespace zinf::train

namespace zinf::train {
namespace {

// bf16-weight Linear layers against the double reference on the widened weight. Shapes cover
// the register blocks (8 rows), the 16-lane vectors and their tails.
TEST(MatmulBf16, MatchesDoubleReferenceOnTheWidenedWeight) {
  std::mt19937_64 rng(17);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto [N, C, OC] : {std::tuple{1, 16, 3}, std::tuple{7, 37, 65}, std::tuple{16, 256, 130},
                          std::tuple{21, 300, 67}}) {
    SCOPED_TRACE(::testing::Message() << "N " << N << " C " << C << " OC " << OC);
    std::vector<uint16_t> w(static_cast<size_t>(OC) * C);
    for (uint16_t& h : w) {
      float f = u(rng);
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      h = static_cast<uint16_t>(bits >> 16);
    }
    std::vector<float> wf(w.size());
    Bf16ToFp32(wf.data(), w.data(), w.size());
    std::vector<float> x(static_cast<size_t>(N) * C), b(OC), dy(static_cast<size_t>(N) * OC);
    for (float& v : x) v = u(rng);
    for (float& v : b) v = u(rng);
    for (float& v : dy) v = u(rng);
    std::vector<double> xd(x.begin(), x.end()), wd(wf.begin(), wf.end()), bd(b.begin(), b.end()),
        dyd(dy.begin(), dy.end());
    std::vector<double> yd(static_cast<size_t>(N) * OC), dxd(x.size(), 0.0), dwd(w.size(), 0.0),
        dbd(OC, 0.0);
    MatmulForward(yd.data(), xd.data(), wd.data(), bd.data(), N, C, OC);
    MatmulBackward(dxd.data(), dwd.data(), dbd.data(), dyd.data(), xd.data(), wd.data(), N, C, OC);

    std::vector<float> y(yd.size()), dx(x.size(), 0.5f), dw(w.size(), 7.0f), db(OC, 0.25f);
    MatmulForwardBf16(y.data(), x.data(), w.data(), b.data(), N, C, OC);
    MatmulBackwardBf16(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), N, C, OC,
                       /*accumulate_dw=*/false);
    // fp32 sums of C (or N) products of values in [-1, 1]: the error is bounded by
    // ~C * 2^-24 * sum|terms|; 1e-5 * (C + 1) relative to the sum of magnitudes covers it.
    auto check = [](const std::vector<float>& got, const std::vector<double>& want, double offset,
                    double tol, const char* what) {
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_NEAR(got[i] - offset, want[i], tol) << what << "[" << i << "]";
      }
    };
    check(y, yd, 0.0, 1e-5 * (C + 1), "out");
    check(dx, dxd, 0.5, 1e-5 * (OC + 1), "dinp (accumulated onto 0.5)");
    check(dw, dwd, 0.0, 1e-5 * (N + 1), "dw (overwritten)");
    check(db, dbd, 0.25, 1e-5 * (N + 1), "dbias (accumulated onto 0.25)");
    // Accumulating dw adds the same values again, bit for bit.
    std::vector<float> dw2 = dw;
    MatmulBackwardBf16(nullptr, dw2.data(), nullptr, dy.data(), x.data(), w.data(), N, C, OC,
                       /*accumulate_dw=*/true);
    for (size_t i = 0; i < dw.size(); ++i) {
      ASSERT_NEAR(dw2[i], 2.0 * dwd[i], 2e-5 * (N + 1)) << "dw accumulated [" << i << "]";
    }
  }
}

TEST(MatmulBf16, SameBitsForAnyThreadCount) {
  const int N = 16, C = 512, OC = 300;
  std::mt19937_64 rng(3);
  std::uniform_int_distribution<int> bits(0x3C00, 0x3F7F);  // bf16 values in [0.0078, 1)
  std::vector<uint16_t> w(static_cast<size_t>(OC) * C);
  for (uint16_t& h : w) h = static_cast<uint16_t>(bits(rng));
  std::vector<float> x(static_cast<size_t>(N) * C), dy(static_cast<size_t>(N) * OC);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& v : x) v = u(rng);
  for (float& v : dy) v = u(rng);
  auto run = [&](int threads, std::vector<float>* y, std::vector<float>* dx,
                 std::vector<float>* dw) {
    tbb::global_control limit(tbb::global_control::max_allowed_parallelism, threads);
    y->assign(static_cast<size_t>(N) * OC, 0.0f);
    dx->assign(x.size(), 0.0f);
    dw->assign(w.size(), 0.0f);
    MatmulForwardBf16(y->data(), x.data(), w.data(), nullptr, N, C, OC);
    MatmulBackwardBf16(dx->data(), dw->data(), nullptr, dy.data(), x.data(), w.data(), N, C, OC,
                       false);
  };
  std::vector<float> y1, dx1, dw1, y2, dx2, dw2;
  run(1, &y1, &dx1, &dw1);
  run(4, &y2, &dx2, &dw2);
  EXPECT_EQ(std::memcmp(y1.data(), y2.data(), y1.size() * 4), 0);
  EXPECT_EQ(std::memcmp(dx1.data(), dx2.data(), dx1.size() * 4), 0);
  EXPECT_EQ(std::memcmp(dw1.data(), dw2.data(), dw1.size() * 4), 0);
}

}  // namespace
}  // namespace zinf::train
