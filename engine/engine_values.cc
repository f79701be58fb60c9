// The façade's calls between optimizer steps: checkpoints, new parameter values, gathering
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
  if (!broken.ok()) return broken;
  if (!clock.BetweenSteps()) {
    return Status::FailedPrecondition(std::string(what) +
                                      " must be called between optimizer steps (after Step() at "
                                      "an accumulation boundary, before the next Acquire)");
  }
  for (ParamId id = 0; id < layout.num_params(); ++id) {
    if (fetch->acquired(id) > 0) {
      return Status::FailedPrecondition(std::string(what) + ": parameter '" +
                                        layout.param(id).info.name + "' is still acquired");
    }
  }
  return Status::OK();
}

Status Engine::Impl::WriteGroupStates(size_t gi, const void* buf, int buf_index) {
  ZINF_RETURN_IF_ERROR(states->Write(gi, buf));
  // The parameter store: the masters in the storage dtype.
  const float* master = static_cast<const float*>(buf);
  std::unique_ptr<AlignedBuffer> copy;
  if (config.bf16) {
    copy = std::make_unique<AlignedBuffer>(layout.group(gi).numel * 2);
    if (copy->data == nullptr) return Status::ResourceExhausted("parameter copy buffer");
    for (ParamId id : layout.group(gi).params) {
      const ParamLayout& p = layout.param(id);
      ZINF_RETURN_IF_ERROR(optimizer->ConvertParams(
          master + p.slice_offset, static_cast<uint16_t*>(copy->data) + p.slice_offset,
          ParamCopyType::kBf16, p.info.partition_numel));
    }
  }
  const uint16_t* copy_out = copy ? static_cast<const uint16_t*>(copy->data) : nullptr;
  if (config.offload_param.tier != Tier::kNvme) {
    return param_store->WriteGroup(gi, master, copy_out, buf_index, nullptr);
  }
  std::vector<Ticket> writes;
  Status s = param_store->WriteGroup(gi, master, copy_out, buf_index, &writes);
  for (Ticket t : writes) {
    Status w = swap->Wait(t);
    if (s.ok()) s = w;
  }
  return s;
}

Status Engine::PrepareCheckpointDir(const std::string& dir) {
  return impl_->checkpointer->Prepare(dir);
}

Result<std::vector<std::string>> Engine::ListCheckpoints(const std::string& dir) {
  return checkpoint_folder::ZinfEntries(dir);
}

Status Engine::RemoveCheckpoints(const std::string& dir) {
  Impl& m = *impl_;
  Status local;
  if (m.rank == 0) {
    local = m.checkpointer->HoldsLock(dir)
                ? checkpoint_folder::RemoveZinfEntries(dir)
                : Status::FailedPrecondition("RemoveCheckpoints(" + dir +
                                             "): prepare the folder first (PrepareCheckpointDir "
                                             "locks it for this engine)");
  }
  return m.collectives->Agree(local, "RemoveCheckpoints");
}

Status Engine::SaveCheckpoint(const std::string& dir, const std::string& user_data) {
  Impl& m = *impl_;
  if (!m.registered) ZINF_RETURN_IF_ERROR(FinishRegistration());
  ZINF_RETURN_IF_ERROR(m.CheckInitialValues());
  ZINF_RETURN_IF_ERROR(m.CheckBetweenSteps("SaveCheckpoint"));
  if (!IsValidUtf8(user_data)) {
    return Status::InvalidArgument(
        "SaveCheckpoint: the user data is not valid UTF-8 (it goes "
        "into the JSON manifest); encode it, e.g. as base64");
  }
  ZINF_RETURN_IF_ERROR(m.budget->ReclaimScratch());
  ZINF_RETURN_IF_ERROR(m.collectives->Agree(m.FinishPendingUpdate(), "SaveCheckpoint"));
  return m.checkpointer->Save(dir, user_data, m.clock.step(), m.states.get(),
                              m.param_store->value_hashes());
}

