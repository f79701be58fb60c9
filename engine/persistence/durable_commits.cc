#include "engine/persistence/durable_commits.h"

#include <xxhash.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "formats/checkpoint_format.h"
#include "zinf/log.h"

namespace zinf {

namespace {
const char* StorageName(const EngineConfig& c) { return StoredParamName(c); }

// The FailedPrecondition of a store that another model or configuration wrote.
Status StoreMismatch(const std::string& what) {
  return Status::FailedPrecondition(
      "ResumeFromStore: the swap store was written by a different model or configuration: " + what);
}

// The settings the store was written with (format, ranks, delayed update, optimizer, parameter
// and state dtypes) against this engine's. Throws nlohmann::json::exception on a missing or
// mistyped field (CommitRecord::Check reports it).
Status CheckWriterSettings(const nlohmann::json& j, const EngineConfig& config,
                           const Layout& layout, int world) {
  const bool delayed = config.delayed_update;
  if (j.at("format").get<std::string>() != "zinf-durable-1") {
    return StoreMismatch("unknown format");
  }
  if (const int saved = j.at("world").get<int>(); saved != world) {
    return StoreMismatch("written by " + std::to_string(saved) + " ranks, this engine is one of " +
                         std::to_string(world) +
                         "; a durable store resumes only with the number of ranks that wrote "
                         "it (resume with " +
                         std::to_string(saved) +
                         " and save a checkpoint: checkpoints load into any number of ranks)");
  }
  if (j.value("delayed", false) != delayed) {
    return StoreMismatch(std::string("zinf.delayed_update was ") + (delayed ? "off" : "on") +
                         " (the parameter stores are laid out per setting)");
  }
  const std::string opt = j.at("optimizer").get<std::string>();
  if (opt != OptimizerTypeName(config.optimizer.type)) {
    return StoreMismatch("optimizer " + opt + ", this engine runs " +
                         OptimizerTypeName(config.optimizer.type));
  }
  const std::string storage = j.at("storage").get<std::string>();
  if (storage != StorageName(config)) {
    return StoreMismatch("parameters stored as " + storage + ", this engine stores " +
                         StorageName(config) + " (the bf16 / fp16 settings differ)");
  }
  // Commits from before compressed states have none: fp32.
  const std::string states = j.value("state_dtype", std::string("fp32"));
  if (states != StateTypeName(layout.state_type())) {
    return StoreMismatch("optimizer states stored as " + states + ", this engine keeps " +
                         StateTypeName(layout.state_type()) + " (zinf.optimizer_state_dtype)");
  }
  return Status::OK();
}

// The record's "params" against this model's: the same parameters, trainable or frozen as
// then, cut the same way. Throws nlohmann::json::exception on a missing or mistyped field.
Status CheckParamLayouts(const nlohmann::json& ps, const std::vector<ParamLayout>& params) {
  if (ps.size() != params.size()) {
    return StoreMismatch(std::to_string(ps.size()) + " parameters, this model registers " +
                         std::to_string(params.size()));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamLayout& p = params[i];
    // Which parameters train must be what the store was written with (a commit from before
    // frozen parameters were recorded kept states for all of them).
    const bool was_frozen = ps[i].size() >= 7 && ps[i].at(6).is_string();
    if (ps[i].at(0).get<std::string>() == p.info.name && was_frozen == p.info.trainable) {
      return StoreMismatch(
          "parameter '" + p.info.name + "' was " + (was_frozen ? "frozen" : "trainable") +
          " when the store was written and is " + (was_frozen ? "trainable" : "frozen") +
          " now; resume with the same trainable set (or load a checkpoint's values "
          "by name into a fresh run)");
    }
    if (ps[i].at(0).get<std::string>() != p.info.name ||
        ps[i].at(1).get<size_t>() != p.info.numel ||
        ps[i].at(2).get<size_t>() != p.info.partition_numel ||
        ps[i].at(3).get<size_t>() != p.info.sub_group ||
        ps[i].at(4).get<size_t>() != p.slice_offset) {
      return StoreMismatch(
          "parameter " + std::to_string(i) + " is '" + ps[i].at(0).get<std::string>() + "' with " +
          std::to_string(ps[i].at(1).get<size_t>()) + " elements in parts of " +
          std::to_string(ps[i].at(2).get<size_t>()) + ", this model has '" + p.info.name +
          "' with " + std::to_string(p.info.numel) + " in parts of " +
          std::to_string(p.info.partition_numel) +
          " (same sub_group_size? int8 frozen weights are cut on their block grid since "
          "issue 38: a store written before cannot resume them; load a checkpoint instead)");
    }
  }
  return Status::OK();
}

// The commit's step, parameter version, lineage, parameter tier, user data, and each
// parameter's update count and frozen value hash, into *out (filled as read, so partly on an
// error). Throws nlohmann::json::exception on a missing or mistyped field.
Status ReadCommitPoint(const nlohmann::json& j, const nlohmann::json& ps,
                       const std::vector<ParamLayout>& params, CommitRecord::Point* out) {
  out->step = j.at("step").get<int64_t>();
  out->visible = j.value("visible", out->step);
  out->lineage = j.value("lineage", uint64_t{0});
  out->param_keys = j.at("param_tier").get<std::string>() == "nvme";
  out->user_data = j.value("user_data", std::string());
  if (j.contains("loss_scale")) {
    const nlohmann::json& l = j.at("loss_scale");
    CheckpointLossScale s;
    s.scale = l.at(0).get<double>();
    s.iteration = l.at(1).get<uint64_t>();
    s.last_overflow = l.at(2).get<int64_t>();
    s.hysteresis_left = l.at(3).get<int64_t>();
    s.skipped_steps = l.at(4).get<uint64_t>();
    out->loss_scale = s;
  }
  if (out->step < 0) return StoreMismatch("negative step");
  if (out->visible > out->step || out->visible < out->step - 1 || out->visible < 0) {
    return StoreMismatch("parameter version " + std::to_string(out->visible) + " at step " +
                         std::to_string(out->step));
  }
  out->updates.assign(params.size(), out->step);
  out->frozen_hashes.assign(params.size(), 0);
  for (size_t i = 0; i < params.size(); ++i) {
    if (ps[i].size() < 6) continue;  // a commit from before per-parameter counts
    const int64_t u = ps[i].at(5).get<int64_t>();
    if (u < 0 || u > out->step) {
      return StoreMismatch("parameter '" + params[i].info.name + "' has " + std::to_string(u) +
                           " updates at step " + std::to_string(out->step));
    }
    out->updates[i] = u;
    if (ps[i].size() >= 7 && ps[i].at(6).is_string()) {
      Result<uint64_t> h = ParseHashHex(ps[i].at(6).get<std::string>());
      if (!h.ok())
        return Status::Corruption("ResumeFromStore: the commit record's hash of '" +
                                  params[i].info.name + "' is not 16 hex digits");
      out->frozen_hashes[i] = *h;
    }
  }
  return Status::OK();
}

}  // namespace

std::string CommitRecord::Meta(int64_t at_step, int64_t at_visible, uint64_t lineage,
                               const std::vector<int64_t>& updates,
                               const std::vector<uint64_t>& hashes, const std::string& user_data,
                               const std::optional<CheckpointLossScale>& loss_scale) const {
  nlohmann::json j;
  j["format"] = "zinf-durable-1";
  j["step"] = at_step;
  j["visible"] = at_visible;
  j["delayed"] = config_->delayed_update;
  j["lineage"] = lineage;
  j["world"] = world_;
  j["optimizer"] = OptimizerTypeName(config_->optimizer.type);
  j["storage"] = StorageName(*config_);
  j["state_dtype"] = StateTypeName(layout_->state_type());
  j["param_tier"] = config_->offload_param.tier == Tier::kNvme ? "nvme" : "memory";
  nlohmann::json ps = nlohmann::json::array();
  for (ParamId id = 0; id < layout_->num_params(); ++id) {
    const ParamLayout& p = layout_->param(id);
    // The 7th element: a frozen parameter's value hash (hex), null for a trainable one.
    nlohmann::json frozen = nullptr;
    if (!p.info.trainable) frozen = HashHex(hashes[id]);
    ps.push_back({p.info.name, p.info.numel, p.info.partition_numel, p.info.sub_group,
                  p.slice_offset, updates[id], frozen});
  }
  j["params"] = ps;
  if (!user_data.empty()) j["user_data"] = user_data;
  if (loss_scale.has_value()) {
    j["loss_scale"] = {loss_scale->scale, loss_scale->iteration, loss_scale->last_overflow,
                       loss_scale->hysteresis_left, loss_scale->skipped_steps};
  }
  return j.dump();
}

Status CommitRecord::Check(const std::string& meta, Point* out) const {
  if (meta.empty()) {
    return Status::NotFound("ResumeFromStore: the swap store has no commit to resume from");
  }
  nlohmann::json j = nlohmann::json::parse(meta, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return Status::Corruption("ResumeFromStore: the store's commit record is not valid JSON");
  }
  try {
    ZINF_RETURN_IF_ERROR(CheckWriterSettings(j, *config_, *layout_, world_));
    const nlohmann::json& ps = j.at("params");
    ZINF_RETURN_IF_ERROR(CheckParamLayouts(ps, layout_->params()));
    ZINF_RETURN_IF_ERROR(ReadCommitPoint(j, ps, layout_->params(), out));
  } catch (const nlohmann::json::exception& ex) {
    return Status::Corruption(std::string("ResumeFromStore: the store's commit record is "
                                          "missing a field (") +
                              ex.what() + ")");
  }
  return Status::OK();
}

Status DurableCommits::Commit(int64_t at_step, int64_t at_visible) {
  if (!config_->durable) return Status::OK();
  std::vector<int64_t> updates(record_.num_params());
  for (ParamId id = 0; id < updates.size(); ++id) updates[id] = states_->updates(id);
  std::optional<CheckpointLossScale> loss_scale;
  {
    MutexLock lock(&mu_);
    auto it = loss_scales_.upper_bound(at_step);
    if (it != loss_scales_.begin()) {
      loss_scale = std::prev(it)->second;
      loss_scales_.erase(loss_scales_.begin(), std::prev(it));  // (older ones are not needed)
    }
  }
  return swap_
      ->Commit(record_.Meta(at_step, at_visible, lineage_, updates, params_->value_hashes(),
                            user_data_, loss_scale))
      .WithContext("committing the durable swap store at step " + std::to_string(at_step));
}

void DurableCommits::RecordLossScale(int64_t step, const CheckpointLossScale& state) {
  if (!config_->durable) return;  // (no commit would take it)
  MutexLock lock(&mu_);
  // (Records after `step` are of a history a load or resume left.)
  loss_scales_.erase(loss_scales_.upper_bound(step), loss_scales_.end());
  loss_scales_[step] = state;
}

void DurableCommits::NewLineage(int64_t step) {
  const uint64_t parts[2] = {lineage_, static_cast<uint64_t>(step)};
  lineage_ = XXH3_64bits_withSeed(parts, sizeof(parts), 0x7a696e66) | 1;
}

Result<CommitRecord::Agreement> CommitRecord::AgreeOnCommit(
    HostCollectives* collectives, int rank, const std::vector<std::string>& paths) const {
  // This rank's last and previous commits as (step, lineage); step -1: none; a step below
  // -100 encodes the StatusCode of a store this rank cannot read.
  int64_t mine[4] = {-1, 0, -1, 0};
  Status local;
  Result<std::vector<std::string>> metas = SwapStore::ListCommits(paths);
  if (!metas.ok()) local = metas.status();
  for (size_t i = 0; local.ok() && i < std::min<size_t>(2, metas->size()); ++i) {
    Point point;
    local = Check((*metas)[i], &point);
    mine[2 * i] = point.step;
    mine[2 * i + 1] = static_cast<int64_t>(point.lineage);
  }
  if (!local.ok()) mine[0] = mine[2] = -100 - static_cast<int64_t>(local.code());
  std::vector<int64_t> all(4 * static_cast<size_t>(world_));
  if (world_ == 1) {
    std::copy(mine, mine + 4, all.begin());
  } else {
    // Every rank takes part, a failed one too, so that none waits for it.
    ZINF_RETURN_IF_ERROR(collectives->AllGather(mine, all.data(), sizeof(mine),
                                                "ResumeFromStore: agreeing on a commit with the "
                                                "other ranks"));
  }
  ZINF_RETURN_IF_ERROR(local.WithContext("ResumeFromStore"));
  Agreement a;
  bool none = true;  // no rank holds a commit (and none failed: checked in ChooseCommit)
  for (int r = 0; r < world_; ++r) none = none && all[4 * r] == -1;
  if (none) {
    LogInfo("rank " + std::to_string(rank) + ": the durable swap store in " + paths[0] +
            " never committed a step (its run stopped while initialising): nothing to keep, "
            "starting at step 0");
    a.fresh = true;
    return a;
  }
  ZINF_ASSIGN_OR_RETURN(CommitChoice choice, ChooseCommit(all, rank));
  if (choice.previous) {
    LogInfo("rank " + std::to_string(rank) + ": resuming at step " + std::to_string(choice.step) +
            ", the commit before its last (step " + std::to_string(all[4 * rank]) +
            "), which every rank holds");
  }
  a.previous = choice.previous;
  return a;
}

Result<CommitChoice> ChooseCommit(const std::vector<int64_t>& all, int rank) {
  const int world = static_cast<int>(all.size() / 4);
  for (int r = 0; r < world; ++r) {
    if (all[4 * r] <= -100) {  // every rank reports the failed rank's code
      return Status(static_cast<StatusCode>(-100 - all[4 * r]),
                    "ResumeFromStore: rank " + std::to_string(r) +
                        " cannot resume from its swap store (its error names the cause)");
    }
  }
  // The commit every rank holds (as its last or previous one), the latest such. Ranks commit
  // at most one step apart, so there is one unless the stores come from different runs (or
  // different histories: a checkpoint load one rank committed and another did not).
  auto holds = [&](int r, int64_t step, int64_t lin) {
    return (all[4 * r] == step && all[4 * r + 1] == lin) ||
           (all[4 * r + 2] == step && all[4 * r + 3] == lin);
  };
  int64_t agreed = -1, agreed_lineage = 0;
  for (int r = 0; r < world; ++r) {
    for (int k = 0; k < 2; ++k) {
      const int64_t step = all[4 * r + 2 * k], lin = all[4 * r + 2 * k + 1];
      if (step < 0 || step <= agreed) continue;
      bool everyone = true;
      for (int q = 0; q < world && everyone; ++q) everyone = holds(q, step, lin);
      if (everyone) {
        agreed = step;
        agreed_lineage = lin;
      }
    }
  }
  if (agreed < 0) {
    std::string held;
    for (int r = 0; r < world; ++r) {
      held += (r ? "; rank " : "rank ") + std::to_string(r) + " at step " +
              std::to_string(all[4 * r]) +
              (all[4 * r + 2] >= 0 ? " (previous " + std::to_string(all[4 * r + 2]) + ")" : "");
    }
    return Status::FailedPrecondition(
        "ResumeFromStore: the ranks' swap stores have no commit in common (" + held +
        "); they come from different runs or histories: resume from a checkpoint or start "
        "afresh");
  }
  CommitChoice choice;
  choice.step = agreed;
  choice.lineage = static_cast<uint64_t>(agreed_lineage);
  choice.previous = !(all[4 * rank] == agreed && all[4 * rank + 1] == agreed_lineage);
  return choice;
}

Status CommitRecord::ExplainExisting(const std::vector<std::string>& paths) {
  std::string held;
  Result<std::vector<std::string>> commits = SwapStore::ListCommits(paths);
  if (commits.ok() && !commits->empty()) {
    nlohmann::json j = nlohmann::json::parse(commits->front(), nullptr, false);
    if (j.is_object() && j.contains("step")) {
      held = "a durable store committed at step " + j["step"].dump();
    }
  } else if (!commits.ok()) {
    held = "a store that cannot be reopened (" + commits.status().message() + ")";
  }
  return Status::AlreadyExists(
      "the swap folders (" + paths[0] + (paths.size() > 1 ? ", ..." : "") + ") hold " +
      (held.empty() ? std::string("another swap store") : held) +
      "; nothing was changed: resume it (Engine::ResumeFromStore; zinf-train --resume) or "
      "replace it (zinf.durable_overwrite; zinf-train --overwrite)");
}

}  // namespace zinf
