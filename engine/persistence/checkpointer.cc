#include "engine/persistence/checkpointer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <vector>

#include "common/file_io.h"
#include "common/utf8.h"
#include "engine/persistence/checkpoint_folder.h"
#include "zinf/crash_point.h"
#include "zinf/log.h"

namespace zinf {

namespace {

// Whether `folder` holds a checkpoint whose rank-0 manifest reads back intact and whose
// states file has the size it lists (for pruning: the newest such one before the new
// checkpoint is kept; the tensors' checksums are the load's business).
bool ReadableCheckpoint(const std::string& folder) {
  Result<std::string> text = ReadSmallFile(folder + "/rank0.json", 1 << 30);
  if (!text.ok()) return false;
  Result<RankManifest> man = ParseRankManifest(*text, folder + "/rank0.json");
  struct stat st {};
  return man.ok() && stat((folder + "/" + man->states_file).c_str(), &st) == 0 &&
         S_ISREG(st.st_mode) && static_cast<uint64_t>(st.st_size) == man->file_bytes;
}

// The number of ranks that saved the checkpoint in `folder` (its rank0.json), or 0 when that
// cannot be read (Validate then says why).
int SavedWorld(const std::string& folder) {
  Result<std::string> text = ReadSmallFile(folder + "/rank0.json", 1 << 30);
  if (!text.ok()) return 0;
  Result<RankManifest> man = ParseRankManifest(*text, folder + "/rank0.json");
  return man.ok() ? man->world : 0;
}

std::string JoinList(const std::vector<std::string>& items) {
  std::string list;
  for (const std::string& t : items) list += (list.empty() ? "" : "; ") + t;
  return list;
}

// Records sub-group gi's tensors in *man when it is frozen: data, not state, recorded by each
// value's hash in `hashes`.
void RecordFrozenTensors(const Layout& layout, size_t gi, const std::vector<uint64_t>& hashes,
                         RankManifest* man) {
  for (ParamId id : layout.group(gi).params) {
    CheckpointTensor& t = man->tensors[id];
    const ParamLayout& p = layout.param(id);
    t.name = p.info.name;
    t.numel = p.info.numel;
    t.partition_numel = p.info.partition_numel;
    t.sub_group = gi;
    t.frozen = true;
    t.value_hash = hashes[id];
    t.updates = 0;  // never stepped
  }
}

// Records trainable sub-group gi's tensors in *man: where each slice lies, its update count in
// `states`, and the checksums of its master and states in `group_states` (the sub-group's).
void RecordTrainableTensors(const Layout& layout, size_t gi, const StateStore& states,
                            const void* group_states, RankManifest* man) {
  const char* f = static_cast<const char*>(group_states);
  for (ParamId id : layout.group(gi).params) {
    const ParamLayout& p = layout.param(id);
    CheckpointTensor& t = man->tensors[id];
    t.name = p.info.name;
    t.numel = p.info.numel;
    t.partition_numel = p.info.partition_numel;
    t.sub_group = gi;
    t.slice_offset = p.slice_offset;
    t.updates = states.updates(id);
    for (int k = 0; k < 3; ++k) {
      t.hash[k] = XXH3_64bits(f + layout.SliceOffsetIn(id, k), layout.SliceBytesIn(id, k));
    }
  }
}

// Writes `man` to a new file at `path`, fsync'ed.
Status WriteManifestFile(const std::string& path, const RankManifest& man) {
  const std::string text = SerializeRankManifest(man);  // names and user data are UTF-8
  ZINF_ASSIGN_OR_RETURN(int mfd, CreateExclusive(path));
  Status s = PwriteAll(mfd, text.data(), text.size(), 0, path);
  if (s.ok() && fsync(mfd) != 0) s = ErrnoToStatus(errno, "fsync of " + path);
  close(mfd);
  return s;
}

// Rank 0, once every rank's files are in the staging folder: it gets its final name, then
// `latest` names it; then the checkpoints older than the newest readable one before it go.
Status CommitStaged(const std::string& dir, int64_t step) {
  ZINF_RETURN_IF_ERROR(checkpoint_folder::MarkIncoming(dir));
  ZINF_ASSIGN_OR_RETURN(const std::string name, checkpoint_folder::Commit(dir, step));
  checkpoint_folder::Prune(dir, name, &ReadableCheckpoint);
  return Status::OK();
}

// The FailedPrecondition of a checkpoint (`where` names it) saved from another model.
Status ModelMismatch(const std::string& where, const std::string& what) {
  return Status::FailedPrecondition(where + ": the checkpoint does not match this model: " + what);
}

}  // namespace

Status Checkpointer::LockDir(const std::string& dir, bool create) {
  if (dir.empty() || !IsValidUtf8(dir)) {
    return Status::InvalidArgument("checkpoint folder '" + dir +
                                   "': give a non-empty path in valid UTF-8");
  }
  std::unique_ptr<FolderLock>& lock = locks_[dir];
  if (create) {  // about to write: exclusive
    if (lock != nullptr) ZINF_RETURN_IF_ERROR(lock->MakeExclusive());
    return checkpoint_folder::Prepare(dir, &lock);
  }
  struct stat st {};
  if (lock == nullptr && stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    // Reading: shared with other readers, not with a run writing there.
    ZINF_ASSIGN_OR_RETURN(lock, FolderLock::Acquire(dir, checkpoint_folder::kLockName,
                                                    "checkpoint folder", /*shared=*/true));
  }
  return Status::OK();
}

Status Checkpointer::Prepare(const std::string& dir) {
  Status local;
  if (rank_ == 0) local = LockDir(dir, /*create=*/true);
  return collectives_->Agree(local, "PrepareCheckpointDir");
}

std::string Checkpointer::OldFormatHint(const RankManifest& man) const {
  const bool saved_frozen = std::any_of(man.tensors.begin(), man.tensors.end(),
                                        [](const CheckpointTensor& t) { return t.frozen; });
  if (saved_frozen || layout_->num_frozen() == 0) return "";
  return " (if its frozen parameters were frozen then too: it was saved before zinf kept them "
         "apart, with optimizer states, which this build does not read; load it with the "
         "build that saved it and export the values with save_safetensors)";
}

std::string Checkpointer::FrozenMismatch(const CheckpointTensor& t, ParamId id) const {
  const ParamLayout& p = layout_->param(id);
  if (t.frozen == !p.info.trainable) {
    if (!t.frozen || hashes_ == nullptr || (*hashes_)[id] == t.value_hash) return "";
    return "the frozen tensor '" + p.info.name + "' was saved with other values (value hash " +
           HashHex(t.value_hash) + ", this engine's " + HashHex((*hashes_)[id]) +
           "): a checkpoint records frozen weights by hash, not by value; register them with "
           "the values the run that saved it had (the same base weights)";
  }
  return "tensor '" + p.info.name + "' was " + (t.frozen ? "frozen" : "trainable") +
         " when saved and is " + (t.frozen ? "trainable" : "frozen") +
         " in this engine; register it as it was saved (which parameters train is fixed per "
         "engine), or load its values by name (safetensors) instead";
}

Status Checkpointer::PrepareStaging(const std::string& dir, const std::string& incoming) {
  ZINF_RETURN_IF_ERROR(LockDir(dir, /*create=*/true));
  std::error_code ec;
  std::filesystem::remove_all(incoming, ec);
  if (ec) {
    return Status::IoError("preparing checkpoint folder " + incoming + ": " + ec.message());
  }
  if (mkdir(incoming.c_str(), 0700) != 0) return ErrnoToStatus(errno, "creating " + incoming);
  return Status::OK();
}

Status Checkpointer::WriteRankFiles(const std::string& incoming, StateStore* states,
                                    const std::vector<uint64_t>& hashes, RankManifest* man) const {
  const std::string states_path = incoming + "/" + man->states_file;
  AlignedBuffer buf(layout_->LargestGroupStateBytes());
  if (buf.data == nullptr) return Status::ResourceExhausted("checkpoint staging buffer");
  ZINF_ASSIGN_OR_RETURN(int fd, CreateExclusive(states_path));
  uint64_t offset = 0;
  Status s;
  man->tensors.resize(layout_->num_params());
  for (size_t gi = 0; gi < layout_->num_groups() && s.ok(); ++gi) {
    const GroupLayout& g = layout_->group(gi);
    if (g.frozen) {  // data, not state: recorded by value hash
      RecordFrozenTensors(*layout_, gi, hashes, man);
      man->groups.push_back({0, offset});
      continue;
    }
    s = states->Read(gi, buf.data);
    if (!s.ok()) {
      s = s.WithContext("reading optimizer states of sub-group " + std::to_string(gi));
      break;
    }
    RecordTrainableTensors(*layout_, gi, *states, buf.data, man);
    s = PwriteAll(fd, buf.data, layout_->GroupStateBytes(gi), offset, states_path);
    man->groups.push_back({g.numel, offset});
    offset += layout_->GroupStateBytes(gi);
  }
  if (s.ok() && fsync(fd) != 0) s = ErrnoToStatus(errno, "fsync of " + states_path);
  close(fd);
  ZINF_RETURN_IF_ERROR(s);
  man->file_bytes = offset;
  return WriteManifestFile(incoming + "/rank" + std::to_string(rank_) + ".json", *man);
}

Status Checkpointer::Save(const std::string& dir, const std::string& user_data, int64_t step,
                          const std::optional<CheckpointLossScale>& loss_scale, StateStore* states,
                          const std::vector<uint64_t>& hashes) {
  const std::string incoming = dir + "/" + checkpoint_folder::kIncoming;
  // Rank 0 makes sure of the folder (created 0700, writable, locked) and prepares an empty
  // staging folder.
  Status local;
  if (rank_ == 0) local = PrepareStaging(dir, incoming);
  ZINF_RETURN_IF_ERROR(collectives_->Agree(local, "SaveCheckpoint"));

  // Every rank writes its states file and manifest.
  RankManifest man;
  man.rank = rank_;
  man.world = world_;
  man.step = step;
  man.optimizer = OptimizerTypeName(config_->optimizer.type);
  man.state_dtype = StateTypeName(layout_->state_type());
  man.states_file = "rank" + std::to_string(rank_) + ".states";
  man.user_data = user_data;
  man.loss_scale = loss_scale;
  local = WriteRankFiles(incoming, states, hashes, &man);
  ZINF_RETURN_IF_ERROR(collectives_->Agree(local, "SaveCheckpoint"));
  CrashPoint("checkpoint.files");

  // Rank 0 commits the staging folder and prunes; every rank learns the result.
  if (rank_ == 0) local = CommitStaged(dir, step);
  return collectives_->Agree(local, "SaveCheckpoint");
}

Status Checkpointer::Validate(const std::string& folder, RankManifest* man, int* fd,
                              std::string* states_path, AlignedBuffer* buf) {
  const std::string man_path = folder + "/rank" + std::to_string(rank_) + ".json";
  ZINF_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(man_path, 1 << 30));
  ZINF_ASSIGN_OR_RETURN(*man, ParseRankManifest(text, man_path));
  auto mismatch = [&](const std::string& what) {
    return Status::FailedPrecondition(man_path +
                                      ": the checkpoint does not match this model: " + what);
  };
  if (man->world != world_ || man->rank != rank_) {
    return mismatch("saved by rank " + std::to_string(man->rank) + " of " +
                    std::to_string(man->world) + ", loading as rank " + std::to_string(rank_) +
                    " of " + std::to_string(world_));
  }
  if (man->optimizer != OptimizerTypeName(config_->optimizer.type)) {
    return mismatch("optimizer " + man->optimizer + ", this engine runs " +
                    OptimizerTypeName(config_->optimizer.type));
  }
  // States of another dtype are converted when installed (Load); they are checked here as
  // stored.
  ZINF_ASSIGN_OR_RETURN(const StateType file_type, ParseStateType(man->state_dtype));
  const size_t num_params = layout_->num_params(), num_groups = layout_->num_groups();
  if (man->tensors.size() != num_params) {
    return mismatch(std::to_string(man->tensors.size()) + " tensors, this engine has " +
                    std::to_string(num_params));
  }
  // Names and sizes, and which tensors are frozen, first: they name what differs; the
  // sub-groups follow from them.
  for (size_t i = 0; i < num_params; ++i) {
    const ParamLayout& p = layout_->param(static_cast<ParamId>(i));
    const CheckpointTensor& t = man->tensors[i];
    if (t.name != p.info.name || t.numel != p.info.numel) {
      return mismatch("tensor " + std::to_string(i) + " is '" + t.name + "' with " +
                      std::to_string(t.numel) + " elements, this engine has '" + p.info.name +
                      "' with " + std::to_string(p.info.numel));
    }
    if (std::string why = FrozenMismatch(t, static_cast<ParamId>(i)); !why.empty()) {
      return mismatch(why + OldFormatHint(*man));
    }
  }
  if (man->groups.size() != num_groups) {
    return mismatch(std::to_string(man->groups.size()) + " sub-groups, this engine has " +
                    std::to_string(num_groups) + " (same sub_group_size?)");
  }
  for (size_t i = 0; i < num_params; ++i) {
    const ParamLayout& p = layout_->param(static_cast<ParamId>(i));
    const CheckpointTensor& t = man->tensors[i];
    // A frozen tensor stores nothing here (its value is checked by hash): its part may be cut
    // otherwise (int8 frozen weights on the block grid since issue 38).
    if ((!t.frozen && t.partition_numel != p.info.partition_numel) ||
        t.sub_group != p.info.sub_group || (!t.frozen && t.slice_offset != p.slice_offset)) {
      return mismatch("tensor '" + t.name +
                      "' lies elsewhere in the sub-groups (same "
                      "sub_group_size?)");
    }
  }
  for (size_t gi = 0; gi < num_groups; ++gi) {
    if (man->groups[gi].numel != layout_->group(gi).numel) {
      return mismatch("sub-group " + std::to_string(gi) + " size differs");
    }
  }
  *states_path = folder + "/" + man->states_file;
  uint64_t file_size = 0;
  ZINF_ASSIGN_OR_RETURN(*fd, OpenRegularFile(*states_path, "checkpoint states", &file_size));
  if (file_size != man->file_bytes) {
    return Status::Corruption(*states_path + " has " + std::to_string(file_size) +
                              " bytes, its manifest says " + std::to_string(man->file_bytes) +
                              " (a torn checkpoint)");
  }
  if (buf->data == nullptr) return Status::ResourceExhausted("checkpoint buffer");
  for (size_t gi = 0; gi < num_groups; ++gi) {
    ZINF_RETURN_IF_ERROR(ReadGroup(*fd, gi, file_type, *man, *states_path, buf->data));
  }
  return Status::OK();
}

