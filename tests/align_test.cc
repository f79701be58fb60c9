// include/zinf/align.h: RoundUp for any alignment, IsPowerOfTwo.
#include "zinf/align.h"

#include <gtest/gtest.h>

#include <cstdint>

namespace zinf {
namespace {

static_assert(RoundUp(0, 4096) == 0);
static_assert(RoundUp(1, 4096) == 4096);
static_assert(RoundUp(4096, 4096) == 4096);

TEST(AlignTest, RoundUpToAPowerOfTwo) {
  EXPECT_EQ(0u, RoundUp(0, 64));
  EXPECT_EQ(64u, RoundUp(1, 64));
  EXPECT_EQ(64u, RoundUp(64, 64));
  EXPECT_EQ(128u, RoundUp(65, 64));
  EXPECT_EQ(uint64_t{4} << 20, RoundUp((uint64_t{2} << 20) + 1, uint64_t{2} << 20));
  EXPECT_EQ(7u, RoundUp(7, 1));
}

// Block sizes need not be powers of two (a bench sweeps 1016 KiB; --block-size takes any
// multiple of 4 KiB): the result is still the next multiple, not a masked value.
TEST(AlignTest, RoundUpToAnyAlignment) {
  const uint64_t block = uint64_t{1016} << 10;
  EXPECT_EQ(block, RoundUp(1, block));
  EXPECT_EQ(block, RoundUp(block, block));
  EXPECT_EQ(2 * block, RoundUp(block + 1, block));
  EXPECT_EQ(12288u, RoundUp(8193, 12288));
  EXPECT_EQ(24576u, RoundUp(12289, 12288));
  EXPECT_EQ(9u, RoundUp(7, 3));
  for (uint64_t align : {uint64_t{3}, uint64_t{4096}, uint64_t{12288}, block}) {
    for (uint64_t n : {uint64_t{0}, uint64_t{1}, align - 1, align, align + 1, 5 * align + 3}) {
      const uint64_t r = RoundUp(n, align);
      EXPECT_EQ(0u, r % align) << n << " to " << align;
      EXPECT_LE(n, r) << n << " to " << align;
      EXPECT_LT(r - n, align) << n << " to " << align;
    }
  }
}

TEST(AlignTest, RoundUpNearTheTopDoesNotWrapWhenTheResultFits) {
  const uint64_t top = UINT64_MAX - 4095;  // a multiple of 4096
  EXPECT_EQ(top, RoundUp(top - 1, 4096));
  EXPECT_EQ(top, RoundUp(top, 4096));
  EXPECT_EQ(UINT64_MAX, RoundUp(UINT64_MAX, 1));
}

TEST(AlignDeathTest, RoundUpToZeroIsAProgrammerError) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  volatile uint64_t zero = 0;
  EXPECT_DEATH((void)RoundUp(5, zero), "RoundUp to a multiple of 0");
}

TEST(AlignTest, IsPowerOfTwo) {
  EXPECT_FALSE(IsPowerOfTwo(0));
  EXPECT_TRUE(IsPowerOfTwo(1));
  EXPECT_TRUE(IsPowerOfTwo(64));
  EXPECT_TRUE(IsPowerOfTwo(uint64_t{1} << 63));
  EXPECT_FALSE(IsPowerOfTwo(96));
  EXPECT_FALSE(IsPowerOfTwo(uint64_t{1016} << 10));
  EXPECT_FALSE(IsPowerOfTwo(UINT64_MAX));
}

}  // namespace
}  // namespace zinf
