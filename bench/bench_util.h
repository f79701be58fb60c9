// What the benchmark programs share: the median of a sample set (the figure every bench
// reports, over repeats or steps) and byte sizes parsed as the configuration parses them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "zinf/config.h"
#include "zinf/status.h"

namespace zinf::bench {

// The median (the mean of the two middle values for an even count); 0 for no samples.
inline double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// A positive byte size ("4G", "1016K", "1048576"; powers of 1024), as ParseByteSize reads the
// configuration's; `flag` names it in errors.
inline Result<uint64_t> ParsePositiveSize(const std::string& text, const std::string& flag) {
  ZINF_ASSIGN_OR_RETURN(uint64_t n, ParseByteSize(text, flag));
  if (n == 0) return Status::InvalidArgument(flag + ": the size must be positive");
  return n;
}

}  // namespace zinf::bench
