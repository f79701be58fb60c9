// Folder locks: two holders of a swap folder (another process, or another store of this one)
// are refused with the holder named; a killed holder leaves no lock behind.
#include "common/folder_lock.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "tests/test_util.h"
#include "zinf/swap.h"

namespace zinf {
namespace {

using testing::TempDir;

TEST(FolderLock, ASecondHolderIsRefusedNamingTheFirst) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  Result<std::unique_ptr<FolderLock>> first = FolderLock::Acquire(dir.path(), "x.lock", "folder");
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  Result<std::unique_ptr<FolderLock>> second =
      FolderLock::Acquire(dir.path(), "x.lock", "checkpoint folder");
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  const std::string& m = second.status().message();
  EXPECT_NE(m.find("checkpoint folder " + dir.path()), std::string::npos) << m;
  EXPECT_NE(m.find("pid " + std::to_string(getpid())), std::string::npos) << m;
  EXPECT_NE(m.find("this process"), std::string::npos) << m;
  first->reset();
  EXPECT_TRUE(FolderLock::Acquire(dir.path(), "x.lock", "folder").ok());
}

TEST(FolderLock, AKilledHolderLeavesNoLock) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto lock = FolderLock::Acquire(dir.path(), "x.lock", "folder");
    char c = lock.ok() ? 'y' : 'n';
    (void)!write(ready[1], &c, 1);  // the parent reads it; nothing to do on failure here
    pause();
    _exit(0);
  }
  char c = 0;
  ASSERT_EQ(read(ready[0], &c, 1), 1);
  ASSERT_EQ(c, 'y');
  Result<std::unique_ptr<FolderLock>> taken = FolderLock::Acquire(dir.path(), "x.lock", "folder");
  ASSERT_FALSE(taken.ok());
  EXPECT_NE(taken.status().message().find("pid " + std::to_string(child)), std::string::npos)
      << taken.status().message();
  ASSERT_EQ(kill(child, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(FolderLock::Acquire(dir.path(), "x.lock", "folder").ok());
  close(ready[0]);
  close(ready[1]);
}

TEST(FolderLock, TwoSwapStoresOnOneFolderAreRefused) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  SwapStoreOptions o;
  o.paths = {dir.path()};
  o.backend = IoBackendKind::kPsync;
  Result<std::unique_ptr<SwapStore>> a = SwapStore::Open(o);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  std::vector<char> buf(4096, 7);
  void* aligned = nullptr;
  ASSERT_EQ(posix_memalign(&aligned, 4096, 4096), 0);
  std::memcpy(aligned, buf.data(), 4096);
  Result<Ticket> t = (*a)->Write("k", aligned, 4096, 4096);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*a)->Wait(*t).ok());
  // A second store on the same folder (also as the second of several paths) is refused before
  // it touches anything: the first store's data stays readable.
  TempDir other;
  for (std::vector<std::string> paths :
       {std::vector<std::string>{dir.path()}, {other.path(), dir.path()}}) {
    SwapStoreOptions o2 = o;
    o2.paths = paths;
    Result<std::unique_ptr<SwapStore>> b = SwapStore::Open(o2);
    ASSERT_FALSE(b.ok());
    EXPECT_EQ(b.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(b.status().message().find("swap folder " + dir.path() + " is in use"),
              std::string::npos)
        << b.status().message();
  }
  std::memset(aligned, 0, 4096);
  t = (*a)->Read("k", aligned, 4096);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*a)->Wait(*t).ok());
  EXPECT_EQ(static_cast<char*>(aligned)[100], 7);
  ASSERT_TRUE((*a)->Close().ok());
  a->reset();
  o.overwrite = true;  // the closed store wrote an index: a fresh one replaces it only so
  EXPECT_TRUE(SwapStore::Open(o).ok()) << "the lock goes with the store";
  std::free(aligned);
}

}  // namespace
}  // namespace zinf
