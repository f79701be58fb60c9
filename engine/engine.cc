// The engine's façade: Engine::Create and its feasibility checks, then each call forwarded to
// Engine::Impl (engine_impl.h), whose registration, placement and sequencing of micro-steps
// and optimizer steps over the components that do the work are here (engine/core/*.h;
// docs/layout.md names each and what it owns).
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
  if (core_) {
    // Delayed update: the last step's optimizer may still run; between micro-steps it needs
    // nothing more from the trainer, so let it finish and report a failure nobody saw.
    const bool drain = clock_.delayed() && registered_ && !clock_.in_micro() && broken_.ok();
    Status unseen = core_->board->Stop(drain ? clock_.step() : -1);
    if (!unseen.ok()) {
      LogWarning("the last optimizer step failed and was not reported: " + unseen.ToString());
    }
  }
  if (pipeline_) pipeline_->Join();
  // The compute stream too: buffers whose free waits for it (evicted parameters) go back with
  // the budget below.
  for (Stream* s :
       {device_->ComputeStream(), streams_.copy, streams_.comm, streams_.update, streams_.grad}) {
    if (s == nullptr) continue;
    Status synced = device_->SynchronizeStream(s);
    if (!synced.ok()) LogWarning("closing the engine: " + synced.ToString());
  }
  // offload_states' host copies (the streams are done with them).
  if (offloaded_) ReleaseHostCopy(offloaded_.get());
  if (reloading_) ReleaseHostCopy(reloading_.get());
  if (spare_) ReleaseHostCopy(spare_.get());
  // Device memory and pinned buffers go back before the arena and the budget they came from.
  pipeline_.reset();
  checkpointer_.reset();
  durable_.reset();
  core_.reset();  // after the layers above, which use it
  swap_.reset();
  CloseOffloadStore();
  collectives_.reset();
  if (arena_ && arena_device_registered_) {
    Status s = device_->UnregisterHostMemory(arena_->region().base);
    if (!s.ok()) LogWarning("closing the engine: " + s.ToString());
  }
}

// ---- Creation and registration ---------------------------------------------------------------