Status Engine::LoadCheckpoint(const std::string& dir, std::string* user_data,
                              bool fall_back_to_older) {
  Impl& m = *impl_;
  if (!m.registered) ZINF_RETURN_IF_ERROR(FinishRegistration());
  ZINF_RETURN_IF_ERROR(m.CheckBetweenSteps("LoadCheckpoint"));
  ZINF_RETURN_IF_ERROR(m.budget->ReclaimScratch());
  ZINF_RETURN_IF_ERROR(m.collectives->Agree(m.FinishPendingUpdate(), "LoadCheckpoint"));
  ZINF_ASSIGN_OR_RETURN(
      std::unique_ptr<CheckpointReader> reader,
      m.checkpointer->Open(dir, fall_back_to_older, m.param_store->value_hashes()));
  const RankManifest& man = reader->manifest();
  // Install: fetched parameter copies are stale from here on; each sub-group is read once,
  // verified in that read, and written into the stores.
  m.gather_states.reset();
  Status local = m.EvictAll(/*frozen=*/false);  // (a load leaves frozen values as they are)
  const int buf = m.param_store->Buf(man.step);
  for (size_t gi = 0; gi < m.layout.num_groups() && local.ok(); ++gi) {
    if (m.layout.group(gi).frozen) continue;  // their values are the ones registered (hashed)
    Result<const void*> states = reader->ReadGroup(gi);
    local = states.ok() ? m.WriteGroupStates(gi, *states, buf) : states.status();
  }
  Status s = m.collectives->Agree(local, "LoadCheckpoint");
  if (!s.ok()) {
    // Installing had begun: the states may be partly replaced.
    m.broken = Status::FailedPrecondition("LoadCheckpoint failed while installing states (" +
                                          s.message() + "); recreate the engine");
    return s;
  }
  m.clock.Reset(man.step, man.step);
  // The trainable values are the checkpoint's now, the same on every rank; frozen ones stay
  // as registered (each rank checked them against the checkpoint's hashes).
  for (ParamId id = 0; id < m.initial_hashes.size(); ++id) {
    if (m.layout.param(id).info.trainable) m.initial_hashes[id] = 0;
  }
  for (ParamId id = 0; id < m.layout.num_params(); ++id) {
    // (A frozen tensor is never stepped.)
    const int64_t updates = man.tensors[id].updates >= 0 ? man.tensors[id].updates : man.step;
    m.states->set_updates(id, m.layout.param(id).info.trainable ? updates : 0);
  }
  // A new history (the same value on every rank: they load the same checkpoint).
  m.durable->NewLineage(man.step);
  m.board->ResetTo(man.step);
  m.BeginMicroStep();
  if (user_data != nullptr) *user_data = man.user_data;
  return Status::OK();
}

// ---- Inspection ------------------------------------------------------------------------------

