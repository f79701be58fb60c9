// GlooComm: ranks as processes (forked children) give the same bits as LocalComm's ranks as
// threads for every collective; the rendezvous stores; a dead peer and a stalled peer fail the
// others within seconds with a message naming the collective (and the rank, when it is on this
// machine); ProcessGroupFromEnv.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/process_ranks.h"
#include "tests/test_util.h"
#include "zinf/comm.h"
#include "zinf/device.h"

namespace zinf {
namespace {

using std::chrono::milliseconds;
using test::ChildResult;
using test::RankExit;
using test::RunProcessRanks;
using zinf::testing::TempDir;

// Values where the order of a sum changes the float result (1e8 absorbs a 1), mixed with
// random magnitudes: a sum in any order but rank order shows.
float Value(int rank, size_t i, int salt) {
  static const float kPattern[] = {1e8f, 1.0f, -1e8f, 1.0f, 3.0f, -7e7f, 0.5f, 2e7f};
  if (i % 3 == 0) return kPattern[(rank + i + salt) % 8];
  std::mt19937 rng(static_cast<uint32_t>(rank * 1000003 + i * 7 + salt));
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-20, 27);
  return std::ldexp(mantissa(rng), exponent(rng));
}

std::vector<float> Values(int rank, size_t n, int salt) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = Value(rank, i, salt);
  return v;
}

void Append(std::string* out, const void* p, size_t bytes) {
  out->append(static_cast<const char*>(p), bytes);
}

// Every collective, in one order, on `stream`; returns what this rank received, byte for byte,
// and checks the sums against ((v0 + v1) + v2) + ... computed here.
Status Script(int rank, int n, Communicator* comm, Device* device, Stream* stream,
              std::string* out) {
  // AllGather, out of place and in place.
  constexpr size_t kBytes = 10007;
  std::vector<unsigned char> send(kBytes), all(kBytes * n);
  for (size_t i = 0; i < kBytes; ++i) send[i] = static_cast<unsigned char>(rank * 31 + i);
  ZINF_RETURN_IF_ERROR(comm->AllGather(send.data(), all.data(), kBytes, stream));
  ZINF_RETURN_IF_ERROR(device->SynchronizeStream(stream));
  Append(out, all.data(), all.size());
  std::vector<unsigned char> inplace(kBytes * n, 0);
  std::memcpy(inplace.data() + rank * kBytes, send.data(), kBytes);
  ZINF_RETURN_IF_ERROR(
      comm->AllGather(inplace.data() + rank * kBytes, inplace.data(), kBytes, stream));
  ZINF_RETURN_IF_ERROR(device->SynchronizeStream(stream));
  if (inplace != all) return Status::Internal("in-place AllGather differs from out-of-place");
  // ReduceScatterSum.
  constexpr size_t kPer = 1001;
  std::vector<float> rs_send = Values(rank, kPer * n, 1), rs_recv(kPer);
  ZINF_RETURN_IF_ERROR(comm->ReduceScatterSum(rs_send.data(), rs_recv.data(), kPer, stream));
  ZINF_RETURN_IF_ERROR(device->SynchronizeStream(stream));
  for (size_t i = 0; i < kPer; ++i) {
    float want = Value(0, rank * kPer + i, 1);
    for (int r = 1; r < n; ++r) want += Value(r, rank * kPer + i, 1);
    if (std::memcmp(&want, &rs_recv[i], sizeof(float)) != 0) {
      return Status::Internal("ReduceScatterSum element " + std::to_string(i) + ": " +
                              std::to_string(rs_recv[i]) + ", rank order gives " +
                              std::to_string(want));
    }
  }
  Append(out, rs_recv.data(), rs_recv.size() * sizeof(float));
  // AllReduceSum: one value, fewer values than ranks, a size no chunking divides.
  for (size_t count : {size_t{1}, size_t{2}, size_t{4099}}) {
    std::vector<float> buf = Values(rank, count, 2 + static_cast<int>(count));
    ZINF_RETURN_IF_ERROR(comm->AllReduceSum(buf.data(), count, stream));
    ZINF_RETURN_IF_ERROR(device->SynchronizeStream(stream));
    for (size_t i = 0; i < count; ++i) {
      float want = Value(0, i, 2 + static_cast<int>(count));
      for (int r = 1; r < n; ++r) want += Value(r, i, 2 + static_cast<int>(count));
      if (std::memcmp(&want, &buf[i], sizeof(float)) != 0) {
        return Status::Internal("AllReduceSum of " + std::to_string(count) + " element " +
                                std::to_string(i) + " is not the rank-order sum");
      }
    }
    Append(out, buf.data(), count * sizeof(float));
  }
  // Broadcast from the last rank.
  std::vector<float> b = Values(rank, 333, 9);
  ZINF_RETURN_IF_ERROR(comm->Broadcast(b.data(), b.size() * sizeof(float), n - 1, stream));
  ZINF_RETURN_IF_ERROR(device->SynchronizeStream(stream));
  if (b != Values(n - 1, 333, 9)) return Status::Internal("Broadcast: not the root's values");
  Append(out, b.data(), b.size() * sizeof(float));
  return comm->Barrier();
}

