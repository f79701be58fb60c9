#include "engine/optimizer_pipeline.h"

#include <algorithm>
#include <chrono>
#include <functional>

#include "engine/core/memory_plan.h"
#include "zinf/crash_point.h"

namespace zinf {

using Clock = std::chrono::steady_clock;

namespace {
double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}
}  // namespace

OptimizerPipeline::~OptimizerPipeline() { Join(); }

OptimizerPipeline::OptimizerPipeline(const EngineContext& ctx, const Parts& parts)
    : ctx_(ctx),
      m_(parts),
      speculation_(ctx_, parts.states, parts.snapshot_pool, parts.optimizer) {}

Status OptimizerPipeline::Start() {
  try {
    thread_ = std::thread([this] { Loop(); });
  } catch (const std::system_error& e) {
    return Status::ResourceExhausted(std::string("starting the optimizer thread: ") + e.what());
  }
  return Status::OK();
}

void OptimizerPipeline::Join() {
  if (thread_.joinable()) thread_.join();
}

void OptimizerPipeline::Loop() {
  OptimizerTask task;
  while (ctx_.board->NextTask(&task)) {
    Status s = Run(task);
    // A delayed step's commit: its writes are complete and the next task's have not begun.
    // The micro-step after it reads the version before it. Never after a failed task: the
    // states it left (sub-groups not stepped) must not be published by a later one. Nor after
    // a failed norm: that task stepped nothing (it is no optimizer failure), and the step it
    // would publish never happened.
    if (s.ok() && ctx_.config->durable && StepClock::DelayedStep(*ctx_.config, task.step) &&
        !ctx_.board->NormFailed(task.step)) {
      s = ctx_.board->failed() ? Status::FailedPrecondition(
                                     "not committing step " + std::to_string(task.step) +
                                     " of the durable store: an earlier optimizer step failed")
                               : m_.durable->Commit(task.step, task.step - 1);
    }
    ctx_.board->FinishTask(task.step, s);
  }
}

struct OptimizerPipeline::TaskRun {
  TaskRun(OptimizerPipeline* p, const OptimizerTask& t)
      : pipeline(p),
        task(t),
        order(p->ctx_.layout->GroupOrder()),
        window(p->ctx_, p->m_.states, p->m_.state_pool, &order,
               std::max<uint32_t>(p->ctx_.config->offload_optimizer.buffer_count, 3), &first) {}
  // However the task ends: sub-groups still speculated (a failure, the norm's or another's, or
  // shutdown) are rolled back, then the window drains.
  ~TaskRun() { Drain(); }
  void Drain() {
    if (drained) return;
    drained = true;
    pipeline->Settle(this, 1.0f, /*roll_back=*/true);
    window.Drain();
  }

  OptimizerPipeline* const pipeline;
  const OptimizerTask& task;
  const std::vector<size_t> order;  // the sub-groups, in backward order
  Status first;                     // the task's first failure
  StateWindow window;
  // Speculate in this task: "auto" does not in the step after one that clipped (clipping
  // tends to come in runs, early training or a spike, where every speculated sub-group would
  // be stepped twice).
  bool may_speculate = false;
  bool drained = false;
};

Status OptimizerPipeline::Run(const OptimizerTask& task) {
  TaskRun run(this, task);
  run.may_speculate = task.needs_norm && speculation_.enabled() &&
                      (ctx_.config->speculative_step == SpeculativeStep::kOn || !last_clipped_);
  for (size_t k = 0; k < run.order.size(); ++k) {
    Status s = StepNext(&run, k);
    // A failure that stops the task, or the norm failed (VerdictFailed drained the task):
    // nothing else is stepped.
    if (!s.ok() || run.drained) return s;
  }
  if (!speculation_.empty() && run.first.ok()) {
    float coef = 1.0f;
    bool known = false, skipped = false;
    Status v = ctx_.board->Verdict(task, /*wait=*/true, &coef, &known, &skipped);
    if (!v.ok()) return VerdictFailed(&run, v);
    Settle(&run, coef, skipped);
  }
  float coef = 1.0f;
  bool known = false, skipped = false;
  // (Only reads the verdict; a failed one has been handled above.)
  if (task.needs_norm && ctx_.board->Verdict(task, /*wait=*/false, &coef, &known, &skipped).ok() &&
      known) {
    last_clipped_ = !skipped && coef < task.unscale;
  }
  run.Drain();
  return run.first;
}

