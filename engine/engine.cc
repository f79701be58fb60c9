// The engine's façade: creation and its feasibility checks, registration and placement, and
// the sequencing of micro-steps and optimizer steps over the components that do the work
// (engine/*.h; docs/layout.md names each and what it owns).
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

#include <xxhash.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <system_error>

#include "common/utf8.h"
#include "engine/core/memory_plan.h"
#include "engine/core/rank_agreement.h"
#include "engine/engine_impl.h"
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

Engine::Impl::~Impl() {
  if (board) {
    // Delayed update: the last step's optimizer may still run; between micro-steps it needs
    // nothing more from the trainer, so let it finish and report a failure nobody saw.
    const bool drain = clock.delayed() && registered && !clock.in_micro() && broken.ok();
    Status unseen = board->Stop(drain ? clock.step() : -1);
    if (!unseen.ok()) {
      LogWarning("the last optimizer step failed and was not reported: " + unseen.ToString());
    }
  }
  if (pipeline) pipeline->Join();
  // The compute stream too: buffers whose free waits for it (evicted parameters) go back with
  // the budget below.
  for (Stream* s :
       {device->ComputeStream(), streams.copy, streams.comm, streams.update, streams.grad}) {
    if (s == nullptr) continue;
    Status synced = device->SynchronizeStream(s);
    if (!synced.ok()) LogWarning("closing the engine: " + synced.ToString());
  }
  // Device memory and pinned buffers go back before the arena and the budget they came from.
  pipeline.reset();
  grads.reset();
  fetch.reset();
  adder.reset();  // after the gradient path and the fetch scheduler (they drain it)
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
  // The configuration's own checks (the same as for a parsed config), then what depends on
  // the device and the ranks.
  ZINF_RETURN_IF_ERROR(ValidateEngineConfig(config));
  ZINF_RETURN_IF_ERROR(CheckFeasible(config, device->Caps(), comm->world_size()));
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
  ZINF_ASSIGN_OR_RETURN(m.streams.copy, device->CreateStream("zinf-copy"));
  ZINF_ASSIGN_OR_RETURN(m.streams.comm, device->CreateStream("zinf-comm"));
  ZINF_ASSIGN_OR_RETURN(m.streams.update, device->CreateStream("zinf-update"));
  ZINF_ASSIGN_OR_RETURN(m.streams.grad, device->CreateStream("zinf-grad"));
  m.budget = std::make_unique<DeviceBudget>(
      device, config.device_budget_bytes,
      std::vector<Stream*>{m.streams.comm, m.streams.copy, m.streams.grad});
  ZINF_ASSIGN_OR_RETURN(m.collectives,
                        HostCollectives::Create(device, comm, m.budget.get(), m.streams.comm));
  m.checkpointer = std::make_unique<Checkpointer>(&m.layout, &m.config, m.collectives.get(), m.rank,
                                                  m.world, hooks.checkpoint_validated);
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
  const uint64_t need = full + GradientScratchBytes(p, m.config);
  if (m.config.device_budget_bytes != 0 && need > m.config.device_budget_bytes) {
    return Status::ResourceExhausted("parameter '" + spec.name + "' (" + FormatBytes(full) +
                                     " gathered, plus its gradient) does not fit the device "
                                     "budget of " +
                                     FormatBytes(m.config.device_budget_bytes) +
                                     "; raise zinf.device_budget_bytes to at least " +
                                     FormatBytes(need))
        .WithKey("zinf.device_budget_bytes");
  }
  if (need > m.device->MemoryInfo().budget) {
    return Status::ResourceExhausted("parameter '" + spec.name + "' needs " + FormatBytes(need) +
                                     " of device memory but the device budget is " +
                                     FormatBytes(m.device->MemoryInfo().budget))
        .WithKey("zinf.device_budget_bytes");
  }
  if (spec.param_group >= m.groups.size()) {
    return Status::InvalidArgument(
        "parameter '" + spec.name + "': parameter group " + std::to_string(spec.param_group) +
        " does not exist (" + std::to_string(m.groups.size()) +
        " defined); define it with SetParamGroup before registering its parameters");
  }
  p.info.param_group = spec.param_group;
  m.inits.push_back(spec.init);
  return m.layout.Add(std::move(p));
}