struct Rank {
  std::unique_ptr<Device> device;
  std::unique_ptr<Communicator> comm;
};

Result<Rank> Join(int rank, int n, const std::string& folder, milliseconds timeout) {
  Rank r;
  r.device = NewHostDevice(HostDeviceOptions{});
  ProcessGroupOptions o;
  o.rank = rank;
  o.world_size = n;
  o.store_folder = folder;
  o.timeout = timeout;
  ZINF_ASSIGN_OR_RETURN(r.comm, NewGlooComm(r.device.get(), o));
  return r;
}

// The report of a child: its first line is OK or the error.
bool ReportOk(const RankExit& e) { return e.report.rfind("OK\n", 0) == 0; }
std::string Output(const RankExit& e) {
  const size_t nl = e.report.find('\n');
  return nl == std::string::npos ? "" : e.report.substr(nl + 1);
}

class GlooCommTest : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(GlooCommTest, SameBitsAsLocalComm) {
  const int n = std::get<0>(GetParam());
  const bool worker = std::get<1>(GetParam());
  TempDir store;
  ASSERT_TRUE(store.ok());
  std::vector<RankExit> exits =
      RunProcessRanks(n, std::chrono::seconds(120), [&](int rank) -> ChildResult {
        Result<Rank> r = Join(rank, n, store.path(), milliseconds(60000));
        if (!r.ok()) return {r.status(), ""};
        Stream* s = r->device->ComputeStream();
        if (worker) {
          Result<Stream*> w = r->device->CreateStream("comm");
          if (!w.ok()) return {w.status(), ""};
          s = *w;
        }
        std::string out;
        Status st = Script(rank, n, r->comm.get(), r->device.get(), s, &out);
        if (st.ok() && (r->comm->world_size() != n || r->comm->rank() != rank)) {
          st = Status::Internal("rank or world_size wrong");
        }
        return {st, out};
      });
  // The same script with ranks as threads on LocalComm.
  std::vector<std::unique_ptr<Device>> devices;
  std::vector<Device*> raw;
  for (int r = 0; r < n; ++r) {
    devices.push_back(NewHostDevice(HostDeviceOptions{}));
    raw.push_back(devices.back().get());
  }
  auto comms = NewLocalComms(raw);
  ASSERT_TRUE(comms.ok());
  std::vector<std::string> local(n);
  std::vector<Status> local_status(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      local_status[r] = Script(r, n, (*comms)[r].get(), raw[r], raw[r]->ComputeStream(), &local[r]);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(local_status[r].ok()) << local_status[r].ToString();
    ASSERT_TRUE(exits[r].finished) << "rank " << r << " did not finish: " << exits[r].report;
    ASSERT_TRUE(ReportOk(exits[r])) << "rank " << r << ": " << exits[r].report;
    EXPECT_EQ(exits[r].exit_code, 0);
    const std::string got = Output(exits[r]);
    ASSERT_EQ(got.size(), local[r].size()) << "rank " << r;
    EXPECT_TRUE(got == local[r]) << "rank " << r << ": GlooComm's bytes differ from LocalComm's";
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, GlooCommTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(false, true)),
                         [](const auto& info) {
                           return std::to_string(std::get<0>(info.param)) + "ranks_" +
                                  (std::get<1>(info.param) ? "worker" : "compute");
                         });

