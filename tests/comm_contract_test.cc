// The Communicator contract (include/zinf/comm.h), one suite run over every implementation:
// LocalComm (ranks as threads), GlooComm (ranks as forked processes) and, in
// comm_contract_nccl_test (label gpu), NcclComm with one GPU per rank. Every collective at sizes
// 0, 1, odd and not divisible by the world size, in and out of place, on the compute stream and
// on a worker stream, for 1, 2 and 3 ranks; sums exact (whole numbers: any order gives them)
// and, where the implementation promises it, bit-identical to the rank-order sum; argument
// errors refused with a message naming the collective and the problem; a peer that never comes
// fails the others instead of hanging.
//
// A test is a body that every rank runs. Bodies use no gtest assertion (a rank may be a child
// process): each records Statuses and the bytes it read back, which come to the test (through a
// pipe when ranks are processes), so every check is written once for all implementations. What
// belongs to one implementation stays in its own test: LocalComm's mismatch detection and its
// group surviving a refusal (local_comm_test), gloo's rendezvous stores and join
// (gloo_comm_test), NCCL's id file and options (cuda_device_test).
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <new>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "device/host/local_comm.h"
#include "tests/process_ranks.h"
#include "tests/test_util.h"
#include "zinf/comm.h"
#include "zinf/device.h"
#include "zinf/status.h"
#ifdef ZINF_CONTRACT_NCCL
#include "zinf/cuda.h"
#endif

namespace zinf {
namespace {

using std::chrono::milliseconds;
using zinf::testing::TempDir;

#if defined(__SANITIZE_THREAD__)
constexpr bool kUnderThreadSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
constexpr bool kUnderThreadSanitizer = true;
#else
constexpr bool kUnderThreadSanitizer = false;
#endif
#else
constexpr bool kUnderThreadSanitizer = false;
#endif

// The collective timeout of tests in which every rank takes part: long, so that a loaded
// machine (-j2, sanitizers) never fails a correct run. A hang still ends: at the harness's
// deadline for processes, at ctest's timeout for threads.
constexpr milliseconds kPatientTimeout{60000};

// ---- What a rank does and reports -------------------------------------------------------------

struct RankReport {
  Status setup;                 // creating the rank's device, communicator and streams
  std::vector<Status> results;  // what the body recorded, in order
  std::string data;             // what it read back from device memory, for the test to check
};

// A rank's view inside a body.
struct RankEnv {
  int rank = 0;
  int world = 1;
  Device* device = nullptr;
  Communicator* comm = nullptr;
  Stream* worker = nullptr;   // a stream of `device`, made for the test
  Stream* foreign = nullptr;  // a stream named "foreign" of another device (an argument error)
  RankReport* report = nullptr;

  // The streams the value tests run on: the compute stream (inline on a host device) and a
  // worker stream (asynchronous, like every CUDA stream).
  std::vector<Stream*> Streams() const { return {device->ComputeStream(), worker}; }
  // True when `s` is OK; otherwise records it, saying what failed, and returns false.
  bool Ok(const Status& s, const std::string& what) {
    if (s.ok()) return true;
    report->results.push_back(s.WithContext("rank " + std::to_string(rank) + ": " + what));
    return false;
  }
  void Record(const Status& s) { report->results.push_back(s); }
  std::string* data() { return &report->data; }
};

using RankBody = std::function<void(RankEnv& env)>;

// Device memory of one rank, freed with this object once the stream's work is done. Copies go
// on `stream`. An empty buffer is null: a collective of nothing takes null pointers.
class RankBuffers {
 public:
  RankBuffers(Device* device, Stream* stream) : device_(device), stream_(stream) {}
  ~RankBuffers() {
    (void)device_->SynchronizeStream(stream_);  // its error, if any, was the body's to record
    for (void* p : owned_) device_->Free(p);
  }
  RankBuffers(const RankBuffers&) = delete;
  RankBuffers& operator=(const RankBuffers&) = delete;

  // A buffer of n elements copied from `host`, the copy queued on the stream: `host` must stay
  // valid until the stream has run it.
  template <typename T>
  Result<T*> Stage(const T* host, size_t n) {
    if (n == 0) return static_cast<T*>(nullptr);
    ZINF_ASSIGN_OR_RETURN(void* p, device_->Alloc(n * sizeof(T)));
    owned_.push_back(p);
    ZINF_RETURN_IF_ERROR(device_->CopyHostToDevice(p, host, n * sizeof(T), stream_));
    return static_cast<T*>(p);
  }
  // The same, waited for.
  template <typename T>
  Result<T*> Upload(const T* host, size_t n) {
    ZINF_ASSIGN_OR_RETURN(T * p, Stage(host, n));
    ZINF_RETURN_IF_ERROR(device_->SynchronizeStream(stream_));
    return p;
  }
  Result<char*> Upload(const std::string& host) { return Upload(host.data(), host.size()); }
  Result<float*> Upload(const std::vector<float>& host) { return Upload(host.data(), host.size()); }

  // Appends the bytes at `p` to `out` once the work queued before on the stream has run (and
  // returns that work's error: a collective's failure on a worker stream shows here).
  Status Download(const void* p, size_t bytes, std::string* out) {
    std::string host(bytes, '\0');
    if (bytes > 0) ZINF_RETURN_IF_ERROR(device_->CopyDeviceToHost(host.data(), p, bytes, stream_));
    ZINF_RETURN_IF_ERROR(device_->SynchronizeStream(stream_));
    out->append(host);
    return Status::OK();
  }

