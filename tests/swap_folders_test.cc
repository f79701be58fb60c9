// A swap store's folders: a store is reopened only from its own folders in its own order, a
// fresh store never replaces another one unless told to, an index or a mark that was edited is
// refused, and a refusal changes nothing on the disk.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <xxhash.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tests/test_util.h"
#include "zinf/swap.h"

namespace zinf {
namespace {

using testing::AlignedBuffer;
using testing::FillRandom;
using testing::TempDir;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteAll(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

// Every file under `dirs` (lock files aside) by path, with a hash of its bytes.
std::map<std::string, uint64_t> Snapshot(const std::vector<std::string>& dirs) {
  std::map<std::string, uint64_t> out;
  for (const std::string& d : dirs) {
    for (const auto& e : std::filesystem::recursive_directory_iterator(d)) {
      if (!e.is_regular_file() || e.path().extension() == ".lock") continue;
      const std::string bytes = ReadAll(e.path());
      out[e.path()] = XXH3_64bits(bytes.data(), bytes.size());
    }
  }
  return out;
}

class SwapFoldersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dir_.ok());
    for (const char* n : {"x", "y", "z"}) {
      const std::string p = dir_.path() + "/" + n;
      ASSERT_EQ(mkdir(p.c_str(), 0700), 0);
      path_[n] = p;
    }
  }
  SwapStoreOptions Options(std::vector<std::string> names, bool durable = true) {
    SwapStoreOptions o;
    for (const std::string& n : names) o.paths.push_back(path_[n]);
    o.backend = IoBackendKind::kPsync;
    o.chunk_size = 64 << 10;
    o.block_size = 64 << 10;
    o.growth_step = 1 << 20;
    o.durable = durable;
    o.checksums = true;
    return o;
  }
  // A durable store over `names` that committed "step 3" holding tensors a and b.
  void MakeStore(std::vector<std::string> names) {
    auto store = SwapStore::Open(Options(names));
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    for (const char* key : {"a", "b"}) {
      FillRandom(buf_.data(), kSize, key[0]);
      auto t = (*store)->Write(key, buf_.data(), kSize, buf_.size());
      ASSERT_TRUE(t.ok());
      ASSERT_TRUE((*store)->Wait(*t).ok());
    }
    ASSERT_TRUE((*store)->Commit("step 3").ok());
    ASSERT_TRUE((*store)->Close().ok());
  }
  std::vector<std::string> All() { return {path_["x"], path_["y"], path_["z"]}; }

  static constexpr uint64_t kSize = 300000;  // 5 chunks: striped over every folder
  TempDir dir_;
  std::map<std::string, std::string> path_;
  AlignedBuffer buf_{kSize};
};

TEST_F(SwapFoldersTest, ReopenedInTheStoresOrderOnly) {
  MakeStore({"x", "y"});
  const auto before = Snapshot(All());
  SwapStoreOptions o = Options({"y", "x"});
  o.reopen = true;
  auto swapped = SwapStore::Open(o);
  ASSERT_FALSE(swapped.ok());
  EXPECT_EQ(swapped.status().code(), StatusCode::kFailedPrecondition)
      << swapped.status().ToString();
  // It names the order to give.
  const std::string order = path_["x"] + ", " + path_["y"];
  EXPECT_NE(swapped.status().message().find(order), std::string::npos)
      << swapped.status().ToString();
  EXPECT_EQ(SwapStore::ListCommits(o.paths).status().code(), StatusCode::kFailedPrecondition);
  // One folder too few, one too many, another folder in place of one.
  for (std::vector<std::string> names :
       {std::vector<std::string>{"x"}, {"x", "y", "z"}, {"x", "z"}}) {
    SwapStoreOptions bad = Options(names);
    bad.reopen = true;
    auto s = SwapStore::Open(bad);
    ASSERT_FALSE(s.ok()) << names.size();
    EXPECT_EQ(s.status().code(), StatusCode::kFailedPrecondition) << s.status().ToString();
    EXPECT_NE(s.status().message().find(order), std::string::npos) << s.status().ToString();
  }
  EXPECT_EQ(Snapshot(All()), before) << "a refused reopen changed a file";
  // The right order reopens it.
  SwapStoreOptions good = Options({"x", "y"});
  good.reopen = true;
  auto store = SwapStore::Open(good);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ((*store)->committed_meta(), "step 3");
  auto t = (*store)->Read("b", buf_.data(), buf_.size());
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*store)->Wait(*t).ok());
  AlignedBuffer want(kSize);
  FillRandom(want.data(), kSize, 'b');
  EXPECT_EQ(std::memcmp(buf_.data(), want.data(), kSize), 0);
}

