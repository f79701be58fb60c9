// The engine's façade: creation and its feasibility checks, registration and placement, and
// the sequencing of micro-steps and optimizer steps over the components that do the work
// (engine/*.h; the README's layout section names each and what it owns).
//
// Threads and what they own:
// - the trainer's thread calls every public method; it alone decides which fetches and
//   collectives are issued, in program order, so all ranks issue them in the same order;
// - the device's streams (copy, comm, update, grad) run copies, collectives and host callbacks;
// - the optimizer thread (OptimizerPipeline) steps sub-groups as their gradients complete and
//   writes results back; GroupBoard is the one monitor it shares with the trainer and the
//   stream callbacks;
// - the swap store's I/O and hash threads.
#include "zinf/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "common/utf8.h"
#include "engine/acquire_trace.h"
#include "engine/checkpointer.h"
#include "engine/device_budget.h"
#include "engine/durable_commits.h"
#include "engine/fetch_scheduler.h"
#include "engine/gradient_path.h"
#include "engine/group_board.h"
#include "engine/host_collectives.h"
#include "engine/host_memory.h"
#include "engine/layout.h"
#include "engine/memory_plan.h"
#include "engine/optimizer_pipeline.h"
#include "engine/param_store.h"
#include "engine/state_store.h"
#include "engine/stats_recorder.h"
#include "zinf/cpu_adam.h"
#include "zinf/log.h"
#include "zinf/swap.h"

namespace zinf {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

struct Engine::Impl {
  Impl(const EngineConfig& c, Device* d, Communicator* cm, const EngineHooks& h)
      : config(c),
        device(d),
        comm(cm),
        hooks(h),
        rank(cm->rank()),
        world(cm->world_size()),
        layout(world, c.bf16 ? 2 : 4),
        delayed(c.delayed_update),
        lr(c.optimizer.lr) {}
  ~Impl();

  const EngineConfig config;
  Device* const device;
  Communicator* const comm;
  const EngineHooks hooks;
  const int rank;
  const int world;
  Layout layout;
  std::vector<std::function<void(float*, size_t)>> inits;  // until the stores are initialised

  Stream* copy_stream = nullptr;
  Stream* comm_stream = nullptr;
  Stream* update_stream = nullptr;
  Stream* grad_stream = nullptr;  // gradient partitions device -> host, then accumulation
  std::unique_ptr<CpuOptimizer> optimizer;
  std::unique_ptr<DeviceBudget> budget;
  StatsRecorder stats;
  std::unique_ptr<HostCollectives> collectives;
  AcquireTrace trace;

  // From placement on (FinishRegistration).
  std::unique_ptr<PinnedArena> arena;
  BlockPool grad_pool;   // streaming accumulators, one block per sub-group
  BlockPool state_pool;  // [master | m | v] of one sub-group (NVMe states; initialisation)
  BlockPool copy_pool;   // the bf16 parameter copy of one sub-group
  std::unique_ptr<SwapStore> swap;
  std::unique_ptr<GroupBoard> board;
  std::unique_ptr<ParamStore> param_store;
  std::unique_ptr<StateStore> states;
  std::unique_ptr<FetchScheduler> fetch;
  std::unique_ptr<GradientPath> grads;
  std::unique_ptr<DurableCommits> durable;
  std::unique_ptr<Checkpointer> checkpointer;
  std::unique_ptr<OptimizerPipeline> pipeline;
  bool registered = false;
  bool resume_store = false;  // ResumeFromStore: InitStores reopens instead of initialising

  int64_t step = 0;
  int64_t micro = 0;  // micro-steps taken
  // One-step delayed update (zinf.delayed_update): the optimizer step for window s runs while
  // the trainer computes window s + 1, which reads the parameters of step s - 1.
  const bool delayed;
  // The version (optimizer step) of the parameters Acquire returns. Equal to `step` without
  // the delayed update; `step - 1` with it (or `step` after a checkpoint).
  int64_t visible = 0;
  // Whether the optimizer step of window s runs delayed (zinf.delayed_update_after: the first
  // steps do not). Undelayed steps use the two buffers too: step s writes buffer s % 2 while
  // the trainer reads s - 1's, and Step() waits for it.
  bool DelayedStep(int64_t s) const {
    return delayed && s > static_cast<int64_t>(config.delayed_update_after);
  }
  bool task_due = false;        // the boundary micro-step's task is not handed over yet
  bool boundary_micro = false;  // this micro-step ends a window
  float lr;                     // the learning rate of the next task
  bool in_micro = false;        // the micro-step has started (KickTask)
  Status broken;                // once set, every call fails with it
  // GatherMasterParameter's copy of one sub-group's states.
  std::unique_ptr<AlignedBuffer> gather_states;
  size_t gather_group = 0;
  SwapStoreStats swap_base;
  Clock::time_point step_start = Clock::now();