 private:
  Device* const device_;
  Stream* const stream_;
  std::vector<void*> owned_;
};

// Runs `body` as rank `rank` on the device and communicator its harness made; the streams are
// made here, the same way for every implementation.
RankReport RunRank(int rank, int world, Device* device, Communicator* comm, const RankBody& body) {
  RankReport report;
  Result<Stream*> worker = device->CreateStream("comm");
  HostDeviceOptions small;
  small.memory_budget = size_t{1} << 20;
  std::unique_ptr<Device> other = NewHostDevice(small);
  Result<Stream*> foreign = other->CreateStream("foreign");
  if (!worker.ok() || !foreign.ok()) {
    report.setup = worker.ok() ? foreign.status() : worker.status();
    return report;
  }
  RankEnv env{rank, world, device, comm, *worker, *foreign, &report};
  body(env);
  return report;
}

// ---- A report's wire form: ranks that are processes send it through their pipe ----------------

void PutStatus(const Status& s, std::string* out) {
  *out += std::to_string(static_cast<int>(s.code())) + " " + std::to_string(s.message().size()) +
          "\n" + s.message();
}

std::string Encode(const RankReport& report) {
  std::string out;
  PutStatus(report.setup, &out);
  out += std::to_string(report.results.size()) + "\n";
  for (const Status& s : report.results) PutStatus(s, &out);
  out += std::to_string(report.data.size()) + "\n" + report.data;
  return out;
}

// Takes "<decimal><end>" from the front of `in`.
bool TakeNumber(std::string_view* in, char end, size_t* n) {
  const size_t stop = in->find(end);
  if (stop == std::string_view::npos || stop == 0 || stop > 19) return false;
  size_t v = 0;
  for (char c : in->substr(0, stop)) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + static_cast<size_t>(c - '0');
  }
  *n = v;
  in->remove_prefix(stop + 1);
  return true;
}

bool TakeBytes(std::string_view* in, size_t n, std::string* out) {
  if (in->size() < n) return false;
  out->assign(in->data(), n);
  in->remove_prefix(n);
  return true;
}

bool TakeStatus(std::string_view* in, Status* s) {
  size_t code = 0, length = 0;
  std::string message;
  if (!TakeNumber(in, ' ', &code) || !TakeNumber(in, '\n', &length) ||
      !TakeBytes(in, length, &message) || code > static_cast<size_t>(StatusCode::kInternal)) {
    return false;
  }
  *s = code == 0 ? Status::OK() : Status(static_cast<StatusCode>(code), std::move(message));
  return true;
}

bool Decode(std::string_view in, RankReport* report) {
  size_t results = 0, bytes = 0;
  if (!TakeStatus(&in, &report->setup) || !TakeNumber(&in, '\n', &results)) return false;
  report->results.resize(results);
  for (Status& s : report->results) {
    if (!TakeStatus(&in, &s)) return false;
  }
  return TakeNumber(&in, '\n', &bytes) && TakeBytes(&in, bytes, &report->data) && in.empty();
}

// ---- The implementations ------------------------------------------------------------------------

// One Communicator implementation as the suite drives it: how its ranks run, and what comm.h
// leaves to the implementation.
class CommUnderTest {
 public:
  virtual ~CommUnderTest() = default;
  // Why `world` ranks cannot run here; "" when they can.
  virtual std::string SkipReason(int world) const = 0;
  // Runs `body` on every rank of a new group of `world` whose collectives wait at most
  // `timeout` for a peer. A rank that could not report has a failed setup saying why.
  virtual std::vector<RankReport> Run(int world, milliseconds timeout, const RankBody& body) = 0;
  // The timeout of a test in which a peer is meant to fail: it bounds how long the others wait
  // for a rank that never comes (the outcome does not depend on it), and leaves the group time
  // to form on a loaded machine.
  virtual milliseconds FailureTimeout() const = 0;
  // Sums are taken in rank order 0, 1, ..., N-1; NCCL picks its own order.
  virtual bool SumsInRankOrder() const = 0;
  // Counters() counts; all zero where it does not.
  virtual bool CountsTraffic() const = 0;
};

// LocalComm: the ranks are threads of this process, each with its own HostDevice.
class LocalRanks final : public CommUnderTest {
 public:
  std::string SkipReason(int) const override { return ""; }

  std::vector<RankReport> Run(int world, milliseconds timeout, const RankBody& body) override {
    std::vector<RankReport> reports(world);
    std::vector<std::unique_ptr<Device>> devices;
    std::vector<Device*> raw;
    for (int r = 0; r < world; ++r) {
      devices.push_back(NewHostDevice(HostDeviceOptions{}));
      raw.push_back(devices.back().get());
    }
    LocalCommOptions options;
    options.timeout = timeout;
    Result<std::vector<std::unique_ptr<Communicator>>> comms = NewLocalComms(raw, options);
    if (!comms.ok()) {
      for (RankReport& report : reports) report.setup = comms.status();
      return reports;
    }
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back(
          [&, r] { reports[r] = RunRank(r, world, raw[r], (*comms)[r].get(), body); });
    }
    for (std::thread& t : threads) t.join();
    return reports;
  }

  milliseconds FailureTimeout() const override { return milliseconds(300); }
  bool SumsInRankOrder() const override { return true; }
  bool CountsTraffic() const override { return false; }
};

// GlooComm: the ranks are forked processes (tests/process_ranks.h) meeting in a store folder.
class GlooRanks final : public CommUnderTest {
 public:
  std::string SkipReason(int) const override {
    if (kUnderThreadSanitizer) {
      return "ranks as processes fork, which needs a one-thread parent, and ThreadSanitizer "
             "runs a thread of its own (scripts/sanitize.sh runs these under ASan)";
    }
    return "";
  }

  std::vector<RankReport> Run(int world, milliseconds timeout, const RankBody& body) override {
    std::vector<RankReport> reports(world);
    TempDir store;
    if (!store.ok()) {
      for (RankReport& report : reports) {
        report.setup = Status::Internal("no temporary folder for the rendezvous store");
      }
      return reports;
    }
    // Room for the join, the body and a timeout or two; ranks still running then are killed.
    // (A test of ten runs with the failure timeout stays under ctest's 600 s when every run
    // hangs to its deadline, so the harness, not ctest, names the stuck rank.)
    const std::chrono::seconds deadline =
        std::chrono::duration_cast<std::chrono::seconds>(3 * timeout) + std::chrono::seconds(20);
    const std::vector<test::RankExit> exits =
        test::RunProcessRanks(world, deadline, [&](int rank) -> test::ChildResult {
          std::unique_ptr<Device> device = NewHostDevice(HostDeviceOptions{});
          ProcessGroupOptions options;
          options.rank = rank;
          options.world_size = world;
          options.store_folder = store.path();
          options.timeout = timeout;
          Result<std::unique_ptr<Communicator>> comm = NewGlooComm(device.get(), options);
          RankReport report;
          if (comm.ok()) {
            report = RunRank(rank, world, device.get(), comm->get(), body);
          } else {
            report.setup = comm.status();
          }
          return {Status::OK(), Encode(report)};
        });
    for (int r = 0; r < world; ++r) {
      const test::RankExit& e = exits[r];
      const bool reported = e.finished && e.exit_code == 0 && e.report.rfind("OK\n", 0) == 0 &&
                            Decode(std::string_view(e.report).substr(3), &reports[r]);
      if (reported) continue;
      reports[r] = RankReport{};
      if (!e.finished && e.report.rfind("ERR", 0) == 0) {  // never forked (the harness refused)
        reports[r].setup = Status::Internal("rank " + std::to_string(r) +
                                            " (a process) was not started: " + e.report);
        continue;
      }
      reports[r].setup = Status::Internal(
          "rank " + std::to_string(r) + " (a process) did not report: " +
          (e.finished ? "exit code " + std::to_string(e.exit_code)
                      : "still running after " + std::to_string(deadline.count()) + " s") +
          ", signal " + std::to_string(e.signal) + "; it wrote: " + e.report.substr(0, 2000));
    }
    return reports;
  }

  // Also the longest join: a dead peer is found by its closed connections, not by the timeout.
  milliseconds FailureTimeout() const override { return milliseconds(10000); }
  bool SumsInRankOrder() const override { return true; }
  bool CountsTraffic() const override { return true; }
};

#ifdef ZINF_CONTRACT_NCCL
// NcclComm: the ranks are threads of this process, rank r on GPU r (NCCL refuses two ranks of a
// communicator on one GPU), meeting through an id file.
class NcclRanks final : public CommUnderTest {
 public:
  std::string SkipReason(int world) const override {
    const int gpus = CudaDeviceCount();
    if (gpus == 0) {
      return "no CUDA device visible (built without CUDA, no driver, or CUDA_VISIBLE_DEVICES "
             "hides every GPU)";
    }
    if (gpus < world) {
      return "NcclComm needs a GPU per rank: " + std::to_string(world) + " ranks, " +
             std::to_string(gpus) + " GPU(s) visible";
    }
    return "";
  }

