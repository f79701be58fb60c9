#include "engine/optimizer_pipeline.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <functional>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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
    : ctx_(ctx), m_(parts) {}

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

Status OptimizerPipeline::Run(const OptimizerTask& task) {
  const Layout& layout = *ctx_.layout;
  const EngineConfig& config = *ctx_.config;
  const std::vector<size_t> order = layout.GroupOrder();
  const size_t buffers = std::max<uint32_t>(config.offload_optimizer.buffer_count, 3);
  // Pipeline (NVMe states): reads run ahead up to `buffers - 1` sub-groups; each sub-group's
  // write-back is waited for only when its buffer is needed again.
  struct Slot {
    PooledBlock states;
    Ticket read = 0;
    bool reading = false;
  };
  std::deque<Slot> window;
  size_t next_read = 0;
  Status first;
  // Buffers whose write-back is in flight, oldest first.
  struct Retiring {
    PooledBlock states, copy;
    std::vector<Ticket> writes;
  };
  std::deque<Retiring> retiring;
  // Sub-groups stepped speculatively (clipping, before the norm was known), in step order:
  // their pre-step [master | states] and update counts, until the verdict keeps, redoes or
  // rolls back their step. Their accumulators stay taken until then.
  struct Speculated {
    size_t gi = 0;
    PooledBlock snapshot;
    std::vector<uint8_t> with_grad;
    std::vector<int64_t> updates;  // per parameter of the sub-group, before the step
    bool poisoned = false;         // its step met a non-finite gradient (tiles left unstepped)
  };
  std::vector<Speculated> speculated;

  auto issue_reads = [&]() -> Status {
    while (next_read < order.size() && window.size() + retiring.size() < buffers) {
      const size_t gi = order[next_read];
      if (!m_.states->on_nvme(gi)) {  // states not on NVMe: nothing to read ahead
        ++next_read;
        continue;
      }
      Slot slot;
      ZINF_ASSIGN_OR_RETURN(slot.states, m_.state_pool->Take());
      ZINF_ASSIGN_OR_RETURN(slot.read, ctx_.swap->Read(m_.states->swap_key(gi), slot.states.data(),
                                                       slot.states.capacity()));
      slot.reading = true;
      window.push_back(std::move(slot));
      ++next_read;
    }
    return Status::OK();
  };
  const bool device_params = config.offload_param.tier == Tier::kDevice;
  // Device copies of the updated parameters read from the retiring buffers (and, for fp32
  // parameters with CPU states, from the states themselves): wait for them before reuse.
  auto sync_updates = [&] {
    if (!device_params) return;
    Status s = ctx_.device->SynchronizeStream(ctx_.streams.update);
    if (!s.ok() && first.ok()) first = s.WithContext("copying updated parameters to the device");
  };
  auto retire_oldest = [&] {
    sync_updates();
    for (Ticket t : retiring.front().writes) {
      Status s = ctx_.swap->Wait(t);
      if (!s.ok() && first.ok()) first = s;
    }
    retiring.pop_front();
  };
  // Done with sub-group gi (stepped, or failed and left as it was): the trainer may put the
  // next window's gradients into its accumulators.
  auto mark_stepped = [&](size_t gi) {
    m_.grads->ReleaseBuffer(gi);
    ctx_.board->MarkStepped(gi, task.step);
  };
  // Where sub-group gi's states are stepped when they are not on NVMe.
  auto resident_states = [&](size_t gi) {
    float* d = m_.states->device_states(gi);
    return d != nullptr ? d : m_.states->host_states(gi);
  };
  // Steps sub-group gi in `master` (its NVMe state block `states`, if any) and queues its
  // write-backs into `retiring`.
  // `non_finite` (speculation): set when a gradient held inf or NaN (the step fails then).
  // `upload_pieces`, `landing`: see StepGroup.
  auto step_and_write = [&](size_t gi, float* master, PooledBlock states, float coef,
                            bool* non_finite, const std::vector<uint8_t>& with_grad,
                            void* snapshot = nullptr, bool upload_pieces = false,
                            int landing = -1) -> Status {
    Retiring done;
    done.states = std::move(states);
    if (config.bf16) {
      Result<PooledBlock> b = m_.copy_pool->Take();
      if (!b.ok()) {
        // Nothing stepped: a speculative snapshot gets the values as they are (whole).
        if (snapshot != nullptr) {
          for (ParamId id : layout.group(gi).params) {
            KeepTiles(id, master, snapshot, 0, layout.param(id).info.partition_numel);
          }
        }
        return b.status().WithContext("bf16 parameter buffer");
      }
      done.copy = std::move(b).value();
    }
    Status s = StepGroup(gi, master, static_cast<uint16_t*>(done.copy.data()), task, coef,
                         non_finite, with_grad, &done.writes, snapshot, upload_pieces, landing);
    if (s.ok() && m_.states->on_nvme(gi)) {
      Result<Ticket> w = ctx_.swap->Write(m_.states->swap_key(gi), done.states.data(),
                                          layout.GroupStateBytes(gi), done.states.capacity());
      if (w.ok()) {
        done.writes.push_back(*w);
      } else {
        s = w.status();
      }
    }
    // Nothing to hold (fp32 parameters copied to the device straight from CPU-resident
    // masters, which only this thread rewrites, after the task's final sync): the copies run
    // on under the next sub-groups' steps instead of being waited for `buffers` later.
    if (done.states.data() != nullptr || done.copy.data() != nullptr || !done.writes.empty()) {
      retiring.push_back(std::move(done));
    }
    return s;
  };
  // The verdict on the speculated sub-groups: kept (`coef` 1), redone from their snapshots
  // with `coef`, or (`roll_back`: the norm failed, or the task stops) restored, with their
  // parameter stores rewritten from the restored masters.
  auto resolve = [&](float coef, bool roll_back) {
    if (speculated.empty()) return;
    // The speculative write-backs and device copies read the buffers about to be restored, and
    // a redo writes the same keys: they finish first.
    while (!retiring.empty()) retire_oldest();
    sync_updates();
    uint64_t kept = 0, redone = 0, rolled_back = 0;
    const auto t0 = Clock::now();
    for (Speculated& sp : speculated) {
      const size_t gi = sp.gi;
      if (!roll_back && coef == 1.0f && !sp.poisoned) {
        ++kept;
        mark_stepped(gi);
        continue;
      }
      // Restore: NVMe states are redone in the snapshot block itself (it is a pinned block of
      // the state buffers' size), the others copied back.
      const bool nvme = m_.states->on_nvme(gi);
      float* master = static_cast<float*>(sp.snapshot.data());
      if (!nvme) {
        master = resident_states(gi);
        ForEachSlice(gi, [&](size_t offset, size_t bytes) {
          Copy(reinterpret_cast<char*>(master) + offset,
               static_cast<const char*>(sp.snapshot.data()) + offset, bytes);
        });
      }
      const std::vector<ParamId>& ids = layout.group(gi).params;
      for (size_t j = 0; j < ids.size(); ++j) m_.states->set_updates(ids[j], sp.updates[j]);
      Status s;
      if (roll_back) {
        ++rolled_back;
        // No parameter is updated: the stores get the restored values back.
        s = step_and_write(gi, master, nvme ? std::move(sp.snapshot) : PooledBlock(), 1.0f, nullptr,
                           std::vector<uint8_t>(ids.size(), 0));
      } else {
        ++redone;
        s = step_and_write(gi, master, nvme ? std::move(sp.snapshot) : PooledBlock(), coef, nullptr,
                           sp.with_grad);
      }
      if (!s.ok() && first.ok()) first = s;
      while (!retiring.empty() && retiring.size() >= buffers - 1) retire_oldest();
      mark_stepped(gi);
    }
    speculated.clear();
    ctx_.stats->CountSpeculation(0, kept, redone, rolled_back,
                                 redone + rolled_back > 0 ? Since(t0) : 0);
  };
  // However this returns, no copy or I/O may still use the buffers it frees: write-backs
  // finish, device copies finish, reads issued ahead for sub-groups never reached (after a
  // failure) complete.
  struct Finally {
    std::function<void()> fn;
    void Run() {
      if (fn) fn();
      fn = nullptr;
    }
    ~Finally() { Run(); }
  } drain{[&] {
    // A task that ends with sub-groups still speculated (a failure, the norm's or another's,
    // or shutdown): their steps are undone.
    resolve(1.0f, /*roll_back=*/true);
    while (!retiring.empty()) retire_oldest();
    sync_updates();
    for (Slot& slot : window) {
      // Only waits so that the buffer is free; nobody uses the states of a sub-group never
      // reached, and the failure that stopped the task is the one reported.
      if (slot.reading) (void)ctx_.swap->Wait(slot.read);
    }
    window.clear();
  }};
  // The norm failed (not finite, or its collective did): what was speculated is rolled back
  // (the drain), nothing else is stepped, and the task did nothing, which is not an optimizer
  // failure; the trainer's Step reports the norm's error.
  auto verdict_failed = [&](const Status& s) {
    if (ctx_.board->NormFailed(task.step)) {
      drain.Run();
      return first;
    }
    return s;
  };
  // "auto" does not speculate in the step after one that clipped: clipping tends to come in
  // runs (early training, a spike), where every speculated sub-group would be stepped twice.
  const bool may_speculate = task.clip && m_.snapshot_pool != nullptr &&
                             m_.snapshot_pool->initialized() &&
                             (config.speculative_step == SpeculativeStep::kOn || !last_clipped_);
  for (size_t k = 0; k < order.size(); ++k) {
    const size_t gi = order[k];
    const GroupLayout& g = layout.group(gi);
    // A verdict that came meanwhile settles what was speculated so far.
    if (!speculated.empty()) {
      float coef = 1.0f;
      bool known = false;
      Status v = ctx_.board->Verdict(task, /*wait=*/false, &coef, &known);
      if (!v.ok()) return verdict_failed(v);
      if (known) resolve(coef, false);
    }
    while (!retiring.empty() && window.size() + retiring.size() >= buffers) retire_oldest();
    const bool nvme = m_.states->on_nvme(gi);
    ZINF_RETURN_IF_ERROR(issue_reads());
    const bool on_device = g.on_device && device_params;
    // Wait for this sub-group's gradients (and, with clipping, the global norm, unless a
    // snapshot block is free to step it speculatively).
    const bool speculate = may_speculate && !on_device && m_.snapshot_pool->free_blocks() > 0 &&
                           (m_.states->device_states(gi) == nullptr || ctx_.device->IsHost());
    float coef = 1.0f;
    bool coef_known = true;
    std::vector<uint8_t> with_grad;  // the parameters this step updates (the others skip it)
    // Without clipping a sub-group whose last gradient is landing piece by piece is stepped as
    // it lands (its accumulators are released only once it has landed whole).
    int landing = -1;
    Status ready = ctx_.board->WaitGroupReady(gi, task, speculate, &coef, &coef_known, &with_grad,
                                              on_device || task.clip ? nullptr : &landing);
    if (!ready.ok()) return verdict_failed(ready);
    if (on_device) {
      // The device steps it and writes the parameters straight into their device stores.
      Status s = StepGroupOnDevice(gi, task, coef, with_grad);
      if (!s.ok() && first.ok()) first = s;
      mark_stepped(gi);
      CrashPoint("optimizer.group");
      continue;
    }
    PooledBlock states;
    float* master;
    if (nvme) {
      Slot slot = std::move(window.front());
      window.pop_front();
      Status s = ctx_.swap->Wait(slot.read);
      if (!s.ok()) {
        if (first.ok()) {
          first = s.WithContext("reading optimizer states of sub-group " + std::to_string(gi));
        }
        Status landed = landing >= 0 ? ctx_.board->WaitLanded(gi, task.step, SIZE_MAX) : Status();
        if (!landed.ok() && first.ok()) first = landed;
        mark_stepped(gi);
        continue;  // this sub-group keeps its old values; the step reports the failure
      }
      states = std::move(slot.states);
      master = static_cast<float*>(states.data());
    } else {
      master = resident_states(gi);
    }
    const bool any_grad = std::find(with_grad.begin(), with_grad.end(), 1) != with_grad.end();
    // The last sub-groups of an undelayed step: the next forward waits for their parameters,
    // and no later step would run under their copies (the last but one's are still going when
    // the last starts), so they go out piece by piece as these step.
    const bool upload_pieces =
        device_params && !config.delayed_update && k + kPiecedLastGroups >= order.size();
    if (!coef_known && any_grad) {
      // Speculative: the pre-step values are kept, then the step runs with the coefficient 1
      // (a non-finite gradient leaves its tiles unstepped; the norm will fail the task).
      Speculated sp;
      sp.gi = gi;
      ZINF_ASSIGN_OR_RETURN(sp.snapshot, m_.snapshot_pool->Take());
      for (ParamId id : g.params) sp.updates.push_back(m_.states->updates(id));
      sp.with_grad = with_grad;
      bool non_finite = false;
      // (The step keeps each tile's pre-step values in the snapshot as it goes.)
      Status s = step_and_write(gi, master, std::move(states), 1.0f, &non_finite, with_grad,
                                sp.snapshot.data(), upload_pieces);
      if (non_finite) {
        sp.poisoned = true;
      } else if (!s.ok() && first.ok()) {
        first = s;
      }
      speculated.push_back(std::move(sp));
      ctx_.stats->CountSpeculation(1, 0, 0, 0, 0);
      CrashPoint("optimizer.group");
      continue;
    }
    // (No gradient in the sub-group, or the coefficient known: nothing to speculate. With
    // clipping the norm's finite check covered the gradients.)
    bool non_finite = false;
    Status s =
        step_and_write(gi, master, std::move(states), coef, task.clip ? nullptr : &non_finite,
                       with_grad, nullptr, upload_pieces, landing);
    if (!s.ok() && first.ok()) first = s;
    if (landing >= 0) {
      ctx_.stats->CountLanding();
      // (A failure may have stopped the step before every piece had landed, above or at the
      // state read: the trainer is still copying into the accumulators mark_stepped releases.)
      Status landed = ctx_.board->WaitLanded(gi, task.step, SIZE_MAX);
      if (!landed.ok() && first.ok()) first = landed;
    }
    // Every gradient of the sub-group has landed and been used: its accumulators can go.
    mark_stepped(gi);
    CrashPoint("optimizer.group");
  }
  if (!speculated.empty() && first.ok()) {
    float coef = 1.0f;
    bool known = false;
    Status v = ctx_.board->Verdict(task, /*wait=*/true, &coef, &known);
    if (!v.ok()) return verdict_failed(v);
    resolve(coef, false);
  }
  if (task.clip) {
    float coef = 1.0f;
    bool known = false;
    // (Only reads the verdict; a failed one has been handled above.)
    if (ctx_.board->Verdict(task, /*wait=*/false, &coef, &known).ok() && known) {
      last_clipped_ = coef < 1.0f;
    }
  }
  drain.Run();
  return first;
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

namespace {
// memcpy with non-temporal stores: the copy does not read the destination's lines first, nor
// leave them in the cache (a snapshot is read back only to undo a step).
void StreamCopy(char* dst, const char* src, size_t bytes) {
#if defined(__SSE2__)
  const size_t head = std::min(bytes, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16);
  std::memcpy(dst, src, head);
  size_t i = head;
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, bytes - i);
  _mm_sfence();  // the stores are visible before anyone is told the snapshot is taken
#else
  std::memcpy(dst, src, bytes);
#endif
}
}  // namespace

