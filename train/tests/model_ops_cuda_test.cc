// The GPT's math on the GPU (CudaModelOps) against the CPU kernels, op by op, and the trainer
// on a CUDA device against the trainer on the host device. Label gpu: every test skips with
// the reason when no CUDA device is visible.
//
// Tolerances. The GPU sums in another order than OpenBLAS and the CPU loops (cuBLAS tiles,
// per-thread strided partial sums, and the compiler may contract a*b+c into one FMA), so
// each fp32 result differs by a few ulps per term it sums: with K terms of magnitude <= 1
// (inputs uniform in [-1, 1]) the difference is bounded by ~K * 2^-24 * max|term| in the
// worst case and ~sqrt(K) * 2^-24 typically. K <= 256 here, so an absolute 1e-4 plus a
// relative 1e-4 is a bound with an order of magnitude to spare, and 1000x tighter than any
// real bug (a wrong index, a missed term, a wrong scale is off by O(0.1)). The bf16 GEMMs
// are compared with the CPU product of the same bf16-rounded operands, which leaves only
// the summation order. The trainer's losses: 5 steps of Adam amplify those differences, so
// they are compared at 1e-3 relative (a model that learnt anything else differs by > 0.1).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "tests/test_util.h"
#include "train/kernels.h"
#include "train/model_ops.h"
#include "train/tests/tiny_model.h"
#include "train/text_data.h"
#include "train/trainer.h"
#include "zinf/comm.h"
#include "zinf/cuda.h"
#include "zinf/device.h"