TEST_F(SwapFoldersTest, AFreshStoreNeverTakesOverAnotherThroughAnyFolder) {
  MakeStore({"x", "y"});
  const auto before = Snapshot(All());
  // Through its second folder, its first, or both in another order.
  for (std::vector<std::string> names :
       {std::vector<std::string>{"z", "y"}, {"x"}, {"y", "x"}, {"y"}}) {
    auto s = SwapStore::Open(Options(names));
    ASSERT_FALSE(s.ok()) << names[0];
    EXPECT_EQ(s.status().code(), StatusCode::kAlreadyExists) << s.status().ToString();
    // A scratch store (not durable, removed at close) is refused the same way.
    SwapStoreOptions scratch = Options(names, /*durable=*/false);
    scratch.remove_on_close = true;
    EXPECT_EQ(SwapStore::Open(scratch).status().code(), StatusCode::kAlreadyExists);
  }
  EXPECT_EQ(Snapshot(All()), before) << "a refused store changed a file";
  // Told to overwrite, it replaces the store in the folders it is given.
  SwapStoreOptions o = Options({"z", "y"});
  o.overwrite = true;
  {
    auto s = SwapStore::Open(o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    ASSERT_TRUE((*s)->Close().ok());
  }
  // y is the new store's second folder now; x, not given, is untouched.
  const nlohmann::json mark = nlohmann::json::parse(ReadAll(path_["y"] + "/zinf-swap.folder.json"));
  EXPECT_EQ(mark["paths"][0], std::filesystem::canonical(path_["z"]).string());
  EXPECT_EQ(mark["folder"], 1);
  for (const auto& [path, hash] : before) {
    if (path.rfind(path_["x"], 0) == 0) EXPECT_EQ(Snapshot({path_["x"]}).at(path), hash) << path;
  }
}

TEST_F(SwapFoldersTest, ALostIndexIsDamageNotAnEmptyStore) {
  MakeStore({"x", "y"});
  ASSERT_EQ(unlink((path_["x"] + "/zinf-swap.index.json").c_str()), 0);
  const auto before = Snapshot(All());
  SwapStoreOptions o = Options({"x", "y"});
  o.reopen = true;
  auto s = SwapStore::Open(o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kCorruption) << s.status().ToString();
  EXPECT_NE(s.status().message().find("lost its index"), std::string::npos)
      << s.status().ToString();
  EXPECT_EQ(SwapStore::ListCommits(o.paths).status().code(), StatusCode::kCorruption);
  // A fresh store is refused too: the swap files are still there.
  o.reopen = false;
  EXPECT_EQ(SwapStore::Open(o).status().code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(Snapshot(All()), before);
  // Swap files without any mark (an older store, or marks and index both lost).
  ASSERT_EQ(unlink((path_["x"] + "/zinf-swap.folder.json").c_str()), 0);
  ASSERT_EQ(unlink((path_["y"] + "/zinf-swap.folder.json").c_str()), 0);
  o.reopen = true;
  EXPECT_EQ(SwapStore::Open(o).status().code(), StatusCode::kCorruption);
  o.reopen = false;
  EXPECT_EQ(SwapStore::Open(o).status().code(), StatusCode::kAlreadyExists);
  // Folders that hold nothing: NotFound.
  SwapStoreOptions empty = Options({"z"});
  empty.reopen = true;
  EXPECT_EQ(SwapStore::Open(empty).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(SwapStore::ListCommits(empty.paths).status().code(), StatusCode::kNotFound);
}

TEST_F(SwapFoldersTest, AnEditedIndexOrMarkIsRefused) {
  MakeStore({"x", "y"});
  const std::string index = path_["x"] + "/zinf-swap.index.json";
  const std::string original = ReadAll(index);
  // One digit of the commit record changed ("step 3" -> "step 4"), then one digit of a size.
  for (auto edit :
       {std::make_pair(std::string("step 3"), std::string("step 4")),
        std::make_pair(std::string("\"size\":300000"), std::string("\"size\":300001"))}) {
    std::string text = original;
    const size_t at = text.find(edit.first);
    ASSERT_NE(at, std::string::npos) << edit.first;
    text.replace(at, edit.first.size(), edit.second);
    WriteAll(index, text);
    SwapStoreOptions o = Options({"x", "y"});
    o.reopen = true;
    auto s = SwapStore::Open(o);
    ASSERT_FALSE(s.ok()) << edit.second;
    EXPECT_EQ(s.status().code(), StatusCode::kCorruption) << s.status().ToString();
    EXPECT_NE(s.status().message().find("does not match its own checksum"), std::string::npos)
        << s.status().ToString();
    EXPECT_EQ(SwapStore::ListCommits(o.paths).status().code(), StatusCode::kCorruption);
  }
  WriteAll(index, original);
  // A mark edited to claim another position.
  const std::string mark = path_["y"] + "/zinf-swap.folder.json";
  const std::string mark_text = ReadAll(mark);
  std::string edited = mark_text;
  const size_t at = edited.find("\"folder\": 1");
  ASSERT_NE(at, std::string::npos) << edited;
  edited.replace(at, 11, "\"folder\": 0");
  WriteAll(mark, edited);
  SwapStoreOptions o = Options({"x", "y"});
  o.reopen = true;
  auto s = SwapStore::Open(o);
  EXPECT_EQ(s.status().code(), StatusCode::kCorruption) << s.status().ToString();
  // A lost mark is rewritten when the folder is where the index says.
  ASSERT_EQ(unlink(mark.c_str()), 0);
  {
    auto store = SwapStore::Open(o);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
  }
  EXPECT_TRUE(std::filesystem::exists(mark));
  auto again = SwapStore::Open(o);
  EXPECT_TRUE(again.ok()) << again.status().ToString();
}

TEST_F(SwapFoldersTest, AnIndexFromBeforeChecksumsStillReopens) {
  MakeStore({"x"});
  // What the previous build wrote: version 1, no checksum, no store id, no folders.
  const std::string index = path_["x"] + "/zinf-swap.index.json";
  nlohmann::json j = nlohmann::json::parse(ReadAll(index));
  j["version"] = 1;
  for (const char* k : {"xxh3", "store", "folders"}) j.erase(k);
  WriteAll(index, j.dump());
  ASSERT_EQ(unlink((path_["x"] + "/zinf-swap.folder.json").c_str()), 0);
  SwapStoreOptions o = Options({"x"});
  o.reopen = true;
  auto store = SwapStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ((*store)->committed_meta(), "step 3");
  ASSERT_TRUE((*store)->Commit("step 4").ok());
  ASSERT_TRUE((*store)->Close().ok());
  // The next commit wrote a sealed index and the folder got its mark.
  nlohmann::json now = nlohmann::json::parse(ReadAll(index));
  EXPECT_EQ(now["version"], 2);
  EXPECT_TRUE(now.contains("xxh3"));
  EXPECT_TRUE(std::filesystem::exists(path_["x"] + "/zinf-swap.folder.json"));
}

TEST_F(SwapFoldersTest, AStoreThatNeverCommittedIsReplacedFreely) {
  {
    auto store = SwapStore::Open(Options({"x", "y"}));
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    ASSERT_TRUE((*store)->Close().ok());  // durable: no commit
  }
  auto listed = SwapStore::ListCommits(Options({"x", "y"}).paths);
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  EXPECT_TRUE(listed->empty());
  auto fresh = SwapStore::Open(Options({"x", "y"}));
  EXPECT_TRUE(fresh.ok()) << fresh.status().ToString();
}

TEST_F(SwapFoldersTest, AScratchStoreLeavesNoFileEvenWhileOpen) {
  SwapStoreOptions o = Options({"x", "y"}, /*durable=*/false);
  o.remove_on_close = true;
  auto store = SwapStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  FillRandom(buf_.data(), kSize, 1);
  auto t = (*store)->Write("a", buf_.data(), kSize, buf_.size());
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*store)->Wait(*t).ok());
  // Unlinked once open: a kill -9 now would leave nothing for the next run to trip on.
  for (const std::string& n : {"x", "y"}) {
    for (const auto& e : std::filesystem::directory_iterator(path_[n])) {
      EXPECT_EQ(e.path().extension(), ".lock") << e.path();
    }
  }
  std::memset(buf_.data(), 0, kSize);
  t = (*store)->Read("a", buf_.data(), buf_.size());
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*store)->Wait(*t).ok());
  AlignedBuffer want(kSize);
  FillRandom(want.data(), kSize, 1);
  EXPECT_EQ(std::memcmp(buf_.data(), want.data(), kSize), 0);
}

}  // namespace
}  // namespace zinf