// The TCP store: rank 0 serves it on MASTER_ADDR:MASTER_PORT, the others connect.
TEST(GlooComm, TcpRendezvous) {
  const int port = test::FreePort();
  ASSERT_GT(port, 0);
  std::vector<RankExit> exits =
      RunProcessRanks(3, std::chrono::seconds(60), [&](int rank) -> ChildResult {
        if (rank == 2) std::this_thread::sleep_for(milliseconds(300));  // late joiner
        auto device = NewHostDevice(HostDeviceOptions{});
        ProcessGroupOptions o;
        o.rank = rank;
        o.world_size = 3;
        o.master_addr = "127.0.0.1";
        o.master_port = port;
        o.timeout = milliseconds(30000);
        Result<std::unique_ptr<Communicator>> comm = NewGlooComm(device.get(), o);
        if (!comm.ok()) return {comm.status(), ""};
        float v = static_cast<float>(rank + 1);
        Status s = (*comm)->AllReduceSum(&v, 1, device->ComputeStream());
        return {s, std::to_string(v)};
      });
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(ReportOk(exits[r])) << "rank " << r << ": " << exits[r].report;
    EXPECT_EQ(Output(exits[r]), "6.000000");
  }
}

TEST(GlooComm, TcpStorePortInUseIsNamed) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof(a);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  const int port = ntohs(a.sin_port);
  auto store = NewTcpStore("127.0.0.1", port, /*serve=*/true, milliseconds(1000));
  close(fd);
  ASSERT_FALSE(store.ok());
  EXPECT_NE(store.status().message().find("MASTER_PORT"), std::string::npos)
      << store.status().ToString();
  EXPECT_NE(store.status().message().find(std::to_string(port)), std::string::npos);
}

TEST(GlooComm, MissingPeerTimesOutJoining) {
  TempDir store;
  ASSERT_TRUE(store.ok());
  auto device = NewHostDevice(HostDeviceOptions{});
  ProcessGroupOptions o;
  o.rank = 0;
  o.world_size = 2;
  o.store_folder = store.path();
  o.timeout = milliseconds(1500);
  const auto start = std::chrono::steady_clock::now();
  Result<std::unique_ptr<Communicator>> comm = NewGlooComm(device.get(), o);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(comm.ok());
  EXPECT_LT(s, 20.0);
  EXPECT_NE(comm.status().message().find("group of 2 processes"), std::string::npos)
      << comm.status().ToString();
}

// A rank killed between two collectives: the others fail their next collective within seconds,
// naming it, instead of waiting out the (long) timeout. Later collectives fail at once.
TEST(GlooComm, DeadPeerFailsTheOthersFast) {
  TempDir store;
  ASSERT_TRUE(store.ok());
  std::vector<RankExit> exits =
      RunProcessRanks(3, std::chrono::seconds(60), [&](int rank) -> ChildResult {
        // Long enough that only the closed connection can explain a fast failure.
        Result<Rank> r = Join(rank, 3, store.path(), milliseconds(60000));
        if (!r.ok()) return {r.status(), ""};
        float v = 1;
        Status s = r->comm->AllReduceSum(&v, 1, r->device->ComputeStream());
        if (!s.ok()) return {s, ""};
        if (rank == 2) raise(SIGKILL);
        const auto start = std::chrono::steady_clock::now();
        std::vector<float> big(1 << 16, 1.0f);
        s = r->comm->AllReduceSum(big.data(), big.size(), r->device->ComputeStream());
        const double took =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        Status again = r->comm->Barrier();
        return {Status::OK(), (s.ok() ? "OK" : s.ToString()) + "\n" + std::to_string(took) + "\n" +
                                  again.ToString()};
      });
  ASSERT_EQ(exits[2].signal, SIGKILL);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(ReportOk(exits[r])) << "rank " << r << " exit " << exits[r].exit_code << " signal "
                                    << exits[r].signal << ": " << exits[r].report;
    const std::string out = Output(exits[r]);
    EXPECT_NE(out.find("AllReduceSum of 65536 floats"), std::string::npos) << out;
    EXPECT_NE(out.find("GlooComm rank " + std::to_string(r)), std::string::npos) << out;
    // On one machine the message names the dead rank (dead or a zombie not yet reaped); the
    // other survivor may have failed and exited already, and is then named too.
    EXPECT_NE(out.find("2 (pid"), std::string::npos) << out;
    EXPECT_NE(out.find("no longer running"), std::string::npos) << out;
    const double took = std::stod(out.substr(out.find('\n') + 1));
    EXPECT_LT(took, 10.0) << out;
    EXPECT_NE(out.find("unusable"), std::string::npos) << out;
  }
}

