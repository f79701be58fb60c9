// Failures of the device and of collectives inside the engine, injected with FaultyDevice and
// FaultyComm: each must come back as an error naming the cause (and stop the engine where its
// state is torn), never as a hang, a silently freed buffer or a step that waits forever.
//
// Every test runs its engine on a thread under a watchdog: a hang fails the test (and ends the
// process, since the stuck thread cannot be joined) instead of stalling the suite.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "device/host/local_comm.h"
#include "engine/core/host_collectives.h"
#include "engine/core/layout.h"
#include "tests/faulty_device.h"
#include "tests/strict_device.h"
#include "tests/test_util.h"
#include "zinf/align.h"
#include "zinf/comm.h"
#include "zinf/config.h"
#include "zinf/device.h"
#include "zinf/engine.h"
#include "zinf/io.h"

namespace zinf {
namespace {

using testing::CommOp;
using testing::DeviceOp;
using testing::FaultyComm;
using testing::FaultyDevice;
using testing::HostReadable;
using testing::NewTestHostDevice;
using testing::TempDir;

constexpr size_t kNumel = 3000;

// Runs `body` on its own thread; a body still running after `limit` is a hang: the test
// fails and the process ends (a stuck engine thread cannot be joined).
void WithWatchdog(const std::function<void()>& body,
                  std::chrono::seconds limit = std::chrono::seconds(60)) {
  std::packaged_task<void()> task(body);
  std::future<void> done = task.get_future();
  std::thread t(std::move(task));
  if (done.wait_for(limit) != std::future_status::ready) {
    std::fprintf(stderr, "engine_fault_test: hung for %lld s (the failure was not propagated)\n",
                 static_cast<long long>(limit.count()));
    std::fflush(stderr);
    std::_Exit(3);
  }
  t.join();
  done.get();
}

EngineConfig CpuConfig() {
  EngineConfig c;
  c.offload_param.tier = Tier::kCpu;
  c.offload_optimizer.tier = Tier::kCpu;
  c.pinned_budget_bytes = 64ull << 20;
  c.param_persistence_threshold = 0;  // every parameter is evicted when released
  c.optimizer_threads = 1;
  return c;
}

// Registers two parameters ("w0", "w1") of kNumel elements.
void Register(Engine* e) {
  for (int p = 0; p < 2; ++p) {
    ParamSpec spec;
    spec.name = "w" + std::to_string(p);
    spec.shape = {static_cast<int64_t>(kNumel)};
    spec.init = [p](float* d, size_t n) {
      for (size_t i = 0; i < n; ++i) d[i] = 0.001f * static_cast<float>((i + p) % 97);
    };
    ASSERT_TRUE(e->RegisterParameter(spec).ok());
  }
}

// One training micro-step: acquire, "backward" with a constant gradient, release.
Status MicroStep(Engine* e, Device* device, float g) {
  std::vector<float> grad(kNumel, g);
  for (ParamId id : {0u, 1u}) {
    Result<std::vector<void*>> got = e->Acquire({id});
    if (!got.ok()) return got.status();
    void* dev = nullptr;
    ZINF_ASSIGN_OR_RETURN(dev, device->Alloc(kNumel * sizeof(float)));
    Status s =
        device->CopyHostToDevice(dev, grad.data(), kNumel * sizeof(float), device->ComputeStream());
    if (s.ok()) s = device->SynchronizeStream(device->ComputeStream());
    if (s.ok()) s = e->ReduceGradient(id, static_cast<float*>(dev));
    // The engine's copy out of `dev` is ordered on the compute stream: it must have run before
    // the buffer goes back (a pool's Free does not wait; the strict device poisons it).
    Status synced = device->SynchronizeStream(device->ComputeStream());
    if (s.ok()) s = synced;
    device->Free(dev);
    ZINF_RETURN_IF_ERROR(s);
    ZINF_RETURN_IF_ERROR(e->Release({id}));
  }
  return Status::OK();
}

struct OneRank {
  HostDeviceOptions options;
  FaultyDevice* device = nullptr;
  std::unique_ptr<Device> owned;
  std::unique_ptr<Communicator> comm;
  OneRank() {
    auto inner = NewTestHostDevice(options);
    Device* raw = inner.get();
    auto faulty = std::make_unique<FaultyDevice>(std::move(inner));
    device = faulty.get();
    owned = std::move(faulty);
    auto comms = NewLocalComms(std::vector<Device*>{raw}, LocalCommOptions{});
    EXPECT_TRUE(comms.ok());
    comm = std::move((*comms)[0]);
  }
};

// Two ranks on test host devices, with LocalComms whose collectives time out after 10 s (long
// enough for sanitizer builds).
struct TwoRanks {
  std::vector<std::unique_ptr<Device>> devices;
  std::vector<Device*> raw;
  Result<std::vector<std::unique_ptr<Communicator>>> comms =
      std::vector<std::unique_ptr<Communicator>>{};
  TwoRanks() {
    for (int r = 0; r < 2; ++r) {
      devices.push_back(NewTestHostDevice());
      raw.push_back(devices.back().get());
    }
    LocalCommOptions lo;
    lo.timeout = std::chrono::milliseconds(10000);
    comms = NewLocalComms(raw, lo);
  }
};

// A gradient accumulated onto an earlier one lands through a host function on the gradient
// stream. When that function cannot be queued the gradient never lands: the optimizer would
// wait for it forever, and so would Step(). ReduceGradient must fail and stop the engine.
TEST(EngineFaults, GradientLandingThatCannotBeQueuedStopsTheEngine) {
  WithWatchdog([] {
    OneRank r;
    EngineConfig c = CpuConfig();
    c.gradient_accumulation_steps = 2;  // the second micro-step accumulates
    auto e = Engine::Create(c, r.device, r.comm.get());
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    Register(e->get());
    ASSERT_TRUE(MicroStep(e->get(), r.device, 0.5f).ok());
    ASSERT_TRUE((*e)->Step().ok());
    // Second micro-step, first gradient: two host functions time its copy, the third lands it.
    r.device->FailAfter(DeviceOp::kLaunchHostFunc, "zinf-grad", 2);
    Status s = MicroStep(e->get(), r.device, 0.25f);
    ASSERT_EQ(r.device->injected(), 1);
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("injected device failure"), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find("landing the gradient of 'w0'"), std::string::npos) << s.ToString();
    Result<StepStats> st = (*e)->Step();
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.status().code(), StatusCode::kFailedPrecondition) << st.status().ToString();
    EXPECT_NE(st.status().message().find("recreate it"), std::string::npos)
        << st.status().ToString();
    e->reset();  // and closing does not hang either
  });
}

