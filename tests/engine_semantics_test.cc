// The engine's optimizer semantics as torch defines them, checked against a simulation with
// the scalar reference kernels: parameters without a gradient in a window are skipped (master,
// moments and their own update count untouched), frozen parameters never change, a window
// with no gradient at all changes nothing; inference acquires between steps neither start a
// micro-step nor touch the prefetch trace; SetParameterValues replaces values; per-parameter
// update counts survive checkpoints and durable resumes.
//
// The gradients are synthetic (a hash of parameter, micro-step and element), independent of
// the parameter values, so the final masters do not depend on the delayed update either: every
// placement, delayed or not, must end bit-identical to the simulation. What each micro-step
// reads (the acquired values) is checked against the simulated version it should see.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "device/host/local_comm.h"
#include "engine/core/loss_scaler.h"
#include "tests/engine_test_model.h"
#include "tests/test_util.h"
#include "zinf/comm.h"
#include "zinf/config.h"
#include "zinf/cpu_adam.h"
#include "zinf/device.h"
#include "zinf/engine.h"
#include "zinf/io.h"
#include "zinf/log.h"

namespace zinf {
namespace {

using testing::HashUniform;
using testing::TempDir;

struct TensorDef {
  const char* name;
  std::vector<int64_t> shape;
  bool trainable = true;
};

// Five tensors over three sub-groups (sub_group_size 12,000 elements, slices 2,048-aligned).
const std::vector<TensorDef>& Defs() {
  static const std::vector<TensorDef> defs = {{"a.weight", {60, 70}}, {"a.bias", {70}},
                                              {"b.weight", {50, 90}}, {"frozen", {33, 3}, false},
                                              {"c.weight", {80, 40}}, {"never", {21}}};
  return defs;
}
size_t Numel(const TensorDef& d) {
  size_t n = 1;
  for (int64_t x : d.shape) n *= static_cast<size_t>(x);
  return n;
}
float InitValue(size_t p, size_t i) { return 0.5f * HashUniform(0xA11CE, p, i); }

constexpr int kAccum = 2;
constexpr int kSteps = 5;
constexpr float kLr = 2e-2f;

// Whether tensor p gets a gradient in micro-step `micro` (0-based, kAccum per window):
// "a.bias" none in window 1 (steps count from 0), "b.weight" only in the first micro-step of
// each window, "c.weight" none in windows 2 and 3, "never" and "frozen" never; window 3 has no
// gradient at all.
bool HasGrad(size_t p, int micro) {
  const int window = micro / kAccum;
  const std::string name = Defs()[p].name;
  if (!Defs()[p].trainable || name == "never" || window == 3) return false;
  if (name == "a.bias") return window != 1;
  if (name == "b.weight") return micro % kAccum == 0;
  if (name == "c.weight") return window != 2;
  return true;
}
float GradValue(size_t p, int micro, size_t i) { return HashUniform(0x6AD, p * 131 + micro, i); }

struct Placement {
  Tier params = Tier::kCpu;
  Tier states = Tier::kCpu;
  double ratio = 1.0;
  bool delayed = false;
  bool bf16 = false;
  double clip = 0.0;
  bool fp16 = false;  // fp16 parameters, dynamic loss scaling (Fp16Settings)
  SpeculativeStep speculative = SpeculativeStep::kAuto;
  ParamCopyType stored() const {
    return bf16 ? ParamCopyType::kBf16 : fp16 ? ParamCopyType::kF16 : ParamCopyType::kNone;
  }
  std::string Describe() const {
    std::ostringstream os;
    os << "params " << TierName(params) << ", states " << TierName(states) << ", ratio " << ratio
       << (delayed ? ", delayed" : "") << (bf16 ? ", bf16" : "") << (fp16 ? ", fp16" : "")
       << ", clip " << clip << (speculative == SpeculativeStep::kOn ? ", speculative" : "");
    return os.str();
  }
};

// The fp16 runs' loss scale: dynamic from 2^12, halved at the second overflow (hysteresis 2),
// doubled after each step without overflow (window 1).
void Fp16Settings(Fp16Config* f) {
  f->enabled = true;
  f->initial_scale_power = 12;
  f->loss_scale_window = 1;
  f->hysteresis = 2;
}

void PrintTo(const Placement& p, std::ostream* os) { *os << p.Describe(); }

// A placement's test name (fp16 placements say so in their suite's name, not here).
std::string PlacementName(const ::testing::TestParamInfo<Placement>& info) {
  const Placement& p = info.param;
  std::string s = std::string("Params") + TierName(p.params) + "States" + TierName(p.states);
  if (p.ratio < 1) s += "Ratio";
  if (p.delayed) s += "Delayed";
  if (p.bf16) s += "Bf16";
  if (p.clip > 0) s += p.clip < 1 ? "Clip" : "ClipOff";
  if (p.speculative == SpeculativeStep::kOn) s += "Speculative";
  return s;
}

EngineConfig MakeConfig(const Placement& pl, const std::string& dir) {
  EngineConfig c;
  c.offload_param.tier = pl.params;
  c.offload_optimizer.tier = pl.states;
  if (pl.params == Tier::kNvme) c.offload_param.nvme_paths = {dir};
  if (pl.states == Tier::kNvme) c.offload_optimizer.nvme_paths = {dir};
  c.offload_optimizer.ratio = pl.ratio;
  c.sub_group_size = 12000;
  c.prefetch_bucket_size = 20000;
  c.param_persistence_threshold = 50;
  c.optimizer.type = OptimizerType::kAdamW;
  c.optimizer.lr = kLr;
  c.optimizer.weight_decay = 0.1f;
  c.gradient_accumulation_steps = kAccum;
  c.gradient_clipping = pl.clip;
  c.delayed_update = pl.delayed;
  c.bf16 = pl.bf16;
  if (pl.fp16) Fp16Settings(&c.fp16);
  c.speculative_step = pl.speculative;
  c.pinned_budget_bytes = 4ull << 20;
  c.optimizer_threads = 1;
  return c;
}

// ---- The simulation ----------------------------------------------------------------------------

struct SimTensor {
  std::vector<float> master, m, v;  // partition_numel (padded with zeros)
  int64_t updates = 0;
};

class Simulation {
 public:
  Simulation() {
    for (size_t p = 0; p < Defs().size(); ++p) {
      const size_t n = Numel(Defs()[p]);
      const size_t padded = (n + 15) / 16 * 16;
      SimTensor t;
      t.master.assign(padded, 0.0f);
      for (size_t i = 0; i < n; ++i) t.master[i] = InitValue(p, i);
      t.m.assign(padded, 0.0f);
      t.v.assign(padded, 0.0f);
      tensors_.push_back(std::move(t));
    }
    versions_.push_back(Masters());
  }

  // One optimizer step over the window ending at micro-step `last_micro`.
  void Step(int window, double clip) {
    std::vector<std::vector<float>> grads(tensors_.size());
    std::vector<bool> any(tensors_.size(), false);
    for (size_t p = 0; p < tensors_.size(); ++p) {
      grads[p].assign(tensors_[p].master.size(), 0.0f);
      bool first = true;
      for (int k = 0; k < kAccum; ++k) {
        const int micro = window * kAccum + k;
        if (!HasGrad(p, micro)) continue;
        any[p] = true;
        for (size_t i = 0; i < Numel(Defs()[p]); ++i) {
          grads[p][i] = first ? GradValue(p, micro, i) : grads[p][i] + GradValue(p, micro, i);
        }
        first = false;
      }
    }
    float coef = 1.0f;
    if (clip > 0) {
      CpuOptimizer::Options oo;
      oo.num_threads = 1;
      std::unique_ptr<CpuOptimizer> opt = CpuOptimizer::Create(oo).value();
      double local = 0;
      for (const auto& g : grads) {
        local += opt->GradSumSquares(g.data(), GradType::kF32, g.size()).value().sum_squares;
      }
      const float total = static_cast<float>(local);
      const double norm = std::sqrt(static_cast<double>(total));
      if (norm > clip) coef = static_cast<float>(clip / (norm + 1e-6));
    }
    for (size_t p = 0; p < tensors_.size(); ++p) {
      if (!any[p]) continue;
      SimTensor& t = tensors_[p];
      OptimizerHyperParams hp;
      hp.kind = OptimizerKind::kAdamW;
      hp.step = ++t.updates;
      hp.lr = kLr;
      hp.weight_decay = 0.1f;
      hp.grad_scale = coef;
      OptimizerTensors ot;
      ot.param = t.master.data();
      ot.grad = grads[p].data();
      ot.exp_avg = t.m.data();
      ot.exp_avg_sq = t.v.data();
      ot.n = t.master.size();
      ASSERT_TRUE(OptimizerStep(hp, ot, CpuIsa::kScalar).ok());
    }
    versions_.push_back(Masters());
  }

  // A window skipped (fp16 overflow): nothing changes, the step is counted.
  void Skip() { versions_.push_back(Masters()); }

  const std::vector<float>& master(size_t p) const { return tensors_[p].master; }
  int64_t updates(size_t p) const { return tensors_[p].updates; }
  // The masters after `step` optimizer steps.
  const std::vector<std::vector<float>>& version(int64_t step) const { return versions_[step]; }

 private:
  std::vector<std::vector<float>> Masters() const {
    std::vector<std::vector<float>> out;
    for (const SimTensor& t : tensors_) out.push_back(t.master);
    return out;
  }
  std::vector<SimTensor> tensors_;
  std::vector<std::vector<std::vector<float>>> versions_;
};

// ---- Driving the engine -----------------------------------------------------------------------

// Registers the tensors of Defs() (initial values InitValue) and appends their ids to `ids`.
Status RegisterDefs(Engine* engine, std::vector<ParamId>* ids) {
  for (size_t p = 0; p < Defs().size(); ++p) {
    ParamSpec spec;
    spec.name = Defs()[p].name;
    spec.shape = Defs()[p].shape;
    spec.trainable = Defs()[p].trainable;
    spec.init = [p](float* data, size_t n) {
      for (size_t i = 0; i < n; ++i) data[i] = InitValue(p, i);
    };
    ZINF_ASSIGN_OR_RETURN(ParamId id, engine->RegisterParameter(spec));
    ids->push_back(id);
  }
  return Status::OK();
}

struct Rig {
  TempDir dir;
  std::unique_ptr<Device> device;
  std::vector<std::unique_ptr<Communicator>> comms;
  std::unique_ptr<Engine> engine;
  std::vector<ParamId> ids;