Status OptimizerPipeline::StepNext(TaskRun* run, size_t k) {
  const OptimizerTask& task = run->task;
  GroupStep plan;
  plan.task = &task;
  plan.gi = run->order[k];
  const size_t gi = plan.gi;
  // A verdict that came meanwhile settles what was speculated so far.
  if (!speculation_.empty()) {
    float coef = 1.0f;
    bool known = false, skipped = false;
    Status v = ctx_.board->Verdict(task, /*wait=*/false, &coef, &known, &skipped);
    if (!v.ok()) return VerdictFailed(run, v);
    // (A skipped step rolls back what was speculated; the sub-groups after step nothing.)
    if (known) Settle(run, coef, skipped);
  }
  run->window.MakeRoomForRead();
  ZINF_RETURN_IF_ERROR(run->window.ReadAhead());
  const bool device_params = ctx_.config->offload_param.tier == Tier::kDevice;
  const bool on_device = ctx_.layout->group(gi).on_device && device_params;
  // Wait for this sub-group's gradients (and, with clipping, the global norm, unless a
  // snapshot block is free to step it speculatively). Without clipping a sub-group whose last
  // gradient is landing piece by piece is stepped as it lands (its accumulators are released
  // only once it has landed whole).
  const bool speculate = run->may_speculate && !on_device && speculation_.CanTake(gi);
  Result<GradientWindow::ReadyGroup> ready = m_.grads->WaitReady(gi, task, speculate);
  if (!ready.ok()) return VerdictFailed(run, ready.status());
  plan.coef = ready->coef;
  plan.with_grad = std::move(ready->with_grad);
  plan.landing = ready->partial;
  plan.grads = ready->grads;
  const bool coef_known = ready->coef_known;
  if (on_device != ready->on_device) {
    run->first.Update(Status::Internal("sub-group " + std::to_string(gi) + " is stepped on the " +
                                       (on_device ? "device" : "host") + " with gradients on the " +
                                       (ready->on_device ? "device" : "host")));
    // (A gradient still landing piece by piece goes on writing the accumulators Release
    // gives back: wait for it first.)
    if (plan.landing >= 0) run->first.Update(m_.grads->WaitLanded(gi, task.step, SIZE_MAX));
    MarkStepped(gi, task.step);
    return Status::OK();
  }
  if (on_device) {
    // The device steps it and writes the parameters straight into their device stores.
    run->first.Update(StepGroupOnDevice(plan));
    MarkStepped(gi, task.step);
    CrashPoint("optimizer.group");
    return Status::OK();
  }
  PooledBlock states;
  float* master = m_.states->resident_states(gi);
  if (m_.states->on_nvme(gi)) {
    Result<PooledBlock> read = run->window.TakeRead(gi);
    if (!read.ok()) {
      run->first.Update(read.status());
      if (plan.landing >= 0) run->first.Update(m_.grads->WaitLanded(gi, task.step, SIZE_MAX));
      MarkStepped(gi, task.step);
      return Status::OK();  // this sub-group keeps its old values; the step reports the failure
    }
    states = std::move(read).value();
    master = static_cast<float*>(states.data());
  }
  // The last sub-groups of an undelayed step: the next forward waits for their parameters,
  // and no later step would run under their copies (the last but one's are still going when
  // the last starts), so they go out piece by piece as these step.
  plan.upload_pieces =
      device_params && !ctx_.config->delayed_update && k + kPiecedLastGroups >= run->order.size();
  const bool any_grad =
      std::find(plan.with_grad.begin(), plan.with_grad.end(), 1) != plan.with_grad.end();
  if (!coef_known && any_grad) return StepSpeculatively(run, &plan, master, std::move(states));
  // (No gradient in the sub-group, or the coefficient known: nothing to speculate. With
  // clipping the norm's finite check covered the gradients.)
  plan.check_finite = !task.needs_norm;
  run->first.Update(StepAndWrite(run, &plan, master, std::move(states)));
  if (plan.landing >= 0) {
    ctx_.stats->CountLanding();
    // (A failure may have stopped the step before every piece had landed, above or at the
    // state read: the trainer is still copying into the accumulators MarkStepped releases.)
    run->first.Update(m_.grads->WaitLanded(gi, task.step, SIZE_MAX));
  }
  // Every gradient of the sub-group has landed and been used: its accumulators can go.
  MarkStepped(gi, task.step);
  CrashPoint("optimizer.group");
  return Status::OK();
}