// The device operations of the gradient path: the bf16 rounding (gradient_transfer_dtype),
// the accumulation and the finite check of sub-groups stepped on the device. A failure of any
// of them reaches the trainer with its cause and stops the engine (part of a gradient may be
// in its accumulator); nothing hangs, and closing the engine does not either.
TEST(EngineFaults, FailedGradientDeviceOperationsStopTheEngineWithTheirCause) {
  struct Case {
    const char* name;
    DeviceOp op;
    const char* stream;
    bool device_steps;  // parameters and optimizer states on the device
    bool bf16;          // zinf.gradient_transfer_dtype "bf16"
    bool at_step;       // the failure surfaces at Step (the optimizer's), not ReduceGradient
  };
  const Case cases[] = {
      {"ConvertToBf16", DeviceOp::kConvertToBf16, "compute", false, true, false},
      {"AddInto", DeviceOp::kAddInto, "zinf-grad", true, false, false},
      {"SumSquares", DeviceOp::kSumSquares, "zinf-update", true, false, true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    WithWatchdog([&c] {
      OneRank r;
      EngineConfig config = CpuConfig();
      config.gradient_transfer_bf16 = c.bf16;
      config.gradient_accumulation_steps = 2;  // the second micro-step adds
      if (c.device_steps) {
        config.offload_param.tier = Tier::kDevice;
        config.offload_optimizer.tier = Tier::kDevice;
      }
      auto e = Engine::Create(config, r.device, r.comm.get());
      ASSERT_TRUE(e.ok()) << e.status().ToString();
      Register(e->get());
      if (c.op == DeviceOp::kAddInto) {
        ASSERT_TRUE(MicroStep(e->get(), r.device, 0.5f).ok());
        ASSERT_TRUE((*e)->Step().ok());
      }
      r.device->FailAfter(c.op, c.stream, 0);
      Status s = MicroStep(e->get(), r.device, 0.25f);
      if (c.at_step) {
        ASSERT_TRUE(s.ok()) << s.ToString();
        ASSERT_TRUE((*e)->Step().ok());  // not the boundary yet
        ASSERT_TRUE(MicroStep(e->get(), r.device, 0.25f).ok());
        s = (*e)->Step().status();
      }
      ASSERT_EQ(r.device->injected(), 1);
      ASSERT_FALSE(s.ok());
      EXPECT_NE(s.message().find("injected device failure"), std::string::npos) << s.ToString();
      // Stopped: the next call says so instead of going on with a torn gradient.
      Result<StepStats> st = (*e)->Step();
      ASSERT_FALSE(st.ok());
      EXPECT_EQ(st.status().code(), StatusCode::kFailedPrecondition) << st.status().ToString();
      e->reset();
    });
  }
}

// With bf16 transfer a later micro-step's gradient scratch holds the rounded partition too
// (2 bytes per element more). Eviction and prefetch must leave room for all of it: with a
// device budget that fits one parameter and that scratch but not a prefetched second
// parameter beside them, the gradient must not fail for want of device memory.
TEST(EngineFaults, Bf16GradientScratchIsPlannedWithTheRoundedPartition) {
  WithWatchdog([] {
    OneRank r;
    EngineConfig config = CpuConfig();
    config.gradient_transfer_bf16 = true;
    config.gradient_accumulation_steps = 2;
    // One rank: the full gradient and the partition are both `part` elements. Scratch of a
    // later micro-step: (part + part) * 4 + part * 2 = 10 * part bytes; a parameter: 4 * part.
    // The budget fits the engine's small-collective scratch, two parameters and 8 * part of
    // scratch (the fp32 room), not 10 * part.
    const uint64_t part = RoundUp(kNumel, kPartitionAlign);
    config.device_budget_bytes = HostCollectives::kSmallScratchBytes + 18 * part - 1;
    auto e = Engine::Create(config, r.device, r.comm.get());
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    Register(e->get());
    ASSERT_EQ((*e)->param(0).partition_numel, part);
    for (int micro = 0; micro < 4; ++micro) {
      Status s = MicroStep(e->get(), r.device, 0.5f);
      ASSERT_TRUE(s.ok()) << "micro-step " << micro << ": " << s.ToString();
      Result<StepStats> st = (*e)->Step();
      ASSERT_TRUE(st.ok()) << "micro-step " << micro << ": " << st.status().ToString();
    }
    e->reset();
  });
}

// Eviction gives the device copy back only once nothing can use it: after the compute
// stream's work so far. When that point cannot be marked, it is not known: Release reports it
// and keeps the memory; and when waiting for a marked point fails later, the buffer stays too.
TEST(EngineFaults, EvictionThatCannotOrderAfterComputeKeepsTheBufferAndSaysSo) {
  WithWatchdog([] {
    OneRank r;
    auto e = Engine::Create(CpuConfig(), r.device, r.comm.get());
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    Register(e->get());
    ASSERT_TRUE((*e)->Acquire({0}).ok());
    const size_t used = r.device->MemoryInfo().used;
    r.device->FailAfter(DeviceOp::kRecordEvent, "compute", 0);
    Status s = (*e)->Release({0});
    ASSERT_EQ(r.device->injected(), 1);
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("evicting parameter 'w0'"), std::string::npos) << s.ToString();
    EXPECT_EQ(r.device->MemoryInfo().used, used);  // nothing was freed under the device
    // w1's eviction is marked, but waiting for the mark fails when its room is needed: the
    // Acquire that needs it fails, and w1's buffer stays allocated.
    ASSERT_TRUE((*e)->Acquire({1}).ok());
    ASSERT_TRUE((*e)->Release({1}).ok());
    const size_t used_after = r.device->MemoryInfo().used;
    // (The compute stream past the mark, so that the next allocation collects it at once.)
    ASSERT_TRUE(HostReadable(r.device).ok());
    r.device->FailAfter(DeviceOp::kSynchronizeEvent, "", 0);
    Result<std::vector<void*>> got = (*e)->Acquire({1});
    ASSERT_EQ(r.device->injected(), 2);
    ASSERT_FALSE(got.ok());
    EXPECT_NE(got.status().message().find("waiting to free"), std::string::npos)
        << got.status().ToString();
    EXPECT_EQ(r.device->MemoryInfo().used, used_after);  // w1's old copy was not freed
  });
}