Status Engine::FinishRegistration() {
  Impl& m = *impl_;
  if (m.registered) return Status::OK();
  if (m.layout.frozen()) {
    return Status::FailedPrecondition("an earlier FinishRegistration failed; recreate the engine");
  }
  // The ranks agree on what they train before any other collective: a rank with another
  // model or setting is refused on every rank, naming the difference (never a collective of
  // another size, which gloo aborts on, or a wait for the collective timeout).
  std::vector<std::pair<std::string, std::string>> settings = m.agreement;
  settings.emplace_back("resume from the durable store", m.resume_store ? "yes" : "no");
  for (size_t g = 0; g < m.groups.size(); ++g) {
    const ParamGroupHyper& h = m.groups[g];
    std::ostringstream text;
    text.precision(9);
    text << "lr " << h.lr << ", betas " << h.beta1 << ", " << h.beta2 << ", eps " << h.eps
         << ", weight_decay " << h.weight_decay;
    settings.emplace_back("parameter group " + std::to_string(g), text.str());
  }
  ZINF_RETURN_IF_ERROR(AgreeAcrossRanks(
      m.collectives.get(), m.world, "the model and its training settings",
      DescribeForAgreement(m.config, m.layout, settings),
      "Start every rank with the same model, configuration and trainer settings."));
  if (m.layout.num_params() == 0) return Status::FailedPrecondition("no parameters registered");
  Status placed = m.Place();
  // A rank that cannot place its stores fails the others too (no collective in Place
  // without a resume; a resume's agreement on the commit has its own).
  if (m.world > 1 && !m.resume_store)
    placed = m.collectives->Agree(placed, "placing the parameters");
  ZINF_RETURN_IF_ERROR(placed);
  m.initial_hashes.clear();
  Status init = m.InitStores();
  // The initial values are in the stores (or init failed): the callbacks, and whatever they
  // hold (a spill file of the values, the trainer's buffers), are not needed any more.
  m.inits.clear();
  if (m.world > 1) {
    // Every rank learns whether every rank initialised. Whether they hold the same values
    // (ranks that initialise differently train a mix of models) is compared at the first
    // call that uses them, after any load that replaces them.
    init = m.collectives->Agree(init, "initialising the parameters");
    m.values_unchecked = init.ok() && !m.initial_hashes.empty();
  }
  ZINF_RETURN_IF_ERROR(init);
  ZINF_RETURN_IF_ERROR(m.pipeline->Start());
  m.registered = true;
  m.BeginMicroStep();
  // The statistics of the first step start here (its swap traffic after the initialisation).
  StepStats unused;
  m.stats.FinishStep({0, 0, 0, m.swap.get(), m.optimizer->cpu_seconds()}, &unused);
  return Status::OK();
}

