// The checkpoint manifest of one rank (rank<r>.json beside rank<r>.states): what the states
// file holds and a checksum per tensor. Parsing treats the text as hostile: any malformed,
// missing or out-of-range field is an error naming it, never a crash.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "zinf/status.h"

namespace zinf {

// 2: the manifest carries its own checksum ("xxh3" of its compact form without that field).
// 3: "state_dtype", how the optimizer states are stored (bf16, int8). Checkpoints of fp32
// states are written as version 2 (no such field), which older builds read too.
// Version 2: fp32 states; 3: compressed states; 4: frozen tensors (recorded by value hash).
inline constexpr int kCheckpointFormatVersion = 4;

struct CheckpointTensor {
  std::string name;
  uint64_t numel = 0;            // full tensor
  uint64_t partition_numel = 0;  // this rank's part
  uint64_t sub_group = 0;
  uint64_t slice_offset = 0;     // elements, inside the sub-group's state arrays
  uint64_t hash[3] = {0, 0, 0};  // xxh3-64 of the master, state 1 and state 2 slices (bytes)
  // Optimizer updates applied to the tensor (torch's state["step"]); -1 when the manifest
  // predates per-tensor counts (every tensor then has the checkpoint's step).
  int64_t updates = -1;
  // A frozen tensor (ParamSpec::trainable false): no states in the file (no slice, no
  // checksums); its value is recorded by `value_hash`, xxh3-64 of the whole fp32 tensor.
  bool frozen = false;
  uint64_t value_hash = 0;
};

struct CheckpointGroup {
  uint64_t numel = 0;   // elements per state array
  uint64_t offset = 0;  // bytes into the states file of [master | state 1 | state 2]
};

// fp16: the loss scaler's state at the checkpoint's step (engine/core/loss_scaler.h's
// LossScaler::State), the same on every rank.
struct CheckpointLossScale {
  double scale = 1;
  uint64_t iteration = 0;
  int64_t last_overflow = -1;
  int64_t hysteresis_left = 1;
  uint64_t skipped_steps = 0;
};

struct RankManifest {
  int rank = 0;
  int world = 1;
  int64_t step = 0;
  std::string optimizer;             // type name
  std::string state_dtype = "fp32";  // StateTypeName of the optimizer states
  std::string states_file;           // file name inside the checkpoint folder
  uint64_t file_bytes = 0;
  std::vector<CheckpointGroup> groups;
  std::vector<CheckpointTensor> tensors;
  std::string user_data;                          // the trainer's own JSON (model shape, seed, ...)
  std::optional<CheckpointLossScale> loss_scale;  // saved by an fp16 engine
};

// 16 lowercase hex digits (the form checksums take in manifests and messages).
std::string HashHex(uint64_t v);
// Its inverse: InvalidArgument unless `text` is 16 lowercase hex digits.
Result<uint64_t> ParseHashHex(const std::string& text);

// May throw nlohmann::json::type_error for strings that are not valid UTF-8: callers check
// names and user data first (IsValidUtf8).
std::string SerializeRankManifest(const RankManifest& m);
// `where` prefixes errors (the file name). Checks internal consistency too: groups inside the
// file, tensors inside their group, sizes that do not overflow.
Result<RankManifest> ParseRankManifest(const std::string& text, const std::string& where);

}  // namespace zinf
