// LocalComm: exact results of every collective for 1, 2 and 4 ranks (sums bit-identical to
// the rank-order sum), stream ordering, argument errors and timeouts.
#include "device/host/local_comm.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "device/host/host_device.h"
#include "zinf/comm.h"
#include "zinf/device.h"

namespace zinf {
namespace {

using std::chrono::milliseconds;

// The reference: ((v[0] + v[1]) + v[2]) + ..., in float, as LocalComm promises.
float RankOrderSum(const std::vector<float>& v) {
  float acc = v[0];
  for (size_t r = 1; r < v.size(); ++r) acc += v[r];
  return acc;
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Values where the summation order changes the float result: 1e8 absorbs a 1 (float spacing
// at 1e8 is 8), so ((1e8 + 1) - 1e8) + 1 = 1 while ((1 + 1) + 1e8) - 1e8 = 0. Mixed with random
// values of very different magnitudes.
float Value(int rank, size_t i) {
  static const float kPattern[] = {1e8f, 1.0f, -1e8f, 1.0f, 3.0f, -7e7f, 0.5f, 2e7f};
  if (i % 3 == 0) return kPattern[(rank + i) % 8];
  std::mt19937 rng(static_cast<uint32_t>(rank * 1000003 + i));
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-20, 27);
  return std::ldexp(mantissa(rng), exponent(rng));
}

// N ranks, each with its own HostDevice (and a comm stream), run as threads.
class Ranks {
 public:
  explicit Ranks(int n, milliseconds timeout = milliseconds(60000), double gbps = 0) {
    std::vector<Device*> raw;
    for (int r = 0; r < n; ++r) {
      HostDeviceOptions options;
      options.copy_gbps = gbps;
      devices_.push_back(NewHostDevice(options));
      raw.push_back(devices_.back().get());
      auto s = devices_.back()->CreateStream("comm");
      EXPECT_TRUE(s.ok());
      streams_.push_back(s.ok() ? *s : nullptr);
    }
    LocalCommOptions options;
    options.timeout = timeout;
    auto comms = NewLocalComms(raw, options);
    EXPECT_TRUE(comms.ok()) << comms.status().ToString();
    if (comms.ok()) comms_ = std::move(*comms);
  }

  int size() const { return static_cast<int>(devices_.size()); }
  Device* device(int r) { return devices_[r].get(); }
  Stream* stream(int r) { return streams_[r]; }
  Communicator* comm(int r) { return comms_[r].get(); }

  // Runs fn(rank) on one thread per rank and joins them.
  void Run(const std::function<void(int rank)>& fn) {
    std::vector<std::thread> threads;
    for (int r = 0; r < size(); ++r) threads.emplace_back(fn, r);
    for (auto& t : threads) t.join();
  }

 private:
  std::vector<std::unique_ptr<Device>> devices_;
  std::vector<Stream*> streams_;
  std::vector<std::unique_ptr<Communicator>> comms_;
};

// Which stream the collectives go on: the rank thread itself, or a worker stream.
enum class On { kCompute, kWorker };
void PrintTo(On on, std::ostream* os) { *os << (on == On::kCompute ? "compute" : "worker"); }

class LocalCommTest : public ::testing::TestWithParam<std::tuple<int, On>> {
 protected:
  int world() const { return std::get<0>(GetParam()); }
  bool on_compute() const { return std::get<1>(GetParam()) == On::kCompute; }
  Stream* StreamOf(Ranks& ranks, int r) {
    return on_compute() ? ranks.device(r)->ComputeStream() : ranks.stream(r);
  }
  // After issuing: the collective is done when this returns OK.
  Status Finish(Ranks& ranks, int r) {
    return ranks.device(r)->SynchronizeStream(StreamOf(ranks, r));
  }
};

TEST_P(LocalCommTest, RanksAndWorldSize) {
  Ranks ranks(world());
  for (int r = 0; r < world(); ++r) {
    EXPECT_EQ(ranks.comm(r)->rank(), r);
    EXPECT_EQ(ranks.comm(r)->world_size(), world());
  }
}

TEST_P(LocalCommTest, AllGather) {
  const int n = world();
  constexpr size_t kBytes = 10007;  // odd: no alignment assumptions
  Ranks ranks(n);
  std::vector<std::vector<unsigned char>> send(n), recv(n);
  for (int r = 0; r < n; ++r) {
    send[r].resize(kBytes);
    for (size_t i = 0; i < kBytes; ++i) send[r][i] = static_cast<unsigned char>(r * 31 + i * 7);
    recv[r].assign(n * kBytes, 0xee);
  }
  std::vector<Status> status(n);
  ranks.Run([&](int r) {
    status[r] =
        ranks.comm(r)->AllGather(send[r].data(), recv[r].data(), kBytes, StreamOf(ranks, r));
    if (status[r].ok()) status[r] = Finish(ranks, r);
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r].ToString();
    for (int q = 0; q < n; ++q) {
      EXPECT_EQ(std::memcmp(recv[r].data() + q * kBytes, send[q].data(), kBytes), 0)
          << "rank " << r << " chunk " << q;
    }
  }
}

TEST_P(LocalCommTest, AllGatherInPlace) {
  const int n = world();
  constexpr size_t kBytes = 4096;
  Ranks ranks(n);
  std::vector<std::vector<unsigned char>> buf(n);
  for (int r = 0; r < n; ++r) {
    buf[r].assign(n * kBytes, 0);
    std::memset(buf[r].data() + r * kBytes, r + 1, kBytes);
  }
  std::vector<Status> status(n);
  ranks.Run([&](int r) {
    unsigned char* mine = buf[r].data() + r * kBytes;
    status[r] = ranks.comm(r)->AllGather(mine, buf[r].data(), kBytes, StreamOf(ranks, r));
    if (status[r].ok()) status[r] = Finish(ranks, r);
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r].ToString();
    for (int q = 0; q < n; ++q) {
      EXPECT_EQ(std::vector<unsigned char>(buf[r].begin() + q * kBytes,
                                           buf[r].begin() + (q + 1) * kBytes),
                std::vector<unsigned char>(kBytes, static_cast<unsigned char>(q + 1)));
    }
  }
}

TEST_P(LocalCommTest, ReduceScatterSumIsTheRankOrderSum) {
  const int n = world();
  constexpr size_t kCount = 3001;  // not a multiple of the summation block
  Ranks ranks(n);
  std::vector<std::vector<float>> send(n), recv(n);
  for (int r = 0; r < n; ++r) {
    send[r].resize(n * kCount);
    for (size_t i = 0; i < send[r].size(); ++i) send[r][i] = Value(r, i);
    recv[r].assign(kCount, -1.0f);
  }
  std::vector<Status> status(n);
  ranks.Run([&](int r) {
    status[r] =
        ranks.comm(r)->ReduceScatterSum(send[r].data(), recv[r].data(), kCount, StreamOf(ranks, r));
    if (status[r].ok()) status[r] = Finish(ranks, r);
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r].ToString();
    std::vector<float> expected(kCount);
    for (size_t i = 0; i < kCount; ++i) {
      std::vector<float> terms;
      for (int q = 0; q < n; ++q) terms.push_back(send[q][r * kCount + i]);
      expected[i] = RankOrderSum(terms);
    }
    EXPECT_TRUE(BitEqual(recv[r], expected)) << "rank " << r;
  }
}

TEST_P(LocalCommTest, ReduceScatterSumInPlace) {
  const int n = world();
  constexpr size_t kCount = 1500;
  Ranks ranks(n);
  std::vector<std::vector<float>> buf(n), original(n);
  for (int r = 0; r < n; ++r) {
    buf[r].resize(n * kCount);
    for (size_t i = 0; i < buf[r].size(); ++i) buf[r][i] = Value(r + 7, i);
    original[r] = buf[r];
  }
  std::vector<Status> status(n);
  ranks.Run([&](int r) {
    float* mine = buf[r].data() + r * kCount;
    status[r] = ranks.comm(r)->ReduceScatterSum(buf[r].data(), mine, kCount, StreamOf(ranks, r));
    if (status[r].ok()) status[r] = Finish(ranks, r);
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r].ToString();
    std::vector<float> expected(kCount),
        got(buf[r].begin() + r * kCount, buf[r].begin() + (r + 1) * kCount);
    for (size_t i = 0; i < kCount; ++i) {
      std::vector<float> terms;
      for (int q = 0; q < n; ++q) terms.push_back(original[q][r * kCount + i]);
      expected[i] = RankOrderSum(terms);
    }
    EXPECT_TRUE(BitEqual(got, expected)) << "rank " << r;
  }
}

TEST_P(LocalCommTest, AllReduceSumIsTheRankOrderSumOnEveryRank) {
  const int n = world();
  for (size_t count : {size_t{1}, size_t{3}, size_t{5000}}) {  // fewer elements than ranks too
    Ranks ranks(n);
    std::vector<std::vector<float>> buf(n), original(n);
    for (int r = 0; r < n; ++r) {
      buf[r].resize(count);
      for (size_t i = 0; i < count; ++i) buf[r][i] = Value(r, i);
      original[r] = buf[r];
    }
    std::vector<Status> status(n);
    ranks.Run([&](int r) {
      status[r] = ranks.comm(r)->AllReduceSum(buf[r].data(), count, StreamOf(ranks, r));
      if (status[r].ok()) status[r] = Finish(ranks, r);
    });
    std::vector<float> expected(count);
    for (size_t i = 0; i < count; ++i) {
      std::vector<float> terms;
      for (int q = 0; q < n; ++q) terms.push_back(original[q][i]);
      expected[i] = RankOrderSum(terms);
    }
    for (int r = 0; r < n; ++r) {
      ASSERT_TRUE(status[r].ok()) << status[r].ToString();
      EXPECT_TRUE(BitEqual(buf[r], expected)) << "rank " << r << " count " << count;
    }
  }
}

// The order is observable: with these four values any other order gives another result.
TEST(LocalCommOrderTest, SumsFollowRankOrderNotArrival) {
  const std::vector<float> values = {1e8f, 1.0f, -1e8f, 1.0f};
  ASSERT_EQ(RankOrderSum(values), 1.0f);
  ASSERT_EQ(((values[3] + values[1]) + values[0]) + values[2], 0.0f);  // another order
  for (int trial = 0; trial < 5; ++trial) {
    Ranks ranks(4);
    std::vector<std::vector<float>> buf(4);
    std::vector<Status> status(4);
    ranks.Run([&](int r) {
      // Stagger arrivals, last rank first, so that arrival order differs from rank order.
      std::this_thread::sleep_for(milliseconds(2 * (3 - r)));
      buf[r].assign(8, values[r]);
      status[r] = ranks.comm(r)->AllReduceSum(buf[r].data(), 8, ranks.stream(r));
      if (status[r].ok()) status[r] = ranks.device(r)->SynchronizeStream(ranks.stream(r));
    });
    for (int r = 0; r < 4; ++r) {
      ASSERT_TRUE(status[r].ok()) << status[r].ToString();
      EXPECT_EQ(buf[r], std::vector<float>(8, 1.0f)) << "rank " << r;
    }
  }
}

TEST_P(LocalCommTest, BroadcastFromEveryRoot) {
  const int n = world();
  constexpr size_t kBytes = 5000;
  Ranks ranks(n);
  for (int root = 0; root < n; ++root) {
    std::vector<std::vector<unsigned char>> buf(n);
    for (int r = 0; r < n; ++r) buf[r].assign(kBytes, static_cast<unsigned char>(100 + r));
    std::vector<Status> status(n);
    ranks.Run([&](int r) {
      status[r] = ranks.comm(r)->Broadcast(buf[r].data(), kBytes, root, StreamOf(ranks, r));
      if (status[r].ok()) status[r] = Finish(ranks, r);
    });
    for (int r = 0; r < n; ++r) {
      ASSERT_TRUE(status[r].ok()) << status[r].ToString();
      EXPECT_EQ(buf[r], std::vector<unsigned char>(kBytes, static_cast<unsigned char>(100 + root)))
          << "rank " << r << " root " << root;
    }
  }
}

TEST_P(LocalCommTest, BarrierWaitsForEveryRank) {
  const int n = world();
  Ranks ranks(n);
  std::atomic<int> arrived{0};
  std::vector<int> seen(n, -1);
  std::vector<Status> status(n);
  ranks.Run([&](int r) {
    for (int round = 0; round < 20; ++round) {
      ++arrived;
      status[r] = ranks.comm(r)->Barrier();
      if (!status[r].ok()) return;
      // Everyone has incremented for this round before anyone leaves it.
      if (arrived.load() < (round + 1) * n) seen[r] = round;
      // A second barrier so no rank starts the next round's increment early.
      status[r] = ranks.comm(r)->Barrier();
      if (!status[r].ok()) return;
    }
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r].ToString();
    EXPECT_EQ(seen[r], -1) << "rank " << r << " left the barrier early in round " << seen[r];
  }
  EXPECT_EQ(arrived.load(), 20 * n);
}

// Many collectives in a row, mixed, some queued on the stream while others run.
TEST_P(LocalCommTest, ManyCollectivesInSequence) {
  const int n = world();
  constexpr int kRounds = 50;
  constexpr size_t kCount = 257;
  Ranks ranks(n);
  std::vector<std::vector<float>> result(n);
  std::vector<Status> status(n);
  ranks.Run([&](int r) {
    Communicator* comm = ranks.comm(r);
    Stream* s = StreamOf(ranks, r);
    std::vector<std::vector<float>> bufs(kRounds, std::vector<float>(kCount));
    Status issued;
    for (int k = 0; k < kRounds && issued.ok(); ++k) {
      for (size_t i = 0; i < kCount; ++i) bufs[k][i] = static_cast<float>(r + k + i);
      issued = comm->AllReduceSum(bufs[k].data(), kCount, s);
      if (issued.ok()) {
        issued = comm->Broadcast(bufs[k].data(), kCount * sizeof(float), k % n, s);
      }
    }
    // Always synchronize: the queued collectives use bufs.
    Status synced = ranks.device(r)->SynchronizeStream(s);
    status[r] = issued.ok() ? synced : issued;
    result[r] = bufs[kRounds - 1];
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r].ToString();
    for (size_t i = 0; i < kCount; ++i) {
      // sum over q of (q + k + i), exact in float at these magnitudes
      const float k = kRounds - 1;
      EXPECT_EQ(result[r][i], n * (k + i) + n * (n - 1) / 2) << "rank " << r << " i " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, LocalCommTest,
                         ::testing::Combine(::testing::Values(1, 2, 4),
                                            ::testing::Values(On::kCompute, On::kWorker)),
                         [](const ::testing::TestParamInfo<std::tuple<int, On>>& info) {
                           return "world" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) == On::kCompute ? "_compute"
                                                                           : "_worker");
                         });

// A collective on a worker stream runs after the work queued before it there: here a
// throttled (slow) host-to-device copy that produces the buffer the collective sends.
TEST(LocalCommStreamTest, ACollectiveSeesEarlierWorkOnItsStream) {
  constexpr int kRanks = 2;
  constexpr size_t kBytes = size_t{4} << 20;  // 4 MiB at 0.2 GB/s: about 21 ms per copy
  std::vector<std::vector<unsigned char>> host(kRanks), out(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    host[r].assign(kBytes, static_cast<unsigned char>(0x10 + r));
    out[r].assign(kRanks * kBytes, 0);
  }
  Ranks ranks(kRanks, milliseconds(60000), /*gbps=*/0.2);
  std::vector<Status> status(kRanks);
  ranks.Run([&](int r) {
    Device* device = ranks.device(r);
    Stream* s = ranks.stream(r);
    auto send = device->Alloc(kBytes);
    auto recv = device->Alloc(kRanks * kBytes);
    if (!send.ok() || !recv.ok()) {
      status[r] = Status::Internal("alloc failed");
      return;
    }
    std::memset(*send, 0, kBytes);
    status[r] = device->CopyHostToDevice(*send, host[r].data(), kBytes, s);
    if (status[r].ok()) status[r] = ranks.comm(r)->AllGather(*send, *recv, kBytes, s);
    if (status[r].ok()) {
      status[r] = device->CopyDeviceToHost(out[r].data(), *recv, kRanks * kBytes, s);
    }
    if (status[r].ok()) status[r] = device->SynchronizeStream(s);
    device->Free(*send);
    device->Free(*recv);
  });
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r].ToString();
    for (int q = 0; q < kRanks; ++q) {
      EXPECT_EQ(std::vector<unsigned char>(out[r].begin() + q * kBytes,
                                           out[r].begin() + (q + 1) * kBytes),
                host[q])
          << "rank " << r << " chunk " << q;
    }
  }
}

// Events order a collective on the comm stream after work on another stream.
TEST(LocalCommStreamTest, ACollectiveWaitsForAnEvent) {
  constexpr int kRanks = 2;
  Ranks ranks(kRanks);
  std::vector<std::vector<float>> buf(kRanks, std::vector<float>(1000, 0.0f));
  std::vector<Status> status(kRanks);
  ranks.Run([&](int r) {
    Device* device = ranks.device(r);
    auto producer = device->CreateStream("producer");
    auto ev = device->CreateEvent();
    if (!producer.ok() || !ev.ok()) {
      status[r] = Status::Internal("setup failed");
      return;
    }
    status[r] = device->LaunchHostFunc(*producer, [&buf, r] {
      std::this_thread::sleep_for(milliseconds(20));  // slow producer
      for (float& x : buf[r]) x = static_cast<float>(r + 1);
    });
    if (status[r].ok()) status[r] = device->RecordEvent(ev->get(), *producer);
    if (status[r].ok()) status[r] = device->StreamWaitEvent(ranks.stream(r), ev->get());
    if (status[r].ok())
      status[r] = ranks.comm(r)->AllReduceSum(buf[r].data(), 1000, ranks.stream(r));
    if (status[r].ok()) status[r] = device->SynchronizeStream(ranks.stream(r));
  });
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r].ToString();
    EXPECT_EQ(buf[r], std::vector<float>(1000, 3.0f));
  }
}

