// zinf-nvme-bench: sequential O_DIRECT throughput of zinf's I/O path (IoQueue over a backend,
// buffers from the PinnedArena), optionally side by side with fio on the same files, and a
// sweep that prints the best block size / queue depth as a zinf config snippet.
//
// One JSON line per measured case on stdout; progress and notes on stderr.
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <future>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "bench/fio_huge_pages.h"
#include "common/cli.h"
#include "nvme/io_queue.h"
#include "zinf/log.h"
#include "zinf/swap.h"

namespace zinf {
namespace {

using Clock = std::chrono::steady_clock;
using bench::Median;
using nlohmann::json;

std::string SizeLabel(uint64_t n) {
  if (n % (1ull << 30) == 0) return std::to_string(n >> 30) + "G";
  if (n % (1ull << 20) == 0) return std::to_string(n >> 20) + "M";
  if (n % (1ull << 10) == 0) return std::to_string(n >> 10) + "K";
  return std::to_string(n);
}

// The median of samples kept by repeat.
double Median(const std::map<int, double>& by_repeat) {
  std::vector<double> v;
  for (const auto& [rep, x] : by_repeat) v.push_back(x);
  return Median(std::move(v));
}

// The median over repeats of a / b, each pair measured in the same repeat: the disk's drift
// from repeat to repeat (the host's cache, other guests) cancels within a pair. 0 when no
// repeat has both.
double PairedRatio(const std::map<int, double>& a, const std::map<int, double>& b) {
  std::vector<double> r;
  for (const auto& [rep, x] : a) {
    auto it = b.find(rep);
    if (it != b.end() && it->second > 0) r.push_back(x / it->second);
  }
  return Median(std::move(r));
}

// The fio peers --compare-fio runs. `huge`: buffers on hugetlbfs pages (--iomem=mmaphuge:...,
// added once the pages are set up), as zinf's own buffers are on huge pages.
struct FioVariant {
  std::string name, engine, extra;
  bool huge = false;
};
const FioVariant kFioVariants[] = {
    {"fio-io_uring", "io_uring", "", false},
    {"fio-io_uring-fixedbufs", "io_uring", "--fixedbufs", false},
    {"fio-io_uring-fixedbufs-registerfiles", "io_uring", "--fixedbufs --registerfiles", false},
    {"fio-libaio", "libaio", "", false},
    {"fio-io_uring-huge", "io_uring", "", true},
    {"fio-io_uring-fixedbufs-huge", "io_uring", "--fixedbufs", true},
    {"fio-libaio-huge", "libaio", "", true},
};

// Whether --fio-variants asks for `name` (an empty list asks for all).
bool Wanted(const std::vector<std::string>& wanted, const std::string& name) {
  return wanted.empty() || std::find(wanted.begin(), wanted.end(), name) != wanted.end();
}

struct Flags {
  std::string backend = "io_uring";
  std::string op = "both";
  std::string block_size = "1M";
  uint32_t queue_depth = 32;
  std::string size = "4G";
  std::vector<std::string> dirs;
  std::string registered = "on";
  std::string huge_pages = "on";
  double seconds = 10;
  int repeats = 1;
  bool sweep = false;
  bool compare_fio = false;
  bool checksum_cost = false;
  bool sqpoll = false;
  bool keep_files = false;
  std::string fio = "fio";
  std::string fio_variants;  // comma-separated names; empty: every variant
  double settle = 0;         // seconds of quiet before each run
};

// The bench files still named in a folder (kept only while fio needs their paths), removed by
// SIGINT/SIGTERM as well as at exit: a stopped bench leaves no multi-GiB file behind.
constexpr int kMaxNamed = 64;
char g_named[kMaxNamed][4096];
volatile sig_atomic_t g_named_count = 0;

void RemoveNamedAndDie(int sig) {
  for (int i = 0; i < g_named_count; ++i) unlink(g_named[i]);  // async-signal-safe
  FioHugePages::RestoreFromSignal();  // the huge pages and mount set up for fio, if any
  signal(sig, SIG_DFL);
  raise(sig);
}

// The bench files: one per folder, preallocated, filled once with data, locked against a
// second bench (flock), and removed at exit unless kept (--keep-files): unlinked at once when
// nothing needs their names, so not even a SIGKILL leaves them behind.
class BenchFiles {
 public:
  ~BenchFiles() {
    for (const IoFile& f : files_) close(f.fd);
    for (const std::string& path : named_) unlink(path.c_str());  // best effort at exit
  }
  // `keep`: leave the files for the next run (which reuses them); `need_names`: fio opens
  // them by path, so they are unlinked at exit (or on SIGINT/SIGTERM) instead of at once.
  Status Open(const std::vector<std::string>& dirs, uint64_t per_file, bool keep, bool need_names) {
    per_file_ = per_file;
    for (size_t i = 0; i < dirs.size(); ++i) {
      std::string path = dirs[i] + "/zinf-bench-" + std::to_string(i) + ".dat";
      int fd = open(path.c_str(), O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC | O_NOFOLLOW, 0600);
      if (fd < 0 && errno == EINVAL) {
        return Status::NotSupported(path +
                                    ": O_DIRECT refused (tmpfs?); benchmark a folder on "
                                    "a disk");
      }
      if (fd < 0) return ErrnoToStatus(errno, "opening " + path);
      files_.push_back({fd, path});
      // (A bench that just exited may hold it for a moment more: the kernel tears its io_uring,
      // which registered the file, down after the process.)
      int locked = -1;
      for (int attempt = 0; attempt < 50; ++attempt) {
        locked = flock(fd, LOCK_EX | LOCK_NB);
        if (locked == 0 || errno != EWOULDBLOCK) break;
        usleep(100 * 1000);
      }
      if (locked != 0) {
        return errno == EWOULDBLOCK
                   ? Status::FailedPrecondition(path +
                                                " is in use by another zinf-nvme-bench: "
                                                "give this one another --dir")
                   : ErrnoToStatus(errno, "flock " + path);
      }
      if (!keep && !need_names) {
        if (unlink(path.c_str()) != 0) return ErrnoToStatus(errno, "unlinking " + path);
      } else if (!keep) {
        if (g_named_count >= kMaxNamed || path.size() >= sizeof(g_named[0])) {
          return Status::InvalidArgument("too many --dir folders or too long a path for fio");
        }
        std::snprintf(g_named[g_named_count], sizeof(g_named[0]), "%s", path.c_str());
        g_named_count = g_named_count + 1;
        named_.push_back(path);
      }
      struct stat st {};
      if (fstat(fd, &st) != 0) return ErrnoToStatus(errno, "fstat " + path);
      if (static_cast<uint64_t>(st.st_size) < per_file &&
          fallocate(fd, 0, 0, static_cast<off_t>(per_file)) != 0) {
        return ErrnoToStatus(errno, "fallocate " + FormatBytes(per_file) + " for " + path +
                                        " (not enough space? lower --size)");
      }
    }
    return Status::OK();
  }
  const std::vector<IoFile>& files() const { return files_; }
  uint64_t per_file() const { return per_file_; }
  bool filled = false;