Status Checkpointer::ReadGroup(int fd, size_t gi, StateType file_type, const RankManifest& man,
                               const std::string& states_path, void* buf) const {
  if (layout_->group(gi).frozen) return Status::OK();  // nothing stored
  ZINF_RETURN_IF_ERROR(PreadAll(fd, buf, layout_->GroupStateBytes(gi, file_type),
                                man.groups[gi].offset, states_path, "a torn checkpoint"));
  const char* f = static_cast<const char*>(buf);
  static const char* const kState[] = {"master weights", "exp_avg", "exp_avg_sq"};
  for (ParamId id : layout_->group(gi).params) {
    const CheckpointTensor& t = man.tensors[id];
    for (int k = 0; k < 3; ++k) {
      if (XXH3_64bits(f + layout_->SliceOffsetIn(id, k, file_type),
                      layout_->SliceBytesIn(id, k, file_type)) != t.hash[k]) {
        return Status::Corruption("checkpoint tensor '" + layout_->param(id).info.name + "' (" +
                                  kState[k] + ") in " + states_path +
                                  " does not match its checksum");
      }
    }
  }
  return Status::OK();
}

Status Checkpointer::ConvertGroupStates(size_t gi, StateType from, const void* src,
                                        void* dst) const {
  const char* in = static_cast<const char*>(src);
  char* out = static_cast<char*>(dst);
  // The masters as they are; regions never stepped (Lion's second, Adagrad's first) are zero
  // in every dtype, as are the gaps between slices.
  std::memset(out, 0, layout_->GroupStateBytes(gi));
  std::memcpy(out, in, layout_->group(gi).numel * sizeof(float));
  for (ParamId id : layout_->group(gi).params) {
    for (int k = 1; k <= 2; ++k) {
      Status s = ConvertOptimizerState(from, in + layout_->SliceOffsetIn(id, k, from),
                                       layout_->state_type(), out + layout_->SliceOffsetIn(id, k),
                                       layout_->param(id).info.partition_numel,
                                       k == 1 ? StateRole::kSigned : StateRole::kNonNegative);
      if (!s.ok()) {
        return s.WithContext("converting the optimizer states of '" + layout_->param(id).info.name +
                             "'");
      }
    }
  }
  return Status::OK();
}

