// What crosses the link from the gradients. zinf.gradient_transfer_dtype: the gradients that
// cross the link in bf16 are exactly the fp32 gradients (summed over the ranks in fp32) rounded
// once per micro-step, and accumulated and stepped in fp32 on the host: bit-identical to the scalar
// optimizer applied to that sum, on every placement, one rank or two, with and without the strict
// host device. The fp32 transfer gives the unrounded sum (so the test tells the two apart), and the
// bf16 transfer moves half the bytes.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "device/host/local_comm.h"
#include "tests/faulty_device.h"
#include "tests/strict_device.h"
#include "tests/test_util.h"
#include "zinf/comm.h"
#include "zinf/config.h"
#include "zinf/cpu_adam.h"
#include "zinf/device.h"
#include "zinf/engine.h"

namespace zinf {
namespace {

using testing::DeviceOp;
using testing::FaultyDevice;
using testing::NewTestHostDevice;
using testing::TempDir;

constexpr size_t kNumel = 3001;  // not a multiple of the partition alignment: padded
constexpr int kSteps = 2;
constexpr int kAccum = 2;
constexpr float kLr = 1e-2f;

float Init(size_t i) { return 0.01f * static_cast<float>(static_cast<int>(i % 37) - 18); }

// Rank r's gradient in micro-step `micro`: varied mantissas, plus values bf16 must get right:
// exact ties (the low 16 bits 0x8000), fp32 denormals (flushed to signed zero), zeros.
float Grad(int rank, int micro, size_t i) {
  uint32_t h = static_cast<uint32_t>(i) * 2654435761u + static_cast<uint32_t>(rank) * 97u +
               static_cast<uint32_t>(micro) * 7919u;
  h ^= h >> 13;
  h *= 0x5bd1e995u;
  h ^= h >> 15;
  float g = (static_cast<float>(h % 20001u) - 10000.0f) * 1.37e-4f;
  if (i % 101 == 0) {
    uint32_t bits;
    std::memcpy(&bits, &g, sizeof(bits));
    bits = (bits & 0xffff0000u) | 0x8000u;  // halfway between two bf16 values
    std::memcpy(&g, &bits, sizeof(g));
  }
  if (i % 103 == 0) g = (h & 1) ? 3e-40f : -3e-40f;
  if (i % 107 == 0) g = 0.0f;
  return g;
}

struct Outcome {
  Status status;
  std::vector<float> master;  // rank 0's gathered master after the last step
  std::vector<uint64_t> d2h;  // rank 0's StepStats::d2h_bytes per micro-step
  // Rank 0's device calls on the gradient stream.
  int grad_copies_to_host = 0;
  int grad_additions = 0;
  int roundings = 0;  // ConvertToBf16 on any stream
};

EngineConfig Config(Tier param, Tier optimizer, bool bf16, const std::string& dir) {
  EngineConfig c;
  c.offload_param.tier = param;
  c.offload_optimizer.tier = optimizer;
  if (param == Tier::kNvme) c.offload_param.nvme_paths = {dir};
  if (optimizer == Tier::kNvme) c.offload_optimizer.nvme_paths = {dir};
  c.offload_param.buffer_size = 1 << 16;
  c.offload_optimizer.buffer_size = 1 << 16;
  c.pinned_budget_bytes = 64ull << 20;
  c.param_persistence_threshold = 0;
  c.optimizer.type = OptimizerType::kAdamW;
  c.optimizer.lr = kLr;
  c.optimizer.weight_decay = 0.01f;
  c.gradient_accumulation_steps = kAccum;
  c.gradient_transfer_bf16 = bf16;
  c.optimizer_threads = 1;
  return c;
}

Status RankMain(const EngineConfig& config, int rank, Device* device, Communicator* comm,
                Outcome* out) {
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Engine> e, Engine::Create(config, device, comm));
  ParamSpec spec;
  spec.name = "w";
  spec.shape = {static_cast<int64_t>(kNumel)};
  spec.init = [](float* d, size_t n) {
    for (size_t i = 0; i < n; ++i) d[i] = Init(i);
  };
  ZINF_ASSIGN_OR_RETURN(ParamId id, e->RegisterParameter(spec));
  ZINF_RETURN_IF_ERROR(e->FinishRegistration());
  Stream* compute = device->ComputeStream();
  ZINF_ASSIGN_OR_RETURN(void* dev, device->Alloc(kNumel * sizeof(float)));
  Status s;
  std::vector<float> grad(kNumel);
  for (int micro = 0; micro < kSteps * kAccum && s.ok(); ++micro) {
    for (size_t i = 0; i < kNumel; ++i) grad[i] = Grad(rank, micro, i);
    Result<std::vector<void*>> got = e->Acquire({id});
    s = got.status();
    if (s.ok()) s = device->CopyHostToDevice(dev, grad.data(), kNumel * sizeof(float), compute);
    if (s.ok()) s = e->ReduceGradient(id, static_cast<const float*>(dev));
    // The engine's copy out of `dev` is ordered on the compute stream: done before reuse.
    if (s.ok()) s = device->SynchronizeStream(compute);
    if (s.ok()) s = e->Release({id});
    if (!s.ok()) break;
    Result<StepStats> st = e->Step();
    s = st.status();
    if (s.ok()) out->d2h.push_back(st->d2h_bytes);
  }
  Status synced = device->SynchronizeStream(compute);
  device->Free(dev);
  ZINF_RETURN_IF_ERROR(s);
  ZINF_RETURN_IF_ERROR(synced);
  out->master.resize(kNumel);
  return e->GatherMasterParameter(id, out->master.data());
}

Outcome Train(int ranks, Tier param, Tier optimizer, bool bf16) {
  TempDir dir;
  const EngineConfig config = Config(param, optimizer, bf16, dir.path());
  std::vector<std::unique_ptr<Device>> devices;
  std::vector<Device*> raw;
  std::vector<FaultyDevice*> counted;  // (never armed: counts calls)
  for (int r = 0; r < ranks; ++r) {
    auto inner = NewTestHostDevice();
    raw.push_back(inner.get());
    auto faulty = std::make_unique<FaultyDevice>(std::move(inner));
    counted.push_back(faulty.get());
    devices.push_back(std::move(faulty));
  }
  Outcome result;
  auto comms = NewLocalComms(raw, LocalCommOptions{});
  if (!comms.ok()) {
    result.status = comms.status();
    return result;
  }
  std::vector<Outcome> outs(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back(
        [&, r] { outs[r].status = RankMain(config, r, counted[r], (*comms)[r].get(), &outs[r]); });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < ranks; ++r) {
    if (!outs[r].status.ok()) {
      result.status = outs[r].status.WithContext("rank " + std::to_string(r));
      return result;
    }
    if (outs[r].master != outs[0].master) {
      result.status = Status::Internal("rank " + std::to_string(r) + " gathered other values");
      return result;
    }
  }
  outs[0].grad_copies_to_host = counted[0]->calls(DeviceOp::kCopyDeviceToHost, "zinf-grad");
  outs[0].grad_additions = counted[0]->calls(DeviceOp::kAddInto, "zinf-grad");
  outs[0].roundings = counted[0]->calls(DeviceOp::kConvertToBf16, "compute") +
                      counted[0]->calls(DeviceOp::kConvertToBf16, "zinf-grad");
  return outs[0];
}

// The scalar optimizer on the gradients summed over the ranks in rank order (LocalComm's
// order), each micro-step's sum rounded to bf16 when `bf16`, accumulated in fp32.
std::vector<float> Expected(int ranks, bool bf16) {
  std::vector<float> w(kNumel), m(kNumel, 0.0f), v(kNumel, 0.0f), acc(kNumel);
  for (size_t i = 0; i < kNumel; ++i) w[i] = Init(i);
  for (int step = 0; step < kSteps; ++step) {
    for (int k = 0; k < kAccum; ++k) {
      const int micro = step * kAccum + k;
      for (size_t i = 0; i < kNumel; ++i) {
        float sum = Grad(0, micro, i);
        for (int r = 1; r < ranks; ++r) sum += Grad(r, micro, i);
        if (bf16) sum = Bf16ToFp32(Fp32ToBf16(sum));
        acc[i] = k == 0 ? sum : acc[i] + sum;
      }
    }
    OptimizerHyperParams hp;
    hp.kind = OptimizerKind::kAdamW;
    hp.step = step + 1;
    hp.lr = kLr;
    const EngineConfig defaults;
    hp.beta1 = defaults.optimizer.beta1;
    hp.beta2 = defaults.optimizer.beta2;
    hp.eps = defaults.optimizer.eps;
    hp.weight_decay = 0.01f;
    OptimizerTensors t;
    t.param = w.data();
    t.grad = acc.data();
    t.grad_type = GradType::kF32;
    t.exp_avg = m.data();
    t.exp_avg_sq = v.data();
    t.n = kNumel;
    Status s = OptimizerStep(hp, t, CpuIsa::kScalar);
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  return w;
}

std::string FirstDifference(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size())
    return "sizes " + std::to_string(a.size()) + " vs " + std::to_string(b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
      return "element " + std::to_string(i) + ": " + std::to_string(a[i]) + " vs " +
             std::to_string(b[i]);
    }
  }
  return "";
}

