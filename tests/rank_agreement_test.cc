// Ranks agree before they train (engine/core/rank_agreement.h): ranks whose model, settings or
// initial values differ are refused at FinishRegistration on every rank, naming the first
// difference and both values, before any other collective (ranks as threads on LocalComm; the
// same with processes on GlooComm is in engine_multiprocess_test).
#include "engine/core/rank_agreement.h"

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/test_util.h"
#include "zinf/comm.h"
#include "zinf/device.h"
#include "zinf/engine.h"

namespace zinf {
namespace {

struct RankSetup {
  float lr = 1e-2f;
  double clipping = 0;
  int layers = 2;
  uint64_t seed = 7;
  std::string trainer_steps = "10";
  float group1_lr = -1;              // >= 0: the last layer in parameter group 1 with this lr
  int fp16_power = -1;               // >= 0: fp16 with this initial_scale_power
  bool quantized_gradients = false;  // zero_optimization.zero_quantized_gradients
  uint32_t gradient_bits = 8;        // zinf.quantized_gradient_bits
  uint32_t quant_block = 256;        // zinf.quantization_block_size
  bool layer_major = false;          // zinf.schedule layer-major
};

EngineConfig Config(const RankSetup& s) {
  EngineConfig c;
  c.offload_param.tier = Tier::kCpu;
  c.offload_optimizer.tier = Tier::kCpu;
  c.param_persistence_threshold = 0;
  c.optimizer.lr = s.lr;
  c.gradient_clipping = s.clipping;
  if (s.fp16_power >= 0) {
    c.fp16.enabled = true;
    c.fp16.initial_scale_power = s.fp16_power;
  }
  c.quantized_gradients = s.quantized_gradients;
  c.quantized_gradient_bits = s.gradient_bits;
  c.quantization_block_size = s.quant_block;
  c.layer_major = s.layer_major;
  c.optimizer_threads = 1;
  c.pinned_budget_bytes = 16ull << 20;
  return c;
}

// What each rank's FinishRegistration returned, and how many collectives it had issued
// before (none may follow a refusal: the test's second phase runs one more on every rank).
struct RankResult {
  Status finish;
  Status after;  // a Barrier after the refusal: every rank is still in step
};

// Runs body(rank, device, comm) on `n` ranks as threads (LocalComm), and joins them.
void OnThreadRanks(int n, const std::function<void(int, Device*, Communicator*)>& body) {
  std::vector<std::unique_ptr<Device>> devices;
  std::vector<Device*> raw;
  for (int r = 0; r < n; ++r) {
    devices.push_back(NewHostDevice({}));
    raw.push_back(devices.back().get());
  }
  Result<std::vector<std::unique_ptr<Communicator>>> comms = NewLocalComms(raw);
  ASSERT_TRUE(comms.ok()) << comms.status().ToString();
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] { body(r, raw[r], (*comms)[r].get()); });
  }
  for (std::thread& t : threads) t.join();
}

std::vector<RankResult> RunRanks(const std::vector<RankSetup>& setups) {
  std::vector<RankResult> out(setups.size());
  OnThreadRanks(static_cast<int>(setups.size()), [&](int r, Device* device, Communicator* comm) {
    const RankSetup& s = setups[r];
    Result<std::unique_ptr<Engine>> engine = Engine::Create(Config(s), device, comm);
    if (!engine.ok()) {
      out[r].finish = engine.status();
      return;
    }
    Status st = (*engine)->RequireAgreement("trainer steps", s.trainer_steps);
    if (st.ok() && s.group1_lr >= 0) {
      ParamGroupHyper g;
      g.lr = s.group1_lr;
      st = (*engine)->SetParamGroup(1, g);
    }
    for (int l = 0; l < s.layers && st.ok(); ++l) {
      ParamSpec p;
      p.param_group = s.group1_lr >= 0 && l == s.layers - 1 ? 1 : 0;
      p.name = "layer" + std::to_string(l) + ".weight";
      p.shape = {4, 33};
      const uint64_t seed = s.seed;
      p.init = [seed, l](float* d, size_t k) {
        for (size_t i = 0; i < k; ++i) d[i] = static_cast<float>((seed * 31 + l * 7 + i) % 13);
      };
      st = (*engine)->RegisterParameter(p).status();
    }
    if (st.ok()) st = (*engine)->FinishRegistration();
    // The initial values are compared at their first use.
    std::vector<float> w(4 * 33);
    if (st.ok()) st = (*engine)->GatherMasterParameter(0, w.data());
    out[r].finish = st;
    out[r].after = comm->Barrier();
  });
  return out;
}

TEST(RankAgreement, SameRanksAgree) {
  std::vector<RankResult> r = RunRanks({RankSetup{}, RankSetup{}, RankSetup{}});
  for (const RankResult& x : r) {
    EXPECT_TRUE(x.finish.ok()) << x.finish.ToString();
    EXPECT_TRUE(x.after.ok()) << x.after.ToString();
  }
}