Status Engine::GatherMasterParameter(ParamId id, float* out) {
  Impl& m = *impl_;
  if (!m.registered) ZINF_RETURN_IF_ERROR(FinishRegistration());
  if (id >= m.layout.num_params() || out == nullptr) {
    return Status::InvalidArgument("GatherMasterParameter: bad id or null output");
  }
  ZINF_RETURN_IF_ERROR(m.CheckInitialValues());
  // The optimizer steps of finished windows (delayed update: the last one may still run).
  ZINF_RETURN_IF_ERROR(m.board->WaitDone(m.clock.step()));
  const ParamLayout& p = m.layout.param(id);
  if (!p.info.trainable) return m.GatherFrozen(id, out);
  const size_t gi = p.info.sub_group;
  const size_t part = p.info.partition_numel;
  const float* host = m.states->host_states(gi);
  if (m.world == 1 && host != nullptr) {  // the partition is the tensor
    std::memcpy(out, host + p.slice_offset, p.info.numel * sizeof(float));
    return Status::OK();
  }
  std::vector<float> mine(part);
  if (host != nullptr) {
    std::memcpy(mine.data(), host + p.slice_offset, part * 4);
  } else {
    // NVMe or device states: read the sub-group once for the consecutive parameters of a
    // full gather (the cache is dropped when the next micro-step starts or a checkpoint loads).
    if (m.gather_group != gi || m.gather_states == nullptr) {
      // One buffer, as large as the largest sub-group, reused from group to group.
      if (m.gather_states == nullptr) {
        const size_t largest = m.layout.LargestGroupStateBytes();
        m.gather_states = std::make_unique<AlignedBuffer>(largest);
        if (m.gather_states->data == nullptr) {
          m.gather_states.reset();
          return Status::ResourceExhausted("gather buffer of " + FormatBytes(largest));
        }
      }
      Status s = m.states->Read(gi, m.gather_states->data);
      if (!s.ok()) {
        m.gather_states.reset();
        return s;
      }
      m.gather_group = gi;
    }
    const float* src = static_cast<const float*>(m.gather_states->data) + p.slice_offset;
    if (m.world == 1) {
      std::memcpy(out, src, p.info.numel * sizeof(float));
      return Status::OK();
    }
    std::memcpy(mine.data(), src, part * 4);
  }
  std::vector<float> gathered(p.padded_numel);
  ZINF_RETURN_IF_ERROR(m.collectives->AllGather(mine.data(), gathered.data(), part * 4,
                                                "gathering '" + p.info.name + "'"));
  std::memcpy(out, gathered.data(), p.info.numel * sizeof(float));
  return Status::OK();
}

Status Engine::Impl::GatherFrozen(ParamId id, float* out) {
  // Its value lives in its parameter store alone (storage dtype).
  const ParamLayout& p = layout.param(id);
  const size_t part = p.info.partition_numel;
  AlignedBuffer stored(RoundUp(layout.PartBytes(id), 4096));
  if (stored.data == nullptr) {
    return Status::ResourceExhausted("gathering '" + p.info.name + "': a buffer of " +
                                     FormatBytes(layout.PartBytes(id)));
  }
  ZINF_RETURN_IF_ERROR(param_store->ReadFrozen(id, stored.data, stored.bytes)
                           .WithContext("reading the frozen parameter '" + p.info.name + "'"));
  std::vector<float> mine(part);
  if (layout.StoredInt8(id) && !config.bf16) {
    DequantizeWeightsInt8(stored.data, part, mine.data());
  } else if (layout.StoredInt8(id)) {  // as the fetch decodes it: into bf16
    std::vector<uint16_t> b(part);
    DequantizeWeightsInt8Bf16(stored.data, part, b.data());
    for (size_t i = 0; i < part; ++i) mine[i] = Bf16ToFp32(b[i]);
  } else if (config.bf16) {
    const uint16_t* b = static_cast<const uint16_t*>(stored.data);
    for (size_t i = 0; i < part; ++i) mine[i] = Bf16ToFp32(b[i]);
  } else {
    std::memcpy(mine.data(), stored.data, part * sizeof(float));
  }
  if (world == 1) {
    std::memcpy(out, mine.data(), p.info.numel * sizeof(float));
    return Status::OK();
  }
  std::vector<float> gathered(p.padded_numel);
  ZINF_RETURN_IF_ERROR(collectives->AllGather(mine.data(), gathered.data(), part * 4,
                                              "gathering '" + p.info.name + "'"));
  std::memcpy(out, gathered.data(), p.info.numel * sizeof(float));
  return Status::OK();
}