Status OptimizerPipeline::StepSpeculatively(TaskRun* run, GroupStep* plan, float* master,
                                            PooledBlock states) {
  // The pre-step values are kept, then the step runs with the coefficient of a norm that
  // neither clips nor overflows (1, or 1 / the loss scale with fp16; a non-finite gradient
  // leaves its tiles unstepped, and the norm will fail or skip the task).
  ZINF_ASSIGN_OR_RETURN(Speculation::Group g, speculation_.Begin(plan->gi, plan->with_grad));
  plan->coef = plan->task->unscale;
  plan->check_finite = true;
  plan->snapshot = g.snapshot.data();
  // (The step keeps each tile's pre-step values in the snapshot as it goes.)
  Status s = StepAndWrite(run, plan, master, std::move(states));
  if (plan->non_finite) {
    g.poisoned = true;
  } else {
    run->first.Update(s);
  }
  speculation_.Add(std::move(g));
  ctx_.stats->CountSpeculation(1, 0, 0, 0, 0);
  CrashPoint("optimizer.group");
  return Status::OK();
}

void OptimizerPipeline::Settle(TaskRun* run, float coef, bool roll_back) {
  if (speculation_.empty()) return;
  // The speculative write-backs and device copies read the buffers about to be restored, and
  // a redo writes the same keys: they finish first.
  run->window.RetireAll();
  run->window.SyncUpdates();
  Speculation::Actions actions;
  actions.restep = [&](size_t gi, float* master, PooledBlock states, float c,
                       const std::vector<uint8_t>& with_grad) {
    GroupStep plan;
    plan.task = &run->task;
    plan.gi = gi;
    plan.coef = c;
    plan.with_grad = with_grad;
    return StepAndWrite(run, &plan, master, std::move(states));
  };
  actions.after_restep = [&] { run->window.RetireBelow(run->window.buffers() - 1); };
  actions.settled = [&](size_t gi) { MarkStepped(gi, run->task.step); };
  speculation_.Resolve(coef, run->task.unscale, roll_back, actions, &run->first);
}

Status OptimizerPipeline::VerdictFailed(TaskRun* run, const Status& s) {
  if (!ctx_.board->NormFailed(run->task.step)) return s;
  run->Drain();
  return run->first;
}

void OptimizerPipeline::MarkStepped(size_t gi, int64_t step) { m_.grads->Release(gi, step); }

Status OptimizerPipeline::StepAndWrite(TaskRun* run, GroupStep* plan, float* master,
                                       PooledBlock states) {
  const size_t gi = plan->gi;
  StateWindow::Retiring done;
  done.states = std::move(states);
  if (StoredParamType(*ctx_.config) != ParamCopyType::kNone) {
    Result<PooledBlock> b = m_.copy_pool->Take();
    if (!b.ok()) {
      // Nothing stepped: a speculative snapshot gets the values as they are (whole).
      if (plan->snapshot != nullptr) {
        for (ParamId id : ctx_.layout->group(gi).params) {
          speculation_.KeepTiles(id, master, plan->snapshot, 0,
                                 ctx_.layout->param(id).info.partition_numel);
        }
      }
      return b.status().WithContext("16-bit parameter buffer");
    }
    done.copy = std::move(b).value();
  }
  Status s = StepGroup(plan, master, static_cast<uint16_t*>(done.copy.data()), &done.writes);
  if (s.ok() && m_.states->on_nvme(gi)) {
    Result<Ticket> w = ctx_.swap->Write(m_.states->swap_key(gi), done.states.data(),
                                        ctx_.layout->GroupStateBytes(gi), done.states.capacity());
    if (w.ok()) {
      done.writes.push_back(*w);
    } else {
      s = w.status();
    }
  }
  run->window.Retire(std::move(done));
  return s;
}

OptimizerHyperParams OptimizerPipeline::HyperParams(const OptimizerTask& task, float coef,
                                                    size_t group) const {
  OptimizerHyperParams hp;
  hp.kind = OptimizerKindFor(ctx_.config->optimizer.type);
  hp.step = task.step;
  // The engine checks each parameter's group when it is registered.
  const ParamGroupHyper& g = task.groups.at(group);
  hp.lr = g.lr;
  hp.beta1 = g.beta1;
  hp.beta2 = g.beta2;
  hp.eps = g.eps;
  hp.weight_decay = g.weight_decay;
  hp.grad_scale = coef;
  return hp;
}