// A rank that refuses a collective (bad arguments) breaks the group and closes its connections:
// its peer, waiting in the matching collective with a long timeout, fails at once; the
// refusing rank's next collective fails with the refusal.
TEST(GlooComm, ARefusedCollectiveFailsThePeersAtOnce) {
  TempDir store;
  ASSERT_TRUE(store.ok());
  std::vector<RankExit> exits =
      RunProcessRanks(2, std::chrono::seconds(60), [&](int rank) -> ChildResult {
        Result<Rank> r = Join(rank, 2, store.path(), milliseconds(60000));
        if (!r.ok()) return {r.status(), ""};
        std::vector<char> all(64);
        const auto start = std::chrono::steady_clock::now();
        Status s = r->comm->AllGather(rank == 1 ? nullptr : all.data(), all.data(), 32,
                                      r->device->ComputeStream());
        const double took =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        Status next = r->comm->Barrier();
        return {Status::OK(), s.ToString() + "\n" + std::to_string(took) + "\n" + next.ToString()};
      });
  ASSERT_TRUE(ReportOk(exits[0])) << exits[0].report;
  ASSERT_TRUE(ReportOk(exits[1])) << exits[1].report;
  const std::string out0 = Output(exits[0]), out1 = Output(exits[1]);
  EXPECT_NE(out1.find("InvalidArgument"), std::string::npos) << out1;
  EXPECT_NE(out1.find("send buffer is null"), std::string::npos) << out1;
  // Rank 1's Barrier fails with its own refusal (the group is broken), not a timeout.
  const std::string next1 = out1.substr(out1.find_last_of('\n') + 1);
  EXPECT_NE(next1.find("send buffer is null"), std::string::npos) << out1;
  EXPECT_NE(out0.find("FailedPrecondition"), std::string::npos) << out0;
  const double took = std::stod(out0.substr(out0.find('\n') + 1));
  EXPECT_LT(took, 10.0) << out0;
}

// A rank that does not come to a collective: the others fail after the collective timeout.
TEST(GlooComm, StalledPeerTimesOut) {
  TempDir store;
  ASSERT_TRUE(store.ok());
  std::vector<RankExit> exits =
      RunProcessRanks(2, std::chrono::seconds(60), [&](int rank) -> ChildResult {
        Result<Rank> r = Join(rank, 2, store.path(), milliseconds(2000));
        if (!r.ok()) return {r.status(), ""};
        if (rank == 1) {
          std::this_thread::sleep_for(std::chrono::seconds(6));
          return {Status::OK(), "slept"};
        }
        const auto start = std::chrono::steady_clock::now();
        float v = 1;
        Status s = r->comm->AllReduceSum(&v, 1, r->device->ComputeStream());
        const double took =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        return {Status::OK(), s.ToString() + "\n" + std::to_string(took)};
      });
  ASSERT_TRUE(ReportOk(exits[0])) << exits[0].report;
  const std::string out = Output(exits[0]);
  EXPECT_NE(out.find("AllReduceSum of 1 floats"), std::string::npos) << out;
  EXPECT_NE(out.find("FailedPrecondition"), std::string::npos) << out;
  EXPECT_NE(out.find("zinf.collective_timeout_seconds"), std::string::npos) << out;
  const double took = std::stod(out.substr(out.find('\n') + 1));
  EXPECT_GE(took, 1.5) << out;
  EXPECT_LT(took, 5.5) << out;
}