Result<std::unique_ptr<Engine>> Engine::Create(const EngineConfig& config, Device* device,
                                               Communicator* comm, const EngineHooks& hooks) {
  if (device == nullptr || comm == nullptr) {
    return Status::InvalidArgument("Engine::Create: device and communicator are required");
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
  // (Here, after the programs' flags: --zero-stage and --quantized-weights apply after a parse.)
  if (config.zero_stage < 3) {
    std::string keys;
    for (const auto& [on, key] :
         {std::pair{config.quantized_weights, "zero_quantized_weights"},
          {config.quantized_nontrainable_weights, "zero_quantized_nontrainable_weights"},
          {config.quantized_gradients, "zero_quantized_gradients"},
          {config.hpz_partition_size > 1, "zero_hpz_partition_size"}}) {
      if (on) keys += std::string(keys.empty() ? "zero_optimization." : ", ") + key;
    }
    if (!keys.empty()) {
      LogWarning(keys + ": ignored below stage 3, as in DeepSpeed (stage " +
                 std::to_string(config.zero_stage) + " runs plain gathers and reductions)");
    }
  }
  if (config.quantized_gradient_bits != 8 && !config.quantized_gradients) {
    LogWarning("zinf.quantized_gradient_bits " + std::to_string(config.quantized_gradient_bits) +
               ": no effect without zero_optimization.zero_quantized_gradients");
  }
  if (config.quantization_block_size != kInt8StateBlock && !config.quantized_weights &&
      !config.quantized_nontrainable_weights && !config.quantized_gradients) {
    LogWarning("zinf.quantization_block_size " + std::to_string(config.quantization_block_size) +
               ": no effect without zero_optimization.zero_quantized_weights, "
               "zero_quantized_nontrainable_weights or zero_quantized_gradients");
  }
  auto impl = std::make_unique<Impl>(config, device, comm, hooks);
  ZINF_RETURN_IF_ERROR(impl->Open());
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Status Engine::Impl::Open() {
  CpuOptimizer::Options oo;
  oo.num_threads = config_.optimizer_threads;
  ZINF_ASSIGN_OR_RETURN(optimizer_, CpuOptimizer::Create(oo));
  ZINF_ASSIGN_OR_RETURN(streams_.copy, device_->CreateStream("zinf-copy"));
  ZINF_ASSIGN_OR_RETURN(streams_.comm, device_->CreateStream("zinf-comm"));
  ZINF_ASSIGN_OR_RETURN(streams_.update, device_->CreateStream("zinf-update"));
  ZINF_ASSIGN_OR_RETURN(streams_.grad, device_->CreateStream("zinf-grad"));
  budget_ = std::make_unique<DeviceBudget>(
      device_, config_.device_budget_bytes,
      std::vector<Stream*>{streams_.comm, streams_.copy, streams_.grad});
  ZINF_ASSIGN_OR_RETURN(collectives_,
                        HostCollectives::Create(device_, comm_, budget_.get(), streams_.comm));
  checkpointer_ = std::make_unique<Checkpointer>(&layout_, &config_, collectives_.get(), rank_,
                                                 world_, hooks_.checkpoint_validated);
  return Status::OK();
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

// Each call is Impl's of the same name (zinf/engine.h says what each does).

Result<ParamId> Engine::RegisterParameter(const ParamSpec& spec) {
  return impl_->RegisterParameter(spec);
}

Status Engine::FinishRegistration() { return impl_->FinishRegistration(); }

Status Engine::CompareAcrossRanks(const std::string& what, const std::string& text,
                                  const std::string& remedy) {
  return impl_->CompareAcrossRanks(what, text, remedy);
}

Status Engine::RequireAgreement(const std::string& name, const std::string& value) {
  return impl_->RequireAgreement(name, value);
}

Status Engine::SetCommitUserData(const std::string& user_data) {
  return impl_->SetCommitUserData(user_data);
}

Status Engine::ResumeFromStore(StoreResume* resumed) { return impl_->ResumeFromStore(resumed); }

Status Engine::SetAcquireOrder(const std::vector<ParamId>& order) {
  return impl_->SetAcquireOrder(order);
}

Result<std::vector<void*>> Engine::Acquire(const std::vector<ParamId>& ids, AcquireMode mode) {
  return impl_->Acquire(ids, mode);
}

Status Engine::Release(const std::vector<ParamId>& ids) { return impl_->Release(ids); }

Status Engine::ReduceGradient(ParamId id, const float* grad) {
  return impl_->ReduceGradient(id, grad, -1);
}

Status Engine::ReduceGradient(ParamId id, const float* grad, int micro_batch) {
  if (micro_batch < 0) {
    return Status::InvalidArgument("ReduceGradient: micro-batch " + std::to_string(micro_batch) +
                                   " is negative (0 is a window's first)");
  }
  return impl_->ReduceGradient(id, grad, micro_batch);
}

Result<StepStats> Engine::Step() { return impl_->Step(); }

Status Engine::PrepareCheckpointDir(const std::string& dir) {
  return impl_->PrepareCheckpointDir(dir);
}

Status Engine::RemoveCheckpoints(const std::string& dir) { return impl_->RemoveCheckpoints(dir); }

Status Engine::SaveCheckpoint(const std::string& dir, const std::string& user_data) {
  return impl_->SaveCheckpoint(dir, user_data);
}

Status Engine::LoadCheckpoint(const std::string& dir, std::string* user_data,
                              bool fall_back_to_older) {
  return impl_->LoadCheckpoint(dir, user_data, fall_back_to_older);
}

Status Engine::GatherMasterParameter(ParamId id, float* out) {
  return impl_->GatherMasterParameter(id, out);
}

Status Engine::SetParameterValues(const std::vector<ParamId>& ids,
                                  const std::function<Status(ParamId, float*)>& fill) {
  return impl_->SetParameterValues(ids, fill);
}

int64_t Engine::param_updates(ParamId id) const { return impl_->param_updates(id); }

Status Engine::SetLearningRate(float lr) { return impl_->SetLearningRate(lr); }

Status Engine::SetParamGroup(size_t group, const ParamGroupHyper& hp) {
  return impl_->SetParamGroup(group, hp);
}

size_t Engine::num_param_groups() const { return impl_->num_param_groups(); }

ParamGroupHyper Engine::param_group(size_t group) const { return impl_->param_group(group); }

int64_t Engine::global_step() const { return impl_->global_step(); }
double Engine::loss_scale() const { return impl_->loss_scale(); }
Status Engine::OffloadStates(const OffloadStatesOptions& o) { return impl_->OffloadStates(o); }
Status Engine::ReloadStates(bool non_blocking) { return impl_->ReloadStates(non_blocking); }
bool Engine::states_offloaded() const { return impl_->states_offloaded(); }
Result<Engine::PinnedMemoryInfo> Engine::pinned_memory() const { return impl_->pinned_memory(); }
uint64_t Engine::skipped_steps() const { return impl_->skipped_steps(); }

int Engine::rank() const { return impl_->rank(); }

int Engine::world_size() const { return impl_->world_size(); }

size_t Engine::num_params() const { return impl_->num_params(); }

const ParamInfo& Engine::param(ParamId id) const { return impl_->param(id); }

const EngineConfig& Engine::config() const { return impl_->config(); }

Result<ParamId> Engine::Impl::RegisterParameter(const ParamSpec& spec) {
  // Stages 0 to 2 keep every parameter whole on the device: each one persists.
  ZINF_ASSIGN_OR_RETURN(ParamLayout p, layout_.Describe(spec.name, spec.shape, spec.trainable,
                                                        ReplicatesParameters(config_)
                                                            ? UINT64_MAX
                                                            : config_.param_persistence_threshold));
  if (!spec.init) {
    return Status::InvalidArgument("parameter '" + spec.name + "': needs a shape and an init");
  }
  // The largest layer must fit the device budget together with its gradient scratch (and a
  // quantized gather's int8 scratch).
  const uint64_t full = p.padded_numel * layout_.elem_size();
  const uint64_t need =
      full + GradientScratchBytes(p, config_) +
      QuantizedGatherScratch(p, config_, world_, config_.frozen_int8 && !spec.trainable,
                             layout_.elem_size());
  if (config_.device_budget_bytes != 0 && need > config_.device_budget_bytes) {
    return Status::ResourceExhausted(
               "parameter '" + spec.name + "' (" + FormatBytes(full) +
               " gathered, plus its gradient and gather scratch) does not fit the device "
               "budget of " +
               FormatBytes(config_.device_budget_bytes) +
               "; raise zinf.device_budget_bytes to at least " + FormatBytes(need))
        .WithKey("zinf.device_budget_bytes");
  }
  if (need > device_->MemoryInfo().budget) {
    return Status::ResourceExhausted("parameter '" + spec.name + "' needs " + FormatBytes(need) +
                                     " of device memory but the device budget is " +
                                     FormatBytes(device_->MemoryInfo().budget))
        .WithKey("zinf.device_budget_bytes");
  }
  if (spec.param_group >= groups_.size()) {
    return Status::InvalidArgument(
        "parameter '" + spec.name + "': parameter group " + std::to_string(spec.param_group) +
        " does not exist (" + std::to_string(groups_.size()) +
        " defined); define it with SetParamGroup before registering its parameters");
  }
  p.info.param_group = spec.param_group;
  inits_.push_back(spec.init);
  return layout_.Add(std::move(p));
}

Status Engine::Impl::FinishRegistration() {
  if (registered_) return Status::OK();
  if (layout_.frozen()) {
    return Status::FailedPrecondition("an earlier FinishRegistration failed; recreate the engine");
  }
  // The ranks agree on what they train before any other collective: a rank with another
  // model or setting is refused on every rank, naming the difference (never a collective of
  // another size, which gloo aborts on, or a wait for the collective timeout).
  std::vector<std::pair<std::string, std::string>> settings = agreement_;
  settings.emplace_back("resume from the durable store", resume_store_ ? "yes" : "no");
  for (size_t g = 0; g < groups_.size(); ++g) {
    const ParamGroupHyper& h = groups_[g];
    std::ostringstream text;
    text.precision(9);
    text << "lr " << h.lr << ", betas " << h.beta1 << ", " << h.beta2 << ", eps " << h.eps
         << ", weight_decay " << h.weight_decay;
    settings.emplace_back("parameter group " + std::to_string(g), text.str());
  }
  ZINF_RETURN_IF_ERROR(AgreeAcrossRanks(
      collectives_.get(), world_, "the model and its training settings",
      DescribeForAgreement(config_, layout_, settings),
      "Start every rank with the same model, configuration and trainer settings."));
  if (layout_.num_params() == 0) return Status::FailedPrecondition("no parameters registered");
  Status placed = Place();
  // A rank that cannot place its stores fails the others too (no collective in Place
  // without a resume; a resume's agreement on the commit has its own).
  if (world_ > 1 && !resume_store_) placed = collectives_->Agree(placed, "placing the parameters");
  ZINF_RETURN_IF_ERROR(placed);
  initial_hashes_.clear();
  Status init = InitStores();
  // The initial values are in the stores (or init failed): the callbacks, and whatever they
  // hold (a spill file of the values, the trainer's buffers), are not needed any more.
  inits_.clear();
  if (world_ > 1) {
    // Every rank learns whether every rank initialised. Whether they hold the same values
    // (ranks that initialise differently train a mix of models) is compared at the first
    // call that uses them, after any load that replaces them.
    init = collectives_->Agree(init, "initialising the parameters");
    values_unchecked_ = init.ok() && !initial_hashes_.empty();
  }
  ZINF_RETURN_IF_ERROR(init);
  ZINF_RETURN_IF_ERROR(pipeline_->Start());
  registered_ = true;
  BeginMicroStep();
  // The statistics of the first step start here (its swap traffic after the initialisation).
  StepStats unused;
  stats_.FinishStep({0, 0, 0, swap_.get(), optimizer_->cpu_seconds()}, &unused);
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
  if (!values_unchecked_) return Status::OK();
  values_unchecked_ = false;
  Status s = AgreeAcrossRanks(collectives_.get(), world_, "the initial parameter values",
                              DescribeValues(layout_, initial_hashes_),
                              "Every rank must initialise the model identically (seed every "
                              "rank's random generator the same), or load the same weights "
                              "on every rank before training.");
  if (!s.ok()) broken_ = s;  // the ranks hold a mix of models
  return s;
}

Status Engine::Impl::CompareAcrossRanks(const std::string& what, const std::string& text,
                                        const std::string& remedy) {
  return AgreeAcrossRanks(collectives_.get(), world_, what, text, remedy);
}

Status Engine::Impl::RequireAgreement(const std::string& name, const std::string& value) {
  if (registered_ || layout_.frozen()) {
    return Status::FailedPrecondition("RequireAgreement('" + name +
                                      "') after registration ended: call it before "
                                      "FinishRegistration");
  }
  if (name.empty() || name.find_first_of("\n:") != std::string::npos ||
      value.find('\n') != std::string::npos) {
    return Status::InvalidArgument("RequireAgreement: the name '" + name +
                                   "' must be a non-empty line without ':', the value one line");
  }
  agreement_.emplace_back(name, value);
  return Status::OK();
}

Status Engine::Impl::CheckReplicasFit() const {
  // What stages 0 to 2 hold in device memory at once: every parameter whole (on one rank with
  // device-tier parameters, the partitions are the whole parameters), the device-tier
  // partitions, the optimizer states and gradient accumulators of the sub-groups the device
  // steps, the local gradient sums (stages 0 and 1 with accumulation) and the largest
  // gradient's scratch.
  const bool device_params = config_.offload_param.tier == Tier::kDevice;
  uint64_t replicas = 0, stores = 0, sums = 0, scratch = 0;
  for (ParamId id = 0; id < layout_.num_params(); ++id) {
    const ParamLayout& p = layout_.param(id);
    if (!(device_params && world_ == 1)) replicas += layout_.FullBytes(id);
    if (device_params) stores += layout_.PartBytes(id);
    if (p.info.trainable && SumsGradientsLocally(config_)) sums += p.info.numel * sizeof(float);
    scratch = std::max<uint64_t>(scratch, GradientScratchBytes(p, config_));
  }
  for (size_t gi = 0; gi < layout_.num_groups(); ++gi) {
    if (!layout_.group(gi).on_device) continue;
    stores += layout_.GroupStateBytes(gi) + (device_params ? layout_.GroupGradBytes(gi) : 0);
  }
  const uint64_t need = replicas + stores + sums + scratch;
  const uint64_t device = device_->MemoryInfo().budget;
  const uint64_t budget = config_.device_budget_bytes != 0
                              ? std::min<uint64_t>(config_.device_budget_bytes, device)
                              : device;
  if (need <= budget) return Status::OK();
  const std::string stage = std::to_string(config_.zero_stage);
  return Status::ResourceExhausted(
             "zero_optimization.stage " + stage + " keeps every parameter whole in each rank's " +
             "device memory: " + FormatBytes(replicas) + " of whole parameters" +
             (sums != 0 ? ", " + FormatBytes(sums) + " of gradients summed over the micro-steps"
                        : std::string()) +
             ", " + FormatBytes(stores) + " of device-tier partitions and optimizer states and " +
             FormatBytes(scratch) + " for the largest gradient need " + FormatBytes(need) +
             ", and the device budget is " + FormatBytes(budget) +
             "; use \"stage\": 3 (each parameter gathered only while it is used)" +
             (config_.device_budget_bytes != 0 ? " or raise zinf.device_budget_bytes"
                                               : std::string()))
      .WithKey("zero_optimization.stage");
}

Status Engine::Impl::Place() {
  const size_t offloaded = layout_.Freeze(config_.sub_group_size, config_.offload_optimizer.tier,
                                          config_.offload_optimizer.ratio);
  const size_t stepped = layout_.GroupOrder().size();  // (the frozen sub-group is not stepped)
  if (ReplicatesParameters(config_)) {
    // Every rank learns whether every rank's device holds the whole parameters (the device
    // budgets may differ: a GPU's free memory).
    Status fits = CheckReplicasFit();
    if (world_ > 1) fits = collectives_->Agree(fits, "fitting the whole parameters");
    ZINF_RETURN_IF_ERROR(fits);
  }
  if (config_.offload_optimizer.tier != Tier::kDevice && config_.offload_optimizer.ratio < 1 &&
      rank_ == 0) {
    // The split is by whole sub-groups: say what the ratio became.
    char ratio[32];
    std::snprintf(ratio, sizeof(ratio), "%g", config_.offload_optimizer.ratio);
    LogInfo("offload_optimizer.ratio " + std::string(ratio) + ": " + std::to_string(offloaded) +
            " of " + std::to_string(stepped) + " optimizer sub-groups offloaded, " +
            std::to_string(stepped - offloaded) +
            " kept and stepped on the device (lower sub_group_size for a finer split)");
  }
  Result<PinnedPlan> planned = PlanPinnedMemory(layout_, config_, device_->IsHost());
  // Every rank learns whether every rank's plan fits (the pinned budgets may differ), before
  // the collectives below.
  if (world_ > 1) {
    ZINF_RETURN_IF_ERROR(collectives_->Agree(planned.status(), "planning the pinned memory"));
  }
  ZINF_ASSIGN_OR_RETURN(PinnedPlan plan, std::move(planned));
  if (HpzActive(config_, world_)) {
    // Every rank is here (the settings agreed): nodes of K consecutive ranks.
    const int k = static_cast<int>(config_.hpz_partition_size);
    Result<std::unique_ptr<Communicator>> node = comm_->Split(rank_ / k, streams_.comm);
    if (!node.ok()) {
      return node.status().WithContext("zero_hpz_partition_size " + std::to_string(k) +
                                       ": making this rank's node group");
    }
    node_comm_ = std::move(node).value();
    if (config_.quantized_gradients) {
      Result<std::unique_ptr<Communicator>> cross = comm_->Split(rank_ % k, streams_.comm);
      if (!cross.ok()) {
        return cross.status().WithContext("zero_quantized_gradients with zero_hpz_partition_size " +
                                          std::to_string(k) + ": making the group across nodes");
      }
      cross_comm_ = std::move(cross).value();
    }
  }
  ZINF_RETURN_IF_ERROR(AllocatePinned(plan));
  // The swap store first: every component gets it at construction.
  if (config_.offload_param.tier == Tier::kNvme || config_.offload_optimizer.tier == Tier::kNvme) {
    ZINF_RETURN_IF_ERROR(OpenSwapStore());
  }
  return BuildComponents(plan);
}

Status Engine::Impl::AllocatePinned(const PinnedPlan& plan) {
  PinnedArenaOptions ao;
  ao.bytes = config_.pinned_budget_bytes;
  ao.lock_memory = config_.offload_param.pin_memory || config_.offload_optimizer.pin_memory;
  ZINF_ASSIGN_OR_RETURN(arena_, PinnedArena::Create(ao));
  ZINF_RETURN_IF_ERROR(device_->RegisterHostMemory(arena_->region().base, arena_->capacity()));
  arena_device_registered_ = true;
  // The fixed-size buffers first, as pools (see BlockPool); the rest of the arena is staging.
  if (plan.state_blocks > 0) {
    ZINF_RETURN_IF_ERROR(state_pool_.Init(arena_.get(), plan.state_block_bytes, plan.state_blocks,
                                          "optimizer buffers"));
  }
  if (plan.copy_blocks > 0) {
    ZINF_RETURN_IF_ERROR(copy_pool_.Init(arena_.get(), plan.copy_block_bytes, plan.copy_blocks,
                                         "parameter copy buffers"));
  }
  if (plan.snapshot_blocks > 0) {
    ZINF_RETURN_IF_ERROR(snapshot_pool_.Init(arena_.get(), plan.snapshot_block_bytes,
                                             plan.snapshot_blocks, "speculative-step snapshots"));
  }
  if (plan.speculation_wanted && rank_ == 0) {
    const size_t stepped = layout_.GroupOrder().size();
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
    ZINF_RETURN_IF_ERROR(grad_pool_.Init(arena_.get(), plan.grad_block_bytes, plan.grad_blocks,
                                         "gradient accumulators"));
  }
  return Status::OK();
}

Status Engine::Impl::OpenSwapStore() {
  ZINF_ASSIGN_OR_RETURN(SwapStoreOptions so,
                        SwapStoreOptionsFor(config_, rank_, world_, *arena_, hooks_.fault_plan));
  so.reopen = resume_store_;
  // A fresh store never replaces another one (the store refuses, AlreadyExists) unless
  // zinf.durable_overwrite says to.
  so.overwrite = config_.durable_overwrite;
  if (resume_store_) {
    const CommitRecord record(&layout_, &config_, world_);
    Result<CommitRecord::Agreement> agreed =
        record.AgreeOnCommit(collectives_.get(), rank_, so.paths);
    if (!agreed.ok()) return WithWorldHint(agreed.status(), config_, world_);
    const CommitRecord::Agreement a = *agreed;
    so.reopen_previous = a.previous;
    if (a.fresh) {  // nothing was ever committed: a fresh start replaces nothing of value
      resume_store_ = false;
      so.reopen = false;
    }
  }
  Result<std::unique_ptr<SwapStore>> opened = SwapStore::Open(so);
  if (!opened.ok() && resume_store_) {
    return WithWorldHint(
        opened.status().WithContext("ResumeFromStore: reopening the swap store in " + so.paths[0]),
        config_, world_);
  }
  if (!opened.ok() && opened.status().code() == StatusCode::kAlreadyExists) {
    return CommitRecord::ExplainExisting(so.paths);
  }
  ZINF_ASSIGN_OR_RETURN(swap_, std::move(opened));
  arena_io_registered_ = true;
  return Status::OK();
}

Status Engine::Impl::BuildComponents(const PinnedPlan& plan) {
  // The components over the frozen layout, once, in dependency order: the core's, then the
  // persistence and the optimizer pipeline over them.
  EngineContext ctx;
  ctx.layout = &layout_;
  ctx.config = &config_;
  ctx.device = device_;
  ctx.comm = comm_;
  ctx.node_comm = node_comm_.get();
  ctx.cross_comm = cross_comm_.get();
  ctx.streams = streams_;
  ctx.budget = budget_.get();
  ctx.stats = &stats_;
  ctx.arena = arena_.get();
  ctx.swap = swap_.get();
  CoreParts::Shared shared;
  shared.optimizer = optimizer_.get();
  shared.trace = &trace_;
  shared.state_pool = &state_pool_;
  shared.grad_pool = &grad_pool_;
  shared.stream_grads = plan.stream_grads;
  ZINF_ASSIGN_OR_RETURN(core_, CoreParts::Build(ctx, shared));
  ctx = core_->ctx();
  durable_ = std::make_unique<DurableCommits>(ctx, core_->states.get(), core_->params.get());
  durable_->set_user_data(commit_user_data_);
  OptimizerPipeline::Parts parts;
  parts.states = core_->states.get();
  parts.params = core_->params.get();
  parts.grads = core_->grads.get();
  parts.durable = durable_.get();
  parts.optimizer = optimizer_.get();
  parts.state_pool = &state_pool_;
  parts.copy_pool = &copy_pool_;
  parts.snapshot_pool = &snapshot_pool_;
  pipeline_ = std::make_unique<OptimizerPipeline>(ctx, parts);
  return Status::OK();
}

Status Engine::Impl::InitStores() {
  // Resuming a durable store: the states come from it, and so do NVMe parameter stores
  // written in the same dtype; everything else is rebuilt from the masters.
  ParamStore::Resume resume;
  CommitRecord::Point point;
  if (resume_store_) {
    ZINF_RETURN_IF_ERROR(durable_->record().Check(swap_->committed_meta(), &point));
    durable_->set_lineage(point.lineage);
    resumed_user_data_ = point.user_data;
    if (scaler_ != nullptr && point.loss_scale.has_value()) {
      ZINF_RETURN_IF_ERROR(scaler_->Restore(ScalerStateOf(*point.loss_scale))
                               .WithContext("ResumeFromStore: the committed loss scale"));
    }
    // (A commit before the next Step's, e.g. FinishPendingUpdate's, records it too.)
    if (scaler_ != nullptr) durable_->RecordLossScale(point.step, *LossScaleRecord());
    reopened_store_ = true;
    for (ParamId id = 0; id < layout_.num_params(); ++id) {
      core_->states->set_updates(id, layout_.param(id).info.trainable ? point.updates[id] : 0);
    }
    resume.active = true;
    resume.stored_params = point.param_keys;
    resume.step = point.step;
    resume.visible = point.visible;
    if (config_.offload_param.tier != Tier::kNvme) {
      // Parameter stores of an earlier run with NVMe parameters: stale from now on (this run
      // keeps its parameters elsewhere); drop them so no later resume can trust them.
      for (const std::string& key : swap_->Keys()) {
        if (key.rfind("param/", 0) == 0) ZINF_RETURN_IF_ERROR(swap_->Remove(key));
      }
    }
  }
  // Optimizer states per sub-group, parameters per store.
  std::vector<float> full;
  for (size_t gi = 0; gi < layout_.num_groups(); ++gi) {
    if (layout_.group(gi).frozen) {
      ZINF_RETURN_IF_ERROR(
          core_->frozen->InitGroup(gi, resume, point.frozen_hashes, inits_, &initial_hashes_));
      // (A parameter whose store kept its committed copy is never aliased: that needs NVMe
      // parameters, an alias the device tier.)
      for (ParamId id : layout_.group(gi).params) {
        if (world_ == 1 && config_.offload_param.tier == Tier::kDevice) core_->fetch->Alias(id);
      }
      continue;
    }
    float* master = nullptr;
    PooledBlock staging;
    ZINF_RETURN_IF_ERROR(core_->states->Allocate(gi, &master, &staging));
    if (resume.active) {  // durable mode: states on NVMe (checked at Create)
      ZINF_RETURN_IF_ERROR(core_->states->ReadCommitted(gi, master, staging.capacity()));
    } else {
      std::memset(master, 0, layout_.GroupStateBytes(gi));  // exp_avg and exp_avg_sq start at zero
    }
    for (ParamId id : layout_.group(gi).params) {
      const ParamLayout& p = layout_.param(id);
      const float* part = master + p.slice_offset;
      if (!resume.active) {
        full.assign(p.padded_numel, 0.0f);
        inits_[id](full.data(), p.info.numel);
        if (world_ > 1) {
          initial_hashes_.resize(layout_.num_params(), 0);
          initial_hashes_[id] = XXH3_64bits(full.data(), p.info.numel * sizeof(float));
        }
        std::memcpy(master + p.slice_offset,
                    full.data() + static_cast<size_t>(rank_) * p.info.partition_numel,
                    p.info.partition_numel * sizeof(float));
      }
      // The parameter store, in storage dtype.
      PinnedBuffer image;
      ZINF_ASSIGN_OR_RETURN(image, arena_->Allocate(layout_.PartBytes(id)));
      if (StoredParamType(config_) != ParamCopyType::kNone) {
        ZINF_RETURN_IF_ERROR(optimizer_->ConvertParams(part, image.data(), StoredParamType(config_),
                                                       p.info.partition_numel));
      } else {
        std::memcpy(image.data(), part, layout_.PartBytes(id));
      }
      ZINF_RETURN_IF_ERROR(core_->params->Init(id, std::move(image), resume));
      if (world_ == 1 && config_.offload_param.tier == Tier::kDevice) core_->fetch->Alias(id);
    }
    if (!resume.active)
      ZINF_RETURN_IF_ERROR(core_->states->Publish(gi, master, staging.capacity()));
    ZINF_RETURN_IF_ERROR(core_->grads->AllocateGroup(gi));
  }
  if (resume.active) {
    clock_.Reset(resume.step, resume.visible);
    core_->board->ResetTo(resume.step);
    return Status::OK();
  }
  // Durable: the initial state is the first commit (a crash in step 1 resumes at step 0).
  return durable_->Commit(0, 0);
}

Status Engine::Impl::SetCommitUserData(const std::string& user_data) {
  if (!IsValidUtf8(user_data)) {
    return Status::InvalidArgument(
        "SetCommitUserData: the text is not valid UTF-8 (it goes into the store's JSON index); "
        "encode it, e.g. as base64");
  }
  if (registered_) {
    return Status::FailedPrecondition(
        "SetCommitUserData must come before the first Acquire, Step or FinishRegistration (the "
        "initial commit records it)");
  }
  commit_user_data_ = user_data;  // the commits' component exists from placement on
  return Status::OK();
}

Status Engine::Impl::ResumeFromStore(StoreResume* resumed) {
  if (!config_.durable) {
    return Status::FailedPrecondition(
        "ResumeFromStore needs zinf.durable (a store that commits every step)");
  }
  if (registered_) {
    return Status::FailedPrecondition(
        "ResumeFromStore must come after registering the parameters and before the first "
        "Acquire, Step or FinishRegistration");
  }
  resume_store_ = true;
  reopened_store_ = false;
  Status s = FinishRegistration();
  resume_store_ = false;
  if (!s.ok()) {
    broken_ = Status::FailedPrecondition("ResumeFromStore failed (" + s.message() +
                                         "); recreate the engine");
    return s;
  }
  if (resumed != nullptr) {
    resumed->reopened = reopened_store_;
    resumed->step = clock_.step();
    resumed->user_data = resumed_user_data_;
  }
  return s;
}

Status Engine::Impl::SetAcquireOrder(const std::vector<ParamId>& order) {
  for (ParamId id : order) {
    if (id >= layout_.num_params()) {
      return Status::InvalidArgument("SetAcquireOrder: unknown parameter id " + std::to_string(id));
    }
  }
  trace_.SetOrder(order);
  return Status::OK();
}

// ---- Parameters --------------------------------------------------------------------------------

Result<std::vector<void*>> Engine::Impl::Acquire(const std::vector<ParamId>& ids,
                                                 AcquireMode mode) {
  if (!broken_.ok()) return broken_;
  if (!registered_) ZINF_RETURN_IF_ERROR(FinishRegistration());
  const bool training = mode == AcquireMode::kTraining;
  // offload_states: an inference Acquire (generation) needs the parameters only.
  ZINF_RETURN_IF_ERROR(ReloadForCollective(training ? kOffloadAll : kOffloadParams));
  ZINF_RETURN_IF_ERROR(CheckInitialValues());
  for (ParamId id : ids) {
    if (id >= layout_.num_params()) {
      return Status::InvalidArgument("Acquire: unknown parameter id " + std::to_string(id));
    }
    if (core_->fetch->AcquiredStale(id, clock_.visible())) {
      return Status::FailedPrecondition(
          "Acquire('" + layout_.param(id).info.name +
          "'): it is still acquired from before the optimizer step "
          "that changed it (its memory holds the old values); release it first");
    }
  }
  if (!training && clock_.boundary() && core_->grads->reduced_this_micro()) {
    // The optimizer may be rewriting the parameter stores of sub-groups whose gradients are
    // complete: an inference fetch now could read a half-written buffer.
    return Status::FailedPrecondition(
        "an inference Acquire between ReduceGradient and Step at an accumulation boundary: the "
        "optimizer may be rewriting the parameters; evaluate between optimizer steps");
  }
  if (training) KickTask();
  return core_->fetch->Acquire(ids, clock_.visible(), training, Rewriting());
}

Status Engine::Impl::Release(const std::vector<ParamId>& ids) {
  if (!registered_) {
    return Status::FailedPrecondition("Release before any Acquire");
  }
  return core_->fetch->Release(ids, clock_.visible(), Rewriting());
}

Status Engine::Impl::ReduceGradient(ParamId id, const float* grad, int micro_batch) {
  if (!broken_.ok()) return broken_;
  if (id >= layout_.num_params()) {
    return Status::InvalidArgument("ReduceGradient: unknown parameter id " + std::to_string(id));
  }
  if (!registered_) return Status::FailedPrecondition("ReduceGradient before any Acquire");
  ZINF_RETURN_IF_ERROR(ReloadForCollective());
  KickTask();
  const ParamLayout& p = layout_.param(id);
  if (!p.info.trainable) {
    return Status::FailedPrecondition("ReduceGradient('" + p.info.name +
                                      "'): the parameter is frozen (registered with trainable "
                                      "false); it takes no gradient");
  }
  Result<bool> last = CheckMicroBatch(id, micro_batch);
  if (!last.ok()) return last.status();
  LocalGradients* local = core_->local_grads.get();
  // The optimizer step this micro-step completes (0: none) when this is the parameter's last
  // gradient in it (a layer-major window's earlier micro-batches: summed in, not landing).
  const int64_t ready = clock_.boundary() && *last ? clock_.step() + 1 : 0;
  const int64_t lands = *last ? ready : GradientWindow::kNotLast;
  ZINF_RETURN_IF_ERROR(WaitStepped(p.info.sub_group));
  Status s;
  if (local != nullptr && (ready == 0 || local->holds(id))) {
    // Stages 0 and 1: summed on this rank until the window's last micro-batch, which reduces
    // the sum (Step reduces those that get no gradient in it).
    s = local->Add(id, grad);
    if (s.ok() && ready != 0) s = core_->grads->Reduce(id, local->sum(id), ready);
    if (s.ok() && ready != 0) local->Clear(id);
  } else {
    s = core_->grads->Reduce(id, grad, lands);
  }
  if (!s.ok()) {
    // Part of the gradient may be in its accumulator, and the optimizer may wait for it.
    return Break("the engine stopped: ReduceGradient('" + p.info.name + "') failed part-way", s,
                 "; recreate it (from a checkpoint) to continue");
  }
  return Status::OK();
}

Result<bool> Engine::Impl::CheckMicroBatch(ParamId id, int micro_batch) {
  const std::string& name = layout_.param(id).info.name;
  const int span = clock_.span();
  const int position = clock_.window_position();
  if (span == 1) {
    // The micro-batch schedule: this micro-step is the micro-batch.
    if (micro_batch >= 0 && micro_batch != position) {
      return Status::InvalidArgument(
          "ReduceGradient('" + name + "', micro-batch " + std::to_string(micro_batch) +
          "): this micro-step is micro-batch " + std::to_string(position) +
          " of its window (zinf.schedule micro-batch: one micro-batch per Step)");
    }
    LocalGradients* local = core_->local_grads.get();
    if (core_->grads->reduced(id) || (local != nullptr && local->added(id))) {
      return Status::FailedPrecondition("ReduceGradient('" + name + "') twice in one micro-step");
    }
    return true;
  }
  if (micro_batch < 0) {
    return Status::FailedPrecondition(
        "ReduceGradient('" + name + "'): with zinf.schedule layer-major and " +
        std::to_string(span) +
        " accumulation steps each gradient names its micro-batch: ReduceGradient(id, grad, j)");
  }
  if (micro_batch >= span) {
    return Status::InvalidArgument("ReduceGradient('" + name + "', micro-batch " +
                                   std::to_string(micro_batch) + "): a window has " +
                                   std::to_string(span) + " micro-batches (0 to " +
                                   std::to_string(span - 1) + ")");
  }
  int& next = next_micro_batch_[id];
  if (micro_batch < next) {
    return Status::FailedPrecondition(
        "ReduceGradient('" + name + "', micro-batch " + std::to_string(micro_batch) +
        "): its gradient of micro-batch " + std::to_string(next - 1) +
        " came already; with zinf.schedule layer-major each parameter's gradients come in "
        "increasing micro-batch order, once each");
  }
  next = micro_batch + 1;
  return micro_batch == span - 1;
}

// ---- Steps -----------------------------------------------------------------------------------

Status Engine::Impl::PostNormVerdict(int64_t next, StepStats* st) {
  // Wait-for-norm: every sub-group waits for the global norm, computed once all gradients
  // have landed (they have: the streams were synchronized). A failed norm: sub-groups the
  // optimizer stepped speculatively are rolled back before its task ends, and the verdict also
  // frees it from waiting for one.
  auto norm_failed = [this, next](const Status& s) {
    core_->board->SetNormFailed(next);
    (void)core_->board->WaitDone(next);  // its result is the rollback's; the norm's is reported
    return s;
  };
  Result<double> norm = core_->grads->GlobalNorm(optimizer_.get(), collectives_.get());
  if (!norm.ok()) return norm_failed(norm.status());
  const NormVerdict v =
      StepCoefficient(*norm, config_.gradient_clipping, scaler_ ? scaler_->scale() : 1.0);
  st->grad_norm = v.norm;
  if (!v.finite && scaler_ == nullptr) {
    // No sub-group has been stepped for good; nothing non-finite is written, and the step is
    // refused as a whole.
    return norm_failed(Status::FailedPrecondition(
        "the gradient norm of step " + std::to_string(next) +
        " is not finite (a gradient holds inf or NaN): no parameter was updated; lower the "
        "learning rate or look at the loss, then resume from the last checkpoint"));
  }
  if (scaler_ != nullptr) {
    // fp16: an overflow skips the step and lowers the scale; at the floor it fails (the state
    // is left as it was: the step is refused as without fp16).
    Status u = scaler_->Update(!v.finite);
    if (!u.ok()) return norm_failed(u.WithContext("step " + std::to_string(next)));
    durable_->RecordLossScale(next, *LossScaleRecord());
    if (!v.finite) {
      core_->board->SetSkipped(next);
      return Status::OK();
    }
  }
  core_->board->SetClipCoef(next, v.coef);
  return Status::OK();
}

Result<StepStats> Engine::Impl::Step() {
  if (!broken_.ok()) return broken_;
  if (!registered_) ZINF_RETURN_IF_ERROR(FinishRegistration());
  ZINF_RETURN_IF_ERROR(ReloadForCollective());
  ZINF_RETURN_IF_ERROR(CheckInitialValues());
  KickTask();
  const bool boundary = clock_.boundary();
  // Gradients of this micro-step must have landed before the next one starts: the streams'
  // part, then the sums of the adder thread.
  Status s = budget_->ReclaimScratch();
  if (!s.ok()) {
    return Break("the engine stopped after an error in a previous step", s,
                 "; recreate it (from a checkpoint) to continue");
  }
  core_->grads->Drain();
  StepStats st;
  const auto wait0 = Clock::now();
  // A boundary Step that fails part-way has landed some gradients and left the optimizer
  // waiting for the rest: it cannot be retried.
  auto fail_boundary = [this](const Status& err) {
    return Break("the engine stopped: a Step at an accumulation boundary failed", err,
                 "; recreate it (from a checkpoint) to continue");
  };
  if (boundary) {
    const int64_t next = clock_.step() + 1;
    // Parameters that got no gradient in the whole window: the optimizer skips them (their
    // has_grad flag is unset); their host accumulators are zeroed so that the clipping norm
    // reads zeros, not the last window's values (device accumulators are not read for them).
    // The optimizer thread has this task since the micro-step began and may have stepped the
    // sub-groups whose gradients are complete. Parameters not reduced in this last micro-step
    // have final accumulators already: count them as landed.
    // (Streaming accumulators: a sub-group none of whose parameters has a gradient holds no
    // block, and nothing reads its accumulators, so there is nothing to zero.)
    // Stages 0 and 1: the local sums of parameters that got no gradient in this last
    // micro-step are reduced now, in registration order on every rank.
    if (LocalGradients* local = core_->local_grads.get(); local != nullptr) {
      for (ParamId id = 0; id < layout_.num_params() && s.ok(); ++id) {
        if (!local->holds(id)) continue;
        s = core_->grads->Reduce(id, local->sum(id), next);
        if (s.ok()) local->Clear(id);
      }
      if (!s.ok()) return fail_boundary(s);
    }
    s = core_->grads->CompleteWindow(next);
    if (!s.ok()) return fail_boundary(s);
    if (NeedsNorm()) {
      s = PostNormVerdict(next, &st);
      if (!s.ok()) return fail_boundary(s);
    }
    // Without the delayed update, this window's optimizer step must be done: the next
    // micro-step reads its parameters. With it, the next micro-step reads the previous step's
    // (version next - 1), and this one runs on while the trainer goes on.
    Status opt = core_->board->WaitDone(clock_.DelayedStep(next) ? next - 1 : next);
    if (!opt.ok()) {
      return Break("the optimizer failed", opt,
                   "; parameters may be partly updated: recreate the engine from a checkpoint");
    }
    clock_.AdvanceStep();
    core_->grads->EndWindow();
    st.optimizer_ran = true;
    // Durable: the step's writes are complete (the optimizer waited for them): publish them.
    // A delayed step is committed by the optimizer thread once its update is written.
    s = clock_.DelayedStep(clock_.step()) ? Status::OK()
                                          : durable_->Commit(clock_.step(), clock_.visible());
    if (!s.ok()) {
      return Break("the durable swap store could not commit step " + std::to_string(clock_.step()),
                   s, "; resume from its last commit");
    }
  }
  const double opt_wait = Since(wait0);
  clock_.EndMicroStep();
  BeginMicroStep();
  trace_.EndMicroStep();
  // The updated parameters are in their stores: start fetching the next micro-step's first
  // ones now, while the trainer prepares its next batch. Stages 0 to 2 gather every one of
  // them once, now.
  if (ReplicatesParameters(config_) && st.optimizer_ran) {
    // The window's gradient scratch first (the streams are idle after the step): its room.
    s = budget_->ReclaimScratch();
    if (!s.ok()) {
      return Break("the engine stopped after an error in this step", s,
                   "; recreate it (from a checkpoint) to continue");
    }
    core_->fetch->Refresh(clock_.visible(), Rewriting());
  }
  core_->fetch->Prefetch(clock_.visible(), Rewriting());

  st.step = clock_.step();
  st.trace_valid = trace_.valid();
  stats_.FinishStep({opt_wait, budget_->TakePeak(), arena_ ? arena_->peak_used() : 0, swap_.get(),
                     optimizer_->cpu_seconds()},
                    &st);
  if (scaler_ != nullptr) {
    st.loss_scale = scaler_->scale();
    st.skipped_steps = scaler_->skipped_steps();
  }
  return st;
}

}  // namespace zinf