// ---- Loading into another number of ranks ------------------------------------------------
//
// Rank q of W saved elements [q p, (q + 1) p) of each tensor padded to W p elements (p its
// partition_numel then), for the master and each state. A rank of this engine takes its own
// range of the tensor padded for this world from the saved parts that overlap it; padding
// beyond the tensor is zero. fp32 and bf16 states are element-addressable; int8 states are
// stored in blocks of a saved slice and are refused.

Status Checkpointer::AddSavedRank(const std::string& folder, int saved_world, int q,
                                  const std::string& where, CheckpointReader* reader) const {
  CheckpointReader::Saved saved;
  const std::string man_path = folder + "/rank" + std::to_string(q) + ".json";
  ZINF_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(man_path, 1 << 30));
  ZINF_ASSIGN_OR_RETURN(saved.man, ParseRankManifest(text, man_path));
  const RankManifest& m = saved.man;
  if (m.world != saved_world || m.rank != q) {
    return Status::Corruption(man_path + " says rank " + std::to_string(m.rank) + " of " +
                              std::to_string(m.world) + "; rank0.json says " +
                              std::to_string(saved_world) + " ranks");
  }
  if (m.optimizer != OptimizerTypeName(config_->optimizer.type)) {
    return ModelMismatch(where, "optimizer " + m.optimizer + ", this engine runs " +
                                    OptimizerTypeName(config_->optimizer.type));
  }
  ZINF_ASSIGN_OR_RETURN(const StateType type, ParseStateType(m.state_dtype));
  if (type == StateType::kInt8) {
    return Status::NotSupported(
        where +
        ": its optimizer states are int8 (blockwise per saved slice), which cannot be "
        "cut for another number of ranks; load it with " +
        std::to_string(saved_world) + " ranks, or save it from a run with fp32 or bf16 states");
  }
  if (q > 0 && (m.step != reader->saved_[0].man.step ||
                m.state_dtype != reader->saved_[0].man.state_dtype)) {
    return Status::Corruption(man_path + ": step or state dtype differs from rank 0's");
  }
  ZINF_RETURN_IF_ERROR(CheckSavedTensors(m, man_path, saved_world, where));
  saved.path = folder + "/" + m.states_file;
  uint64_t file_size = 0;
  ZINF_ASSIGN_OR_RETURN(saved.fd, OpenRegularFile(saved.path, "checkpoint states", &file_size));
  reader->saved_.push_back(std::move(saved));  // the reader closes its file from here on
  const CheckpointReader::Saved& added = reader->saved_.back();
  if (file_size != added.man.file_bytes) {
    return Status::Corruption(added.path + " has " + std::to_string(file_size) +
                              " bytes, its manifest says " + std::to_string(added.man.file_bytes) +
                              " (a torn checkpoint)");
  }
  return Status::OK();
}

