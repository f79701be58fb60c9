#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <future>
#include <thread>

#include "nvme/io_queue.h"
#include "tests/test_util.h"
#include "zinf/io.h"

namespace zinf {
namespace {

using testing::AlignedBuffer;
using testing::FillRandom;
using testing::TempDir;

class IoQueueTest : public ::testing::TestWithParam<IoBackendKind> {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dir_.ok());
    path_ = dir_.path() + "/data.bin";
    fd_ = open(path_.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
    ASSERT_GE(fd_, 0);
  }
  void TearDown() override { close(fd_); }

  std::unique_ptr<IoQueue> Start(uint32_t qd, uint32_t block,
                                 std::shared_ptr<FaultPlan> plan = {}) {
    IoBackendOptions bo;
    bo.queue_depth = qd;
    auto b = NewIoBackend(GetParam(), bo);
    EXPECT_TRUE(b.ok());
    std::unique_ptr<IoBackend> backend = std::move(b).value();
    if (plan) backend = NewFaultyBackend(std::move(backend), plan);
    IoQueueOptions qo;
    qo.block_size = block;
    auto q = IoQueue::Start(std::move(backend), {{fd_, path_}}, {}, qo);
    EXPECT_TRUE(q.ok()) << q.status().ToString();
    return q.ok() ? std::move(q).value() : nullptr;
  }

  static Status Run(IoQueue* q, const Transfer& t) {
    std::promise<Status> p;
    q->Submit(t, [&p](const Status& s) { p.set_value(s); });
    return p.get_future().get();
  }

