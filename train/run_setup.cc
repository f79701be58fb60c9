// zinf-train's setup jobs: the plan, the device, the session, the resume (train/run.h).
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <filesystem>
#include <string>
#include <vector>

#include "train/checkpoint.h"
#include "train/run.h"
#include "zinf/log.h"

#ifndef ZINF_DEFAULT_DATA
#define ZINF_DEFAULT_DATA "train/data/corpus.txt"
#endif

namespace zinf::train {

FILE* out = stdout;

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The default data file: next to the working directory's checkout, or the source tree's.
std::string DefaultData() {
  if (std::filesystem::exists(ZINF_DEFAULT_DATA)) return ZINF_DEFAULT_DATA;
#ifdef ZINF_SOURCE_DATA
  return ZINF_SOURCE_DATA;
#else
  return ZINF_DEFAULT_DATA;
#endif
}

// The engine configuration: --config (DeepSpeed-style JSON) or the embedded defaults, then
// the placement flags on top.
Result<EngineConfig> BuildConfig(const Flags& f) {
  EngineConfig c;
  if (!f.config.empty()) {
    std::vector<std::string> warnings;
    Result<EngineConfig> loaded = LoadEngineConfig(f.config, &warnings);
    if (!loaded.ok()) return loaded.status().WithContext("--config");
    c = std::move(loaded).value();
    for (const std::string& w : warnings) LogWarning(w);
  } else {
    // Embedded defaults: bf16 parameters in pinned host memory, fp32 master weights and Adam
    // states on NVMe under ./zinf-swap.
    c.bf16 = true;
    c.offload_param.tier = Tier::kCpu;
    c.offload_optimizer.tier = Tier::kNvme;
    c.optimizer.type = OptimizerType::kAdamW;
    c.optimizer.lr = 1e-3f;
    c.optimizer.weight_decay = 0.0f;
    c.gradient_clipping = 0;
    c.sub_group_size = 4'000'000;
    c.pinned_budget_bytes = 1ull << 30;
  }
  if (f.fp32 && f.fp16) return Status::InvalidArgument("--fp32 and --fp16: pick one");
  if (f.fp32) {
    c.bf16 = false;
    c.fp16.enabled = false;
  }
  if (f.fp16) {
    // fp16 parameters with fp32 masters and dynamic loss scaling (the config's "fp16" block
    // settings when it has one, else DeepSpeed's defaults).
    c.bf16 = false;
    c.fp16.enabled = true;
  }
  ZINF_RETURN_IF_ERROR(ApplyEngineFlags(f.engine, &c));
  if (f.engine.nvme.empty()) {
    // The config's folders (both tiers'), or ./zinf-swap.
    std::vector<std::string> nvme;
    for (const OffloadConfig* o : {&c.offload_param, &c.offload_optimizer}) {
      for (const std::string& p : o->nvme_paths) {
        if (std::find(nvme.begin(), nvme.end(), p) == nvme.end()) nvme.push_back(p);
      }
    }
    if (nvme.empty()) nvme.push_back("zinf-swap");
    c.offload_param.nvme_paths = nvme;
    c.offload_optimizer.nvme_paths = nvme;
  }
  if (f.lr > 0) c.optimizer.lr = static_cast<float>(f.lr);
  if (f.grad_accum > 0) c.gradient_accumulation_steps = f.grad_accum;
  if (f.schedule == "layer-major" || f.schedule == "micro-batch") {
    c.layer_major = f.schedule == "layer-major";
  } else if (c.gradient_accumulation_steps > 1 && c.offload_param.tier != Tier::kDevice) {
    // auto: where parameters cross to the device, fetch them once per pass.
    c.layer_major = true;
  }
  if (f.delayed_update_after > 0) c.delayed_update_after = f.delayed_update_after;
  if (f.overwrite) c.durable_overwrite = true;
  if (f.durable) c.durable = true;
  if (!f.device_budget.empty()) {
    ZINF_ASSIGN_OR_RETURN(c.device_budget_bytes, ParseByteSize(f.device_budget, "--device-budget"));
  }
  if (!f.pinned_budget.empty()) {
    ZINF_ASSIGN_OR_RETURN(c.pinned_budget_bytes, ParseByteSize(f.pinned_budget, "--pinned-budget"));
  }
  return c;
}

// Names the zinf-train flag of the configuration key an engine error is about (Status::key:
// never read from the message).
Status Explain(const Status& s) {
  static const std::pair<const char*, const char*> kFlags[] = {
      {"zinf.device_budget_bytes", "--device-budget"},
      {"zinf.pinned_budget_bytes", "--pinned-budget"},
      {"nvme_path", "--nvme"},
      {"zinf.allowed_nvme_roots", "--nvme"}};
  for (const auto& [key, flag] : kFlags) {
    if (s.key() == key)
      return Status(s.code(), s.message() + " (zinf-train: " + flag + ")", s.sys_errno());
  }
  return s;
}

}  // namespace