// Release never waits for the compute stream on the host (on a GPU the trainer runs ahead of
// its kernels): with the compute stream held up, a Release that evicts returns at once, and the
// buffer goes back only once the stream has passed the point the eviction marked.
TEST(EngineFaults, ReleaseDoesNotWaitForTheComputeStream) {
  WithWatchdog([] {
    HostDeviceOptions strict;
    strict.strict = true;  // an asynchronous compute stream, whatever the suite's mode
    strict.strict_seed = 5;
    std::unique_ptr<Device> device = NewHostDevice(strict);
    auto comms = NewLocalComms(std::vector<Device*>{device.get()}, LocalCommOptions{});
    ASSERT_TRUE(comms.ok());
    auto e = Engine::Create(CpuConfig(), device.get(), (*comms)[0].get());
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    Register(e->get());
    ASSERT_TRUE((*e)->Acquire({0}, AcquireMode::kInference).ok());
    const size_t held = device->MemoryInfo().used;
    // The trainer's kernels, still running: the compute stream is held until the gate opens.
    std::promise<void> gate;
    std::shared_future<void> open = gate.get_future().share();
    ASSERT_TRUE(device->LaunchHostFunc(device->ComputeStream(), [open] { open.wait(); }).ok());
    std::future<Status> released =
        std::async(std::launch::async, [&] { return (*e)->Release({0}); });
    const bool returned = released.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
    EXPECT_TRUE(returned) << "Release waited for the compute stream";
    EXPECT_EQ(device->MemoryInfo().used, held) << "freed while the compute stream may read it";
    gate.set_value();
    ASSERT_TRUE(released.get().ok());
    ASSERT_TRUE(device->SynchronizeStream(device->ComputeStream()).ok());
    // The next allocation collects it: fetching w0 again needs no more memory than before.
    ASSERT_TRUE((*e)->Acquire({0}, AcquireMode::kInference).ok());
    EXPECT_EQ(device->MemoryInfo().used, held);
    ASSERT_TRUE((*e)->Release({0}).ok());
  });
}