  std::vector<RankReport> Run(int world, milliseconds timeout, const RankBody& body) override {
    std::vector<RankReport> reports(world);
    TempDir dir;
    if (!dir.ok()) {
      for (RankReport& report : reports) {
        report.setup = Status::Internal("no temporary folder for the NCCL id file");
      }
      return reports;
    }
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        CudaDeviceOptions d;
        d.device = r;
        d.memory_budget = size_t{64} << 20;
        Result<std::unique_ptr<Device>> device = NewCudaDevice(d);
        if (!device.ok()) {
          reports[r].setup = device.status();
          return;
        }
        NcclCommOptions o;
        o.rank = r;
        o.world_size = world;
        o.local_rank = r;
        o.unique_id_file = dir.path() + "/nccl-id";
        o.timeout_seconds = std::chrono::duration<double>(timeout).count();
        // Created, used and destroyed on the rank's thread: NCCL's creation and finalisation
        // need every rank at once.
        Result<std::unique_ptr<Communicator>> comm = NewNcclComm(device->get(), o);
        if (!comm.ok()) {
          reports[r].setup = comm.status();
          return;
        }
        reports[r] = RunRank(r, world, device->get(), comm->get(), body);
      });
    }
    for (std::thread& t : threads) t.join();
    return reports;
  }

  // Also the longest creation (NCCL's takes seconds); its watchdog finds a peer that never
  // comes only at the timeout.
  milliseconds FailureTimeout() const override { return milliseconds(10000); }
  bool SumsInRankOrder() const override { return false; }
  bool CountsTraffic() const override { return false; }
};
#endif

enum class Impl { kLocal, kGloo, kNccl };

const char* ImplName(Impl impl) {
  switch (impl) {
    case Impl::kLocal:
      return "LocalComm";
    case Impl::kGloo:
      return "GlooComm";
    case Impl::kNccl:
      return "NcclComm";
  }
  return "?";
}
void PrintTo(Impl impl, std::ostream* os) { *os << ImplName(impl); }

std::unique_ptr<CommUnderTest> MakeImpl(Impl impl) {
  switch (impl) {
    case Impl::kLocal:
      return std::make_unique<LocalRanks>();
    case Impl::kGloo:
      return std::make_unique<GlooRanks>();
    case Impl::kNccl:
#ifdef ZINF_CONTRACT_NCCL
      return std::make_unique<NcclRanks>();
#else
      return nullptr;  // built into comm_contract_nccl_test only
#endif
  }
  return nullptr;
}

// ---- Values -------------------------------------------------------------------------------------

// splitmix64 of (salt, rank, index): the same value in every process.
uint64_t Mix(int rank, size_t i, int salt) {
  uint64_t x = (static_cast<uint64_t>(salt) << 48) ^ (static_cast<uint64_t>(rank) << 32) ^ i;
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

std::string RankBytes(int rank, size_t n, int salt) {
  std::string out(n, '\0');
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<char>(Mix(rank, i, salt) & 0xff);
  return out;
}

// Whole numbers in [-1000, 1000]: every partial sum over a few ranks is exact in float, so an
// implementation gives the integer sum whatever order it adds in (NCCL's included).
std::vector<float> SmallInts(int rank, size_t n, int salt) {
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    out[i] = static_cast<float>(static_cast<int64_t>(Mix(rank, i, salt) % 2001) - 1000);
  }
  return out;
}

// Values whose float sum depends on the order of the additions: 1e8 absorbs a 1 (the float
// spacing there is 8), mixed with 24 random mantissa bits at exponents from 2^-20 to 2^27.
std::vector<float> OrderSensitive(int rank, size_t n, int salt) {
  static constexpr float kLargeAndSmall[] = {1e8f, 1.0f, -1e8f, 1.0f, 3.0f, -7e7f, 0.5f, 2e7f};
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t k = Mix(rank, i, salt);
    if (i % 3 == 0) {
      out[i] = kLargeAndSmall[(static_cast<size_t>(rank) + i) % 8];
      continue;
    }
    const float mantissa = static_cast<float>(k & 0xffffff) / 16777216.0f;
    const int exponent = static_cast<int>((k >> 24) % 48) - 20;
    out[i] = std::ldexp((k >> 40) & 1 ? -mantissa : mantissa, exponent);
  }
  return out;
}

std::string Bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

using Generator = std::vector<float> (*)(int rank, size_t n, int salt);

// For i < count: the sum over ranks q of gen(q, total, salt)[begin + i], added in rank order
// ((v0 + v1) + v2) + ... as LocalComm and GlooComm do; with SmallInts, the exact sum.
std::string RankOrderSums(Generator gen, int world, size_t total, size_t begin, size_t count,
                          int salt) {
  std::vector<std::vector<float>> in;
  for (int q = 0; q < world; ++q) in.push_back(gen(q, total, salt));
  std::vector<float> sums(count);
  for (size_t i = 0; i < count; ++i) {
    float acc = in[0][begin + i];
    for (int q = 1; q < world; ++q) acc += in[q][begin + i];
    sums[i] = acc;
  }
  return Bytes(sums);
}

// What every rank holds after an AllGather of RankBytes(q, bytes, salt) from each rank q.
std::string Gathered(int world, size_t bytes, int salt) {
  std::string out;
  for (int q = 0; q < world; ++q) out += RankBytes(q, bytes, salt);
  return out;
}

// ---- One collective, as every rank issues it ----------------------------------------------------
// Each uploads this rank's input to device memory on `s`, runs the collective there and appends
// what this rank holds afterwards to `out`.

Status GatherOnce(RankEnv& env, Stream* s, const std::string& mine, bool in_place,
                  std::string* out) {
  RankBuffers mem(env.device, s);
  const size_t bytes = mine.size();
  std::string staged(bytes * env.world, '\x5a');
  if (in_place) staged.replace(static_cast<size_t>(env.rank) * bytes, bytes, mine);
  ZINF_ASSIGN_OR_RETURN(char* recv, mem.Upload(staged));
  // In place: the input is this rank's block of the output.
  const char* send = recv == nullptr ? nullptr : recv + static_cast<size_t>(env.rank) * bytes;
  if (!in_place) {
    ZINF_ASSIGN_OR_RETURN(send, mem.Upload(mine));
  }
  ZINF_RETURN_IF_ERROR(env.comm->AllGather(send, recv, bytes, s));
  return mem.Download(recv, staged.size(), out);
}

// Rank `rank`'s send buffer of an AllToAll: its block for each peer p, RankBytes salted by p.
std::string AllToAllSend(int rank, int world, size_t bytes) {
  std::string out;
  for (int p = 0; p < world; ++p) out += RankBytes(rank, bytes, 100 + p);
  return out;
}

Status AllToAllOnce(RankEnv& env, Stream* s, size_t bytes, std::string* out) {
  RankBuffers mem(env.device, s);
  ZINF_ASSIGN_OR_RETURN(char* send, mem.Upload(AllToAllSend(env.rank, env.world, bytes)));
  ZINF_ASSIGN_OR_RETURN(char* recv, mem.Upload(std::string(bytes * env.world, '\x5a')));
  ZINF_RETURN_IF_ERROR(env.comm->AllToAll(send, recv, bytes, s));
  return mem.Download(recv, bytes * env.world, out);
}

Status ReduceScatterOnce(RankEnv& env, Stream* s, const std::vector<float>& send, bool in_place,
                         std::string* out) {
  RankBuffers mem(env.device, s);
  const size_t count = send.size() / env.world;
  ZINF_ASSIGN_OR_RETURN(float* in, mem.Upload(send));
  // In place: the output is this rank's block of the input.
  float* recv = in == nullptr ? nullptr : in + static_cast<size_t>(env.rank) * count;
  if (!in_place) {
    ZINF_ASSIGN_OR_RETURN(recv, mem.Upload(std::vector<float>(count, -1.0f)));
  }
  ZINF_RETURN_IF_ERROR(env.comm->ReduceScatterSum(in, recv, count, s));
  return mem.Download(recv, count * sizeof(float), out);
}

