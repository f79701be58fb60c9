// HostDevice: memory budget and accounting, stream order, events (including re-recording),
// the compute stream's inline semantics, sticky errors, the simulated PCIe link, and strict
// mode (CUDA's asynchrony, adversarially).
#include "device/host/host_device.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <limits>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#include "tests/device_test_util.h"
#include "tests/test_util.h"
#include "zinf/cpu_adam.h"
#include "zinf/device.h"

namespace zinf {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr size_t kMiB = size_t{1} << 20;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

std::unique_ptr<Device> MakeDevice(size_t budget = size_t{1} << 30, double gbps = 0) {
  HostDeviceOptions options;
  options.memory_budget = budget;
  options.copy_gbps = gbps;
  return NewHostDevice(options);
}

Stream* MustCreateStream(Device* device, const std::string& name) {
  auto s = device->CreateStream(name);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? *s : nullptr;
}

using testing::Gate;

// A flag set by one host task; WaitFor gives up after a while instead of hanging the test.
// The task shares the flag's state, so it may outlive the Flag.
class Flag {
 public:
  std::function<void()> Task() {
    return [p = promise_] { p->set_value(); };
  }
  bool WaitFor(milliseconds d) const { return future_.wait_for(d) == std::future_status::ready; }
  bool IsSet() const { return WaitFor(milliseconds(0)); }

 private:
  std::shared_ptr<std::promise<void>> promise_ = std::make_shared<std::promise<void>>();
  std::shared_future<void> future_ = promise_->get_future().share();
};

TEST(HostDeviceTest, BudgetIsEnforcedAndAccountingIsExact) {
  auto device = MakeDevice(/*budget=*/1000000);
  auto a = device->Alloc(600000);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  auto b = device->Alloc(399999);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(*a) % kHostDeviceAlignment, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(*b) % kHostDeviceAlignment, 0u);
  DeviceMemoryInfo info = device->MemoryInfo();
  EXPECT_EQ(info.budget, 1000000u);
  EXPECT_EQ(info.used, 999999u);
  EXPECT_EQ(info.peak, 999999u);

  // One byte is left: two do not fit, and the message names the request, budget and use.
  auto c = device->Alloc(2);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kResourceExhausted);
  const std::string& m = c.status().message();
  EXPECT_NE(m.find("(2 bytes)"), std::string::npos) << m;
  EXPECT_NE(m.find("(1000000 bytes)"), std::string::npos) << m;
  EXPECT_NE(m.find("(999999 bytes)"), std::string::npos) << m;
  EXPECT_EQ(device->MemoryInfo().used, 999999u);  // a failed Alloc counts for nothing

  auto d = device->Alloc(1);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(device->MemoryInfo().used, 1000000u);

  // The memory is usable in full.
  std::memset(*a, 0xab, 600000);
  std::memset(*b, 0xcd, 399999);

  device->Free(*a);
  device->Free(*d);
  info = device->MemoryInfo();
  EXPECT_EQ(info.used, 399999u);
  EXPECT_EQ(info.peak, 1000000u);  // the peak stays

  auto e = device->Alloc(500000);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(device->MemoryInfo().used, 899999u);
  EXPECT_EQ(device->MemoryInfo().peak, 1000000u);

  // Alloc(0) gives distinct pointers that count for nothing.
  auto z1 = device->Alloc(0);
  auto z2 = device->Alloc(0);
  ASSERT_TRUE(z1.ok() && z2.ok());
  EXPECT_NE(*z1, *z2);
  EXPECT_EQ(device->MemoryInfo().used, 899999u);

  device->Free(*b);
  device->Free(*e);
  device->Free(*z1);
  device->Free(*z2);
  device->Free(nullptr);  // a no-op, like free()
  EXPECT_EQ(device->MemoryInfo().used, 0u);
  EXPECT_EQ(device->MemoryInfo().peak, 1000000u);
}