namespace {

// How many ranks wrote the swap store in the first NVMe folder of `config`: one subfolder
// rank<k> per rank with several, the folder itself with one; 0 when it holds nothing.
int RanksThatWroteTheStore(const EngineConfig& config) {
  const std::vector<std::string>& paths = config.offload_optimizer.tier == Tier::kNvme
                                              ? config.offload_optimizer.nvme_paths
                                              : config.offload_param.nvme_paths;
  if (paths.empty()) return 0;
  std::error_code ec;
  int ranks = 0;
  bool files = false;
  std::filesystem::directory_iterator it(paths[0], ec);
  for (; !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    int k = -1;
    const char* digits = name.c_str() + 4;
    if (it->is_directory(ec) && name.size() > 4 && name.size() < 12 && name.rfind("rank", 0) == 0 &&
        std::from_chars(digits, name.c_str() + name.size(), k).ptr == name.c_str() + name.size() &&
        !std::filesystem::is_empty(it->path(), ec)) {
      ranks = std::max(ranks, k + 1);
    } else if (it->is_regular_file(ec)) {
      files = true;
    }
  }
  return ranks > 0 ? ranks : (files ? 1 : 0);
}

// A failed resume of a durable store that another number of ranks wrote says so, with both
// counts (a store is bound to its world size; checkpoints move between them).
Status WithWorldHint(const Status& failed, const EngineConfig& config, int world) {
  const int wrote = RanksThatWroteTheStore(config);
  if (wrote == 0 || wrote == world) return failed;
  return Status(failed.code(), failed.message() + " (the store there was written by " +
                                   std::to_string(wrote) + (wrote == 1 ? " rank" : " ranks") +
                                   ", and this run has " + std::to_string(world) +
                                   ": a durable store resumes with the number of ranks "
                                   "that wrote it; resume with " +
                                   std::to_string(wrote) +
                                   ", or save a checkpoint there and load it with " +
                                   std::to_string(world) + ")");
}

}  // namespace

Status Engine::Impl::CheckInitialValues() {
  if (!values_unchecked) return Status::OK();
  values_unchecked = false;
  Status s = AgreeAcrossRanks(collectives.get(), world, "the initial parameter values",
                              DescribeValues(layout, initial_hashes),
                              "Every rank must initialise the model identically (seed every "
                              "rank's random generator the same), or load the same weights "
                              "on every rank before training.");
  if (!s.ok()) broken = s;  // the ranks hold a mix of models
  return s;
}

Status Engine::CompareAcrossRanks(const std::string& what, const std::string& text,
                                  const std::string& remedy) {
  Impl& m = *impl_;
  return AgreeAcrossRanks(m.collectives.get(), m.world, what, text, remedy);
}

Status Engine::RequireAgreement(const std::string& name, const std::string& value) {
  Impl& m = *impl_;
  if (m.registered || m.layout.frozen()) {
    return Status::FailedPrecondition("RequireAgreement('" + name +
                                      "') after registration ended: call it before "
                                      "FinishRegistration");
  }
  if (name.empty() || name.find_first_of("\n:") != std::string::npos ||
      value.find('\n') != std::string::npos) {
    return Status::InvalidArgument("RequireAgreement: the name '" + name +
                                   "' must be a non-empty line without ':', the value one line");
  }
  m.agreement.emplace_back(name, value);
  return Status::OK();
}

