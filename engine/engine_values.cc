// Engine::Impl's calls between optimizer steps: checkpoints, new parameter values, gathering
// the master weights, and the small accessors.
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/utf8.h"
#include "engine/core/rank_agreement.h"
#include "engine/engine_impl.h"
#include "engine/persistence/checkpoint_folder.h"
#include "zinf/log.h"

namespace zinf {

// ---- Checkpoints and values between steps ---------------------------------------------------

Status Engine::Impl::CheckBetweenSteps(const char* what) const {
  if (!broken_.ok()) return broken_;
  if (!clock_.BetweenSteps()) {
    return Status::FailedPrecondition(std::string(what) +
                                      " must be called between optimizer steps (after Step() at "
                                      "an accumulation boundary, before the next Acquire)");
  }
  for (ParamId id = 0; id < layout_.num_params(); ++id) {
    if (core_->fetch->acquired(id) > 0) {
      return Status::FailedPrecondition(std::string(what) + ": parameter '" +
                                        layout_.param(id).info.name + "' is still acquired");
    }
  }
  return Status::OK();
}

Status Engine::Impl::WriteGroupStates(size_t gi, const void* buf, int buf_index) {
  ZINF_RETURN_IF_ERROR(core_->states->Write(gi, buf));
  // The parameter store: the masters in the storage dtype.
  const float* master = static_cast<const float*>(buf);
  std::unique_ptr<AlignedBuffer> copy;
  if (StoredParamType(config_) != ParamCopyType::kNone) {
    copy = std::make_unique<AlignedBuffer>(layout_.group(gi).numel * 2);
    if (copy->data == nullptr) return Status::ResourceExhausted("parameter copy buffer");
    for (ParamId id : layout_.group(gi).params) {
      const ParamLayout& p = layout_.param(id);
      ZINF_RETURN_IF_ERROR(optimizer_->ConvertParams(
          master + p.slice_offset, static_cast<uint16_t*>(copy->data) + p.slice_offset,
          StoredParamType(config_), p.info.partition_numel));
    }
  }
  const uint16_t* copy_out = copy ? static_cast<const uint16_t*>(copy->data) : nullptr;
  if (config_.offload_param.tier != Tier::kNvme) {
    return core_->params->WriteGroup(gi, master, copy_out, buf_index, nullptr);
  }
  std::vector<Ticket> writes;
  Status s = core_->params->WriteGroup(gi, master, copy_out, buf_index, &writes);
  for (Ticket t : writes) {
    Status w = swap_->Wait(t);
    if (s.ok()) s = w;
  }
  return s;
}

Status Engine::Impl::PrepareCheckpointDir(const std::string& dir) {
  return checkpointer_->Prepare(dir);
}

Result<std::vector<std::string>> Engine::ListCheckpoints(const std::string& dir) {
  return checkpoint_folder::ZinfEntries(dir);
}

Status Engine::Impl::RemoveCheckpoints(const std::string& dir) {
  Status local;
  if (rank_ == 0) {
    local = checkpointer_->HoldsLock(dir)
                ? checkpoint_folder::RemoveZinfEntries(dir)
                : Status::FailedPrecondition("RemoveCheckpoints(" + dir +
                                             "): prepare the folder first (PrepareCheckpointDir "
                                             "locks it for this engine)");
  }
  return collectives_->Agree(local, "RemoveCheckpoints");
}

std::optional<CheckpointLossScale> Engine::Impl::LossScaleRecord() const {
  if (scaler_ == nullptr) return std::nullopt;
  return RecordOf(scaler_->state());
}

Status Engine::Impl::SaveCheckpoint(const std::string& dir, const std::string& user_data) {
  if (!registered_) ZINF_RETURN_IF_ERROR(FinishRegistration());
  ZINF_RETURN_IF_ERROR(CheckInitialValues());
  ZINF_RETURN_IF_ERROR(CheckBetweenSteps("SaveCheckpoint"));
  ZINF_RETURN_IF_ERROR(ReloadForCollective());
  if (!IsValidUtf8(user_data)) {
    return Status::InvalidArgument(
        "SaveCheckpoint: the user data is not valid UTF-8 (it goes "
        "into the JSON manifest); encode it, e.g. as base64");
  }
  ZINF_RETURN_IF_ERROR(budget_->ReclaimScratch());
  ZINF_RETURN_IF_ERROR(collectives_->Agree(FinishPendingUpdate(), "SaveCheckpoint"));
  return checkpointer_->Save(dir, user_data, clock_.step(), LossScaleRecord(), core_->states.get(),
                             core_->params->value_hashes());
}

Status Engine::Impl::LoadCheckpoint(const std::string& dir, std::string* user_data,
                                    bool fall_back_to_older) {
  if (!registered_) ZINF_RETURN_IF_ERROR(FinishRegistration());
  ZINF_RETURN_IF_ERROR(CheckBetweenSteps("LoadCheckpoint"));
  ZINF_RETURN_IF_ERROR(ReloadForCollective());
  ZINF_RETURN_IF_ERROR(budget_->ReclaimScratch());
  ZINF_RETURN_IF_ERROR(collectives_->Agree(FinishPendingUpdate(), "LoadCheckpoint"));
  ZINF_ASSIGN_OR_RETURN(
      std::unique_ptr<CheckpointReader> reader,
      checkpointer_->Open(dir, fall_back_to_older, core_->params->value_hashes()));
  const RankManifest& man = reader->manifest();
  // fp16: the saved scaler goes on (a checkpoint of a run without fp16 has none: the scale
  // starts afresh), checked before anything is installed (every rank reads the same state).
  std::optional<LossScaler> loaded_scaler;
  if (scaler_ != nullptr) {
    loaded_scaler.emplace(LossScaleSettingsOf(config_.fp16));
    if (man.loss_scale.has_value()) {
      ZINF_RETURN_IF_ERROR(loaded_scaler->Restore(ScalerStateOf(*man.loss_scale))
                               .WithContext("LoadCheckpoint: the saved loss scale"));
    }
  }
  // Install: fetched parameter copies are stale from here on; each sub-group is read once,
  // verified in that read, and written into the stores.
  gather_states_.reset();
  Status local = EvictAll(/*frozen=*/false);  // (a load leaves frozen values as they are)
  const int buf = core_->params->Buf(man.step);
  for (size_t gi = 0; gi < layout_.num_groups() && local.ok(); ++gi) {
    if (layout_.group(gi).frozen) continue;  // their values are the ones registered (hashed)
    Result<const void*> states = reader->ReadGroup(gi);
    local = states.ok() ? WriteGroupStates(gi, *states, buf) : states.status();
  }
  Status s = collectives_->Agree(local, "LoadCheckpoint");
  if (!s.ok()) {
    // Installing had begun: the states may be partly replaced.
    broken_ = Status::FailedPrecondition("LoadCheckpoint failed while installing states (" +
                                         s.message() + "); recreate the engine");
    return s;
  }
  clock_.Reset(man.step, man.step);
  if (loaded_scaler.has_value()) {
    *scaler_ = *loaded_scaler;
    // (Commits from here on record it, not a state of the history the load left.)
    durable_->RecordLossScale(man.step, *LossScaleRecord());
  }
  // The trainable values are the checkpoint's now, the same on every rank; frozen ones stay
  // as registered (each rank checked them against the checkpoint's hashes).
  for (ParamId id = 0; id < initial_hashes_.size(); ++id) {
    if (layout_.param(id).info.trainable) initial_hashes_[id] = 0;
  }
  for (ParamId id = 0; id < layout_.num_params(); ++id) {
    // (A frozen tensor is never stepped.)
    const int64_t updates = man.tensors[id].updates >= 0 ? man.tensors[id].updates : man.step;
    core_->states->set_updates(id, layout_.param(id).info.trainable ? updates : 0);
  }
  // A new history (the same value on every rank: they load the same checkpoint).
  durable_->NewLineage(man.step);
  core_->board->ResetTo(man.step);
  BeginMicroStep();
  if (user_data != nullptr) *user_data = man.user_data;
  return Status::OK();
}

// ---- Inspection ------------------------------------------------------------------------------

Status Engine::Impl::GatherMasterParameter(ParamId id, float* out) {
  if (!registered_) ZINF_RETURN_IF_ERROR(FinishRegistration());
  // (Also once the engine stopped: what it holds can still be inspected.)
  ZINF_RETURN_IF_ERROR(ReloadForCollective(kOffloadParams | kOffloadOptimizerStates));
  if (id >= layout_.num_params() || out == nullptr) {
    return Status::InvalidArgument("GatherMasterParameter: bad id or null output");
  }
  ZINF_RETURN_IF_ERROR(CheckInitialValues());
  // The optimizer steps of finished windows (delayed update: the last one may still run).
  ZINF_RETURN_IF_ERROR(core_->board->WaitDone(clock_.step()));
  const ParamLayout& p = layout_.param(id);
  if (!p.info.trainable) {  // its value lives in its parameter store alone (storage dtype)
    std::vector<float> mine(p.info.partition_numel);
    ZINF_RETURN_IF_ERROR(core_->frozen->ReadPartition(id, mine.data()));
    return GatherPartition(p, mine.data(), out);
  }
  const size_t gi = p.info.sub_group;
  const float* host = core_->states->host_states(gi);
  if (host != nullptr) return GatherPartition(p, host + p.slice_offset, out);
  // NVMe or device states: read the sub-group once for the consecutive parameters of a full
  // gather (the cache is dropped when the next micro-step starts or a checkpoint loads).
  if (gather_group_ != gi || gather_states_ == nullptr) {
    // One buffer, as large as the largest sub-group, reused from group to group.
    if (gather_states_ == nullptr) {
      const size_t largest = layout_.LargestGroupStateBytes();
      gather_states_ = std::make_unique<AlignedBuffer>(largest);
      if (gather_states_->data == nullptr) {
        gather_states_.reset();
        return Status::ResourceExhausted("gather buffer of " + FormatBytes(largest));
      }
    }
    Status s = core_->states->Read(gi, gather_states_->data);
    if (!s.ok()) {
      gather_states_.reset();
      return s;
    }
    gather_group_ = gi;
  }
  return GatherPartition(p, static_cast<const float*>(gather_states_->data) + p.slice_offset, out);
}

Status Engine::Impl::GatherPartition(const ParamLayout& p, const float* mine, float* out) {
  if (world_ == 1) {  // the partition is the tensor
    std::memcpy(out, mine, p.info.numel * sizeof(float));
    return Status::OK();
  }
  // A copy of its own: the collective's upload may still read it when the collective fails,
  // and `mine` may be states the optimizer rewrites after this call.
  const std::vector<float> part(mine, mine + p.info.partition_numel);
  std::vector<float> gathered(p.padded_numel);
  ZINF_RETURN_IF_ERROR(collectives_->AllGather(part.data(), gathered.data(),
                                               p.info.partition_numel * sizeof(float),
                                               "gathering '" + p.info.name + "'"));
  std::memcpy(out, gathered.data(), p.info.numel * sizeof(float));
  return Status::OK();
}

Status Engine::Impl::CompareValuesToSet(size_t count, const std::vector<uint8_t>& wanted,
                                        const std::function<Status(ParamId, float*)>& fill) {
  // The ranks set the same parameters to the same values, or nothing is set: each rank keeps
  // only its slice, so different values would leave a parameter part one, part the other.
  // Compared before anything is written (the values are filled twice).
  std::string text = "parameters set: " + std::to_string(count) + "\n";
  std::vector<float> full;
  Status filled;
  for (ParamId id = 0; id < layout_.num_params() && filled.ok(); ++id) {
    if (!wanted[id]) continue;
    const ParamLayout& p = layout_.param(id);
    full.assign(p.padded_numel, 0.0f);
    filled = fill(id, full.data()).WithContext("values of '" + p.info.name + "'");
    text += "the values set for '" + p.info.name +
            "' (xxh3): " + HashHex(XXH3_64bits(full.data(), p.info.numel * sizeof(float))) + "\n";
  }
  ZINF_RETURN_IF_ERROR(collectives_->Agree(filled, "SetParameterValues"));
  return AgreeAcrossRanks(
      collectives_.get(), world_, "the parameter values being set", text,
      "Nothing was set. Every rank must set the same parameters to the same values (each "
      "rank keeps its own partition of a parameter): write them on every rank alike, or "
      "compute them on one rank and broadcast them first.");
}

Status Engine::Impl::SetParameterValues(const std::vector<ParamId>& ids,
                                        const std::function<Status(ParamId, float*)>& fill) {
  if (!fill) return Status::InvalidArgument("SetParameterValues: no fill function");
  std::vector<uint8_t> wanted(layout_.num_params(), 0);
  for (ParamId id : ids) {
    if (id >= layout_.num_params()) {
      return Status::InvalidArgument("SetParameterValues: unknown parameter id " +
                                     std::to_string(id));
    }
    if (wanted[id]) {
      return Status::InvalidArgument("SetParameterValues: parameter '" +
                                     layout_.param(id).info.name + "' is listed twice");
    }
    wanted[id] = 1;
  }
  if (!registered_) ZINF_RETURN_IF_ERROR(FinishRegistration());
  ZINF_RETURN_IF_ERROR(CheckBetweenSteps("SetParameterValues"));
  ZINF_RETURN_IF_ERROR(ReloadForCollective());
  ZINF_RETURN_IF_ERROR(budget_->ReclaimScratch());
  if (world_ > 1) ZINF_RETURN_IF_ERROR(CompareValuesToSet(ids.size(), wanted, fill));
  ZINF_RETURN_IF_ERROR(collectives_->Agree(FinishPendingUpdate(), "SetParameterValues"));
  gather_states_.reset();
  size_t group_bytes = 0;
  Status local;
  bool changed = false;  // some value was written
  for (ParamId id = 0; id < layout_.num_params() && local.ok(); ++id) {
    if (!wanted[id]) continue;
    local = core_->fetch->Replace(id);  // a fetched copy (or hpZ shard) holds the old values
    if (local.ok() && !layout_.param(id).info.trainable) {
      bool wrote = false;
      local = core_->frozen->Set(id, fill, &wrote);  // its store alone
      changed = changed || wrote;
      continue;
    }
    group_bytes = std::max(group_bytes, layout_.GroupStateBytes(layout_.param(id).info.sub_group));
  }
  if (local.ok() && group_bytes > 0) {
    HostStates host;
    local = AllocateHostStates(arena_.get(), group_bytes, &host);
    std::vector<float> full;
    for (size_t gi = 0; gi < layout_.num_groups() && local.ok(); ++gi) {
      const GroupLayout& g = layout_.group(gi);
      if (g.frozen ||
          std::none_of(g.params.begin(), g.params.end(), [&](ParamId id) { return wanted[id]; })) {
        continue;
      }
      float* master = static_cast<float*>(host.data());
      local = core_->states->Read(gi, master);
      for (size_t j = 0; j < g.params.size() && local.ok(); ++j) {
        const ParamLayout& p = layout_.param(g.params[j]);
        if (!wanted[g.params[j]]) continue;
        full.assign(p.padded_numel, 0.0f);
        local = fill(g.params[j], full.data()).WithContext("values of '" + p.info.name + "'");
        if (local.ok()) {
          std::memcpy(master + p.slice_offset,
                      full.data() + static_cast<size_t>(rank_) * p.info.partition_numel,
                      p.info.partition_numel * sizeof(float));
        }
      }
      if (local.ok()) {
        changed = true;
        local = WriteGroupStates(gi, master, core_->params->Buf(clock_.visible()));
      }
    }
  }
  Status agreed = collectives_->Agree(local, "SetParameterValues");
  if (!agreed.ok()) {
    // Some rank may hold new values in part of its sub-groups: the model is neither the old
    // one nor the new one.
    if (changed || world_ > 1) {
      return Break("SetParameterValues failed part-way", agreed,
                   "; recreate the engine and load again");
    }
    return agreed;
  }
  // Set alike on every rank (compared above): no longer the initial values to compare.
  for (ParamId id : ids) {
    if (id < initial_hashes_.size()) initial_hashes_[id] = 0;
  }
  // Durable: the new values are a new history, committed at once.
  durable_->NewLineage(clock_.step());
  Status committed = durable_->Commit(clock_.step(), clock_.visible());
  if (!committed.ok()) {
    return Break("the durable swap store could not commit the loaded values", committed,
                 "; resume from its last commit");
  }
  return Status::OK();
}

int64_t Engine::Impl::param_updates(ParamId id) const {
  layout_.params().at(id);  // throws std::out_of_range on a bad id, as documented
  if (!registered_) return 0;
  // The optimizer thread counts the updates of a step still running (delayed update): wait
  // for it. A failed step's count is what it reached; that failure is reported by the calls
  // that run steps, so it is not repeated here.
  (void)core_->board->WaitDone(
      clock_.step());  // safe: the failure is the step-running calls' to report
  return core_->states->updates(id);
}

Status Engine::Impl::SetLearningRate(float lr) {
  if (!std::isfinite(lr) || lr < 0) {
    return Status::InvalidArgument("SetLearningRate: the learning rate must be finite and >= 0");
  }
  for (ParamGroupHyper& g : groups_) g.lr = lr;
  return Status::OK();
}

Status Engine::Impl::SetParamGroup(size_t group, const ParamGroupHyper& hp) {
  const std::string where = "parameter group " + std::to_string(group);
  if (group > groups_.size()) {
    return Status::InvalidArgument("SetParamGroup: " + where + " is beyond the next one (" +
                                   std::to_string(groups_.size()) + "); add the groups in order");
  }
  if (group == groups_.size() && registered_) {
    return Status::FailedPrecondition("SetParamGroup: " + where +
                                      " is new, and groups are added before FinishRegistration "
                                      "(their parameters name them when registered)");
  }
  const std::pair<const char*, float> values[] = {{"lr", hp.lr},
                                                  {"betas[0]", hp.beta1},
                                                  {"betas[1]", hp.beta2},
                                                  {"eps", hp.eps},
                                                  {"weight_decay", hp.weight_decay}};
  for (const auto& [key, v] : values) {
    const bool beta = key[0] == 'b';
    const bool lion = config_.optimizer.type == OptimizerType::kLion;
    if (!std::isfinite(v) || v < 0 || (beta && (lion ? v > 1 : v >= 1))) {
      return Status::InvalidArgument("SetParamGroup: " + where + ": " + key + " = " +
                                     std::to_string(v) + " must be finite and " +
                                     (beta ? (lion ? "in [0, 1]" : "in [0, 1)") : ">= 0"));
    }
  }
  if (group == groups_.size()) {
    groups_.push_back(hp);
  } else {
    groups_[group] = hp;
  }
  return Status::OK();
}

size_t Engine::Impl::num_param_groups() const { return groups_.size(); }

ParamGroupHyper Engine::Impl::param_group(size_t group) const { return groups_.at(group); }

int64_t Engine::Impl::global_step() const { return clock_.step(); }

int Engine::Impl::rank() const { return rank_; }

int Engine::Impl::world_size() const { return world_; }

size_t Engine::Impl::num_params() const { return layout_.num_params(); }

const ParamInfo& Engine::Impl::param(ParamId id) const { return layout_.params().at(id).info; }

const EngineConfig& Engine::Impl::config() const { return config_; }

}  // namespace zinf