Status Engine::Impl::SetFrozen(ParamId id, const std::function<Status(ParamId, float*)>& fill,
                               bool* wrote) {
  const ParamLayout& p = layout.param(id);
  std::vector<float> full(p.padded_numel, 0.0f);
  ZINF_RETURN_IF_ERROR(fill(id, full.data()).WithContext("values of '" + p.info.name + "'"));
  AlignedBuffer image(RoundUp(layout.PartBytes(id), 4096));
  if (image.data == nullptr) {
    return Status::ResourceExhausted("values of '" + p.info.name + "': a buffer of " +
                                     FormatBytes(layout.PartBytes(id)));
  }
  ZINF_RETURN_IF_ERROR(EncodeFrozen(
      id, full.data() + static_cast<size_t>(rank) * p.info.partition_numel, image.data));
  *wrote = true;  // from here on the store may hold part of the new values
  ZINF_RETURN_IF_ERROR(param_store->WriteFrozen(id, image.data, image.bytes));
  param_store->set_value_hash(id, ValueHash(full.data(), p.info.numel));
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
  for (ParamId id = 0; id < layout.num_params() && filled.ok(); ++id) {
    if (!wanted[id]) continue;
    const ParamLayout& p = layout.param(id);
    full.assign(p.padded_numel, 0.0f);
    filled = fill(id, full.data()).WithContext("values of '" + p.info.name + "'");
    text += "the values set for '" + p.info.name +
            "' (xxh3): " + HashHex(XXH3_64bits(full.data(), p.info.numel * sizeof(float))) + "\n";
  }
  ZINF_RETURN_IF_ERROR(collectives->Agree(filled, "SetParameterValues"));
  return AgreeAcrossRanks(
      collectives.get(), world, "the parameter values being set", text,
      "Nothing was set. Every rank must set the same parameters to the same values (each "
      "rank keeps its own partition of a parameter): write them on every rank alike, or "
      "compute them on one rank and broadcast them first.");
}

Status Engine::SetParameterValues(const std::vector<ParamId>& ids,
                                  const std::function<Status(ParamId, float*)>& fill) {
  Impl& m = *impl_;
  if (!fill) return Status::InvalidArgument("SetParameterValues: no fill function");
  std::vector<uint8_t> wanted(m.layout.num_params(), 0);
  for (ParamId id : ids) {
    if (id >= m.layout.num_params()) {
      return Status::InvalidArgument("SetParameterValues: unknown parameter id " +
                                     std::to_string(id));
    }
    if (wanted[id]) {
      return Status::InvalidArgument("SetParameterValues: parameter '" +
                                     m.layout.param(id).info.name + "' is listed twice");
    }
    wanted[id] = 1;
  }
  if (!m.registered) ZINF_RETURN_IF_ERROR(FinishRegistration());
  ZINF_RETURN_IF_ERROR(m.CheckBetweenSteps("SetParameterValues"));
  ZINF_RETURN_IF_ERROR(m.budget->ReclaimScratch());
  if (m.world > 1) ZINF_RETURN_IF_ERROR(m.CompareValuesToSet(ids.size(), wanted, fill));
  ZINF_RETURN_IF_ERROR(m.collectives->Agree(m.FinishPendingUpdate(), "SetParameterValues"));
  m.gather_states.reset();
  size_t group_bytes = 0;
  Status local;
  bool changed = false;  // some value was written
  for (ParamId id = 0; id < m.layout.num_params() && local.ok(); ++id) {
    if (!wanted[id]) continue;
    local = m.fetch->Evict(id);  // a fetched copy holds the old values
    if (local.ok() && !m.layout.param(id).info.trainable) {
      bool wrote = false;
      local = m.SetFrozen(id, fill, &wrote);  // its store alone
      changed = changed || wrote;
      continue;
    }
    group_bytes =
        std::max(group_bytes, m.layout.GroupStateBytes(m.layout.param(id).info.sub_group));
  }
  if (local.ok() && group_bytes > 0) {
    HostStates host;
    local = AllocateHostStates(m.arena.get(), group_bytes, &host);
    std::vector<float> full;
    for (size_t gi = 0; gi < m.layout.num_groups() && local.ok(); ++gi) {
      const GroupLayout& g = m.layout.group(gi);
      if (g.frozen ||
          std::none_of(g.params.begin(), g.params.end(), [&](ParamId id) { return wanted[id]; })) {
        continue;
      }
      float* master = static_cast<float*>(host.data());
      local = m.states->Read(gi, master);
      for (size_t j = 0; j < g.params.size() && local.ok(); ++j) {
        const ParamLayout& p = m.layout.param(g.params[j]);
        if (!wanted[g.params[j]]) continue;
        full.assign(p.padded_numel, 0.0f);
        local = fill(g.params[j], full.data()).WithContext("values of '" + p.info.name + "'");
        if (local.ok()) {
          std::memcpy(master + p.slice_offset,
                      full.data() + static_cast<size_t>(m.rank) * p.info.partition_numel,
                      p.info.partition_numel * sizeof(float));
        }
      }
      if (local.ok()) {
        changed = true;
        local = m.WriteGroupStates(gi, master, m.param_store->Buf(m.clock.visible()));
      }
    }
  }
  Status agreed = m.collectives->Agree(local, "SetParameterValues");
  if (!agreed.ok()) {
    // Some rank may hold new values in part of its sub-groups: the model is neither the old
    // one nor the new one.
    if (changed || m.world > 1) {
      return m.Break("SetParameterValues failed part-way", agreed,
                     "; recreate the engine and load again");
    }
    return agreed;
  }
  // Set alike on every rank (compared above): no longer the initial values to compare.
  for (ParamId id : ids) {
    if (id < m.initial_hashes.size()) m.initial_hashes[id] = 0;
  }
  // Durable: the new values are a new history, committed at once.
  m.durable->NewLineage(m.clock.step());
  Status committed = m.durable->Commit(m.clock.step(), m.clock.visible());
  if (!committed.ok()) {
    return m.Break("the durable swap store could not commit the loaded values", committed,
                   "; resume from its last commit");
  }
  return Status::OK();
}