 private:
  std::vector<IoFile> files_;
  std::vector<std::string> named_;
  uint64_t per_file_ = 0;
};

struct CaseResult {
  uint64_t bytes = 0;
  double seconds = 0;
  double cpu_seconds = -1;  // user + system CPU the tool spent (all its threads); < 0: unknown
  std::string features;
  double gbps() const { return seconds > 0 ? bytes / seconds / 1e9 : 0; }
};

// User + system CPU seconds of this process so far (every thread); -1 if getrusage fails.
double ProcessCpuSeconds() {
  rusage u{};
  if (getrusage(RUSAGE_SELF, &u) != 0) return -1;
  auto sec = [](const timeval& t) { return t.tv_sec + t.tv_usec / 1e6; };
  return sec(u.ru_utime) + sec(u.ru_stime);
}

// The IoQueue a zinf case streams through, and the buffers its slots cycle (one per slot,
// filled with random data) in a PinnedArena.
struct ZinfQueue {
  std::unique_ptr<PinnedArena> arena;
  std::vector<PinnedBuffer> bufs;
  std::unique_ptr<IoQueue> queue;
};

Result<ZinfQueue> StartZinfQueue(const BenchFiles& files, IoBackendKind kind, uint64_t block,
                                 uint32_t qd, bool registered, bool huge_pages, bool sqpoll) {
  ZinfQueue z;
  PinnedArenaOptions ao;
  ao.bytes = block * qd;
  ao.huge_pages = huge_pages;
  ZINF_ASSIGN_OR_RETURN(z.arena, PinnedArena::Create(ao));
  for (uint32_t i = 0; i < qd; ++i) {
    ZINF_ASSIGN_OR_RETURN(PinnedBuffer b, z.arena->Allocate(block));
    std::mt19937_64 rng(i);
    auto* p = static_cast<uint64_t*>(b.data());
    for (size_t k = 0; k < block / 8; ++k) p[k] = rng();
    z.bufs.push_back(std::move(b));
  }
  IoBackendOptions bo;
  bo.queue_depth = qd;
  bo.register_buffers = registered;
  bo.register_files = registered;
  bo.sqpoll = sqpoll;
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<IoBackend> backend, NewIoBackend(kind, bo));
  IoQueueOptions qo;
  qo.block_size = static_cast<uint32_t>(std::min<uint64_t>(block, 1ull << 30));
  std::vector<MemoryRegion> regions;
  if (registered) regions.push_back(z.arena->region());
  ZINF_ASSIGN_OR_RETURN(z.queue, IoQueue::Start(std::move(backend), files.files(), regions, qo));
  return z;
}

// Streams `total` bytes through the IoQueue at `qd` transfers of `block` bytes each, striped
// round-robin over the files; stops early after `seconds`. `mixed`: half the slots read the
// first half of the files while the other half write the second half, at the same time (the
// engine's pattern during backward: optimizer states in and out, parameters in).
Result<CaseResult> RunZinf(BenchFiles& files, IoBackendKind kind, IoOp op, uint64_t block,
                           uint32_t qd, uint64_t total, bool registered, bool huge_pages,
                           double seconds, bool sqpoll = false, bool mixed = false,
                           uint64_t* read_bytes = nullptr) {
  ZINF_ASSIGN_OR_RETURN(ZinfQueue z,
                        StartZinfQueue(files, kind, block, qd, registered, huge_pages, sqpoll));
  const std::vector<PinnedBuffer>& bufs = z.bufs;
  IoQueue* const queue = z.queue.get();

  const uint64_t nfiles = files.files().size();
  const uint64_t blocks_per_file = files.per_file() / block;
  const uint64_t total_blocks = std::min(total / block, blocks_per_file * nfiles);
  std::atomic<uint64_t> next{0};
  std::atomic<uint64_t> next_write{0};  // mixed: writes, in the second half
  std::atomic<uint64_t> done_bytes{0};
  std::atomic<uint64_t> done_read{0};
  const uint64_t half = total_blocks / 2;
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::condition_variable cv;
  uint32_t live = 0;   // guarded by mu
  Status first_error;  // guarded by mu
  const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);