// Two jobs started on one MASTER_PORT: job B's rank 1 reaches job A's store before A's own
// rank 1 comes. Before, A's rank 0 paired with B's rank 1 (both trained on a mix, exit 0); now
// B's rank 1 is refused at once, naming the other job, and A's ranks pair with each other.
TEST(GlooComm, TwoJobsOnOnePortNeverPair) {
  const int port = test::FreePort();
  ASSERT_GT(port, 0);
  TempDir flags;
  ASSERT_TRUE(flags.ok());
  const std::string b_done = flags.path() + "/b-done";
  // Process 0: job A's rank 0; process 1: job B's rank 1; process 2: job A's rank 1, started
  // once B's rank 1 has finished.
  std::vector<RankExit> exits =
      RunProcessRanks(3, std::chrono::seconds(60), [&](int proc) -> ChildResult {
        const bool job_a = proc != 1;
        const int rank = proc == 0 ? 0 : 1;
        if (proc == 2) {
          const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
          while (access(b_done.c_str(), F_OK) != 0 && std::chrono::steady_clock::now() < until) {
            std::this_thread::sleep_for(milliseconds(20));
          }
        }
        auto device = NewHostDevice(HostDeviceOptions{});
        ProcessGroupOptions o;
        o.rank = rank;
        o.world_size = 2;
        o.master_addr = "127.0.0.1";
        o.master_port = port;
        o.job_id = job_a ? "job-a" : "job-b";
        o.timeout = milliseconds(20000);
        Result<std::unique_ptr<Communicator>> comm = NewGlooComm(device.get(), o);
        if (proc == 1) {
          FILE* f = std::fopen(b_done.c_str(), "w");
          if (f != nullptr) std::fclose(f);
        }
        if (!comm.ok()) return {comm.status(), ""};
        float v = job_a ? 1.0f : 100.0f;
        Status s = (*comm)->AllReduceSum(&v, 1, device->ComputeStream());
        if (s.ok()) s = device->SynchronizeStream(device->ComputeStream());
        return {s, std::to_string(v)};
      });
  for (int p : {0, 2}) {
    ASSERT_TRUE(ReportOk(exits[p])) << "job A process " << p << ": " << exits[p].report;
    EXPECT_EQ(Output(exits[p]), "2.000000") << "job A process " << p;
  }
  ASSERT_FALSE(ReportOk(exits[1])) << exits[1].report;
  EXPECT_NE(exits[1].report.find("belongs to another job"), std::string::npos) << exits[1].report;
  EXPECT_EQ(exits[1].signal, 0);
}

