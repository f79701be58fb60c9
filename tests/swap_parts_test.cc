// The swap store's parts on their own: the space on its files (stripe geometry, allocation,
// growth and its limit, reopen's reservation), the index (a round trip, its own checksum, the
// older version), the ticket table (parts, first error, busy time) and the hash worker (read
// checks ahead of write hashes).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <future>
#include <mutex>
#include <string>
#include <vector>

#include "nvme/swap_index.h"
#include "nvme/swap_space.h"
#include "nvme/swap_tickets.h"
#include "tests/test_util.h"

namespace zinf {
namespace {

using testing::TempDir;

class SwapSpaceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dir_.ok());
    for (int i = 0; i < 3; ++i) {
      const std::string path = dir_.path() + "/f" + std::to_string(i);
      const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
      ASSERT_GE(fd, 0);
      files_.push_back({fd, path});
    }
  }
  void TearDown() override {
    for (const IoFile& f : files_) close(f.fd);
  }
  SwapSpaceOptions Options() const {
    SwapSpaceOptions o;
    o.chunk_size = 64 << 10;
    o.alignment = 4096;
    o.growth_step = 1 << 20;
    o.reserve_bytes = 0;
    return o;
  }
  TempDir dir_;
  std::vector<IoFile> files_;
};

TEST_F(SwapSpaceTest, ChunksStripeOverTheFilesOneExtentEach) {
  SwapSpace space(Options(), files_, {0, 0, 0});
  const uint64_t chunk = 64 << 10;
  // 7 chunks over 3 files: 3 + 2 + 2, the last chunk short.
  const uint64_t padded = 6 * chunk + 8192;
  EXPECT_EQ(space.NumChunks(padded), 7u);
  EXPECT_EQ(space.ExtentCount(padded), 3u);
  EXPECT_EQ(space.ExtentBytes(padded, 0), 2 * chunk + 8192);  // chunks 0, 3, 6
  EXPECT_EQ(space.ExtentBytes(padded, 1), 2 * chunk);         // chunks 1, 4
  EXPECT_EQ(space.ExtentBytes(padded, 2), 2 * chunk);         // chunks 2, 5
  EXPECT_EQ(space.ExtentCount(4096), 1u);
  EXPECT_EQ(space.ExtentBytes(4096, 1), 0u);
  Result<std::vector<Extent>> ext = space.Allocate(padded, "t");
  ASSERT_TRUE(ext.ok()) << ext.status().ToString();
  ASSERT_EQ(ext->size(), 3u);
  char* buf = reinterpret_cast<char*>(0x100000);
  const Transfer t6 = space.ChunkTransfer(*ext, padded, 6, IoOp::kWrite, buf);
  EXPECT_EQ(t6.file, 0u);
  EXPECT_EQ(t6.offset, (*ext)[0].offset + 2 * chunk);
  EXPECT_EQ(t6.len, 8192u);
  EXPECT_EQ(static_cast<char*>(t6.buf), buf + 6 * chunk);
  const Transfer t4 = space.ChunkTransfer(*ext, padded, 4, IoOp::kRead, buf);
  EXPECT_EQ(t4.file, 1u);
  EXPECT_EQ(t4.offset, (*ext)[1].offset + chunk);
  EXPECT_EQ(space.allocated_bytes(), padded);
  // The files grew by what the tensor needed, at least 1 MiB each.
  EXPECT_GE(space.file_size(0), 1u << 20);
  for (const Extent& x : *ext) space.Free(x);
  EXPECT_EQ(space.allocated_bytes(), 0u);
}

TEST_F(SwapSpaceTest, TheCapacityLimitRefusesNamingTheTensorAndKeepsNothing) {
  SwapSpaceOptions o = Options();
  o.max_capacity_per_path = 1 << 20;
  SwapSpace space(o, files_, {0, 0, 0});
  ASSERT_TRUE(space.Allocate(2 << 20, "fits").ok());  // 2 MiB over 3 files: under 1 MiB each
  Result<std::vector<Extent>> big = space.Allocate(3 << 20, "too big");
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(big.status().message().find("'too big'"), std::string::npos) << big.status().ToString();
  EXPECT_EQ(space.allocated_bytes(), 2u << 20) << "a failed allocation kept extents";
}

TEST_F(SwapSpaceTest, ReopenReservesExactlyTheIndexedExtents) {
  SwapSpace space(Options(), files_, {1 << 20, 1 << 20, 1 << 20});
  space.FreeAll();
  EXPECT_TRUE(space.Reserve({0, 0, 65536}));
  EXPECT_TRUE(space.Reserve({1, 65536, 4096}));
  EXPECT_FALSE(space.Reserve({0, 4096, 4096})) << "overlaps the first";
  EXPECT_FALSE(space.Reserve({1, (1 << 20) - 4096, 8192})) << "past the end of its file";
  EXPECT_FALSE(space.Reserve({7, 0, 4096})) << "no such file";
  EXPECT_EQ(space.allocated_bytes(), 65536u + 4096u);
  EXPECT_EQ(space.file_bytes(), 3u << 20);
}

