#include "zinf/swap.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <map>
#include <thread>

#include "tests/test_util.h"
#include "zinf/log.h"

namespace zinf {
namespace {

using testing::AlignedBuffer;
using testing::FillRandom;
using testing::TempDir;

// Captures warnings for the duration of a test.
class LogCapture {
 public:
  LogCapture() {
    previous_ = SetLogSink([this](LogLevel, const std::string& line) {
      std::lock_guard<std::mutex> lock(mu_);
      lines_.push_back(line);
    });
  }
  ~LogCapture() { SetLogSink(previous_); }
  std::vector<std::string> lines() {
    std::lock_guard<std::mutex> lock(mu_);
    return lines_;
  }

 private:
  std::mutex mu_;
  std::vector<std::string> lines_;
  LogSink previous_;
};

SwapStoreOptions BaseOptions(const std::vector<std::string>& paths, IoBackendKind backend,
                             bool direct) {
  SwapStoreOptions o;
  o.paths = paths;
  o.backend = backend;
  o.direct_io = direct;
  o.chunk_size = 64 << 10;  // small chunks: many chunks, many stripes in small tests
  o.block_size = 32 << 10;  // and several requests per chunk
  o.growth_step = 1 << 20;
  o.backend_options.queue_depth = 8;
  return o;
}

struct Case {
  IoBackendKind backend;
  bool direct;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  return std::string(IoBackendKindName(info.param.backend)) +
         (info.param.direct ? "_direct" : "_buffered");
}

class SwapStoreTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override { ASSERT_TRUE(dir_.ok()); }
  SwapStoreOptions Options(int npaths = 1) {
    std::vector<std::string> paths;
    for (int i = 0; i < npaths; ++i) {
      std::string p = dir_.path() + "/p" + std::to_string(i);
      mkdir(p.c_str(), 0700);
      paths.push_back(p);
    }
    return BaseOptions(paths, GetParam().backend, GetParam().direct);
  }
  // Writes the first `size` bytes of buf under key and waits for it.
  static void WriteWhole(SwapStore* st, const std::string& key, const AlignedBuffer& buf,
                         uint64_t size) {
    auto t = st->Write(key, buf.data(), size, buf.size());
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    ASSERT_TRUE(st->Wait(*t).ok());
  }
  // Reads key into *back and expects its first `size` bytes to equal want's.
  static void ExpectReads(SwapStore* st, const std::string& key, AlignedBuffer* back,
                          const AlignedBuffer& want, uint64_t size) {
    auto t = st->Read(key, back->data(), back->size());
    ASSERT_TRUE(t.ok()) << key << ": " << t.status().ToString();
    Status s = st->Wait(*t);
    ASSERT_TRUE(s.ok()) << key << ": " << s.ToString();
    EXPECT_EQ(0, std::memcmp(back->data(), want.data(), size)) << key;
  }
  TempDir dir_;
};

// Round trips of random data are bit-exact for sizes around the block, chunk and alignment
// boundaries (tails not multiple of the block included).
TEST_P(SwapStoreTest, RoundTripBitExactAllSizes) {
  auto store = SwapStore::Open(Options());
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  const std::vector<uint64_t> sizes = {
      0, 1, 4095, 4096, 4097, 32 << 10, (64 << 10) - 1, 64 << 10, (64 << 10) + 1, 1000003, 3 << 20};
  std::map<std::string, std::unique_ptr<AlignedBuffer>> written;
  for (uint64_t size : sizes) {
    auto buf = std::make_unique<AlignedBuffer>(size);
    FillRandom(buf->data(), size, size + 7);
    std::string key = "t" + std::to_string(size);
    auto t = (*store)->Write(key, buf->data(), size, buf->size());
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    ASSERT_TRUE((*store)->Wait(*t).ok());
    written[key] = std::move(buf);
  }
  for (uint64_t size : sizes) {
    std::string key = "t" + std::to_string(size);
    AlignedBuffer back(size);
    std::memset(back.data(), 0xAB, back.size());
    auto t = (*store)->Read(key, back.data(), back.size());
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    Status s = (*store)->Wait(*t);
    ASSERT_TRUE(s.ok()) << s.ToString();
    ASSERT_EQ(0, std::memcmp(back.data(), written[key]->data(), size)) << "size " << size;
    EXPECT_EQ(size, (*store)->Size(key).value());
  }
}

// Done(ticket) never blocks and turns true once the request has ended: a caller may poll it
// and then Wait without blocking (the engine issues a read's device copy that way). An unknown
// or already waited ticket is "done" (Wait reports it).
TEST_P(SwapStoreTest, DoneTellsWhetherWaitWouldBlock) {
  auto store = SwapStore::Open(Options());
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  const uint64_t size = 3 << 20;
  AlignedBuffer buf(size), back(size);
  FillRandom(buf.data(), size, 11);
  WriteWhole(store->get(), "t", buf, size);
  auto t = (*store)->Read("t", back.data(), back.size());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!(*store)->Done(*t)) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "the read never ended";
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  ASSERT_TRUE((*store)->Wait(*t).ok());
  EXPECT_EQ(0, std::memcmp(back.data(), buf.data(), size));
  EXPECT_TRUE((*store)->Done(*t));  // waited for: unknown now
  EXPECT_EQ((*store)->Wait(*t).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE((*store)->Done(987654));
}

// Many tickets in flight at once, from several threads; each comes back intact.
TEST_P(SwapStoreTest, ManyConcurrentTickets) {
  auto store = SwapStore::Open(Options(2));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  constexpr int kThreads = 4;
  constexpr int kPerThread = 16;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::unique_ptr<AlignedBuffer>> bufs;
      std::vector<Ticket> tickets;
      for (int i = 0; i < kPerThread; ++i) {
        uint64_t size = 10000 + 37777 * i + t;
        bufs.push_back(std::make_unique<AlignedBuffer>(size));
        FillRandom(bufs.back()->data(), size, t * 1000 + i);
        auto tk = (*store)->Write("k" + std::to_string(t) + "_" + std::to_string(i),
                                  bufs.back()->data(), size, bufs.back()->size());
        if (!tk.ok()) {
          ++failures;
          return;
        }
        tickets.push_back(*tk);
      }
      for (Ticket tk : tickets)
        if (!(*store)->Wait(tk).ok()) ++failures;
      tickets.clear();
      std::vector<std::unique_ptr<AlignedBuffer>> back;
      for (int i = 0; i < kPerThread; ++i) {
        back.push_back(std::make_unique<AlignedBuffer>(bufs[i]->size()));
        auto tk = (*store)->Read("k" + std::to_string(t) + "_" + std::to_string(i),
                                 back.back()->data(), back.back()->size());
        if (!tk.ok()) {
          ++failures;
          return;
        }
        tickets.push_back(*tk);
      }
      for (int i = 0; i < kPerThread; ++i) {
        if (!(*store)->Wait(tickets[i]).ok()) ++failures;
        uint64_t size = 10000 + 37777 * i + t;
        if (std::memcmp(back[i]->data(), bufs[i]->data(), size) != 0) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(0, failures.load());
  EXPECT_EQ(uint64_t{kThreads * kPerThread}, (*store)->stats().tensors);
}

// A tensor striped over three paths puts its chunks round-robin on the three files.
TEST_P(SwapStoreTest, StripesOverThreePaths) {
  SwapStoreOptions o = Options(3);
  auto store = SwapStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  const uint64_t size = 10 * o.chunk_size + 12345;  // 11 chunks: 4 + 4 + 3
  AlignedBuffer buf(size), back(size);
  FillRandom(buf.data(), size, 99);
  auto t = (*store)->Write("striped", buf.data(), size, buf.size());
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*store)->Wait(*t).ok());
  ASSERT_TRUE((*store)->Flush().ok());
  // Each file received its share; check the bytes of chunk i directly in file i % 3.
  std::vector<std::string> files = (*store)->file_paths();
  ASSERT_EQ(3u, files.size());
  for (uint64_t chunk = 0; chunk < 11; ++chunk) {
    std::ifstream f(files[chunk % 3], std::ios::binary);
    ASSERT_TRUE(f.good());
    f.seekg(static_cast<std::streamoff>((chunk / 3) * o.chunk_size));
    uint64_t n = std::min<uint64_t>(o.chunk_size, size - chunk * o.chunk_size);
    std::vector<char> got(n);
    f.read(got.data(), static_cast<std::streamsize>(n));
    ASSERT_EQ(0, std::memcmp(got.data(), buf.data() + chunk * o.chunk_size, n)) << chunk;
  }
  t = (*store)->Read("striped", back.data(), back.size());
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*store)->Wait(*t).ok());
  EXPECT_EQ(0, std::memcmp(back.data(), buf.data(), size));
}

