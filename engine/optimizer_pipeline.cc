#include "engine/optimizer_pipeline.h"

#include <chrono>
#include <deque>
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
    // states it left (sub-groups not stepped) must not be published by a later one.
    if (s.ok() && ctx_.config->durable && StepClock::DelayedStep(*ctx_.config, task.step)) {
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
    while (!retiring.empty()) retire_oldest();
    sync_updates();
    for (Slot& slot : window) {
      // Only waits so that the buffer is free; nobody uses the states of a sub-group never
      // reached, and the failure that stopped the task is the one reported.
      if (slot.reading) (void)ctx_.swap->Wait(slot.read);
    }
    window.clear();
  }};
  for (size_t k = 0; k < order.size(); ++k) {
    const size_t gi = order[k];
    const GroupLayout& g = layout.group(gi);
    while (!retiring.empty() && window.size() + retiring.size() >= buffers) retire_oldest();
    const bool nvme = m_.states->on_nvme(gi);
    ZINF_RETURN_IF_ERROR(issue_reads());
    // Wait for this sub-group's gradients (and, with clipping, the global norm).
    float coef = 1.0f;
    std::vector<uint8_t> with_grad;  // the parameters this step updates (the others skip it)
    ZINF_RETURN_IF_ERROR(ctx_.board->WaitGroupReady(gi, task, &coef, &with_grad));
    // Done with sub-group gi (stepped, or failed and left as it was): the trainer may put
    // the next window's gradients into its accumulators.
    auto mark_stepped = [&] {
      m_.grads->ReleaseBuffer(gi);
      ctx_.board->MarkStepped(gi, task.step);
    };
    if (g.on_device && device_params) {
      // The device steps it and writes the parameters straight into their device stores.
      Status s = StepGroupOnDevice(gi, task, coef, with_grad);
      if (!s.ok() && first.ok()) first = s;
      mark_stepped();
      CrashPoint("optimizer.group");
      continue;
    }
    Retiring done;
    float* master;
    if (nvme) {
      Slot slot = std::move(window.front());
      window.pop_front();
      Status s = ctx_.swap->Wait(slot.read);
      if (!s.ok()) {
        if (first.ok()) {
          first = s.WithContext("reading optimizer states of sub-group " + std::to_string(gi));
        }
        mark_stepped();
        continue;  // this sub-group keeps its old values; the step reports the failure
      }
      done.states = std::move(slot.states);
      master = static_cast<float*>(done.states.data());
    } else if (m_.states->device_states(gi) != nullptr) {
      master = m_.states->device_states(gi);
    } else {
      master = m_.states->host_states(gi);
    }
    if (config.bf16) {
      Result<PooledBlock> b = m_.copy_pool->Take();
      if (!b.ok()) return b.status().WithContext("bf16 parameter buffer");
      done.copy = std::move(b).value();
    }
    Status s = StepGroup(gi, master, static_cast<uint16_t*>(done.copy.data()), task, coef,
                         with_grad, &done.writes);
    if (!s.ok() && first.ok()) first = s;
    // Every gradient of the sub-group has landed and been used: its accumulators can go.
    mark_stepped();
    CrashPoint("optimizer.group");
    if (nvme && s.ok()) {
      Result<Ticket> w = ctx_.swap->Write(m_.states->swap_key(gi), done.states.data(),
                                          layout.GroupStateBytes(gi), done.states.capacity());
      if (w.ok()) {
        done.writes.push_back(*w);
      } else if (first.ok()) {
        first = w.status();
      }
    }
    retiring.push_back(std::move(done));
  }
  drain.Run();
  return first;
}

OptimizerHyperParams OptimizerPipeline::HyperParams(const OptimizerTask& task, float coef) const {
  const EngineConfig& config = *ctx_.config;
  OptimizerHyperParams hp;
  hp.kind = OptimizerKindFor(config.optimizer.type);
  hp.step = task.step;
  hp.lr = task.lr;
  hp.beta1 = config.optimizer.beta1;
  hp.beta2 = config.optimizer.beta2;
  hp.eps = config.optimizer.eps;
  hp.weight_decay = config.optimizer.weight_decay;
  hp.grad_scale = coef;
  return hp;
}

Status OptimizerPipeline::CheckFinite(ParamId id, int64_t step) {
  const ParamLayout& p = ctx_.layout->param(id);
  Result<GradStats> gs =
      m_.optimizer->GradSumSquares(m_.grads->Acc(id), GradType::kF32, p.info.partition_numel);
  ZINF_RETURN_IF_ERROR(gs.status());
  return gs->has_inf_or_nan ? NonFinite(id, step) : Status::OK();
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
  OptimizerHyperParams hp = HyperParams(task, coef);
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
                                    const OptimizerTask& task, float coef,
                                    const std::vector<uint8_t>& with_grad,
                                    std::vector<Ticket>* writes) {
  const Layout& layout = *ctx_.layout;
  OptimizerHyperParams hp = HyperParams(task, coef);
  const auto t0 = Clock::now();
  for (ParamId id : layout.group(gi).params) {
    const ParamLayout& p = layout.param(id);
    if (!with_grad[p.index_in_group]) {
      // Not updated (no gradient in the window); its store is rewritten from the masters.
      if (copy_out != nullptr) {
        Status s = m_.optimizer->ConvertParams(master + p.slice_offset, copy_out + p.slice_offset,
                                               ParamCopyType::kBf16, p.info.partition_numel);
        if (!s.ok()) return s.WithContext("converting '" + p.info.name + "'");
      }
      continue;
    }
    if (!task.clip)
      ZINF_RETURN_IF_ERROR(CheckFinite(id, task.step));  // (clipping checked the norm)
    OptimizerTensors t = PartTensors(id, hp, master, m_.grads->Acc(id));
    if (copy_out != nullptr) {
      t.param_copy = copy_out + p.slice_offset;
      t.param_copy_type = ParamCopyType::kBf16;
    }
    hp.step = m_.states->updates(id) + 1;
    Status s = m_.optimizer->Step(hp, t);
    if (!s.ok()) return s.WithContext("optimizer step of '" + p.info.name + "'");
    m_.states->CountUpdate(id);
  }
  ctx_.stats->AddOptimizerBusy(Since(t0));
  return m_.params->WriteGroup(gi, master, copy_out, Buf(task.step), writes);
}

}  // namespace zinf