// A rank that stops (SIGSTOP) once it has published its address, before pairing: the others'
// join fails within about the timeout. Before, gloo waited five times the timeout for the
// pair's first connect (101 s at a 20 s timeout; 50 minutes at the default).
TEST(GlooComm, ARankStoppedWhileJoiningFailsTheOthersWithinTheTimeout) {
  TempDir store;
  ASSERT_TRUE(store.ok());
  const milliseconds timeout(4000);
  // gloo's key for rank 1's address, as the folder store names it (prefix "zinf").
  const std::string published = store.path() + "/zinf%2f1";
  std::vector<RankExit> exits =
      RunProcessRanks(2, std::chrono::seconds(90), [&](int rank) -> ChildResult {
        if (rank == 1) {
          Result<Rank> r = Join(1, 2, store.path(), milliseconds(60000));
          return {r.ok() ? Status::OK() : r.status(), ""};
        }
        // Rank 0 says it is here (so that rank 1 goes on to publish its address), waits for
        // that address, stops rank 1, then joins.
        auto folder = NewFileStore(store.path());
        if (!folder.ok()) return {folder.status(), ""};
        char host[256] = {0};
        gethostname(host, sizeof(host) - 1);
        Status s =
            (*folder)->Set("zinf/member/0", std::string(host) + " " + std::to_string(getpid()));
        // gloo's own first key (each rank's host name, rank_<r>), which rank 1 waits for
        // before it publishes its pairs' addresses under "<r>".
        if (s.ok()) s = (*folder)->Set("zinf/rank_0", host);
        if (!s.ok()) return {s, ""};
        Result<std::string> member = (*folder)->Get("zinf/member/1", milliseconds(30000));
        if (!member.ok()) return {member.status(), ""};
        const pid_t peer = static_cast<pid_t>(std::stol(member->substr(member->rfind(' ') + 1)));
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
        while (access(published.c_str(), F_OK) != 0 && std::chrono::steady_clock::now() < until) {
          std::this_thread::sleep_for(milliseconds(5));
        }
        if (access(published.c_str(), F_OK) != 0) {
          kill(peer, SIGKILL);  // the test's own child, by pid
          return {Status::OK(), "SKIP"};
        }
        kill(peer, SIGSTOP);
        const auto start = std::chrono::steady_clock::now();
        Result<Rank> r = Join(0, 2, store.path(), timeout);
        const double took =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        kill(peer, SIGKILL);  // the test's own child, by pid
        return {Status::OK(), (r.ok() ? std::string("joined") : r.status().ToString()) + "\n" +
                                  std::to_string(took)};
      });
  ASSERT_TRUE(ReportOk(exits[0])) << exits[0].report;
  const std::string out = Output(exits[0]);
  if (out == "SKIP") {
    GTEST_SKIP() << "rank 1's address never appeared under gloo's key 'zinf/1' (this libgloo "
                    "names its rendezvous keys otherwise: the test stops rank 1 between them)";
  }
  EXPECT_NE(out.find("joining the group of 2 processes"), std::string::npos) << out;
  const double took = std::stod(out.substr(out.find('\n') + 1));
  // About 1.2 times the timeout here; 5 times (20 s) before. The bound leaves room for a
  // loaded machine.
  EXPECT_LT(took, 3.5 * timeout.count() / 1000.0) << out;
}

// ---- ProcessGroupFromEnv ---------------------------------------------------------------------

// Sets exactly `vars` of the launcher's variables for its lifetime; restores them after.
class ScopedEnv {
 public:
  explicit ScopedEnv(std::vector<std::pair<std::string, std::string>> vars) {
    for (const char* name : kNames) {
      const char* v = std::getenv(name);
      if (v != nullptr) saved_.emplace_back(name, v);
      unsetenv(name);
    }
    for (auto& [k, v] : vars) setenv(k.c_str(), v.c_str(), 1);
  }
  ~ScopedEnv() {
    for (const char* name : kNames) unsetenv(name);
    for (auto& [k, v] : saved_) setenv(k.c_str(), v.c_str(), 1);
  }

 private:
  static constexpr const char* kNames[] = {"RANK",
                                           "WORLD_SIZE",
                                           "LOCAL_RANK",
                                           "LOCAL_WORLD_SIZE",
                                           "MASTER_ADDR",
                                           "MASTER_PORT",
                                           "OMPI_COMM_WORLD_RANK",
                                           "OMPI_COMM_WORLD_SIZE",
                                           "OMPI_COMM_WORLD_LOCAL_RANK",
                                           "OMPI_COMM_WORLD_LOCAL_SIZE",
                                           "ZINF_STORE_FOLDER",
                                           "ZINF_LISTEN_ADDR",
                                           "ZINF_JOB_ID",
                                           "TORCHELASTIC_RUN_ID",
                                           "ZINF_STORE_LISTEN_ADDR"};
  std::vector<std::pair<std::string, std::string>> saved_;
};