TEST(LocalCommErrorTest, AMissingRankTimesOutInsteadOfHanging) {
  Ranks ranks(3, milliseconds(200));
  std::vector<float> buf0(16, 1.0f), buf1(16, 2.0f);
  Status on_compute, on_worker;
  const auto start = std::chrono::steady_clock::now();
  // Ranks 0 and 1 join; rank 2 never does.
  std::thread rank1([&] {
    on_worker = ranks.comm(1)->AllReduceSum(buf1.data(), 16, ranks.stream(1));
    if (on_worker.ok()) on_worker = ranks.device(1)->SynchronizeStream(ranks.stream(1));
  });
  on_compute = ranks.comm(0)->AllReduceSum(buf0.data(), 16, ranks.device(0)->ComputeStream());
  rank1.join();
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(elapsed, 0.2);
  EXPECT_LT(elapsed, 30.0);  // far below the default 60 s: the option took effect

  // On the compute stream the call returns the error; on a worker stream the stream's sticky
  // error carries it.
  EXPECT_EQ(on_compute.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(on_worker.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(on_compute.message().find("timed out"), std::string::npos) << on_compute.ToString();
  EXPECT_NE(on_compute.message().find("rank(s) 2"), std::string::npos) << on_compute.ToString();
  EXPECT_NE(on_worker.message().find("AllReduceSum"), std::string::npos) << on_worker.ToString();

  // The group is broken: later collectives fail at once, on every rank.
  const auto later = std::chrono::steady_clock::now();
  EXPECT_EQ(ranks.comm(2)->Barrier().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(ranks.comm(0)->Barrier().code(), StatusCode::kFailedPrecondition);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - later).count(), 0.2);
}

TEST(LocalCommErrorTest, MismatchedCollectivesFailTheGroup) {
  Ranks ranks(2, milliseconds(5000));
  std::vector<float> buf(64, 1.0f);
  std::vector<unsigned char> bytes(64 * sizeof(float), 0);
  Status s0, s1;
  std::thread t([&] {
    s1 = ranks.comm(1)->Broadcast(bytes.data(), bytes.size(), 0, ranks.device(1)->ComputeStream());
  });
  s0 = ranks.comm(0)->AllReduceSum(buf.data(), 64, ranks.device(0)->ComputeStream());
  t.join();
  // Whichever arrives second detects the mismatch; both fail at once rather than timing out.
  EXPECT_EQ(s0.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s1.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s0.message().find("mismatch"), std::string::npos) << s0.ToString();
}

TEST(LocalCommErrorTest, BadArgumentsFailThatCollectiveOnEveryRankAndNothingElse) {
  Ranks ranks(2, milliseconds(5000));
  std::vector<float> buf0(8, 1.0f), buf1(8, 2.0f);
  Status bad, peer;
  std::thread t([&] {
    peer = ranks.comm(1)->AllReduceSum(buf1.data(), 8, ranks.device(1)->ComputeStream());
  });
  bad = ranks.comm(0)->AllReduceSum(nullptr, 8, ranks.device(0)->ComputeStream());
  t.join();
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(peer.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(peer.message().find("rank 0"), std::string::npos) << peer.ToString();

  // The group is still usable, and both ranks stay in step.
  Status s0, s1;
  std::thread t2(
      [&] { s1 = ranks.comm(1)->AllReduceSum(buf1.data(), 8, ranks.device(1)->ComputeStream()); });
  s0 = ranks.comm(0)->AllReduceSum(buf0.data(), 8, ranks.device(0)->ComputeStream());
  t2.join();
  ASSERT_TRUE(s0.ok()) << s0.ToString();
  ASSERT_TRUE(s1.ok()) << s1.ToString();
  EXPECT_EQ(buf0, std::vector<float>(8, 3.0f));
  EXPECT_EQ(buf1, std::vector<float>(8, 3.0f));

  // A bad root and a stream of another device are argument errors too.
  EXPECT_EQ(ranks.comm(0)->Broadcast(buf0.data(), 32, 2, ranks.stream(0)).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ranks.comm(0)->Broadcast(buf0.data(), 32, 0, ranks.stream(1)).code(),
            StatusCode::kInvalidArgument);
  // Rank 1 issues the matching two and is told, without waiting for a timeout.
  EXPECT_EQ(ranks.comm(1)->Broadcast(buf1.data(), 32, 2, ranks.device(1)->ComputeStream()).code(),
            StatusCode::kInvalidArgument);  // its own root is bad too
  EXPECT_EQ(ranks.comm(1)->Broadcast(buf1.data(), 32, 0, ranks.device(1)->ComputeStream()).code(),
            StatusCode::kFailedPrecondition);
}

// Empty collectives still take part (every rank stays in step); their pointers may be null.
TEST(LocalCommEdgeTest, EmptyCollectivesSucceed) {
  Ranks ranks(2, milliseconds(5000));
  std::vector<Status> status(2);
  std::vector<float> buf(4);
  ranks.Run([&](int r) {
    Communicator* comm = ranks.comm(r);
    Stream* s = ranks.stream(r);
    status[r] = comm->AllGather(nullptr, nullptr, 0, s);
    if (status[r].ok()) status[r] = comm->ReduceScatterSum(nullptr, nullptr, 0, s);
    if (status[r].ok()) status[r] = comm->AllReduceSum(nullptr, 0, s);
    if (status[r].ok()) status[r] = comm->Broadcast(nullptr, 0, 1, s);
    if (status[r].ok()) status[r] = ranks.device(r)->SynchronizeStream(s);
    // Still in step: a real collective afterwards works.
    if (status[r].ok()) {
      float x = static_cast<float>(r + 1);
      status[r] = comm->AllReduceSum(&x, 1, ranks.device(r)->ComputeStream());
      buf[r] = x;
    }
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r].ToString();
    EXPECT_EQ(buf[r], 3.0f);
  }
}

TEST(LocalCommErrorTest, FactoryArgumentErrors) {
  EXPECT_EQ(NewLocalComms({}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(NewLocalComms({nullptr}).status().code(), StatusCode::kInvalidArgument);
  auto device = NewHostDevice(HostDeviceOptions{});
  LocalCommOptions options;
  options.timeout = milliseconds(0);
  EXPECT_EQ(NewLocalComms({device.get()}, options).status().code(), StatusCode::kInvalidArgument);
  // Ranks may share a device.
  auto comms = NewLocalComms({device.get(), device.get()});
  ASSERT_TRUE(comms.ok());
  EXPECT_EQ((*comms)[1]->world_size(), 2);
}

}  // namespace
}  // namespace zinf
