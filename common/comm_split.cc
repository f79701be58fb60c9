// The communicator seam's sub-groups (zinf/comm.h): Split's default, and which ranks a split
// puts together, which every implementation's Split uses so that they agree.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "zinf/comm.h"

namespace zinf {

Result<std::unique_ptr<Communicator>> Communicator::Split(int /*color*/, Stream* /*stream*/) {
  return Status::NotSupported(
      "this communicator cannot split into sub-groups (LocalComm, GlooComm and NcclComm can)");
}

Result<std::vector<int>> SplitMembers(const std::vector<int32_t>& colors, int rank,
                                      const std::string& who) {
  for (size_t r = 0; r < colors.size(); ++r) {
    if (colors[r] < 0) {
      return Status::InvalidArgument(who + ": Split: rank " + std::to_string(r) + " gave color " +
                                     std::to_string(colors[r]) +
                                     "; a sub-group's color must be >= 0 on every rank");
    }
  }
  if (rank < 0 || rank >= static_cast<int>(colors.size())) {
    return Status::InvalidArgument(who + ": Split: rank " + std::to_string(rank) +
                                   " is not a rank of a world of " + std::to_string(colors.size()));
  }
  std::vector<int> members;
  for (size_t r = 0; r < colors.size(); ++r) {
    if (colors[r] == colors[rank]) members.push_back(static_cast<int>(r));
  }
  return members;
}

}  // namespace zinf
