// The durable mode's commits: what a commit records (the step, the parameter version the
// next micro-step reads, the layout, each parameter's update count, the history it belongs
// to), its check at resume, and the agreement of all ranks on the commit to reopen.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/thread_annotations.h"
#include "engine/core/engine_context.h"
#include "engine/core/host_collectives.h"
#include "engine/core/layout.h"
#include "engine/core/param_store.h"
#include "engine/core/state_store.h"
#include "formats/checkpoint_format.h"
#include "zinf/config.h"
#include "zinf/swap.h"

namespace zinf {

// The commit every rank reopens at, from what each holds: `all[4 r .. 4 r + 3]` is rank r's
// (last step, its lineage, previous step, its lineage); a step of -1: none; a step at or below
// -100 encodes the StatusCode of a store rank r cannot read (that code is returned). The
// latest commit (step and lineage) every rank holds, and whether `rank` reopens at its
// previous one; FailedPrecondition when there is none. Pure.
struct CommitChoice {
  int64_t step = -1;
  uint64_t lineage = 0;
  bool previous = false;
};
Result<CommitChoice> ChooseCommit(const std::vector<int64_t>& all, int rank);

// What a durable commit records (the step, the parameter version the next micro-step reads,
// the layout, each parameter's update count, the history, the trainer's text) and its check
// against this engine; and, before a store is reopened, the commit every rank agrees on.
// Over the layout and the configuration only: usable before the swap store exists.
class CommitRecord {
 public:
  CommitRecord(const Layout* layout, const EngineConfig* config, int world)
      : layout_(layout), config_(config), world_(world) {}

  // The record of a commit at `at_step` whose next micro-step reads version `at_visible`.
  // `hashes`: each frozen parameter's value hash (ParamStore::value_hash; 0 for trainable).
  std::string Meta(int64_t at_step, int64_t at_visible, uint64_t lineage,
                   const std::vector<int64_t>& updates, const std::vector<uint64_t>& hashes,
                   const std::string& user_data,
                   const std::optional<CheckpointLossScale>& loss_scale) const;
  // What the commit `meta` holds, checked against this engine's layout and configuration.
  struct Point {
    int64_t step = 0;
    int64_t visible = 0;
    bool param_keys = false;  // the commit holds NVMe parameter stores
    uint64_t lineage = 0;
    std::vector<int64_t> updates;  // each parameter's update count
    // Each frozen parameter's value hash as committed (0: trainable, or a commit from before
    // frozen parameters were recorded); the resume compares it with the values registered.
    std::vector<uint64_t> frozen_hashes;
    std::string user_data;                          // the trainer's record (SetCommitUserData)
    std::optional<CheckpointLossScale> loss_scale;  // an fp16 engine's scaler after the step
  };
  Status Check(const std::string& meta, Point* point) const;

  // ResumeFromStore: the commit every rank reopens at. Each rank's store (in `paths`, its
  // folders in order) holds its last commit and, with more than one rank, the one before;
  // ranks commit at most one step apart, so the earliest last commit is held by all.
  // `previous`: this rank reopens at its previous one. `fresh`: no rank's store ever
  // committed (the run stopped while initialising): there is nothing to keep, the engine
  // starts at step 0. NotFound when a rank's folders hold no store. A collective.
  struct Agreement {
    bool previous = false;
    bool fresh = false;
  };
  Result<Agreement> AgreeOnCommit(HostCollectives* collectives, int rank,
                                  const std::vector<std::string>& paths) const;
  // A fresh store was refused (AlreadyExists) because `paths` hold one: what they hold, with
  // the step that store committed when it can be read, and the engine's ways out.
  static Status ExplainExisting(const std::vector<std::string>& paths);
  size_t num_params() const { return layout_->num_params(); }

 private:
  const Layout* const layout_;
  const EngineConfig* const config_;
  const int world_;
};

// The durable mode's commits of this engine's swap store.
class DurableCommits {
 public:
  DurableCommits(const EngineContext& ctx, const StateStore* states, const ParamStore* params)
      : record_(ctx.layout, ctx.config, ctx.comm->world_size()),
        config_(ctx.config),
        states_(states),
        params_(params),
        swap_(ctx.swap) {}

  const CommitRecord& record() const { return record_; }
  // Publishes the swap store's writes as step `at_step` (no-op unless durable). Called by the
  // trainer thread at Step() (or between steps), or, for a delayed step, by the optimizer
  // thread once the step's update is written (the next one has not begun).
  Status Commit(int64_t at_step, int64_t at_visible);

  // Durable: which history the commits belong to. 0 for a fresh start; every checkpoint load
  // or set of new values derives a new one (the same on every rank), so that a resume never
  // mixes a rank's commit from before it with another's from after it at the same step.
  uint64_t lineage() const { return lineage_; }
  void set_lineage(uint64_t l) { lineage_ = l; }
  void NewLineage(int64_t step);
  // The trainer's text recorded with every commit (Engine::SetCommitUserData).
  void set_user_data(std::string text) { user_data_ = std::move(text); }
  // fp16: the loss scaler's state after step `step`'s update (the trainer thread, at its
  // boundary Step), recorded with the commit of that step, which with the delayed update the
  // optimizer thread makes after the trainer has gone on to update the scaler again. A commit
  // records the latest state recorded at or before its step.
  void RecordLossScale(int64_t step, const CheckpointLossScale& state) EXCLUDES(mu_);

 private:
  const CommitRecord record_;
  const EngineConfig* const config_;
  const StateStore* const states_;
  const ParamStore* const params_;
  SwapStore* const swap_;
  uint64_t lineage_ = 0;
  std::string user_data_;
  Mutex mu_;
  std::map<int64_t, CheckpointLossScale> loss_scales_ GUARDED_BY(mu_);
};

}  // namespace zinf