// Bytes the optimizer keeps per parameter: the fp32 master and two states as stored (12 with
// fp32 states, 8 with bf16, about 6.03 with int8).
double StateBytesPerParam(const EngineConfig& c) {
  constexpr size_t kN = size_t{1} << 20;
  return 4.0 + 2.0 * static_cast<double>(StateBytes(c.optimizer_state_type, kN)) / kN;
}

bool UsesNvme(const EngineConfig& c) {
  return c.offload_param.tier == Tier::kNvme || c.offload_optimizer.tier == Tier::kNvme;
}

// Stops the run after an engine, device or trainer call failed: one line naming what was being
// done, with a budget error rewritten as the flag that fixes it. Returns the exit code, 1.
int Fail(const std::string& what, const Status& s) {
  std::fprintf(stderr, "zinf-train: %s: %s\n", what.c_str(), Explain(s).message().c_str());
  return 1;
}

// The exit code of a failure before the first step: 2 when it refuses what was asked (a flag,
// the configuration, a folder, the environment: its code says so, or its errno is a permission,
// a read-only filesystem or a descriptor limit), 1 when something failed (I/O, space, damaged
// state, a device).
int SetupExitCode(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kNotFound:
    case StatusCode::kAlreadyExists:
    case StatusCode::kFailedPrecondition:
    case StatusCode::kNotSupported:
      return 2;
    default:
      break;
  }
  const int e = s.sys_errno();
  return e == EACCES || e == EPERM || e == EROFS || e == EMFILE || e == ENFILE ? 2 : 1;
}

// Fail, before training: the same line, the exit code SetupExitCode gives.
int FailSetup(const std::string& what, const Status& s) {
  Fail(what, s);
  return SetupExitCode(s);
}

// The model the flags ask for: explicit sizes (all of --layers, --d-model and --heads) or a
// preset, with --max-seq on top. Sets f->seq when it was not given.
int ChooseModel(Flags* f, GptConfig* model) {
  if (f->layers > 0 || f->d_model > 0 || f->heads > 0) {
    if (f->layers <= 0 || f->d_model <= 0 || f->heads <= 0) {
      std::fprintf(stderr,
                   "zinf-train: explicit sizes need all of --layers, --d-model and --heads\n");
      return 2;
    }
    model->layers = f->layers;
    model->d_model = f->d_model;
    model->heads = f->heads;
    model->max_seq = std::max(f->seq, 1024);  // --seq given or not: 1024 rows
    model->name = "custom";
  } else {
    Result<GptConfig> p = Preset(f->preset);
    if (!p.ok()) {
      std::fprintf(stderr, "zinf-train: %s\n", p.status().message().c_str());
      return 2;
    }
    *model = *p;
  }
  if (f->max_seq > 0) model->max_seq = f->max_seq;
  if (f->seq == 0) f->seq = std::min(128, model->max_seq);
  if (Status s = Validate(*model); !s.ok()) {
    std::fprintf(stderr, "zinf-train: %s\n", s.message().c_str());
    return 2;
  }
  return 0;
}

// The model, the engine configuration, the swap folders (created, with room for the model)
// and the training text.
int PlanRun(Flags* f, RunPlan* plan) {
  if (int rc = ChooseModel(f, &plan->model); rc != 0) return rc;
  Result<EngineConfig> config = BuildConfig(*f);
  if (!config.ok()) {
    std::fprintf(stderr, "zinf-train: %s\n", config.status().message().c_str());
    return 2;
  }
  plan->config = std::move(config).value();
  plan->params = ParamCount(plan->model);
  if (Status s = PrepareNvmeFolders(plan->config, plan->params); !s.ok()) {
    std::fprintf(stderr, "zinf-train: %s\n", Explain(s).message().c_str());
    return SetupExitCode(s);
  }
  const std::string data_path = f->data.empty() ? DefaultData() : f->data;
  Result<TextData> data = TextData::Load(data_path, f->seq);
  if (!data.ok()) {
    std::fprintf(stderr, "zinf-train: %s\n", data.status().message().c_str());
    return SetupExitCode(data.status());
  }
  plan->data = std::move(data).value();
  return 0;
}