  // Each slot refills itself from its completion callback (on the I/O thread): no thread hop
  // between a completion and the next submission.
  std::function<void(uint32_t)> issue = [&](uint32_t slot) {
    const IoOp slot_op = mixed ? (slot % 2 == 0 ? IoOp::kRead : IoOp::kWrite) : op;
    uint64_t k;
    bool more;
    if (!mixed) {
      k = next.fetch_add(1);
      more = k < total_blocks;
    } else if (slot_op == IoOp::kRead) {
      k = next.fetch_add(1);
      more = k < half;
    } else {
      k = half + next_write.fetch_add(1);
      more = k < 2 * half;
    }
    if (!more || stop.load()) {
      std::lock_guard<std::mutex> lock(mu);
      if (--live == 0) cv.notify_all();
      return;
    }
    Transfer t{slot_op, static_cast<uint32_t>(k % nfiles), (k / nfiles) * block, bufs[slot].data(),
               block};
    queue->Submit(t, [&, slot, slot_op](const Status& s) {
      if (!s.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (first_error.ok()) first_error = s;
        stop = true;
      } else {
        done_bytes += block;
        if (slot_op == IoOp::kRead) done_read += block;
      }
      if (Clock::now() >= deadline) stop = true;
      issue(slot);
    });
  };
  const double cpu0 = ProcessCpuSeconds();
  auto t0 = Clock::now();
  {
    std::lock_guard<std::mutex> lock(mu);
    live = qd;
  }
  for (uint32_t s = 0; s < qd; ++s) issue(s);
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return live == 0; });
  }
  double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
  const double cpu1 = ProcessCpuSeconds();
  if (!first_error.ok()) return first_error;
  CaseResult r;
  if (cpu0 >= 0 && cpu1 >= 0) r.cpu_seconds = cpu1 - cpu0;
  r.bytes = done_bytes.load();
  if (read_bytes != nullptr) *read_bytes = done_read.load();
  r.seconds = elapsed;
  // The share of the buffers really on 2 MiB pages (a 1 MiB request from 4 KiB pages is split).
  std::string huge;
  if (Result<size_t> hb = z.arena->HugePageBytes(); hb.ok()) {
    huge = " huge " + std::to_string(*hb * 100 / z.arena->capacity()) + "%";
  }
  r.features = std::string(queue->BackendName()) + " " + queue->Features() +
               (z.arena->locked() ? " locked" : "") + (huge_pages ? " huge-pages" : "") + huge;
  return r;
}

// Runs fio with the same pattern on the same files; returns its bandwidth.
Result<CaseResult> RunFio(const Flags& flags, const BenchFiles& files, const std::string& engine,
                          const std::string& extra, IoOp op, uint64_t block, uint32_t qd,
                          uint64_t total, double seconds) {
  std::string names;
  for (const IoFile& f : files.files()) names += (names.empty() ? "" : ":") + f.path;
  uint64_t size = std::min<uint64_t>(total, files.per_file() * files.files().size());
  char cmd[4096];
  const int len =
      std::snprintf(cmd, sizeof(cmd),
                    "%s --name=zinf-compare --filename=%s --rw=%s --bs=%llu --iodepth=%u "
                    "--ioengine=%s --direct=1 --size=%llu --runtime=%d --numjobs=1 "
                    "--thread --output-format=json %s 2>&1",
                    flags.fio.c_str(), names.c_str(), op == IoOp::kRead ? "read" : "write",
                    static_cast<unsigned long long>(block), qd, engine.c_str(),
                    static_cast<unsigned long long>(size),
                    std::max(1, static_cast<int>(seconds + 0.999)), extra.c_str());
  if (len < 0 || static_cast<size_t>(len) >= sizeof(cmd)) {
    return Status::InvalidArgument("the fio command line is too long (file paths?)");
  }
  FILE* p = popen(cmd, "r");
  if (p == nullptr) return ErrnoToStatus(errno, "starting fio");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  int rc = pclose(p);
  if (rc != 0) {
    return Status::NotFound("fio failed (exit " + std::to_string(rc) + "): " + out.substr(0, 300) +
                            " — install it with `apt-get install fio`");
  }
  size_t brace = out.find('{');
  json j = json::parse(brace == std::string::npos ? "" : out.substr(brace), nullptr, false);
  if (j.is_discarded()) return Status::Internal("could not parse fio's JSON output");
  const json& job = j["jobs"][0][op == IoOp::kRead ? "read" : "write"];
  CaseResult r;
  r.bytes = job.value("io_bytes", uint64_t{0});
  r.seconds = job.value("runtime", 0.0) / 1000.0;
  if (r.seconds <= 0 || r.bytes == 0) return Status::Internal("fio reported no I/O");
  // fio reports its job's CPU as percentages of the job's run time.
  const json& all = j["jobs"][0];
  if (all.contains("usr_cpu") && all.contains("sys_cpu") && all.contains("job_runtime")) {
    r.cpu_seconds = (all.value("usr_cpu", 0.0) + all.value("sys_cpu", 0.0)) / 100.0 *
                    all.value("job_runtime", 0.0) / 1000.0;
  }
  r.features = engine + " " + extra;
  return r;
}

