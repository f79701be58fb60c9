// Frozen parameters (ParamSpec::trainable false) are data, not state: stored once in the
// parameter dtype, no master and no optimizer states, never written back, fetched like the
// others. What a run with a frozen "base" beside small trainable "adapters" must show against
// the same run without the base: the adapters train to the same bits, the NVMe writes per step
// are the same bytes, the swap store grows by the base's stored copy alone; the base reads back
// as registered (bf16-rounded with bf16 storage). Checkpoints and the durable store record the
// base by its value hash: a load or resume with other base values, or with the base trainable,
// is refused naming it. SetParameterValues replaces a frozen value in its store.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cpu_adam/weights_int8_impl.h"
#include "engine/core/layout.h"
#include "tests/engine_test_model.h"
#include "tests/test_util.h"
#include "zinf/comm.h"
#include "zinf/config.h"
#include "zinf/cpu_adam.h"
#include "zinf/device.h"
#include "zinf/engine.h"

namespace zinf {
namespace {

using testing::HashUniform;
using testing::TempDir;

constexpr size_t kBase = 1 << 18;  // 262,144 frozen elements (1 MiB in fp32)
constexpr int64_t kAdapter[] = {64, 48};
constexpr size_t kAdapters = 3;

struct Options {
  bool bf16 = false;
  bool fp16 = false;  // fp16 storage (the gradients handed unscaled: only the adapters' values
                      // are compared, run against run)
  bool int8 = false;  // zinf.frozen_weight_dtype int8
  Tier param_tier = Tier::kNvme;
  uint64_t sub_group_size = 4096;
  bool delayed = false;
  bool with_base = true;
  bool base_trainable = false;
  uint64_t base_seed = 1;
  std::vector<float> base_values;  // when not empty: the base's values (not base_seed's)
  int ranks = 1;
  int steps = 4;
  bool durable = false;
  bool resume = false;  // ResumeFromStore instead of a fresh start
  std::string load;     // LoadCheckpoint from here before training
  std::string save;     // SaveCheckpoint here after training
  std::function<void(Engine*, const std::vector<ParamId>&)> before;  // after registration
};

struct Outcome {
  Status status;
  std::vector<std::vector<float>> values;  // gathered, registration order
  std::vector<StepStats> stats;            // per step, rank 0
};

float BaseValue(uint64_t seed, size_t i) { return 0.3f * HashUniform(seed, 7, i); }
float AdapterValue(size_t a, size_t i) { return 0.1f * HashUniform(0xADA, a, i); }
// A gradient that depends on the step and, like a LoRA gradient, on the adapter's value.
float Grad(size_t a, size_t i, int step, float w) {
  return 0.05f * HashUniform(0x6AD, a * 1000 + static_cast<size_t>(step), i) + 0.01f * w;
}

EngineConfig Config(const Options& o, const std::string& nvme) {
  EngineConfig c;
  c.offload_param.tier = o.param_tier;
  c.offload_optimizer.tier = Tier::kNvme;
  c.offload_param.nvme_paths = {nvme};
  c.offload_optimizer.nvme_paths = {nvme};
  c.offload_param.buffer_size = 1 << 16;
  c.offload_optimizer.buffer_size = 1 << 16;
  c.sub_group_size = o.sub_group_size;
  c.prefetch_bucket_size = 1 << 19;
  c.param_persistence_threshold = 0;
  c.bf16 = o.bf16;
  c.fp16.enabled = o.fp16;
  c.frozen_int8 = o.int8;
  c.delayed_update = o.delayed;
  c.durable = o.durable;
  c.durable_overwrite = o.durable && !o.resume;
  c.optimizer.lr = 1e-2f;
  c.optimizer_threads = 1;
  c.pinned_budget_bytes = 64ull << 20;
  return c;
}

Status TrainRank(const Options& o, const std::string& nvme, Device* device, Communicator* comm,
                 Outcome* out) {
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                        Engine::Create(Config(o, nvme), device, comm));
  std::vector<ParamId> ids;
  std::vector<bool> trainable;
  for (size_t a = 0; a < kAdapters; ++a) {
    if (a == 1 && o.with_base) {  // registered between the adapters, as LoRA's base is
      ParamSpec base;
      base.name = "base";
      base.shape = {static_cast<int64_t>(kBase)};
      base.trainable = o.base_trainable;
      const uint64_t seed = o.base_seed;
      const std::vector<float> values = o.base_values;
      base.init = [seed, values](float* d, size_t n) {
        for (size_t i = 0; i < n; ++i) d[i] = values.empty() ? BaseValue(seed, i) : values[i];
      };
      ZINF_ASSIGN_OR_RETURN(ParamId id, engine->RegisterParameter(base));
      ids.push_back(id);
      trainable.push_back(o.base_trainable);
    }
    ParamSpec spec;
    spec.name = "adapter" + std::to_string(a);
    spec.shape = {kAdapter[0], kAdapter[1]};
    spec.init = [a](float* d, size_t n) {
      for (size_t i = 0; i < n; ++i) d[i] = AdapterValue(a, i);
    };
    ZINF_ASSIGN_OR_RETURN(ParamId id, engine->RegisterParameter(spec));
    ids.push_back(id);
    trainable.push_back(true);
  }
  if (o.resume) {
    ZINF_RETURN_IF_ERROR(engine->ResumeFromStore());
  } else {
    ZINF_RETURN_IF_ERROR(engine->FinishRegistration());
  }
  if (o.before) o.before(engine.get(), ids);
  if (!o.load.empty()) ZINF_RETURN_IF_ERROR(engine->LoadCheckpoint(o.load));
  const int rank = comm->rank(), world = comm->world_size();
  for (int step = static_cast<int>(engine->global_step()); step < o.steps; ++step) {
    ZINF_ASSIGN_OR_RETURN(std::vector<void*> views, engine->Acquire(ids));
    // The adapters' gradients from their current values (fp32 storage: exact; bf16: rounded).
    std::vector<std::vector<float>> grads;
    for (size_t k = 0, a = 0; k < ids.size(); ++k) {
      if (!trainable[k] || engine->param(ids[k]).name == "base") continue;
      const size_t n = engine->param(ids[k]).numel;
      std::vector<float> w(n);
      if (o.bf16 || o.fp16) {
        const uint16_t* b = static_cast<const uint16_t*>(views[k]);
        const ParamCopyType type = o.bf16 ? ParamCopyType::kBf16 : ParamCopyType::kF16;
        for (size_t i = 0; i < n; ++i) w[i] = ParamCopyToFp32(type, b[i]);
      } else {
        std::memcpy(w.data(), views[k], n * sizeof(float));
      }
      std::vector<float> g(n);
      // Every rank hands its share: the sum over ranks is the gradient.
      for (size_t i = 0; i < n; ++i) g[i] = Grad(a, i, step, w[i]) / static_cast<float>(world);
      grads.push_back(std::move(g));
      ++a;
    }
    ZINF_RETURN_IF_ERROR(engine->Release(ids));
    for (size_t k = 0, a = 0; k < ids.size(); ++k) {
      if (!trainable[k] || engine->param(ids[k]).name == "base") continue;
      ZINF_RETURN_IF_ERROR(engine->ReduceGradient(ids[k], grads[a++].data()));
    }
    ZINF_ASSIGN_OR_RETURN(StepStats st, engine->Step());
    if (rank == 0) out->stats.push_back(st);
  }
  if (!o.save.empty()) ZINF_RETURN_IF_ERROR(engine->SaveCheckpoint(o.save));
  for (ParamId id : ids) {
    std::vector<float> v(engine->param(id).numel);
    ZINF_RETURN_IF_ERROR(engine->GatherMasterParameter(id, v.data()));
    if (rank == 0) out->values.push_back(std::move(v));
  }
  return Status::OK();
}

Outcome Train(const Options& o, const std::string& nvme) {
  Outcome run;
  std::vector<std::unique_ptr<Device>> devices;
  std::vector<Device*> raw;
  for (int r = 0; r < o.ranks; ++r) {
    devices.push_back(NewHostDevice({}));
    raw.push_back(devices.back().get());
  }
  Result<std::vector<std::unique_ptr<Communicator>>> comms = NewLocalComms(raw);
  if (!comms.ok()) return {comms.status(), {}, {}};
  std::vector<Status> status(o.ranks);
  std::vector<Outcome> runs(o.ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < o.ranks; ++r) {
    threads.emplace_back(
        [&, r] { status[r] = TrainRank(o, nvme, raw[r], (*comms)[r].get(), &runs[r]); });
  }
  for (std::thread& t : threads) t.join();
  run = std::move(runs[0]);
  for (const Status& s : status) {
    if (!s.ok() && run.status.ok()) run.status = s;
  }
  return run;
}

// The adapters' values (every tensor but "base").
std::vector<std::vector<float>> Adapters(const Outcome& run, bool with_base) {
  std::vector<std::vector<float>> out;
  for (size_t k = 0; k < run.values.size(); ++k) {
    if (with_base && k == 1) continue;
    out.push_back(run.values[k]);
  }
  return out;
}

std::vector<float> ExpectedBase(uint64_t seed, bool bf16) {
  std::vector<float> v(kBase);
  for (size_t i = 0; i < kBase; ++i) {
    v[i] = BaseValue(seed, i);
    if (bf16) v[i] = Bf16ToFp32(Fp32ToBf16(v[i]));
  }
  return v;
}

TEST(EngineFrozen, TheBaseCostsItsStoredCopyAloneAndNeverChanges) {
  for (bool bf16 : {false, true}) {
    for (bool delayed : {false, true}) {
      for (int ranks : {1, 2}) {
        SCOPED_TRACE(std::string(bf16 ? "bf16" : "fp32") + (delayed ? ", delayed" : "") + ", " +
                     std::to_string(ranks) + " rank(s)");
        TempDir d1, d2;
        ASSERT_TRUE(d1.ok() && d2.ok());
        Options o;
        o.bf16 = bf16;
        o.delayed = delayed;
        o.ranks = ranks;
        const Outcome with = Train(o, d1.path());
        ASSERT_TRUE(with.status.ok()) << with.status.ToString();
        o.with_base = false;
        const Outcome without = Train(o, d2.path());
        ASSERT_TRUE(without.status.ok()) << without.status.ToString();
        // The adapters train exactly as without the base.
        ASSERT_EQ(with.values.size(), kAdapters + 1);
        EXPECT_EQ(Adapters(with, true), Adapters(without, false));
        EXPECT_NE(Adapters(with, true)[0], std::vector<float>(kAdapter[0] * kAdapter[1]))
            << "the adapters did not train";
        // The base reads back as registered.
        EXPECT_EQ(with.values[1], ExpectedBase(1, bf16));
        // NVMe: the same writes per step; the store holds the base's copy once more.
        ASSERT_EQ(with.stats.size(), without.stats.size());
        uint64_t read_with = 0, read_without = 0, write_with = 0, write_without = 0;
        uint64_t step_writes = 0, step_reads = 0;  // the most one step of the adapters moves
        for (size_t s = 0; s < with.stats.size(); ++s) {
          // (The delayed update's writes straddle the steps: compared in sum below.)
          if (!delayed) {
            EXPECT_EQ(with.stats[s].nvme_write_bytes, without.stats[s].nvme_write_bytes)
                << "step " << s + 1;
          }
          read_with += with.stats[s].nvme_read_bytes;
          read_without += without.stats[s].nvme_read_bytes;
          write_with += with.stats[s].nvme_write_bytes;
          write_without += without.stats[s].nvme_write_bytes;
          step_writes = std::max(step_writes, without.stats[s].nvme_write_bytes);
          step_reads = std::max(step_reads, without.stats[s].nvme_read_bytes);
        }
        EXPECT_LE(write_with, write_without + step_writes);
        // The base is read at most once per step (its forward fetch; this trainer's backward
        // needs none), and once more by the prefetch each Step issues for the next one. Summed,
        // with one step's reads of slack: the swap store counts a read as it ends, so a read
        // still in flight at the last step's statistics is in one run's total and not in the
        // other's (under TSan the run without the base counted 36,864 bytes fewer: the three
        // adapters' fp32 values); and the delayed update's reads straddle the steps, by at most
        // one step's more. A base read twice per step would
        // still exceed this by about (steps - 1) base copies: step_reads is a fraction of one.
        const uint64_t base_read = kBase * (bf16 ? 2 : 4) / ranks;
        ASSERT_LT(step_reads, base_read);
        EXPECT_LE(read_with, read_without + (delayed ? 2 : 1) * step_reads +
                                 (with.stats.size() + 1) * base_read);
        // (The swap files grow in steps of at least 1 MiB: the bound allows one. The base's
        // master, states and copies, as trainable parameters keep them, would add 4 MiB.)
        EXPECT_LE(with.stats.back().nvme_bytes,
                  without.stats.back().nvme_bytes + base_read + (1 << 20));
      }
    }
  }
}

TEST(EngineFrozen, CheckpointsRecordTheBaseByHash) {
  TempDir nvme, ckpt;
  ASSERT_TRUE(nvme.ok() && ckpt.ok());
  Options straight;
  straight.steps = 5;
  const Outcome full = Train(straight, nvme.path());
  ASSERT_TRUE(full.status.ok()) << full.status.ToString();

  Options first;
  first.steps = 3;
  first.save = ckpt.path();
  ASSERT_TRUE(Train(first, nvme.path()).status.ok());
  // The base is not in the states file: it holds the adapters' states alone.
  std::ifstream in(ckpt.path() + "/step-000000003/rank0.json");
  const std::string manifest((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
  EXPECT_NE(manifest.find("\"frozen\""), std::string::npos) << manifest.substr(0, 200);

  Options resumed = straight;
  resumed.load = ckpt.path();
  const Outcome cont = Train(resumed, nvme.path());
  ASSERT_TRUE(cont.status.ok()) << cont.status.ToString();
  EXPECT_EQ(cont.values, full.values);

  Options other = resumed;
  other.base_seed = 2;
  const Outcome refused = Train(other, nvme.path());
  EXPECT_EQ(refused.status.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status.message().find("frozen tensor 'base' was saved with other values"),
            std::string::npos)
      << refused.status.ToString();

  Options unfrozen = resumed;
  unfrozen.base_trainable = true;
  const Outcome refused2 = Train(unfrozen, nvme.path());
  EXPECT_EQ(refused2.status.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(refused2.status.message().find("'base' was frozen when saved"), std::string::npos)
      << refused2.status.ToString();

  // With sub-groups as large as the model (the trainable set changes their number), the
  // refusal still names the tensor.
  unfrozen.sub_group_size = 1 << 22;
  Options big = first;
  big.sub_group_size = 1 << 22;
  TempDir ckpt2;
  ASSERT_TRUE(ckpt2.ok());
  big.save = ckpt2.path();
  ASSERT_TRUE(Train(big, nvme.path()).status.ok());
  unfrozen.load = ckpt2.path();
  const Outcome refused3 = Train(unfrozen, nvme.path());
  EXPECT_NE(refused3.status.message().find("'base' was frozen when saved"), std::string::npos)
      << refused3.status.ToString();

  // Two ranks load the one-rank checkpoint (re-partitioned; the base by its hash).
  Options two = resumed;
  two.ranks = 2;
  const Outcome cont2 = Train(two, nvme.path());
  ASSERT_TRUE(cont2.status.ok()) << cont2.status.ToString();
  EXPECT_EQ(cont2.values[1], ExpectedBase(1, false));
}

// With bf16 storage the hash is of the values as stored: a base exported from the store
// (bf16-rounded) and registered again loads the checkpoint it was saved with.
TEST(EngineFrozen, AnExportedBf16BaseHashesAsTheOneSaved) {
  TempDir nvme, ckpt;
  ASSERT_TRUE(nvme.ok() && ckpt.ok());
  Options save;
  save.bf16 = true;
  save.steps = 2;
  save.save = ckpt.path();
  const Outcome saved = Train(save, nvme.path());
  ASSERT_TRUE(saved.status.ok()) << saved.status.ToString();
  Options load = save;
  load.save.clear();
  load.steps = 3;
  load.load = ckpt.path();
  load.base_seed = 0;  // registered from the export below
  load.base_values = saved.values[1];
  const Outcome loaded = Train(load, nvme.path());
  ASSERT_TRUE(loaded.status.ok()) << loaded.status.ToString();
  EXPECT_EQ(loaded.values[1], saved.values[1]);
}

TEST(EngineFrozen, SetParameterValuesReplacesTheBaseInItsStore) {
  TempDir nvme, ckpt;
  ASSERT_TRUE(nvme.ok() && ckpt.ok());
  Options o;
  o.steps = 2;
  o.save = ckpt.path();
  o.before = [](Engine* engine, const std::vector<ParamId>& ids) {
    Status s = engine->SetParameterValues({ids[1]}, [](ParamId, float* d) {
      for (size_t i = 0; i < kBase; ++i) d[i] = BaseValue(2, i);
      return Status::OK();
    });
    ASSERT_TRUE(s.ok()) << s.ToString();
  };
  const Outcome set = Train(o, nvme.path());
  ASSERT_TRUE(set.status.ok()) << set.status.ToString();
  EXPECT_EQ(set.values[1], ExpectedBase(2, false));
  // The checkpoint records the new values: it loads with them, not with the old ones.
  Options load;
  load.steps = 2;
  load.load = ckpt.path();
  load.base_seed = 2;
  EXPECT_TRUE(Train(load, nvme.path()).status.ok());
  load.base_seed = 1;
  EXPECT_EQ(Train(load, nvme.path()).status.code(), StatusCode::kFailedPrecondition);
}

// A durable store resumes only with the trainable set it was written with (refused naming the
// parameter, either way). NVMe parameters: the store's committed copy of the base is the one
// the run goes on with, whatever values were registered (a trainer that loads its base after
// registering, from safetensors say, registers placeholders). Parameters in memory: the
// registered base must hash as committed.
TEST(EngineFrozen, TheDurableStoreResumesOnlyWithTheSameBase) {
  for (Tier param_tier : {Tier::kNvme, Tier::kCpu}) {
    SCOPED_TRACE(param_tier == Tier::kNvme ? "parameters on nvme" : "parameters in memory");
    TempDir nvme;
    ASSERT_TRUE(nvme.ok());
    Options straight;
    straight.steps = 4;
    straight.durable = true;
    straight.param_tier = param_tier;
    const Outcome full = Train(straight, nvme.path());
    ASSERT_TRUE(full.status.ok()) << full.status.ToString();
    Options part = straight;
    part.steps = 2;
    ASSERT_TRUE(Train(part, nvme.path()).status.ok());
    Options unfrozen = straight;
    unfrozen.resume = true;
    unfrozen.base_trainable = true;
    const Outcome refused = Train(unfrozen, nvme.path());
    EXPECT_EQ(refused.status.code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(refused.status.message().find("parameter 'base' was frozen when the store was "
                                            "written and is trainable now"),
              std::string::npos)
        << refused.status.ToString();
    Options other = straight;
    other.resume = true;
    other.base_seed = 2;
    const Outcome with_other = Train(other, nvme.path());
    if (param_tier == Tier::kNvme) {
      ASSERT_TRUE(with_other.status.ok()) << with_other.status.ToString();
      EXPECT_EQ(with_other.values, full.values);
      continue;
    }
    EXPECT_EQ(with_other.status.code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(with_other.status.message().find("frozen parameter 'base'"), std::string::npos)
        << with_other.status.ToString();
    Options same = straight;
    same.resume = true;
    const Outcome resumed = Train(same, nvme.path());
    ASSERT_TRUE(resumed.status.ok()) << resumed.status.ToString();
    EXPECT_EQ(resumed.values, full.values);
  }
}

// The int8 code of frozen weights: every element within its block's largest magnitude / 254
// (half a step), the last block padded with zeros, bf16 decoding = fp32 decoding rounded as
// Fp32ToBf16, inf and NaN refused.
TEST(FrozenInt8, EveryElementIsWithinHalfAStepOfItsBlock) {
  const size_t n = 3 * kInt8StateBlock + 77;
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = (i / kInt8StateBlock + 1) * HashUniform(0x18, 1, i);
  x[5] = 0;
  std::vector<uint8_t> q(StateBytes(StateType::kInt8, n), 0xAB);
  ASSERT_TRUE(QuantizeWeightsInt8(x.data(), n, q.data()).ok());
  std::vector<float> back(n);
  DequantizeWeightsInt8(q.data(), n, back.data());
  std::vector<uint16_t> half(n);
  DequantizeWeightsInt8Bf16(q.data(), n, half.data());
  double worst = 0;
  for (size_t b = 0; b * kInt8StateBlock < n; ++b) {
    const size_t lo = b * kInt8StateBlock, hi = std::min(n, lo + kInt8StateBlock);
    float largest = 0;
    for (size_t i = lo; i < hi; ++i) largest = std::max(largest, std::fabs(x[i]));
    for (size_t i = lo; i < hi; ++i) {
      const double err = std::fabs(static_cast<double>(back[i]) - x[i]);
      // (+1e-4: the fp32 scale and product round, by a few ulp of the block.)
      EXPECT_LE(err, largest / 254.0 * (1 + 1e-4)) << "element " << i;
      worst = std::max(worst, err / largest);
      EXPECT_EQ(half[i], Fp32ToBf16(back[i])) << "element " << i;
    }
  }
  EXPECT_GT(worst, 1.0 / 1000) << "nothing was quantised";
  EXPECT_EQ(back[5], 0.0f);
  // The last block's padding codes are zero.
  const uint8_t* last = q.data() + 3 * (kInt8StateBlock + 4);
  for (size_t i = 77; i < kInt8StateBlock; ++i) EXPECT_EQ(last[i], 0) << i;
  // A block of tiny values (its scale below FLT_MIN) stores as zeros, without overflow.
  std::vector<float> tiny(kInt8StateBlock, 1e-38f);
  tiny[3] = -2e-38f;
  ASSERT_TRUE(QuantizeWeightsInt8(tiny.data(), tiny.size(), q.data()).ok());
  DequantizeWeightsInt8(q.data(), tiny.size(), back.data());
  for (size_t i = 0; i < tiny.size(); ++i) EXPECT_EQ(back[i], 0.0f) << i;
  // All-ones bytes (what a failed read leaves, sent to the peers) decode to NaN in both types.
  std::vector<uint8_t> ones(StateBytes(StateType::kInt8, kInt8StateBlock), 0xFF);
  DequantizeWeightsInt8(ones.data(), kInt8StateBlock, back.data());
  DequantizeWeightsInt8Bf16(ones.data(), kInt8StateBlock, half.data());
  for (size_t i = 0; i < kInt8StateBlock; ++i) {
    EXPECT_TRUE(std::isnan(back[i])) << i;
    EXPECT_TRUE(std::isnan(Bf16ToFp32(half[i]))) << i;
  }
  x[300] = std::nanf("");
  Status s = QuantizeWeightsInt8(x.data(), n, q.data());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("element 300"), std::string::npos) << s.ToString();
}

// The AVX-512 decoders (what a fetch runs where the CPU has them) are the scalar ones' bits:
// full and partial blocks, zero, tiny and NaN scales, blocks of the stored 256 values and of the
// quantized collectives' other sizes (zinf.quantization_block_size).
TEST(FrozenInt8, Avx512DecodesAsTheScalarCode) {
  if (!weights_int8::Avx512Usable()) GTEST_SKIP() << "no AVX-512 on this CPU";
  for (size_t kB : {kMinQuantBlock, kInt8StateBlock, kMaxQuantBlock}) {
    SCOPED_TRACE("blocks of " + std::to_string(kB));
    const size_t n = 9 * kB + 200;
    std::vector<float> x(n);
    for (size_t i = 0; i < n; ++i) x[i] = std::ldexp(HashUniform(0x512, 1, i), (i / kB) * 9 - 40);
    for (size_t i = kB; i < 2 * kB; ++i) x[i] = 0;  // a zero block
    std::vector<uint8_t> q(Int8Bytes(n, kB));
    QuantizeParamsInt8(x.data(), ParamCopyType::kNone, n, q.data(), kB);
    std::memset(q.data() + 4 * (kB + 4), 0xFF, kB + 4);  // a NaN block
    for (size_t len : {n, kB, 3 * kB + 1}) {
      std::vector<float> a(len), b(len);
      weights_int8::DequantizeF32Scalar(q.data(), len, kB, a.data());
      weights_int8::DequantizeF32Avx512(q.data(), len, kB, b.data());
      EXPECT_EQ(std::memcmp(a.data(), b.data(), len * sizeof(float)), 0) << len;
      std::vector<uint16_t> c(len), d(len);
      weights_int8::DequantizeBf16Scalar(q.data(), len, kB, c.data());
      weights_int8::DequantizeBf16Avx512(q.data(), len, kB, d.data());
      EXPECT_EQ(c, d) << len;
    }
  }
}

// The AVX-512 block encoder (what every quantized gather, quantized gradient reduction and
// int8 registration runs where the CPU has it) gives the scalar encoder's bytes: magnitudes
// from 1e-38 to FLT_MAX, exact ties (nearest even), zero, tiny, inf and NaN blocks, partial
// blocks; blocks of 64, 256 and 1024 values.
TEST(FrozenInt8, Avx512EncodesAsTheScalarCode) {
  if (!weights_int8::Avx512Usable()) GTEST_SKIP() << "no AVX-512 on this CPU";
  constexpr size_t kMax = kMaxQuantBlock;
  std::vector<std::vector<float>> blocks;
  for (int e = -126; e <= 127; e += 9) {  // random values at every scale
    std::vector<float> x(kMax);
    for (size_t i = 0; i < kMax; ++i) x[i] = std::ldexp(HashUniform(0xE2C, e + 200, i), e);
    blocks.push_back(x);
  }
  std::vector<float> ties(kMax);  // largest 127: inv is 1, so k + 0.5 are exact ties
  for (size_t i = 0; i < kMax; ++i) ties[i] = static_cast<float>(i % 64) - 31.5f;
  ties[7] = 127.0f;
  blocks.push_back(ties);
  blocks.push_back(std::vector<float>(kMax, 0.0f));
  blocks.push_back(std::vector<float>(kMax, -1e-38f));
  std::vector<float> huge(kMax, -FLT_MAX);
  huge[3] = FLT_MAX;
  blocks.push_back(huge);
  for (size_t kB : {kMinQuantBlock, kInt8StateBlock, kMaxQuantBlock}) {
    for (float bad : {INFINITY, -INFINITY, NAN}) {  // in the last value of a block of kB
      std::vector<float> x = blocks[5];
      x[kB - 1] = bad;
      blocks.push_back(x);
    }
  }
  for (size_t kB : {kMinQuantBlock, kInt8StateBlock, kMaxQuantBlock}) {
    for (size_t b = 0; b < blocks.size(); ++b) {
      for (size_t len : {kB, kB - 1, size_t{17}}) {
        std::vector<int8_t> want(kB + 4, 1), got(kB + 4, 2);
        weights_int8::EncodeBlockScalar(blocks[b].data(), len, kB, want.data());
        weights_int8::EncodeBlockAvx512(blocks[b].data(), len, kB, got.data());
        EXPECT_EQ(want, got) << "block " << b << ", " << len << " of " << kB << " values";
      }
    }
  }
  // The ties went to the even code: -31.5 -> -32, -30.5 -> -30, 0.5 -> 0, 1.5 -> 2.
  std::vector<int8_t> q(kInt8StateBlock + 4);
  weights_int8::EncodeBlockAvx512(ties.data(), kInt8StateBlock, kInt8StateBlock, q.data());
  EXPECT_EQ(q[0], -32);
  EXPECT_EQ(q[1], -30);
  EXPECT_EQ(q[32], 0);
  EXPECT_EQ(q[33], 2);
}

// zinf.frozen_weight_dtype int8: the adapters train exactly as with the base as-is (this
// trainer's gradients do not read it); the base reads back as its int8 code decodes (into the
// storage dtype: bf16, or fp16); the base's stored copy, which each of its fetches reads, is
// about half of bf16's.
TEST(EngineFrozen, Int8FrozenWeightsHalveTheBasesBytes) {
  for (int run = 0; run < 3; ++run) {
    const int ranks = run == 1 ? 2 : 1;
    const ParamCopyType stored = run == 2 ? ParamCopyType::kF16 : ParamCopyType::kBf16;
    SCOPED_TRACE(std::to_string(ranks) + " rank(s), " + ParamCopyTypeName(stored));
    TempDir d1, d2;
    ASSERT_TRUE(d1.ok() && d2.ok());
    Options o;
    o.bf16 = stored == ParamCopyType::kBf16;
    o.fp16 = stored == ParamCopyType::kF16;
    o.ranks = ranks;
    o.steps = 3;
    const Outcome plain = Train(o, d1.path());
    ASSERT_TRUE(plain.status.ok()) << plain.status.ToString();
    o.int8 = true;
    const Outcome int8 = Train(o, d2.path());
    ASSERT_TRUE(int8.status.ok()) << int8.status.ToString();
    EXPECT_EQ(Adapters(int8, true), Adapters(plain, true));
    // The base as its code decodes: blocks of the whole tensor, whatever the world size
    // (partitions start on the block grid), into bf16.
    std::vector<float> base(kBase);
    for (size_t i = 0; i < kBase; ++i) base[i] = BaseValue(1, i);
    std::vector<float> expect(kBase);
    std::vector<uint8_t> q(StateBytes(StateType::kInt8, kBase));
    ASSERT_TRUE(QuantizeWeightsInt8(base.data(), kBase, q.data()).ok());
    DequantizeWeightsInt8(q.data(), kBase, expect.data());
    // ... into bf16 or fp16, as the fetch decodes it.
    for (float& v : expect) v = ParamCopyToFp32(stored, Fp32ToParamCopy(stored, v));
    EXPECT_EQ(int8.values[1], expect);
    EXPECT_NE(int8.values[1], plain.values[1]);  // (the base as stored without int8)
    // The base's stored copy, which is what each of its fetches reads: about half of bf16's
    // (260 / 512: int8 blocks and their scales). Not the runs' read totals: the swap store
    // counts a read as it ends, and whether a step's last prefetch (or the next task's
    // read-ahead) has ended by the step's statistics depends on timing (the totals varied
    // under TSan, with one rank too: 0.92 against 1.35 base reads).
    Layout bf16_layout(ranks, 2), int8_layout(ranks, 2, StateType::kF32, /*frozen_int8=*/true);
    for (Layout* l : {&bf16_layout, &int8_layout}) {
      Result<ParamLayout> p = l->Describe("base", {static_cast<int64_t>(kBase)},
                                          /*trainable=*/false, /*persistence_threshold=*/0);
      ASSERT_TRUE(p.ok()) << p.status().ToString();
      l->Add(std::move(p).value());
      l->Freeze(4096, Tier::kNvme, 1.0);
    }
    EXPECT_EQ(bf16_layout.PartBytes(0), kBase * 2 / ranks);
    EXPECT_EQ(int8_layout.PartBytes(0) * 512, bf16_layout.PartBytes(0) * 260);
  }
  // Not on the device tier: refused by name.
  EngineConfig c;
  c.frozen_int8 = true;
  Status s = ValidateEngineConfig(c);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("zinf.frozen_weight_dtype"), std::string::npos) << s.ToString();
}

// The int8 frozen weights one rank and several store decode to the same values: partitions
// start on the whole tensor's block grid. Before, each rank cut blocks at its partition's start
// (384 elements on 2 ranks: 192 each, and 63 of the 384 values decoded otherwise than on one
// rank; a resharded resume then ended 2e-3 away).
TEST(EngineFrozen, Int8FrozenWeightsDoNotDependOnTheWorldSize) {
  constexpr size_t kOdd = 384 + 37;  // no world size here divides it into whole blocks
  auto gathered = [](int ranks, std::vector<float>* out) -> Status {
    std::vector<std::unique_ptr<Device>> devices;
    std::vector<Device*> raw;
    for (int r = 0; r < ranks; ++r) {
      devices.push_back(NewHostDevice({}));
      raw.push_back(devices.back().get());
    }
    ZINF_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Communicator>> comms, NewLocalComms(raw));
    std::vector<Status> status(ranks);
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] {
        status[r] = [&]() -> Status {
          EngineConfig c;
          c.offload_param.tier = Tier::kCpu;
          c.offload_optimizer.tier = Tier::kCpu;
          c.frozen_int8 = true;
          c.param_persistence_threshold = 0;
          c.optimizer_threads = 1;
          c.pinned_budget_bytes = 16ull << 20;
          ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                                Engine::Create(c, raw[r], comms[r].get()));
          ParamSpec base;
          base.name = "base";
          base.shape = {static_cast<int64_t>(kOdd)};
          base.trainable = false;
          base.init = [](float* d, size_t n) {
            for (size_t i = 0; i < n; ++i) d[i] = BaseValue(3, i) * (i % 97 == 0 ? 40.0f : 1.0f);
          };
          ZINF_ASSIGN_OR_RETURN(ParamId id, engine->RegisterParameter(base));
          ParamSpec adapter;
          adapter.name = "adapter";
          adapter.shape = {64};
          adapter.init = [](float* d, size_t n) {
            for (size_t i = 0; i < n; ++i) d[i] = AdapterValue(0, i);
          };
          ZINF_RETURN_IF_ERROR(engine->RegisterParameter(adapter).status());
          ZINF_RETURN_IF_ERROR(engine->FinishRegistration());
          std::vector<float> v(kOdd);
          ZINF_RETURN_IF_ERROR(engine->GatherMasterParameter(id, v.data()));
          if (r == 0) *out = v;
          return Status::OK();
        }();
      });
    }
    for (std::thread& t : threads) t.join();
    for (const Status& st : status) ZINF_RETURN_IF_ERROR(st);
    return Status::OK();
  };
  std::vector<float> whole(kOdd);
  for (size_t i = 0; i < kOdd; ++i) whole[i] = BaseValue(3, i) * (i % 97 == 0 ? 40.0f : 1.0f);
  std::vector<uint8_t> q(StateBytes(StateType::kInt8, kOdd));
  ASSERT_TRUE(QuantizeWeightsInt8(whole.data(), kOdd, q.data()).ok());
  std::vector<float> expect(kOdd);
  DequantizeWeightsInt8(q.data(), kOdd, expect.data());
  for (int ranks : {1, 2, 3}) {
    std::vector<float> got;
    Status st = gathered(ranks, &got);
    ASSERT_TRUE(st.ok()) << ranks << " ranks: " << st.ToString();
    size_t differ = 0;
    for (size_t i = 0; i < kOdd; ++i) differ += got[i] != expect[i];
    EXPECT_EQ(differ, 0u) << ranks << " ranks";
  }
}

}  // namespace
}  // namespace zinf