TEST(ProcessGroupFromEnv, Variants) {
  {
    ScopedEnv env({});
    auto o = ProcessGroupFromEnv();
    ASSERT_TRUE(o.ok());
    EXPECT_EQ(o->world_size, 1);
    EXPECT_EQ(o->rank, 0);
  }
  {
    ScopedEnv env({{"RANK", "1"},
                   {"WORLD_SIZE", "4"},
                   {"LOCAL_RANK", "1"},
                   {"LOCAL_WORLD_SIZE", "2"},
                   {"MASTER_ADDR", "10.0.0.1"},
                   {"MASTER_PORT", "29500"}});
    auto o = ProcessGroupFromEnv();
    ASSERT_TRUE(o.ok()) << o.status().ToString();
    EXPECT_EQ(o->rank, 1);
    EXPECT_EQ(o->world_size, 4);
    EXPECT_EQ(o->local_rank, 1);
    EXPECT_EQ(o->local_world_size, 2);
    EXPECT_EQ(o->master_addr, "10.0.0.1");
    EXPECT_EQ(o->master_port, 29500);
  }
  {
    ScopedEnv env({{"OMPI_COMM_WORLD_RANK", "2"},
                   {"OMPI_COMM_WORLD_SIZE", "3"},
                   {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                   {"ZINF_STORE_FOLDER", "/tmp"}});
    auto o = ProcessGroupFromEnv();
    ASSERT_TRUE(o.ok()) << o.status().ToString();
    EXPECT_EQ(o->rank, 2);
    EXPECT_EQ(o->world_size, 3);
    EXPECT_EQ(o->store_folder, "/tmp");
  }
  {
    // The job's identity: ZINF_JOB_ID, else torchrun's run id unless it is "none"; keys
    // carry its tag, not the id.
    ScopedEnv env({{"RANK", "0"},
                   {"WORLD_SIZE", "2"},
                   {"ZINF_STORE_FOLDER", "/tmp"},
                   {"TORCHELASTIC_RUN_ID", "run7"},
                   {"ZINF_STORE_LISTEN_ADDR", "0.0.0.0"}});
    auto o = ProcessGroupFromEnv();
    ASSERT_TRUE(o.ok()) << o.status().ToString();
    EXPECT_EQ(o->job_id, "run7");
    EXPECT_EQ(o->store_listen_addr, "0.0.0.0");
    EXPECT_EQ(o->prefix, "zinf/job-" + JobTag("run7"));
    EXPECT_EQ(o->prefix.find("run7"), std::string::npos);
  }
  {
    ScopedEnv env({{"RANK", "0"},
                   {"WORLD_SIZE", "2"},
                   {"ZINF_STORE_FOLDER", "/tmp"},
                   {"TORCHELASTIC_RUN_ID", "none"}});
    auto o = ProcessGroupFromEnv();
    ASSERT_TRUE(o.ok());
    EXPECT_EQ(o->job_id, "");
    EXPECT_EQ(o->prefix, "zinf");
  }
  {
    ScopedEnv env({{"RANK", "0"},
                   {"WORLD_SIZE", "2"},
                   {"ZINF_STORE_FOLDER", "/tmp"},
                   {"TORCHELASTIC_RUN_ID", "run7"},
                   {"ZINF_JOB_ID", "mine"}});
    auto o = ProcessGroupFromEnv();
    ASSERT_TRUE(o.ok());
    EXPECT_EQ(o->job_id, "mine");
  }
  struct Bad {
    std::vector<std::pair<std::string, std::string>> vars;
    const char* names;
  };
  for (const Bad& bad : std::vector<Bad>{
           {{{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}},
            "RANK=2"},
           {{{"RANK", "0"}, {"WORLD_SIZE", "2"}}, "MASTER_ADDR"},
           {{{"RANK", "x"}, {"WORLD_SIZE", "2"}}, "RANK='x'"},
           {{{"RANK", "0"},
             {"WORLD_SIZE", "2"},
             {"MASTER_ADDR", "a"},
             {"MASTER_PORT", "99999999999"}},
            "MASTER_PORT"},
           {{{"WORLD_SIZE", "2"}}, "RANK is not"},
       }) {
    ScopedEnv env(bad.vars);
    auto o = ProcessGroupFromEnv();
    ASSERT_FALSE(o.ok()) << bad.names;
    EXPECT_EQ(o.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(o.status().message().find(bad.names), std::string::npos) << o.status().ToString();
  }
}

}  // namespace
}  // namespace zinf