// Writes and reads `total` bytes as 64 MiB tensors through a SwapStore, with per-chunk
// checksums off and on, interleaved; prints the throughput of each and their ratio.
Status RunChecksumCost(const Flags& f, IoBackendKind kind, uint64_t block, uint32_t qd,
                       uint64_t total) {
  constexpr uint64_t kTensor = 64ull << 20;
  uint64_t tensors = std::max<uint64_t>(1, total / kTensor);
  PinnedArenaOptions ao;
  ao.bytes = kTensor * tensors;
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<PinnedArena> arena, PinnedArena::Create(ao));
  std::vector<PinnedBuffer> bufs;
  for (uint64_t i = 0; i < tensors; ++i) {
    ZINF_ASSIGN_OR_RETURN(PinnedBuffer b, arena->Allocate(kTensor));
    std::mt19937_64 rng(i);
    auto* p = static_cast<uint64_t*>(b.data());
    for (size_t k = 0; k < kTensor / 8; ++k) p[k] = rng();
    bufs.push_back(std::move(b));
  }
  std::map<std::string, std::vector<double>> gbps;
  for (int rep = 0; rep < f.repeats; ++rep) {
    for (bool sums : {false, true}) {
      SwapStoreOptions o;
      o.paths = f.dirs;
      o.backend = kind;
      o.backend_options.queue_depth = qd;
      o.block_size = static_cast<uint32_t>(block);
      o.checksums = sums;
      o.remove_on_close = true;  // a bench leaves nothing behind
      o.registered_regions = {arena->region()};
      o.capacity_per_path = RoundUp(total / f.dirs.size() + (64ull << 20), 1 << 20);
      ZINF_ASSIGN_OR_RETURN(std::unique_ptr<SwapStore> store, SwapStore::Open(o));
      for (IoOp op : {IoOp::kWrite, IoOp::kRead}) {
        auto t0 = Clock::now();
        std::vector<Ticket> tickets;
        for (uint64_t i = 0; i < tensors; ++i) {
          std::string key = "t" + std::to_string(i);
          Result<Ticket> t = op == IoOp::kWrite
                                 ? store->Write(key, bufs[i].data(), kTensor, kTensor)
                                 : store->Read(key, bufs[i].data(), kTensor);
          if (!t.ok()) return t.status();
          tickets.push_back(*t);
        }
        for (Ticket t : tickets) ZINF_RETURN_IF_ERROR(store->Wait(t));
        double secs = std::chrono::duration<double>(Clock::now() - t0).count();
        double g = tensors * kTensor / secs / 1e9;
        std::string name = std::string(IoOpName(op)) + (sums ? "_checksums" : "_plain");
        gbps[name].push_back(g);
        json j;
        j["backend"] = std::string("swapstore-") + IoBackendKindName(kind);
        j["op"] = IoOpName(op);
        j["checksums"] = sums;
        j["block_size"] = block;
        j["queue_depth"] = qd;
        j["bytes"] = tensors * kTensor;
        j["seconds"] = std::round(secs * 1e4) / 1e4;
        j["gbps"] = std::round(g * 1e3) / 1e3;
        j["checksum_seconds"] = store->stats().checksum_seconds;
        j["repeat"] = rep;
        std::printf("%s\n", j.dump().c_str());
      }
      ZINF_RETURN_IF_ERROR(store->Close());
    }
  }
  for (const char* op : {"write", "read"}) {
    json j;
    j["case"] = std::string(op) + " checksum cost";
    double plain = Median(gbps[std::string(op) + "_plain"]);
    double sums = Median(gbps[std::string(op) + "_checksums"]);
    j["plain_gbps"] = std::round(plain * 1e3) / 1e3;
    j["checksums_gbps"] = std::round(sums * 1e3) / 1e3;
    j["ratio"] = plain > 0 ? std::round(sums / plain * 1e3) / 1e3 : 0;
    std::printf("%s\n", j.dump().c_str());
  }
  return Status::OK();
}

json CaseJson(const std::string& backend, IoOp op, uint64_t block, uint32_t qd,
              const CaseResult& r) {
  json j;
  j["backend"] = backend;
  j["op"] = IoOpName(op);
  j["block_size"] = block;
  j["queue_depth"] = qd;
  j["bytes"] = r.bytes;
  j["seconds"] = std::round(r.seconds * 1e4) / 1e4;
  j["gbps"] = std::round(r.gbps() * 1e3) / 1e3;
  // CPU time per GB moved: what a request costs the host, apart from the disk's own noise.
  if (r.cpu_seconds >= 0 && r.bytes > 0) {
    j["cpu_ms_per_gb"] = std::round(r.cpu_seconds * 1e3 / (r.bytes / 1e9) * 100) / 100;
  }
  return j;
}

void Emit(const json& j) {
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);
}

Status Fill(BenchFiles& files, uint64_t total) {
  if (files.filled) return Status::OK();
  std::fprintf(stderr, "zinf-nvme-bench: writing %s of data to read back...\n",
               FormatBytes(total).c_str());
  Result<CaseResult> r =
      RunZinf(files, IoBackendKind::kIoUring, IoOp::kWrite, 1 << 20, 32, total, true, true, 1e9);
  if (!r.ok()) return r.status();
  files.filled = true;
  return Status::OK();
}