  TempDir dir_;
  std::string path_;
  int fd_ = -1;
};

// A transfer much larger than the block size is cut into many requests and comes back exact.
TEST_P(IoQueueTest, LargeTransferSplitIntoBlocks) {
  auto q = Start(4, 64 << 10);
  ASSERT_NE(nullptr, q);
  const size_t n = 5 << 20;
  AlignedBuffer w(n), r(n);
  FillRandom(w.data(), n, 42);
  ASSERT_TRUE(Run(q.get(), {IoOp::kWrite, 0, 8192, w.data(), n}).ok());
  ASSERT_TRUE(Run(q.get(), {IoOp::kRead, 0, 8192, r.data(), n}).ok());
  EXPECT_EQ(0, std::memcmp(w.data(), r.data(), n));
  IoQueueStats st = q->Stats();
  EXPECT_EQ(2u * n / (64 << 10), st.requests);
  EXPECT_EQ(n, st.bytes_read);
  EXPECT_EQ(n, st.bytes_written);
}

// Reading past the end of the file is an error naming file, offset and length.
TEST_P(IoQueueTest, ReadPastEndIsAClearError) {
  auto q = Start(4, 64 << 10);
  ASSERT_NE(nullptr, q);
  AlignedBuffer r(8192);
  Status s = Run(q.get(), {IoOp::kRead, 0, 1 << 20, r.data(), 8192});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(std::string::npos, s.message().find("read of " + path_ + " at offset 1048576"))
      << s.message();
}

// Many transfers submitted at once from several threads all complete, each exactly once.
TEST_P(IoQueueTest, ManyTransfersFromManyThreads) {
  auto q = Start(8, 16 << 10);
  ASSERT_NE(nullptr, q);
  constexpr int kThreads = 4, kEach = 50;
  const size_t n = 20 << 10;
  AlignedBuffer w(n * kThreads * kEach);
  FillRandom(w.data(), w.size(), 1);
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::promise<Status>> ps(kEach);
      for (int i = 0; i < kEach; ++i) {
        size_t idx = static_cast<size_t>(t * kEach + i);
        q->Submit({IoOp::kWrite, 0, idx * n, w.data() + idx * n, n},
                  [&ps, i](const Status& s) { ps[i].set_value(s); });
      }
      for (auto& p : ps) ok += p.get_future().get().ok();
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(kThreads * kEach, ok.load());
  AlignedBuffer r(w.size());
  ASSERT_TRUE(Run(q.get(), {IoOp::kRead, 0, 0, r.data(), r.size()}).ok());
  EXPECT_EQ(0, std::memcmp(w.data(), r.data(), w.size()));
}

// A fault in one transfer fails that transfer only; the queue keeps serving others.
TEST_P(IoQueueTest, FaultFailsOnlyItsTransfer) {
  auto plan = std::make_shared<FaultPlan>();
  auto q = Start(4, 4096, plan);
  ASSERT_NE(nullptr, q);
  AlignedBuffer a(16384), b(16384);
  FillRandom(a.data(), a.size(), 2);
  IoFault f;
  f.kind = IoFault::Kind::kError;
  f.errno_value = EIO;
  f.first = 2;
  plan->Add(f);
  std::promise<Status> pa, pb;
  q->Submit({IoOp::kWrite, 0, 0, a.data(), a.size()}, [&](const Status& s) { pa.set_value(s); });
  Status sa = pa.get_future().get();
  EXPECT_EQ(EIO, sa.sys_errno()) << sa.ToString();
  q->Submit({IoOp::kWrite, 0, 65536, a.data(), a.size()},
            [&](const Status& s) { pb.set_value(s); });
  EXPECT_TRUE(pb.get_future().get().ok());
  // EAGAIN beyond the retry budget becomes an error rather than a livelock.
  IoFault again;
  again.kind = IoFault::Kind::kError;
  again.errno_value = EAGAIN;
  again.count = 1000;
  plan->AddAhead(again, 0);
  Status s = Run(q.get(), {IoOp::kRead, 0, 0, b.data(), 4096});
  EXPECT_EQ(EAGAIN, s.sys_errno()) << s.ToString();
}

// Wake() ends a blocked Reap even with nothing in flight.
TEST_P(IoQueueTest, WakeEndsBlockedReap) {
  IoBackendOptions bo;
  bo.queue_depth = 4;
  auto b = NewIoBackend(GetParam(), bo);
  ASSERT_TRUE(b.ok());
  auto backend = std::move(b).value();
  ASSERT_TRUE(backend->Start({{fd_, path_}}, {}).ok());
  std::thread waker([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    backend->Wake();
  });
  IoCompletion c[4];
  auto n = backend->Reap(c, 4, /*wait=*/true);
  waker.join();
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_EQ(0, n.value());
}

INSTANTIATE_TEST_SUITE_P(Backends, IoQueueTest,
                         ::testing::Values(IoBackendKind::kIoUring, IoBackendKind::kLibaio,
                                           IoBackendKind::kPsync),
                         [](const auto& info) {
                           return std::string(IoBackendKindName(info.param));
                         });

// SQPOLL (a kernel thread polls the submission ring) round-trips data, or falls back to a
// plain ring with a warning where the kernel refuses it.
TEST(IoBackendTest, SqpollRoundTripOrFallback) {
  TempDir dir;
  std::string path = dir.path() + "/sq.bin";
  int fd = open(path.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
  ASSERT_GE(fd, 0);
  IoBackendOptions bo;
  bo.queue_depth = 4;
  bo.sqpoll = true;
  IoQueueOptions qo;
  qo.block_size = 8192;
  auto q = IoQueue::Start(NewIoUringBackend(bo), {{fd, path}}, {}, qo);
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  AlignedBuffer w(65536), r(65536);
  FillRandom(w.data(), w.size(), 9);
  for (auto [op, buf] : {std::pair{IoOp::kWrite, &w}, std::pair{IoOp::kRead, &r}}) {
    std::promise<Status> p;
    (*q)->Submit({op, 0, 0, buf->data(), buf->size()}, [&p](const Status& s) { p.set_value(s); });
    ASSERT_TRUE(p.get_future().get().ok());
  }
  EXPECT_EQ(0, std::memcmp(w.data(), r.data(), w.size()));
  q->reset();
  close(fd);
}

// A rule armed `ahead` requests from now fires on exactly that request, even while another
// thread keeps issuing requests: reading requests() and then adding a rule with an absolute
// first request let a background request slip in between, so that the rule never fired (the
// engine fault tests flaked on it under the strict device).
TEST(FaultPlanTest, AddAheadCountsFromTheRequestsSeenUnderItsLock) {
  FaultPlan plan;
  IoFault f;
  IoFault got;
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(plan.Next(IoOp::kRead, &got));
  EXPECT_EQ(plan.AddAhead(f, 0), 3u);
  EXPECT_TRUE(plan.Next(IoOp::kWrite, &got));
  EXPECT_EQ(got.first, 3u);
  EXPECT_FALSE(plan.Next(IoOp::kRead, &got));
  EXPECT_EQ(plan.AddAhead(f, 2), 7u);
  EXPECT_FALSE(plan.Next(IoOp::kRead, &got));
  EXPECT_FALSE(plan.Next(IoOp::kRead, &got));
  EXPECT_TRUE(plan.Next(IoOp::kRead, &got));
  EXPECT_EQ(plan.fired(), 2u);
  EXPECT_EQ(plan.requests(), 8u);

  // Against a thread issuing requests all the time: every rule armed fires once.
  FaultPlan busy;
  std::atomic<bool> stop{false};
  std::thread issuer([&] {
    IoFault unused;
    while (!stop.load()) (void)busy.Next(IoOp::kRead, &unused);  // counted either way
  });
  constexpr uint64_t kRules = 200;
  uint64_t missed = 0;
  for (uint64_t k = 1; k <= kRules; ++k) {
    busy.AddAhead(f, 0);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (busy.fired() < k && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::yield();
    }
    if (busy.fired() < k) {
      ++missed;
      break;
    }
  }
  stop = true;
  issuer.join();
  EXPECT_EQ(missed, 0u) << "a rule armed from now never fired";
  EXPECT_EQ(busy.fired(), kRules);
}

TEST(IoBackendTest, ParseAndValidate) {
  EXPECT_EQ(IoBackendKind::kLibaio, ParseIoBackendKind("libaio").value());
  auto bad = ParseIoBackendKind("spdk");
  EXPECT_EQ(StatusCode::kInvalidArgument, bad.status().code());
  EXPECT_NE(std::string::npos, bad.status().message().find("io_uring, libaio or psync"));
  IoBackendOptions o;
  o.queue_depth = 0;
  EXPECT_FALSE(NewIoBackend(IoBackendKind::kIoUring, o).ok());
}

}  // namespace
}  // namespace zinf
