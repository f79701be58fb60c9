#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "tests/test_util.h"
#include "zinf/align.h"
#include "zinf/zinf.h"

namespace {

TEST(CApiSwap, OpenWriteReadWaitClose) {
  zinf::testing::TempDir dir;
  ASSERT_TRUE(dir.ok());
  const char* paths[] = {dir.path().c_str(), dir.path().c_str()};
  zinf_swap_options o;
  zinf_swap_options_init(&o);
  o.paths = paths;
  o.num_paths = 2;
  o.checksums = 1;
  zinf_swap_store* store = nullptr;
  ASSERT_EQ(0, zinf_swap_open(&o, &store)) << zinf_last_error();
  ASSERT_NE(nullptr, store);
  EXPECT_EQ(4096u, zinf_swap_alignment(store));
  const size_t n = 3000001;
  auto* w = static_cast<unsigned char*>(zinf_alloc_aligned(n));
  auto* r = static_cast<unsigned char*>(zinf_alloc_aligned(n));
  ASSERT_NE(nullptr, w);
  zinf::testing::FillRandom(w, n, 5);
  size_t cap = zinf::RoundUp(n, 4096);
  uint64_t t = 0;
  ASSERT_EQ(0, zinf_swap_write(store, "emb", w, n, cap, &t)) << zinf_last_error();
  ASSERT_EQ(0, zinf_swap_wait(store, t)) << zinf_last_error();
  EXPECT_EQ(int64_t(n), zinf_swap_size(store, "emb"));
  ASSERT_EQ(0, zinf_swap_read(store, "emb", r, cap, &t)) << zinf_last_error();
  ASSERT_EQ(0, zinf_swap_wait(store, t)) << zinf_last_error();
  EXPECT_EQ(0, std::memcmp(w, r, n));
  EXPECT_STREQ("", zinf_last_error());

  // Errors: a message in zinf_last_error.
  EXPECT_NE(0, zinf_swap_read(store, "nope", r, cap, &t));
  EXPECT_NE(std::string::npos,
            std::string(zinf_last_error()).find("'nope' is not in the swap store"));
  EXPECT_NE(0, zinf_swap_write(store, "x", w + 1, 10, 4096, &t));
  EXPECT_NE(std::string::npos, std::string(zinf_last_error()).find("not aligned"));
  EXPECT_EQ(-1, zinf_swap_size(store, "nope"));
  EXPECT_NE(0, zinf_swap_write(nullptr, "x", w, 10, 4096, &t));
  EXPECT_EQ(0, zinf_swap_remove(store, "emb"));
  EXPECT_EQ(0, zinf_swap_close(store)) << zinf_last_error();

  zinf_swap_options bad;
  zinf_swap_options_init(&bad);
  EXPECT_NE(0, zinf_swap_open(&bad, &store));
  EXPECT_NE(std::string::npos, std::string(zinf_last_error()).find("no paths"));
  const char* missing[] = {"/nonexistent/zinf"};
  bad.paths = missing;
  bad.num_paths = 1;
  bad.backend = "io_uring";
  EXPECT_NE(0, zinf_swap_open(&bad, &store));
  EXPECT_NE(std::string::npos, std::string(zinf_last_error()).find("does not exist"));
  zinf_free_aligned(w);
  zinf_free_aligned(r);
}

}  // namespace