Status AllReduceOnce(RankEnv& env, Stream* s, const std::vector<float>& mine, std::string* out) {
  RankBuffers mem(env.device, s);
  ZINF_ASSIGN_OR_RETURN(float* buf, mem.Upload(mine));
  ZINF_RETURN_IF_ERROR(env.comm->AllReduceSum(buf, mine.size(), s));
  return mem.Download(buf, mine.size() * sizeof(float), out);
}

Status BroadcastOnce(RankEnv& env, Stream* s, const std::string& mine, int root, std::string* out) {
  RankBuffers mem(env.device, s);
  ZINF_ASSIGN_OR_RETURN(char* buf, mem.Upload(mine));
  ZINF_RETURN_IF_ERROR(env.comm->Broadcast(buf, mine.size(), root, s));
  return mem.Download(buf, mine.size(), out);
}

std::string Where(const char* what, size_t n, Stream* s, bool in_place = false) {
  return std::string(what) + " of " + std::to_string(n) + (in_place ? " in place" : "") +
         " on stream '" + s->name() + "'";
}

enum class Collective { kAllGather, kReduceScatterSum, kAllReduceSum, kBroadcast, kBarrier };
constexpr Collective kEveryCollective[] = {Collective::kAllGather, Collective::kReduceScatterSum,
                                           Collective::kAllReduceSum, Collective::kBroadcast,
                                           Collective::kBarrier};

const char* NameOf(Collective c) {
  switch (c) {
    case Collective::kAllGather:
      return "AllGather";
    case Collective::kReduceScatterSum:
      return "ReduceScatterSum";
    case Collective::kAllReduceSum:
      return "AllReduceSum";
    case Collective::kBroadcast:
      return "Broadcast";
    case Collective::kBarrier:
      return "Barrier";
  }
  return "?";
}

// Issues one collective of 7 elements on `s` (Broadcast from rank 0); the caller waits.
Status IssueSmall(RankEnv& env, Collective c, Stream* s, RankBuffers& mem) {
  constexpr size_t kCount = 7;
  ZINF_ASSIGN_OR_RETURN(float* small, mem.Upload(SmallInts(env.rank, kCount, 9)));
  ZINF_ASSIGN_OR_RETURN(float* large, mem.Upload(SmallInts(env.rank, kCount * env.world, 10)));
  switch (c) {
    case Collective::kAllGather:
      return env.comm->AllGather(small, large, kCount * sizeof(float), s);
    case Collective::kReduceScatterSum:
      return env.comm->ReduceScatterSum(large, small, kCount, s);
    case Collective::kAllReduceSum:
      return env.comm->AllReduceSum(small, kCount, s);
    case Collective::kBroadcast:
      return env.comm->Broadcast(small, kCount * sizeof(float), 0, s);
    case Collective::kBarrier:
      return env.comm->Barrier();
  }
  return Status::Internal("unknown collective");
}

// ---- Checks on the reports --------------------------------------------------------------------

// Every rank set up (what it recorded is the test's to judge).
::testing::AssertionResult AllJoined(const std::vector<RankReport>& reports) {
  for (size_t r = 0; r < reports.size(); ++r) {
    if (!reports[r].setup.ok()) {
      return ::testing::AssertionFailure()
             << "rank " << r << " could not set up: " << reports[r].setup.ToString();
    }
  }
  return ::testing::AssertionSuccess();
}

// Every rank set up and recorded no failure.
::testing::AssertionResult AllOk(const std::vector<RankReport>& reports) {
  if (::testing::AssertionResult joined = AllJoined(reports); !joined) return joined;
  for (size_t r = 0; r < reports.size(); ++r) {
    for (const Status& s : reports[r].results) {
      if (!s.ok()) return ::testing::AssertionFailure() << s.ToString();
    }
  }
  return ::testing::AssertionSuccess();
}

// got == want, or where they first differ (a dump of long buffers would drown the failure).
::testing::AssertionResult SameBytes(const std::string& got, const std::string& want) {
  if (got == want) return ::testing::AssertionSuccess();
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << got.size() << " bytes, expected " << want.size();
  }
  size_t i = 0;
  while (got[i] == want[i]) ++i;
  return ::testing::AssertionFailure()
         << "first difference at byte " << i << " of " << got.size() << ": "
         << static_cast<int>(static_cast<unsigned char>(got[i])) << ", expected "
         << static_cast<int>(static_cast<unsigned char>(want[i]));
}

void ExpectData(const std::vector<RankReport>& reports, const std::vector<std::string>& want) {
  for (size_t r = 0; r < reports.size(); ++r) {
    EXPECT_TRUE(SameBytes(reports[r].data, want[r])) << "rank " << r;
  }
}

// What a rank recorded, for a failure message.
std::string Recorded(const RankReport& report) {
  std::string out;
  for (const Status& s : report.results) out += "\n  " + s.ToString();
  return out.empty() ? " nothing" : out;
}

::testing::AssertionResult Says(const Status& s, const std::string& text) {
  if (s.message().find(text) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << text << "' is not in " << s.ToString();
}

// ---- The suite ----------------------------------------------------------------------------------

class CommContract : public ::testing::TestWithParam<std::tuple<Impl, int>> {
 protected:
  void SetUp() override {
    impl_ = MakeImpl(std::get<0>(GetParam()));
    ASSERT_NE(impl_, nullptr) << ImplName(std::get<0>(GetParam())) << " is not built here";
    const std::string skip = impl_->SkipReason(world());
    if (!skip.empty()) GTEST_SKIP() << skip;
  }

  int world() const { return std::get<1>(GetParam()); }
  // Runs `body` on every rank of a new group.
  std::vector<RankReport> RunRanks(const RankBody& body, milliseconds timeout = kPatientTimeout) {
    return impl_->Run(world(), timeout, body);
  }

  std::unique_ptr<CommUnderTest> impl_;
};

// Sizes of the byte collectives: nothing (null pointers; an empty collective keeps the ranks in
// step, so the sizes after it pair up), one byte, odd sizes, and one over 64 KiB.
constexpr size_t kByteSizes[] = {0, 1, 7, 1001, 65537};

TEST_P(CommContract, KnowsItsRankAndWorldSize) {
  std::vector<RankReport> reports = RunRanks([](RankEnv& env) {
    *env.data() =
        std::to_string(env.comm->rank()) + " of " + std::to_string(env.comm->world_size());
  });
  ASSERT_TRUE(AllOk(reports));
  for (int r = 0; r < world(); ++r) {
    EXPECT_EQ(reports[r].data, std::to_string(r) + " of " + std::to_string(world()));
  }
}

TEST_P(CommContract, AllGatherEverySizeInAndOutOfPlace) {
  std::vector<RankReport> reports = RunRanks([](RankEnv& env) {
    for (Stream* s : env.Streams()) {
      for (size_t bytes : kByteSizes) {
        for (bool in_place : {false, true}) {
          if (!env.Ok(GatherOnce(env, s, RankBytes(env.rank, bytes, 1), in_place, env.data()),
                      Where("AllGather", bytes, s, in_place))) {
            return;
          }
        }
      }
    }
  });
  ASSERT_TRUE(AllOk(reports));
  std::string want;
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t bytes : kByteSizes) {
      want += Gathered(world(), bytes, 1);  // out of place
      want += Gathered(world(), bytes, 1);  // in place
    }
  }
  ExpectData(reports, std::vector<std::string>(world(), want));
}