// Close writes the index; reopening reads back what was written, and new writes do not land
// on the old tensors' extents.
TEST_P(SwapStoreTest, ReopenReadsWhatWasWritten) {
  SwapStoreOptions o = Options(2);
  o.checksums = true;
  const uint64_t size = 777777;
  AlignedBuffer a(size), b(size), back(size);
  FillRandom(a.data(), size, 1);
  FillRandom(b.data(), size, 2);
  {
    auto store = SwapStore::Open(o);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    auto t = (*store)->Write("a", a.data(), size, a.size());
    ASSERT_TRUE(t.ok());
    ASSERT_TRUE((*store)->Wait(*t).ok());
    ASSERT_TRUE((*store)->Close().ok());
  }
  o.reopen = true;
  auto store = SwapStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ(std::vector<std::string>{"a"}, (*store)->Keys());
  auto t = (*store)->Write("b", b.data(), size, b.size());
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*store)->Wait(*t).ok());
  t = (*store)->Read("a", back.data(), back.size());
  ASSERT_TRUE(t.ok());
  Status s = (*store)->Wait(*t);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(0, std::memcmp(back.data(), a.data(), size));
}

// Durable mode: a reopen sees exactly the last commit. Writes after it (a new version of a
// committed tensor, a new tensor, a removal) are invisible until the next commit, and
// superseded extents are reused after commits, so repeated steps do not grow the files.
TEST_P(SwapStoreTest, DurableReopenSeesTheLastCommit) {
  SwapStoreOptions o = Options(2);
  o.durable = true;
  o.checksums = true;
  const uint64_t size = 300000;
  AlignedBuffer v1(size), v2(size), c(size), back(size);
  FillRandom(v1.data(), size, 1);
  FillRandom(v2.data(), size, 2);
  FillRandom(c.data(), size, 3);
  auto write = [&](SwapStore* st, const std::string& key, const AlignedBuffer& buf) {
    WriteWhole(st, key, buf, size);
  };
  auto read_equals = [&](SwapStore* st, const std::string& key, const AlignedBuffer& want) {
    ExpectReads(st, key, &back, want, size);
  };
  uint64_t file_bytes_after_warmup = 0;
  {
    auto store = SwapStore::Open(o);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    SwapStore* st = store->get();
    write(st, "a", v1);
    write(st, "b", v1);
    ASSERT_TRUE(st->Commit("step 1").ok());
    EXPECT_EQ(st->Flush().code(), StatusCode::kFailedPrecondition);
    // Many "steps": each rewrites both tensors and commits; the files stop growing.
    for (int step = 2; step < 12; ++step) {
      write(st, "a", step % 2 ? v1 : v2);
      write(st, "a", step % 2 ? v1 : v2);  // a second write of the step overwrites in place
      write(st, "b", step % 2 ? v1 : v2);
      ASSERT_TRUE(st->Commit("step " + std::to_string(step)).ok());
      if (step == 4) file_bytes_after_warmup = st->stats().file_bytes;
    }
    EXPECT_EQ(st->stats().file_bytes, file_bytes_after_warmup);
    // Step 11 (v1) is committed; then uncommitted changes, and a "crash" (no commit).
    write(st, "a", v2);
    write(st, "c", c);
    ASSERT_TRUE(st->Remove("b").ok());
    read_equals(st, "a", v2);  // the running process sees its own writes
    ASSERT_TRUE(st->Close().ok());
  }
  o.reopen = true;
  {
    auto store = SwapStore::Open(o);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    SwapStore* st = store->get();
    EXPECT_EQ(st->committed_meta(), "step 11");
    EXPECT_EQ((std::vector<std::string>{"a", "b"}), st->Keys());
    read_equals(st, "a", v1);
    read_equals(st, "b", v1);
    // Go on from there and commit: the next reopen sees the new state.
    write(st, "a", v2);
    write(st, "c", c);
    ASSERT_TRUE(st->Commit("step 12").ok());
  }
  auto store = SwapStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ((*store)->committed_meta(), "step 12");
  EXPECT_EQ((std::vector<std::string>{"a", "b", "c"}), (*store)->Keys());
  read_equals(store->get(), "a", v2);
  read_equals(store->get(), "b", v1);
  read_equals(store->get(), "c", c);
  ASSERT_TRUE((*store)->Close().ok());
  // A fresh (not reopened) store in the same folder is refused: it would replace a store that
  // committed data. Nothing is changed by the refusal.
  o.reopen = false;
  {
    auto refused = SwapStore::Open(o);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), StatusCode::kAlreadyExists) << refused.status().ToString();
    EXPECT_NE(refused.status().message().find(o.paths[0]), std::string::npos);
    o.reopen = true;
    auto still = SwapStore::Open(o);
    ASSERT_TRUE(still.ok()) << still.status().ToString();
    EXPECT_EQ((*still)->committed_meta(), "step 12");
    read_equals(still->get(), "c", c);
    o.reopen = false;
  }
  // Told to overwrite, it removes the old index at once: a crash before its first commit must
  // not leave an index describing truncated files.
  o.overwrite = true;
  {
    auto fresh = SwapStore::Open(o);
    ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
    write(fresh->get(), "a", v1);
    ASSERT_TRUE((*fresh)->Close().ok());  // durable: no commit
  }
  // That store never committed: nothing to reopen (NotFound), and nothing to keep (a fresh
  // store replaces it without being told to).
  o.reopen = true;
  auto none = SwapStore::Open(o);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound) << none.status().ToString();
  EXPECT_NE(none.status().message().find("never wrote an index"), std::string::npos)
      << none.status().ToString();
  auto listed = SwapStore::ListCommits(o.paths);
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  EXPECT_TRUE(listed->empty());
  o.reopen = false;
  o.overwrite = false;
  EXPECT_TRUE(SwapStore::Open(o).ok());
}