Status Engine::Impl::Place() {
  const size_t offloaded = layout.Freeze(config.sub_group_size, config.offload_optimizer.tier,
                                         config.offload_optimizer.ratio);
  const size_t groups = layout.GroupOrder().size();  // (the frozen sub-group is not stepped)
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
  if (plan.snapshot_blocks > 0) {
    ZINF_RETURN_IF_ERROR(snapshot_pool.Init(arena.get(), plan.snapshot_block_bytes,
                                            plan.snapshot_blocks, "speculative-step snapshots"));
  }
  if (plan.speculation_wanted && rank == 0) {
    const size_t stepped = layout.GroupOrder().size();
    LogInfo(plan.snapshot_blocks > 0
                ? "zinf.speculative_step: up to " + std::to_string(plan.snapshot_blocks) + " of " +
                      std::to_string(stepped) +
                      " optimizer sub-groups are stepped before the gradient norm is known (" +
                      FormatBytes(plan.snapshot_blocks * plan.snapshot_block_bytes) +
                      " of pinned snapshots)"
                : "zinf.speculative_step \"auto\": off, the pinned budget has no room for a " +
                      FormatBytes(plan.snapshot_block_bytes) +
                      " snapshot; raise zinf.pinned_budget_bytes to step sub-groups before the "
                      "gradient norm is known");
  }
  if (plan.stream_grads) {
    ZINF_RETURN_IF_ERROR(grad_pool.Init(arena.get(), plan.grad_block_bytes, plan.grad_blocks,
                                        "gradient accumulators"));
  }

  // The swap store first: every component gets it at construction.
  if (config.offload_param.tier == Tier::kNvme || config.offload_optimizer.tier == Tier::kNvme) {
    ZINF_ASSIGN_OR_RETURN(SwapStoreOptions so,
                          SwapStoreOptionsFor(config, rank, world, *arena, hooks.fault_plan));
    so.reopen = resume_store;
    // A fresh store never replaces another one (the store refuses, AlreadyExists) unless
    // zinf.durable_overwrite says to.
    so.overwrite = config.durable_overwrite;
    if (resume_store) {
      const CommitRecord record(&layout, &config, world);
      Result<CommitRecord::Agreement> agreed =
          record.AgreeOnCommit(collectives.get(), rank, so.paths);
      if (!agreed.ok()) return WithWorldHint(agreed.status(), config, world);
      const CommitRecord::Agreement a = *agreed;
      so.reopen_previous = a.previous;
      if (a.fresh) {  // nothing was ever committed: a fresh start replaces nothing of value
        resume_store = false;
        so.reopen = false;
      }
    }
    Result<std::unique_ptr<SwapStore>> opened = SwapStore::Open(so);
    if (!opened.ok() && resume_store) {
      return WithWorldHint(opened.status().WithContext(
                               "ResumeFromStore: reopening the swap store in " + so.paths[0]),
                           config, world);
    }
    if (!opened.ok() && opened.status().code() == StatusCode::kAlreadyExists) {
      return CommitRecord::ExplainExisting(so.paths);
    }
    ZINF_ASSIGN_OR_RETURN(swap, std::move(opened));
  }

  // The components over the frozen layout, once, in dependency order.
  board = std::make_unique<GroupBoard>(&layout);
  EngineContext ctx;
  ctx.layout = &layout;
  ctx.config = &config;
  ctx.device = device;
  ctx.comm = comm;
  ctx.streams = streams;
  ctx.budget = budget.get();
  ctx.stats = &stats;
  ctx.board = board.get();
  ctx.arena = arena.get();
  ctx.swap = swap.get();
  param_store = std::make_unique<ParamStore>(ctx);
  states = std::make_unique<StateStore>(ctx, &state_pool);
  try {
    adder = std::make_unique<GradientAdder>();
  } catch (const std::system_error& e) {  // no thread could be started
    return Status::ResourceExhausted(std::string("starting the gradient adder thread: ") +
                                     e.what());
  }
  fetch = std::make_unique<FetchScheduler>(ctx, param_store.get(), &trace, adder.get());
  ZINF_RETURN_IF_ERROR(fetch->Init());
  grads =
      std::make_unique<GradientPath>(ctx, fetch.get(), adder.get(), &grad_pool, plan.stream_grads);
  ZINF_RETURN_IF_ERROR(grads->Init());
  durable = std::make_unique<DurableCommits>(ctx, states.get(), param_store.get());
  durable->set_user_data(commit_user_data);
  OptimizerPipeline::Parts parts;
  parts.states = states.get();
  parts.params = param_store.get();
  parts.grads = grads.get();
  parts.durable = durable.get();
  parts.optimizer = optimizer.get();
  parts.state_pool = &state_pool;
  parts.copy_pool = &copy_pool;
  parts.snapshot_pool = &snapshot_pool;
  pipeline = std::make_unique<OptimizerPipeline>(ctx, parts);
  return Status::OK();
}