  Status Create(const EngineConfig& config, bool finish = true, const EngineHooks& hooks = {}) {
    HostDeviceOptions ho;
    ho.memory_budget = 64ull << 20;
    device = NewHostDevice(ho);
    ZINF_ASSIGN_OR_RETURN(comms, NewLocalComms({device.get()}));
    ZINF_ASSIGN_OR_RETURN(engine, Engine::Create(config, device.get(), comms[0].get(), hooks));
    ZINF_RETURN_IF_ERROR(RegisterDefs(engine.get(), &ids));
    return finish ? engine->FinishRegistration() : Status::OK();
  }
};

// The first n values of `master` as stored (rounded to bf16 or fp16, or fp32 as they are).
std::vector<float> Expected(const std::vector<float>& master, size_t n, ParamCopyType stored) {
  std::vector<float> out(master.begin(), master.begin() + static_cast<std::ptrdiff_t>(n));
  if (stored != ParamCopyType::kNone) {
    for (float& x : out) x = ParamCopyToFp32(stored, Fp32ToParamCopy(stored, x));
  }
  return out;
}

// Acquires every parameter and compares what it reads with `version` (in the storage dtype).
void CheckAcquired(Rig& rig, const std::vector<std::vector<float>>& version, ParamCopyType stored,
                   AcquireMode mode, const std::string& when) {
  Result<std::vector<void*>> ptrs = rig.engine->Acquire(rig.ids, mode);
  ASSERT_TRUE(ptrs.ok()) << when << ": " << ptrs.status().ToString();
  for (size_t p = 0; p < rig.ids.size(); ++p) {
    const size_t n = Numel(Defs()[p]);
    std::vector<float> got(n);
    for (size_t i = 0; i < n; ++i) {
      got[i] = stored != ParamCopyType::kNone
                   ? ParamCopyToFp32(stored, static_cast<const uint16_t*>((*ptrs)[p])[i])
                   : static_cast<const float*>((*ptrs)[p])[i];
    }
    ASSERT_EQ(got, Expected(version[p], n, stored))
        << when << ": parameter '" << Defs()[p].name << "' reads the wrong version";
  }
  ASSERT_TRUE(rig.engine->Release(rig.ids).ok());
}

// One micro-step: acquire everything (checking the values), hand over the gradients, Step.
void MicroStep(Rig& rig, int micro, const Placement& pl, const Simulation& sim) {
  const int64_t step = rig.engine->global_step();
  // The version this micro-step reads: one behind with the delayed update.
  const int64_t visible = pl.delayed ? std::max<int64_t>(step - 1, 0) : step;
  CheckAcquired(rig, sim.version(visible), pl.stored(), AcquireMode::kTraining,
                "micro-step " + std::to_string(micro) + " (" + pl.Describe() + ")");
  for (size_t p = 0; p < Defs().size(); ++p) {
    if (!HasGrad(p, micro)) continue;
    std::vector<float> g(Numel(Defs()[p]));
    for (size_t i = 0; i < g.size(); ++i) g[i] = GradValue(p, micro, i);
    ASSERT_TRUE(rig.engine->ReduceGradient(rig.ids[p], g.data()).ok());
  }
  Result<StepStats> st = rig.engine->Step();
  ASSERT_TRUE(st.ok()) << st.status().ToString();
}

void ExpectMasters(Rig& rig, const Simulation& sim, const std::string& what) {
  for (size_t p = 0; p < Defs().size(); ++p) {
    const size_t n = Numel(Defs()[p]);
    std::vector<float> got(n, std::nanf(""));
    ASSERT_TRUE(rig.engine->GatherMasterParameter(rig.ids[p], got.data()).ok());
    // (A frozen tensor has no master: its value is its store's, bf16 with bf16 storage.)
    const ParamCopyType stored =
        Defs()[p].trainable ? ParamCopyType::kNone : StoredParamType(rig.engine->config());
    EXPECT_EQ(got, Expected(sim.master(p), n, stored))
        << what << ": master of '" << Defs()[p].name << "' differs from the simulation";
    EXPECT_EQ(rig.engine->param_updates(rig.ids[p]), sim.updates(p))
        << what << ": update count of '" << Defs()[p].name << "'";
  }
}

class SkipTest : public ::testing::TestWithParam<Placement> {};

TEST_P(SkipTest, ParametersWithoutGradientsAreSkippedLikeTorch) {
  const Placement pl = GetParam();
  Rig rig;
  ASSERT_TRUE(rig.dir.ok());
  ASSERT_TRUE(rig.Create(MakeConfig(pl, rig.dir.path())).ok());
  Simulation sim;
  for (int micro = 0; micro < kSteps * kAccum; ++micro) {
    MicroStep(rig, micro, pl, sim);
    if (::testing::Test::HasFatalFailure()) return;
    if ((micro + 1) % kAccum == 0) {
      sim.Step(micro / kAccum, pl.clip);
      // Right after Step (with the delayed update its optimizer may still run): the count
      // includes it.
      for (size_t p = 0; p < Defs().size(); ++p) {
        ASSERT_EQ(rig.engine->param_updates(rig.ids[p]), sim.updates(p)) << Defs()[p].name;
      }
    }
  }
  EXPECT_EQ(rig.engine->global_step(), kSteps);
  ExpectMasters(rig, sim, pl.Describe());
  // The simulation itself: "never" and "frozen" kept their initial values, the skipped ones
  // have fewer updates than the steps taken.
  EXPECT_EQ(sim.updates(3), 0);
  EXPECT_EQ(sim.updates(5), 0);
  EXPECT_EQ(sim.updates(1), kSteps - 2);  // a.bias: not in windows 1 and 3
  EXPECT_EQ(sim.updates(0), kSteps - 1);  // window 3 has no gradient at all
  EXPECT_EQ(sim.master(3), sim.version(0)[3]);
}

INSTANTIATE_TEST_SUITE_P(
    Placements, SkipTest,
    ::testing::Values(Placement{Tier::kCpu, Tier::kCpu}, Placement{Tier::kDevice, Tier::kCpu},
                      Placement{Tier::kNvme, Tier::kNvme},
                      Placement{Tier::kCpu, Tier::kNvme, 1.0, false, true},
                      Placement{Tier::kNvme, Tier::kNvme, 1.0, true, true},
                      Placement{Tier::kCpu, Tier::kCpu, 1.0, true, false, 0.5},
                      Placement{Tier::kDevice, Tier::kCpu, 0.5, false, true},
                      Placement{Tier::kDevice, Tier::kCpu, 0.5, true, true},
                      Placement{Tier::kDevice, Tier::kCpu, 0.5, true, false, 0.5},
                      Placement{Tier::kDevice, Tier::kDevice, 1.0, true, true}),
    PlacementName);

TEST(EngineSemanticsTest, FrozenParametersRefuseGradients) {
  Rig rig;
  ASSERT_TRUE(rig.Create(MakeConfig(Placement{}, rig.dir.path())).ok());
  ASSERT_FALSE(rig.engine->param(rig.ids[3]).trainable);
  ASSERT_TRUE(rig.engine->param(rig.ids[0]).trainable);
  ASSERT_TRUE(rig.engine->Acquire({rig.ids[3]}).ok());
  std::vector<float> g(Numel(Defs()[3]), 1.0f);
  Status s = rig.engine->ReduceGradient(rig.ids[3], g.data());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("'frozen'"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("frozen"), std::string::npos) << s.ToString();
}

TEST(EngineSemanticsTest, AWindowWithoutGradientsChangesNothingButCountsTheStep) {
  Rig rig;
  ASSERT_TRUE(rig.Create(MakeConfig(Placement{Tier::kNvme, Tier::kNvme}, rig.dir.path())).ok());
  for (int micro = 0; micro < kAccum; ++micro) {
    ASSERT_TRUE(rig.engine->Acquire(rig.ids).ok());
    ASSERT_TRUE(rig.engine->Release(rig.ids).ok());
    Result<StepStats> st = rig.engine->Step();
    ASSERT_TRUE(st.ok()) << st.status().ToString();
  }
  EXPECT_EQ(rig.engine->global_step(), 1);
  Simulation untouched;
  ExpectMasters(rig, untouched, "a window without gradients");
}

// Logs collected while alive.
class LogCapture {
 public:
  LogCapture() {
    previous_ = SetLogSink([this](LogLevel level, const std::string& line) {
      std::lock_guard<std::mutex> lock(mu_);
      if (level == LogLevel::kWarning) warnings_.push_back(line);
    });
  }
  ~LogCapture() { SetLogSink(previous_); }
  std::vector<std::string> warnings() {
    std::lock_guard<std::mutex> lock(mu_);
    return warnings_;
  }