void AddFlags(CLI::App& app, Flags* f) {
  app.add_option("--backend", f->backend, "io_uring, libaio or psync")
      ->check(CLI::IsMember({"io_uring", "libaio", "psync"}));
  app.add_option("--op", f->op,
                 "read, write, both (one after the other) or mixed (reads and writes at once)")
      ->check(CLI::IsMember({"read", "write", "both", "mixed"}));
  app.add_option("--block-size", f->block_size,
                 "bytes per request (K/M/G suffixes); a comma-separated list runs each");
  app.add_option("--queue-depth", f->queue_depth, "requests in flight")->check(CLI::Range(1, 1024));
  app.add_option("--size", f->size, "bytes per case, over all folders (K/M/G)");
  app.add_option("--dir", f->dirs, "folder for a bench file; repeat to stripe over several")
      ->check(CLI::ExistingDirectory);
  app.add_option("--registered", f->registered, "io_uring fixed buffers and files: on|off")
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--huge-pages", f->huge_pages, "MADV_HUGEPAGE on the buffers: on|off")
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--seconds", f->seconds, "time limit per case")
      ->check(FiniteNumber())
      ->check(CLI::Range(0.01, 1e6));
  app.add_option("--settle", f->settle,
                 "seconds to wait before each run of a read or write case, so that the disk "
                 "(and a host's write cache) is quiet when it starts; default 0")
      ->check(FiniteNumber())
      ->check(CLI::Range(0.0, 600.0));
  app.add_option("--repeats", f->repeats, "runs per case (interleaved; medians reported)")
      ->check(CLI::Range(1, 100));
  app.add_flag("--sweep", f->sweep, "try block sizes x queue depths; print the best as config");
  app.add_flag("--compare-fio", f->compare_fio, "run fio on the same pattern, interleaved");
  app.add_option("--fio", f->fio, "fio binary");
  app.add_option("--fio-variants", f->fio_variants,
                 "with --compare-fio: only these fio variants (comma-separated names, e.g. "
                 "fio-io_uring-huge,fio-libaio-huge); default: all seven");
  app.add_flag("--sqpoll", f->sqpoll, "io_uring kernel submission thread (costs a core)");
  app.add_flag("--keep-files", f->keep_files,
               "keep the bench files for the next run (default: removed at exit)");
  app.add_flag("--checksum-cost", f->checksum_cost,
               "time SwapStore writes/reads with per-chunk xxh3 checksums off and on");
}

// The flags checked and parsed, for the parts of the run.
struct Plan {
  std::vector<uint64_t> block_list;  // --block-size, without repeats
  uint64_t block = 0;                // the largest of block_list
  uint64_t size = 0;                 // --size
  IoBackendKind kind = IoBackendKind::kIoUring;
  std::vector<std::string> wanted_fio;  // --fio-variants; empty: every variant
  bool registered = false;
  bool huge = false;
  // The cases: ops x blocks x depths.
  std::vector<IoOp> ops;
  std::vector<uint64_t> blocks;
  std::vector<uint32_t> depths;
};

// --block-size's list, without repeats; false (having said why) for a size that is not a
// multiple of 4K up to 1G.
bool ParseBlockSizes(const Flags& f, std::vector<uint64_t>* block_list) {
  for (size_t start = 0; start <= f.block_size.size();) {
    size_t comma = f.block_size.find(',', start);
    if (comma == std::string::npos) comma = f.block_size.size();
    Result<uint64_t> b =
        bench::ParsePositiveSize(f.block_size.substr(start, comma - start), "--block-size");
    if (!b.ok() || *b == 0 || *b % 4096 != 0 || *b > (1ull << 30)) {
      std::fprintf(stderr, "zinf-nvme-bench: --block-size must be a multiple of 4K up to 1G\n");
      return false;
    }
    if (std::find(block_list->begin(), block_list->end(), *b) == block_list->end()) {
      block_list->push_back(*b);
    }
    start = comma + 1;
  }
  return true;
}

// --fio-variants: known names only, checked before any file is made; false (having said why)
// otherwise.
bool ParseFioVariants(const Flags& f, std::vector<std::string>* wanted_fio) {
  if (f.fio_variants.empty()) return true;
  if (!f.compare_fio || f.op == "mixed" || f.checksum_cost) {
    std::fprintf(stderr,
                 "zinf-nvme-bench: --fio-variants needs --compare-fio, which runs with "
                 "--op read, write or both (not mixed, not --checksum-cost)\n");
    return false;
  }
  for (size_t start = 0; start <= f.fio_variants.size();) {
    size_t comma = f.fio_variants.find(',', start);
    if (comma == std::string::npos) comma = f.fio_variants.size();
    std::string name = f.fio_variants.substr(start, comma - start);
    if (std::none_of(std::begin(kFioVariants), std::end(kFioVariants),
                     [&](const FioVariant& v) { return v.name == name; })) {
      std::string list;
      for (const FioVariant& v : kFioVariants) list += (list.empty() ? "" : ", ") + v.name;
      std::fprintf(stderr, "zinf-nvme-bench: --fio-variants: unknown variant '%s' (known: %s)\n",
                   name.c_str(), list.c_str());
      return false;
    }
    if (std::find(wanted_fio->begin(), wanted_fio->end(), name) == wanted_fio->end()) {
      wanted_fio->push_back(name);
    }
    start = comma + 1;
  }
  return true;
}

// The run's plan from the flags; false (having said why) when they do not make one.
bool MakePlan(const Flags& f, Plan* plan) {
  if (!ParseBlockSizes(f, &plan->block_list)) return false;
  const std::vector<uint64_t>& block_list = plan->block_list;
  if (block_list.size() > 1 && (f.op == "mixed" || f.checksum_cost)) {
    std::fprintf(stderr, "zinf-nvme-bench: --op mixed and --checksum-cost take one --block-size\n");
    return false;
  }
  Result<uint64_t> block = *std::max_element(block_list.begin(), block_list.end());
  Result<uint64_t> size = bench::ParsePositiveSize(f.size, "--size");
  Result<IoBackendKind> kind = ParseIoBackendKind(f.backend);
  for (const Status& s : {block.status(), size.status(), kind.status()}) {
    if (!s.ok() && s.code() != StatusCode::kInternal) {
      std::fprintf(stderr, "zinf-nvme-bench: %s\n", s.message().c_str());
      return false;
    }
  }
  if (!block.ok() || !size.ok() || !kind.ok() || *block == 0 || *block % 4096 != 0 ||
      *block > (1ull << 30)) {
    std::fprintf(stderr, "zinf-nvme-bench: --block-size must be a multiple of 4K up to 1G\n");
    return false;
  }
  if (*size < *block || *size > (1ull << 50)) {
    std::fprintf(stderr,
                 "zinf-nvme-bench: --size %s is %s the block size (%s): give at least one "
                 "block, at most 1P\n",
                 f.size.c_str(), *size < *block ? "smaller than" : "far beyond",
                 f.block_size.c_str());
    return false;
  }
  if (!ParseFioVariants(f, &plan->wanted_fio)) return false;
  plan->block = *block;
  plan->size = *size;
  plan->kind = *kind;
  plan->registered = f.registered == "on";
  plan->huge = f.huge_pages == "on";
  if (f.op != "write") plan->ops.push_back(IoOp::kRead);
  if (f.op != "read") plan->ops.push_back(IoOp::kWrite);
  plan->blocks = block_list;
  plan->depths = {f.queue_depth};
  if (f.sweep) {
    plan->blocks = {256 << 10, 1016 << 10, 1 << 20, 4 << 20, 8 << 20};
    plan->depths = {4, 8, 16, 32, 64};
  }
  return true;
}