Status OptimizerPipeline::NonFinite(ParamId id, int64_t step) const {
  return Status::FailedPrecondition(
      "the gradient of '" + ctx_.layout->param(id).info.name + "' in step " + std::to_string(step) +
      " holds inf or NaN: the optimizer stopped before writing it; lower the learning rate or "
      "look at the loss, then resume from the last checkpoint");
}

OptimizerTensors OptimizerPipeline::PartTensors(ParamId id, const OptimizerHyperParams& hp,
                                                float* states, const float* grad) const {
  const Layout& layout = *ctx_.layout;
  const ParamLayout& p = layout.param(id);
  const size_t gi = p.info.sub_group;
  char* const bytes = reinterpret_cast<char*>(states);
  void* const s1 = bytes + layout.StateRegionOffset(gi, 1) + layout.SliceStateOffset(id);
  void* const s2 = bytes + layout.StateRegionOffset(gi, 2) + layout.SliceStateOffset(id);
  OptimizerTensors t;
  t.param = states + p.slice_offset;
  t.grad = grad;
  t.grad_type = GradType::kF32;
  t.n = p.info.partition_numel;
  if (layout.state_type() != StateType::kF32) {
    // Compressed: Adagrad's sum is the kernel's state1, kept in state 2 as with fp32.
    t.state_type = layout.state_type();
    if (hp.kind == OptimizerKind::kAdagrad) {
      t.state1 = s2;
    } else {
      t.state1 = s1;
      if (hp.kind != OptimizerKind::kLion) t.state2 = s2;
    }
    return t;
  }
  if (hp.kind == OptimizerKind::kAdagrad) {
    t.sum = static_cast<float*>(s2);
  } else {
    t.exp_avg = static_cast<float*>(s1);
    if (hp.kind != OptimizerKind::kLion) t.exp_avg_sq = static_cast<float*>(s2);
  }
  return t;
}

Status OptimizerPipeline::CheckDeviceGradients(const GroupStep& plan, const float* grads) {
  const Layout& layout = *ctx_.layout;
  const GroupLayout& g = layout.group(plan.gi);
  Stream* stream = ctx_.streams.update;
  std::vector<GradStats> sums(g.params.size());
  Status queued;
  for (size_t j = 0; j < g.params.size() && queued.ok(); ++j) {
    const ParamLayout& p = layout.param(g.params[j]);
    if (!plan.with_grad[p.index_in_group]) continue;
    queued =
        ctx_.device->SumSquares(grads + p.slice_offset, p.info.partition_numel, &sums[j], stream);
  }
  // Even after a failure: the sums queued write into `sums` until the stream is done.
  Status synced = ctx_.device->SynchronizeStream(stream);
  ZINF_RETURN_IF_ERROR(
      queued.WithContext("checking the gradients of sub-group " + std::to_string(plan.gi)));
  ZINF_RETURN_IF_ERROR(synced);
  for (size_t j = 0; j < g.params.size(); ++j) {
    if (sums[j].has_inf_or_nan) return NonFinite(g.params[j], plan.task->step);
  }
  return Status::OK();
}