 private:
  std::mutex mu_;
  std::vector<std::string> warnings_;
  LogSink previous_;
};

TEST(EngineSemanticsTest, InferenceAcquiresBetweenStepsLeaveTheTraceAndTheStepAlone) {
  for (bool delayed : {false, true}) {
    SCOPED_TRACE(delayed ? "delayed update" : "no delayed update");
    Placement pl{Tier::kNvme, Tier::kNvme};
    pl.delayed = delayed;
    Rig rig;
    EngineConfig config = MakeConfig(pl, rig.dir.path());
    config.gradient_accumulation_steps = 1;
    ASSERT_TRUE(rig.Create(config).ok());
    LogCapture logs;
    auto micro_step = [&](int micro) -> StepStats {
      // Layer by layer as a trainer does: prefetch has something to run ahead of.
      for (ParamId id : rig.ids) {
        EXPECT_TRUE(rig.engine->Acquire({id}).ok());
        EXPECT_TRUE(rig.engine->Release({id}).ok());
      }
      for (size_t p = 0; p < Defs().size(); ++p) {
        if (!Defs()[p].trainable) continue;
        std::vector<float> g(Numel(Defs()[p]));
        for (size_t i = 0; i < g.size(); ++i) g[i] = GradValue(p, micro, i);
        EXPECT_TRUE(rig.engine->ReduceGradient(rig.ids[p], g.data()).ok());
      }
      Result<StepStats> st = rig.engine->Step();
      EXPECT_TRUE(st.ok()) << st.status().ToString();
      return st.ok() ? *st : StepStats{};
    };
    micro_step(0);  // records the trace
    // An evaluation pass between steps, in another order, twice.
    for (int pass = 0; pass < 2; ++pass) {
      for (size_t k = rig.ids.size(); k-- > 0;) {
        Result<std::vector<void*>> p = rig.engine->Acquire({rig.ids[k]}, AcquireMode::kInference);
        ASSERT_TRUE(p.ok()) << p.status().ToString();
        ASSERT_TRUE(rig.engine->Release({rig.ids[k]}).ok());
      }
    }
    // Still between steps: a checkpoint may be saved.
    Status saved = rig.engine->SaveCheckpoint(rig.dir.path() + "/ckpt");
    EXPECT_TRUE(saved.ok()) << saved.ToString();
    StepStats next = micro_step(1);
    EXPECT_TRUE(next.trace_valid);
    EXPECT_GT(next.prefetch_hits, 0u);
    for (const std::string& w : logs.warnings()) {
      EXPECT_EQ(w.find("trace"), std::string::npos) << "unexpected warning: " << w;
    }
    // Between a boundary micro-step's first gradient and its Step the optimizer may be
    // rewriting parameters: an inference acquire is refused then (a training one is not).
    ASSERT_TRUE(rig.engine->Acquire({rig.ids[0]}).ok());
    ASSERT_TRUE(rig.engine->Release({rig.ids[0]}).ok());
    std::vector<float> g0(Numel(Defs()[0]), 0.5f);
    ASSERT_TRUE(rig.engine->ReduceGradient(rig.ids[0], g0.data()).ok());
    Result<std::vector<void*>> early = rig.engine->Acquire({rig.ids[2]}, AcquireMode::kInference);
    ASSERT_FALSE(early.ok());
    EXPECT_EQ(early.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(early.status().message().find("between optimizer steps"), std::string::npos);
    ASSERT_TRUE(rig.engine->Step().ok());
    ASSERT_TRUE(rig.engine->Acquire({rig.ids[2]}, AcquireMode::kInference).ok());
    ASSERT_TRUE(rig.engine->Release({rig.ids[2]}).ok());
    // A training acquire in another order does invalidate it, with a warning.
    ASSERT_TRUE(rig.engine->Acquire({rig.ids.back()}).ok());
    ASSERT_TRUE(rig.engine->Release({rig.ids.back()}).ok());
    bool warned = false;
    for (const std::string& w : logs.warnings())
      warned |= w.find("trace invalidated") != std::string::npos;
    EXPECT_TRUE(warned);
  }
}

TEST(EngineSemanticsTest, AParameterHeldAcrossAnUpdateIsRefusedNotSilentlyRefetched) {
  Placement pl{Tier::kCpu, Tier::kCpu};
  Rig rig;
  EngineConfig config = MakeConfig(pl, rig.dir.path());
  config.gradient_accumulation_steps = 1;
  ASSERT_TRUE(rig.Create(config).ok());
  ASSERT_TRUE(rig.engine->Acquire(rig.ids).ok());
  for (size_t p = 0; p < Defs().size(); ++p) {
    if (!Defs()[p].trainable) continue;
    std::vector<float> g(Numel(Defs()[p]), 0.25f);
    ASSERT_TRUE(rig.engine->ReduceGradient(rig.ids[p], g.data()).ok());
  }
  // a.weight is still acquired (the trainer forgot it); the step changes it.
  ASSERT_TRUE(rig.engine->Release({rig.ids.begin() + 1, rig.ids.end()}).ok());
  ASSERT_TRUE(rig.engine->Step().ok());
  Result<std::vector<void*>> again = rig.engine->Acquire({rig.ids[0]});
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(again.status().message().find("'a.weight'"), std::string::npos);
  ASSERT_TRUE(rig.engine->Release({rig.ids[0]}).ok());
  EXPECT_TRUE(rig.engine->Acquire({rig.ids[0]}).ok());
}

TEST(EngineSemanticsTest, AFailedAcquireKeepsNoneOfItsParametersAcquired) {
  Placement pl{Tier::kCpu, Tier::kCpu};
  pl.delayed = true;
  Rig rig;
  EngineConfig config = MakeConfig(pl, rig.dir.path());
  config.gradient_accumulation_steps = 1;
  ASSERT_TRUE(rig.Create(config).ok());
  ASSERT_TRUE(rig.engine->Acquire({rig.ids[0]}).ok());
  ASSERT_TRUE(rig.engine->Release({rig.ids[0]}).ok());
  std::vector<float> g(Numel(Defs()[0]), 0.5f);
  ASSERT_TRUE(rig.engine->ReduceGradient(rig.ids[0], g.data()).ok());
  // a.bias is acquired first, then a.weight is refused (after its ReduceGradient with the
  // delayed update): a.bias must not stay acquired.
  Result<std::vector<void*>> r = rig.engine->Acquire({rig.ids[1], rig.ids[0]});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("'a.weight'"), std::string::npos);
  ASSERT_TRUE(rig.engine->Step().ok());
  Status saved = rig.engine->SaveCheckpoint(rig.dir.path() + "/ckpt");
  EXPECT_TRUE(saved.ok()) << saved.ToString();
}

// A rig whose pinned budget is the smallest that places the model with one tensor per
// sub-group and streaming accumulators: it leaves two gradient blocks.
void MakeTightRig(Rig* rig, std::shared_ptr<FaultPlan> plan) {
  EngineConfig config = MakeConfig(Placement{Tier::kCpu, Tier::kNvme}, rig->dir.path());
  config.gradient_accumulation_steps = 1;
  config.sub_group_size = 2048;  // one tensor per sub-group
  HostDeviceOptions ho;
  ho.memory_budget = 64ull << 20;
  rig->device = NewHostDevice(ho);
  rig->comms = std::move(NewLocalComms({rig->device.get()})).value();
  auto places = [&](uint64_t b) {
    EngineConfig c = config;
    c.pinned_budget_bytes = b;
    auto e = std::move(Engine::Create(c, rig->device.get(), rig->comms[0].get())).value();
    std::vector<ParamId> ids;
    return RegisterDefs(e.get(), &ids).ok() && e->FinishRegistration().ok();
  };
  uint64_t lo = 4096, budget = 4ull << 20;  // bisection: places at `budget`, not at `lo`
  ASSERT_TRUE(places(budget));
  while (budget - lo > 4096) {
    const uint64_t mid = (lo + budget) / 2 / 4096 * 4096;
    (places(mid) ? budget : lo) = mid;
  }
  config.pinned_budget_bytes = budget;
  EngineHooks hooks;
  hooks.fault_plan = std::move(plan);
  rig->engine =
      std::move(Engine::Create(config, rig->device.get(), rig->comms[0].get(), hooks)).value();
  ASSERT_TRUE(RegisterDefs(rig->engine.get(), &rig->ids).ok());
  ASSERT_TRUE(rig->engine->FinishRegistration().ok());
}

// Hands in the gradients of the trainable tensors in `order`, then Steps; the first error.
Status HandIn(Rig& rig, const std::vector<size_t>& order) {
  ZINF_RETURN_IF_ERROR(rig.engine->Acquire(rig.ids).status());
  ZINF_RETURN_IF_ERROR(rig.engine->Release(rig.ids));
  for (size_t k : order) {
    std::vector<float> g(Numel(Defs()[k]), 0.25f);
    ZINF_RETURN_IF_ERROR(rig.engine->ReduceGradient(rig.ids[k], g.data()));
  }
  return rig.engine->Step().status();
}

TEST(EngineSemanticsTest, AFrozenSubGroupDoesNotStallStreamingAccumulators) {
  // The frozen tensor's sub-group lies between trainable ones in the optimizer's order; it
  // never gets a gradient, so it must not count as waiting for one (it used to, until Step:
  // with two blocks the backward then waited 300 s for one).
  Rig rig;
  MakeTightRig(&rig, nullptr);
  if (::testing::Test::HasFatalFailure()) return;
  auto t0 = std::chrono::steady_clock::now();
  for (int step = 0; step < 3; ++step) {
    Status s = HandIn(rig, {5, 4, 2, 1, 0});  // the backward order; 3 is frozen
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
  EXPECT_EQ(rig.engine->param_updates(rig.ids[0]), 3);
  EXPECT_EQ(rig.engine->param_updates(rig.ids[3]), 0);
}

TEST(EngineSemanticsTest, GradientsInAnOrderTheBlocksCannotHoldAreOneClearErrorNotAWait) {
  // In registration order instead of the reverse: the optimizer waits for the last sub-group
  // while both blocks hold the first ones. That cannot resolve; it is reported at once.
  Rig rig;
  MakeTightRig(&rig, nullptr);
  if (::testing::Test::HasFatalFailure()) return;
  auto t0 = std::chrono::steady_clock::now();
  Status s = HandIn(rig, {0, 1, 2, 4, 5});
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
  ASSERT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  EXPECT_NE(s.message().find("'never'"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("zinf.pinned_budget_bytes"), std::string::npos) << s.ToString();
}

TEST(EngineSemanticsTest, AnOptimizerFailureReachesTheBackwardPromptly) {
  auto plan = std::make_shared<FaultPlan>();
  Rig rig;
  MakeTightRig(&rig, plan);
  if (::testing::Test::HasFatalFailure()) return;
  IoFault fault;  // from now on: the optimizer's state reads
  fault.count = 1000;
  fault.any_op = false;
  fault.op = IoOp::kRead;
  plan->AddAhead(fault, 0);
  auto t0 = std::chrono::steady_clock::now();
  Status s = HandIn(rig, {5, 4, 2, 1, 0});
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
  EXPECT_EQ(s.code(), StatusCode::kIoError) << s.ToString();
  EXPECT_NE(s.message().find("optimizer states"), std::string::npos) << s.ToString();
}

float LoadedValue(ParamId p, size_t i) {
  return 1.0f + 0.001f * static_cast<float>((p * 7 + i) % 997);
}

TEST(EngineSemanticsTest, SetParameterValuesReplacesValuesOnEveryTier) {
  const std::vector<Placement> placements = {{Tier::kCpu, Tier::kCpu},
                                             {Tier::kNvme, Tier::kNvme, 1.0, true, true},
                                             {Tier::kDevice, Tier::kCpu, 0.5, false, true}};
  for (const Placement& pl : placements) {
    SCOPED_TRACE(pl.Describe());
    Rig rig;
    ASSERT_TRUE(rig.Create(MakeConfig(pl, rig.dir.path())).ok());
    // Tensors 0, 2 and 4 (sub-groups 0, 1 and 2) get new values; the others keep theirs.
    const std::vector<size_t> chosen = {4, 0, 2};
    std::vector<ParamId> ids;
    for (size_t p : chosen) ids.push_back(rig.ids[p]);
    std::vector<ParamId> filled;
    Status s = rig.engine->SetParameterValues(ids, [&](ParamId id, float* data) {
      filled.push_back(id);
      for (size_t i = 0; i < rig.engine->param(id).numel; ++i) data[i] = LoadedValue(id, i);
      return Status::OK();
    });
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(filled, (std::vector<ParamId>{rig.ids[0], rig.ids[2], rig.ids[4]}))
        << "visited in sub-group order";
    std::vector<std::vector<float>> expect;
    for (size_t p = 0; p < Defs().size(); ++p) {
      std::vector<float> v(Numel(Defs()[p]));
      const bool loaded = p == 0 || p == 2 || p == 4;
      for (size_t i = 0; i < v.size(); ++i)
        v[i] = loaded ? LoadedValue(rig.ids[p], i) : InitValue(p, i);
      std::vector<float> got(v.size());
      ASSERT_TRUE(rig.engine->GatherMasterParameter(rig.ids[p], got.data()).ok());
      // (A frozen tensor has no master: its value is its store's, bf16 with bf16 storage.)
      EXPECT_EQ(got,
                Expected(v, v.size(), Defs()[p].trainable ? ParamCopyType::kNone : pl.stored()))
          << "master of " << Defs()[p].name;
      expect.push_back(v);
    }
    CheckAcquired(rig, expect, pl.stored(), AcquireMode::kTraining, "after SetParameterValues");
  }
}

TEST(EngineSemanticsTest, SetParameterValuesRefusalsAndAFailingSource) {
  Rig rig;
  ASSERT_TRUE(rig.Create(MakeConfig(Placement{Tier::kCpu, Tier::kNvme}, rig.dir.path())).ok());
  auto ok_fill = [](ParamId, float*) { return Status::OK(); };
  EXPECT_EQ(rig.engine->SetParameterValues({rig.ids[0], rig.ids[0]}, ok_fill).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(rig.engine->SetParameterValues({999}, ok_fill).code(), StatusCode::kInvalidArgument);
  // Inside a micro-step: refused like a checkpoint load.
  ASSERT_TRUE(rig.engine->Acquire({rig.ids[0]}).ok());
  EXPECT_EQ(rig.engine->SetParameterValues({rig.ids[0]}, ok_fill).code(),
            StatusCode::kFailedPrecondition);
  ASSERT_TRUE(rig.engine->Release({rig.ids[0]}).ok());
  ASSERT_TRUE(rig.engine->Step().ok());
  ASSERT_TRUE(rig.engine->Step().ok());  // the window's end: between steps again
  // A source failing in the second sub-group: the error names the tensor, and the engine
  // refuses to go on (the first sub-group already holds new values).
  Status s = rig.engine->SetParameterValues({rig.ids[0], rig.ids[2]}, [&](ParamId id, float* d) {
    if (id == rig.ids[2]) return Status::IoError("disk on fire");
    d[0] = 42.0f;
    return Status::OK();
  });
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find("'b.weight'"), std::string::npos) << s.ToString();
  EXPECT_FALSE(rig.engine->Acquire({rig.ids[0]}).ok());
}

// Per-parameter update counts survive a checkpoint and a durable resume: the resumed run
// continues bit-identical to the simulation (which differs from a global step count).
TEST(EngineSemanticsTest, UpdateCountsSurviveCheckpointsAndDurableResumes) {
  for (bool durable : {false, true}) {
    SCOPED_TRACE(durable ? "durable resume" : "checkpoint");
    Placement pl{Tier::kCpu, Tier::kNvme};
    TempDir dir;
    EngineConfig config = MakeConfig(pl, dir.path());
    config.durable = durable;
    Simulation sim;
    const int split = 3;  // windows before the restart
    {
      Rig rig;
      ASSERT_TRUE(rig.Create(config).ok());
      for (int micro = 0; micro < split * kAccum; ++micro) {
        MicroStep(rig, micro, pl, sim);
        if (::testing::Test::HasFatalFailure()) return;
        if ((micro + 1) % kAccum == 0) sim.Step(micro / kAccum, 0.0);
      }
      if (!durable) {
        ASSERT_TRUE(rig.engine->SaveCheckpoint(dir.path() + "/ckpt").ok());
      }
    }
    Rig rig;
    ASSERT_TRUE(rig.Create(config, /*finish=*/false).ok());
    if (durable) {
      Status s = rig.engine->ResumeFromStore();
      ASSERT_TRUE(s.ok()) << s.ToString();
    } else {
      ASSERT_TRUE(rig.engine->FinishRegistration().ok());
      Status s = rig.engine->LoadCheckpoint(dir.path() + "/ckpt");
      ASSERT_TRUE(s.ok()) << s.ToString();
    }
    ASSERT_EQ(rig.engine->global_step(), split);
    EXPECT_EQ(rig.engine->param_updates(rig.ids[1]), sim.updates(1));
    for (int micro = split * kAccum; micro < kSteps * kAccum; ++micro) {
      MicroStep(rig, micro, pl, sim);
      if (::testing::Test::HasFatalFailure()) return;
      if ((micro + 1) % kAccum == 0) sim.Step(micro / kAccum, 0.0);
    }
    ExpectMasters(rig, sim, durable ? "after a durable resume" : "after a checkpoint load");
  }
}

// ---- Checkpoint folders: damage is never "no checkpoint yet" ----------------------------------

// Trains `windows` optimizer steps from `first_window`, saving a checkpoint after each.
void TrainAndSave(Rig& rig, int first_window, int windows, const std::string& ckpt) {
  Simulation unused;
  for (int w = first_window; w < first_window + windows; ++w) {
    for (int k = 0; k < kAccum; ++k) {
      ASSERT_TRUE(rig.engine->Acquire(rig.ids).ok());
      ASSERT_TRUE(rig.engine->Release(rig.ids).ok());
      for (size_t p = 0; p < Defs().size(); ++p) {
        if (!Defs()[p].trainable) continue;
        std::vector<float> g(Numel(Defs()[p]));
        for (size_t i = 0; i < g.size(); ++i) g[i] = GradValue(p, w * kAccum + k, i);
        ASSERT_TRUE(rig.engine->ReduceGradient(rig.ids[p], g.data()).ok());
      }
      ASSERT_TRUE(rig.engine->Step().ok());
    }
    Status s = rig.engine->SaveCheckpoint(ckpt, "window " + std::to_string(w));
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
}

std::string ReadLatest(const std::string& ckpt) {
  std::ifstream f(ckpt + "/latest");
  std::string name;
  f >> name;
  return name;
}

class CheckpointDamage : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dir.ok());
    ckpt = dir.path() + "/ckpt";
    Rig writer;
    ASSERT_TRUE(writer.Create(MakeConfig(Placement{}, dir.path())).ok());
    TrainAndSave(writer, 0, 3, ckpt);  // step-1, step-2, step-3; pruning keeps 2 and 3
    newest = ReadLatest(ckpt);
    ASSERT_EQ(newest, "step-000000003");
  }
  // A fresh engine's attempt to load; its global step after.
  Status Load(bool fallback, std::string* user = nullptr, int64_t* step = nullptr) {
    Rig reader;
    Status s = reader.Create(MakeConfig(Placement{}, dir.path()));
    if (s.ok()) s = reader.engine->LoadCheckpoint(ckpt, user, fallback);
    if (step != nullptr) *step = reader.engine ? reader.engine->global_step() : -1;
    return s;
  }
  TempDir dir;
  std::string ckpt, newest;
};

TEST_F(CheckpointDamage, AMissingLatestLoadsTheNewestCompleteCheckpointWithAWarning) {
  ASSERT_EQ(unlink((ckpt + "/latest").c_str()), 0);
  LogCapture logs;
  std::string user;
  int64_t step = 0;
  Status s = Load(false, &user, &step);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(user, "window 2");
  EXPECT_EQ(step, 3);
  bool warned = false;
  for (const std::string& w : logs.warnings())
    warned |= w.find("latest is missing") != std::string::npos;
  EXPECT_TRUE(warned);
}

TEST_F(CheckpointDamage, AMissingPieceOfTheNewestIsAnErrorNamingItNotAFreshStart) {
  const std::vector<std::pair<std::string, std::string>> pieces = {
      {ckpt + "/" + newest + "/rank0.states", "rank0.states"},
      {ckpt + "/" + newest + "/rank0.json", "rank0.json"}};
  for (const auto& [path, name] : pieces) {
    SCOPED_TRACE(name);
    const std::string aside = path + ".aside";
    ASSERT_EQ(rename(path.c_str(), aside.c_str()), 0);
    Status s = Load(false);
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.ToString();
    EXPECT_NE(s.message().find(name), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find("damaged"), std::string::npos) << s.ToString();
    // Allowed to fall back: the one before, with a warning.
    LogCapture logs;
    std::string user;
    int64_t step = 0;
    s = Load(true, &user, &step);
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(user, "window 1");
    EXPECT_EQ(step, 2);
    EXPECT_FALSE(logs.warnings().empty());
    ASSERT_EQ(rename(aside.c_str(), path.c_str()), 0);
  }
  // The folder `latest` names, gone: damage too.
  ASSERT_EQ(rename((ckpt + "/" + newest).c_str(), (dir.path() + "/moved").c_str()), 0);
  Status s = Load(false);
  EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.ToString();
}

TEST_F(CheckpointDamage, AnEditedManifestIsRefusedByItsChecksum) {
  const std::string man = ckpt + "/" + newest + "/rank0.json";
  std::string text;
  {
    std::ifstream f(man);
    text.assign(std::istreambuf_iterator<char>(f), {});
  }
  const size_t at = text.find("\"step\": 3");
  ASSERT_NE(at, std::string::npos) << text.substr(0, 300);
  text.replace(at, 9, "\"step\": 9");
  std::ofstream(man, std::ios::trunc) << text;
  Status s = Load(false);
  EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.ToString();
  EXPECT_NE(s.message().find("checksum"), std::string::npos) << s.ToString();
}

// The bytes installed are the bytes verified: a states file that changes after the
// validation pass (another process, a disk returning other data) is caught by the read that
// installs it, never installed unverified.
TEST_F(CheckpointDamage, DataChangedAfterValidationIsNotInstalled) {
  EngineHooks hooks;
  bool flipped = false;
  hooks.checkpoint_validated = [&](const std::string& folder) {
    const std::string states = folder + "/rank0.states";
    std::fstream f(states, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(100);
    char c = 0;
    f.get(c);
    f.seekp(100);
    f.put(static_cast<char>(c ^ 0x5a));
    flipped = f.good();
  };
  Rig reader;
  ASSERT_TRUE(reader.Create(MakeConfig(Placement{}, dir.path()), true, hooks).ok());
  Status s = reader.engine->LoadCheckpoint(ckpt);
  ASSERT_TRUE(flipped);
  EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.ToString();
  EXPECT_NE(s.message().find("does not match its checksum"), std::string::npos) << s.ToString();
  // Installing had begun: the engine refuses to train on states it may hold in part.
  EXPECT_FALSE(reader.engine->Acquire(reader.ids).ok());
}

// `latest` carries a checksum of the name it holds: a changed digit naming another (older)
// checkpoint is damage, not a silent load of an older step.
TEST_F(CheckpointDamage, AnEditedLatestIsDamageNotAnOlderCheckpoint) {
  std::string text;
  {
    std::ifstream f(ckpt + "/latest");
    text.assign(std::istreambuf_iterator<char>(f), {});
  }
  ASSERT_EQ(text.rfind("step-000000003\nxxh3 ", 0), 0u) << text;
  text[13] = '2';  // names step-000000002, which exists
  std::ofstream(ckpt + "/latest", std::ios::trunc) << text;
  // Damaged `latest`: the newest complete checkpoint loads (step 3, as a missing `latest`
  // does), with a warning naming the damage; before the checksum it loaded step 2 silently.
  LogCapture logs;
  int64_t step = 0;
  Status s = Load(false, nullptr, &step);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(step, 3);
  bool warned = false;
  for (const std::string& w : logs.warnings()) {
    warned |= w.find("latest does not match its own checksum") != std::string::npos;
  }
  EXPECT_TRUE(warned);
}

// Only what zinf wrote is a checkpoint: a user's folder named like one (without zinf's mark or
// manifest) and files named step-* are never listed, pruned or removed.
TEST_F(CheckpointDamage, OnlyWhatZinfWroteIsListedPrunedOrRemoved) {
  ASSERT_EQ(mkdir((ckpt + "/step-000000001").c_str(), 0700), 0);  // pruned earlier: the user's now
  std::ofstream(ckpt + "/step-000000001/notes.txt") << "mine";
  std::ofstream(ckpt + "/step-notes.txt") << "mine too";
  ASSERT_EQ(mkdir((ckpt + "/step-7").c_str(), 0700), 0);
  Result<std::vector<std::string>> listed = Engine::ListCheckpoints(ckpt);
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  EXPECT_EQ(*listed, (std::vector<std::string>{"latest", "step-000000003", "step-000000002"}));
  Rig again;
  ASSERT_TRUE(again.Create(MakeConfig(Placement{}, dir.path())).ok());
  TrainAndSave(again, 0, 2, ckpt);  // two more saves prune the zinf checkpoints before them
  EXPECT_TRUE(std::filesystem::exists(ckpt + "/step-000000001/notes.txt"));
  EXPECT_TRUE(std::filesystem::exists(ckpt + "/step-notes.txt"));
  EXPECT_TRUE(std::filesystem::exists(ckpt + "/step-7"));
  ASSERT_TRUE(again.engine->PrepareCheckpointDir(ckpt).ok());
  ASSERT_TRUE(again.engine->RemoveCheckpoints(ckpt).ok());
  listed = Engine::ListCheckpoints(ckpt);
  ASSERT_TRUE(listed.ok());
  EXPECT_TRUE(listed->empty()) << (*listed)[0];
  EXPECT_TRUE(std::filesystem::exists(ckpt + "/step-000000001/notes.txt"));
  EXPECT_TRUE(std::filesystem::exists(ckpt + "/step-notes.txt"));
  EXPECT_TRUE(std::filesystem::exists(ckpt + "/step-7"));
  // Removing needs the folder's lock: an engine that did not prepare it is refused.
  Rig other;
  ASSERT_TRUE(other.Create(MakeConfig(Placement{}, dir.path())).ok());
  EXPECT_EQ(other.engine->RemoveCheckpoints(ckpt).code(), StatusCode::kFailedPrecondition);
}

// Running out of file descriptors is said as such, not as a folder that is not writable.
TEST_F(CheckpointDamage, ADescriptorLimitIsNotCalledAReadOnlyFolder) {
  Rig rig;
  ASSERT_TRUE(rig.Create(MakeConfig(Placement{}, dir.path())).ok());
  struct rlimit old {};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &old), 0);
  int highest = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    highest = std::max(highest, std::atoi(e.path().filename().c_str()));
  }
  struct rlimit low = old;
  low.rlim_cur = static_cast<rlim_t>(highest + 8);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  std::vector<int> filler;  // every descriptor number below the limit taken
  for (int fd; (fd = dup(0)) >= 0;) filler.push_back(fd);
  Status s = rig.engine->PrepareCheckpointDir(dir.path() + "/fresh");
  for (int fd : filler) close(fd);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &old), 0);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.message().find("not writable"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("too many open files"), std::string::npos) << s.ToString();
}