Status Checkpointer::CheckSavedTensors(const RankManifest& m, const std::string& man_path,
                                       int saved_world, const std::string& where) const {
  const size_t num_params = layout_->num_params();
  if (m.tensors.size() != num_params) {
    return ModelMismatch(where, std::to_string(m.tensors.size()) + " tensors, this engine has " +
                                    std::to_string(num_params));
  }
  for (size_t i = 0; i < num_params; ++i) {
    const ParamLayout& p = layout_->param(static_cast<ParamId>(i));
    const CheckpointTensor& t = m.tensors[i];
    if (t.name != p.info.name || t.numel != p.info.numel) {
      return ModelMismatch(where, "tensor " + std::to_string(i) + " is '" + t.name + "' with " +
                                      std::to_string(t.numel) + " elements, this engine has '" +
                                      p.info.name + "' with " + std::to_string(p.info.numel));
    }
    if (t.sub_group >= m.groups.size()) {
      return Status::Corruption(man_path + ": tensor '" + t.name + "' names a missing sub-group");
    }
    if (std::string why = FrozenMismatch(t, static_cast<ParamId>(i)); !why.empty()) {
      return ModelMismatch(where, why + OldFormatHint(m));
    }
    // The saved parts must tile the tensor as `saved_world` ranks cut it (Layout's rule):
    // a manifest that says otherwise would leave holes that load as zeros.
    const uint64_t expected = RoundUp((t.numel + saved_world - 1) / saved_world, kPartitionAlign);
    // int8 frozen weights are cut on the int8 block grid instead; they store nothing here.
    const uint64_t int8_grid = RoundUp((t.numel + saved_world - 1) / saved_world, kInt8StateBlock);
    if (t.partition_numel != expected && !(t.frozen && t.partition_numel == int8_grid)) {
      return Status::Corruption(man_path + ": tensor '" + t.name + "' has a part of " +
                                std::to_string(t.partition_numel) + " elements; " +
                                std::to_string(saved_world) + " ranks cut its " +
                                std::to_string(t.numel) + " into parts of " +
                                std::to_string(expected));
    }
  }
  return Status::OK();
}