TEST(HostDeviceTest, ConcurrentAllocsNeverOvershootTheBudget) {
  constexpr size_t kBudget = 64 * 4096;
  auto device = MakeDevice(kBudget);
  std::atomic<int> successes{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 32; ++i) {
        if (device->Alloc(4096).ok()) ++successes;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(successes.load(), 64);
  EXPECT_EQ(device->MemoryInfo().used, kBudget);
  EXPECT_EQ(device->MemoryInfo().peak, kBudget);
  // The device frees what is still allocated when it goes.
}

TEST(HostDeviceDeathTest, FreeOfAnUnknownPointerIsAProgrammerError) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto device = MakeDevice();
  int not_device_memory = 0;
  EXPECT_DEATH(device->Free(&not_device_memory), "did not allocate");
  auto p = device->Alloc(16);
  ASSERT_TRUE(p.ok());
  device->Free(*p);
  EXPECT_DEATH(device->Free(*p), "freed twice");
}

TEST(HostDeviceTest, LaunchHostFuncRunsInOrderOnTheStreamThread) {
  std::vector<int> order;  // touched only by the stream thread until the synchronize
  std::vector<std::thread::id> ids;
  auto device = MakeDevice();
  Stream* stream = MustCreateStream(device.get(), "work");
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(device
                    ->LaunchHostFunc(stream,
                                     [&, i] {
                                       order.push_back(i);
                                       ids.push_back(std::this_thread::get_id());
                                     })
                    .ok());
  }
  ASSERT_TRUE(device->SynchronizeStream(stream).ok());
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
  for (auto id : ids) {
    EXPECT_EQ(id, ids[0]);
    EXPECT_NE(id, std::this_thread::get_id());
  }
}

TEST(HostDeviceTest, ReRecordingAnEventBeforeItCompletes) {
  auto device = MakeDevice();
  Stream* a = MustCreateStream(device.get(), "a");
  Stream* c = MustCreateStream(device.get(), "c");
  Stream* early_waiter = MustCreateStream(device.get(), "early");
  Stream* late_waiter = MustCreateStream(device.get(), "late");
  auto ev = device->CreateEvent();
  ASSERT_TRUE(ev.ok());

  Gate gate_a, gate_c;
  Flag early_done, late_done;
  ASSERT_TRUE(device->LaunchHostFunc(a, gate_a.Task()).ok());
  ASSERT_TRUE(device->RecordEvent(ev->get(), a).ok());                 // record 1, pending
  ASSERT_TRUE(device->StreamWaitEvent(early_waiter, ev->get()).ok());  // waits for record 1
  ASSERT_TRUE(device->LaunchHostFunc(early_waiter, early_done.Task()).ok());

  ASSERT_TRUE(device->LaunchHostFunc(c, gate_c.Task()).ok());
  ASSERT_TRUE(device->RecordEvent(ev->get(), c).ok());  // record 2 replaces it, pending
  ASSERT_TRUE(device->StreamWaitEvent(late_waiter, ev->get()).ok());  // waits for record 2
  ASSERT_TRUE(device->LaunchHostFunc(late_waiter, late_done.Task()).ok());

  // Record 1 completes: the early waiter goes, the late one and the event itself do not.
  gate_a.Open();
  EXPECT_TRUE(early_done.WaitFor(milliseconds(5000)));
  ASSERT_TRUE(device->SynchronizeStream(a).ok());
  EXPECT_FALSE(device->EventDone(ev->get()));
  EXPECT_FALSE(late_done.WaitFor(milliseconds(30)));

  gate_c.Open();
  EXPECT_TRUE(late_done.WaitFor(milliseconds(5000)));
  EXPECT_TRUE(device->SynchronizeEvent(ev->get()).ok());
  EXPECT_TRUE(device->EventDone(ev->get()));

  // Re-recording on the same stream, many times: each record completes in turn.
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(device->RecordEvent(ev->get(), a).ok());
  EXPECT_TRUE(device->SynchronizeEvent(ev->get()).ok());
  EXPECT_TRUE(device->EventDone(ev->get()));
}

TEST(HostDeviceTest, AnEventMayBeDestroyedWhileWaitsOnItAreQueued) {
  auto device = MakeDevice();
  Stream* a = MustCreateStream(device.get(), "a");
  Stream* b = MustCreateStream(device.get(), "b");
  Gate gate;
  Flag done;
  {
    auto ev = device->CreateEvent();
    ASSERT_TRUE(ev.ok());
    ASSERT_TRUE(device->LaunchHostFunc(a, gate.Task()).ok());
    ASSERT_TRUE(device->RecordEvent(ev->get(), a).ok());
    ASSERT_TRUE(device->StreamWaitEvent(b, ev->get()).ok());
    ASSERT_TRUE(device->LaunchHostFunc(b, done.Task()).ok());
  }
  EXPECT_FALSE(done.WaitFor(milliseconds(20)));
  gate.Open();
  EXPECT_TRUE(done.WaitFor(milliseconds(5000)));
}