// Where the gradient's copy to the host runs. On a compute stream that runs behind the host
// (the strict host device, as a GPU), never on the compute stream: the compute stream only
// copies the gradient into device scratch, and the copy across the link runs on the gradient
// stream, ordered by an event. On the host device's inline compute stream the direct copy is
// the cheapest and is kept. Either way the values are the same.
TEST(EngineFaults, GradientCopiesToTheHostRunOffTheComputeStream) {
  WithWatchdog([] {
    std::vector<float> after[2];
    for (bool strict : {false, true}) {
      HostDeviceOptions options;
      options.strict = strict;
      options.strict_seed = 9;
      std::unique_ptr<Device> inner = NewHostDevice(options);
      Device* raw = inner.get();  // LocalComm runs on the host device itself
      auto faulty = std::make_unique<FaultyDevice>(std::move(inner));
      FaultyDevice* device = faulty.get();
      auto comms = NewLocalComms(std::vector<Device*>{raw}, LocalCommOptions{});
      ASSERT_TRUE(comms.ok());
      auto e = Engine::Create(CpuConfig(), device, (*comms)[0].get());
      ASSERT_TRUE(e.ok()) << e.status().ToString();
      Register(e->get());
      ASSERT_TRUE(MicroStep(e->get(), device, 0.5f).ok());
      ASSERT_TRUE((*e)->Step().ok());
      const int on_compute = device->calls(DeviceOp::kCopyDeviceToHost, "compute");
      const int on_grad = device->calls(DeviceOp::kCopyDeviceToHost, "zinf-grad");
      if (strict) {
        EXPECT_EQ(on_compute, 0) << "a gradient crossed to the host on the compute stream";
        EXPECT_EQ(on_grad, 2);  // w0's and w1's
      } else {
        EXPECT_EQ(on_compute, 2);
      }
      after[strict].resize(kNumel);
      ASSERT_TRUE((*e)->GatherMasterParameter(1, after[strict].data()).ok());
    }
    EXPECT_EQ(after[0], after[1]);
  });
}

