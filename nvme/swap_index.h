// A swap store's index: what it holds (each tensor's size, extents and chunk checksums), its
// files, the store's id and folders, and, for a durable commit, the caller's description.
// JSON carrying a checksum of itself (version 2; version 1, written before that, has none and
// no folders, and is still read). Parsing treats the text as hostile: a malformed, missing or
// mistyped field is Corruption naming the file and the field. Pure; private to nvme/.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "nvme/swap_space.h"
#include "zinf/status.h"

namespace zinf {

inline constexpr int kSwapIndexVersion = 2;

struct SwapIndexTensor {
  uint64_t size = 0;
  std::vector<Extent> extents;
  std::vector<uint64_t> checksums;  // per chunk, when the store writes checksums
};

struct SwapIndex {
  int version = kSwapIndexVersion;
  bool has_meta = false;  // a durable commit
  std::string meta;
  uint64_t alignment = 4096;
  uint64_t chunk_size = 0;
  bool checksums = false;
  struct File {
    std::string path;
    uint64_t size = 0;
  };
  std::vector<File> files;
  std::map<std::string, SwapIndexTensor> tensors;
  std::string store;                 // the store's id ("" in version 1)
  std::vector<std::string> folders;  // resolved, in order (empty in version 1)
};

// The index as sealed JSON (version 2).
std::string SerializeSwapIndex(const SwapIndex& index);
// `where` names the file in errors. Checks the seal (required from version 2) and the types;
// the geometry (extent counts, overlaps) is the store's to check against its files.
Result<SwapIndex> ParseSwapIndex(const std::string& text, const std::string& where);

}  // namespace zinf