// Rank r receives every rank's r-th block, in rank order.
TEST_P(CommContract, AllToAllEverySize) {
  std::vector<RankReport> reports = RunRanks([](RankEnv& env) {
    for (Stream* s : env.Streams()) {
      for (size_t bytes : kByteSizes) {
        if (!env.Ok(AllToAllOnce(env, s, bytes, env.data()), Where("AllToAll", bytes, s, false))) {
          return;
        }
      }
    }
  });
  ASSERT_TRUE(AllOk(reports));
  for (int r = 0; r < world(); ++r) {
    std::string want;
    for (int pass = 0; pass < 2; ++pass) {
      for (size_t bytes : kByteSizes) {
        for (int from = 0; from < world(); ++from) want += RankBytes(from, bytes, 100 + r);
      }
    }
    EXPECT_TRUE(SameBytes(reports[r].data, want)) << "rank " << r;
  }
}

TEST_P(CommContract, ReduceScatterSumEverySizeInAndOutOfPlace) {
  const std::vector<size_t> counts = {0, 1, 7, 1001, 4099};  // floats per rank
  const int n = world();
  std::vector<RankReport> reports = RunRanks([&](RankEnv& env) {
    for (Stream* s : env.Streams()) {
      for (size_t count : counts) {
        const std::vector<float> send = SmallInts(env.rank, count * n, static_cast<int>(count));
        for (bool in_place : {false, true}) {
          if (!env.Ok(ReduceScatterOnce(env, s, send, in_place, env.data()),
                      Where("ReduceScatterSum", count, s, in_place))) {
            return;
          }
        }
      }
    }
  });
  ASSERT_TRUE(AllOk(reports));
  for (int r = 0; r < n; ++r) {
    std::string want;
    for (int pass = 0; pass < 2; ++pass) {
      for (size_t count : counts) {
        const std::string sums =
            RankOrderSums(SmallInts, n, count * n, r * count, count, static_cast<int>(count));
        want += sums + sums;
      }
    }
    EXPECT_TRUE(SameBytes(reports[r].data, want)) << "rank " << r;
  }
}

TEST_P(CommContract, AllReduceSumEverySize) {
  // Fewer elements than ranks (1, 2), and counts no world size here divides (7, 1001, 5003).
  const std::vector<size_t> counts = {0, 1, 2, 7, 1001, 5003};
  std::vector<RankReport> reports = RunRanks([&](RankEnv& env) {
    for (Stream* s : env.Streams()) {
      for (size_t count : counts) {
        if (!env.Ok(AllReduceOnce(env, s, SmallInts(env.rank, count, static_cast<int>(count)),
                                  env.data()),
                    Where("AllReduceSum", count, s))) {
          return;
        }
      }
    }
  });
  ASSERT_TRUE(AllOk(reports));
  std::string want;
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t count : counts) {
      want += RankOrderSums(SmallInts, world(), count, 0, count, static_cast<int>(count));
    }
  }
  ExpectData(reports, std::vector<std::string>(world(), want));
}

// comm.h: LocalComm and GlooComm add in rank order, so their sums are the same bits on every
// rank and in every run. One rank sums nothing: its result is its input, bit for bit, on every
// implementation.
TEST_P(CommContract, SumsAreTheRankOrderSumBitForBit) {
  if (!impl_->SumsInRankOrder() && world() > 1) {
    GTEST_SKIP() << ImplName(std::get<0>(GetParam()))
                 << " adds in its own order (include/zinf/comm.h); "
                    "AllReduceSumGivesEveryRankTheSameBits checks what it promises";
  }
  constexpr size_t kCount = 1001;
  const int n = world();
  std::vector<RankReport> reports = RunRanks([&](RankEnv& env) {
    for (Stream* s : env.Streams()) {
      if (!env.Ok(ReduceScatterOnce(env, s, OrderSensitive(env.rank, kCount * n, 50), false,
                                    env.data()),
                  Where("ReduceScatterSum", kCount, s)) ||
          !env.Ok(AllReduceOnce(env, s, OrderSensitive(env.rank, kCount, 51), env.data()),
                  Where("AllReduceSum", kCount, s))) {
        return;
      }
    }
  });
  ASSERT_TRUE(AllOk(reports));
  if (n >= 3) {
    // The values expose the order: adding the other way round gives other bits somewhere, for
    // both collectives' values. (Two ranks' sum is the same either way: at world 2 this checks
    // the sums, and world 3 the order.)
    for (int salt : {50, 51}) {
      const size_t count = salt == 50 ? kCount * n : kCount;
      const std::vector<float> v0 = OrderSensitive(0, count, salt);
      const std::vector<float> v1 = OrderSensitive(1, count, salt);
      const std::vector<float> v2 = OrderSensitive(2, count, salt);
      int differ = 0;
      for (size_t i = 0; i < count; ++i) {
        if (((v0[i] + v1[i]) + v2[i]) != ((v2[i] + v1[i]) + v0[i])) ++differ;
      }
      ASSERT_GT(differ, 0) << "salt " << salt;
    }
  }
  for (int r = 0; r < n; ++r) {
    const std::string once = RankOrderSums(OrderSensitive, n, kCount * n, r * kCount, kCount, 50) +
                             RankOrderSums(OrderSensitive, n, kCount, 0, kCount, 51);
    EXPECT_TRUE(SameBytes(reports[r].data, once + once)) << "rank " << r;
  }
}

// What comm.h promises of every implementation, NCCL's own order included.
TEST_P(CommContract, AllReduceSumGivesEveryRankTheSameBits) {
  constexpr size_t kCount = 5003;
  std::vector<RankReport> reports = RunRanks([](RankEnv& env) {
    env.Ok(AllReduceOnce(env, env.worker, OrderSensitive(env.rank, kCount, 52), env.data()),
           Where("AllReduceSum", kCount, env.worker));
  });
  ASSERT_TRUE(AllOk(reports));
  ASSERT_EQ(reports[0].data.size(), kCount * sizeof(float));
  for (int r = 1; r < world(); ++r) {
    EXPECT_TRUE(SameBytes(reports[r].data, reports[0].data)) << "rank " << r << " against rank 0";
  }
  if (world() == 1) {
    EXPECT_TRUE(SameBytes(reports[0].data, Bytes(OrderSensitive(0, kCount, 52))));
  }
}

TEST_P(CommContract, BroadcastEverySizeFromEveryRoot) {
  const int n = world();
  std::vector<RankReport> reports = RunRanks([&](RankEnv& env) {
    for (Stream* s : env.Streams()) {
      for (size_t bytes : kByteSizes) {
        for (int root = 0; root < n; ++root) {
          if (!env.Ok(BroadcastOnce(env, s, RankBytes(env.rank, bytes, 3 + root), root, env.data()),
                      Where("Broadcast", bytes, s) + " from root " + std::to_string(root))) {
            return;
          }
        }
      }
    }
  });
  ASSERT_TRUE(AllOk(reports));
  std::string want;
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t bytes : kByteSizes) {
      for (int root = 0; root < n; ++root) want += RankBytes(root, bytes, 3 + root);
    }
  }
  ExpectData(reports, std::vector<std::string>(n, want));
}