TEST(SwapIndexTest, RoundTripAndItsOwnChecksum) {
  SwapIndex index;
  index.has_meta = true;
  index.meta = "{\"step\": 3}";
  index.chunk_size = 65536;
  index.checksums = true;
  index.files = {{"/x/zinf-swap-0.bin", 1 << 20}, {"/y/zinf-swap-1.bin", 2 << 20}};
  index.tensors["a"] = {300000, {{0, 0, 196608}, {1, 4096, 131072}}, {1, 2, 3, 4, 5}};
  index.tensors["empty"] = {0, {}, {}};
  index.store = "0123456789abcdef";
  index.folders = {"/x", "/y"};
  const std::string text = SerializeSwapIndex(index);
  Result<SwapIndex> back = ParseSwapIndex(text, "i.json");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->version, kSwapIndexVersion);
  EXPECT_EQ(back->meta, index.meta);
  EXPECT_EQ(back->files.size(), 2u);
  EXPECT_EQ(back->files[1].size, 2u << 20);
  ASSERT_EQ(back->tensors.count("a"), 1u);
  EXPECT_EQ(back->tensors.at("a").extents[1].offset, 4096u);
  EXPECT_EQ(back->tensors.at("a").checksums, (std::vector<uint64_t>{1, 2, 3, 4, 5}));
  EXPECT_EQ(back->store, index.store);
  EXPECT_EQ(back->folders, index.folders);
  // One digit changed anywhere: refused by the seal, naming the file.
  std::string edited = text;
  edited[edited.find("300000")] = '4';
  Result<SwapIndex> bad = ParseSwapIndex(edited, "i.json");
  EXPECT_EQ(bad.status().code(), StatusCode::kCorruption);
  EXPECT_NE(bad.status().message().find("i.json"), std::string::npos);
  // Hostile text: not JSON, no version, an unknown version, a mistyped field.
  EXPECT_EQ(ParseSwapIndex("{", "x").status().code(), StatusCode::kCorruption);
  EXPECT_EQ(ParseSwapIndex("{}", "x").status().code(), StatusCode::kCorruption);
  EXPECT_EQ(ParseSwapIndex(R"({"version": 9})", "x").status().code(), StatusCode::kCorruption);
  Result<SwapIndex> typed = ParseSwapIndex(
      R"({"version": 1, "alignment": "x", "chunk_size": 1, "checksums": false, "files": [],)"
      R"( "tensors": {}})",
      "x");
  EXPECT_EQ(typed.status().code(), StatusCode::kCorruption);
  EXPECT_NE(typed.status().message().find("mistyped"), std::string::npos);
  // Version 1 (before the seal): read without one, and without folders.
  Result<SwapIndex> v1 =
      ParseSwapIndex(R"({"version": 1, "alignment": 4096, "chunk_size": 65536, "checksums": false,)"
                     R"( "files": [{"path": "/x/zinf-swap-0.bin", "size": 0}], "tensors": {}})",
                     "x");
  ASSERT_TRUE(v1.ok()) << v1.status().ToString();
  EXPECT_TRUE(v1->store.empty());
  EXPECT_TRUE(v1->folders.empty());
}

TEST(TicketTableTest, ATicketEndsWithItsLastPartAndKeepsTheFirstError) {
  TicketTable t;
  const Ticket a = t.Open(3), b = t.Open(1);
  EXPECT_NE(a, b);
  EXPECT_EQ(t.in_flight(), 2);
  EXPECT_FALSE(t.PartDone(a, Status::OK()));
  EXPECT_FALSE(t.PartDone(a, Status::IoError("first")));
  EXPECT_FALSE(t.Ended(a));
  EXPECT_TRUE(t.PartDone(a, Status::Corruption("second")));
  EXPECT_TRUE(t.Ended(a));
  EXPECT_EQ(t.in_flight(), 1);
  Status s = t.Take(a);
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_EQ(s.message(), "first");
  EXPECT_FALSE(t.Known(a));
  EXPECT_EQ(t.Take(a).code(), StatusCode::kInvalidArgument) << "taken twice";
  EXPECT_TRUE(t.PartDone(b, Status::OK()));
  EXPECT_TRUE(t.Take(b).ok());
  EXPECT_EQ(t.in_flight(), 0);
  EXPECT_GE(t.busy_seconds(), 0.0);
}

TEST(HashWorkerTest, ReadChecksGoAheadOfWriteHashes) {
  HashWorker worker;
  std::promise<void> gate;
  std::shared_future<void> open = gate.get_future().share();
  std::promise<void> started;
  std::vector<char> order;
  std::mutex order_mu;
  std::promise<void> done;
  // The first task blocks the worker; meanwhile a write hash and a read check queue up.
  worker.Post(
      [&] {
        started.set_value();
        open.wait();
      },
      /*read_check=*/false);
  started.get_future().wait();
  worker.Post(
      [&] {
        std::lock_guard<std::mutex> lock(order_mu);
        order.push_back('w');
        done.set_value();
      },
      /*read_check=*/false);
  worker.Post(
      [&] {
        std::lock_guard<std::mutex> lock(order_mu);
        order.push_back('r');
      },
      /*read_check=*/true);
  gate.set_value();
  done.get_future().wait();
  std::lock_guard<std::mutex> lock(order_mu);
  EXPECT_EQ(order, (std::vector<char>{'r', 'w'}));
}

}  // namespace
}  // namespace zinf