namespace zinf::train {
namespace {

using zinf::testing::TempDir;

constexpr double kAtol = 1e-4, kRtol = 1e-4;

std::vector<float> Random(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

uint16_t ToBf16(float f) {  // round to nearest even (finite inputs)
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
float FromBf16(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

::testing::AssertionResult Close(const std::vector<float>& gpu, const std::vector<float>& cpu,
                                 const char* what, double atol = kAtol, double rtol = kRtol) {
  if (gpu.size() != cpu.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  for (size_t i = 0; i < gpu.size(); ++i) {
    const double d = std::fabs(static_cast<double>(gpu[i]) - cpu[i]);
    if (!(d <= atol + rtol * std::fabs(cpu[i]))) {
      return ::testing::AssertionFailure()
             << what << "[" << i << "]: gpu " << gpu[i] << " vs cpu " << cpu[i];
    }
  }
  return ::testing::AssertionSuccess();
}

class CudaModelOpsTest : public ::testing::Test {
 protected:
  static constexpr int B = 2, T = 40, C = 64, NH = 4, V = 256, N = B * T;

  void SetUp() override {
    if (CudaDeviceCount() == 0) {
      GTEST_SKIP() << "no CUDA device visible (built without CUDA, no driver, or "
                      "CUDA_VISIBLE_DEVICES hides every GPU)";
    }
    CudaDeviceOptions options;
    options.memory_budget = size_t{256} << 20;
    auto device = NewCudaDevice(options);
    ASSERT_TRUE(device.ok()) << device.status().ToString();
    device_ = std::move(*device);
    Reopen(ModelDims{B, T, C, NH, V});
    cpu_ = NewHostModelOps();
  }

  // Fresh GPU ops (and their memory) for other shapes.
  void Reopen(const ModelDims& dims) {
    gpu_.reset();
    auto ops = NewCudaModelOps(device_.get(), dims);
    ASSERT_TRUE(ops.ok()) << ops.status().ToString();
    gpu_ = std::move(*ops);
  }

  void CheckLayerNorm(int n, int c);
  void CheckAttention(int b, int t, int c, int nh);

  // A device copy of `host` (ops memory).
  float* Up(const std::vector<float>& host) {
    Result<float*> p = gpu_->AllocFloats(host.size());
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    if (!p.ok()) return nullptr;
    Status s =
        device_->CopyHostToDevice(*p, host.data(), host.size() * 4, device_->ComputeStream());
    EXPECT_TRUE(s.ok()) << s.ToString();
    return *p;
  }
  uint16_t* Up16(const std::vector<uint16_t>& host) {
    Result<float*> p = gpu_->AllocFloats((host.size() + 1) / 2);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    if (!p.ok()) return nullptr;
    Status s =
        device_->CopyHostToDevice(*p, host.data(), host.size() * 2, device_->ComputeStream());
    EXPECT_TRUE(s.ok()) << s.ToString();
    return reinterpret_cast<uint16_t*>(*p);
  }
  int32_t* UpInts(const std::vector<int32_t>& host) {
    Result<int32_t*> p = gpu_->AllocInts(host.size());
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    if (!p.ok()) return nullptr;
    gpu_->UploadInts(*p, host.data(), host.size());
    return *p;
  }
  std::vector<float> Down(const float* p, size_t n) {
    std::vector<float> out(n);
    Status s = gpu_->Download(out.data(), p, n);
    EXPECT_TRUE(s.ok()) << s.ToString();
    return out;
  }
  std::vector<int32_t> Tokens(uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<int32_t> t(N);
    for (int32_t& x : t) x = static_cast<int32_t>(rng() % 7);  // repeats: rows collide
    return t;
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<ModelOps> gpu_, cpu_;
};

TEST_F(CudaModelOpsTest, EmbeddingsMatchTheCpu) {
  const std::vector<int32_t> tok = Tokens(1);
  const std::vector<float> wte = Random(size_t{V} * C, 2), wpe = Random(size_t{T} * C, 3);
  std::vector<float> out(size_t{N} * C);
  cpu_->EncoderForward(out.data(), tok.data(), wte.data(), wpe.data(), B, T, C);
  float* g_out = Up(out);
  gpu_->Zero(g_out, out.size());
  gpu_->EncoderForward(g_out, UpInts(tok), Up(wte), Up(wpe), B, T, C);
  EXPECT_TRUE(Close(Down(g_out, out.size()), out, "encoder out", 0, 0));  // one add: exact

  const std::vector<float> dout = Random(size_t{N} * C, 4);
  std::vector<float> dwte = Random(wte.size(), 5), dwpe = Random(wpe.size(), 6);
  float* g_dwte = Up(dwte);
  float* g_dwpe = Up(dwpe);
  cpu_->EncoderBackward(dwte.data(), dwpe.data(), dout.data(), tok.data(), B, T, C);
  gpu_->EncoderBackward(g_dwte, g_dwpe, Up(dout), UpInts(tok), B, T, C);
  // The same additions in the same order (one thread per channel walks the tokens).
  EXPECT_TRUE(Close(Down(g_dwte, dwte.size()), dwte, "dwte", 0, 0));
  EXPECT_TRUE(Close(Down(g_dwpe, dwpe.size()), dwpe, "dwpe", 0, 0));
  EXPECT_TRUE(gpu_->status().ok()) << gpu_->status().ToString();
}

void CudaModelOpsTest::CheckLayerNorm(int n, int c) {
  const std::vector<float> x = Random(size_t(n) * c, 10, -3.0f, 5.0f);  // a mean to remove
  const std::vector<float> w = Random(c, 11), b = Random(c, 12), dout = Random(x.size(), 13);
  std::vector<float> out(x.size()), mean(n), rstd(n);
  cpu_->LayerNormForward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), n, c);
  float *g_out = Up(out), *g_mean = Up(mean), *g_rstd = Up(rstd);
  float *g_x = Up(x), *g_w = Up(w);
  gpu_->LayerNormForward(g_out, g_mean, g_rstd, g_x, g_w, Up(b), n, c);
  EXPECT_TRUE(Close(Down(g_out, out.size()), out, "layernorm out"));
  EXPECT_TRUE(Close(Down(g_mean, n), mean, "mean"));
  EXPECT_TRUE(Close(Down(g_rstd, n), rstd, "rstd"));

  std::vector<float> dx = Random(x.size(), 14), dw = Random(c, 15), db = Random(c, 16);
  float *g_dx = Up(dx), *g_dw = Up(dw), *g_db = Up(db);
  // Both from the CPU's saved statistics, so only the backward is compared.
  const float* c_mean = Up(mean);
  const float* c_rstd = Up(rstd);
  cpu_->LayerNormBackward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(),
                          mean.data(), rstd.data(), n, c);
  gpu_->LayerNormBackward(g_dx, g_dw, g_db, Up(dout), g_x, g_w, c_mean, c_rstd, n, c);
  EXPECT_TRUE(Close(Down(g_dx, dx.size()), dx, "layernorm dinp"));
  EXPECT_TRUE(Close(Down(g_dw, c), dw, "layernorm dw"));
  // db is a pure sum over rows in the CPU's order: exact.
  EXPECT_TRUE(Close(Down(g_db, c), db, "layernorm db", 0, 0));
  EXPECT_TRUE(gpu_->status().ok()) << gpu_->status().ToString();
}

// C = 64: fewer features than threads; C = 1000: several per thread, not a multiple of 256.
TEST_F(CudaModelOpsTest, LayerNormMatchesTheCpu) {
  CheckLayerNorm(N, C);
  Reopen(ModelDims{1, 24, 1000, 8, V});
  CheckLayerNorm(24, 1000);
}

TEST_F(CudaModelOpsTest, Fp32LinearMatchesTheCpu) {
  const int IN = C, OUT = 3 * C;
  const std::vector<float> x = Random(size_t{N} * IN, 20), w = Random(size_t{OUT} * IN, 21);
  const std::vector<float> bias = Random(OUT, 22), dout = Random(size_t{N} * OUT, 23);
  std::vector<float> y(size_t{N} * OUT);
  cpu_->Linear(y.data(), x.data(), w.data(), nullptr, bias.data(), N, IN, OUT);
  float *g_y = Up(y), *g_x = Up(x), *g_w = Up(w);
  gpu_->Linear(g_y, g_x, g_w, nullptr, Up(bias), N, IN, OUT);
  EXPECT_TRUE(Close(Down(g_y, y.size()), y, "linear out"));

  std::vector<float> dx = Random(x.size(), 24), dw = Random(w.size(), 25), db = Random(OUT, 26);
  float *g_dx = Up(dx), *g_dw = Up(dw), *g_db = Up(db);
  cpu_->LinearBackward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), nullptr, N,
                       IN, OUT);
  gpu_->LinearBackward(g_dx, g_dw, g_db, Up(dout), g_x, g_w, nullptr, N, IN, OUT);
  EXPECT_TRUE(Close(Down(g_dx, dx.size()), dx, "linear dinp"));
  EXPECT_TRUE(Close(Down(g_dw, dw.size()), dw, "linear dw"));
  EXPECT_TRUE(Close(Down(g_db, OUT), db, "linear dbias"));
  EXPECT_TRUE(gpu_->status().ok()) << gpu_->status().ToString();
}

// bf16 weights: the GPU rounds the fp32 activation (or gradient) to bf16 and multiplies bf16
// by bf16 in fp32; the reference is the CPU's fp32 product of the same rounded operands.
TEST_F(CudaModelOpsTest, Bf16LinearIsTheProductOfTheRoundedOperands) {
  const int IN = 4 * C, OUT = C;
  std::vector<float> x = Random(size_t{N} * IN, 30), wf = Random(size_t{OUT} * IN, 31);
  const std::vector<float> dout = Random(size_t{N} * OUT, 32);
  std::vector<uint16_t> w16(wf.size());
  for (size_t i = 0; i < wf.size(); ++i) {
    w16[i] = ToBf16(wf[i]);
    wf[i] = FromBf16(w16[i]);
  }
  auto rounded = [](std::vector<float> v) {
    for (float& f : v) f = FromBf16(ToBf16(f));
    return v;
  };
  std::vector<float> y(size_t{N} * OUT);
  cpu_->Linear(y.data(), rounded(x).data(), wf.data(), nullptr, nullptr, N, IN, OUT);
  float *g_y = Up(y), *g_x = Up(x);
  uint16_t* g_w16 = Up16(w16);
  gpu_->Linear(g_y, g_x, nullptr, g_w16, nullptr, N, IN, OUT);
  EXPECT_TRUE(Close(Down(g_y, y.size()), y, "bf16 linear out"));

  std::vector<float> dx(x.size(), 0.0f), dw(wf.size(), 0.0f);
  float *g_dx = Up(dx), *g_dw = Up(dw);
  cpu_->LinearBackward(dx.data(), dw.data(), nullptr, rounded(dout).data(), rounded(x).data(),
                       wf.data(), nullptr, N, IN, OUT);
  gpu_->LinearBackward(g_dx, g_dw, nullptr, Up(dout), g_x, nullptr, g_w16, N, IN, OUT);
  EXPECT_TRUE(Close(Down(g_dx, dx.size()), dx, "bf16 linear dinp"));
  EXPECT_TRUE(Close(Down(g_dw, dw.size()), dw, "bf16 linear dw"));

  // No input gradient, a bias gradient (the fp32 output gradient's column sums, exact).
  std::vector<float> dw2(wf.size(), 0.0f), db(OUT, 0.0f);
  float *g_dw2 = Up(dw2), *g_db = Up(db);
  cpu_->LinearBackward(nullptr, dw2.data(), nullptr, rounded(dout).data(), rounded(x).data(),
                       wf.data(), nullptr, N, IN, OUT);
  for (int r = 0; r < N; ++r) {
    for (int j = 0; j < OUT; ++j) db[j] += dout[size_t(r) * OUT + j];
  }
  gpu_->LinearBackward(nullptr, g_dw2, g_db, Up(dout), g_x, nullptr, g_w16, N, IN, OUT);
  EXPECT_TRUE(Close(Down(g_dw2, dw2.size()), dw2, "bf16 linear dw, no dinp"));
  EXPECT_TRUE(Close(Down(g_db, OUT), db, "bf16 linear dbias", 0, 0));
  EXPECT_TRUE(gpu_->status().ok()) << gpu_->status().ToString();
}

void CudaModelOpsTest::CheckAttention(int b, int t, int c, int nh) {
  const size_t n = size_t(b) * t;
  const std::vector<float> qkv = Random(n * 3 * c, 40);
  std::vector<float> out(n * c), att(size_t(b) * nh * t * t);
  cpu_->AttentionForward(out.data(), att.data(), qkv.data(), b, t, c, nh);
  float *g_out = Up(out), *g_att = Up(att), *g_qkv = Up(qkv);
  gpu_->Zero(g_att, att.size());
  gpu_->AttentionForward(g_out, g_att, g_qkv, b, t, c, nh);
  EXPECT_TRUE(Close(Down(g_att, att.size()), att, "attention probabilities"));
  EXPECT_TRUE(Close(Down(g_out, out.size()), out, "attention out"));

  const std::vector<float> dout = Random(out.size(), 41);
  std::vector<float> dqkv = Random(qkv.size(), 42);
  float* g_dqkv = Up(dqkv);
  cpu_->AttentionBackward(dqkv.data(), dout.data(), qkv.data(), att.data(), b, t, c, nh);
  gpu_->AttentionBackward(g_dqkv, Up(dout), g_qkv, Up(att), b, t, c, nh);
  EXPECT_TRUE(Close(Down(g_dqkv, dqkv.size()), dqkv, "attention dqkv"));
  EXPECT_TRUE(gpu_->status().ok()) << gpu_->status().ToString();
}

// T = 40 > 32: a warp's lanes each handle more than one key; head size 16 < 32 lanes, then
// 128 (several features per lane).
TEST_F(CudaModelOpsTest, AttentionMatchesTheCpu) {
  CheckAttention(B, T, C, NH);
  Reopen(ModelDims{2, 40, 256, 2, V});
  CheckAttention(2, 40, 256, 2);
}

TEST_F(CudaModelOpsTest, GeluResidualAndCrossEntropyMatchTheCpu) {
  const size_t n = size_t{N} * 4 * C;
  const std::vector<float> x = Random(n, 50, -6.0f, 6.0f), d = Random(n, 51);
  std::vector<float> y(n), dx = Random(n, 52), r(n);
  cpu_->GeluForward(y.data(), x.data(), n);
  float *g_x = Up(x), *g_y = Up(y), *g_dx = Up(dx), *g_d = Up(d), *g_r = Up(r);
  gpu_->GeluForward(g_y, g_x, n);
  // The CPU's tanh is a polynomial within 2e-7 of tanh; the GPU's tanhf within 2 ulps.
  EXPECT_TRUE(Close(Down(g_y, n), y, "gelu"));
  cpu_->GeluBackward(dx.data(), x.data(), d.data(), n);
  gpu_->GeluBackward(g_dx, g_x, g_d, n);
  EXPECT_TRUE(Close(Down(g_dx, n), dx, "gelu backward"));
  cpu_->ResidualForward(r.data(), x.data(), d.data(), n);
  gpu_->ResidualForward(g_r, g_x, g_d, n);
  EXPECT_TRUE(Close(Down(g_r, n), r, "residual", 0, 0));  // one add: exact

  const std::vector<float> logits = Random(size_t{N} * V, 53, -4.0f, 4.0f);
  std::vector<int32_t> targets = Tokens(54);
  targets[3] = V - 1;
  std::vector<float> dl(logits.size());
  Result<double> cl = cpu_->CrossEntropy(dl.data(), logits.data(), targets.data(), N, V, 0.5);
  float* g_dl = Up(dl);
  Result<double> gl = gpu_->CrossEntropy(g_dl, Up(logits), UpInts(targets), N, V, 0.5);
  ASSERT_TRUE(cl.ok() && gl.ok()) << gl.status().ToString();
  EXPECT_NEAR(*gl, *cl, 1e-6 * std::fabs(*cl));  // per-row sums in double
  EXPECT_TRUE(Close(Down(g_dl, dl.size()), dl, "dlogits", 1e-7, 1e-5));
}

// Shapes larger than the ops were created for are refused (no kernel runs on them), and the
// error stays: status() reports it.
TEST_F(CudaModelOpsTest, ShapesBeyondTheScratchAreErrors) {
  Result<float*> p = gpu_->AllocFloats(size_t{N} * 8 * C);
  ASSERT_TRUE(p.ok());
  float* big = *p;
  Result<double> r = gpu_->CrossEntropy(nullptr, big, nullptr, 2 * N, V, 1.0);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(gpu_->status().ok());
  gpu_->AttentionBackward(big, big, big, big, B, 2 * T, C, NH);
  EXPECT_EQ(gpu_->status().code(), StatusCode::kInvalidArgument);
  Reopen(ModelDims{B, T, C, NH, V});
  std::vector<uint16_t> w16(size_t{8} * C * C, 0);
  gpu_->Linear(big, big, nullptr, Up16(w16), nullptr, 2 * N, 4 * C, 2 * C);  // 2N x 4C > scratch
  EXPECT_EQ(gpu_->status().code(), StatusCode::kInvalidArgument);
}

// ---- The trainer on the GPU -------------------------------------------------------------------

EngineConfig MakeConfig(bool bf16, Tier param, Tier optimizer, const std::string& nvme) {
  EngineConfig c;
  c.offload_param.tier = param;
  c.offload_optimizer.tier = optimizer;
  c.offload_param.nvme_paths = {nvme};
  c.offload_optimizer.nvme_paths = {nvme};
  c.bf16 = bf16;
  c.optimizer.type = OptimizerType::kAdamW;
  c.optimizer.lr = 3e-3f;
  c.sub_group_size = 20000;
  c.prefetch_bucket_size = 20000;
  c.param_persistence_threshold = 64;
  c.pinned_budget_bytes = 64ull << 20;
  c.device_budget_bytes = 64ull << 20;
  c.optimizer_threads = 1;
  return c;
}

struct TrainRun {
  std::vector<double> losses;
  uint64_t checksum = 0;
};

// `steps` steps of the tiny model on the host device (gpu false) or GPU 0.
Status Train(bool gpu, const EngineConfig& config, int steps, TrainRun* run) {
  const GptConfig model = TinyModel();
  const int batch = 8, seq = 16;
  std::unique_ptr<Device> device;
  std::vector<std::unique_ptr<Communicator>> comms;
  if (gpu) {
    CudaDeviceOptions o;
    o.memory_budget =
        config.device_budget_bytes + GptTrainer::DeviceBytes(model, batch, seq, config.bf16);
    ZINF_ASSIGN_OR_RETURN(device, NewCudaDevice(o));
    ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm,
                          NewNcclComm(device.get(), NcclCommOptions{}));
    comms.push_back(std::move(comm));
  } else {
    device = NewHostDevice(HostDeviceOptions{});
    ZINF_ASSIGN_OR_RETURN(comms, NewLocalComms({device.get()}));
  }
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                        Engine::Create(config, device.get(), comms[0].get()));
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<GptTrainer> trainer,
                        GptTrainer::Create(model, batch, seq, 7, engine.get(), {}, device.get()));
  // ZINF_TRAIN_DATA: the corpus where the binary runs away from its build tree (gpu_check.sh
  // with a prebuilt bundle).
  const char* corpus = std::getenv("ZINF_TRAIN_DATA");
  ZINF_ASSIGN_OR_RETURN(TextData data,
                        TextData::Load(corpus != nullptr ? corpus : ZINF_SOURCE_DATA, seq));
  std::vector<int32_t> tokens(batch * seq), targets(batch * seq);
  for (int step = 0; step < steps; ++step) {
    data.Batch(7, step, batch, seq, tokens.data(), targets.data());
    ZINF_ASSIGN_OR_RETURN(double loss,
                          trainer->MicroStep(tokens.data(), targets.data(), 1.0f, nullptr));
    run->losses.push_back(loss);
  }
  ZINF_ASSIGN_OR_RETURN(run->checksum, trainer->ParamChecksum());
  return Status::OK();
}

class CudaTrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) {
      GTEST_SKIP() << "no CUDA device visible (built without CUDA, no driver, or "
                      "CUDA_VISIBLE_DEVICES hides every GPU)";
    }
  }
};

// fp32 parameters: the GPU run tracks the CPU run, and repeats itself bit for bit.
TEST_F(CudaTrainerTest, TinyModelTracksTheCpuAndRepeatsBitForBit) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  const EngineConfig config = MakeConfig(false, Tier::kDevice, Tier::kCpu, dir.path());
  TrainRun cpu, gpu, again;
  Status s = Train(false, config, 5, &cpu);
  ASSERT_TRUE(s.ok()) << s.ToString();
  s = Train(true, config, 5, &gpu);
  ASSERT_TRUE(s.ok()) << s.ToString();
  s = Train(true, config, 5, &again);
  ASSERT_TRUE(s.ok()) << s.ToString();
  for (int i = 0; i < 5; ++i) {
    EXPECT_NEAR(gpu.losses[i], cpu.losses[i], 1e-3 * cpu.losses[i]) << "step " << i;
    EXPECT_EQ(gpu.losses[i], again.losses[i]) << "step " << i;
  }
  EXPECT_EQ(gpu.checksum, again.checksum);
}

// bf16 parameters on NVMe, optimizer states on NVMe: the GPU model learns (the CPU test's
// criterion, Model.TinyModelLossFallsOver50Steps) and tracks the CPU's bf16 run loosely (the
// GPU also rounds activations to bf16 for its GEMMs).
TEST_F(CudaTrainerTest, Bf16OffloadedModelLearns) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  const EngineConfig config = MakeConfig(true, Tier::kNvme, Tier::kNvme, dir.path());
  TrainRun gpu, cpu;
  Status s = Train(true, config, 50, &gpu);
  ASSERT_TRUE(s.ok()) << s.ToString();
  s = Train(false, config, 50, &cpu);
  ASSERT_TRUE(s.ok()) << s.ToString();
  double first = 0, last = 0, cpu_last = 0;
  for (int i = 0; i < 5; ++i) {
    first += gpu.losses[i] / 5;
    last += gpu.losses[45 + i] / 5;
    cpu_last += cpu.losses[45 + i] / 5;
  }
  std::printf("  gpu loss: first 5 steps %.3f, last 5 %.3f (cpu last 5 %.3f)\n", first, last,
              cpu_last);
  // Starts near log(256) = 5.55 (uniform over bytes) and at the CPU run's first loss (same
  // initial weights; only the GEMMs' rounding differs), ends well under 4 (the CPU run
  // reaches 3.32; the two runs are not compared after 50 steps: their rounding differs).
  EXPECT_NEAR(gpu.losses[0], std::log(256.0), 0.3);
  EXPECT_NEAR(gpu.losses[0], cpu.losses[0], 0.01);
  EXPECT_LT(last, 4.0);
}

}  // namespace
}  // namespace zinf::train