TEST_F(CheckpointDamage, PruningKeepsTheNewestReadableCheckpoint) {
  // `latest` lost and the newest folder damaged: a new save must not remove step-2, the
  // newest readable checkpoint before it (it used to remove every step folder but the new one
  // when `latest` could not be read).
  ASSERT_EQ(unlink((ckpt + "/latest").c_str()), 0);
  ASSERT_EQ(unlink((ckpt + "/" + newest + "/rank0.states").c_str()), 0);
  Rig again;
  ASSERT_TRUE(again.Create(MakeConfig(Placement{}, dir.path())).ok());
  TrainAndSave(again, 0, 1, ckpt);  // a new step-1 (as step-000000001.1)
  EXPECT_TRUE(std::filesystem::exists(ckpt + "/step-000000002/rank0.json"));
  EXPECT_TRUE(std::filesystem::exists(ckpt + "/" + newest)) << "damaged and newer: kept";
}

TEST_F(CheckpointDamage, AnEmptyOrMissingFolderIsNoCheckpointYet) {
  ckpt = dir.path() + "/empty";
  ASSERT_EQ(mkdir(ckpt.c_str(), 0700), 0);
  EXPECT_EQ(Load(false).code(), StatusCode::kNotFound);
  ckpt = dir.path() + "/absent";
  EXPECT_EQ(Load(false).code(), StatusCode::kNotFound);
}