Status Engine::Impl::InitStores() {
  // Resuming a durable store: the states come from it, and so do NVMe parameter stores
  // written in the same dtype; everything else is rebuilt from the masters.
  ParamStore::Resume resume;
  CommitRecord::Point point;
  if (resume_store) {
    ZINF_RETURN_IF_ERROR(durable->record().Check(swap->committed_meta(), &point));
    durable->set_lineage(point.lineage);
    resumed_user_data = point.user_data;
    reopened_store = true;
    for (ParamId id = 0; id < layout.num_params(); ++id) {
      states->set_updates(id, layout.param(id).info.trainable ? point.updates[id] : 0);
    }
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
    if (layout.group(gi).frozen) {
      ZINF_RETURN_IF_ERROR(InitFrozen(gi, resume, point.frozen_hashes));
      continue;
    }
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
        if (world > 1) {
          initial_hashes.resize(layout.num_params(), 0);
          initial_hashes[id] = XXH3_64bits(full.data(), p.info.numel * sizeof(float));
        }
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
      ZINF_RETURN_IF_ERROR(param_store->Init(id, std::move(image), resume));
      if (world == 1 && config.offload_param.tier == Tier::kDevice) fetch->Alias(id);
    }
    if (!resume.active) ZINF_RETURN_IF_ERROR(states->Publish(gi, master, staging.capacity()));
    ZINF_RETURN_IF_ERROR(grads->AllocateGroup(gi));
  }
  if (resume.active) {
    clock.Reset(resume.step, resume.visible);
    board->ResetTo(resume.step);
    return Status::OK();
  }
  // Durable: the initial state is the first commit (a crash in step 1 resumes at step 0).
  return durable->Commit(0, 0);
}

Status Engine::Impl::InitFrozen(size_t gi, const ParamStore::Resume& resume,
                                const std::vector<uint64_t>& committed) {
  // Data, not state: each value comes from its init (also at a resume: the store never
  // rewrites them), is hashed, and goes to its parameter store in the storage dtype.
  std::vector<float> full;
  for (ParamId id : layout.group(gi).params) {
    const ParamLayout& p = layout.param(id);
    if (resume.active && id < committed.size() && committed[id] != 0 &&
        param_store->HoldsCommitted(id, resume)) {
      // The store holds the committed copy (NVMe parameters): the run goes on with it, as
      // with every other committed value (a trainer that loads the base after registering,
      // as from safetensors, registers other values than the ones committed).
      param_store->set_value_hash(id, committed[id]);
      ZINF_RETURN_IF_ERROR(param_store->Init(id, PinnedBuffer(), resume));
      continue;
    }
    full.assign(p.padded_numel, 0.0f);
    inits[id](full.data(), p.info.numel);
    const uint64_t hash = ValueHash(full.data(), p.info.numel);
    if (resume.active && id < committed.size() && committed[id] != 0 && committed[id] != hash) {
      return Status::FailedPrecondition(
          "ResumeFromStore: the frozen parameter '" + p.info.name +
          "' is registered with other values than the run that wrote the store had (value "
          "hash " +
          HashHex(hash) + ", the store's " + HashHex(committed[id]) +
          "); register it with the same values (the same base weights) to resume");
    }
    param_store->set_value_hash(id, hash);
    if (world > 1 && !resume.active) {
      initial_hashes.resize(layout.num_params(), 0);
      initial_hashes[id] = hash;
    }
    ZINF_ASSIGN_OR_RETURN(PinnedBuffer image, arena->Allocate(layout.PartBytes(id)));
    ZINF_RETURN_IF_ERROR(EncodeFrozen(
        id, full.data() + static_cast<size_t>(rank) * p.info.partition_numel, image.data()));
    ZINF_RETURN_IF_ERROR(param_store->Init(id, std::move(image), resume));
    if (world == 1 && config.offload_param.tier == Tier::kDevice) fetch->Alias(id);
  }
  return Status::OK();
}