// Durable mode retaining two commits (ranks one commit apart agree on the earlier one): the
// commit before the last stays readable whatever is written after the last, a reopen at it
// drops the last one, a reopen at the last drops it; the files stop growing all the same.
TEST_P(SwapStoreTest, DurableRetainsThePreviousCommit) {
  SwapStoreOptions o = Options(2);
  o.durable = true;
  o.checksums = true;
  o.retained_commits = 2;
  const uint64_t size = 300000;
  AlignedBuffer v1(size), v2(size), v3(size), back(size);
  FillRandom(v1.data(), size, 1);
  FillRandom(v2.data(), size, 2);
  FillRandom(v3.data(), size, 3);
  auto write = [&](SwapStore* st, const std::string& key, const AlignedBuffer& buf) {
    WriteWhole(st, key, buf, size);
  };
  auto read_equals = [&](SwapStore* st, const std::string& key, const AlignedBuffer& want) {
    ExpectReads(st, key, &back, want, size);
  };
  auto commits = [&] {
    auto l = SwapStore::ListCommits(o.paths);
    return l.ok() ? *l : std::vector<std::string>{l.status().ToString()};
  };
  using Metas = std::vector<std::string>;
  {
    auto store = SwapStore::Open(o);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    SwapStore* st = store->get();
    // Steady state first: the files stop growing with two commits retained.
    uint64_t file_bytes = 0;
    for (int step = 1; step <= 10; ++step) {
      write(st, "a", step % 2 ? v1 : v2);
      write(st, "b", step % 2 ? v1 : v2);
      ASSERT_TRUE(st->Commit(std::to_string(step)).ok());
      if (step == 5) file_bytes = st->stats().file_bytes;
    }
    EXPECT_EQ(st->stats().file_bytes, file_bytes);
    EXPECT_EQ(commits(), (Metas{"10", "9"}));
    // After commit 10 (v2), commit 11 (a = v3); then writes that would reuse any extent freed
    // too early: new tensors and new versions of both.
    write(st, "a", v3);
    ASSERT_TRUE(st->Commit("11").ok());
    EXPECT_EQ(st->committed_meta(), "11");
    EXPECT_EQ(commits(), (Metas{"11", "10"}));
    for (int k = 0; k < 4; ++k) write(st, "fill" + std::to_string(k), v1);
    write(st, "a", v1);
    write(st, "b", v3);
    ASSERT_TRUE(st->Close().ok());  // a crash: no commit
  }
  o.reopen = true;
  o.reopen_previous = true;
  {
    auto store = SwapStore::Open(o);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    SwapStore* st = store->get();
    EXPECT_EQ(st->committed_meta(), "10");
    EXPECT_EQ((Metas{"a", "b"}), st->Keys());
    read_equals(st, "a", v2);
    read_equals(st, "b", v2);
    // The last commit is gone: only "10" can be reopened now.
    EXPECT_EQ(commits(), (Metas{"10"}));
    write(st, "a", v1);
    ASSERT_TRUE(st->Commit("11'").ok());
    EXPECT_EQ(commits(), (Metas{"11'", "10"}));
  }
  o.reopen_previous = false;
  {
    auto store = SwapStore::Open(o);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    EXPECT_EQ((*store)->committed_meta(), "11'");
    read_equals(store->get(), "a", v1);
    read_equals(store->get(), "b", v2);
    EXPECT_EQ(commits(), (Metas{"11'"}));  // reopened at the last: the previous one dropped
  }
  // Only one commit left: no previous one to reopen at.
  o.reopen_previous = true;
  auto none = SwapStore::Open(o);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound) << none.status().ToString();
  // A crash between a commit's two renames leaves only the previous index: it is the last.
  const std::string index = o.paths[0] + "/zinf-swap.index.json";
  ASSERT_EQ(rename(index.c_str(), (o.paths[0] + "/zinf-swap.index.prev.json").c_str()), 0);
  EXPECT_EQ(commits(), (Metas{"11'"}));
  o.reopen_previous = false;
  {
    auto store = SwapStore::Open(o);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    EXPECT_EQ((*store)->committed_meta(), "11'");
    read_equals(store->get(), "a", v1);
  }
  EXPECT_EQ(commits(), (Metas{"11'"}));
  // Bad options.
  o.retained_commits = 3;
  EXPECT_EQ(SwapStore::Open(o).status().code(), StatusCode::kInvalidArgument);
  o.retained_commits = 2;
  o.durable = false;
  o.reopen_previous = true;
  EXPECT_EQ(SwapStore::Open(o).status().code(), StatusCode::kInvalidArgument);
  // A folder with no durable commit.
  TempDir empty;
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(SwapStore::ListCommits(empty.path()).status().code(), StatusCode::kNotFound);
}