TEST(CheckpointFolder, LockedAgainstASecondWriterCreated0700AndNoLinkFollowed) {
  TempDir dir;
  const std::string ckpt = dir.path() + "/a/b";
  Rig first, second;
  ASSERT_TRUE(first.Create(MakeConfig(Placement{}, dir.path())).ok());
  ASSERT_TRUE(second.Create(MakeConfig(Placement{}, dir.path())).ok());
  ASSERT_TRUE(first.engine->PrepareCheckpointDir(ckpt).ok());
  struct stat st {};
  ASSERT_EQ(stat((dir.path() + "/a").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  Status s = second.engine->SaveCheckpoint(ckpt);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("in use by pid"), std::string::npos) << s.ToString();
  s = second.engine->LoadCheckpoint(ckpt);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << "a reader waits for the writer";
  // A link planted as latest.tmp is replaced, not followed.
  const std::string victim = dir.path() + "/victim";
  std::ofstream(victim) << "precious";
  ASSERT_EQ(symlink(victim.c_str(), (ckpt + "/latest.tmp").c_str()), 0);
  ASSERT_TRUE(first.engine->SaveCheckpoint(ckpt).ok());
  std::string text;
  std::ifstream(victim) >> text;
  EXPECT_EQ(text, "precious");
  EXPECT_EQ(ReadLatest(ckpt), "step-000000000");
  // Not writable: refused before training, naming the folder.
  if (geteuid() != 0) {
    const std::string ro = dir.path() + "/ro";
    ASSERT_EQ(mkdir(ro.c_str(), 0500), 0);
    s = second.engine->PrepareCheckpointDir(ro);
    EXPECT_NE(s.message().find("not writable"), std::string::npos) << s.ToString();
  }
  // Not valid UTF-8: refused, nothing aborts.
  EXPECT_EQ(first.engine->SaveCheckpoint(ckpt, std::string("\xff\xfe", 2)).code(),
            StatusCode::kInvalidArgument);
}

// The ZeRO++ settings without effect are warned about at Engine::Create, naming the key and
// what it needs: zinf.quantization_block_size and zinf.quantized_gradient_bits with no quantized
// collective on; with one on, not a word about them.
TEST(EngineSemanticsTest, QuantizationKeysWithoutEffectAreWarnedAbout) {
  TempDir dir;
  HostDeviceOptions ho;
  ho.memory_budget = 16 << 20;
  std::unique_ptr<Device> device = NewHostDevice(ho);
  auto comms = std::move(NewLocalComms({device.get()})).value();
  auto warnings_for = [&](bool quantized) {
    EngineConfig c = MakeConfig(Placement{}, dir.path());
    c.quantization_block_size = 64;
    c.quantized_gradient_bits = 4;
    c.quantized_gradients = quantized;
    LogCapture logs;
    Result<std::unique_ptr<Engine>> e = Engine::Create(c, device.get(), comms[0].get());
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    std::string all;
    for (const std::string& w : logs.warnings()) all += w + "\n";
    return all;
  };
  const std::string off = warnings_for(false);
  EXPECT_NE(off.find("zinf.quantization_block_size 64: no effect without "
                     "zero_optimization.zero_quantized_weights"),
            std::string::npos)
      << off;
  EXPECT_NE(off.find("zinf.quantized_gradient_bits 4: no effect"), std::string::npos) << off;
  const std::string on = warnings_for(true);
  EXPECT_EQ(on.find("quantization_block_size"), std::string::npos) << on;
  EXPECT_EQ(on.find("quantized_gradient_bits"), std::string::npos) << on;
}

TEST(EngineRegistration, DuplicateNamesOverflowingShapesAndBadNamesAreRefused) {
  TempDir dir;
  HostDeviceOptions ho;
  ho.memory_budget = 16 << 20;
  std::unique_ptr<Device> device = NewHostDevice(ho);
  auto comms = std::move(NewLocalComms({device.get()})).value();
  auto engine =
      std::move(Engine::Create(MakeConfig(Placement{}, dir.path()), device.get(), comms[0].get()))
          .value();
  ParamSpec spec;
  spec.name = "w";
  spec.shape = {4};
  spec.init = [](float* d, size_t n) { std::fill(d, d + n, 1.0f); };
  ASSERT_TRUE(engine->RegisterParameter(spec).ok());
  Result<ParamId> again = engine->RegisterParameter(spec);
  EXPECT_EQ(again.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(again.status().message().find("registered twice"), std::string::npos);
  spec.name = "huge";
  spec.shape = {int64_t{1} << 40, int64_t{1} << 40};
  EXPECT_EQ(engine->RegisterParameter(spec).status().code(), StatusCode::kInvalidArgument);
  spec.name = std::string("bad\xc3", 4);
  spec.shape = {4};
  EXPECT_EQ(engine->RegisterParameter(spec).status().code(), StatusCode::kInvalidArgument);
}

// The last sub-groups of an undelayed step reach the device piece by piece as they are
// stepped (OptimizerPipeline::StepGroup, upload_pieces), and a sub-group's large last gradient
// is stepped as its pieces land (GradientWindow's inline copy, GroupBoard::LandPiece): what the
// trainer reads after each step is the masters (rounded to bf16 with bf16 parameters), and the
// masters are those of the same steps without either, bit for bit: with fp32 and int8 states,
// and speculating. A non-finite value in a landing gradient's last piece fails the step.
TEST(EngineUpload, PiecesUploadedAndLandedGiveTheMastersOfWholeSteps) {
  // "x" spans the 8 pieces a parameter is cut into (64 Ki-element tiles, the last piece
  // partial) and is a sub-group of its own; "y" and "z" share one, stepped first (backward
  // order). Gradients are reduced in backward order (z, y, x), so the landing "y" is the
  // first parameter of its group and is stepped after "z".
  const std::vector<std::pair<std::string, int64_t>> defs = {
      {"x", 1000003}, {"y", 300001}, {"z", 200003}};
  struct Case {
    bool bf16;
    StateType states;
    double clip;  // 1e-3: below the gradients' norm, so every step rescales
    SpeculativeStep speculative;
  };
  // The masters after the run (`nan_step` >= 0: the last element of y's gradient is NaN in
  // that step, which must fail), with the parameters on `tier`, on the strict host device or
  // not; the sub-groups stepped while landing.
  auto run = [&](const Case& c, Tier tier, bool strict, int nan_step,
                 std::vector<std::vector<float>>* masters, uint64_t* landing) {
    HostDeviceOptions ho;
    ho.memory_budget = 256ull << 20;
    ho.strict = strict;
    ho.strict_seed = 0x5EED;
    // A slow link (0.2 GB/s: the 4 MB of "x" in 20 ms): the optimizer starts on a gradient's
    // first pieces well before its last have landed.
    ho.copy_gbps = 0.2;
    std::unique_ptr<Device> device = NewHostDevice(ho);
    Result<std::vector<std::unique_ptr<Communicator>>> comms = NewLocalComms({device.get()});
    ASSERT_TRUE(comms.ok()) << comms.status().ToString();
    EngineConfig config;
    config.offload_param.tier = tier;
    config.offload_optimizer.tier = Tier::kCpu;
    config.sub_group_size = 1100000;
    config.param_persistence_threshold = 0;
    config.optimizer.type = OptimizerType::kAdamW;
    config.optimizer.lr = 1e-2f;
    config.optimizer.weight_decay = 0.1f;
    config.optimizer_state_type = c.states;
    config.bf16 = c.bf16;
    config.gradient_clipping = c.clip;
    config.speculative_step = c.speculative;
    config.pinned_budget_bytes = 128ull << 20;
    config.optimizer_threads = 1;  // (as every engine test: TSan cannot see inside oneTBB)
    Result<std::unique_ptr<Engine>> engine =
        Engine::Create(config, device.get(), (*comms)[0].get());
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    Engine& e = **engine;
    std::vector<ParamId> ids;
    for (size_t p = 0; p < defs.size(); ++p) {
      ParamSpec spec;
      spec.name = defs[p].first;
      spec.shape = {defs[p].second};
      spec.init = [p](float* data, size_t n) {
        for (size_t i = 0; i < n; ++i) data[i] = InitValue(p, i);
      };
      Result<ParamId> id = e.RegisterParameter(spec);
      ASSERT_TRUE(id.ok()) << id.status().ToString();
      ids.push_back(*id);
    }
    ASSERT_TRUE(e.FinishRegistration().ok());
    masters->assign(defs.size(), {});
    *landing = 0;
    // Step k's forward reads (and checks) what step k - 1 left; the last pass only reads.
    for (int step = 0; step <= 3; ++step) {
      Result<std::vector<void*>> ptrs = e.Acquire(ids);
      ASSERT_TRUE(ptrs.ok()) << ptrs.status().ToString();
      // (Strict: the compute stream runs behind; a kernel would see what it sees then.)
      ASSERT_TRUE(device->SynchronizeStream(device->ComputeStream()).ok());
      for (size_t p = 0; p < defs.size() && step > 0 && tier == Tier::kDevice; ++p) {
        const std::vector<float>& m = (*masters)[p];
        // (The host device's memory is the host's: the trainer's pointer reads it.)
        for (size_t i = 0; i < m.size(); ++i) {
          const float got = c.bf16 ? Bf16ToFp32(static_cast<const uint16_t*>((*ptrs)[p])[i])
                                   : static_cast<const float*>((*ptrs)[p])[i];
          const float want = c.bf16 ? Bf16ToFp32(Fp32ToBf16(m[i])) : m[i];
          ASSERT_EQ(std::memcmp(&got, &want, sizeof(float)), 0)
              << "after step " << step - 1 << ": '" << defs[p].first << "' element " << i
              << " on the device is not its master";
        }
      }
      ASSERT_TRUE(e.Release(ids).ok());
      if (step == 3) break;
      for (size_t p = defs.size(); p-- > 0;) {
        std::vector<float> g(static_cast<size_t>(defs[p].second));
        for (size_t i = 0; i < g.size(); ++i) g[i] = GradValue(p, step, i);
        if (step == nan_step && defs[p].first == "y") g.back() = std::nanf("");
        ASSERT_TRUE(e.ReduceGradient(ids[p], g.data()).ok());
        // (Strict: the copy out of `g` runs on the compute stream, behind the host.)
        ASSERT_TRUE(device->SynchronizeStream(device->ComputeStream()).ok());
      }
      Result<StepStats> st = e.Step();
      if (step == nan_step) {
        ASSERT_FALSE(st.ok());
        EXPECT_NE(st.status().message().find(c.clip > 0 ? "norm" : "'y'"), std::string::npos)
            << st.status().ToString();
        return;
      }
      ASSERT_TRUE(st.ok()) << st.status().ToString();
      *landing += st->landing_groups;
      for (size_t p = 0; p < defs.size(); ++p) {
        (*masters)[p].resize(static_cast<size_t>(defs[p].second));
        ASSERT_TRUE(e.GatherMasterParameter(ids[p], (*masters)[p].data()).ok());
      }
    }
  };
  const Case cases[] = {{false, StateType::kF32, 0.0, SpeculativeStep::kAuto},
                        {true, StateType::kF32, 0.0, SpeculativeStep::kAuto},
                        {false, StateType::kInt8, 0.0, SpeculativeStep::kAuto},
                        {true, StateType::kF32, 1e-3, SpeculativeStep::kOn},
                        {false, StateType::kF32, 1e9, SpeculativeStep::kOn}};
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.bf16 ? "bf16" : "fp32") + " parameters, " + StateTypeName(c.states) +
                 " states, clip " + std::to_string(c.clip));
    // Pieces uploaded and gradients landing in pieces (device, not strict); landing only
    // (CPU tier); uploaded only (device, strict: its compute stream is not the caller's, so
    // gradients land whole); neither (CPU, strict). The strict device also delays each stream
    // operation at random: a piece's copy still in flight when the next forward reads the
    // parameters would show. Clipping: nothing lands in pieces.
    const std::pair<Tier, bool> runs[] = {
        {Tier::kDevice, false}, {Tier::kCpu, false}, {Tier::kDevice, true}, {Tier::kCpu, true}};
    std::vector<std::vector<float>> want;
    for (const auto& [tier, strict] : runs) {
      SCOPED_TRACE(std::string("params ") + TierName(tier) + (strict ? ", strict device" : ""));
      std::vector<std::vector<float>> got;
      uint64_t landing = 0;
      run(c, tier, strict, /*nan_step=*/-1, &got, &landing);
      if (HasFatalFailure()) return;
      // (Two sub-groups a step over 3 steps; each lands over milliseconds, so the optimizer,
      // waiting for it, is woken by its first pieces.)
      if (strict || c.clip > 0) {
        EXPECT_EQ(landing, 0u);
      } else {
        EXPECT_GT(landing, 0u);
      }
      if (want.empty()) want = got;
      for (size_t p = 0; p < defs.size(); ++p) {
        EXPECT_EQ(std::memcmp(got[p].data(), want[p].data(), want[p].size() * 4), 0)
            << defs[p].first;
      }
    }
    // A NaN in the last piece of the landing "y": the step fails naming it (with clipping,
    // the norm), and nothing hangs.
    std::vector<std::vector<float>> unused;
    uint64_t landing = 0;
    run(c, Tier::kDevice, /*strict=*/false, /*nan_step=*/1, &unused, &landing);
    if (HasFatalFailure()) return;
  }
}