// The bench files, sized for the plan's largest block, and filled with data to read back.
Status PrepareFiles(const Flags& f, const Plan& plan, BenchFiles* files) {
  uint64_t max_block = *std::max_element(plan.blocks.begin(), plan.blocks.end());
  uint64_t nfiles = f.dirs.size();
  uint64_t per_file = RoundUp((plan.size + nfiles - 1) / nfiles, max_block * 4);
  ZINF_RETURN_IF_ERROR(files->Open(f.dirs, per_file, f.keep_files, f.compare_fio));
  return Fill(*files, per_file * nfiles);
}

// --op mixed: reads and writes at once, as the engine issues them during backward: one figure
// per repeat with both directions, then the medians. Returns the exit code.
int RunMixed(const Flags& f, const Plan& plan, BenchFiles& files) {
  std::vector<double> total, reads, writes;
  for (int rep = 0; rep < f.repeats; ++rep) {
    uint64_t read_bytes = 0;
    Result<CaseResult> r =
        RunZinf(files, plan.kind, IoOp::kRead, plan.block, f.queue_depth, plan.size,
                plan.registered, plan.huge, f.seconds, f.sqpoll, true, &read_bytes);
    if (!r.ok()) {
      std::fprintf(stderr, "zinf-nvme-bench: %s\n", r.status().ToString().c_str());
      return 1;
    }
    const double rg = read_bytes / r->seconds / 1e9;
    const double wg = (r->bytes - read_bytes) / r->seconds / 1e9;
    json j = {{"backend", f.backend},
              {"op", "mixed"},
              {"block_size", plan.block},
              {"queue_depth", f.queue_depth},
              {"bytes", r->bytes},
              {"seconds", r->seconds},
              {"read_gbps", std::round(rg * 1e3) / 1e3},
              {"write_gbps", std::round(wg * 1e3) / 1e3},
              {"gbps", std::round(r->gbps() * 1e3) / 1e3},
              {"repeat", rep}};
    Emit(j);
    total.push_back(r->gbps());
    reads.push_back(rg);
    writes.push_back(wg);
  }
  Emit({{"case", "mixed bs=" + SizeLabel(plan.block) + " qd=" + std::to_string(f.queue_depth)},
        {"zinf_gbps_median", std::round(Median(total) * 1e3) / 1e3},
        {"read_gbps_median", std::round(Median(reads) * 1e3) / 1e3},
        {"write_gbps_median", std::round(Median(writes) * 1e3) / 1e3}});
  return 0;
}

// The fio peers --compare-fio runs, and the huge pages for their buffers.
struct FioPeers {
  std::vector<FioVariant> variants;
  FioHugePages huge;
  std::string huge_why;  // why fio runs without huge pages; empty while it has them
};

// Chooses the fio variants to run and sets up their huge pages; false (having said why) when
// the variants asked for cannot run.
bool SetUpFioPeers(const Flags& f, const Plan& plan, FioPeers* fio) {
  bool want_huge = false;
  for (const FioVariant& v : kFioVariants) {
    if (Wanted(plan.wanted_fio, v.name)) want_huge = want_huge || v.huge;
  }
  // fio at its best: its buffers on huge pages too, as zinf's are (MADV_HUGEPAGE), so that
  // the disk does not split its requests at 4 KiB page boundaries.
  const uint64_t largest = *std::max_element(plan.blocks.begin(), plan.blocks.end());
  const uint64_t max_depth = *std::max_element(plan.depths.begin(), plan.depths.end());
  fio->huge_why =
      want_huge ? fio->huge.Prepare(largest * max_depth) : "not asked for (--fio-variants)";
  if (want_huge && fio->huge_why.empty()) {
    std::fprintf(stderr, "zinf-nvme-bench: fio with huge-page buffers (%s)\n",
                 fio->huge.summary().c_str());
  } else if (want_huge) {
    std::fprintf(stderr,
                 "zinf-nvme-bench: fio runs without huge-page buffers, so it is not at its "
                 "best: %s\n",
                 fio->huge_why.c_str());
  }
  if (!plan.wanted_fio.empty() && want_huge && !fio->huge_why.empty()) {
    // A peer named before the run does not quietly drop out of it.
    std::fprintf(stderr,
                 "zinf-nvme-bench: --fio-variants names a huge-page variant, and huge pages "
                 "cannot be set up: %s\n",
                 fio->huge_why.c_str());
    return false;
  }
  for (FioVariant v : kFioVariants) {
    if (!Wanted(plan.wanted_fio, v.name) || (v.huge && !fio->huge_why.empty())) continue;
    if (v.huge)
      v.extra += (v.extra.empty() ? "" : " ") + std::string("--iomem=") + fio->huge.iomem();
    fio->variants.push_back(v);
  }
  if (fio->variants.empty()) {
    std::fprintf(stderr,
                 "zinf-nvme-bench: none of --fio-variants %s can run (the huge-page "
                 "variants need huge pages: %s)\n",
                 f.fio_variants.c_str(), fio->huge_why.c_str());
    return false;
  }
  const size_t tools = 1 + fio->variants.size();
  if (f.repeats % tools != 0) {
    std::fprintf(stderr,
                 "zinf-nvme-bench: the run order rotates over %zu tools; --repeats %d is not a "
                 "multiple of %zu, so some run first more often than others (on a disk "
                 "that caches writes, the order moves the figures)\n",
                 tools, f.repeats, tools);
  }
  return true;
}