void Checkpointer::SynthesizeManifest(CheckpointReader* reader) const {
  const RankManifest& first = reader->saved_[0].man;
  RankManifest& man = reader->man_;
  man = RankManifest{};
  man.rank = rank_;
  man.world = world_;
  man.step = first.step;
  man.optimizer = first.optimizer;
  man.state_dtype = first.state_dtype;
  man.loss_scale = first.loss_scale;
  // The trainer's own data (a client_state, its data position): each rank's own where that
  // rank saved one, rank 0's for ranks the saving run did not have.
  man.user_data = static_cast<size_t>(rank_) < reader->saved_.size()
                      ? reader->saved_[rank_].man.user_data
                      : first.user_data;
  for (size_t gi = 0; gi < layout_->num_groups(); ++gi) {
    CheckpointGroup g;
    g.numel = layout_->group(gi).numel;
    man.groups.push_back(g);
  }
  for (size_t i = 0; i < layout_->num_params(); ++i) {
    const ParamLayout& p = layout_->param(static_cast<ParamId>(i));
    CheckpointTensor t;
    t.name = p.info.name;
    t.numel = p.info.numel;
    t.partition_numel = p.info.partition_numel;
    t.sub_group = p.info.sub_group;
    t.slice_offset = p.slice_offset;
    t.updates = first.tensors[i].updates;
    t.frozen = first.tensors[i].frozen;
    t.value_hash = first.tensors[i].value_hash;
    man.tensors.push_back(t);
  }
}