INSTANTIATE_TEST_SUITE_P(
    Backends, SwapStoreTest,
    ::testing::Values(Case{IoBackendKind::kIoUring, true}, Case{IoBackendKind::kIoUring, false},
                      Case{IoBackendKind::kLibaio, true}, Case{IoBackendKind::kLibaio, false},
                      Case{IoBackendKind::kPsync, true}, Case{IoBackendKind::kPsync, false}),
    CaseName);

// ---- Faults ----------------------------------------------------------------------------------

class SwapFaultTest : public ::testing::TestWithParam<IoBackendKind> {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dir_.ok());
    plan_ = std::make_shared<FaultPlan>();
    SwapStoreOptions o = BaseOptions({dir_.path()}, GetParam(), true);
    o.fault_plan = plan_;
    o.checksums = true;
    auto store = SwapStore::Open(o);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    store_ = std::move(store).value();
    // Two tensors written cleanly first: "other" must survive every fault below.
    other_ = std::make_unique<AlignedBuffer>(kSize);
    victim_ = std::make_unique<AlignedBuffer>(kSize);
    FillRandom(other_->data(), kSize, 11);
    FillRandom(victim_->data(), kSize, 12);
    ASSERT_TRUE(WriteSync("other", *other_).ok());
    ASSERT_TRUE(WriteSync("victim", *victim_).ok());
  }

  Status WriteSync(const std::string& key, const AlignedBuffer& buf) {
    auto t = store_->Write(key, buf.data(), kSize, buf.size());
    if (!t.ok()) return t.status();
    return store_->Wait(*t);
  }
  Status ReadSync(const std::string& key, AlignedBuffer* buf) {
    auto t = store_->Read(key, buf->data(), buf->size());
    if (!t.ok()) return t.status();
    return store_->Wait(*t);
  }
  void ExpectOtherIntact() {
    AlignedBuffer back(kSize);
    Status s = ReadSync("other", &back);
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(0, std::memcmp(back.data(), other_->data(), kSize));
  }
  // Makes the next request (first = current count + k) fault.
  void FaultAt(IoFault f, uint64_t k = 0) { plan_->AddAhead(f, k); }

  static constexpr uint64_t kSize = 300000;  // 5 chunks of 64 KiB, 10 requests of 32 KiB
  TempDir dir_;
  std::shared_ptr<FaultPlan> plan_;
  std::unique_ptr<SwapStore> store_;
  std::unique_ptr<AlignedBuffer> other_, victim_;
};