TEST(EngineNonFinite, AGradientWithNanStopsTheStepBeforeAnyNonFiniteMasterIsWritten) {
  // (Parameters and states on the device: the gradients accumulate and are checked there.)
  const std::pair<Tier, Tier> placements[] = {
      {Tier::kCpu, Tier::kCpu}, {Tier::kCpu, Tier::kNvme}, {Tier::kDevice, Tier::kDevice}};
  // With clipping, the norm fails the step; with speculation the sub-groups stepped before it
  // was known (the one with the NaN among them, its tiles left unstepped) are rolled back, so
  // in both cases no parameter is updated.
  const std::pair<double, SpeculativeStep> modes[] = {
      {0.0, SpeculativeStep::kAuto}, {1.0, SpeculativeStep::kOff}, {1.0, SpeculativeStep::kOn}};
  for (const auto& [clip, speculative] : modes) {
    for (const auto& [params, states] : placements) {
      SCOPED_TRACE(std::string("clip ") + std::to_string(clip) + ", params " + TierName(params) +
                   ", states " + TierName(states) + ", speculative " +
                   (speculative == SpeculativeStep::kOn ? "on" : "off"));
      Placement pl{params, states};
      pl.clip = clip;
      Rig rig;
      EngineConfig config = MakeConfig(pl, rig.dir.path());
      config.gradient_accumulation_steps = 1;
      config.speculative_step = speculative;
      ASSERT_TRUE(rig.Create(config).ok());
      std::vector<std::vector<float>> before(Defs().size());
      for (size_t p = 0; p < Defs().size(); ++p) {
        before[p].resize(Numel(Defs()[p]));
        ASSERT_TRUE(rig.engine->GatherMasterParameter(rig.ids[p], before[p].data()).ok());
      }
      ASSERT_TRUE(rig.engine->Acquire(rig.ids).ok());
      ASSERT_TRUE(rig.engine->Release(rig.ids).ok());
      for (size_t p = 0; p < Defs().size(); ++p) {
        if (!Defs()[p].trainable) continue;
        std::vector<float> g(Numel(Defs()[p]), 0.1f);
        if (p == 2) g[17] = std::nanf("");
        ASSERT_TRUE(rig.engine->ReduceGradient(rig.ids[p], g.data()).ok());
      }
      Result<StepStats> st = rig.engine->Step();
      ASSERT_FALSE(st.ok());
      EXPECT_EQ(st.status().code(), StatusCode::kFailedPrecondition) << st.status().ToString();
      EXPECT_NE(st.status().message().find(clip > 0 ? "norm" : "'b.weight'"), std::string::npos)
          << st.status().ToString();
      if (clip > 0) {
        // Nothing of the step was applied: the masters are those before it, bit for bit.
        for (size_t p = 0; p < Defs().size(); ++p) {
          std::vector<float> after(Numel(Defs()[p]));
          Status g = rig.engine->GatherMasterParameter(rig.ids[p], after.data());
          ASSERT_TRUE(g.ok()) << g.ToString();
          EXPECT_EQ(std::memcmp(after.data(), before[p].data(), after.size() * sizeof(float)), 0)
              << Defs()[p].name;
        }
      }
      // The engine stays stopped: nothing of the step can be saved or gathered (what reaches
      // a store instead is in ADurableStoreKeepsTheLastGoodStep).
      EXPECT_FALSE(rig.engine->Step().ok());
      EXPECT_FALSE(rig.engine->SaveCheckpoint(rig.dir.path() + "/ckpt").ok());
    }
  }
}

// Also with the delayed update and clipping, where the optimizer thread commits each step: a
// failed norm is no failure of the optimizer's (it steps nothing), and must not be committed.
TEST(EngineNonFinite, ADurableStoreKeepsTheLastGoodStep) {
  struct Case {
    Tier params;
    bool delayed;
    double clip;
  };
  for (const Case& c : {Case{Tier::kCpu, false, 0.0}, Case{Tier::kNvme, true, 1.0}}) {
    SCOPED_TRACE(std::string(c.delayed ? "delayed, clip 1" : "undelayed, no clipping"));
    Placement pl{c.params, Tier::kNvme};
    pl.clip = c.clip;
    TempDir dir;
    EngineConfig config = MakeConfig(pl, dir.path());
    config.gradient_accumulation_steps = 1;
    config.durable = true;
    config.delayed_update = c.delayed;
    {
      Rig rig;
      ASSERT_TRUE(rig.Create(config).ok());
      for (int step = 0; step < 2; ++step) {
        ASSERT_TRUE(rig.engine->Acquire(rig.ids).ok());
        ASSERT_TRUE(rig.engine->Release(rig.ids).ok());
        for (size_t p = 0; p < Defs().size(); ++p) {
          if (!Defs()[p].trainable) continue;
          std::vector<float> g(Numel(Defs()[p]), 0.1f);
          if (step == 1) g[0] = std::numeric_limits<float>::infinity();
          ASSERT_TRUE(rig.engine->ReduceGradient(rig.ids[p], g.data()).ok());
        }
        EXPECT_EQ(rig.engine->Step().ok(), step == 0);
      }
    }
    Rig resumed;
    ASSERT_TRUE(resumed.Create(config, /*finish=*/false).ok());
    Status s = resumed.engine->ResumeFromStore();
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(resumed.engine->global_step(), 1) << "the failed step never committed";
    for (size_t p = 0; p < Defs().size(); ++p) {
      std::vector<float> got(Numel(Defs()[p]));
      ASSERT_TRUE(resumed.engine->GatherMasterParameter(resumed.ids[p], got.data()).ok());
      for (float x : got) ASSERT_TRUE(std::isfinite(x)) << Defs()[p].name;
    }
  }
}