// A copy that fails while a parameter is fetched: the Acquire fails naming the parameter,
// nothing stays acquired, and a later Acquire fetches it again and gets its values.
TEST(EngineFaults, FailedFetchCopyIsReportedAndTheNextAcquireFetchesAgain) {
  WithWatchdog([] {
    OneRank r;
    auto e = Engine::Create(CpuConfig(), r.device, r.comm.get());
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    Register(e->get());
    ASSERT_TRUE((*e)->FinishRegistration().ok());
    r.device->FailAfter(DeviceOp::kCopyHostToDevice, "zinf-copy", 0);
    Result<std::vector<void*>> got = (*e)->Acquire({1}, AcquireMode::kInference);
    ASSERT_EQ(r.device->injected(), 1);
    ASSERT_FALSE(got.ok());
    EXPECT_NE(got.status().message().find("injected device failure"), std::string::npos);
    EXPECT_FALSE((*e)->Release({1}).ok());  // not acquired
    got = (*e)->Acquire({1}, AcquireMode::kInference);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ASSERT_TRUE(HostReadable(r.device).ok());
    const float* v = static_cast<const float*>((*got)[0]);
    for (size_t i = 0; i < kNumel; ++i) {
      ASSERT_EQ(v[i], 0.001f * static_cast<float>((i + 1) % 97)) << i;
    }
  });
}

// A collective that fails on one rank (it never takes part): that rank's call fails with the
// cause, the other rank's wait ends at its communicator's timeout, both engines stop with an
// error and close. Nothing hangs.
TEST(EngineFaults, CollectiveFailingOnOneRankStopsBothRanks) {
  WithWatchdog([] {
    constexpr int kWorld = 2;
    TwoRanks two;
    ASSERT_TRUE(two.comms.ok()) << two.comms.status().ToString();
    std::vector<Device*>& raw = two.raw;
    auto& comms = two.comms;
    std::vector<std::unique_ptr<FaultyComm>> faulty;
    for (auto& c : *comms) faulty.push_back(std::make_unique<FaultyComm>(std::move(c)));
    faulty[1]->FailAfter(CommOp::kReduceScatterSum, 0);
    std::vector<Status> reduce(kWorld), step(kWorld);
    std::vector<std::thread> threads;
    for (int r = 0; r < kWorld; ++r) {
      threads.emplace_back([&, r] {
        auto e = Engine::Create(CpuConfig(), raw[r], faulty[r].get());
        if (!e.ok()) {
          reduce[r] = e.status();
          return;
        }
        Register(e->get());
        reduce[r] = MicroStep(e->get(), raw[r], 1.0f);
        Result<StepStats> st = (*e)->Step();
        step[r] = st.status();
      });
    }
    for (std::thread& t : threads) t.join();
    EXPECT_EQ(faulty[1]->injected(), 1);
    EXPECT_NE(reduce[1].message().find("injected collective failure on rank 1"), std::string::npos)
        << reduce[1].ToString();
    EXPECT_FALSE(step[1].ok());
    // Rank 0 issued its reduce-scatter on the comm stream; it fails at the timeout and the
    // failure reaches the trainer no later than Step().
    EXPECT_TRUE(!reduce[0].ok() || !step[0].ok())
        << "rank 0 finished a step whose reduction rank 1 never took part in";
  });
}