// The message every rank gets, with the setting, rank 0's value and the other rank's.
void ExpectRefused(const std::vector<RankResult>& r, const std::vector<std::string>& parts) {
  for (size_t k = 0; k < r.size(); ++k) {
    ASSERT_FALSE(r[k].finish.ok()) << "rank " << k;
    EXPECT_EQ(r[k].finish.code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ(r[k].finish.message(), r[0].finish.message()) << "rank " << k;
    for (const std::string& part : parts) {
      EXPECT_NE(r[k].finish.message().find(part), std::string::npos)
          << "rank " << k << " lacks \"" << part << "\": " << r[k].finish.ToString();
    }
    EXPECT_TRUE(r[k].after.ok()) << "rank " << k << ": " << r[k].after.ToString();
  }
}

TEST(RankAgreement, AnotherLearningRateIsNamed) {
  RankSetup other;
  other.lr = 3e-2f;
  ExpectRefused(RunRanks({RankSetup{}, other}),
                {"the ranks disagree on the model and its training settings",
                 "optimizer.lr: rank 0 has 0.0099999", "rank 1 has 0.029999"});
}

// A parameter group's values, and a parameter's group, are compared like the config's.
TEST(RankAgreement, AnotherParameterGroupIsNamed) {
  RankSetup grouped;
  grouped.group1_lr = 0.5f;
  RankSetup other = grouped;
  other.group1_lr = 0.25f;
  ExpectRefused(RunRanks({grouped, other}),
                {"parameter group 1: rank 0 has lr 0.5,", "rank 1 has lr 0.25,"});
  ExpectRefused(RunRanks({grouped, RankSetup{}}),
                {"rank 0 has parameter group 1: lr 0.5", "where rank 1 has parameters: 2"});
  std::vector<RankResult> same = RunRanks({grouped, grouped});
  for (const RankResult& x : same) EXPECT_TRUE(x.finish.ok()) << x.finish.ToString();
}

// int4 gradient blocks on one rank, int8 on another: the owners would decode the wrong code.
// (Compared only where qgZ is on.)
TEST(RankAgreement, AnotherGradientCodeIsNamed) {
  RankSetup int8;
  int8.quantized_gradients = true;
  RankSetup int4 = int8;
  int4.gradient_bits = 4;
  ExpectRefused(RunRanks({int8, int4}),
                {"zinf.quantized_gradient_bits: rank 0 has 8, rank 1 has 4"});
  // Without zero_quantized_gradients the key has no effect: not a reason to refuse a rank.
  RankSetup unused;
  unused.gradient_bits = 4;
  for (const RankResult& x : RunRanks({RankSetup{}, unused})) {
    EXPECT_TRUE(x.finish.ok()) << x.finish.ToString();
  }
}

// Blocks of 64 values on one rank, 256 on another: the sizes of every quantized collective
// would differ. (Compared only where a quantized collective is on.)
TEST(RankAgreement, AnotherQuantizationBlockIsNamed) {
  RankSetup b256;
  b256.quantized_gradients = true;
  RankSetup b64 = b256;
  b64.quant_block = 64;
  ExpectRefused(RunRanks({b256, b64}),
                {"zinf.quantization_block_size: rank 0 has 256, rank 1 has 64"});
  RankSetup unused;
  unused.quant_block = 64;
  for (const RankResult& x : RunRanks({RankSetup{}, unused})) {
    EXPECT_TRUE(x.finish.ok()) << x.finish.ToString();
  }
}

// One rank stepping per window and one per micro-batch would pair their collectives wrongly.
TEST(RankAgreement, AnotherScheduleIsNamed) {
  RankSetup layer;
  layer.layer_major = true;
  ExpectRefused(RunRanks({RankSetup{}, layer}),
                {"zinf.schedule: rank 0 has micro-batch, rank 1 has layer-major"});
}

TEST(RankAgreement, AnotherClippingIsNamed) {
  RankSetup other;
  other.clipping = 1.0;
  ExpectRefused(RunRanks({RankSetup{}, RankSetup{}, other}),
                {"gradient_clipping: rank 0 has 0, rank 2 has 1"});
}

// fp16 on one rank only, or with another scale: the ranks' scales would part.
TEST(RankAgreement, AnotherFp16SettingIsNamed) {
  RankSetup fp16;
  fp16.fp16_power = 16;
  ExpectRefused(RunRanks({RankSetup{}, fp16}), {"fp16.enabled: rank 0 has false, rank 1 has true"});
  RankSetup other = fp16;
  other.fp16_power = 32;
  ExpectRefused(RunRanks({fp16, other}),
                {"fp16.initial_scale_power: rank 0 has 16, rank 1 has 32"});
}

// Rank 1 with a layer more: gloo aborted on the first collective of another size before.
TEST(RankAgreement, AnotherModelIsNamed) {
  RankSetup other;
  other.layers = 3;
  ExpectRefused(RunRanks({RankSetup{}, other}), {"parameters: rank 0 has 2, rank 1 has 3"});
}

TEST(RankAgreement, ATrainersOwnSettingIsNamed) {
  RankSetup other;
  other.trainer_steps = "20";
  ExpectRefused(RunRanks({RankSetup{}, other}), {"trainer steps: rank 0 has 10, rank 1 has 20"});
}

TEST(RankAgreement, OtherInitialValuesAreNamed) {
  RankSetup other;
  other.seed = 8;
  ExpectRefused(RunRanks({RankSetup{}, other}),
                {"the ranks disagree on the initial parameter values",
                 "the initial value of 'layer0.weight' (xxh3): rank 0 has", "seed every rank"});
}

// SetParameterValues with other values (or other parameters) on one rank: refused on every
// rank before anything is written (before: each rank kept its slice of its own values, a
// parameter half one value, half the other). CompareAcrossRanks names what each rank does.
TEST(RankAgreement, ValuesSetDifferentlyAreRefusedAndNothingIsSet) {
  const int n = 2;
  std::vector<Status> set_other(n), set_same(n), compare(n);
  std::vector<std::vector<float>> after_other(n), after_same(n);
  OnThreadRanks(n, [&](int r, Device* device, Communicator* comm) {
    Result<std::unique_ptr<Engine>> engine = Engine::Create(Config(RankSetup{}), device, comm);
    if (!engine.ok()) {
      set_other[r] = engine.status();
      return;
    }
    ParamSpec p;
    p.name = "w";
    p.shape = {100};
    p.init = [](float* d, size_t k) {
      for (size_t i = 0; i < k; ++i) d[i] = 0.5f;
    };
    Result<ParamId> id = (*engine)->RegisterParameter(p);
    if (!id.ok() || !(*engine)->FinishRegistration().ok()) return;
    const float mine = static_cast<float>(r + 1);
    set_other[r] = (*engine)->SetParameterValues({*id}, [mine](ParamId, float* d) {
      for (int i = 0; i < 100; ++i) d[i] = mine;
      return Status::OK();
    });
    after_other[r].resize(100);
    (void)(*engine)->GatherMasterParameter(*id, after_other[r].data());  // checked below
    set_same[r] = (*engine)->SetParameterValues({*id}, [](ParamId, float* d) {
      for (int i = 0; i < 100; ++i) d[i] = 7.0f;
      return Status::OK();
    });
    after_same[r].resize(100);
    (void)(*engine)->GatherMasterParameter(*id, after_same[r].data());  // checked below
    compare[r] = (*engine)->CompareAcrossRanks(
        "what they do next", r == 0 ? "next: a write of 'w'" : "next: a forward", "Remedy.");
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_FALSE(set_other[r].ok()) << "rank " << r;
    EXPECT_NE(set_other[r].message().find("the ranks disagree on the parameter values being "
                                          "set: the values set for 'w' (xxh3): rank 0 has"),
              std::string::npos)
        << set_other[r].ToString();
    EXPECT_EQ(after_other[r], std::vector<float>(100, 0.5f)) << "rank " << r;
    EXPECT_TRUE(set_same[r].ok()) << set_same[r].ToString();
    EXPECT_EQ(after_same[r], std::vector<float>(100, 7.0f)) << "rank " << r;
    EXPECT_EQ(compare[r].message(),
              "the ranks disagree on what they do next: next: rank 0 has a write of 'w', rank 1 "
              "has a forward. Remedy.");
  }
}

// Runs `body(rank, engine)` on `ranks` thread ranks, each with one parameter registered.
// Runs body(rank, engine) on `ranks` thread ranks, each engine with one parameter "w" of
// 1000 elements registered (0.25, or init(rank)'s values) and registration finished.
using InitOf = std::function<std::function<void(float*, size_t)>(int rank)>;
std::vector<Status> OnRanks(int ranks, const std::function<Status(int, Engine*)>& body,
                            const InitOf& init = {}) {
  std::vector<Status> out(ranks);
  OnThreadRanks(ranks, [&](int r, Device* device, Communicator* comm) {
    out[r] = [&]() -> Status {
      ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                            Engine::Create(Config(RankSetup{}), device, comm));
      ParamSpec p;
      p.name = "w";
      p.shape = {1000};
      p.init = init ? init(r) : [](float* d, size_t k) {
        for (size_t i = 0; i < k; ++i) d[i] = 0.25f;
      };
      ZINF_RETURN_IF_ERROR(engine->RegisterParameter(p).status());
      ZINF_RETURN_IF_ERROR(engine->FinishRegistration());
      return body(r, engine.get());
    }();
  });
  return out;
}

// A checkpoint saved by 3 ranks, each with its own user data (Python's client_state), loaded
// by 2 and by 4: each rank gets the data its rank saved (before: every rank got rank 0's);
// rank 3, which the saving run did not have, gets rank 0's.
TEST(RankCheckpoint, AReshardedLoadGivesEachRankItsOwnUserData) {
  testing::TempDir dir;
  ASSERT_TRUE(dir.ok());
  for (const Status& s : OnRanks(3, [&](int r, Engine*e) {
         return e->SaveCheckpoint(dir.path(), "data of rank " + std::to_string(r));
       })) {
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  for (int ranks : {2, 4}) {
    std::vector<std::string> got(ranks);
    for (const Status& s :
         OnRanks(ranks, [&](int r, Engine*e) { return e->LoadCheckpoint(dir.path(), &got[r]); })) {
      ASSERT_TRUE(s.ok()) << s.ToString();
    }
    for (int r = 0; r < ranks; ++r) {
      EXPECT_EQ(got[r], "data of rank " + std::to_string(r < 3 ? r : 0))
          << ranks << " ranks, rank " << r;
    }
  }
}

// Ranks that initialise differently and then load the same weights (a checkpoint, or every
// parameter set alike) train: DeepSpeed scripts build an unseeded model on each rank and load
// right after initialize. A load of some parameters only leaves the others compared.
TEST(RankAgreement, DifferentInitialValuesReplacedByALoadAreNotRefused) {
  testing::TempDir dir;
  ASSERT_TRUE(dir.ok());
  for (const Status& s :
       OnRanks(2, [&](int r, Engine*e) { return e->SaveCheckpoint(dir.path(), ""); })) {
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  const InitOf init = [](int r) -> std::function<void(float*, size_t)> {
    return [r](float* d, size_t k) {
      for (size_t i = 0; i < k; ++i) d[i] = static_cast<float>(r * 10 + i % 7);
    };
  };
  // Then the values' first use: a gather.
  auto on_two = [&](const std::function<Status(Engine*)>& body) {
    return OnRanks(
        2,
        [&](int, Engine* e) -> Status {
          ZINF_RETURN_IF_ERROR(body(e));
          std::vector<float> v(1000);
          return e->GatherMasterParameter(0, v.data());
        },
        init);
  };
  for (const Status& s : on_two([&](Engine* e) { return e->LoadCheckpoint(dir.path()); })) {
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  for (const Status& s : on_two([](Engine* e) {
         return e->SetParameterValues({0}, [](ParamId, float* d) {
           for (int i = 0; i < 1000; ++i) d[i] = 3.0f;
           return Status::OK();
         });
       })) {
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  for (const Status& s : on_two([](Engine*) { return Status::OK(); })) {
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
    EXPECT_NE(s.message().find("the initial value of 'w'"), std::string::npos) << s.ToString();
  }
}

TEST(RankAgreement, RequireAgreementChecksItsArguments) {
  std::unique_ptr<Device> device = NewHostDevice({});
  Result<std::vector<std::unique_ptr<Communicator>>> comms = NewLocalComms({device.get()});
  ASSERT_TRUE(comms.ok());
  Result<std::unique_ptr<Engine>> engine =
      Engine::Create(Config(RankSetup{}), device.get(), (*comms)[0].get());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  EXPECT_EQ((*engine)->RequireAgreement("a: b", "c").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*engine)->RequireAgreement("a", "two\nlines").code(), StatusCode::kInvalidArgument);
  ParamSpec p;
  p.name = "w";
  p.shape = {8};
  p.init = [](float* d, size_t k) {
    for (size_t i = 0; i < k; ++i) d[i] = 1;
  };
  ASSERT_TRUE((*engine)->RegisterParameter(p).ok());
  ASSERT_TRUE((*engine)->FinishRegistration().ok());
  EXPECT_EQ((*engine)->RequireAgreement("late", "1").code(), StatusCode::kFailedPrecondition);
}

TEST(RankAgreement, FirstDifferenceNamesTheLine) {
  EXPECT_EQ(FirstDifference("a: 1\nb: 2\n", 3, "a: 1\nb: 5\n"), "b: rank 0 has 2, rank 3 has 5");
  EXPECT_EQ(FirstDifference("a: 1\n", 1, "a: 1\nc: 9\n"), "rank 1 has c: 9, which rank 0 has not");
  EXPECT_EQ(FirstDifference("a: 1\nc: 9\n", 1, "a: 1\n"), "rank 0 has c: 9, which rank 1 has not");
  EXPECT_EQ(FirstDifference("x: 1\n", 2, "y: 1\n"), "rank 0 has x: 1 where rank 2 has y: 1");
}

}  // namespace
}  // namespace zinf