int64_t Engine::param_updates(ParamId id) const {
  const Impl& m = *impl_;
  m.layout.params().at(id);  // throws std::out_of_range on a bad id, as documented
  if (!m.registered) return 0;
  // The optimizer thread counts the updates of a step still running (delayed update): wait
  // for it. A failed step's count is what it reached; that failure is reported by the calls
  // that run steps, so it is not repeated here.
  (void)m.board->WaitDone(
      m.clock.step());  // safe: the failure is the step-running calls' to report
  return m.states->updates(id);
}

Status Engine::SetLearningRate(float lr) {
  if (!std::isfinite(lr) || lr < 0) {
    return Status::InvalidArgument("SetLearningRate: the learning rate must be finite and >= 0");
  }
  for (ParamGroupHyper& g : impl_->groups) g.lr = lr;
  return Status::OK();
}

Status Engine::SetParamGroup(size_t group, const ParamGroupHyper& hp) {
  Impl& m = *impl_;
  const std::string where = "parameter group " + std::to_string(group);
  if (group > m.groups.size()) {
    return Status::InvalidArgument("SetParamGroup: " + where + " is beyond the next one (" +
                                   std::to_string(m.groups.size()) + "); add the groups in order");
  }
  if (group == m.groups.size() && m.registered) {
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
    const bool lion = m.config.optimizer.type == OptimizerType::kLion;
    if (!std::isfinite(v) || v < 0 || (beta && (lion ? v > 1 : v >= 1))) {
      return Status::InvalidArgument("SetParamGroup: " + where + ": " + key + " = " +
                                     std::to_string(v) + " must be finite and " +
                                     (beta ? (lion ? "in [0, 1]" : "in [0, 1)") : ">= 0"));
    }
  }
  if (group == m.groups.size()) {
    m.groups.push_back(hp);
  } else {
    m.groups[group] = hp;
  }
  return Status::OK();
}

size_t Engine::num_param_groups() const { return impl_->groups.size(); }

ParamGroupHyper Engine::param_group(size_t group) const { return impl_->groups.at(group); }

int64_t Engine::global_step() const { return impl_->clock.step(); }
int Engine::rank() const { return impl_->rank; }
int Engine::world_size() const { return impl_->world; }
size_t Engine::num_params() const { return impl_->layout.num_params(); }
const ParamInfo& Engine::param(ParamId id) const { return impl_->layout.params().at(id).info; }
const EngineConfig& Engine::config() const { return impl_->config; }

}  // namespace zinf