TEST_P(SwapFaultTest, WriteEioBecomesStatusNamingFileAndTensor) {
  IoFault f;
  f.kind = IoFault::Kind::kError;
  f.errno_value = EIO;
  FaultAt(f, 3);
  AlignedBuffer fresh(kSize);
  FillRandom(fresh.data(), kSize, 13);
  Status s = WriteSync("victim", fresh);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(StatusCode::kIoError, s.code());
  EXPECT_EQ(EIO, s.sys_errno());
  EXPECT_NE(std::string::npos, s.message().find("tensor 'victim'")) << s.message();
  EXPECT_NE(std::string::npos, s.message().find("zinf-swap-0.bin at offset")) << s.message();
  // The failed tensor refuses reads with the reason; the other one is intact.
  AlignedBuffer back(kSize);
  Status r = ReadSync("victim", &back);
  EXPECT_EQ(StatusCode::kFailedPrecondition, r.code());
  EXPECT_NE(std::string::npos, r.message().find("last write failed")) << r.message();
  plan_->Clear();
  ExpectOtherIntact();
  // Rewriting heals it.
  ASSERT_TRUE(WriteSync("victim", fresh).ok());
  ASSERT_TRUE(ReadSync("victim", &back).ok());
  EXPECT_EQ(0, std::memcmp(back.data(), fresh.data(), kSize));
}

TEST_P(SwapFaultTest, ReadEioAndEnospcAreStatuses) {
  IoFault f;
  f.kind = IoFault::Kind::kError;
  f.errno_value = EIO;
  FaultAt(f, 1);
  AlignedBuffer back(kSize);
  Status s = ReadSync("victim", &back);
  EXPECT_EQ(StatusCode::kIoError, s.code()) << s.ToString();
  EXPECT_NE(std::string::npos, s.message().find("swap read of tensor 'victim'"));

  f.errno_value = ENOSPC;
  FaultAt(f, 0);
  s = WriteSync("victim", *victim_);
  EXPECT_EQ(StatusCode::kResourceExhausted, s.code()) << s.ToString();
  plan_->Clear();
  ExpectOtherIntact();
}

TEST_P(SwapFaultTest, ShortTransfersAndEagainAreResubmitted) {
  IoFault shorty;
  shorty.kind = IoFault::Kind::kShort;
  shorty.short_bytes = 4096;
  shorty.count = 6;
  FaultAt(shorty, 0);
  IoFault again;
  again.kind = IoFault::Kind::kError;
  again.errno_value = EAGAIN;
  again.count = 3;
  plan_->AddAhead(again, 6);
  AlignedBuffer fresh(kSize), back(kSize);
  FillRandom(fresh.data(), kSize, 21);
  Status s = WriteSync("victim", fresh);
  ASSERT_TRUE(s.ok()) << s.ToString();
  plan_->Clear();
  FaultAt(shorty, 0);
  s = ReadSync("victim", &back);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(0, std::memcmp(back.data(), fresh.data(), kSize));
}

// A torn write (the device acknowledges bytes it did not store) is caught by the checksums.
TEST_P(SwapFaultTest, TornWriteDetectedByChecksum) {
  IoFault torn;
  torn.kind = IoFault::Kind::kTorn;
  torn.short_bytes = 4096;
  FaultAt(torn, 2);
  AlignedBuffer fresh(kSize), back(kSize);
  FillRandom(fresh.data(), kSize, 31);
  ASSERT_TRUE(WriteSync("victim", fresh).ok());  // the lie is not visible at write time
  plan_->Clear();
  Status s = ReadSync("victim", &back);
  EXPECT_EQ(StatusCode::kCorruption, s.code()) << s.ToString();
  EXPECT_NE(std::string::npos, s.message().find("checksum mismatch")) << s.message();
  ExpectOtherIntact();
}

TEST_P(SwapFaultTest, SlowRequestsStillComplete) {
  IoFault slow;
  slow.kind = IoFault::Kind::kDelay;
  slow.delay_us = 20000;
  slow.count = 3;
  FaultAt(slow, 0);
  AlignedBuffer back(kSize);
  auto t0 = std::chrono::steady_clock::now();
  Status s = ReadSync("victim", &back);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(20));
  EXPECT_EQ(0, std::memcmp(back.data(), victim_->data(), kSize));
}

INSTANTIATE_TEST_SUITE_P(Backends, SwapFaultTest,
                         ::testing::Values(IoBackendKind::kIoUring, IoBackendKind::kLibaio,
                                           IoBackendKind::kPsync),
                         [](const auto& info) {
                           return std::string(IoBackendKindName(info.param));
                         });

// ---- Errors at the call ------------------------------------------------------------------------