// A Release whose eviction fails still releases every other parameter it lists (a caller
// cannot tell which ones a partial release kept), and a Release naming a parameter that is not
// acquired changes nothing.
TEST(EngineFaults, ReleaseIsAllOrNothingForItsListAndEvictsTheRest) {
  WithWatchdog([] {
    OneRank r;
    auto e = Engine::Create(CpuConfig(), r.device, r.comm.get());
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    Register(e->get());
    ASSERT_TRUE((*e)->Acquire({0, 1}, AcquireMode::kInference).ok());
    Status bad = (*e)->Release({0, 7});  // 7 does not exist: nothing is released
    EXPECT_EQ(bad.code(), StatusCode::kFailedPrecondition) << bad.ToString();
    r.device->FailAfter(DeviceOp::kRecordEvent, "compute", 0);  // the first eviction's mark
    Status s = (*e)->Release({0, 1});
    ASSERT_EQ(r.device->injected(), 1);
    EXPECT_NE(s.message().find("evicting parameter 'w0'"), std::string::npos) << s.ToString();
    // Both were released: neither can be released again, and a checkpoint may be saved.
    EXPECT_EQ((*e)->Release({1}).code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ((*e)->Release({0}).code(), StatusCode::kFailedPrecondition);
    TempDir dir;
    Status saved = (*e)->SaveCheckpoint(dir.path() + "/ckpt", "{}");
    EXPECT_TRUE(saved.ok()) << saved.ToString();
  });
}

// An NVMe read that fails for a fetch: the Acquire fails naming the parameter (the read's
// result is known on the host before Acquire returns: it is never left to a stream callback
// that runs after the buffer was handed out, as it was on a GPU), the buffer the read never
// filled goes back at once (no stream ever touched it, so no wait can fail) and is never taken
// for the parameter's value: the next Acquire reads again and gets the values.
TEST(EngineFaults, BufferOfAFailedReadIsNeverTakenAndGoesBack) {
  WithWatchdog([] {
    OneRank r;
    TempDir dir;
    EngineConfig c = CpuConfig();
    c.offload_param.tier = Tier::kNvme;
    c.offload_param.nvme_paths = {dir.path()};
    EngineHooks hooks;
    hooks.fault_plan = std::make_shared<FaultPlan>();
    auto e = Engine::Create(c, r.device, r.comm.get(), hooks);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    Register(e->get());
    ASSERT_TRUE((*e)->FinishRegistration().ok());
    const size_t used = r.device->MemoryInfo().used;
    IoFault read_error;  // the next request (the fetch's read) fails with EIO
    hooks.fault_plan->AddAhead(read_error, 0);
    Result<std::vector<void*>> got = (*e)->Acquire({0}, AcquireMode::kInference);
    ASSERT_FALSE(got.ok());
    EXPECT_NE(got.status().message().find("fetching parameter 'w0'"), std::string::npos)
        << got.status().ToString();
    EXPECT_EQ(r.device->MemoryInfo().used, used) << "the failed read's device buffer stayed";
    const uint64_t requests = hooks.fault_plan->requests();
    got = (*e)->Acquire({0}, AcquireMode::kInference);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_GT(hooks.fault_plan->requests(), requests) << "the failed read's buffer was reused";
    ASSERT_TRUE(HostReadable(r.device).ok());
    const float* v = static_cast<const float*>((*got)[0]);
    for (size_t i = 0; i < kNumel; ++i) ASSERT_EQ(v[i], 0.001f * static_cast<float>(i % 97)) << i;
  });
}

// Two ranks, parameters on NVMe, and rank 0's read of w0 fails. Rank 0's Acquire reports it;
// rank 1 is not left waiting for a gather that rank 0 never issued (a hang on NCCL, or its next
// collective paired with the wrong one): rank 0 still takes part, sending NaN for its part, so
// rank 1 gets NaN there (never stale memory) and the right values for its own part.
TEST(EngineFaults, AFailedReadOnOneRankStillTakesPartInTheGather) {
  WithWatchdog([] {
    constexpr int kWorld = 2;
    TwoRanks two;
    ASSERT_TRUE(two.comms.ok()) << two.comms.status().ToString();
    std::vector<Device*>& raw = two.raw;
    auto& comms = two.comms;
    TempDir dir;
    std::vector<Status> got(kWorld);
    std::vector<std::vector<float>> values(kWorld);
    std::vector<size_t> partition(kWorld, 0);
    std::vector<std::thread> threads;
    for (int r = 0; r < kWorld; ++r) {
      threads.emplace_back([&, r] {
        EngineConfig c = CpuConfig();
        c.offload_param.tier = Tier::kNvme;
        c.offload_param.nvme_paths = {dir.path()};
        EngineHooks hooks;
        hooks.fault_plan = std::make_shared<FaultPlan>();
        auto e = Engine::Create(c, raw[r], (*comms)[r].get(), hooks);
        if (!e.ok()) {
          got[r] = e.status();
          return;
        }
        Register(e->get());
        got[r] = (*e)->FinishRegistration();
        if (!got[r].ok()) return;
        partition[r] = (*e)->param(0).partition_numel;
        if (r == 0) {
          IoFault read_error;  // rank 0's next request (the fetch's read) fails with EIO
          hooks.fault_plan->AddAhead(read_error, 0);
        }
        Result<std::vector<void*>> a = (*e)->Acquire({0}, AcquireMode::kInference);
        got[r] = a.status();
        if (!a.ok()) return;
        got[r] = HostReadable(raw[r]);
        if (!got[r].ok()) return;
        const float* v = static_cast<const float*>((*a)[0]);
        values[r].assign(v, v + kNumel);
        got[r] = (*e)->Release({0});
      });
    }
    for (std::thread& t : threads) t.join();
    ASSERT_FALSE(got[0].ok());
    EXPECT_NE(got[0].message().find("fetching parameter 'w0'"), std::string::npos)
        << got[0].ToString();
    ASSERT_TRUE(got[1].ok()) << got[1].ToString();
    ASSERT_EQ(values[1].size(), kNumel);
    ASSERT_GT(partition[1], 0u);
    for (size_t i = 0; i < kNumel; ++i) {
      if (i < partition[1]) {
        ASSERT_TRUE(std::isnan(values[1][i])) << i << ": rank 0's part is not NaN";
      } else {
        ASSERT_EQ(values[1][i], 0.001f * static_cast<float>(i % 97)) << i;
      }
    }
  });
}

// Writing new values into parameters on the device: a copy that fails part-way must not let
// the host buffers go while earlier copies still read them (the error is returned after they
// finished; ASan would see the use after free otherwise), and the engine stops.
TEST(EngineFaults, FailedCopyOfNewValuesReturnsAfterTheCopiesInFlight) {
  WithWatchdog([] {
    OneRank r;
    EngineConfig c = CpuConfig();
    c.offload_param.tier = Tier::kDevice;
    auto e = Engine::Create(c, r.device, r.comm.get());
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    Register(e->get());
    ASSERT_TRUE((*e)->FinishRegistration().ok());
    r.device->FailAfter(DeviceOp::kCopyHostToDevice, "zinf-update", 1);  // w1's copy
    Status s = (*e)->SetParameterValues({0, 1}, [](ParamId, float* full) {
      for (size_t i = 0; i < kNumel; ++i) full[i] = 2.0f;
      return Status::OK();
    });
    ASSERT_EQ(r.device->injected(), 1);
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("injected device failure"), std::string::npos) << s.ToString();
    EXPECT_EQ((*e)->Step().status().code(), StatusCode::kFailedPrecondition);  // stopped
  });
}

}  // namespace
}  // namespace zinf