void OptimizerPipeline::ForEachSlice(size_t gi,
                                     const std::function<void(size_t, size_t)>& fn) const {
  for (ParamId id : ctx_.layout->group(gi).params) {
    for (int k = 0; k < 3; ++k)
      fn(ctx_.layout->SliceOffsetIn(id, k), ctx_.layout->SliceBytesIn(id, k));
  }
}

void OptimizerPipeline::KeepTiles(ParamId id, const float* master, void* snapshot, size_t begin,
                                  size_t end) const {
  const Layout& layout = *ctx_.layout;
  const char* from = reinterpret_cast<const char*>(master);
  char* to = static_cast<char*>(snapshot);
  for (int k = 0; k < 3; ++k) {
    const size_t offset = layout.SliceOffsetIn(id, k);
    const size_t b = k == 0 ? begin * sizeof(float) : StateBytes(layout.state_type(), begin);
    const size_t e = k == 0 ? end * sizeof(float) : StateBytes(layout.state_type(), end);
    StreamCopy(to + offset + b, from + offset + b, e - b);
  }
}

void OptimizerPipeline::Copy(void* dst, const void* src, size_t bytes) {
  constexpr size_t kLine = 64;
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  m_.optimizer->ParallelFor((bytes + kLine - 1) / kLine, [&](size_t begin, size_t end) {
    std::memcpy(d + begin * kLine, s + begin * kLine, std::min(bytes, end * kLine) - begin * kLine);
  });
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

Status OptimizerPipeline::StepGroupOnDevice(size_t gi, const OptimizerTask& task, float coef,
                                            const std::vector<uint8_t>& with_grad) {
  const Layout& layout = *ctx_.layout;
  const GroupLayout& g = layout.group(gi);
  Device* device = ctx_.device;
  Stream* stream = ctx_.streams.update;
  const bool copies = ctx_.config->bf16;
  OptimizerHyperParams hp = HyperParams(task, coef, 0);
  const int buf = Buf(task.step);
  const auto t0 = Clock::now();
  // The gradients accumulated in device memory (GradientPath); with clipping the norm's
  // finite check covered them.
  float* master = m_.states->device_states(gi);
  const float* grads = m_.grads->group_grads(gi);
  if (!m_.grads->on_device(gi) || grads == nullptr) {
    return Status::Internal("sub-group " + std::to_string(gi) +
                            " is stepped on the device without device gradients");
  }
  if (!task.clip) {
    std::vector<GradStats> sums(g.params.size());
    Status queued;
    for (size_t j = 0; j < g.params.size() && queued.ok(); ++j) {
      const ParamLayout& p = layout.param(g.params[j]);
      if (!with_grad[p.index_in_group]) continue;
      queued = device->SumSquares(grads + p.slice_offset, p.info.partition_numel, &sums[j], stream);
    }
    // Even after a failure: the sums queued write into `sums` until the stream is done.
    Status synced = device->SynchronizeStream(stream);
    ZINF_RETURN_IF_ERROR(
        queued.WithContext("checking the gradients of sub-group " + std::to_string(gi)));
    ZINF_RETURN_IF_ERROR(synced);
    for (size_t j = 0; j < g.params.size(); ++j) {
      if (sums[j].has_inf_or_nan) return NonFinite(g.params[j], task.step);
    }
  }
  Status s;
  for (ParamId id : g.params) {
    if (!s.ok()) break;
    const ParamLayout& p = layout.param(id);
    const size_t bytes = layout.PartBytes(id);
    OptimizerTensors t = PartTensors(id, hp, master, grads + p.slice_offset);
    void* dst = m_.params->device_part(id, buf);
    if (!with_grad[p.index_in_group]) {
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
    hp = HyperParams(task, coef, p.info.param_group);
    hp.step = m_.states->updates(id) + 1;
    if (copies) {
      t.param_copy = dst;
      t.param_copy_type = ParamCopyType::kBf16;
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

Status OptimizerPipeline::StepGroup(size_t gi, float* master, uint16_t* copy_out,
                                    const OptimizerTask& task, float coef, bool* non_finite,
                                    const std::vector<uint8_t>& with_grad,
                                    std::vector<Ticket>* writes, void* snapshot, bool upload_pieces,
                                    int landing) {
  const Layout& layout = *ctx_.layout;
  const std::vector<ParamId>& ids = layout.group(gi).params;
  if (landing >= 0 && snapshot != nullptr) {
    return Status::Internal("a speculative step of a sub-group whose gradient is still landing");
  }
  OptimizerHyperParams hp = HyperParams(task, coef, 0);
  const auto t0 = Clock::now();
  const size_t tile = m_.optimizer->tile_elements();
  // Per tile of the parameter being stepped: whether its pre-step values are in the snapshot.
  std::vector<uint8_t> kept;
  // By index in the group: parameters whose pieces went to the device as they were stepped.
  std::vector<uint8_t> written(ids.size(), 0);
  // A failure at parameter j: what was not stepped still holds its pre-step values (the tiles
  // of j not kept, the parameters after it); the snapshot gets them, so that it is whole for
  // the rollback whatever failed.
  auto fail = [&](size_t j, const Status& s) {
    if (snapshot == nullptr) return s;
    const size_t n = layout.param(ids[j]).info.partition_numel;
    for (size_t k = 0; k * tile < n; ++k) {
      if (k >= kept.size() || !kept[k]) {
        KeepTiles(ids[j], master, snapshot, k * tile, std::min(n, (k + 1) * tile));
      }
    }
    for (size_t r = j + 1; r < ids.size(); ++r) {
      KeepTiles(ids[r], master, snapshot, 0, layout.param(ids[r]).info.partition_numel);
    }
    return s;
  };
  // The parameter still landing (if any) goes last, so that the others are stepped while it
  // lands. (Not speculative: the snapshot's completion after a failure assumes id order.)
  std::vector<size_t> sequence;
  for (size_t j = 0; j < ids.size(); ++j) {
    if (static_cast<int>(j) != landing) sequence.push_back(j);
  }
  if (landing >= 0) sequence.push_back(static_cast<size_t>(landing));
  double landing_wait = 0;  // seconds waiting for pieces to land (WaitLanded)
  for (const size_t j : sequence) {
    const ParamId id = ids[j];
    const ParamLayout& p = layout.param(id);
    const size_t n = p.info.partition_numel;
    kept.clear();
    if (!with_grad[p.index_in_group]) {
      // Not updated (no gradient in the window); its store is rewritten from the masters.
      if (snapshot != nullptr) KeepTiles(id, master, snapshot, 0, n);
      if (copy_out != nullptr) {
        Status s = m_.optimizer->ConvertParams(master + p.slice_offset, copy_out + p.slice_offset,
                                               ParamCopyType::kBf16, n);
        if (!s.ok()) return fail(j, s.WithContext("converting '" + p.info.name + "'"));
      }
      continue;
    }
    hp = HyperParams(task, coef, p.info.param_group);
    OptimizerTensors t = PartTensors(id, hp, master, m_.grads->Acc(id));
    if (copy_out != nullptr) {
      t.param_copy = copy_out + p.slice_offset;
      t.param_copy_type = ParamCopyType::kBf16;
    }
    hp.step = m_.states->updates(id) + 1;
    // The finite check runs inside the step, tile by tile while the gradients are in cache:
    // a non-finite gradient leaves its tiles unstepped and nothing of the group is written.
    // A speculative step keeps each tile's pre-step values in the snapshot just before the
    // tile is stepped (tiles start on multiples of the optimizer's tile, and each is one
    // thread's: the flags are written by one thread each).
    // Pieces start on multiples of the tile (of the int8 state block too), so each piece's
    // tiles are the whole step's.
    const bool pieces = upload_pieces && !layout.StoredInt8(id);
    const bool lands = static_cast<int>(j) == landing;  // stepped as its pieces land
    const size_t piece = pieces || lands
                             ? RoundUp(std::max<size_t>((n + kPieces - 1) / kPieces, 1), tile)
                             : std::max<size_t>(n, 1);
    size_t offset = 0;  // the piece being stepped starts there
    std::function<void(size_t, size_t)> keep;
    if (snapshot != nullptr) {
      kept.assign((n + tile - 1) / tile, 0);
      keep = [&](size_t begin, size_t end) {
        KeepTiles(id, master, snapshot, offset + begin, offset + end);
        kept[(offset + begin) / tile] = 1;
      };
    }
    for (; offset < n; offset += piece) {
      const size_t end = std::min(n, offset + piece);
      Result<OptimizerTensors> u = SliceOptimizerTensors(t, offset, end);
      Status s = u.status();
      if (s.ok() && lands) {
        const auto w0 = Clock::now();
        s = ctx_.board->WaitLanded(gi, task.step, end);
        landing_wait += Since(w0);  // waiting, not stepping: not busy time
      }
      if (s.ok()) {
        s = non_finite != nullptr ? m_.optimizer->StepIfFinite(hp, *u, non_finite, keep)
                                  : m_.optimizer->Step(hp, *u);
      }
      if (!s.ok()) return fail(j, s.WithContext("optimizer step of '" + p.info.name + "'"));
      if (non_finite != nullptr && *non_finite) return fail(j, NonFinite(id, task.step));
      if (pieces) {
        const void* src = copy_out != nullptr ? static_cast<const void*>(copy_out + p.slice_offset)
                                              : static_cast<const void*>(master + p.slice_offset);
        s = m_.params->WritePiece(id, src, offset, end, Buf(task.step));
        if (!s.ok()) return fail(j, s.WithContext("copying '" + p.info.name + "' to the device"));
      }
    }
    if (pieces) written[p.index_in_group] = 1;
    m_.states->CountUpdate(id);
  }
  ctx_.stats->AddOptimizerBusy(Since(t0) - landing_wait);
  return m_.params->WriteGroup(gi, master, copy_out, Buf(task.step), writes, &written);
}

}  // namespace zinf