struct Placement {
  Tier param;
  Tier optimizer;
};

TEST(GradientTransfer, Bf16IsTheFp32SumRoundedOncePerMicroStepAndHalfTheBytes) {
  const Placement placements[] = {
      {Tier::kDevice, Tier::kCpu}, {Tier::kCpu, Tier::kCpu}, {Tier::kNvme, Tier::kNvme}};
  for (int ranks : {1, 2}) {
    const std::vector<float> want32 = Expected(ranks, false);
    const std::vector<float> want16 = Expected(ranks, true);
    // The rounding changes the training: a test that cannot tell them apart proves nothing.
    ASSERT_NE(FirstDifference(want32, want16), "");
    for (const Placement& pl : placements) {
      SCOPED_TRACE(std::to_string(ranks) + " rank(s), params " + TierName(pl.param) +
                   ", optimizer " + TierName(pl.optimizer));
      Outcome f32 = Train(ranks, pl.param, pl.optimizer, false);
      ASSERT_TRUE(f32.status.ok()) << f32.status.ToString();
      Outcome b16 = Train(ranks, pl.param, pl.optimizer, true);
      ASSERT_TRUE(b16.status.ok()) << b16.status.ToString();
      EXPECT_EQ(FirstDifference(f32.master, want32), "") << "fp32 transfer";
      EXPECT_EQ(FirstDifference(b16.master, want16), "") << "bf16 transfer";
      ASSERT_EQ(f32.d2h.size(), static_cast<size_t>(kSteps * kAccum));
      ASSERT_EQ(b16.d2h.size(), f32.d2h.size());
      // Every micro-step's gradient is rounded once, on the device, before it crosses (also on
      // the host device, whose link then carries the halved bytes it counts).
      EXPECT_EQ(f32.roundings, 0);
      EXPECT_EQ(b16.roundings, kSteps * kAccum);
      for (size_t k = 0; k < f32.d2h.size(); ++k) {
        EXPECT_GE(f32.d2h[k], kNumel * sizeof(float) / ranks) << "micro-step " << k;
        EXPECT_EQ(b16.d2h[k] * 2, f32.d2h[k]) << "micro-step " << k;
      }
    }
  }
}