  Status Place();
  Status InitStores();
  // A parameter the optimizer may be rewriting now (delayed update: its gradient was reduced
  // in this boundary micro-step).
  FetchScheduler::Rewriting Rewriting() const {
    return [this](ParamId id) { return delayed && boundary_micro && grads->reduced(id); };
  }
  // Delayed update: waits until the previous window's optimizer step is done with sub-group
  // `gi`, whose accumulators the trainer is about to write. No-op otherwise.
  Status WaitStepped(size_t gi) {
    if (!delayed) return Status::OK();
    double waited = 0;
    Status s = board->WaitStepped(gi, step, &waited);
    if (waited > 0) stats.AddOptimizerWait(waited);
    return s;
  }
  // At the start of a micro-step: resets the gradient flags; a micro-step that ends a window
  // hands the optimizer its task at its first call (KickTask).
  void BeginMicroStep() {
    const bool boundary = (micro + 1) % std::max(1, config.gradient_accumulation_steps) == 0;
    grads->BeginMicroStep();
    board->BeginMicroStep(boundary, step);
    task_due = boundary;
    boundary_micro = boundary;
  }
  // Hands the optimizer thread the task of a boundary micro-step, at the micro-step's first
  // Acquire, ReduceGradient or Step (so that between steps the optimizer is idle and a
  // checkpoint can be saved or loaded). Its read-ahead of NVMe states overlaps the forward.
  void KickTask() {
    in_micro = true;
    gather_states.reset();
    if (!task_due) return;
    task_due = false;
    board->Push({step + 1, config.gradient_clipping > 0, lr});
  }
  // Between steps: waits for the optimizer step still running (delayed update) and makes its
  // parameters the ones the next micro-step reads, as a checkpoint resume would.
  Status FinishPendingUpdate() {
    ZINF_RETURN_IF_ERROR(board->WaitDone(step));
    if (visible != step) {
      visible = step;
      gather_states.reset();
      // Durable: a resume must read what the next micro-step reads (the optimizer is idle).
      return durable->Commit(step, visible);
    }
    return Status::OK();
  }
  Status CheckBetweenSteps(const char* what) const;
  // Every fetched copy goes (it holds values about to change).
  Status EvictAll() {
    for (ParamId id = 0; id < layout.num_params(); ++id) ZINF_RETURN_IF_ERROR(fetch->Evict(id));
    return Status::OK();
  }
  // Installs sub-group `gi`'s [master | m | v] from `buf` and rebuilds its parameter store
  // buffer `buf_index` from the masters.
  Status WriteGroupStates(size_t gi, const void* buf, int buf_index);
  // Stops the engine after `s`: every later call fails with "head (s); tail".
  Status Break(const std::string& head, const Status& s, const std::string& tail) {
    broken = Status::FailedPrecondition(head + " (" + s.message() + ")" + tail);
    return s;
  }
};

Engine::Impl::~Impl() {
  if (board) {
    // Delayed update: the last step's optimizer may still run; between micro-steps it needs
    // nothing more from the trainer, so let it finish and report a failure nobody saw.
    const bool drain = delayed && registered && !in_micro && broken.ok();
    Status unseen = board->Stop(drain ? step : -1);
    if (!unseen.ok()) {
      LogWarning("the last optimizer step failed and was not reported: " + unseen.ToString());
    }
  }
  if (pipeline) pipeline->Join();
  for (Stream* s : {copy_stream, comm_stream, update_stream, grad_stream}) {
    if (s == nullptr) continue;
    Status synced = device->SynchronizeStream(s);
    if (!synced.ok()) LogWarning("closing the engine: " + synced.ToString());
  }
  // Device memory and pinned buffers go back before the arena and the budget they came from.
  pipeline.reset();
  grads.reset();
  fetch.reset();
  checkpointer.reset();
  durable.reset();
  param_store.reset();
  states.reset();
  board.reset();
  swap.reset();
  collectives.reset();
  if (arena) {
    Status s = device->UnregisterHostMemory(arena->region().base);
    if (!s.ok()) LogWarning("closing the engine: " + s.ToString());
  }
}

// ---- Creation and registration ---------------------------------------------------------------

Result<std::unique_ptr<Engine>> Engine::Create(const EngineConfig& config, Device* device,
                                               Communicator* comm, const EngineHooks& hooks) {
  if (device == nullptr || comm == nullptr) {
    return Status::InvalidArgument("Engine::Create: device and communicator are required");
  }
  if (config.zero_stage != 3) {
    return Status::InvalidArgument("zero_optimization.stage: zinf implements stage 3 only");
  }
  for (const OffloadConfig* o : {&config.offload_param, &config.offload_optimizer}) {
    if (o->tier == Tier::kNvme && o->nvme_paths.empty()) {
      return Status::InvalidArgument(
          std::string(o == &config.offload_param ? "offload_param" : "offload_optimizer") +
          ": device is nvme but no nvme_path is set; add \"nvme_path\" or zinf.nvme_paths");
    }
  }
  // Sub-groups stepped on the device: all of them (offload_optimizer.device none) or those
  // beyond offload_optimizer.ratio.
  const bool device_optimizer =
      config.offload_optimizer.tier == Tier::kDevice || config.offload_optimizer.ratio < 1;
  if (device_optimizer && !device->IsHost()) {
    const char* what = config.offload_optimizer.tier == Tier::kDevice
                           ? "offload_optimizer.device none (the optimizer on the GPU)"
                           : "offload_optimizer.ratio below 1 (part of the optimizer on the GPU)";
    if (config.offload_param.tier != Tier::kDevice) {
      return Status::NotSupported(
          std::string(what) +
          " needs offload_param.device none: the GPU writes the updated parameters straight "
          "into their device stores; set offload_optimizer.ratio 1 and device cpu or nvme");
    }
    if (config.optimizer.type != OptimizerType::kAdam &&
        config.optimizer.type != OptimizerType::kAdamW) {
      return Status::NotSupported(std::string(what) + ": the GPU kernel runs Adam and AdamW, not " +
                                  OptimizerTypeName(config.optimizer.type) +
                                  "; step it on the CPU (ratio 1, device cpu or nvme)");
    }
  }
  if (config.durable) {
    if (config.offload_optimizer.tier != Tier::kNvme || config.offload_optimizer.ratio < 1) {
      return Status::InvalidArgument(
          "zinf.durable needs offload_optimizer.device nvme and offload_optimizer.ratio 1 (the "
          "states to resume from live in the swap store)");
    }
    if (config.delayed_update && comm->world_size() > 1) {
      return Status::NotSupported(
          "zinf.durable with zinf.delayed_update and more than one rank is not supported: each "
          "rank's optimizer commits on its own, so ranks can end up more than the one retained "
          "commit apart; turn one off");
    }
    if (config.delayed_update && config.offload_param.tier != Tier::kNvme) {
      return Status::InvalidArgument(
          "zinf.durable with zinf.delayed_update needs offload_param.device nvme: a resume "
          "needs the parameters one step behind the states, which only the NVMe parameter "
          "store keeps");
    }
  }
  // NVMe paths: folders, inside zinf.allowed_nvme_roots when set (again when the swap store
  // opens at placement).
  for (const OffloadConfig* o : {&config.offload_param, &config.offload_optimizer}) {
    if (o->tier == Tier::kNvme) {
      ZINF_RETURN_IF_ERROR(CheckNvmePaths(o->nvme_paths, config.allowed_nvme_roots));
    }
  }
  auto impl = std::make_unique<Impl>(config, device, comm, hooks);
  Impl& m = *impl;
  CpuOptimizer::Options oo;
  oo.num_threads = config.optimizer_threads;
  ZINF_ASSIGN_OR_RETURN(m.optimizer, CpuOptimizer::Create(oo));
  ZINF_ASSIGN_OR_RETURN(m.copy_stream, device->CreateStream("zinf-copy"));
  ZINF_ASSIGN_OR_RETURN(m.comm_stream, device->CreateStream("zinf-comm"));
  ZINF_ASSIGN_OR_RETURN(m.update_stream, device->CreateStream("zinf-update"));
  ZINF_ASSIGN_OR_RETURN(m.grad_stream, device->CreateStream("zinf-grad"));
  m.budget = std::make_unique<DeviceBudget>(
      device, config.device_budget_bytes,
      std::vector<Stream*>{m.comm_stream, m.copy_stream, m.grad_stream});
  ZINF_ASSIGN_OR_RETURN(m.collectives,
                        HostCollectives::Create(device, comm, m.budget.get(), m.comm_stream));
  m.checkpointer =
      std::make_unique<Checkpointer>(&m.layout, &m.config, m.collectives.get(), m.rank, m.world);
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

Result<ParamId> Engine::RegisterParameter(const ParamSpec& spec) {
  Impl& m = *impl_;
  ZINF_ASSIGN_OR_RETURN(ParamLayout p, m.layout.Describe(spec.name, spec.shape, spec.trainable,
                                                         m.config.param_persistence_threshold));
  if (!spec.init) {
    return Status::InvalidArgument("parameter '" + spec.name + "': needs a shape and an init");
  }
  // The largest layer must fit the device budget together with its gradient scratch.
  const uint64_t full = p.padded_numel * m.layout.elem_size();
  const uint64_t need =
      full + p.padded_numel * sizeof(float) + p.info.partition_numel * sizeof(float);
  if (m.config.device_budget_bytes != 0 && need > m.config.device_budget_bytes) {
    return Status::ResourceExhausted("parameter '" + spec.name + "' (" + FormatBytes(full) +
                                     " gathered, plus its gradient) does not fit the device "
                                     "budget of " +
                                     FormatBytes(m.config.device_budget_bytes) +
                                     "; raise zinf.device_budget_bytes to at least " +
                                     FormatBytes(need));
  }
  if (need > m.device->MemoryInfo().budget) {
    return Status::ResourceExhausted("parameter '" + spec.name + "' needs " + FormatBytes(need) +
                                     " of device memory but the device budget is " +
                                     FormatBytes(m.device->MemoryInfo().budget));
  }
  m.inits.push_back(spec.init);
  return m.layout.Add(std::move(p));
}

Status Engine::FinishRegistration() {
  Impl& m = *impl_;
  if (m.registered) return Status::OK();
  if (m.layout.num_params() == 0) return Status::FailedPrecondition("no parameters registered");
  if (m.layout.frozen()) {
    return Status::FailedPrecondition("an earlier FinishRegistration failed; recreate the engine");
  }
  ZINF_RETURN_IF_ERROR(m.Place());
  Status init = m.InitStores();
  // The initial values are in the stores (or init failed): the callbacks, and whatever they
  // hold (a spill file of the values, the trainer's buffers), are not needed any more.
  m.inits.clear();
  ZINF_RETURN_IF_ERROR(init);
  ZINF_RETURN_IF_ERROR(m.pipeline->Start());
  m.registered = true;
  m.BeginMicroStep();
  m.swap_base = m.swap ? m.swap->stats() : SwapStoreStats{};
  m.step_start = Clock::now();
  return Status::OK();
}

Status Engine::Impl::Place() {
  const size_t offloaded = layout.Freeze(config.sub_group_size, config.offload_optimizer.tier,
                                         config.offload_optimizer.ratio);
  const size_t groups = layout.num_groups();
  if (config.offload_optimizer.tier != Tier::kDevice && config.offload_optimizer.ratio < 1 &&
      rank == 0) {
    // The split is by whole sub-groups: say what the ratio became.
    char ratio[32];
    std::snprintf(ratio, sizeof(ratio), "%g", config.offload_optimizer.ratio);
    LogInfo("offload_optimizer.ratio " + std::string(ratio) + ": " + std::to_string(offloaded) +
            " of " + std::to_string(groups) + " optimizer sub-groups offloaded, " +
            std::to_string(groups - offloaded) +
            " kept and stepped on the device (lower sub_group_size for a finer split)");
  }
  ZINF_ASSIGN_OR_RETURN(PinnedPlan plan, PlanPinnedMemory(layout, config, device->IsHost()));
  PinnedArenaOptions ao;
  ao.bytes = config.pinned_budget_bytes;
  ao.lock_memory = config.offload_param.pin_memory || config.offload_optimizer.pin_memory;
  ZINF_ASSIGN_OR_RETURN(arena, PinnedArena::Create(ao));
  ZINF_RETURN_IF_ERROR(device->RegisterHostMemory(arena->region().base, arena->capacity()));
  // The fixed-size buffers first, as pools (see BlockPool); the rest of the arena is staging.
  if (plan.state_blocks > 0) {
    ZINF_RETURN_IF_ERROR(state_pool.Init(arena.get(), plan.state_block_bytes, plan.state_blocks,
                                         "optimizer buffers"));
  }
  if (plan.copy_blocks > 0) {
    ZINF_RETURN_IF_ERROR(copy_pool.Init(arena.get(), plan.copy_block_bytes, plan.copy_blocks,
                                        "parameter copy buffers"));
  }
  if (plan.stream_grads) {
    ZINF_RETURN_IF_ERROR(grad_pool.Init(arena.get(), plan.grad_block_bytes, plan.grad_blocks,
                                        "gradient accumulators"));
  }

  // The components over the frozen layout.
  board = std::make_unique<GroupBoard>(&layout);
  param_store = std::make_unique<ParamStore>(&layout, &config, device, budget.get(), &stats,
                                             copy_stream, update_stream);
  states = std::make_unique<StateStore>(&layout, &config, device, budget.get(), copy_stream,
                                        update_stream);
  fetch = std::make_unique<FetchScheduler>(
      &layout, &config, device, comm, budget.get(), &stats, param_store.get(), &trace,
      FetchScheduler::Streams{copy_stream, comm_stream, grad_stream});
  ZINF_RETURN_IF_ERROR(fetch->Init());
  grads = std::make_unique<GradientPath>(&layout, &config, device, comm, budget.get(), &stats,
                                         board.get(), fetch.get(),
                                         GradientPath::Streams{comm_stream, grad_stream});
  ZINF_RETURN_IF_ERROR(grads->Init());
  durable = std::make_unique<DurableCommits>(&layout, &config, states.get(), collectives.get(),
                                             rank, world);
  checkpointer->Attach(states.get());
  OptimizerPipeline::Parts parts;
  parts.layout = &layout;
  parts.config = &config;
  parts.device = device;
  parts.update_stream = update_stream;
  parts.budget = budget.get();
  parts.stats = &stats;
  parts.board = board.get();
  parts.states = states.get();
  parts.params = param_store.get();
  parts.grads = grads.get();
  parts.durable = durable.get();
  parts.optimizer = optimizer.get();
  pipeline = std::make_unique<OptimizerPipeline>(parts);

  if (config.offload_param.tier == Tier::kNvme || config.offload_optimizer.tier == Tier::kNvme) {
    ZINF_ASSIGN_OR_RETURN(SwapStoreOptions so,
                          SwapStoreOptionsFor(config, rank, world, *arena, hooks));
    so.reopen = resume_store;
    if (resume_store) {
      ZINF_ASSIGN_OR_RETURN(so.reopen_previous, durable->AgreeOnCommit(so.paths[0]));
    } else {
      ZINF_RETURN_IF_ERROR(durable->RefuseOverwrite(so.paths[0]));
    }
    Result<std::unique_ptr<SwapStore>> opened = SwapStore::Open(so);
    if (!opened.ok() && resume_store) {
      return opened.status().WithContext("ResumeFromStore: reopening the swap store in " +
                                         so.paths[0]);
    }
    ZINF_ASSIGN_OR_RETURN(swap, std::move(opened));
  }
  states->Attach(swap.get(), &state_pool);
  fetch->Attach(arena.get(), swap.get());
  grads->Attach(arena.get(), &grad_pool, plan.stream_grads);
  durable->Attach(swap.get());
  return pipeline->Attach(swap.get(), &state_pool, &copy_pool);
}

Status Engine::Impl::InitStores() {
  // Resuming a durable store: the states come from it, and so do NVMe parameter stores
  // written in the same dtype; everything else is rebuilt from the masters.
  ParamStore::Resume resume;
  if (resume_store) {
    DurableCommits::Point point;
    ZINF_RETURN_IF_ERROR(durable->Check(swap->committed_meta(), &point));
    durable->set_lineage(point.lineage);
    for (ParamId id = 0; id < layout.num_params(); ++id) states->set_updates(id, point.updates[id]);
    resume.active = true;
    resume.stored_params = point.param_keys;
    resume.step = point.step;
    resume.visible = point.visible;
    if (config.offload_param.tier != Tier::kNvme) {
      // Parameter stores of an earlier run with NVMe parameters: stale from now on (this run
      // keeps its parameters elsewhere); drop them so no later resume can trust them.
      for (const std::string& key : swap->Keys()) {
        if (key.rfind("param/", 0) == 0) ZINF_RETURN_IF_ERROR(swap->Remove(key));
      }
    }
  }
  // Optimizer states per sub-group, parameters per store.
  std::vector<float> full;
  for (size_t gi = 0; gi < layout.num_groups(); ++gi) {
    float* master = nullptr;
    PooledBlock staging;
    ZINF_RETURN_IF_ERROR(states->Allocate(gi, &master, &staging));
    if (resume.active) {  // durable mode: states on NVMe (checked at Create)
      ZINF_RETURN_IF_ERROR(states->ReadCommitted(gi, master, staging.capacity()));
    } else {
      std::memset(master, 0, layout.GroupStateBytes(gi));  // exp_avg and exp_avg_sq start at zero
    }
    for (ParamId id : layout.group(gi).params) {
      const ParamLayout& p = layout.param(id);
      const float* part = master + p.slice_offset;
      if (!resume.active) {
        full.assign(p.padded_numel, 0.0f);
        inits[id](full.data(), p.info.numel);
        std::memcpy(master + p.slice_offset,
                    full.data() + static_cast<size_t>(rank) * p.info.partition_numel,
                    p.info.partition_numel * sizeof(float));
      }
      // The parameter store, in storage dtype.
      PinnedBuffer image;
      ZINF_ASSIGN_OR_RETURN(image, arena->Allocate(layout.PartBytes(id)));
      if (config.bf16) {
        ZINF_RETURN_IF_ERROR(optimizer->ConvertParams(part, image.data(), ParamCopyType::kBf16,
                                                      p.info.partition_numel));
      } else {
        std::memcpy(image.data(), part, layout.PartBytes(id));
      }
      ZINF_RETURN_IF_ERROR(
          param_store->Init(id, std::move(image), arena.get(), swap.get(), resume));
      if (world == 1 && config.offload_param.tier == Tier::kDevice) fetch->Alias(id);
    }
    if (!resume.active) ZINF_RETURN_IF_ERROR(states->Publish(gi, master, staging.capacity()));
    ZINF_RETURN_IF_ERROR(grads->AllocateGroup(gi));
  }
  if (resume.active) {
    step = resume.step;
    visible = resume.visible;
    micro = resume.step * std::max(1, config.gradient_accumulation_steps);
    board->ResetTo(resume.step);
    return Status::OK();
  }
  // Durable: the initial state is the first commit (a crash in step 1 resumes at step 0).
  return durable->Commit(0, 0);
}

Status Engine::ResumeFromStore() {
  Impl& m = *impl_;
  if (!m.config.durable) {
    return Status::FailedPrecondition(
        "ResumeFromStore needs zinf.durable (a store that commits every step)");
  }
  if (m.registered) {
    return Status::FailedPrecondition(
        "ResumeFromStore must come after registering the parameters and before the first "
        "Acquire, Step or FinishRegistration");
  }
  m.resume_store = true;
  Status s = FinishRegistration();
  m.resume_store = false;
  if (!s.ok()) {
    m.broken = Status::FailedPrecondition("ResumeFromStore failed (" + s.message() +
                                          "); recreate the engine");
  }
  return s;
}

Status Engine::SetAcquireOrder(const std::vector<ParamId>& order) {
  Impl& m = *impl_;
  for (ParamId id : order) {
    if (id >= m.layout.num_params()) {
      return Status::InvalidArgument("SetAcquireOrder: unknown parameter id " + std::to_string(id));
    }
  }
  m.trace.SetOrder(order);
  return Status::OK();
}

// ---- Parameters --------------------------------------------------------------------------------

Result<std::vector<void*>> Engine::Acquire(const std::vector<ParamId>& ids, AcquireMode mode) {
  Impl& m = *impl_;
  if (!m.broken.ok()) return m.broken;
  if (!m.registered) ZINF_RETURN_IF_ERROR(FinishRegistration());
  const bool training = mode == AcquireMode::kTraining;
  for (ParamId id : ids) {
    if (id >= m.layout.num_params()) {
      return Status::InvalidArgument("Acquire: unknown parameter id " + std::to_string(id));
    }
    if (m.fetch->AcquiredStale(id, m.visible)) {
      return Status::FailedPrecondition(
          "Acquire('" + m.layout.param(id).info.name +
          "'): it is still acquired from before the optimizer step "
          "that changed it (its memory holds the old values); release it first");
    }
  }
  if (!training && m.boundary_micro && m.grads->reduced_this_micro()) {
    // The optimizer may be rewriting the parameter stores of sub-groups whose gradients are
    // complete: an inference fetch now could read a half-written buffer.
    return Status::FailedPrecondition(
        "an inference Acquire between ReduceGradient and Step at an accumulation boundary: the "
        "optimizer may be rewriting the parameters; evaluate between optimizer steps");
  }
  if (training) m.KickTask();
  return m.fetch->Acquire(ids, m.visible, training, m.Rewriting());
}

Status Engine::Release(const std::vector<ParamId>& ids) {
  Impl& m = *impl_;
  if (!m.registered) {
    return Status::FailedPrecondition("Release before any Acquire");
  }
  return m.fetch->Release(ids, m.visible, m.Rewriting());
}

Status Engine::ReduceGradient(ParamId id, const float* grad) {
  Impl& m = *impl_;
  if (!m.broken.ok()) return m.broken;
  if (id >= m.layout.num_params()) {
    return Status::InvalidArgument("ReduceGradient: unknown parameter id " + std::to_string(id));
  }
  if (!m.registered) return Status::FailedPrecondition("ReduceGradient before any Acquire");
  m.KickTask();
  const ParamLayout& p = m.layout.param(id);
  if (!p.info.trainable) {
    return Status::FailedPrecondition("ReduceGradient('" + p.info.name +
                                      "'): the parameter is frozen (registered with trainable "
                                      "false); it takes no gradient");
  }
  if (m.grads->reduced(id)) {
    return Status::FailedPrecondition("ReduceGradient('" + p.info.name +
                                      "') twice in one micro-step");
  }
  // The optimizer step this micro-step completes (0: none); the sub-group's accumulators must
  // be free of the previous window's step (delayed update) before this gradient goes in.
  const int64_t ready = m.boundary_micro ? m.step + 1 : 0;
  ZINF_RETURN_IF_ERROR(m.WaitStepped(p.info.sub_group));
  Status s = m.grads->Reduce(id, grad, ready);
  if (!s.ok()) {
    // Part of the gradient may be in its accumulator, and the optimizer may wait for it.
    return m.Break("the engine stopped: ReduceGradient('" + p.info.name + "') failed part-way", s,
                   "; recreate it (from a checkpoint) to continue");
  }
  return Status::OK();
}

// ---- Steps -----------------------------------------------------------------------------------

Result<StepStats> Engine::Step() {
  Impl& m = *impl_;
  if (!m.broken.ok()) return m.broken;
  if (!m.registered) ZINF_RETURN_IF_ERROR(FinishRegistration());
  m.KickTask();
  const bool boundary = m.boundary_micro;
  // Gradients of this micro-step must have landed before the next one starts.
  Status s = m.budget->ReclaimScratch();
  if (!s.ok()) {
    return m.Break("the engine stopped after an error in a previous step", s,
                   "; recreate it (from a checkpoint) to continue");
  }
  StepStats st;
  const auto wait0 = Clock::now();
  // A boundary Step that fails part-way has landed some gradients and left the optimizer
  // waiting for the rest: it cannot be retried.
  auto fail_boundary = [&m](const Status& err) {
    return m.Break("the engine stopped: a Step at an accumulation boundary failed", err,
                   "; recreate it (from a checkpoint) to continue");
  };
  if (boundary) {
    // Parameters that got no gradient in the whole window: the optimizer skips them (their
    // has_grad flag is unset); their accumulators are zeroed so that the clipping norm and a
    // device step's gradient copy read zeros, not the last window's values.
    // The optimizer thread has this task since the micro-step began and may have stepped the
    // sub-groups whose gradients are complete. Parameters not reduced in this last micro-step
    // have final accumulators already: count them as landed.
    // (Streaming accumulators: a sub-group none of whose parameters has a gradient holds no
    // block, and nothing reads its accumulators, so there is nothing to zero.)
    s = m.grads->CompleteWindow(m.step + 1, [&m](size_t gi) { return m.WaitStepped(gi); });
    if (!s.ok()) return fail_boundary(s);
    if (m.config.gradient_clipping > 0) {
      // Wait-for-norm: every sub-group waits for the global norm, computed here once all
      // gradients have landed (they have: the streams were synchronized above).
      Result<double> local = m.grads->LocalSumSquares(m.optimizer.get());
      if (!local.ok()) return fail_boundary(local.status());
      float total = static_cast<float>(*local);
      s = m.collectives->AllReduceSum(&total, 1, m.device->ComputeStream(), "gradient norm");
      if (!s.ok()) return fail_boundary(s);
      const double norm = std::sqrt(static_cast<double>(total));
      st.grad_norm = norm;
      if (!std::isfinite(norm)) {
        // No sub-group has been stepped (they wait for the norm): nothing non-finite is
        // written, and the step is refused as a whole.
        return fail_boundary(Status::FailedPrecondition(
            "the gradient norm of step " + std::to_string(m.step + 1) +
            " is not finite (a gradient holds inf or NaN): no parameter was updated; lower the "
            "learning rate or look at the loss, then resume from the last checkpoint"));
      }
      float coef = 1.0f;
      if (norm > m.config.gradient_clipping) {
        coef = static_cast<float>(m.config.gradient_clipping / (norm + 1e-6));
      }
      m.board->SetClipCoef(m.step + 1, coef);
    }
    // Without the delayed update, this window's optimizer step must be done: the next
    // micro-step reads its parameters. With it, the next micro-step reads the previous step's
    // (version m.step), and this one runs on while the trainer goes on.
    Status opt = m.board->WaitDone(m.DelayedStep(m.step + 1) ? m.step : m.step + 1);
    if (!opt.ok()) {
      return m.Break("the optimizer failed", opt,
                     "; parameters may be partly updated: recreate the engine from a checkpoint");
    }
    ++m.step;
    m.visible = m.DelayedStep(m.step) ? std::max(m.visible, m.step - 1) : m.step;
    m.grads->EndWindow();
    st.optimizer_ran = true;
    // Durable: the step's writes are complete (the optimizer waited for them): publish them.
    // A delayed step is committed by the optimizer thread once its update is written.
    s = m.DelayedStep(m.step) ? Status::OK() : m.durable->Commit(m.step, m.visible);
    if (!s.ok()) {
      return m.Break("the durable swap store could not commit step " + std::to_string(m.step), s,
                     "; resume from its last commit");
    }
  }
  const double opt_wait = Since(wait0);
  ++m.micro;
  m.BeginMicroStep();
  m.in_micro = false;
  m.trace.EndMicroStep();
  // The updated parameters are in their stores: start fetching the next micro-step's first
  // ones now, while the trainer prepares its next batch.
  m.fetch->Prefetch(m.visible, m.Rewriting());

  // Statistics.
  st.step = m.step;
  st.step_seconds = Since(m.step_start);
  st.trace_valid = m.trace.valid();
  const StatsRecorder::Counters c = m.stats.Take();
  st.h2d_bytes = c.h2d;
  st.d2h_bytes = c.d2h;
  st.copy_busy_seconds = c.copy_busy;
  st.optimizer_busy_seconds = c.optimizer_busy;
  st.acquire_wait_seconds = c.acquire_wait;
  st.optimizer_wait_seconds = opt_wait + c.optimizer_wait;
  st.prefetch_hits = c.hits;
  st.prefetch_misses = c.misses;
  st.peak_device_bytes = m.budget->TakePeak();
  if (m.swap) {
    SwapStoreStats now = m.swap->stats();
    st.nvme_read_bytes = now.bytes_read - m.swap_base.bytes_read;
    st.nvme_write_bytes = now.bytes_written - m.swap_base.bytes_written;
    st.nvme_busy_seconds = now.busy_seconds - m.swap_base.busy_seconds;
    st.nvme_bytes = now.file_bytes;
    m.swap_base = now;
  }
  st.peak_pinned_bytes = m.arena ? m.arena->peak_used() : 0;
  const double compute = st.step_seconds - st.acquire_wait_seconds - st.optimizer_wait_seconds;
  const double busiest = std::max({st.nvme_busy_seconds, st.copy_busy_seconds,
                                   st.optimizer_busy_seconds, std::max(compute, 0.0)});
  st.overlap_efficiency = st.step_seconds > 0 ? std::min(1.0, busiest / st.step_seconds) : 0;
  m.step_start = Clock::now();
  return st;
}

// ---- Checkpoints and values between steps ---------------------------------------------------

Status Engine::Impl::CheckBetweenSteps(const char* what) const {
  if (!broken.ok()) return broken;
  if (in_micro || micro % std::max(1, config.gradient_accumulation_steps) != 0) {
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
    return param_store->WriteGroup(gi, master, copy_out, buf_index, swap.get(), nullptr);
  }
  std::vector<Ticket> writes;
  Status s = param_store->WriteGroup(gi, master, copy_out, buf_index, swap.get(), &writes);
  for (Ticket t : writes) {
    Status w = swap->Wait(t);
    if (s.ok()) s = w;
  }
  return s;
}

Status Engine::PrepareCheckpointDir(const std::string& dir) {
  return impl_->checkpointer->Prepare(dir);
}

Status Engine::SaveCheckpoint(const std::string& dir, const std::string& user_data) {
  Impl& m = *impl_;
  if (!m.registered) ZINF_RETURN_IF_ERROR(FinishRegistration());
  ZINF_RETURN_IF_ERROR(m.CheckBetweenSteps("SaveCheckpoint"));
  if (!IsValidUtf8(user_data)) {
    return Status::InvalidArgument(
        "SaveCheckpoint: the user data is not valid UTF-8 (it goes "
        "into the JSON manifest); encode it, e.g. as base64");
  }
  ZINF_RETURN_IF_ERROR(m.budget->ReclaimScratch());
  ZINF_RETURN_IF_ERROR(m.collectives->Agree(m.FinishPendingUpdate(), "SaveCheckpoint"));
  return m.checkpointer->Save(dir, user_data, m.step);
}

Status Engine::LoadCheckpoint(const std::string& dir, std::string* user_data,
                              bool fall_back_to_older) {
  Impl& m = *impl_;
  if (!m.registered) ZINF_RETURN_IF_ERROR(FinishRegistration());
  ZINF_RETURN_IF_ERROR(m.CheckBetweenSteps("LoadCheckpoint"));
  ZINF_RETURN_IF_ERROR(m.budget->ReclaimScratch());
  ZINF_RETURN_IF_ERROR(m.collectives->Agree(m.FinishPendingUpdate(), "LoadCheckpoint"));
  RankManifest man;
  bool install_failed = false;
  Status s = m.checkpointer->Load(
      dir, fall_back_to_older,
      [&] {
        // Fetched parameter copies are stale from here on.
        m.gather_states.reset();
        return m.EvictAll();
      },
      [&](size_t gi, const void* buf, int64_t version) {
        return m.WriteGroupStates(gi, buf, m.param_store->Buf(version));
      },
      &man, &install_failed);
  if (!s.ok()) {
    if (install_failed) {
      m.broken = Status::FailedPrecondition("LoadCheckpoint failed while installing states (" +
                                            s.message() + "); recreate the engine");
    }
    return s;
  }
  m.step = man.step;
  m.visible = man.step;
  for (ParamId id = 0; id < m.layout.num_params(); ++id) {
    m.states->set_updates(id, man.tensors[id].updates >= 0 ? man.tensors[id].updates : man.step);
  }
  // A new history (the same value on every rank: they load the same checkpoint).
  m.durable->NewLineage(man.step);
  m.board->ResetTo(man.step);
  m.micro = man.step * std::max(1, m.config.gradient_accumulation_steps);
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
  // The optimizer steps of finished windows (delayed update: the last one may still run).
  ZINF_RETURN_IF_ERROR(m.board->WaitDone(m.step));
  const ParamLayout& p = m.layout.param(id);
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
  ZINF_RETURN_IF_ERROR(m.collectives->Agree(m.FinishPendingUpdate(), "SetParameterValues"));
  m.gather_states.reset();
  size_t group_bytes = 0;
  Status local;
  for (ParamId id = 0; id < m.layout.num_params() && local.ok(); ++id) {
    if (!wanted[id]) continue;
    group_bytes =
        std::max(group_bytes, m.layout.GroupStateBytes(m.layout.param(id).info.sub_group));
    local = m.fetch->Evict(id);  // a fetched copy holds the old values
  }
  bool changed = false;  // some sub-group was written
  if (local.ok() && group_bytes > 0) {
    HostStates host;
    local = AllocateHostStates(m.arena.get(), group_bytes, &host);
    std::vector<float> full;
    for (size_t gi = 0; gi < m.layout.num_groups() && local.ok(); ++gi) {
      const GroupLayout& g = m.layout.group(gi);
      if (std::none_of(g.params.begin(), g.params.end(), [&](ParamId id) { return wanted[id]; })) {
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
        local = m.WriteGroupStates(gi, master, m.param_store->Buf(m.visible));
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
  // Durable: the new values are a new history, committed at once.
  m.durable->NewLineage(m.step);
  Status committed = m.durable->Commit(m.step, m.visible);
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
  (void)m.board->WaitDone(m.step);
  return m.states->updates(id);
}

Status Engine::SetLearningRate(float lr) {
  if (!std::isfinite(lr) || lr < 0) {
    return Status::InvalidArgument("SetLearningRate: the learning rate must be finite and >= 0");
  }
  impl_->lr = lr;
  return Status::OK();
}

int64_t Engine::global_step() const { return impl_->step; }
int Engine::rank() const { return impl_->rank; }
int Engine::world_size() const { return impl_->world; }
size_t Engine::num_params() const { return impl_->layout.num_params(); }
const ParamInfo& Engine::param(ParamId id) const { return impl_->layout.params().at(id).info; }
const EngineConfig& Engine::config() const { return impl_->config; }

}  // namespace zinf