std::string CaseKey(IoOp op, uint64_t block, uint32_t qd) {
  return std::string(IoOpName(op)) + " bs=" + SizeLabel(block) + " qd=" + std::to_string(qd);
}

// case key -> backend name -> repeat -> gbps
using Samples = std::map<std::string, std::map<std::string, std::map<int, double>>>;

// What the measured cases share, and what they measured.
struct BenchRun {
  const Flags& f;
  const Plan& plan;
  BenchFiles& files;
  FioPeers& fio;
  Samples samples{};
  std::vector<std::string> case_order{};  // the case keys, in the order they first ran
};

// One case in one repeat.
struct CaseRepeat {
  IoOp op;
  uint64_t block;
  uint32_t qd;
  int rep;
  std::string key;  // CaseKey
};

// zinf's run of one case; false (having said why) if it failed. `first`: the tool that ran
// first in this case and repeat; `position`: the runs before this one.
bool RunZinfCase(BenchRun& run, const CaseRepeat& c, const std::string& first, size_t position) {
  const Flags& f = run.f;
  Result<CaseResult> r = RunZinf(run.files, run.plan.kind, c.op, c.block, c.qd, run.plan.size,
                                 run.plan.registered, run.plan.huge, f.seconds, f.sqpoll);
  if (!r.ok()) {
    std::fprintf(stderr, "zinf-nvme-bench: %s: %s\n", c.key.c_str(), r.status().ToString().c_str());
    return false;
  }
  json j = CaseJson(f.backend, c.op, c.block, c.qd, *r);
  j["registered"] = run.plan.registered;
  j["huge_pages"] = run.plan.huge;
  j["features"] = r->features;
  j["repeat"] = c.rep;
  if (f.compare_fio) {
    j["first"] = first;
    j["position"] = position;
  }
  Emit(j);
  run.samples[c.key]["zinf"][c.rep] = r->gbps();
  return true;
}

// fio variant `v`'s run of one case, as RunZinfCase. A huge-page variant that fails gives up
// the huge-page variants and returns true: the others go on.
bool RunFioCase(BenchRun& run, const FioVariant& v, const CaseRepeat& c, const std::string& first,
                size_t position) {
  FioPeers& fio = run.fio;
  const bool on_huge = v.huge;
  Result<CaseResult> fr = Status::ResourceExhausted("the huge pages did not come back within 5 s");
  if (!on_huge || fio.huge.WaitForPages(5.0)) {
    fr = RunFio(run.f, run.files, v.engine, v.extra, c.op, c.block, c.qd, run.plan.size,
                run.f.seconds);
  }
  if (!fr.ok() && on_huge) {
    // Huge pages are set up by heuristics (another user may hold some): drop
    // these variants and go on with the others, saying so.
    fio.huge_why = "gave up after " + v.name + " failed: " + fr.status().ToString();
    std::fprintf(stderr, "zinf-nvme-bench: %s\n", fio.huge_why.c_str());
    return true;
  }
  if (!fr.ok()) {
    std::fprintf(stderr, "zinf-nvme-bench: %s: %s\n", v.name.c_str(),
                 fr.status().ToString().c_str());
    return false;
  }
  json fj = CaseJson(v.name, c.op, c.block, c.qd, *fr);
  fj["repeat"] = c.rep;
  fj["first"] = first;
  fj["position"] = position;
  Emit(fj);
  run.samples[c.key][v.name][c.rep] = fr->gbps();
  return true;
}

// One case in one repeat, zinf and each fio peer; false if a run failed.
bool RunCaseRepeat(BenchRun& run, const CaseRepeat& c) {
  const std::vector<FioVariant>& fio_variants = run.fio.variants;
  // The tools run one after the other, and on this kind of disk the order matters
  // (the host caches what was just written and is still flushing it when the next
  // tool writes). So the order rotates from repeat to repeat: zinf and each fio
  // variant take every position equally often when --repeats is a multiple of the
  // number of tools, and with one variant that is the two alternating. Which tool
  // runs just before another still follows the cycle (with three or more tools):
  // --settle is what lets the host finish the previous tool's writes.
  const size_t tools = 1 + fio_variants.size();  // 0: zinf, i: fio_variants[i - 1]
  // Variants given up on (huge pages lost mid-run) take no slot.
  auto live = [&](size_t tool) {
    return tool == 0 || !fio_variants[tool - 1].huge || run.fio.huge_why.empty();
  };
  std::string first;
  size_t position = 0;  // runs so far in this case and repeat
  for (size_t k = 0; k < tools; ++k) {
    const size_t tool = (c.rep + k) % tools;
    if (!live(tool)) continue;
    if (first.empty()) first = tool == 0 ? "zinf" : fio_variants[tool - 1].name;
    if (run.f.settle > 0) {
      std::this_thread::sleep_for(std::chrono::duration<double>(run.f.settle));
    }
    if (!(tool == 0 ? RunZinfCase(run, c, first, position)
                    : RunFioCase(run, fio_variants[tool - 1], c, first, position))) {
      return false;
    }
    ++position;
  }
  return true;
}

