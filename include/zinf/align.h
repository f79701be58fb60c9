// Alignment arithmetic: the one RoundUp of the tree (buffer sizes, file extents, O_DIRECT
// lengths, huge-page mappings).
#pragma once

#include <cstdint>

#include "zinf/status.h"

namespace zinf {

// The smallest multiple of `align` that is >= `n`. Any alignment, a power of two or not (a block
// size of 1016 KiB, a tile of 3 vectors): the division form, which the compiler turns into a
// mask when `align` is a known power of two.
// REQUIRES: align > 0, and the result fits in 64 bits (callers bound `n` first, see
// zinf_alloc_aligned).
constexpr uint64_t RoundUp(uint64_t n, uint64_t align) {
  ZINF_CHECK_MSG(align > 0, "RoundUp to a multiple of 0");
  return (n / align + (n % align != 0 ? 1 : 0)) * align;
}

// Whether `n` is a power of two (0 is not).
constexpr bool IsPowerOfTwo(uint64_t n) { return n != 0 && (n & (n - 1)) == 0; }

}  // namespace zinf