uint64_t Engine::Impl::ValueHash(const float* full, size_t n) const {
  if (!config.bf16) return XXH3_64bits(full, n * sizeof(float));
  // bf16 storage: the values as stored, so that values exported from the store (rounded
  // already) and registered again hash the same.
  XXH3_state_t* state = XXH3_createState();
  if (state == nullptr || XXH3_64bits_reset(state) != XXH_OK) {
    XXH3_freeState(state);
    return 0;  // (no frozen hash: nothing is compared)
  }
  float chunk[1024];
  for (size_t at = 0; at < n; at += 1024) {
    const size_t len = std::min<size_t>(1024, n - at);
    for (size_t i = 0; i < len; ++i) chunk[i] = Bf16ToFp32(Fp32ToBf16(full[at + i]));
    XXH3_64bits_update(state, chunk, len * sizeof(float));
  }
  const uint64_t h = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return h;
}

Status Engine::Impl::EncodeFrozen(ParamId id, const float* part, void* out) {
  const ParamLayout& p = layout.param(id);
  if (layout.StoredInt8(id)) {
    return QuantizeWeightsInt8(part, p.info.partition_numel, out)
        .WithContext("storing the frozen parameter '" + p.info.name + "' as int8");
  }
  if (config.bf16) {
    return optimizer->ConvertParams(part, out, ParamCopyType::kBf16, p.info.partition_numel);
  }
  std::memcpy(out, part, layout.PartBytes(id));
  return Status::OK();
}

Status Engine::SetCommitUserData(const std::string& user_data) {
  Impl& m = *impl_;
  if (!IsValidUtf8(user_data)) {
    return Status::InvalidArgument(
        "SetCommitUserData: the text is not valid UTF-8 (it goes into the store's JSON index); "
        "encode it, e.g. as base64");
  }
  if (m.registered) {
    return Status::FailedPrecondition(
        "SetCommitUserData must come before the first Acquire, Step or FinishRegistration (the "
        "initial commit records it)");
  }
  m.commit_user_data = user_data;  // the commits' component exists from placement on
  return Status::OK();
}