TEST(HostDeviceTest, TheComputeStreamIsTheCallingThread) {
  auto device = MakeDevice();
  Stream* compute = device->ComputeStream();
  ASSERT_NE(compute, nullptr);
  EXPECT_EQ(compute, device->ComputeStream());

  // Host functions run inline, before the call returns.
  std::thread::id ran_on;
  ASSERT_TRUE(device->LaunchHostFunc(compute, [&] { ran_on = std::this_thread::get_id(); }).ok());
  EXPECT_EQ(ran_on, std::this_thread::get_id());

  // Copies are synchronous.
  std::vector<unsigned char> src(4096), out(4096, 0);
  testing::FillRandom(src.data(), src.size(), 7);
  auto d = device->Alloc(4096);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(device->CopyHostToDevice(*d, src.data(), 4096, compute).ok());
  ASSERT_TRUE(device->CopyDeviceToHost(out.data(), *d, 4096, compute).ok());
  EXPECT_EQ(out, src);
  device->Free(*d);

  // An event recorded on it is complete at once.
  auto ev = device->CreateEvent();
  ASSERT_TRUE(ev.ok());
  ASSERT_TRUE(device->RecordEvent(ev->get(), compute).ok());
  EXPECT_TRUE(device->EventDone(ev->get()));
  EXPECT_TRUE(device->SynchronizeStream(compute).ok());

  // Waiting on an event blocks the caller until it completes.
  Stream* side = MustCreateStream(device.get(), "side");
  Gate gate;
  std::atomic<bool> opened{false};
  ASSERT_TRUE(device->LaunchHostFunc(side, gate.Task()).ok());
  ASSERT_TRUE(device->RecordEvent(ev->get(), side).ok());
  std::thread opener([&] {
    std::this_thread::sleep_for(milliseconds(50));
    opened = true;
    gate.Open();
  });
  ASSERT_TRUE(device->StreamWaitEvent(compute, ev->get()).ok());
  EXPECT_TRUE(opened.load());
  EXPECT_TRUE(device->EventDone(ev->get()));
  opener.join();
}

TEST(HostDeviceTest, ATaskFailureIsStickyAndPropagatesThroughEvents) {
  std::atomic<int> later_ran{0};
  HostDevice device(HostDeviceOptions{});
  auto s = device.CreateStream("failing");
  auto t = device.CreateStream("downstream");
  ASSERT_TRUE(s.ok() && t.ok());
  ASSERT_TRUE(device.LaunchHostTask(*s, [] { return Status::IoError("simulated failure"); }).ok());
  // Work after the failure still runs (nothing queued behind it hangs).
  ASSERT_TRUE(device.LaunchHostFunc(*s, [&] { ++later_ran; }).ok());
  ASSERT_TRUE(device.LaunchHostTask(*s, [] { return Status::Corruption("second failure"); }).ok());
  auto ev = device.CreateEvent();
  ASSERT_TRUE(ev.ok());
  ASSERT_TRUE(device.RecordEvent(ev->get(), *s).ok());
  ASSERT_TRUE(device.StreamWaitEvent(*t, ev->get()).ok());

  Status first = device.SynchronizeStream(*s);
  EXPECT_EQ(first.code(), StatusCode::kIoError);
  EXPECT_NE(first.message().find("simulated failure"), std::string::npos);
  EXPECT_NE(first.message().find("failing"), std::string::npos);  // names the stream
  EXPECT_EQ(later_ran.load(), 1);
  EXPECT_EQ(device.SynchronizeStream(*s).code(), StatusCode::kIoError);  // sticky
  EXPECT_EQ(device.SynchronizeEvent(ev->get()).code(), StatusCode::kIoError);
  EXPECT_EQ(device.SynchronizeStream(*t).code(), StatusCode::kIoError);  // inherited

  // On the compute stream a task's failure is the call's own result.
  EXPECT_EQ(
      device.LaunchHostTask(device.ComputeStream(), [] { return Status::NotFound("x"); }).code(),
      StatusCode::kNotFound);
  // An exception escaping a host function becomes an error instead of terminating.
  auto u = device.CreateStream("throwing");
  ASSERT_TRUE(u.ok());
  ASSERT_TRUE(device.LaunchHostFunc(*u, [] { throw std::runtime_error("boom"); }).ok());
  Status thrown = device.SynchronizeStream(*u);
  EXPECT_EQ(thrown.code(), StatusCode::kInternal);
  EXPECT_NE(thrown.message().find("boom"), std::string::npos);
}