// Parameter groups: a parameter naming a group that does not exist, a group added after
// registration or out of order, and a value the optimizer refuses are each refused, naming
// the group (and the key); a group's values can change between steps.
TEST(EngineSemanticsTest, ParameterGroupRefusals) {
  Rig rig;
  ASSERT_TRUE(rig.Create(MakeConfig(Placement{Tier::kCpu, Tier::kCpu}, rig.dir.path()),
                         /*finish=*/false)
                  .ok());
  EXPECT_EQ(rig.engine->num_param_groups(), 1u);
  ParamSpec spec;
  spec.name = "late";
  spec.shape = {4};
  spec.init = [](float* d, size_t n) { std::fill(d, d + n, 0.5f); };
  spec.param_group = 1;
  Result<ParamId> r = rig.engine->RegisterParameter(spec);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("parameter group 1 does not exist"), std::string::npos)
      << r.status().ToString();
  Status s = rig.engine->SetParamGroup(2, ParamGroupHyper{});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  ParamGroupHyper bad;
  bad.beta2 = 1.0f;
  s = rig.engine->SetParamGroup(1, bad);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("parameter group 1: betas[1]"), std::string::npos) << s.ToString();
  bad = ParamGroupHyper{};
  bad.weight_decay = -1.0f;
  EXPECT_NE(rig.engine->SetParamGroup(0, bad).message().find("weight_decay"), std::string::npos);
  ParamGroupHyper g;
  g.lr = 0.25f;
  ASSERT_TRUE(rig.engine->SetParamGroup(1, g).ok());
  r = rig.engine->RegisterParameter(spec);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(rig.engine->param(*r).param_group, 1u);
  ASSERT_TRUE(rig.engine->FinishRegistration().ok());
  EXPECT_EQ(rig.engine->SetParamGroup(2, g).code(), StatusCode::kFailedPrecondition);
  g.lr = 0.5f;
  ASSERT_TRUE(rig.engine->SetParamGroup(1, g).ok());
  EXPECT_EQ(rig.engine->param_group(1).lr, 0.5f);
  ASSERT_TRUE(rig.engine->SetLearningRate(0.125f).ok());
  EXPECT_EQ(rig.engine->param_group(0).lr, 0.125f);
  EXPECT_EQ(rig.engine->param_group(1).lr, 0.125f);
}

}  // namespace
}  // namespace zinf