// Parameters and optimizer states on the device: the gradients are summed over the
// micro-steps in device memory (Device::AddInto after the first) and stepped there, never
// copied to the host, whatever gradient_transfer_dtype says; bit-identical to the scalar
// optimizer on the unrounded sum.
TEST(GradientTransfer, SubGroupsSteppedOnTheDeviceAccumulateThereAndNothingCrosses) {
  for (int ranks : {1, 2}) {
    const std::vector<float> want = Expected(ranks, false);
    for (bool bf16 : {false, true}) {
      SCOPED_TRACE(std::to_string(ranks) + " rank(s), transfer " + (bf16 ? "bf16" : "fp32"));
      Outcome o = Train(ranks, Tier::kDevice, Tier::kDevice, bf16);
      ASSERT_TRUE(o.status.ok()) << o.status.ToString();
      EXPECT_EQ(FirstDifference(o.master, want), "");
      ASSERT_EQ(o.d2h.size(), static_cast<size_t>(kSteps * kAccum));
      for (size_t k = 0; k < o.d2h.size(); ++k) EXPECT_EQ(o.d2h[k], 0u) << "micro-step " << k;
      EXPECT_EQ(o.grad_copies_to_host, 0);
      // One addition per later micro-step of each window.
      EXPECT_EQ(o.grad_additions, kSteps * (kAccum - 1));
    }
  }
}

}  // namespace
}  // namespace zinf