// Device and communicator, one rank: the host device, or GPU 0 with a one-rank NCCL
// communicator (the model's forward and backward then run on the GPU), by the runtime's rules.
int OpenDevice(const Flags& f, const RunPlan& plan, Runtime* rank) {
  RuntimeOptions o;
  o.cuda = f.device == "cuda";
  o.device_budget_bytes = plan.config.device_budget_bytes;
  o.pinned_budget_bytes = plan.config.pinned_budget_bytes;
  o.names = BudgetNames{"--device-budget", "--pinned-budget"};
  // A rank of a group when a launcher (zinf-train --nproc, torchrun, mpirun) says so.
  Result<ProcessGroupOptions> group = ProcessGroupFromEnv();
  if (!group.ok()) return FailSetup("the process group", group.status());
  o.group = *group;
  o.group.timeout = std::chrono::milliseconds(
      static_cast<int64_t>(plan.config.collective_timeout_seconds * 1000));
  if (o.group.world_size > 1 && plan.config.durable) {
    std::fprintf(stderr,
                 "zinf-train: --durable is not supported with several ranks yet (WORLD_SIZE=%d); "
                 "use --checkpoint-dir with --save-every, which several ranks share (and which "
                 "loads into any number of ranks)\n",
                 o.group.world_size);
    return 2;
  }
  if (o.cuda) {
    o.cuda_ordinal = o.group.local_rank;  // one GPU per process of a machine
    // The trainer's own device memory (activations, one layer's gradients, scratch), which the
    // engine does not plan.
    const size_t trainer = GptTrainer::DeviceBytes(
        plan.model, f.batch, f.seq, StoredParamBytes(plan.config) == 2,
        plan.config.layer_major ? std::max(1, plan.config.gradient_accumulation_steps) : 0);
    if (trainer > (size_t{1} << 56)) {
      std::fprintf(stderr,
                   "zinf-train: the trainer's activations for --batch %d x --seq %d are larger "
                   "than any device; lower --batch or --seq\n",
                   f.batch, f.seq);
      return 2;
    }
    o.extra_device_bytes = trainer;
  }
  Result<Runtime> r = NewRuntime(o);
  if (!r.ok()) {
    // No usable GPU is a device error (1); a host budget that cannot fit is refused (2).
    return o.cuda ? Fail("--device cuda", r.status()) : FailSetup("the host device", r.status());
  }
  *rank = std::move(r).value();
  return 0;
}

void PrintBanner(const Flags& f, const RunPlan& plan) {
  const GptConfig& model = plan.model;
  const EngineConfig& config = plan.config;
  std::fprintf(
      out,
      "zinf-train: model %s, %d layers, d_model %d, %d heads: %s parameters (%.3g B)\n"
      "  parameters on %s (%s), optimizer states on %s (%s, %.2f B/param with the master), %s; "
      "batch %d x seq %d, %d steps\n",
      model.name.c_str(), model.layers, model.d_model, model.heads,
      std::to_string(plan.params).c_str(), plan.params / 1e9, TierName(config.offload_param.tier),
      StoredParamName(config), TierName(config.offload_optimizer.tier),
      StateTypeName(config.optimizer_state_type), StateBytesPerParam(config),
      UsesNvme(config) ? ("swap folder " + config.offload_optimizer.nvme_paths.front()).c_str()
                       : "no NVMe",
      f.batch, f.seq, f.steps);
  const int accum = std::max(1, config.gradient_accumulation_steps);
  if (config.layer_major) {
    const double mib =
        static_cast<double>(GptTrainer::WindowBytes(model, f.batch, f.seq, accum)) / (1 << 20);
    std::fprintf(out,
                 "  schedule layer-major: %d micro-batches per pass, their block inputs kept "
                 "(%.1f MiB), blocks recomputed in the backward\n",
                 accum, mib);
  } else if (accum > 1) {
    std::fprintf(out, "  schedule micro-batch: %d micro-batches, one at a time\n", accum);
  }
  std::fflush(out);
}