Status Checkpointer::VerifySlicesTaken(const CheckpointReader& reader) const {
  for (size_t i = 0; i < layout_->num_params(); ++i) {
    if (!layout_->param(static_cast<ParamId>(i)).info.trainable) continue;  // nothing stored
    const size_t part = layout_->param(static_cast<ParamId>(i)).info.partition_numel;
    const uint64_t begin = static_cast<uint64_t>(rank_) * part, end = begin + part;
    for (const CheckpointReader::Saved& saved : reader.saved_) {
      const CheckpointTensor& t = saved.man.tensors[i];
      const uint64_t sb = static_cast<uint64_t>(saved.man.rank) * t.partition_numel;
      if (sb >= end || sb + t.partition_numel <= begin) continue;
      for (int k = 0; k < 3; ++k) {
        ZINF_RETURN_IF_ERROR(ReadSavedSlice(saved, i, k, reader.file_type_, 0, 0, nullptr));
      }
    }
  }
  return Status::OK();
}

Status Checkpointer::ValidateResharded(const std::string& folder, int saved_world,
                                       CheckpointReader* reader) {
  const std::string where = folder + " (saved by " + std::to_string(saved_world) +
                            " ranks, loading into " + std::to_string(world_) + ")";
  for (int q = 0; q < saved_world; ++q) {
    ZINF_RETURN_IF_ERROR(AddSavedRank(folder, saved_world, q, where, reader));
  }
  SynthesizeManifest(reader);
  // Pass 1: every saved slice this rank will take from is read and verified now.
  reader->file_type_ = *ParseStateType(reader->saved_[0].man.state_dtype);
  return VerifySlicesTaken(*reader);
}

