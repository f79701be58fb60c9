// Swap-file space on a small real filesystem (a loop-mounted ext4, when root may mount): growth
// proportional to need, never into the filesystem's reserve, a request larger than the disk
// refused at the call, nothing left behind by a store that removes its files.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tests/test_util.h"
#include "zinf/log.h"
#include "zinf/swap.h"

namespace zinf {
namespace {

using testing::TempDir;

// A fresh ext4 filesystem of `mib` MiB mounted at mount(); unmounted and removed at the end.
class LoopFs {
 public:
  explicit LoopFs(int mib) {
    if (geteuid() != 0) {
      why_not_ = "not root: cannot mount a loop filesystem";
      return;
    }
    image_ = dir_.path() + "/fs.img";
    mount_ = dir_.path() + "/mnt";
    const std::string mk = "truncate -s " + std::to_string(mib) + "M " + image_ +
                           " && mkfs.ext4 -q -F " + image_ + " >/dev/null 2>&1 && mkdir -p " +
                           mount_ + " && mount -o loop " + image_ + " " + mount_ +
                           " >/dev/null 2>&1";
    if (std::system(mk.c_str()) != 0) {
      why_not_ = "cannot make and loop-mount an ext4 image (mkfs.ext4, mount -o loop)";
      return;
    }
    mounted_ = true;
  }
  ~LoopFs() {
    if (mounted_) (void)!std::system(("umount " + mount_ + " >/dev/null 2>&1").c_str());
  }
  bool ok() const { return mounted_; }
  const std::string& why_not() const { return why_not_; }
  const std::string& mount() const { return mount_; }
  uint64_t Free() const {
    struct statvfs v {};
    statvfs(mount_.c_str(), &v);
    return uint64_t(v.f_bavail) * v.f_frsize;
  }

 private:
  TempDir dir_;
  std::string image_, mount_, why_not_;
  bool mounted_ = false;
};

struct Buffer {
  void* p = nullptr;
  size_t n = 0;
  explicit Buffer(size_t bytes) : n(RoundUp(bytes, 4096)) {
    if (posix_memalign(&p, 4096, n) != 0) p = nullptr;
    if (p != nullptr) std::memset(p, 0x5a, n);
  }
  ~Buffer() { std::free(p); }
};

uint64_t FileSize(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
}

SwapStoreOptions Options(const std::string& dir) {
  SwapStoreOptions o;
  o.paths = {dir};
  o.backend = IoBackendKind::kPsync;
  return o;
}

TEST(SwapSpace, GrowthFollowsNeedAndARequestLargerThanTheDiskIsRefusedAtTheCall) {
  LoopFs fs(64);
  if (!fs.ok()) GTEST_SKIP() << fs.why_not();
  const uint64_t free_at_start = fs.Free();
  auto store = SwapStore::Open(Options(fs.mount()));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  // 1.5 MB of state: the file grows by what it needs (it used to grow by 256 MiB, which on
  // this disk failed half-way and left the filesystem full).
  Buffer b(1500000);
  auto t = (*store)->Write("small", b.p, 1500000, b.n);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_TRUE((*store)->Wait(*t).ok());
  const std::string file = fs.mount() + "/zinf-swap-0.bin";
  EXPECT_LE(FileSize(file), 4u << 20);
  EXPECT_GE(fs.Free(), free_at_start - (6u << 20));
  // 1 TiB in one write: refused at the call, nothing grown.
  const uint64_t size_before = FileSize(file), free_before = fs.Free();
  Buffer tiny(4096);
  Result<Ticket> huge = (*store)->Write("huge", tiny.p, uint64_t{1} << 40, uint64_t{1} << 41);
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), StatusCode::kResourceExhausted) << huge.status().ToString();
  EXPECT_NE(huge.status().message().find("in reserve"), std::string::npos);
  EXPECT_EQ(FileSize(file), size_before);
  EXPECT_GE(fs.Free() + (64u << 10), free_before);
  // The first tensor is intact.
  Buffer back(1500000);
  t = (*store)->Read("small", back.p, back.n);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*store)->Wait(*t).ok());
  EXPECT_EQ(std::memcmp(back.p, b.p, 1500000), 0);
}