// A counter in memory shared by the ranks, threads or forked processes alike.
class SharedCounter {
 public:
  static_assert(std::atomic<int64_t>::is_always_lock_free, "shared between processes");
  SharedCounter() {
    void* p = mmap(nullptr, sizeof(std::atomic<int64_t>), PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p != MAP_FAILED) value_ = new (p) std::atomic<int64_t>(0);
  }
  ~SharedCounter() {
    if (value_ != nullptr) munmap(value_, sizeof(*value_));
  }
  SharedCounter(const SharedCounter&) = delete;
  SharedCounter& operator=(const SharedCounter&) = delete;
  bool ok() const { return value_ != nullptr; }
  std::atomic<int64_t>& value() { return *value_; }

 private:
  std::atomic<int64_t>* value_ = nullptr;
};

TEST_P(CommContract, BarrierHoldsEveryRankUntilAllHaveArrived) {
  constexpr int kRounds = 10;
  SharedCounter arrived;
  ASSERT_TRUE(arrived.ok());
  std::vector<RankReport> reports = RunRanks([&](RankEnv& env) {
    for (int round = 0; round < kRounds; ++round) {
      arrived.value().fetch_add(1);
      if (!env.Ok(env.comm->Barrier(), "Barrier of round " + std::to_string(round))) return;
      // A rank may already count for the next round: the count is a lower bound only.
      const int64_t seen = arrived.value().load();
      if (seen < static_cast<int64_t>(round + 1) * env.world) {
        env.Record(Status::Internal("rank " + std::to_string(env.rank) +
                                    " left the Barrier of round " + std::to_string(round) +
                                    " having seen " + std::to_string(seen) + " arrivals"));
        return;
      }
    }
  });
  ASSERT_TRUE(AllOk(reports));
  EXPECT_EQ(arrived.value().load(), int64_t{kRounds} * world());
}

constexpr int kQueuedRounds = 6;

// Every data collective, kQueuedRounds times, queued on `s` with the uploads of their inputs
// and nothing waited for in between; then what this rank holds, round by round.
Status QueuedScript(RankEnv& env, Stream* s, std::string* out) {
  struct Round {
    // Host memory, kept until the stream has run the copies from it.
    std::vector<float> ar, rs, rs_out;
    std::string bc, ag, ag_out;
    float* ar_buf = nullptr;
    float* rs_send = nullptr;
    float* rs_recv = nullptr;
    char* bc_buf = nullptr;
    char* ag_send = nullptr;
    char* ag_recv = nullptr;
  };
  const int n = env.world;
  std::vector<Round> rounds(kQueuedRounds);
  RankBuffers mem(env.device, s);  // after `rounds`: waits for the stream before they go
  for (int k = 0; k < kQueuedRounds; ++k) {
    Round& r = rounds[k];
    r.ar = SmallInts(env.rank, 7 + k, 100 + k);
    r.rs = SmallInts(env.rank, (2 + k) * n, 400 + k);
    r.rs_out.assign(2 + k, -1.0f);
    r.bc = RankBytes(env.rank, 5 + k, 200 + k);
    r.ag = RankBytes(env.rank, 3 + k, 300 + k);
    r.ag_out.assign((3 + k) * n, '\0');
    ZINF_ASSIGN_OR_RETURN(r.ar_buf, mem.Stage(r.ar.data(), r.ar.size()));
    ZINF_ASSIGN_OR_RETURN(r.rs_send, mem.Stage(r.rs.data(), r.rs.size()));
    ZINF_ASSIGN_OR_RETURN(r.rs_recv, mem.Stage(r.rs_out.data(), r.rs_out.size()));
    ZINF_ASSIGN_OR_RETURN(r.bc_buf, mem.Stage(r.bc.data(), r.bc.size()));
    ZINF_ASSIGN_OR_RETURN(r.ag_send, mem.Stage(r.ag.data(), r.ag.size()));
    ZINF_ASSIGN_OR_RETURN(r.ag_recv, mem.Stage(r.ag_out.data(), r.ag_out.size()));
    ZINF_RETURN_IF_ERROR(env.comm->AllReduceSum(r.ar_buf, r.ar.size(), s));
    ZINF_RETURN_IF_ERROR(env.comm->Broadcast(r.bc_buf, r.bc.size(), k % n, s));
    ZINF_RETURN_IF_ERROR(env.comm->AllGather(r.ag_send, r.ag_recv, r.ag.size(), s));
    ZINF_RETURN_IF_ERROR(env.comm->ReduceScatterSum(r.rs_send, r.rs_recv, r.rs_out.size(), s));
  }
  for (const Round& r : rounds) {
    ZINF_RETURN_IF_ERROR(mem.Download(r.ar_buf, r.ar.size() * sizeof(float), out));
    ZINF_RETURN_IF_ERROR(mem.Download(r.bc_buf, r.bc.size(), out));
    ZINF_RETURN_IF_ERROR(mem.Download(r.ag_recv, r.ag_out.size(), out));
    ZINF_RETURN_IF_ERROR(mem.Download(r.rs_recv, r.rs_out.size() * sizeof(float), out));
  }
  return Status::OK();
}

// Collectives queued on a stream pair up with the peers' in the order they were issued, and
// each sees the work queued before it (the upload of its input).
TEST_P(CommContract, QueuedCollectivesRunInIssueOrder) {
  std::vector<RankReport> reports = RunRanks([](RankEnv& env) {
    for (Stream* s : env.Streams()) {
      if (!env.Ok(QueuedScript(env, s, env.data()), "queued collectives on '" + s->name() + "'")) {
        return;
      }
    }
  });
  ASSERT_TRUE(AllOk(reports));
  const int n = world();
  for (int r = 0; r < n; ++r) {
    std::string once;
    for (int k = 0; k < kQueuedRounds; ++k) {
      const size_t rs_count = 2 + k;
      once += RankOrderSums(SmallInts, n, 7 + k, 0, 7 + k, 100 + k);
      once += RankBytes(k % n, 5 + k, 200 + k);
      once += Gathered(n, 3 + k, 300 + k);
      once += RankOrderSums(SmallInts, n, rs_count * n, r * rs_count, rs_count, 400 + k);
    }
    EXPECT_TRUE(SameBytes(reports[r].data, once + once)) << "rank " << r;
  }
}

// comm.h: Counters() are zero where the implementation does not count; where it does, a
// collective counts once, and moves bytes to the peers when there are any.
TEST_P(CommContract, CountersCountEachCollectiveOrNothing) {
  constexpr size_t kCount = 1001;
  std::vector<RankReport> reports = RunRanks([](RankEnv& env) {
    const CommCounters before = env.comm->Counters();
    std::string sums;  // AllReduceSumEverySize checks them
    const bool ok = env.Ok(AllReduceOnce(env, env.worker, SmallInts(env.rank, kCount, 60), &sums),
                           Where("AllReduceSum", kCount, env.worker));
    const CommCounters after = env.comm->Counters();
    if (!ok) return;
    *env.data() = std::to_string(before.collectives) + " " + std::to_string(after.collectives) +
                  " " + std::to_string(before.bytes_sent) + " " + std::to_string(after.bytes_sent) +
                  " " + (before.seconds >= 0 && after.seconds >= before.seconds ? "1" : "0");
  });
  ASSERT_TRUE(AllOk(reports));
  for (int r = 0; r < world(); ++r) {
    SCOPED_TRACE("rank " + std::to_string(r) + ": " + reports[r].data);
    std::istringstream in(reports[r].data);
    uint64_t collectives0 = 0, collectives1 = 0, bytes0 = 0, bytes1 = 0;
    int seconds_grew = 0;
    ASSERT_TRUE(in >> collectives0 >> collectives1 >> bytes0 >> bytes1 >> seconds_grew);
    EXPECT_EQ(seconds_grew, 1);
    if (!impl_->CountsTraffic()) {
      EXPECT_EQ(collectives0 + collectives1 + bytes0 + bytes1, 0u);
      continue;
    }
    EXPECT_EQ(collectives1, collectives0 + 1);
    if (world() > 1) {
      EXPECT_GT(bytes1, bytes0);
    } else {
      EXPECT_EQ(bytes1, bytes0);
    }
  }
}