Status Checkpointer::ReadSavedSlice(const CheckpointReader::Saved& saved, size_t i, int k,
                                    StateType type, uint64_t copy_from, uint64_t copy_bytes,
                                    char* dst) const {
  const RankManifest& m = saved.man;
  const CheckpointTensor& t = m.tensors[i];
  const CheckpointGroup& g = m.groups[t.sub_group];
  const uint64_t slice_bytes =
      k == 0 ? t.partition_numel * sizeof(float) : StateBytes(type, t.partition_numel);
  const uint64_t offset =
      g.offset + (k == 0 ? t.slice_offset * sizeof(float)
                         : g.numel * sizeof(float) + (k - 1) * StateBytes(type, g.numel) +
                               StateBytes(type, t.slice_offset));
  if (offset + slice_bytes > m.file_bytes || copy_from + copy_bytes > slice_bytes) {
    return Status::Corruption(saved.path + ": tensor '" + t.name + "' lies beyond the file");
  }
  // In bounded chunks: the whole slice is hashed, only [copy_from, copy_from + copy_bytes) is
  // kept, so memory stays at one chunk whatever the tensor's size.
  constexpr uint64_t kChunk = uint64_t{4} << 20;
  std::vector<char> chunk(std::min(slice_bytes, kChunk));
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(),
                                                                 &XXH3_freeState);
  if (state == nullptr || XXH3_64bits_reset(state.get()) != XXH_OK) {
    return Status::ResourceExhausted("checkpoint: a hash state");
  }
  for (uint64_t at = 0; at < slice_bytes; at += chunk.size()) {
    const uint64_t n = std::min<uint64_t>(chunk.size(), slice_bytes - at);
    ZINF_RETURN_IF_ERROR(
        PreadAll(saved.fd, chunk.data(), n, offset + at, saved.path, "a torn checkpoint"));
    if (XXH3_64bits_update(state.get(), chunk.data(), n) != XXH_OK) {
      return Status::Internal("checkpoint: hashing failed");
    }
    const uint64_t lo = std::max(at, copy_from), hi = std::min(at + n, copy_from + copy_bytes);
    if (dst != nullptr && lo < hi)
      std::memcpy(dst + (lo - copy_from), chunk.data() + (lo - at), hi - lo);
  }
  if (XXH3_64bits_digest(state.get()) != t.hash[k]) {
    static const char* const kState[] = {"master weights", "exp_avg", "exp_avg_sq"};
    return Status::Corruption("checkpoint tensor '" + t.name + "' (" + kState[k] + ") in " +
                              saved.path + " does not match its checksum");
  }
  return Status::OK();
}

Status CheckpointReader::ReadResharded(size_t gi, void* buf) {
  const Layout& layout = *owner_->layout_;
  if (layout.group(gi).frozen) return Status::OK();  // nothing stored
  char* out = static_cast<char*>(buf);
  std::memset(out, 0, layout.GroupStateBytes(gi, file_type_));  // padding stays zero
  for (ParamId id : layout.group(gi).params) {
    const size_t part = layout.param(id).info.partition_numel;
    const uint64_t begin = static_cast<uint64_t>(owner_->rank_) * part, end = begin + part;
    for (const Saved& saved : saved_) {
      const CheckpointTensor& t = saved.man.tensors[id];
      const uint64_t sb = static_cast<uint64_t>(saved.man.rank) * t.partition_numel;
      const uint64_t lo = std::max(begin, sb), hi = std::min(end, sb + t.partition_numel);
      if (lo >= hi) continue;
      for (int k = 0; k < 3; ++k) {
        // Verified again in this read: the bytes installed are the bytes verified.
        const size_t esize = k == 0 ? sizeof(float) : StateBytes(file_type_, 1);
        ZINF_RETURN_IF_ERROR(owner_->ReadSavedSlice(
            saved, id, k, file_type_, (lo - sb) * esize, (hi - lo) * esize,
            out + layout.SliceOffsetIn(id, k, file_type_) + (lo - begin) * esize));
      }
    }
  }
  return Status::OK();
}

CheckpointReader::~CheckpointReader() {
  if (fd_ >= 0) close(fd_);
  for (const Saved& s : saved_) {
    if (s.fd >= 0) close(s.fd);
  }
}

Result<const void*> CheckpointReader::ReadGroup(size_t gi) {
  if (!saved_.empty()) {
    ZINF_RETURN_IF_ERROR(ReadResharded(gi, buf_.data));
    if (!converted_) return static_cast<const void*>(buf_.data);
    ZINF_RETURN_IF_ERROR(owner_->ConvertGroupStates(gi, file_type_, buf_.data, converted_->data));
    return static_cast<const void*>(converted_->data);
  }
  // The bytes installed are the bytes verified: this read is checked again (the file may have
  // changed since the validation pass, or the disk returned something else).
  ZINF_RETURN_IF_ERROR(owner_->ReadGroup(fd_, gi, file_type_, man_, states_path_, buf_.data));
  if (!converted_) return static_cast<const void*>(buf_.data);
  ZINF_RETURN_IF_ERROR(owner_->ConvertGroupStates(gi, file_type_, buf_.data, converted_->data));
  return static_cast<const void*>(converted_->data);
}