// Every case, repeat by repeat; false if a run failed.
bool RunCases(BenchRun& run) {
  for (int rep = 0; rep < run.f.repeats; ++rep) {
    for (IoOp op : run.plan.ops) {
      for (uint64_t b : run.plan.blocks) {
        for (uint32_t qd : run.plan.depths) {
          const CaseRepeat c{op, b, qd, rep, CaseKey(op, b, qd)};
          if (rep == 0) run.case_order.push_back(c.key);
          if (!RunCaseRepeat(run, c)) return false;
        }
      }
    }
  }
  return true;
}

// One line per case: zinf against the fio peers.
void ReportFioComparison(BenchRun& run) {
  const std::vector<FioVariant>& fio_variants = run.fio.variants;
  for (const std::string& key : run.case_order) {
    auto& by = run.samples[key];
    const std::map<int, double>& zs = by["zinf"];
    double zinf = Median(zs);
    double best = 0;
    std::string best_name;
    for (const FioVariant& v : fio_variants) {
      double m = Median(by[v.name]);
      if (m > best) {
        best = m;
        best_name = v.name;
      }
    }
    json j;
    j["case"] = key;
    j["repeats"] = run.f.repeats;
    j["zinf_gbps"] = std::round(zinf * 1e3) / 1e3;
    j["fio_best_gbps"] = std::round(best * 1e3) / 1e3;
    j["fio_best"] = best_name;
    if (auto it = by.find("fio-libaio"); it != by.end() && !it->second.empty()) {
      j["fio_libaio_gbps"] = std::round(Median(it->second) * 1e3) / 1e3;
    }
    // Every variant's median, how many repeats it ran (fewer than zinf's when its huge
    // pages were lost mid-run), zinf's paired ratio to it (null with no common repeat),
    // and why fio ran without huge pages ("yes" when it had them).
    json variants, counts, paired;
    for (const FioVariant& v : fio_variants) {
      const std::map<int, double>& vs = by[v.name];
      variants[v.name] = std::round(Median(vs) * 1e3) / 1e3;
      counts[v.name] = vs.size();
      const double pr = PairedRatio(zs, vs);
      paired[v.name] = pr > 0 ? json(std::round(pr * 1e3) / 1e3) : json(nullptr);
    }
    j["fio_gbps"] = variants;
    j["fio_repeats"] = counts;
    j["fio_huge_pages"] = run.fio.huge_why.empty() ? "yes" : "no: " + run.fio.huge_why;
    // The ratio of medians, against the variant with the best median (a best-of-N, which
    // favours fio), and the median of the per-repeat ratios against that same variant.
    j["ratio"] = best > 0 ? std::round(zinf / best * 1e3) / 1e3 : 0;
    j["paired_ratio"] = paired;
    j["paired_ratio_vs_best"] = best > 0 ? paired[best_name] : json(nullptr);
    Emit(j);
  }
}

// One line per case: zinf's median over the repeats.
void ReportZinfMedians(BenchRun& run) {
  for (const std::string& key : run.case_order) {
    json j;
    j["case"] = key;
    j["zinf_gbps_median"] = std::round(Median(run.samples[key]["zinf"]) * 1e3) / 1e3;
    Emit(j);
  }
}

// --sweep: per op, the best block size and queue depth as a zinf config snippet.
void ReportBestConfigs(BenchRun& run) {
  for (IoOp op : run.plan.ops) {
    double best = 0;
    uint64_t best_b = 0;
    uint32_t best_qd = 0;
    for (uint64_t b : run.plan.blocks) {
      for (uint32_t qd : run.plan.depths) {
        double m = Median(run.samples[CaseKey(op, b, qd)]["zinf"]);
        if (m > best) {
          best = m;
          best_b = b;
          best_qd = qd;
        }
      }
    }
    json snippet;
    snippet["aio"] = {{"block_size", best_b}, {"queue_depth", best_qd}};
    snippet["zinf"] = {{"io_backend", run.f.backend}};
    json j;
    j["best_for"] = IoOpName(op);
    j["gbps"] = std::round(best * 1e3) / 1e3;
    j["config"] = snippet;
    Emit(j);
  }
}

int Main(int argc, char** argv) {
  Flags f;
  CLI::App app{"zinf-nvme-bench: sequential direct-I/O throughput of the zinf swapper"};
  AddFlags(app, &f);
  if (int rc = ParseCommandLine(app, argc, argv); rc >= 0) return rc;

  if (f.dirs.empty()) f.dirs.push_back(".");
  Plan plan;
  if (!MakePlan(f, &plan)) return 2;
  signal(SIGINT, RemoveNamedAndDie);
  signal(SIGTERM, RemoveNamedAndDie);
  if (f.checksum_cost) {
    Status s = RunChecksumCost(f, plan.kind, plan.block, f.queue_depth, plan.size);
    if (!s.ok()) {
      std::fprintf(stderr, "zinf-nvme-bench: %s\n", s.ToString().c_str());
      return 1;
    }
    return 0;
  }
  BenchFiles files;
  if (Status s = PrepareFiles(f, plan, &files); !s.ok()) {
    std::fprintf(stderr, "zinf-nvme-bench: %s\n", s.ToString().c_str());
    return 1;
  }
  if (f.op == "mixed") return RunMixed(f, plan, files);
  FioPeers fio;
  if (f.compare_fio && !SetUpFioPeers(f, plan, &fio)) return 1;

  BenchRun run{f, plan, files, fio};
  if (!RunCases(run)) return 1;
  if (f.compare_fio) {
    ReportFioComparison(run);
  } else if (f.repeats > 1 || f.sweep) {
    ReportZinfMedians(run);
  }
  if (f.sweep) ReportBestConfigs(run);
  return 0;
}

}  // namespace
}  // namespace zinf

int main(int argc, char** argv) { return zinf::Main(argc, argv); }
