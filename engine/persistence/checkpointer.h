// Checkpoints: every rank writes its sub-groups' states (with an xxh3 checksum per tensor
// slice) and a manifest into a staging folder; rank 0 commits it under its step's name, points
// `latest` at it and prunes older ones. A load validates a checkpoint in full (layout and
// every checksum) before anything changes, falling back to an older one when asked.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "common/folder_lock.h"
#include "engine/core/host_collectives.h"
#include "engine/core/host_memory.h"
#include "engine/core/layout.h"
#include "engine/core/state_store.h"
#include "formats/checkpoint_format.h"
#include "zinf/config.h"

namespace zinf {

class Checkpointer;

// A checkpoint chosen and validated in full on every rank (its layout and every checksum):
// nothing has changed yet. Its sub-groups are read one at a time for installing, each
// verified again in the same read.
class CheckpointReader {
 public:
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  const RankManifest& manifest() const { return man_; }
  // Sub-group gi's [master | state 1 | state 2] in this engine's state dtype: read once,
  // verified against the manifest's checksums, then converted when stored in another dtype.
  // Valid until the next call.
  Result<const void*> ReadGroup(size_t gi);

 private:
  friend class Checkpointer;
  CheckpointReader(const Checkpointer* owner, size_t buf_bytes) : owner_(owner), buf_(buf_bytes) {}
  // A checkpoint saved by another number of ranks: every saving rank's manifest and states
  // file; ReadGroup assembles this rank's slices from the parts that overlap them.
  struct Saved {
    RankManifest man;
    int fd = -1;
    std::string path;
  };
  Status ReadResharded(size_t gi, void* buf);

  const Checkpointer* const owner_;
  RankManifest man_;          // this rank's (synthesized for this layout when resharding)
  std::vector<Saved> saved_;  // non-empty when resharding
  int fd_ = -1;
  std::string states_path_;
  StateType file_type_ = StateType::kF32;
  AlignedBuffer buf_;                       // one sub-group as stored
  std::optional<AlignedBuffer> converted_;  // and converted to this engine's dtype
};

class Checkpointer {
 public:
  // `validated` (tests, EngineHooks::checkpoint_validated): called with the folder of a
  // checkpoint once it has validated, before anything is read for installing.
  Checkpointer(const Layout* layout, const EngineConfig* config, HostCollectives* collectives,
               int rank, int world, std::function<void(const std::string&)> validated = nullptr)
      : layout_(layout),
        config_(config),
        collectives_(collectives),
        rank_(rank),
        world_(world),
        validated_(std::move(validated)) {}

  // Rank 0 creates and locks `dir`; every rank learns the result. A collective.
  Status Prepare(const std::string& dir);
  // Rank 0: whether this engine holds `dir`'s lock exclusively (Prepare or Save took it).
  bool HoldsLock(const std::string& dir) const {
    auto it = locks_.find(dir);
    return it != locks_.end() && it->second != nullptr && it->second->exclusive();
  }
  // Writes the states of every sub-group of `states` as step `step` (with `loss_scale`, an
  // fp16 engine's scaler). A collective; the optimizer must be idle.
  // Frozen parameters are recorded by `hashes` (ParamStore::value_hashes), not written.
  Status Save(const std::string& dir, const std::string& user_data, int64_t step,
              const std::optional<CheckpointLossScale>& loss_scale, StateStore* states,
              const std::vector<uint64_t>& hashes);
  // Finds the checkpoint to load (the newest, or with `fall_back_to_older` the newest readable
  // one) and validates it in full. A collective; nothing changes.
  // A checkpoint whose frozen tensors were other values than `hashes` (this engine's) is
  // refused, naming the first.
  Result<std::unique_ptr<CheckpointReader>> Open(const std::string& dir, bool fall_back_to_older,
                                                 const std::vector<uint64_t>& hashes);