// Creates the engine on `rank` (with `config`: the plan's, or one allowed to replace the
// durable store) and the trainer, which registers the model's parameters.
int OpenSession(const Flags& f, const RunPlan& plan, const EngineConfig& config,
                const Runtime& rank, Session* s) {
  Result<std::unique_ptr<Engine>> engine =
      Engine::Create(config, rank.device.get(), rank.comm.get());
  if (!engine.ok()) return FailSetup("creating the engine", engine.status());
  s->engine = std::move(engine).value();
  // Durable commits carry the run's record, so that a resume checks the model and the seed.
  if (Status st = s->engine->SetCommitUserData(RunRecord(plan.model, f.seed)); !st.ok()) {
    return FailSetup("creating the engine", st);
  }
  // What every rank must run alike beyond the engine's settings (compared across the ranks
  // at FinishRegistration, with the model's parameters and initial values).
  const std::pair<const char*, std::string> trainer_settings[] = {
      {"zinf-train --steps", std::to_string(f.steps)},
      {"zinf-train --batch", std::to_string(f.batch)},
      {"zinf-train --seq", std::to_string(f.seq)},
      {"zinf-train --warmup", f.warmup < 0 ? "default" : std::to_string(f.warmup)},
      {"zinf-train --seed", std::to_string(f.seed)},
      {"zinf-train model", plan.model.name + " " + std::to_string(plan.model.layers) +
                               " layers, d_model " + std::to_string(plan.model.d_model) + ", " +
                               std::to_string(plan.model.heads) + " heads"},
  };
  for (const auto& [name, value] : trainer_settings) {
    if (Status st = s->engine->RequireAgreement(name, value); !st.ok()) {
      return FailSetup("creating the engine", st);
    }
  }
  Result<std::unique_ptr<GptTrainer>> trainer = GptTrainer::Create(
      plan.model, f.batch, f.seq, f.seed, s->engine.get(), {}, rank.device.get());
  if (!trainer.ok()) return FailSetup("building the model", trainer.status());
  s->trainer = std::move(trainer).value();
  s->rank = rank.comm->rank();
  s->world = rank.comm->world_size();
  s->comm = rank.comm.get();
  s->device = rank.device.get();
  return 0;
}

// Whether --checkpoint-dir holds a checkpoint to fall back to.
bool HasCheckpoints(const Flags& f) {
  if (f.checkpoint_dir.empty()) return false;
  Result<std::vector<std::string>> names = Engine::ListCheckpoints(f.checkpoint_dir);
  return names.ok() && !names->empty();
}

// Gives the parameters their values: with --durable --resume those of the swap store's last
// committed step, else their initial values placed in their tiers. Sets *first_step. When the
// store holds no usable commit, *from_checkpoint says to resume from --checkpoint-dir instead
// (the engine then starts a fresh store); a resume never silently starts over.
int PlaceOrResumeDurable(const Flags& f, const RunPlan& plan, const Runtime& rank, Session* s,
                         int64_t* first_step, bool* from_checkpoint) {
  auto t_init = Clock::now();
  *first_step = 0;
  *from_checkpoint = false;
  if (f.resume && plan.config.durable) {
    // Durable: the swap store itself holds the last completed step.
    const std::string folders =
        plan.config.offload_optimizer.nvme_paths.front() +
        (plan.config.offload_optimizer.nvme_paths.size() > 1 ? ", ..." : "");
    Engine::StoreResume resumed;
    Status st = s->engine->ResumeFromStore(&resumed);
    if (st.ok()) {
      *first_step = resumed.step;
      if (resumed.reopened) {
        if (Status c = CheckRunRecord("the durable store in " + folders, resumed.user_data,
                                      plan.model, f.seed);
            !c.ok()) {
          return FailSetup("resuming from the swap store", c);
        }
        std::fprintf(out, "  resumed from the durable swap store at step %" PRId64 "\n",
                     *first_step);
      } else {
        std::fprintf(out,
                     "  the durable swap store never committed a step (its run stopped while "
                     "initialising): starting from step 0\n");
      }
    } else {
      // No usable commit. NotFound: the folders hold no store (a replaced disk, other --nvme
      // folders); Corruption: the store lost its index or a file; anything else (another
      // order of the folders, another model) is only refused.
      const bool no_store = st.code() == StatusCode::kNotFound;
      const bool damaged = st.code() == StatusCode::kCorruption;
      if (!(no_store || damaged) || !HasCheckpoints(f)) {
        std::string fix;
        if (no_store) {
          fix =
              "; give the --nvme folders that hold it, in their order, or start afresh without "
              "--resume";
        }
        return FailSetup("--resume: the durable swap store cannot be resumed",
                         Status(st.code(), st.message() + fix, st.sys_errno()));
      }
      if (damaged && !f.overwrite) {
        std::fprintf(stderr,
                     "zinf-train: --resume: the durable swap store cannot be resumed: %s; "
                     "--checkpoint-dir %s holds checkpoints: add --overwrite to replace the "
                     "store and resume from the newest of them\n",
                     st.message().c_str(), f.checkpoint_dir.c_str());
        return 1;
      }
      std::fprintf(out,
                   "  the durable swap store cannot be resumed (%s): resuming from the "
                   "newest checkpoint in %s%s\n",
                   st.message().c_str(), f.checkpoint_dir.c_str(),
                   damaged ? "; --overwrite: the store is replaced" : "");
      *from_checkpoint = true;
      // A fresh engine (the failed one refuses to train), allowed to replace a damaged store
      // only with --overwrite (checked above).
      s->trainer.reset();
      s->engine.reset();
      EngineConfig config = plan.config;
      config.durable_overwrite = config.durable_overwrite || damaged;
      if (int rc = OpenSession(f, plan, config, rank, s); rc != 0) return rc;
    }
  }
  if (*first_step == 0) {
    if (Status st = s->engine->FinishRegistration(); !st.ok()) {
      return FailSetup("placing the parameters", st);
    }
  }
  std::fprintf(out, "  initialised and placed in %.1f s\n", Seconds(Clock::now() - t_init));
  return 0;
}