Status OptimizerPipeline::StepGroupOnDevice(const GroupStep& plan) {
  const Layout& layout = *ctx_.layout;
  const size_t gi = plan.gi;
  const OptimizerTask& task = *plan.task;
  Device* device = ctx_.device;
  Stream* stream = ctx_.streams.update;
  const ParamCopyType copy_type = StoredParamType(*ctx_.config);
  const bool copies = copy_type != ParamCopyType::kNone;
  OptimizerHyperParams hp = HyperParams(task, plan.coef, 0);
  const int buf = Buf(task.step);
  const auto t0 = Clock::now();
  // The gradients accumulated in device memory (GradientWindow); with clipping the norm's
  // finite check covered them.
  float* master = m_.states->device_states(gi);
  const float* grads = plan.grads;
  if (grads == nullptr) {
    return Status::Internal("sub-group " + std::to_string(gi) +
                            " is stepped on the device without device gradients");
  }
  if (!task.needs_norm) ZINF_RETURN_IF_ERROR(CheckDeviceGradients(plan, grads));
  Status s;
  for (ParamId id : layout.group(gi).params) {
    if (!s.ok()) break;
    const ParamLayout& p = layout.param(id);
    const size_t bytes = layout.PartBytes(id);
    OptimizerTensors t = PartTensors(id, hp, master, grads + p.slice_offset);
    void* dst = m_.params->device_part(id, buf);
    if (!plan.with_grad[p.index_in_group]) {
      // Not updated. Its store buffer for this version must still hold its values: the
      // masters' (fp32), or the previous version's buffer (bf16; the same buffer without the
      // delayed update).
      void* other = m_.params->device_part(id, 1 - buf);
      if (!copies) {
        s = device->CopyDeviceToDevice(dst, t.param, bytes, stream);
      } else if (other != nullptr && other != dst) {
        s = device->CopyDeviceToDevice(dst, other, bytes, stream);
      }
      continue;
    }
    hp = HyperParams(task, plan.coef, p.info.param_group);
    hp.step = m_.states->updates(id) + 1;
    if (copies) {
      t.param_copy = dst;
      t.param_copy_type = copy_type;
    }
    s = device->OptimizerStep(hp, t, stream)
            .WithContext("device optimizer step of '" + p.info.name + "'");
    if (s.ok()) m_.states->CountUpdate(id);
    if (s.ok() && !copies) s = device->CopyDeviceToDevice(dst, t.param, bytes, stream);
  }
  // Whatever was queued finishes before the gradients' buffer is reused.
  Status synced = device->SynchronizeStream(stream);
  ctx_.stats->AddOptimizerBusy(Since(t0));
  ZINF_RETURN_IF_ERROR(s);
  return synced.WithContext("device optimizer step of sub-group " + std::to_string(gi));
}

Status OptimizerPipeline::CompleteSnapshot(const GroupStep& plan, size_t j,
                                           const std::vector<uint8_t>& kept, const float* master,
                                           const Status& s) const {
  if (plan.snapshot == nullptr) return s;
  const Layout& layout = *ctx_.layout;
  const std::vector<ParamId>& ids = layout.group(plan.gi).params;
  const size_t tile = m_.optimizer->tile_elements();
  const size_t n = layout.param(ids[j]).info.partition_numel;
  for (size_t k = 0; k * tile < n; ++k) {
    if (k >= kept.size() || !kept[k]) {
      speculation_.KeepTiles(ids[j], master, plan.snapshot, k * tile, std::min(n, (k + 1) * tile));
    }
  }
  for (size_t r = j + 1; r < ids.size(); ++r) {
    speculation_.KeepTiles(ids[r], master, plan.snapshot, 0,
                           layout.param(ids[r]).info.partition_numel);
  }
  return s;
}

Status OptimizerPipeline::StepGroup(GroupStep* plan, float* master, uint16_t* copy_out,
                                    std::vector<Ticket>* writes) {
  const Layout& layout = *ctx_.layout;
  const std::vector<ParamId>& ids = layout.group(plan->gi).params;
  if (plan->landing >= 0 && plan->snapshot != nullptr) {
    return Status::Internal("a speculative step of a sub-group whose gradient is still landing");
  }
  const auto t0 = Clock::now();
  // Per tile of the parameter being stepped: whether its pre-step values are in the snapshot.
  std::vector<uint8_t> kept;
  // By index in the group: parameters whose pieces went to the device as they were stepped.
  std::vector<uint8_t> written(ids.size(), 0);
  // The parameter still landing (if any) goes last, so that the others are stepped while it
  // lands. (Not speculative: the snapshot's completion after a failure assumes id order.)
  std::vector<size_t> sequence;
  for (size_t j = 0; j < ids.size(); ++j) {
    if (static_cast<int>(j) != plan->landing) sequence.push_back(j);
  }
  if (plan->landing >= 0) sequence.push_back(static_cast<size_t>(plan->landing));
  double landing_wait = 0;  // seconds waiting for pieces to land (WaitLanded)
  for (const size_t j : sequence) {
    const ParamLayout& p = layout.param(ids[j]);
    kept.clear();
    if (plan->with_grad[p.index_in_group]) {
      bool pieces = false;
      Status s = StepParam(plan, j, master, copy_out, &kept, &pieces, &landing_wait);
      if (!s.ok()) return CompleteSnapshot(*plan, j, kept, master, s);
      written[p.index_in_group] = pieces ? 1 : 0;
      continue;
    }
    // Not updated (no gradient in the window); its store is rewritten from the masters.
    const size_t n = p.info.partition_numel;
    if (plan->snapshot != nullptr) speculation_.KeepTiles(ids[j], master, plan->snapshot, 0, n);
    if (copy_out != nullptr) {
      Status s = m_.optimizer->ConvertParams(master + p.slice_offset, copy_out + p.slice_offset,
                                             StoredParamType(*ctx_.config), n);
      if (!s.ok()) {
        return CompleteSnapshot(*plan, j, kept, master,
                                s.WithContext("converting '" + p.info.name + "'"));
      }
    }
  }
  ctx_.stats->AddOptimizerBusy(Since(t0) - landing_wait);
  return m_.params->WriteGroup(plan->gi, master, copy_out, Buf(plan->task->step), writes, &written);
}