TEST(SwapStoreErrors, MisalignedBufferRejectedClearly) {
  TempDir dir;
  auto store = SwapStore::Open(BaseOptions({dir.path()}, IoBackendKind::kIoUring, true));
  ASSERT_TRUE(store.ok());
  AlignedBuffer buf(8192 + 4096);
  auto t = (*store)->Write("x", buf.data() + 512, 4096, 8192);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(StatusCode::kInvalidArgument, t.status().code());
  EXPECT_NE(std::string::npos, t.status().message().find("not aligned to 4096"));
  t = (*store)->Write("x", buf.data(), 5000, 4096);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(std::string::npos, t.status().message().find("8192 are needed"));
  t = (*store)->Read("missing", buf.data(), 4096);
  EXPECT_EQ(StatusCode::kNotFound, t.status().code());
  EXPECT_EQ(StatusCode::kInvalidArgument, (*store)->Wait(12345).code());
}

TEST(SwapStoreErrors, BadPaths) {
  TempDir dir;
  auto missing =
      SwapStore::Open(BaseOptions({dir.path() + "/nope"}, IoBackendKind::kIoUring, true));
  EXPECT_EQ(StatusCode::kNotFound, missing.status().code());
  EXPECT_NE(std::string::npos, missing.status().message().find("does not exist"));
  std::string file = dir.path() + "/file";
  std::ofstream(file) << "x";
  auto not_dir = SwapStore::Open(BaseOptions({file}, IoBackendKind::kIoUring, true));
  EXPECT_EQ(StatusCode::kInvalidArgument, not_dir.status().code());
  EXPECT_NE(std::string::npos, not_dir.status().message().find("is not a folder"));
  auto none = SwapStore::Open(BaseOptions({}, IoBackendKind::kIoUring, true));
  EXPECT_EQ(StatusCode::kInvalidArgument, none.status().code());
}

// Full store: the failing write errors at the call, nothing moves, the others are intact;
// a same-size overwrite needs no new space and still works.
TEST(SwapStoreErrors, FullStoreFailsAtTheCallOthersIntact) {
  TempDir dir;
  SwapStoreOptions o = BaseOptions({dir.path()}, IoBackendKind::kIoUring, true);
  o.capacity_per_path = 1 << 20;
  o.max_capacity_per_path = 1 << 20;
  auto store = SwapStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  AlignedBuffer a(600000), b(600000), back(600000);
  FillRandom(a.data(), a.size(), 5);
  FillRandom(b.data(), b.size(), 6);
  auto t = (*store)->Write("a", a.data(), a.size(), a.size());
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*store)->Wait(*t).ok());
  t = (*store)->Write("b", b.data(), b.size(), b.size());
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(StatusCode::kResourceExhausted, t.status().code());
  EXPECT_NE(std::string::npos, t.status().message().find("tensor 'b'")) << t.status().message();
  EXPECT_NE(std::string::npos, t.status().message().find("capacity limit"));
  EXPECT_FALSE((*store)->Contains("b"));
  t = (*store)->Write("a", b.data(), b.size(), b.size());  // same size: in place
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_TRUE((*store)->Wait(*t).ok());
  t = (*store)->Read("a", back.data(), back.size());
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*store)->Wait(*t).ok());
  EXPECT_EQ(0, std::memcmp(back.data(), b.data(), b.size()));
  // Removing frees the space for another tensor.
  ASSERT_TRUE((*store)->Remove("a").ok());
  t = (*store)->Write("b", b.data(), b.size(), b.size());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_TRUE((*store)->Wait(*t).ok());
}

TEST(SwapStoreErrors, SwapFilesAre0600AndInsideThePath) {
  TempDir dir;
  mode_t old = umask(0);
  auto store = SwapStore::Open(BaseOptions({dir.path()}, IoBackendKind::kIoUring, true));
  umask(old);
  ASSERT_TRUE(store.ok());
  for (const std::string& f : (*store)->file_paths()) {
    EXPECT_EQ(0u, f.rfind(dir.path() + "/", 0)) << f;
    struct stat st {};
    ASSERT_EQ(0, stat(f.c_str(), &st));
    EXPECT_EQ(0600u, st.st_mode & 0777) << f;
  }
  ASSERT_TRUE((*store)->Close().ok());
  struct stat st {};
  ASSERT_EQ(0, stat((dir.path() + "/zinf-swap.index.json").c_str(), &st));
  EXPECT_EQ(0600u, st.st_mode & 0777);
}

TEST(SwapStoreErrors, BusyKeyAndCorruptIndex) {
  TempDir dir;
  SwapStoreOptions o = BaseOptions({dir.path()}, IoBackendKind::kPsync, true);
  auto plan = std::make_shared<FaultPlan>();
  IoFault slow;
  slow.kind = IoFault::Kind::kDelay;
  slow.delay_us = 50000;
  plan->Add(slow);
  o.fault_plan = plan;
  {
    auto store = SwapStore::Open(o);
    ASSERT_TRUE(store.ok());
    AlignedBuffer a(4096);
    auto t = (*store)->Write("a", a.data(), 4096, 4096);
    ASSERT_TRUE(t.ok());
    auto again = (*store)->Write("a", a.data(), 4096, 4096);
    EXPECT_EQ(StatusCode::kFailedPrecondition, again.status().code());
    EXPECT_EQ(StatusCode::kFailedPrecondition, (*store)->Remove("a").code());
    ASSERT_TRUE((*store)->Wait(*t).ok());
  }
  std::ofstream(dir.path() + "/zinf-swap.index.json") << "{\"version\": 1, \"tensors\": 3";
  o.reopen = true;
  auto bad = SwapStore::Open(o);
  EXPECT_EQ(StatusCode::kCorruption, bad.status().code());
  EXPECT_NE(std::string::npos, bad.status().message().find("not valid JSON"));
}