// The checkpoint folder: usable (created, writable, locked) before any step is spent, and
// not another run's checkpoints unless resuming or told to overwrite them. Only what zinf
// wrote there counts (and goes with --overwrite); the user's other files stay.
int PrepareCheckpointFolder(const Flags& f, Engine* engine, bool resuming) {
  if (Status s = engine->PrepareCheckpointDir(f.checkpoint_dir); !s.ok()) {
    return FailSetup("the checkpoint folder", s);
  }
  Result<std::vector<std::string>> existing = Engine::ListCheckpoints(f.checkpoint_dir);
  if (!existing.ok()) return FailSetup("the checkpoint folder", existing.status());
  if (!existing->empty() && !resuming && !f.overwrite) {
    std::fprintf(stderr,
                 "zinf-train: %s holds checkpoints (%s): pass --resume to continue from the "
                 "newest, or --overwrite to remove them and start afresh\n",
                 f.checkpoint_dir.c_str(), existing->front().c_str());
    return 2;
  }
  if (!existing->empty() && f.overwrite && !resuming) {
    if (Status s = engine->RemoveCheckpoints(f.checkpoint_dir); !s.ok()) {
      return Fail("--overwrite", s);
    }
    std::fprintf(out, "  --overwrite: removed %zu checkpoint entr%s from %s (other files kept)\n",
                 existing->size(), existing->size() == 1 ? "y" : "ies", f.checkpoint_dir.c_str());
  }
  return 0;
}

// --resume without --durable: continues from the newest readable checkpoint in
// --checkpoint-dir (from step 0 when there is none yet). Sets *first_step when it resumes.
int ResumeFromCheckpoint(const Flags& f, const RunPlan& plan, Engine* engine, int64_t* first_step) {
  if (f.checkpoint_dir.empty()) {
    std::fprintf(stderr,
                 "zinf-train: --resume needs --checkpoint-dir (or --durable, to resume from "
                 "the swap store)\n");
    return 2;
  }
  Result<int64_t> step =
      LoadCheckpoint(f.checkpoint_dir, plan.model, f.seed, engine, /*fall_back=*/true);
  if (!step.ok() && step.status().code() == StatusCode::kNotFound) {
    // Nothing committed yet (e.g. the first run died before its first save): start over.
    std::fprintf(out, "  no checkpoint in %s yet: starting from step 0\n",
                 f.checkpoint_dir.c_str());
  } else if (!step.ok()) {
    return FailSetup("resuming from " + f.checkpoint_dir, step.status());
  } else {
    *first_step = *step;
    std::fprintf(out, "  resumed from %s at step %" PRId64 "\n", f.checkpoint_dir.c_str(),
                 *first_step);
  }
  return 0;
}

}  // namespace zinf::train