 private:
  friend class CheckpointReader;
  // Rank 0: locks `dir` (with `create`: creates it 0700 and checks it is writable first).
  Status LockDir(const std::string& dir, bool create);
  // Save, rank 0: `dir` created and locked (LockDir), `incoming` in it an empty new folder.
  Status PrepareStaging(const std::string& dir, const std::string& incoming);
  // Save, every rank: its states file (each sub-group of `states`, or a frozen one's value
  // hashes) and its manifest in `incoming`; fills *man's tensors, sub-groups and size.
  Status WriteRankFiles(const std::string& incoming, StateStore* states,
                        const std::vector<uint64_t>& hashes, RankManifest* man) const;
  // Sub-group gi's [master | state 1 | state 2] with its states stored as `from` (src) into
  // this engine's state dtype (dst, GroupStateBytes(gi) bytes).
  Status ConvertGroupStates(size_t gi, StateType from, const void* src, void* dst) const;
  // Reads sub-group gi's [master | state 1 | state 2] (stored as `file_type`) from the states
  // file into `buf` and verifies every slice against the manifest's checksums.
  Status ReadGroup(int fd, size_t gi, StateType file_type, const RankManifest& man,
                   const std::string& states_path, void* buf) const;
  // Pass 1 of a load: parse, match the layout and verify every checksum of `folder`; nothing
  // changes. Leaves the manifest in *man and the open states file in *fd.
  Status Validate(const std::string& folder, RankManifest* man, int* fd, std::string* states_path,
                  AlignedBuffer* buf);
  // The same for a checkpoint saved by `saved_world` ranks (not this engine's world): every
  // saving rank's manifest must describe this model, every slice this rank takes from them is
  // verified; fills reader->saved_ and synthesizes reader->man_ for this rank's layout.
  Status ValidateResharded(const std::string& folder, int saved_world, CheckpointReader* reader);
  // ValidateResharded's steps. Saved rank q's manifest, checked against rank 0's and this
  // model, with its states file opened, appended to reader->saved_ (`where` names the load).
  Status AddSavedRank(const std::string& folder, int saved_world, int q, const std::string& where,
                      CheckpointReader* reader) const;
  // Manifest `m` (of `man_path`)'s tensors against this model's: names, sizes, sub-groups,
  // frozen values, and parts cut as `saved_world` ranks cut them.
  Status CheckSavedTensors(const RankManifest& m, const std::string& man_path, int saved_world,
                           const std::string& where) const;
  // reader->man_: this rank's manifest as if it had saved it in this layout.
  void SynthesizeManifest(CheckpointReader* reader) const;
  // Reads and verifies every saved slice that this rank's parts of the tensors overlap.
  Status VerifySlicesTaken(const CheckpointReader& reader) const;
  // Reads state k (0: master) of tensor i of a saved rank's slice and verifies it against its
  // checksum, in bounded chunks; bytes [copy_from, copy_from + copy_bytes) of the slice go to
  // `dst` (null: verify only).
  Status ReadSavedSlice(const CheckpointReader::Saved& saved, size_t i, int k, StateType type,
                        uint64_t copy_from, uint64_t copy_bytes, char* dst) const;

  // Tensor `id` of a checkpoint against this engine's parameter: trainable in both, or frozen
  // in both with the same value; otherwise what differs (empty when they match).
  std::string FrozenMismatch(const CheckpointTensor& t, ParamId id) const;
  // What to add to a frozen mismatch when `man` has no frozen tensor but this engine has some
  // (a checkpoint from before frozen parameters were kept apart); empty otherwise.
  std::string OldFormatHint(const RankManifest& man) const;

  const Layout* const layout_;
  const EngineConfig* const config_;
  HostCollectives* const collectives_;
  const std::vector<uint64_t>* hashes_ = nullptr;  // Open's, while it runs
  const int rank_;
  const int world_;
  const std::function<void(const std::string&)> validated_;  // EngineHooks::checkpoint_validated
  // Checkpoint folders this engine saved to or loaded from, locked for its lifetime (rank 0).
  std::map<std::string, std::unique_ptr<FolderLock>> locks_;
};

}  // namespace zinf