// A call with bad arguments: rank 0 makes it, the other ranks make the matching good one.
struct BadCall {
  std::string name;
  std::function<Status(const RankEnv& env, float* small, float* large, bool bad)> issue;
  std::vector<std::string> refusal_says;  // what rank 0's InvalidArgument names
  std::string peers_say;                  // what the peers' failure names (their collective)
};

constexpr size_t kBadCount = 7;

std::vector<BadCall> BadCalls(int world) {
  const std::string not_a_rank = "root is not a rank of a world of " + std::to_string(world);
  const std::string gather = "AllGather of 7 bytes per rank";
  const std::string scatter = "ReduceScatterSum of 7 floats per rank";
  const std::string reduce = "AllReduceSum of 7 floats";
  return {
      {"a null AllGather send buffer",
       [](const RankEnv& e, float* small, float* large, bool bad) {
         return e.comm->AllGather(bad ? nullptr : small, large, kBadCount, e.worker);
       },
       {gather, "send buffer is null"},
       gather},
      {"a null AllGather receive buffer",
       [](const RankEnv& e, float* small, float* large, bool bad) {
         return e.comm->AllGather(small, bad ? nullptr : large, kBadCount, e.worker);
       },
       {gather, "receive buffer is null"},
       gather},
      {"a null ReduceScatterSum send buffer",
       [](const RankEnv& e, float* small, float* large, bool bad) {
         return e.comm->ReduceScatterSum(bad ? nullptr : large, small, kBadCount, e.worker);
       },
       {scatter, "send buffer is null"},
       scatter},
      {"a null ReduceScatterSum receive buffer",
       [](const RankEnv& e, float* small, float* large, bool bad) {
         return e.comm->ReduceScatterSum(large, bad ? nullptr : small, kBadCount, e.worker);
       },
       {scatter, "receive buffer is null"},
       scatter},
      {"a null AllReduceSum buffer",
       [](const RankEnv& e, float* small, float*, bool bad) {
         return e.comm->AllReduceSum(bad ? nullptr : small, kBadCount, e.worker);
       },
       {reduce, "buffer is null"},
       reduce},
      {"a null Broadcast buffer",
       [](const RankEnv& e, float* small, float*, bool bad) {
         return e.comm->Broadcast(bad ? nullptr : small, kBadCount, 0, e.worker);
       },
       {"Broadcast of 7 bytes from root 0", "buffer is null"},
       "Broadcast of 7 bytes"},
      {"a Broadcast root of -1",
       [](const RankEnv& e, float* small, float*, bool bad) {
         return e.comm->Broadcast(small, kBadCount, bad ? -1 : 0, e.worker);
       },
       {"Broadcast of 7 bytes from root -1", not_a_rank},
       "Broadcast of 7 bytes"},
      {"a Broadcast root equal to the world size",
       [](const RankEnv& e, float* small, float*, bool bad) {
         return e.comm->Broadcast(small, kBadCount, bad ? e.world : 0, e.worker);
       },
       {"Broadcast of 7 bytes from root " + std::to_string(world), not_a_rank},
       "Broadcast of 7 bytes"},
      {"a null stream",
       [](const RankEnv& e, float* small, float*, bool bad) {
         return e.comm->AllReduceSum(small, kBadCount, bad ? nullptr : e.worker);
       },
       {reduce, "stream is null"},
       reduce},
      // LocalComm and GlooComm pass the device's own message on, which names the stream but
      // not the collective.
      {"a stream of another device",
       [](const RankEnv& e, float* small, float*, bool bad) {
         return e.comm->AllReduceSum(small, kBadCount, bad ? e.foreign : e.worker);
       },
       {"'foreign'"},
       reduce},
  };
}

// The refusing rank gets InvalidArgument naming the collective and the problem; its peers,
// waiting in the matching collective, fail instead of hanging (at once where the implementation
// can tell them, at the timeout where it cannot: NCCL). What the group is good for afterwards
// is the implementation's (LocalComm stays usable, GlooComm breaks; their own tests say so).
// The two ways of splitting the suite's groups: every other rank ({0, 2} and {1} of 3; {0, 2}
// and {1, 3} of 4), and halves ({0, 1} and {2}; {0, 1} and {2, 3}: hpZ's nodes).
int SplitColor(int way, int rank) { return way == 0 ? rank % 2 : rank / 2; }

// Sub-groups, over worlds up to 4 (two groups of several ranks at once).
class CommSplit : public CommContract {};

// Each rank's sub-group runs the collectives of its own members only: gathers, an all-to-all
// and an ordered sum see the sub-group's ranks in their order, and the parent's collectives,
// issued between them on the same stream, still pair with the parent's.
TEST_P(CommSplit, SplitMakesSubGroupsOfTheSameColor) {
  constexpr size_t kBytes = 1001;
  constexpr size_t kCount = 7;  // floats per rank of the reduce-scatter
  std::vector<RankReport> reports = RunRanks([&](RankEnv& env) {
    for (int way = 0; way < 2; ++way) {
      Result<std::unique_ptr<Communicator>> sub =
          env.comm->Split(SplitColor(way, env.rank), env.worker);
      if (!env.Ok(sub.status(), "Split way " + std::to_string(way))) return;
      RankEnv in = env;
      in.comm = sub->get();
      in.rank = in.comm->rank();
      in.world = in.comm->world_size();
      *env.data() += std::to_string(in.rank) + " of " + std::to_string(in.world) + ";";
      // (Salted by the color: a rank paired with another group's would read other bytes.)
      const int salt = 10 * way + 3 * SplitColor(way, env.rank);
      if (!env.Ok(
              GatherOnce(in, env.worker, RankBytes(in.rank, kBytes, salt + 1), false, env.data()),
              "sub AllGather") ||
          !env.Ok(GatherOnce(env, env.worker, RankBytes(env.rank, kBytes, 10 * way + 2), true,
                             env.data()),
                  "parent AllGather") ||
          !env.Ok(AllToAllOnce(in, env.worker, kBytes, env.data()), "sub AllToAll") ||
          !env.Ok(ReduceScatterOnce(in, env.worker, SmallInts(in.rank, kCount * in.world, salt),
                                    false, env.data()),
                  "sub ReduceScatterSum") ||
          !env.Ok(in.comm->Barrier(), "sub Barrier")) {
        return;
      }
    }
  });
  ASSERT_TRUE(AllOk(reports));
  for (int r = 0; r < world(); ++r) {
    std::string want;
    for (int way = 0; way < 2; ++way) {
      std::vector<int> members;
      for (int q = 0; q < world(); ++q) {
        if (SplitColor(way, q) == SplitColor(way, r)) members.push_back(q);
      }
      const int n = static_cast<int>(members.size());
      const int index =
          static_cast<int>(std::find(members.begin(), members.end(), r) - members.begin());
      const int salt = 10 * way + 3 * SplitColor(way, r);
      want += std::to_string(index) + " of " + std::to_string(n) + ";";
      want += Gathered(n, kBytes, salt + 1);
      want += Gathered(world(), kBytes, 10 * way + 2);
      for (int from = 0; from < n; ++from) want += RankBytes(from, kBytes, 100 + index);
      want += RankOrderSums(SmallInts, n, kCount * n, index * kCount, kCount, salt);
    }
    EXPECT_TRUE(SameBytes(reports[r].data, want)) << "rank " << r;
  }
}