Status Engine::ResumeFromStore(StoreResume* resumed) {
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
  m.reopened_store = false;
  Status s = FinishRegistration();
  m.resume_store = false;
  if (!s.ok()) {
    m.broken = Status::FailedPrecondition("ResumeFromStore failed (" + s.message() +
                                          "); recreate the engine");
    return s;
  }
  if (resumed != nullptr) {
    resumed->reopened = m.reopened_store;
    resumed->step = m.clock.step();
    resumed->user_data = m.resumed_user_data;
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
  ZINF_RETURN_IF_ERROR(m.CheckInitialValues());
  const bool training = mode == AcquireMode::kTraining;
  for (ParamId id : ids) {
    if (id >= m.layout.num_params()) {
      return Status::InvalidArgument("Acquire: unknown parameter id " + std::to_string(id));
    }
    if (m.fetch->AcquiredStale(id, m.clock.visible())) {
      return Status::FailedPrecondition(
          "Acquire('" + m.layout.param(id).info.name +
          "'): it is still acquired from before the optimizer step "
          "that changed it (its memory holds the old values); release it first");
    }
  }
  if (!training && m.clock.boundary() && m.grads->reduced_this_micro()) {
    // The optimizer may be rewriting the parameter stores of sub-groups whose gradients are
    // complete: an inference fetch now could read a half-written buffer.
    return Status::FailedPrecondition(
        "an inference Acquire between ReduceGradient and Step at an accumulation boundary: the "
        "optimizer may be rewriting the parameters; evaluate between optimizer steps");
  }
  if (training) m.KickTask();
  return m.fetch->Acquire(ids, m.clock.visible(), training, m.Rewriting());
}

Status Engine::Release(const std::vector<ParamId>& ids) {
  Impl& m = *impl_;
  if (!m.registered) {
    return Status::FailedPrecondition("Release before any Acquire");
  }
  return m.fetch->Release(ids, m.clock.visible(), m.Rewriting());
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
  const int64_t ready = m.clock.boundary() ? m.clock.step() + 1 : 0;
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
  ZINF_RETURN_IF_ERROR(m.CheckInitialValues());
  m.KickTask();
  const bool boundary = m.clock.boundary();
  // Gradients of this micro-step must have landed before the next one starts: the streams'
  // part, then the sums of the adder thread.
  Status s = m.budget->ReclaimScratch();
  if (!s.ok()) {
    return m.Break("the engine stopped after an error in a previous step", s,
                   "; recreate it (from a checkpoint) to continue");
  }
  m.grads->Drain();
  StepStats st;
  const auto wait0 = Clock::now();
  // A boundary Step that fails part-way has landed some gradients and left the optimizer
  // waiting for the rest: it cannot be retried.
  auto fail_boundary = [&m](const Status& err) {
    return m.Break("the engine stopped: a Step at an accumulation boundary failed", err,
                   "; recreate it (from a checkpoint) to continue");
  };
  if (boundary) {
    const int64_t next = m.clock.step() + 1;
    // Parameters that got no gradient in the whole window: the optimizer skips them (their
    // has_grad flag is unset); their host accumulators are zeroed so that the clipping norm
    // reads zeros, not the last window's values (device accumulators are not read for them).
    // The optimizer thread has this task since the micro-step began and may have stepped the
    // sub-groups whose gradients are complete. Parameters not reduced in this last micro-step
    // have final accumulators already: count them as landed.
    // (Streaming accumulators: a sub-group none of whose parameters has a gradient holds no
    // block, and nothing reads its accumulators, so there is nothing to zero.)
    s = m.grads->CompleteWindow(next);
    if (!s.ok()) return fail_boundary(s);
    if (m.config.gradient_clipping > 0) {
      // Wait-for-norm: every sub-group waits for the global norm, computed once all gradients
      // have landed (they have: the streams were synchronized above).
      Result<float> coef =
          m.grads->ClipCoefficient(next, m.optimizer.get(), m.collectives.get(), &st.grad_norm);
      if (!coef.ok()) {
        // Sub-groups the optimizer stepped speculatively are rolled back before its task ends;
        // the verdict also frees it from waiting for one.
        m.board->SetNormFailed(next);
        (void)m.board->WaitDone(next);  // its result is the rollback's; the norm's is reported
        return fail_boundary(coef.status());
      }
      m.board->SetClipCoef(next, *coef);
    }
    // Without the delayed update, this window's optimizer step must be done: the next
    // micro-step reads its parameters. With it, the next micro-step reads the previous step's
    // (version next - 1), and this one runs on while the trainer goes on.
    Status opt = m.board->WaitDone(m.clock.DelayedStep(next) ? next - 1 : next);
    if (!opt.ok()) {
      return m.Break("the optimizer failed", opt,
                     "; parameters may be partly updated: recreate the engine from a checkpoint");
    }
    m.clock.AdvanceStep();
    m.grads->EndWindow();
    st.optimizer_ran = true;
    // Durable: the step's writes are complete (the optimizer waited for them): publish them.
    // A delayed step is committed by the optimizer thread once its update is written.
    s = m.clock.DelayedStep(m.clock.step()) ? Status::OK()
                                            : m.durable->Commit(m.clock.step(), m.clock.visible());
    if (!s.ok()) {
      return m.Break(
          "the durable swap store could not commit step " + std::to_string(m.clock.step()), s,
          "; resume from its last commit");
    }
  }
  const double opt_wait = Since(wait0);
  m.clock.EndMicroStep();
  m.BeginMicroStep();
  m.trace.EndMicroStep();
  // The updated parameters are in their stores: start fetching the next micro-step's first
  // ones now, while the trainer prepares its next batch.
  m.fetch->Prefetch(m.clock.visible(), m.Rewriting());

  st.step = m.clock.step();
  st.trace_valid = m.trace.valid();
  m.stats.FinishStep({opt_wait, m.budget->TakePeak(), m.arena ? m.arena->peak_used() : 0,
                      m.swap.get(), m.optimizer->cpu_seconds()},
                     &st);
  return st;
}

}  // namespace zinf