Result<std::unique_ptr<CheckpointReader>> Checkpointer::Open(const std::string& dir,
                                                             bool fall_back_to_older,
                                                             const std::vector<uint64_t>& hashes) {
  hashes_ = &hashes;
  struct Unset {
    const std::vector<uint64_t>** p;
    ~Unset() { *p = nullptr; }
  } unset{&hashes_};
  Status local = rank_ == 0 ? LockDir(dir, /*create=*/false) : Status::OK();
  ZINF_RETURN_IF_ERROR(collectives_->Agree(local, "LoadCheckpoint"));
  // Which checkpoints there are: "none yet" only for a folder that holds none at all; a
  // `latest` that cannot be read, or step folders without one, is damage.
  ZINF_ASSIGN_OR_RETURN(checkpoint_folder::Listing listing, checkpoint_folder::List(dir));
  if (!listing.exists || listing.Empty()) {
    return Status::NotFound("no checkpoint in " + dir + " (the folder " +
                            (listing.exists ? "holds none" : "does not exist") + ")");
  }
  // A step folder gets its name only once complete, so the newest one is a committed
  // checkpoint even when `latest` (a pointer written right after) is missing or unreadable:
  // that is then said, not fatal. The candidate chosen must validate in full; a damaged one is
  // an error unless falling back is allowed.
  std::vector<std::string> candidates = checkpoint_folder::Candidates(dir, listing);
  std::string damage;
  if (!listing.latest_status.ok()) {
    damage = listing.latest_status.message();
  } else if (listing.latest.empty() && !listing.single) {
    damage = dir + "/latest is missing";
  }
  // Room for a sub-group as the checkpoint stores it, whatever its state dtype (fp32 is the
  // largest).
  std::unique_ptr<CheckpointReader> reader(
      new CheckpointReader(this, layout_->LargestGroupStateBytes(StateType::kF32)));
  std::string used;
  std::vector<std::string> tried;
  for (const std::string& folder : candidates) {
    if (reader->fd_ >= 0) {
      close(reader->fd_);
      reader->fd_ = -1;
    }
    for (const CheckpointReader::Saved& saved : reader->saved_) {
      if (saved.fd >= 0) close(saved.fd);
    }
    reader->saved_.clear();
    // Saved by another number of ranks: re-partitioned while read.
    const int saved_world = SavedWorld(folder);
    if (saved_world > 0 && saved_world != world_) {
      local = ValidateResharded(folder, saved_world, reader.get());
    } else {
      local = Validate(folder, &reader->man_, &reader->fd_, &reader->states_path_, &reader->buf_);
    }
    Status agreed = collectives_->Agree(local, "LoadCheckpoint");
    if (agreed.ok()) {
      used = folder;
      break;
    }
    // A checkpoint of another model, or one this load cannot re-partition, is no damage: an
    // older one would not fit either.
    if ((agreed.code() == StatusCode::kFailedPrecondition ||
         agreed.code() == StatusCode::kNotSupported) &&
        !local.ok()) {
      return agreed;
    }
    tried.push_back(folder + " (" + agreed.message() + ")");
    if (!fall_back_to_older) {
      return Status::Corruption("the newest checkpoint " + folder +
                                " is damaged: " + agreed.message() +
                                "; load the one before (LoadCheckpoint's fall_back_to_older; "
                                "zinf-train --resume --fallback) or repair it");
    }
  }
  if (used.empty())
    return Status::Corruption("no readable checkpoint in " + dir + ": " + JoinList(tried));
  if (!tried.empty()) {
    LogWarning("loading " + used +
               ", not the newest checkpoint, which is damaged: " + JoinList(tried));
  } else if (!damage.empty()) {
    LogWarning(damage + "; loading " + used + ", the newest complete checkpoint");
  }

  // States stored in another dtype are converted when read (ConvertOptimizerState: as a step
  // would have decoded and stored them). (The parser accepted the dtype; every rank's
  // checkpoint has the same one.)
  const Result<StateType> parsed_type = ParseStateType(reader->man_.state_dtype);
  reader->file_type_ = parsed_type.ok() ? *parsed_type : StateType::kF32;
  const StateType engine_type = layout_->state_type();
  Status prepared;
  if (reader->file_type_ != engine_type) {
    reader->converted_.emplace(layout_->LargestGroupStateBytes());
    if (reader->converted_->data == nullptr) {
      prepared = Status::ResourceExhausted("checkpoint conversion buffer");
    } else {
      LogInfo("loading optimizer states stored as " + reader->man_.state_dtype + " into " +
              StateTypeName(engine_type) + " (zinf.optimizer_state_dtype): converting them");
    }
  }
  // Nothing is read for installing yet: a rank that cannot convert stops every rank here.
  ZINF_RETURN_IF_ERROR(collectives_->Agree(prepared, "LoadCheckpoint"));
  if (validated_) validated_(used);
  return reader;
}

}  // namespace zinf