namespace zinf {
namespace {

// What an Acquire returns is the parameter's stored value, also when prefetches run far ahead
// of slow reads and the pinned staging runs out. (A prefetch that found no staging used to
// keep its device buffer marked as fetched: the next Acquire returned whatever that memory
// held, another parameter's values or garbage, and the 3.15B model's first loss changed from
// run to run.)
TEST(EngineFetch, AcquiredValuesAreTheStoredOnesWhenPrefetchesExhaustTheStaging) {
  constexpr int kParams = 32;
  constexpr size_t kNumel = 65536;  // 256 KiB each
  constexpr int kStepsHere = 3;
  // Each run: every parameter acquired in order and hashed, gradients from the values, a step.
  auto run = [&](bool slow_reads, std::vector<uint64_t>* seen,
                 std::vector<std::vector<float>>* masters) -> Status {
    TempDir dir;
    if (!dir.ok()) return Status::IoError("mkdtemp failed");
    std::unique_ptr<Device> device = NewHostDevice(HostDeviceOptions{});
    ZINF_ASSIGN_OR_RETURN(auto comms, NewLocalComms({device.get()}));
    EngineConfig c;
    c.offload_param.tier = Tier::kNvme;
    c.offload_param.nvme_paths = {dir.path()};
    c.offload_optimizer.tier = Tier::kCpu;
    c.offload_param.buffer_size = 1 << 16;
    c.offload_optimizer.buffer_size = 1 << 16;
    c.sub_group_size = 4 * kNumel;        // four parameters per sub-group
    c.prefetch_bucket_size = 8 * kNumel;  // eight parameters per prefetch call
    c.param_persistence_threshold = 0;
    c.max_reuse_distance = 0;  // released parameters leave the device
    // Planned: staging for 4 + 8 parameters and two sub-groups' gradients (5 MiB); the arena
    // is 6 MiB, so gradient blocks take 3 MiB and 12 parameters' staging remains, while two
    // prefetch calls can have 16 reads in flight.
    c.pinned_budget_bytes = 6u << 20;
    c.optimizer.type = OptimizerType::kAdamW;
    c.optimizer.lr = 1e-2f;
    c.optimizer_threads = 1;
    EngineHooks hooks;
    auto plan = std::make_shared<FaultPlan>();
    hooks.fault_plan = plan;
    ZINF_ASSIGN_OR_RETURN(auto engine, Engine::Create(c, device.get(), comms[0].get(), hooks));
    std::vector<ParamId> ids;
    for (int i = 0; i < kParams; ++i) {
      ParamSpec spec;
      spec.name = "p" + std::to_string(i);
      spec.shape = {static_cast<int64_t>(kNumel)};
      spec.init = [i](float* data, size_t n) {
        for (size_t k = 0; k < n; ++k) data[k] = 0.25f * HashUniform(0xFE7C4, i, k);
      };
      ZINF_ASSIGN_OR_RETURN(ParamId id, engine->RegisterParameter(spec));
      ids.push_back(id);
    }
    ZINF_RETURN_IF_ERROR(engine->FinishRegistration());
    // The order is known (as zinf-train declares it): prefetching starts with the first step.
    ZINF_RETURN_IF_ERROR(engine->SetAcquireOrder(ids));
    if (slow_reads) {  // every read from now on completes 20 ms late
      IoFault f;
      f.kind = IoFault::Kind::kDelay;
      f.first = 0;
      f.count = UINT64_MAX;
      f.any_op = false;
      f.op = IoOp::kRead;
      f.delay_us = 20000;
      plan->Add(f);
    }
    std::vector<float> grad(kNumel);
    for (int step = 0; step < kStepsHere; ++step) {
      std::vector<std::vector<float>> values(kParams);
      for (int i = 0; i < kParams; ++i) {
        ZINF_ASSIGN_OR_RETURN(std::vector<void*> ptr, engine->Acquire({ids[i]}));
        const float* v = static_cast<const float*>(ptr[0]);
        values[i].assign(v, v + kNumel);
        seen->push_back(std::hash<std::string_view>{}(
            std::string_view(reinterpret_cast<const char*>(v), kNumel * sizeof(float))));
        ZINF_RETURN_IF_ERROR(engine->Release({ids[i]}));
      }
      for (int i = kParams - 1; i >= 0; --i) {
        // (From the values acquired: a wrong value changes the masters too.)
        for (size_t k = 0; k < kNumel; ++k) grad[k] = values[i][k] - 0.1f;
        ZINF_RETURN_IF_ERROR(engine->ReduceGradient(ids[i], grad.data()));
      }
      ZINF_RETURN_IF_ERROR(engine->Step().status());
    }
    masters->assign(kParams, std::vector<float>(kNumel));
    for (int i = 0; i < kParams; ++i) {
      ZINF_RETURN_IF_ERROR(engine->GatherMasterParameter(ids[i], (*masters)[i].data()));
    }
    return Status::OK();
  };
  std::vector<uint64_t> fast_seen, slow_seen;
  std::vector<std::vector<float>> fast, slow;
  ASSERT_TRUE(run(false, &fast_seen, &fast).ok());
  Status s = run(true, &slow_seen, &slow);
  ASSERT_TRUE(s.ok()) << s.ToString();
  ASSERT_EQ(fast_seen.size(), slow_seen.size());
  for (size_t k = 0; k < fast_seen.size(); ++k) {
    ASSERT_EQ(fast_seen[k], slow_seen[k])
        << "acquire #" << k << " (step " << k / kParams + 1 << ", p" << k % kParams
        << ") returned other values than without slow reads";
  }
  for (int i = 0; i < kParams; ++i) {
    ASSERT_EQ(std::memcmp(fast[i].data(), slow[i].data(), kNumel * sizeof(float)), 0) << "p" << i;
  }
}

// ---- fp16 ----------------------------------------------------------------------------------

// The windows whose gradients overflow in the fp16 runs (an inf in window 1, a NaN in window 2,
// both in the last micro-step's "a.weight"): with hysteresis 2 the first is taken by the
// hysteresis, the second halves the scale. DeepSpeed's rule then doubles it on the step after
// a whole window (1) without overflow: window 4. The scale after each window: 4096, 4096,
// 2048, 2048, 4096.
bool Overflows(int window) { return window == 1 || window == 2; }

// One fp16 micro-step of rank `rank` of `ranks` (each hands `share` of the gradient, so that
// the ranks' sum is the simulation's): the values read checked, the gradients multiplied by
// the engine's loss scale (a power of two: exact), an overflow injected where Overflows says
// (on rank `overflow_rank` only), Step. At a boundary *st gets the step's stats.
void Fp16MicroStep(Engine* engine, const std::vector<ParamId>& ids, int micro, const Placement& pl,
                   const Simulation& sim, int rank, float share, int overflow_rank, StepStats* st) {
  const int64_t step = engine->global_step();
  const int64_t visible = pl.delayed ? std::max<int64_t>(step - 1, 0) : step;
  const std::string when = "micro-step " + std::to_string(micro) + " (" + pl.Describe() + ")";
  Result<std::vector<void*>> ptrs = engine->Acquire(ids);
  ASSERT_TRUE(ptrs.ok()) << when << ": " << ptrs.status().ToString();
  for (size_t p = 0; p < ids.size(); ++p) {
    const size_t n = Numel(Defs()[p]);
    const auto* half = static_cast<const uint16_t*>((*ptrs)[p]);
    std::vector<float> got(n);
    for (size_t i = 0; i < n; ++i) got[i] = Fp16ToFp32(half[i]);
    ASSERT_EQ(got, Expected(sim.version(visible)[p], n, ParamCopyType::kF16))
        << when << ": '" << Defs()[p].name << "' reads the wrong version";
  }
  ASSERT_TRUE(engine->Release(ids).ok());
  const float scale = static_cast<float>(engine->loss_scale());
  const int window = micro / kAccum;
  for (size_t p = 0; p < Defs().size(); ++p) {
    if (!HasGrad(p, micro)) continue;
    std::vector<float> g(Numel(Defs()[p]));
    for (size_t i = 0; i < g.size(); ++i) g[i] = GradValue(p, micro, i) * share * scale;
    if (p == 0 && micro % kAccum == kAccum - 1 && Overflows(window) && rank == overflow_rank) {
      g[7] = window == 1 ? std::numeric_limits<float>::infinity() : std::nanf("");
    }
    ASSERT_TRUE(engine->ReduceGradient(ids[p], g.data()).ok());
  }
  Result<StepStats> r = engine->Step();
  ASSERT_TRUE(r.ok()) << when << ": " << r.status().ToString();
  *st = *r;
}

// Runs micro-steps [first, last) of the fp16 schedule on a one-rank rig, stepping `sim` and
// `oracle` (the scaler fed the same overflows) along, and checks the scale, the skipped
// steps and the update counts at every boundary.
void RunFp16(Rig& rig, int first, int last, const Placement& pl, Simulation* sim,
             LossScaler* oracle, std::vector<double>* scales = nullptr) {
  for (int micro = first; micro < last; ++micro) {
    ASSERT_EQ(rig.engine->loss_scale(), oracle->scale()) << "micro-step " << micro;
    StepStats st;
    Fp16MicroStep(rig.engine.get(), rig.ids, micro, pl, *sim, 0, 1.0f, 0, &st);
    if (::testing::Test::HasFatalFailure()) return;
    if ((micro + 1) % kAccum != 0) continue;
    const int window = micro / kAccum;
    ASSERT_TRUE(oracle->Update(Overflows(window)).ok());
    if (Overflows(window)) {
      sim->Skip();
    } else {
      sim->Step(window, pl.clip);
    }
    EXPECT_EQ(st.loss_scale, oracle->scale()) << "window " << window;
    if (scales != nullptr) scales->push_back(st.loss_scale);
    EXPECT_EQ(st.skipped_steps, oracle->skipped_steps()) << "window " << window;
    for (size_t p = 0; p < Defs().size(); ++p) {
      ASSERT_EQ(rig.engine->param_updates(rig.ids[p]), sim->updates(p))
          << Defs()[p].name << " after window " << window;
    }
  }
}

LossScaler Fp16Oracle() {
  Fp16Config f;
  Fp16Settings(&f);
  return LossScaler(LossScaleSettingsOf(f));
}

class Fp16Test : public ::testing::TestWithParam<Placement> {};

// The masters end bit-identical to the fp32 simulation that never saw the overflowing windows
// (the gradients times 2^k, times 2^-k in the optimizer, are the simulation's exactly), every
// micro-step reads fp16 values of the right version, and the scale moves as DeepSpeed's does.
TEST_P(Fp16Test, OverflowingWindowsAreSkippedAndTheOthersTrainAsInFp32) {
  const Placement pl = GetParam();
  Rig rig;
  ASSERT_TRUE(rig.dir.ok());
  ASSERT_TRUE(rig.Create(MakeConfig(pl, rig.dir.path())).ok());
  Simulation sim;
  LossScaler oracle = Fp16Oracle();
  std::vector<double> scales;
  RunFp16(rig, 0, kSteps * kAccum, pl, &sim, &oracle, &scales);
  if (::testing::Test::HasFatalFailure()) return;
  EXPECT_EQ(rig.engine->global_step(), kSteps);
  EXPECT_EQ(rig.engine->skipped_steps(), 2u);
  EXPECT_EQ(scales, (std::vector<double>{4096, 4096, 2048, 2048, 4096}));
  ExpectMasters(rig, sim, pl.Describe());
}

INSTANTIATE_TEST_SUITE_P(
    Placements, Fp16Test,
    ::testing::Values(
        Placement{Tier::kCpu, Tier::kCpu, 1.0, false, false, 0.0, true},
        Placement{Tier::kNvme, Tier::kNvme, 1.0, false, false, 0.0, true},
        Placement{Tier::kDevice, Tier::kDevice, 1.0, false, false, 0.0, true},
        Placement{Tier::kDevice, Tier::kCpu, 0.5, true, false, 0.0, true},
        Placement{Tier::kCpu, Tier::kNvme, 1.0, true, false, 0.0, true},
        Placement{Tier::kCpu, Tier::kCpu, 1.0, false, false, 0.5, true, SpeculativeStep::kOn},
        Placement{Tier::kCpu, Tier::kCpu, 1.0, false, false, 1e4, true, SpeculativeStep::kOn},
        Placement{Tier::kNvme, Tier::kNvme, 1.0, true, false, 0.5, true, SpeculativeStep::kOn}),
    PlacementName);

// The scaler's state goes into checkpoints and durable commits: a run restarted after the
// overflowing windows goes on with the same scale, skipped steps and values. With the delayed
// update a step's commit is made by the optimizer thread after the trainer has updated the
// scale again (each commit takes the state of its own step), and a commit made before the
// resumed run's first step (SaveCheckpoint finishing the pending update) keeps it too.
TEST(Fp16Test, TheScaleSurvivesCheckpointsAndDurableResumes) {
  for (int mode = 0; mode < 3; ++mode) {
    const bool durable = mode > 0, delayed = mode == 2;
    SCOPED_TRACE(mode == 0 ? "checkpoint" : mode == 1 ? "durable resume" : "durable, delayed");
    Placement pl{delayed ? Tier::kNvme : Tier::kCpu, Tier::kNvme, 1.0, delayed, false, 0.0, true};
    TempDir dir;
    EngineConfig config = MakeConfig(pl, dir.path());
    config.durable = durable;
    Simulation sim;
    LossScaler oracle = Fp16Oracle();
    const int split = 3;  // windows before the restart: both overflows, the scale changed
    {
      Rig rig;
      ASSERT_TRUE(rig.Create(config).ok());
      RunFp16(rig, 0, split * kAccum, pl, &sim, &oracle);
      if (::testing::Test::HasFatalFailure()) return;
      ASSERT_EQ(rig.engine->skipped_steps(), 2u);
      if (!durable) ASSERT_TRUE(rig.engine->SaveCheckpoint(dir.path() + "/ckpt").ok());
    }
    auto reopen = [&](Rig* rig) {
      ASSERT_TRUE(rig->Create(config, /*finish=*/false).ok());
      if (durable) {
        Status s = rig->engine->ResumeFromStore();
        ASSERT_TRUE(s.ok()) << s.ToString();
      } else {
        ASSERT_TRUE(rig->engine->FinishRegistration().ok());
        Status s = rig->engine->LoadCheckpoint(dir.path() + "/ckpt");
        ASSERT_TRUE(s.ok()) << s.ToString();
      }
      ASSERT_EQ(rig->engine->global_step(), split);
      EXPECT_EQ(rig->engine->loss_scale(), oracle.scale());
      EXPECT_EQ(rig->engine->skipped_steps(), 2u);
    };
    if (delayed) {
      {
        Rig rig;
        reopen(&rig);
        if (::testing::Test::HasFatalFailure()) return;
        // Finishes the pending update: a commit at the resumed step, before any Step.
        ASSERT_TRUE(rig.engine->SaveCheckpoint(dir.path() + "/ckpt").ok());
      }
      Rig rig;
      reopen(&rig);
      if (::testing::Test::HasFatalFailure()) return;
      ExpectMasters(rig, sim, "after two durable resumes");
      continue;  // (the next micro-step reads the latest version: not RunFp16's delayed one)
    }
    Rig rig;
    reopen(&rig);
    if (::testing::Test::HasFatalFailure()) return;
    RunFp16(rig, split * kAccum, kSteps * kAccum, pl, &sim, &oracle);
    if (::testing::Test::HasFatalFailure()) return;
    ExpectMasters(rig, sim, durable ? "after a durable resume" : "after a checkpoint load");
  }
}

// An overflow at min_loss_scale fails the step (DeepSpeed raises there): skipping would skip
// every step from then on. Nothing was updated, and the error names the setting.
TEST(Fp16Test, AnOverflowAtTheSmallestScaleFailsTheStep) {
  Placement pl{Tier::kCpu, Tier::kCpu, 1.0, false, false, 0.0, true};
  Rig rig;
  ASSERT_TRUE(rig.dir.ok());
  EngineConfig config = MakeConfig(pl, rig.dir.path());
  config.fp16.min_loss_scale = 4096;  // the initial scale
  config.fp16.hysteresis = 1;
  ASSERT_TRUE(rig.Create(config).ok());
  Simulation sim;
  StepStats st;
  for (int micro = 0; micro < 2 * kAccum - 1; ++micro) {
    Fp16MicroStep(rig.engine.get(), rig.ids, micro, pl, sim, 0, 1.0f, 0, &st);
    if (::testing::Test::HasFatalFailure()) return;
    if (micro == kAccum - 1) sim.Step(0, 0.0);
  }
  std::vector<float> g(Numel(Defs()[0]), 1.0f);
  g[3] = std::numeric_limits<float>::infinity();
  ASSERT_TRUE(rig.engine->ReduceGradient(rig.ids[0], g.data()).ok());
  Result<StepStats> r = rig.engine->Step();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("min_loss_scale"), std::string::npos)
      << r.status().ToString();
  EXPECT_EQ(rig.engine->param_updates(rig.ids[0]), 1);
}

// Two ranks: an inf in one rank's gradient alone skips the step on both (the norm is
// all-reduced), and both go on with the same values and scale.
TEST(Fp16Test, AnOverflowOnOneRankSkipsTheStepOnEvery) {
  const Placement pl{Tier::kCpu, Tier::kNvme, 1.0, false, false, 0.0, true};
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  std::vector<std::unique_ptr<Device>> devices;
  std::vector<Device*> raw;
  for (int r = 0; r < 2; ++r) {
    HostDeviceOptions ho;
    ho.memory_budget = 64ull << 20;
    devices.push_back(NewHostDevice(ho));
    raw.push_back(devices.back().get());
  }
  Result<std::vector<std::unique_ptr<Communicator>>> comms = NewLocalComms(raw);
  ASSERT_TRUE(comms.ok());
  // The simulation: window 1 and 2 skipped, the rest stepped (each rank hands half).
  Simulation sim;
  LossScaler oracle = Fp16Oracle();
  for (int w = 0; w < kSteps; ++w) {
    ASSERT_TRUE(oracle.Update(Overflows(w)).ok());
    if (Overflows(w)) {
      sim.Skip();
    } else {
      sim.Step(w, 0.0);
    }
  }
  std::vector<std::vector<std::vector<float>>> masters(2);
  std::vector<double> scales(2);
  std::vector<uint64_t> skipped(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Result<std::unique_ptr<Engine>> e =
          Engine::Create(MakeConfig(pl, dir.path()), raw[r], (*comms)[r].get());
      ASSERT_TRUE(e.ok()) << e.status().ToString();
      std::vector<ParamId> ids;
      ASSERT_TRUE(RegisterDefs(e->get(), &ids).ok());
      ASSERT_TRUE((*e)->FinishRegistration().ok());
      for (int micro = 0; micro < kSteps * kAccum; ++micro) {
        StepStats st;
        // (The simulation's versions are complete: each micro-step checks what it reads.)
        Fp16MicroStep(e->get(), ids, micro, pl, sim, r, 0.5f, /*overflow_rank=*/1, &st);
        if (::testing::Test::HasFatalFailure()) return;
      }
      for (size_t p = 0; p < Defs().size(); ++p) {
        masters[r].emplace_back(Numel(Defs()[p]));
        ASSERT_TRUE((*e)->GatherMasterParameter(ids[p], masters[r].back().data()).ok());
      }
      scales[r] = (*e)->loss_scale();
      skipped[r] = (*e)->skipped_steps();
    });
  }
  for (std::thread& t : threads) t.join();
  if (::testing::Test::HasFailure()) return;
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(scales[r], oracle.scale()) << "rank " << r;
    EXPECT_EQ(skipped[r], 2u) << "rank " << r;
    for (size_t p = 0; p < Defs().size(); ++p) {
      const ParamCopyType stored = Defs()[p].trainable ? ParamCopyType::kNone : ParamCopyType::kF16;
      EXPECT_EQ(masters[r][p], Expected(sim.master(p), Numel(Defs()[p]), stored))
          << "rank " << r << ": '" << Defs()[p].name << "'";
    }
  }
}

}  // namespace
}  // namespace zinf