// A negative color on one rank fails Split on every rank, naming that rank; the parent group
// goes on working.
TEST_P(CommSplit, SplitRefusesANegativeColorOnEveryRank) {
  std::vector<RankReport> reports = RunRanks([](RankEnv& env) {
    Result<std::unique_ptr<Communicator>> sub = env.comm->Split(env.rank == 0 ? -1 : 0, env.worker);
    env.Record(sub.status());
    env.Record(GatherOnce(env, env.worker, RankBytes(env.rank, 7, 3), false, env.data()));
  });
  ASSERT_TRUE(AllJoined(reports));
  for (int r = 0; r < world(); ++r) {
    ASSERT_EQ(reports[r].results.size(), 2u) << "rank " << r << Recorded(reports[r]);
    EXPECT_EQ(reports[r].results[0].code(), StatusCode::kInvalidArgument) << "rank " << r;
    EXPECT_TRUE(Says(reports[r].results[0], "rank 0 gave color -1")) << "rank " << r;
    EXPECT_TRUE(reports[r].results[1].ok()) << reports[r].results[1].ToString();
    EXPECT_TRUE(SameBytes(reports[r].data, Gathered(world(), 7, 3))) << "rank " << r;
  }
}

TEST_P(CommContract, ArgumentErrorsAreRefusedAndNamed) {
  for (const BadCall& call : BadCalls(world())) {
    SCOPED_TRACE(call.name);
    std::vector<RankReport> reports = RunRanks(
        [&](RankEnv& env) {
          RankBuffers mem(env.device, env.worker);
          Result<float*> small = mem.Upload(SmallInts(env.rank, kBadCount, 7));
          Result<float*> large = mem.Upload(SmallInts(env.rank, kBadCount * env.world, 8));
          if (!env.Ok(small.status(), "setup") || !env.Ok(large.status(), "setup")) return;
          const bool bad = env.rank == 0;
          Status s = call.issue(env, *small, *large, bad);
          if (!bad && s.ok()) s = env.device->SynchronizeStream(env.worker);
          env.Record(s);
        },
        impl_->FailureTimeout());
    ASSERT_TRUE(AllJoined(reports));
    ASSERT_EQ(reports[0].results.size(), 1u) << "rank 0 recorded" << Recorded(reports[0]);
    const Status& refused = reports[0].results[0];
    EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.ToString();
    for (const std::string& text : call.refusal_says) EXPECT_TRUE(Says(refused, text));
    for (int r = 1; r < world(); ++r) {
      ASSERT_EQ(reports[r].results.size(), 1u)
          << "rank " << r << " recorded" << Recorded(reports[r]);
      const Status& peer = reports[r].results[0];
      EXPECT_EQ(peer.code(), StatusCode::kFailedPrecondition)
          << "rank " << r << ": " << peer.ToString();
      EXPECT_TRUE(Says(peer, call.peers_say)) << "rank " << r;
    }
  }
}

// A rank that joined and then returns without taking part: every other rank's collective
// fails with FailedPrecondition (when its peer is found dead, or at the timeout) saying the
// group is unusable, and every later collective fails at once with the same Status.
TEST_P(CommContract, ADeadPeerFailsTheOthersInsteadOfHanging) {
  if (world() == 1) GTEST_SKIP() << "a dead peer needs a second rank";
  const int dead = world() - 1;
  for (Collective c : kEveryCollective) {
    SCOPED_TRACE(NameOf(c));
    std::vector<RankReport> reports = RunRanks(
        [&](RankEnv& env) {
          if (env.rank == dead) return;
          RankBuffers mem(env.device, env.worker);
          Status first = IssueSmall(env, c, env.worker, mem);
          if (first.ok()) first = env.device->SynchronizeStream(env.worker);
          // A root's Broadcast may complete without the dead peer (it only sends); the
          // Barrier after it cannot.
          if (first.ok()) first = env.comm->Barrier();
          env.Record(first);
          env.Record(env.comm->Barrier());
        },
        impl_->FailureTimeout());
    ASSERT_TRUE(AllJoined(reports));
    EXPECT_TRUE(reports[dead].results.empty()) << Recorded(reports[dead]);
    for (int r = 0; r < dead; ++r) {
      ASSERT_EQ(reports[r].results.size(), 2u)
          << "rank " << r << " recorded" << Recorded(reports[r]);
      const Status& first = reports[r].results[0];
      const Status& later = reports[r].results[1];
      EXPECT_EQ(first.code(), StatusCode::kFailedPrecondition) << first.ToString();
      EXPECT_TRUE(Says(first, NameOf(c)) || Says(first, "Barrier")) << first.ToString();
      EXPECT_TRUE(Says(first, "unusable"));
      EXPECT_EQ(later.code(), StatusCode::kFailedPrecondition) << later.ToString();
      // The same Status (a stream's sticky error adds the stream's name in front).
      EXPECT_TRUE(Says(first, later.message()));
    }
  }
}

std::string WorldName(const ::testing::TestParamInfo<std::tuple<Impl, int>>& info) {
  return "world" + std::to_string(std::get<1>(info.param));
}

#ifdef ZINF_CONTRACT_NCCL
INSTANTIATE_TEST_SUITE_P(Nccl, CommContract,
                         ::testing::Combine(::testing::Values(Impl::kNccl),
                                            ::testing::Values(1, 2, 3)),
                         WorldName);
INSTANTIATE_TEST_SUITE_P(Nccl, CommSplit,
                         ::testing::Combine(::testing::Values(Impl::kNccl),
                                            ::testing::Values(1, 2, 3, 4)),
                         WorldName);
#else
// Two suites so that CMake labels them apart: LocalComm's ranks are threads (TSan runs them),
// GlooComm's fork (label multiprocess).
INSTANTIATE_TEST_SUITE_P(Local, CommContract,
                         ::testing::Combine(::testing::Values(Impl::kLocal),
                                            ::testing::Values(1, 2, 3)),
                         WorldName);
INSTANTIATE_TEST_SUITE_P(Gloo, CommContract,
                         ::testing::Combine(::testing::Values(Impl::kGloo),
                                            ::testing::Values(1, 2, 3)),
                         WorldName);
INSTANTIATE_TEST_SUITE_P(Local, CommSplit,
                         ::testing::Combine(::testing::Values(Impl::kLocal),
                                            ::testing::Values(1, 2, 3, 4)),
                         WorldName);
INSTANTIATE_TEST_SUITE_P(Gloo, CommSplit,
                         ::testing::Combine(::testing::Values(Impl::kGloo),
                                            ::testing::Values(1, 2, 3, 4)),
                         WorldName);
#endif

}  // namespace
}  // namespace zinf