// On tmpfs O_DIRECT is refused: the store falls back to buffered I/O with one warning.
TEST(SwapStoreErrors, DirectIoRefusedFallsBackWithOneWarning) {
  TempDir dir("/dev/shm");
  if (!dir.ok()) GTEST_SKIP() << "no /dev/shm on this machine";
  LogCapture log;
  auto store =
      SwapStore::Open(BaseOptions({dir.path(), dir.path()}, IoBackendKind::kIoUring, true));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  if ((*store)->direct_io()) GTEST_SKIP() << "this /dev/shm accepts O_DIRECT";
  int warnings = 0;
  for (const std::string& l : log.lines())
    warnings += l.find("O_DIRECT refused") != std::string::npos;
  EXPECT_EQ(1, warnings);
  AlignedBuffer a(10000), back(10000);
  FillRandom(a.data(), 10000, 3);
  auto t = (*store)->Write("a", a.data(), 10000, a.size());
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*store)->Wait(*t).ok());
  t = (*store)->Read("a", back.data(), back.size());
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*store)->Wait(*t).ok());
  EXPECT_EQ(0, std::memcmp(a.data(), back.data(), 10000));
}

// ---- PinnedArena -------------------------------------------------------------------------------

TEST(PinnedArenaTest, AllocatesAlignedReusesAndCoalesces) {
  PinnedArenaOptions o;
  o.bytes = 4 << 20;
  auto arena = PinnedArena::Create(o);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  EXPECT_EQ(0u, reinterpret_cast<uintptr_t>((*arena)->region().base) % (2 << 20));
  auto a = (*arena)->Allocate(1);
  auto b = (*arena)->Allocate(5000);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(4096u, a->capacity());
  EXPECT_EQ(8192u, b->capacity());
  EXPECT_EQ(0u, reinterpret_cast<uintptr_t>(b->data()) % 4096);
  EXPECT_EQ(12288u, (*arena)->used());
  auto too_big = (*arena)->Allocate(4 << 20);
  EXPECT_EQ(StatusCode::kResourceExhausted, too_big.status().code());
  a->Reset();
  b->Reset();
  EXPECT_EQ(0u, (*arena)->used());
  auto whole = (*arena)->Allocate(4 << 20);  // coalesced back into one range
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();
  EXPECT_EQ(size_t{4} << 20, (*arena)->peak_used());
}

// An arena of 8 MiB and a store in `dir` with it registered (io_uring fixed buffers).
void OpenRegistered(const TempDir& dir, bool lock, std::unique_ptr<PinnedArena>* arena,
                    std::unique_ptr<SwapStore>* store) {
  PinnedArenaOptions ao;
  ao.bytes = 8 << 20;
  ao.lock_memory = lock;
  auto created = PinnedArena::Create(ao);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  *arena = std::move(*created);
  SwapStoreOptions o = BaseOptions({dir.path()}, IoBackendKind::kIoUring, true);
  o.registered_regions = {(*arena)->region()};
  auto opened = SwapStore::Open(o);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  *store = std::move(*opened);
  ASSERT_NE(std::string::npos, (*store)->backend_features().find("fixed-buffers"))
      << (*store)->backend_features();
}

// What holds values: the blocks handed out, widened to whole pages and merged.
TEST(PinnedArenaTest, UsedPagesAreTheBlocksHandedOut) {
  PinnedArenaOptions o;
  o.bytes = 4 << 20;
  o.alignment = 64;
  auto arena = PinnedArena::Create(o);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  char* base = static_cast<char*>((*arena)->region().base);
  EXPECT_TRUE((*arena)->UsedPages().empty());
  auto a = (*arena)->Allocate(100);    // [0, 128)
  auto b = (*arena)->Allocate(8192);   // [128, 8320)
  auto c = (*arena)->Allocate(16384);  // [8320, 24704)
  auto d = (*arena)->Allocate(64);     // [24704, 24768)
  ASSERT_TRUE(a.ok() && b.ok() && c.ok() && d.ok());
  c->Reset();
  std::vector<MemoryRegion> pages = (*arena)->UsedPages();
  // [0, 8320) -> pages [0, 12288); [24704, 24768) -> page [24576, 28672).
  ASSERT_EQ(2u, pages.size());
  EXPECT_EQ(base, pages[0].base);
  EXPECT_EQ(12288u, pages[0].len);
  EXPECT_EQ(base + 24576, pages[1].base);
  EXPECT_EQ(4096u, pages[1].len);
  b->Reset();
  a->Reset();
  pages = (*arena)->UsedPages();
  ASSERT_EQ(1u, pages.size());
  EXPECT_EQ(base + 24576, pages[0].base);
}