TEST(SwapSpace, WritesStopAtTheReserveAndEarlierTensorsStayIntact) {
  LoopFs fs(64);
  if (!fs.ok()) GTEST_SKIP() << fs.why_not();
  SwapStoreOptions o = Options(fs.mount());
  o.reserve_bytes = 16u << 20;
  auto store = SwapStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  Buffer b(4u << 20);
  int written = 0;
  Status refused;
  for (int i = 0; i < 64 && refused.ok(); ++i) {
    std::memset(b.p, i, b.n);
    Result<Ticket> t = (*store)->Write("t" + std::to_string(i), b.p, b.n, b.n);
    if (!t.ok()) {
      refused = t.status();
      break;
    }
    ASSERT_TRUE((*store)->Wait(*t).ok());
    ++written;
  }
  ASSERT_FALSE(refused.ok()) << "64 x 4 MiB cannot fit a 64 MiB filesystem";
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused.ToString();
  EXPECT_GE(fs.Free(), 16u << 20) << "growth went into the reserve";
  EXPECT_GT(written, 4);
  Buffer back(4u << 20);
  for (int i = 0; i < written; ++i) {
    Result<Ticket> t = (*store)->Read("t" + std::to_string(i), back.p, back.n);
    ASSERT_TRUE(t.ok());
    ASSERT_TRUE((*store)->Wait(*t).ok());
    EXPECT_EQ(static_cast<unsigned char*>(back.p)[12345], static_cast<unsigned char>(i));
  }
}

TEST(SwapSpace, AStoreThatRemovesItsFilesLeavesNothingBehind) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  SwapStoreOptions o = Options(dir.path());
  o.remove_on_close = true;
  auto store = SwapStore::Open(o);
  ASSERT_TRUE(store.ok());
  Buffer b(8192);
  auto t = (*store)->Write("x", b.p, 8192, b.n);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*store)->Wait(*t).ok());
  ASSERT_TRUE((*store)->Close().ok());
  EXPECT_EQ(FileSize(dir.path() + "/zinf-swap-0.bin"), 0u);
  struct stat st {};
  EXPECT_NE(stat((dir.path() + "/zinf-swap-0.bin").c_str(), &st), 0);
  EXPECT_NE(stat((dir.path() + "/zinf-swap.index.json").c_str(), &st), 0);
}

TEST(SwapSpace, KeysThatAreNotUtf8AndAbsurdSizesAreRefused) {
  TempDir dir;
  auto store = SwapStore::Open(Options(dir.path()));
  ASSERT_TRUE(store.ok());
  Buffer b(4096);
  EXPECT_EQ((*store)->Write(std::string("k\xff", 2), b.p, 16, b.n).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ((*store)->Write("big", b.p, ~uint64_t{0} - 100, ~uint64_t{0}).status().code(),
            StatusCode::kInvalidArgument);
  SwapStoreOptions o = Options(std::string("/tmp/\xc3(", 7));
  EXPECT_EQ(SwapStore::Open(o).status().code(), StatusCode::kInvalidArgument);
}

TEST(SwapBackend, AnIoUringThatCannotBeSetUpFallsBackWithOneWarning) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // The sanitizer runtimes open files of their own (UBSan's type checks read the memory map):
  // with every descriptor taken they report errors of their own. The plain build runs it.
  GTEST_SKIP() << "takes every file descriptor away, which the sanitizer runtime needs";
#endif
  // In a child: a file-descriptor limit that leaves room for the lock and swap files but not
  // for the io_uring's descriptors. The store must open on another backend (libaio or psync:
  // libaio wants an eventfd too), say once why, naming the cause, and work.
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::vector<std::string> warnings;
    SetLogSink([&](LogLevel level, const std::string& line) {
      if (level == LogLevel::kWarning) warnings.push_back(line);
    });
    // Every descriptor below a limit of 64 taken, then two given back: room for the lock
    // file and the swap file (opened at Open), none for the ring.
    struct rlimit rl {
      64, 64
    };
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0) _exit(10);
    std::vector<int> fillers;
    for (int fd; (fd = open("/dev/null", O_RDONLY)) >= 0;) fillers.push_back(fd);
    if (errno != EMFILE || fillers.size() < 2) _exit(10);
    for (int i = 0; i < 2; ++i) {
      close(fillers.back());
      fillers.pop_back();
    }
    SwapStoreOptions o = Options(dir.path());
    o.backend = IoBackendKind::kIoUring;
    auto store = SwapStore::Open(o);
    if (!store.ok()) {
      fprintf(stderr, "%s\n", store.status().ToString().c_str());
      _exit(11);
    }
    Buffer b(8192), back(8192);
    auto t = (*store)->Write("x", b.p, 8192, b.n);
    if (!t.ok() || !(*store)->Wait(*t).ok()) _exit(12);
    t = (*store)->Read("x", back.p, back.n);
    if (!t.ok() || !(*store)->Wait(*t).ok() || std::memcmp(b.p, back.p, 8192) != 0) _exit(13);
    int said = 0;
    for (const std::string& w : warnings) {
      said += w.find("io_uring I/O backend is unavailable") != std::string::npos &&
              w.find("Too many open files") != std::string::npos;
    }
    if (said != 1) {
      for (const std::string& w : warnings) fprintf(stderr, "warning: %s\n", w.c_str());
    }
    _exit(said == 1 ? 0 : 14);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "10: setrlimit, 11: open, 12: write, 13: read, 14: the "
                                       "warning (none, or more than one)";
}

}  // namespace
}  // namespace zinf