TEST(HostDeviceTest, ArgumentErrors) {
  auto device = MakeDevice();
  auto other = MakeDevice();
  Stream* s = MustCreateStream(device.get(), "s");
  Stream* foreign = MustCreateStream(other.get(), "foreign");
  char buf[16] = {};
  EXPECT_EQ(device->CopyHostToDevice(buf, buf, 16, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device->CopyHostToDevice(buf, buf, 16, foreign).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device->CopyHostToDevice(nullptr, buf, 16, s).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device->CopyDeviceToHost(buf, nullptr, 16, s).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(device->CopyDeviceToDevice(nullptr, nullptr, 0, s).ok());  // nothing to copy
  EXPECT_EQ(device->LaunchHostFunc(s, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device->RecordEvent(nullptr, s).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device->SynchronizeStream(foreign).code(), StatusCode::kInvalidArgument);
  // Events are not tied to a device.
  auto ev = other->CreateEvent();
  ASSERT_TRUE(ev.ok());
  EXPECT_TRUE(device->RecordEvent(ev->get(), s).ok());
  EXPECT_TRUE(other->SynchronizeEvent(ev->get()).ok());
}

// Device-side accumulation's two operations, ordered on the stream: AddInto is the host's
// `a += b`, SumSquares the CPU optimizer's GradSumSquares (the same order of additions, so
// the clipping norm is bit-identical wherever the gradients were summed), delivered when
// the stream reaches it.
TEST(HostDeviceTest, AddIntoAndSumSquaresMatchTheHostOnTheStream) {
  auto device = MakeDevice();
  Stream* s = MustCreateStream(device.get(), "s");
  const size_t n = 200003;  // several of the CPU sum's tiles, and a partial one
  std::vector<float> a(n), b(n);
  for (size_t i = 0; i < n; ++i) {
    a[i] = std::sin(static_cast<float>(i)) * 3.0f;
    b[i] = std::cos(static_cast<float>(i) * 0.7f) * 1e-3f;
  }
  b[77] = std::numeric_limits<float>::infinity();
  auto da = device->Alloc(n * sizeof(float));
  auto db = device->Alloc(n * sizeof(float));
  ASSERT_TRUE(da.ok() && db.ok());
  float* pa = static_cast<float*>(*da);
  float* pb = static_cast<float*>(*db);
  ASSERT_TRUE(device->CopyHostToDevice(pa, a.data(), n * sizeof(float), s).ok());
  ASSERT_TRUE(device->CopyHostToDevice(pb, b.data(), n * sizeof(float), s).ok());
  GradStats before, after, with_inf;
  ASSERT_TRUE(device->SumSquares(pa, n, &before, s).ok());
  ASSERT_TRUE(device->AddInto(pa, pb, 77, s).ok());  // the inf stays out of a
  ASSERT_TRUE(device->AddInto(pa + 78, pb + 78, n - 78, s).ok());
  ASSERT_TRUE(device->SumSquares(pa, n, &after, s).ok());
  ASSERT_TRUE(device->SumSquares(pb, n, &with_inf, s).ok());
  std::vector<float> got(n);
  ASSERT_TRUE(device->CopyDeviceToHost(got.data(), pa, n * sizeof(float), s).ok());
  ASSERT_TRUE(device->SynchronizeStream(s).ok());
  std::vector<float> want = a;
  for (size_t i = 0; i < n; ++i) {
    if (i != 77) want[i] += b[i];
  }
  EXPECT_EQ(std::memcmp(got.data(), want.data(), n * sizeof(float)), 0);
  // One thread, as the host device's own reducer: the tree of per-tile sums is the same for
  // any thread count (cpu_adam_test checks that), and oneTBB's worker threads are not
  // instrumented, so under ThreadSanitizer its task-pool reuse across threads reads as a race.
  CpuOptimizer::Options one_thread;
  one_thread.num_threads = 1;
  auto cpu = CpuOptimizer::Create(one_thread);
  ASSERT_TRUE(cpu.ok());
  auto ref_before = (*cpu)->GradSumSquares(a.data(), GradType::kF32, n);
  auto ref_after = (*cpu)->GradSumSquares(want.data(), GradType::kF32, n);
  ASSERT_TRUE(ref_before.ok() && ref_after.ok());
  EXPECT_EQ(before.sum_squares, ref_before->sum_squares);
  EXPECT_EQ(after.sum_squares, ref_after->sum_squares);
  EXPECT_NE(before.sum_squares, after.sum_squares);
  EXPECT_FALSE(before.has_inf_or_nan);
  EXPECT_FALSE(after.has_inf_or_nan);
  EXPECT_TRUE(with_inf.has_inf_or_nan);
  EXPECT_EQ(device->AddInto(nullptr, pb, 4, s).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device->SumSquares(pa, 4, nullptr, s).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device->SumSquares(nullptr, 4, &before, s).code(), StatusCode::kInvalidArgument);
  device->Free(pa);
  device->Free(pb);
}

TEST(HostDeviceTest, DestructionDrainsTheStreams) {
  std::atomic<int> ran{0};
  {
    auto device = MakeDevice();
    for (int i = 0; i < 3; ++i) {
      Stream* s = MustCreateStream(device.get(), std::string(1, static_cast<char>('a' + i)));
      for (int j = 0; j < 5; ++j) {
        ASSERT_TRUE(device
                        ->LaunchHostFunc(s,
                                         [&] {
                                           std::this_thread::sleep_for(milliseconds(2));
                                           ++ran;
                                         })
                        .ok());
      }
    }
  }
  EXPECT_EQ(ran.load(), 15);
}

// ---- Strict mode (HostDeviceOptions::strict) ---------------------------------------------------

std::unique_ptr<HostDevice> MakeStrict(uint64_t seed = 1) {
  HostDeviceOptions options;
  options.memory_budget = 64 * kMiB;
  options.strict = true;
  options.strict_seed = seed;
  return std::make_unique<HostDevice>(options);
}

// The compute stream is asynchronous: work on it runs on another thread after the call
// returns, and only a wait (stream or event) makes its result visible to the host.
TEST(HostDeviceStrictTest, TheComputeStreamIsAsynchronous) {
  auto device = MakeStrict();
  Stream* compute = device->ComputeStream();
  std::promise<void> gate;
  std::shared_future<void> open = gate.get_future().share();
  std::atomic<bool> ran{false};
  std::thread::id ran_on;
  ASSERT_TRUE(device
                  ->LaunchHostFunc(compute,
                                   [&, open] {
                                     open.wait();
                                     ran_on = std::this_thread::get_id();
                                     ran = true;
                                   })
                  .ok());
  auto ev = device->CreateEvent();
  ASSERT_TRUE(ev.ok());
  ASSERT_TRUE(device->RecordEvent(ev->get(), compute).ok());
  EXPECT_FALSE(ran.load());                    // the call did not run it
  EXPECT_FALSE(device->EventDone(ev->get()));  // nor has the stream reached the record
  gate.set_value();
  ASSERT_TRUE(device->SynchronizeStream(compute).ok());
  EXPECT_TRUE(ran.load());
  EXPECT_NE(ran_on, std::this_thread::get_id());
  EXPECT_TRUE(device->EventDone(ev->get()));
}

// Host functions of every stream run on one thread, one at a time: while one blocks, another
// stream's host function waits (as CUDA may serialise them), though other work goes on.
TEST(HostDeviceStrictTest, HostFunctionsOfAllStreamsRunOneAtATimeOnOneThread) {
  auto device = MakeStrict();
  Stream* a = MustCreateStream(device.get(), "a");
  Stream* b = MustCreateStream(device.get(), "b");
  std::promise<void> gate;
  std::shared_future<void> open = gate.get_future().share();
  std::atomic<bool> a_started{false}, b_ran{false};
  std::thread::id on_a, on_b;
  ASSERT_TRUE(device
                  ->LaunchHostFunc(a,
                                   [&, open] {
                                     on_a = std::this_thread::get_id();
                                     a_started = true;
                                     open.wait();
                                   })
                  .ok());
  while (!a_started.load()) std::this_thread::yield();
  ASSERT_TRUE(device
                  ->LaunchHostFunc(b,
                                   [&] {
                                     on_b = std::this_thread::get_id();
                                     b_ran = true;
                                   })
                  .ok());
  // A copy on a third stream still runs: only host functions share the thread.
  Stream* c = MustCreateStream(device.get(), "c");
  std::vector<char> src(4096, 7), dst(4096, 0);
  ASSERT_TRUE(device->CopyHostToDevice(dst.data(), src.data(), src.size(), c).ok());
  ASSERT_TRUE(device->SynchronizeStream(c).ok());
  EXPECT_EQ(dst, src);
  std::this_thread::sleep_for(milliseconds(50));
  EXPECT_FALSE(b_ran.load()) << "b's host function ran while a's was running";
  gate.set_value();
  ASSERT_TRUE(device->SynchronizeStream(a).ok());
  ASSERT_TRUE(device->SynchronizeStream(b).ok());
  EXPECT_TRUE(b_ran.load());
  EXPECT_EQ(on_a, on_b);
}

// A copy reads its source when it runs: a host buffer changed after the copy was issued (and
// before the stream reached it) is copied with the change. A missing wait shows up as data.
TEST(HostDeviceStrictTest, ACopyReadsItsSourceWhenItRuns) {
  auto device = MakeStrict();
  Stream* s = MustCreateStream(device.get(), "s");
  std::promise<void> gate;
  std::shared_future<void> open = gate.get_future().share();
  ASSERT_TRUE(device->LaunchHostFunc(s, [open] { open.wait(); }).ok());
  std::vector<float> src(1024, 1.0f), dst(1024, 0.0f);
  ASSERT_TRUE(device->CopyHostToDevice(dst.data(), src.data(), 4096, s).ok());
  src.assign(1024, 2.0f);
  gate.set_value();
  ASSERT_TRUE(device->SynchronizeStream(s).ok());
  EXPECT_EQ(dst[0], 2.0f);
  EXPECT_EQ(dst[1023], 2.0f);
}

// Freed device memory is overwritten with NaN: a stream still reading a buffer freed under it
// (a missing wait before Free) gets NaN, not the old values.
TEST(HostDeviceStrictTest, FreedMemoryIsPoisoned) {
  auto device = MakeStrict();
  Result<void*> p = device->Alloc(4096);
  ASSERT_TRUE(p.ok());
  auto* f = static_cast<float*>(*p);
  for (int i = 0; i < 1024; ++i) f[i] = 1.0f;
  device->Free(*p);
  for (int i = 0; i < 1024; ++i) ASSERT_TRUE(std::isnan(f[i])) << i;  // still mapped: the pool
  // A new allocation of the same range starts poisoned too (nothing of the old data remains).
  Result<void*> q = device->Alloc(4096);
  ASSERT_TRUE(q.ok());
  EXPECT_TRUE(std::isnan(static_cast<float*>(*q)[0]));
  device->Free(*q);
}

// A failed operation's error is sticky: every later launch on the stream returns it (nothing is
// queued), an event recorded there completes with it, and nothing waiting hangs.
TEST(HostDeviceStrictTest, AFailureIsReturnedByEveryLaterLaunch) {
  auto device = MakeStrict();
  Stream* s = MustCreateStream(device.get(), "failing");
  Stream* t = MustCreateStream(device.get(), "downstream");
  ASSERT_TRUE(device->LaunchHostTask(s, [] { return Status::IoError("simulated failure"); }).ok());
  EXPECT_EQ(device->SynchronizeStream(s).code(), StatusCode::kIoError);
  std::vector<char> buf(64);
  Status copy = device->CopyHostToDevice(buf.data(), buf.data() + 32, 32, s);
  EXPECT_EQ(copy.code(), StatusCode::kIoError);
  EXPECT_NE(copy.message().find("simulated failure"), std::string::npos) << copy.ToString();
  EXPECT_EQ(device->LaunchHostFunc(s, [] {}).code(), StatusCode::kIoError);
  auto ev = device->CreateEvent();
  ASSERT_TRUE(ev.ok());
  EXPECT_EQ(device->RecordEvent(ev->get(), s).code(), StatusCode::kIoError);
  EXPECT_EQ(device->SynchronizeEvent(ev->get()).code(), StatusCode::kIoError);  // no hang
  ASSERT_TRUE(device->StreamWaitEvent(t, ev->get()).ok());
  EXPECT_EQ(device->SynchronizeStream(t).code(), StatusCode::kIoError);  // inherited
  // The compute stream's failures are sticky too (it is a worker like the others).
  ASSERT_TRUE(
      device->LaunchHostTask(device->ComputeStream(), [] { return Status::NotFound("x"); }).ok());
  EXPECT_EQ(device->SynchronizeStream(device->ComputeStream()).code(), StatusCode::kNotFound);
}

// CUDA forbids device calls inside a host function (cudaLaunchHostFunc): strict mode refuses
// them, naming the call, so that an engine callback that queues or waits is caught here.
TEST(HostDeviceStrictTest, ADeviceCallFromAHostFunctionIsRefused) {
  auto device = MakeStrict();
  Stream* s = MustCreateStream(device.get(), "s");
  Status inner;
  ASSERT_TRUE(device->LaunchHostFunc(s, [&] { inner = device->SynchronizeStream(s); }).ok());
  ASSERT_TRUE(device->SynchronizeStream(s).ok());
  EXPECT_EQ(inner.code(), StatusCode::kFailedPrecondition) << inner.ToString();
  EXPECT_NE(inner.message().find("SynchronizeStream called from a host function"),
            std::string::npos)
      << inner.ToString();
  Status launch;
  ASSERT_TRUE(device
                  ->LaunchHostFunc(device->ComputeStream(),
                                   [&] { launch = device->LaunchHostFunc(s, [] {}); })
                  .ok());
  ASSERT_TRUE(device->SynchronizeStream(device->ComputeStream()).ok());
  EXPECT_EQ(launch.code(), StatusCode::kFailedPrecondition) << launch.ToString();
  // Memory bookkeeping is not a device call: Free from a host function is allowed.
  Result<void*> p = device->Alloc(4096);
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE(device->LaunchHostFunc(s, [&] { device->Free(*p); }).ok());
  ASSERT_TRUE(device->SynchronizeStream(s).ok());
  EXPECT_EQ(device->MemoryInfo().used, 0u);
}

// The link's schedule, without timing: reservations in one direction queue up.
TEST(CopyLinkTest, ReservationsShareTheLink) {
  CopyLink link(/*gbps=*/1.0);  // 1 byte per ns
  const auto t0 = CopyLink::Clock::now();
  const auto ms = [](int n) { return std::chrono::milliseconds(n); };
  EXPECT_EQ(link.Reserve(1000000, t0), t0 + ms(1));
  EXPECT_EQ(link.Reserve(1000000, t0), t0 + ms(2));  // a second copy at t0 queues behind
  EXPECT_EQ(link.Reserve(2000000, t0 + ms(1)), t0 + ms(4));
  EXPECT_EQ(link.Reserve(1000000, t0 + ms(10)), t0 + ms(11));  // an idle link starts now
  EXPECT_GE(link.chunk_bytes(), kMiB);
}

// Timing tests assert lower bounds (the cap is a floor on copy time by construction); upper
// bounds are only loose sanity checks because a loaded machine can delay any thread.
class HostDeviceLinkTest : public ::testing::Test {
 protected:
  // 16 MiB at 0.25 GB/s: 67.1 ms, as long as 64 MiB at 1 GB/s with a quarter of the page
  // faults (first-touching host memory dominates these tests' run time otherwise).
  static constexpr size_t kBytes = 16 * kMiB;
  static constexpr double kGbps = 0.25;
  static constexpr double kOneCopySeconds = kBytes / (kGbps * 1e9);

  void SetUp() override {
    device_ = MakeDevice(size_t{1} << 30, kGbps);
    for (int i = 0; i < 2; ++i) {
      auto d = device_->Alloc(kBytes);
      ASSERT_TRUE(d.ok());
      dev_[i] = *d;
      host_[i] = std::make_unique<testing::AlignedBuffer>(kBytes);
      testing::FillRandom(host_[i]->data(), kBytes, 100 + i);
    }
  }

  // Host buffers are declared first so that they outlive the device, which drains its
  // streams when destroyed.
  std::unique_ptr<testing::AlignedBuffer> host_[2];
  testing::AlignedBuffer out_{kBytes};
  std::unique_ptr<Device> device_;
  void* dev_[2] = {};
};

TEST_F(HostDeviceLinkTest, ACopyTakesAtLeastBytesOverBandwidth) {
  Stream* s = MustCreateStream(device_.get(), "h2d");
  const auto start = Clock::now();
  ASSERT_TRUE(device_->CopyHostToDevice(dev_[0], host_[0]->data(), kBytes, s).ok());
  ASSERT_TRUE(device_->SynchronizeStream(s).ok());
  const double elapsed = Seconds(Clock::now() - start);
  RecordProperty("elapsed_us", static_cast<int>(elapsed * 1e6));
  EXPECT_GE(elapsed, kOneCopySeconds * 0.99);
  EXPECT_EQ(std::memcmp(dev_[0], host_[0]->data(), kBytes), 0);
  ASSERT_TRUE(device_->CopyDeviceToDevice(dev_[1], dev_[0], kBytes, s).ok());
  ASSERT_TRUE(device_->SynchronizeStream(s).ok());
  EXPECT_EQ(std::memcmp(dev_[1], host_[0]->data(), kBytes), 0);
}

TEST_F(HostDeviceLinkTest, TwoStreamsInTheSameDirectionShareTheLink) {
  Stream* s0 = MustCreateStream(device_.get(), "h2d-0");
  Stream* s1 = MustCreateStream(device_.get(), "h2d-1");
  const auto start = Clock::now();
  ASSERT_TRUE(device_->CopyHostToDevice(dev_[0], host_[0]->data(), kBytes, s0).ok());
  ASSERT_TRUE(device_->CopyHostToDevice(dev_[1], host_[1]->data(), kBytes, s1).ok());
  ASSERT_TRUE(device_->SynchronizeStream(s0).ok());
  ASSERT_TRUE(device_->SynchronizeStream(s1).ok());
  const double elapsed = Seconds(Clock::now() - start);
  RecordProperty("elapsed_us", static_cast<int>(elapsed * 1e6));
  EXPECT_GE(elapsed, 2 * kOneCopySeconds * 0.99);
  EXPECT_EQ(std::memcmp(dev_[0], host_[0]->data(), kBytes), 0);
  EXPECT_EQ(std::memcmp(dev_[1], host_[1]->data(), kBytes), 0);
}

TEST_F(HostDeviceLinkTest, TheTwoDirectionsAreIndependent) {
  Stream* up = MustCreateStream(device_.get(), "h2d");
  Stream* down = MustCreateStream(device_.get(), "d2h");
  std::memcpy(dev_[1], host_[1]->data(), kBytes);
  const auto start = Clock::now();
  ASSERT_TRUE(device_->CopyHostToDevice(dev_[0], host_[0]->data(), kBytes, up).ok());
  ASSERT_TRUE(device_->CopyDeviceToHost(out_.data(), dev_[1], kBytes, down).ok());
  ASSERT_TRUE(device_->SynchronizeStream(up).ok());
  ASSERT_TRUE(device_->SynchronizeStream(down).ok());
  const double elapsed = Seconds(Clock::now() - start);
  RecordProperty("elapsed_us", static_cast<int>(elapsed * 1e6));
  EXPECT_GE(elapsed, kOneCopySeconds * 0.99);
  // Full duplex finishes in about one copy's time, a shared link would need two; but only the
  // lower bound holds on a busy machine (an upper bound failed under a sanitizer with a
  // parallel build), so the sharing rule itself is checked without timing by CopyLinkTest.
  EXPECT_EQ(std::memcmp(dev_[0], host_[0]->data(), kBytes), 0);
  EXPECT_EQ(std::memcmp(out_.data(), host_[1]->data(), kBytes), 0);
}

TEST_F(HostDeviceLinkTest, CopiesOnTheComputeStreamAreThrottledToo) {
  const auto start = Clock::now();
  ASSERT_TRUE(
      device_->CopyHostToDevice(dev_[0], host_[0]->data(), kBytes, device_->ComputeStream()).ok());
  EXPECT_GE(Seconds(Clock::now() - start), kOneCopySeconds * 0.99);
  EXPECT_EQ(std::memcmp(dev_[0], host_[0]->data(), kBytes), 0);
}

}  // namespace
}  // namespace zinf
