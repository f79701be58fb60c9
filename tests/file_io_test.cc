// common/file_io: ReplaceFile, the write-temporary, fsync, rename protocol every file that must
// survive a crash goes through (the checkpoint folder's `latest`, the swap store's index).
#include "common/file_io.h"

#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace zinf {
namespace {

// The names in `dir`, without "." and "..", sorted.
std::vector<std::string> List(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      std::string name = e->d_name;
      if (name != "." && name != "..") names.push_back(name);
    }
    closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

bool Exists(const std::string& path) {
  struct stat st {};
  return lstat(path.c_str(), &st) == 0;
}

class ReplaceFileTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(dir_.ok()) << "cannot create a temporary folder"; }
  testing::TempDir dir_;
};

TEST_F(ReplaceFileTest, WritesTheContentsAndLeavesOnlyTheFile) {
  const std::string path = dir_.path() + "/latest";
  ASSERT_TRUE(ReplaceFile(path, "step-000000001\n").ok());
  EXPECT_EQ("step-000000001\n", ReadSmallFile(path, 1 << 20).value());
  // Replaced: bytes, NULs included, through the (data, n) form.
  const std::string bytes("a\0b\0\xff", 5);
  ASSERT_TRUE(ReplaceFile(path, bytes.data(), bytes.size()).ok());
  EXPECT_EQ(bytes, ReadSmallFile(path, 1 << 20).value());
  // Empty is a valid content.
  ASSERT_TRUE(ReplaceFile(path, "").ok());
  EXPECT_EQ("", ReadSmallFile(path, 1 << 20).value());
  EXPECT_EQ(std::vector<std::string>{"latest"}, List(dir_.path()));
  struct stat st {};
  ASSERT_EQ(0, stat(path.c_str(), &st));
  EXPECT_EQ(0600u, st.st_mode & 0777);
}

TEST_F(ReplaceFileTest, AMissingFolderIsAnErrorNamingThePathAndLeavesNoTemporary) {
  const std::string path = dir_.path() + "/no-such-folder/latest";
  bool renamed = false;
  ReplaceFileOptions options;
  options.renamed = &renamed;
  Status s = ReplaceFile(path, "x", 1, options);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(StatusCode::kNotFound, s.code()) << s.ToString();
  EXPECT_NE(std::string::npos, s.message().find(path)) << s.ToString();
  EXPECT_FALSE(renamed);
  EXPECT_FALSE(Exists(path + ".tmp"));
  EXPECT_TRUE(List(dir_.path()).empty());
}

TEST_F(ReplaceFileTest, AFailedRenameRemovesTheTemporaryAndLeavesTheTargetAlone) {
  // A folder (not empty) where the file should go: the temporary is written, the rename fails.
  const std::string path = dir_.path() + "/latest";
  ASSERT_EQ(0, mkdir(path.c_str(), 0700));
  ASSERT_TRUE(ReplaceFile(path + "/inside", "keep").ok());
  Status s = ReplaceFile(path, "new");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(std::string::npos, s.message().find("renaming " + path + ".tmp to " + path))
      << s.ToString();
  EXPECT_EQ(std::vector<std::string>{"latest"}, List(dir_.path()));
  EXPECT_EQ("keep", ReadSmallFile(path + "/inside", 64).value());
}

TEST_F(ReplaceFileTest, BeforeRenameSeesTheDurableTemporaryAndCanStopTheReplacement) {
  const std::string path = dir_.path() + "/index";
  ASSERT_TRUE(ReplaceFile(path, "old").ok());
  int calls = 0;
  bool renamed = false;
  ReplaceFileOptions options;
  options.renamed = &renamed;
  options.before_rename = [&]() -> Status {
    ++calls;
    // The new contents are complete in the temporary; `path` is still the old file.
    EXPECT_EQ("new", ReadSmallFile(path + ".tmp", 64).value());
    EXPECT_EQ("old", ReadSmallFile(path, 64).value());
    return Status::IoError("moving the last commit aside failed");
  };
  Status s = ReplaceFile(path, "new", 3, options);
  EXPECT_EQ(1, calls);
  EXPECT_EQ("IoError: moving the last commit aside failed", s.ToString());
  EXPECT_FALSE(renamed);
  EXPECT_EQ("old", ReadSmallFile(path, 64).value());
  EXPECT_EQ(std::vector<std::string>{"index"}, List(dir_.path()));

  options.before_rename = [&]() -> Status {
    ++calls;
    return Status::OK();
  };
  ASSERT_TRUE(ReplaceFile(path, "new", 3, options).ok());
  EXPECT_EQ(2, calls);
  EXPECT_TRUE(renamed);
  EXPECT_EQ("new", ReadSmallFile(path, 64).value());
  EXPECT_EQ(std::vector<std::string>{"index"}, List(dir_.path()));
}

TEST_F(ReplaceFileTest, ALeftoverOrALinkAtTheTemporaryIsReplacedNotWrittenThrough) {
  const std::string path = dir_.path() + "/latest";
  const std::string victim = dir_.path() + "/victim";
  ASSERT_TRUE(ReplaceFile(victim, "untouched").ok());
  ASSERT_EQ(0, symlink(victim.c_str(), (path + ".tmp").c_str()));
  ASSERT_TRUE(ReplaceFile(path, "step-2\n").ok());
  EXPECT_EQ("step-2\n", ReadSmallFile(path, 64).value());
  EXPECT_EQ("untouched", ReadSmallFile(victim, 64).value());
  struct stat st {};
  ASSERT_EQ(0, lstat(path.c_str(), &st));
  EXPECT_TRUE(S_ISREG(st.st_mode));
  // A leftover temporary from a crash (longer than the new contents) is not reused.
  ASSERT_TRUE(ReplaceFile(path + ".tmp", "a leftover from a crash, longer").ok());
  ASSERT_TRUE(ReplaceFile(path, "step-3\n").ok());
  EXPECT_EQ("step-3\n", ReadSmallFile(path, 64).value());
  EXPECT_EQ((std::vector<std::string>{"latest", "victim"}), List(dir_.path()));
}

}  // namespace
}  // namespace zinf