// The arena's huge-page coverage, read from /proc/self/smaps: all of it where transparent huge
// pages are on (Create asks with MADV_HUGEPAGE, then MADV_COLLAPSE for what the fault path left
// in 4 KiB pages; a 1 MiB write from 4 KiB pages is split by the block layer); none once
// released (no page at all); all again once restored.
TEST(PinnedArenaTest, HugePageBytesAreTheArenasTwoMiBPages) {
  std::string mode;
  if (FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r")) {
    char line[128] = {0};
    if (std::fgets(line, sizeof(line), f) != nullptr) mode = line;
    std::fclose(f);
  }
  const bool thp = mode.find("[never]") == std::string::npos && !mode.empty();
  PinnedArenaOptions o;
  o.bytes = 16 << 20;
  o.lock_memory = false;
  auto arena = PinnedArena::Create(o);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  Result<size_t> huge = (*arena)->HugePageBytes();
  ASSERT_TRUE(huge.ok()) << huge.status().ToString();
  EXPECT_EQ(0u, *huge % (2 << 20));
  if (thp) EXPECT_EQ(size_t{16} << 20, *huge) << "transparent_hugepage: " << mode;
  ASSERT_TRUE((*arena)->Release().ok());
  huge = (*arena)->HugePageBytes();
  ASSERT_TRUE(huge.ok());
  EXPECT_EQ(0u, *huge);
  ASSERT_TRUE((*arena)->Restore().ok());
  huge = (*arena)->HugePageBytes();
  ASSERT_TRUE(huge.ok());
  if (thp) EXPECT_EQ(size_t{16} << 20, *huge) << "transparent_hugepage: " << mode;
}

// offload_states(device="nvme")'s release: the arena's memory goes back to the kernel (none of
// it resident) and comes back while a store has it registered with io_uring. The registration
// is dropped first (fixed buffers pin the pages they were registered with: a read after the
// release would land in the old pages, and the arena would read zeros) and restored after.
TEST(PinnedArenaTest, ReleasedAndRestoredUnderARegisteredStore) {
  for (bool lock : {false, true}) {
    SCOPED_TRACE(lock ? "locked" : "not locked");
    TempDir dir;
    std::unique_ptr<PinnedArena> arena;
    std::unique_ptr<SwapStore> store;
    ASSERT_NO_FATAL_FAILURE(OpenRegistered(dir, lock, &arena, &store));
    auto buf = arena->Allocate(3 << 20);
    ASSERT_TRUE(buf.ok());
    FillRandom(buf->data(), buf->capacity(), 78);
    std::vector<char> kept(static_cast<char*>(buf->data()),
                           static_cast<char*>(buf->data()) + (3 << 20));
    auto t = store->Write("w", buf->data(), 3 << 20, buf->capacity());
    ASSERT_TRUE(t.ok());
    ASSERT_TRUE(store->Wait(*t).ok());

    Result<size_t> resident = arena->ResidentBytes();
    ASSERT_TRUE(resident.ok());
    EXPECT_GE(*resident, size_t{3} << 20);  // (at least what was just written)
    ASSERT_TRUE(store->SetRegionsRegistered(false).ok());
    ASSERT_TRUE(arena->Release().ok());
    EXPECT_TRUE(arena->released());
    resident = arena->ResidentBytes();
    ASSERT_TRUE(resident.ok());
    EXPECT_EQ(0u, *resident);
    ASSERT_TRUE(arena->Restore().ok());
    ASSERT_TRUE(store->SetRegionsRegistered(true).ok());
    EXPECT_FALSE(arena->released());
    EXPECT_EQ(0, static_cast<char*>(buf->data())[4096]);  // the values went with the memory

    t = store->Read("w", buf->data(), buf->capacity());
    ASSERT_TRUE(t.ok());
    ASSERT_TRUE(store->Wait(*t).ok());
    EXPECT_EQ(0, std::memcmp(kept.data(), buf->data(), kept.size()));
    // And writes from the arena's new pages reach the file.
    FillRandom(buf->data(), buf->capacity(), 79);
    t = store->Write("v", buf->data(), 3 << 20, buf->capacity());
    ASSERT_TRUE(t.ok());
    ASSERT_TRUE(store->Wait(*t).ok());
    AlignedBuffer back(3 << 20);
    t = store->Read("v", back.data(), back.size());
    ASSERT_TRUE(t.ok());
    ASSERT_TRUE(store->Wait(*t).ok());
    EXPECT_EQ(0, std::memcmp(buf->data(), back.data(), 3 << 20));
    ASSERT_TRUE(store->Close().ok());
  }
}

// Arena buffers are registered with io_uring (fixed buffers) and round-trip through the store.
TEST(PinnedArenaTest, RegisteredWithIoUring) {
  TempDir dir;
  std::unique_ptr<PinnedArena> arena;
  std::unique_ptr<SwapStore> store;
  ASSERT_NO_FATAL_FAILURE(OpenRegistered(dir, /*lock=*/false, &arena, &store));
  auto buf = arena->Allocate(3 << 20);
  auto back = arena->Allocate(3 << 20);
  ASSERT_TRUE(buf.ok() && back.ok());
  FillRandom(buf->data(), buf->capacity(), 77);
  auto t = store->Write("w", buf->data(), 3 << 20, buf->capacity());
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE(store->Wait(*t).ok());
  t = store->Read("w", back->data(), back->capacity());
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE(store->Wait(*t).ok());
  EXPECT_EQ(0, std::memcmp(buf->data(), back->data(), 3 << 20));
}

}  // namespace
}  // namespace zinf