Status OptimizerPipeline::StepParam(GroupStep* plan, size_t j, float* master, uint16_t* copy_out,
                                    std::vector<uint8_t>* kept, bool* written,
                                    double* landing_wait) {
  const Layout& layout = *ctx_.layout;
  const OptimizerTask& task = *plan->task;
  const ParamId id = layout.group(plan->gi).params[j];
  const ParamLayout& p = layout.param(id);
  const size_t n = p.info.partition_numel;
  const size_t tile = m_.optimizer->tile_elements();
  OptimizerHyperParams hp = HyperParams(task, plan->coef, p.info.param_group);
  OptimizerTensors t = PartTensors(id, hp, master, m_.grads->Acc(id));
  if (copy_out != nullptr) {
    t.param_copy = copy_out + p.slice_offset;
    t.param_copy_type = StoredParamType(*ctx_.config);
  }
  hp.step = m_.states->updates(id) + 1;
  // The finite check runs inside the step, tile by tile while the gradients are in cache:
  // a non-finite gradient leaves its tiles unstepped and nothing of the group is written.
  // A speculative step keeps each tile's pre-step values in the snapshot just before the
  // tile is stepped (tiles start on multiples of the optimizer's tile, and each is one
  // thread's: the flags are written by one thread each).
  // Pieces start on multiples of the tile (of the int8 state block too), so each piece's
  // tiles are the whole step's.
  const bool pieces = plan->upload_pieces && !layout.StoredInt8(id);
  const bool lands = static_cast<int>(j) == plan->landing;  // stepped as its pieces land
  const size_t piece = pieces || lands
                           ? RoundUp(std::max<size_t>((n + kPieces - 1) / kPieces, 1), tile)
                           : std::max<size_t>(n, 1);
  size_t offset = 0;  // the piece being stepped starts there
  std::function<void(size_t, size_t)> keep;
  if (plan->snapshot != nullptr) {
    kept->assign((n + tile - 1) / tile, 0);
    keep = [&](size_t begin, size_t end) {
      speculation_.KeepTiles(id, master, plan->snapshot, offset + begin, offset + end);
      (*kept)[(offset + begin) / tile] = 1;
    };
  }
  for (; offset < n; offset += piece) {
    const size_t end = std::min(n, offset + piece);
    Result<OptimizerTensors> u = SliceOptimizerTensors(t, offset, end);
    Status s = u.status();
    if (s.ok() && lands) {
      const auto w0 = Clock::now();
      s = m_.grads->WaitLanded(plan->gi, task.step, end);
      *landing_wait += Since(w0);  // waiting, not stepping: not busy time
    }
    if (s.ok()) {
      s = plan->check_finite ? m_.optimizer->StepIfFinite(hp, *u, &plan->non_finite, keep)
                             : m_.optimizer->Step(hp, *u);
    }
    if (!s.ok()) return s.WithContext("optimizer step of '" + p.info.name + "'");
    if (plan->check_finite && plan->non_finite) return NonFinite(id, task.step);
    if (pieces) {
      const void* src = copy_out != nullptr ? static_cast<const void*>(copy_out + p.slice_offset)
                                            : static_cast<const void*>(master + p.slice_offset);
      s = m_.params->WritePiece(id, src, offset, end, Buf(task.step));
      if (!s.ok()) return s.WithContext("copying '" + p.info.name + "' to the device");
    }
  }
  *written = pieces;
  m_.states->CountUpdate(id);
  return Status::OK();
}

}  // namespace zinf
