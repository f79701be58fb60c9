// zinf-train: trains a GPT-2-style byte-level model through the zinf engine.
//
//   zinf-train                       # the demo: small model, optimizer states on NVMe under
//                                    # ./zinf-swap, the repository's corpus
//   zinf-train --preset 1.3B --param-tier nvme --optimizer-tier nvme --nvme /mnt/nvme0
//   zinf-train --config ds_config.json --steps 100
//
// Progress goes to stdout (stderr with --json): a line per step with the loss, tokens/s,
// model TFLOPS, NVMe GB/s, overlap efficiency and stall time; at the end a summary table and
// one JSON line.
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/cli.h"
#include "engine/host/single_rank.h"
#include "train/checkpoint.h"
#include "train/gpt.h"
#include "train/text_data.h"
#include "train/trainer.h"
#include "zinf/comm.h"
#include "zinf/config.h"
#include "zinf/cuda.h"
#include "zinf/device.h"
#include "zinf/engine.h"
#include "zinf/log.h"

#ifndef ZINF_DEFAULT_DATA
#define ZINF_DEFAULT_DATA "train/data/corpus.txt"
#endif

namespace zinf::train {
namespace {

using Clock = std::chrono::steady_clock;

struct Flags {
  std::string preset = "small";
  int layers = 0, d_model = 0, heads = 0, max_seq = 0;
  int steps = 400;
  int batch = 8;
  int seq = 0;         // 0: 128, or the model's position table when shorter
  int grad_accum = 0;  // 0: config's gradient_accumulation_steps
  double lr = 0;       // 0: config's (or 1e-3)
  int warmup = -1;     // -1: steps / 10, at most 100
  std::string config;
  std::vector<std::string> nvme;
  std::string device = "host";  // host | cuda
  std::string param_tier, optimizer_tier;
  double optimizer_ratio = -1;  // -1: config's (or 1)
  std::string device_budget, pinned_budget;
  std::string data;
  std::string checkpoint_dir;
  int save_every = 0;
  bool resume = false;
  uint64_t seed = 1;
  bool json = false;
  int log_every = 0;  // 0: about 40 lines per run
  bool fp32 = false;
  bool delayed_update = false;
  uint64_t delayed_update_after = 0;
  bool durable = false;
  bool overwrite = false;
  std::string io_backend;   // "": config's (io_uring, falling back to libaio, then psync)
  std::string state_dtype;  // "": config's zinf.optimizer_state_dtype (fp32)
};

FILE* out = stdout;  // progress stream (stderr with --json)

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

uint64_t PeakRssBytes() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<uint64_t>(ru.ru_maxrss) * 1024;
}

Result<Tier> ParseTier(const std::string& s, const std::string& flag) {
  if (s == "device" || s == "none") return Tier::kDevice;
  if (s == "cpu") return Tier::kCpu;
  if (s == "nvme") return Tier::kNvme;
  return Status::InvalidArgument(flag + ": expected device, cpu or nvme, got '" + s + "'");
}

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
  if (f.fp32) c.bf16 = false;
  if (!f.param_tier.empty()) {
    ZINF_ASSIGN_OR_RETURN(c.offload_param.tier, ParseTier(f.param_tier, "--param-tier"));
  }
  if (!f.optimizer_tier.empty()) {
    ZINF_ASSIGN_OR_RETURN(c.offload_optimizer.tier,
                          ParseTier(f.optimizer_tier, "--optimizer-tier"));
  }
  if (f.optimizer_ratio >= 0) c.offload_optimizer.ratio = f.optimizer_ratio;
  if (!f.state_dtype.empty()) {
    Result<StateType> t = ParseStateType(f.state_dtype);
    if (!t.ok()) {
      return Status::InvalidArgument("--state-dtype: expected fp32, bf16 or int8, got '" +
                                     f.state_dtype + "'");
    }
    c.optimizer_state_type = *t;
  }
  std::vector<std::string> nvme = f.nvme;
  if (nvme.empty()) {
    for (const OffloadConfig* o : {&c.offload_param, &c.offload_optimizer}) {
      for (const std::string& p : o->nvme_paths) {
        if (std::find(nvme.begin(), nvme.end(), p) == nvme.end()) nvme.push_back(p);
      }
    }
  }
  if (nvme.empty()) nvme.push_back("zinf-swap");
  c.offload_param.nvme_paths = nvme;
  c.offload_optimizer.nvme_paths = nvme;
  if (f.lr > 0) c.optimizer.lr = static_cast<float>(f.lr);
  if (f.grad_accum > 0) c.gradient_accumulation_steps = f.grad_accum;
  if (f.delayed_update) c.delayed_update = true;
  if (f.delayed_update_after > 0) c.delayed_update_after = f.delayed_update_after;
  if (f.overwrite) c.durable_overwrite = true;
  if (!f.io_backend.empty()) c.aio.backend = f.io_backend;
  if (f.durable) c.durable = true;
  if (!f.device_budget.empty()) {
    ZINF_ASSIGN_OR_RETURN(c.device_budget_bytes, ParseByteSize(f.device_budget, "--device-budget"));
  }
  if (!f.pinned_budget.empty()) {
    ZINF_ASSIGN_OR_RETURN(c.pinned_budget_bytes, ParseByteSize(f.pinned_budget, "--pinned-budget"));
  }
  return c;
}

bool UsesNvme(const EngineConfig& c) {
  return c.offload_param.tier == Tier::kNvme || c.offload_optimizer.tier == Tier::kNvme;
}

// Creates the swap folders and checks that the model fits on them: one sentence with the fix
// when it does not.
// Bytes the optimizer keeps per parameter: the fp32 master and two states as stored (12 with
// fp32 states, 8 with bf16, about 6.03 with int8).
double StateBytesPerParam(const EngineConfig& c) {
  constexpr size_t kN = size_t{1} << 20;
  return 4.0 + 2.0 * static_cast<double>(StateBytes(c.optimizer_state_type, kN)) / kN;
}

Status CheckNvme(const EngineConfig& c, uint64_t params) {
  if (!UsesNvme(c)) return Status::OK();
  const std::vector<std::string>& paths = c.offload_optimizer.nvme_paths;
  // In 128 bits: a count beyond any disk must not wrap into one that fits.
  unsigned __int128 need = 0;
  const unsigned __int128 n = params;
  if (c.offload_param.tier == Tier::kNvme) need += n * (c.bf16 ? 2 : 4);
  if (c.offload_optimizer.tier == Tier::kNvme) {
    need += static_cast<unsigned __int128>(StateBytesPerParam(c) * static_cast<double>(params));
  }
  // The delayed update double-buffers NVMe parameters; durable mode keeps the committed copy
  // of everything while a step writes the next one.
  if (c.delayed_update && c.offload_param.tier == Tier::kNvme) need += n * (c.bf16 ? 2 : 4);
  if (c.durable) need *= 2;
  need = need + need / 50;  // alignment and padding
  uint64_t free_bytes = 0;
  for (size_t i = 0; i < paths.size(); ++i) {
    const std::string& p = paths[i];
    // A swap file already there is reused (resume) or truncated (fresh run): its space counts.
    struct stat st {};
    const std::string swap_file = p + "/zinf-swap-" + std::to_string(i) + ".bin";
    if (stat(swap_file.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
      free_bytes += static_cast<uint64_t>(st.st_blocks) * 512;
    }
    std::error_code ec;
    if (!c.allowed_nvme_roots.empty()) {
      // Refused before anything is created: the existing part of the path resolved (links
      // followed), the rest taken as written.
      const std::filesystem::path resolved = std::filesystem::weakly_canonical(p, ec);
      bool inside = false;
      for (const std::string& r : c.allowed_nvme_roots) {
        std::error_code rec;
        const std::filesystem::path root = std::filesystem::canonical(r, rec);
        if (rec) continue;
        const auto rel = resolved.lexically_relative(root);
        inside = inside || (!rel.empty() && *rel.begin() != "..");
      }
      if (ec || !inside) {
        return Status::InvalidArgument("the NVMe swap folder " + p +
                                       " is outside zinf.allowed_nvme_roots (nothing was "
                                       "created): give --nvme a folder inside one of them");
      }
    }
    std::filesystem::create_directories(p, ec);
    if (ec) {
      return Status(StatusCode::kIoError,
                    "cannot create the NVMe swap folder " + p + ": " + ec.message() +
                        "; give --nvme a writable folder",
                    ec.value());
    }
    struct statvfs vfs {};
    if (statvfs(p.c_str(), &vfs) != 0) {
      return ErrnoToStatus(errno, "statvfs on the NVMe swap folder " + p);
    }
    free_bytes += static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  }
  if (need > free_bytes) {
    const uint64_t shown = need > UINT64_MAX ? UINT64_MAX : static_cast<uint64_t>(need);
    return Status::ResourceExhausted(
        "not enough space on the NVMe path" + std::string(paths.size() > 1 ? "s" : "") + " (" +
        paths.front() + (paths.size() > 1 ? ", ..." : "") + "): this model's " +
        (c.offload_param.tier == Tier::kNvme ? "parameters and " : "") +
        "optimizer states need about " + FormatBytes(shown) + " but " + FormatBytes(free_bytes) +
        " is free; free space, add --nvme paths on other disks, or pick a smaller model");
  }
  return Status::OK();
}

// Rewrites engine errors about budgets as the zinf-train flag that fixes them.
Status Explain(const Status& s) {
  const std::string& m = s.message();
  if (m.find("zinf.device_budget_bytes") != std::string::npos ||
      m.find("HostDeviceOptions::memory_budget") != std::string::npos) {
    return Status(s.code(), m + " (zinf-train: --device-budget)");
  }
  if (m.find("zinf.pinned_budget_bytes") != std::string::npos) {
    return Status(s.code(), m + " (zinf-train: --pinned-budget)");
  }
  return s;
}

struct StepRow {
  int64_t step = 0;
  double loss = 0, seconds = 0, tokens_per_s = 0, tflops = 0;
  double read_gbps = 0, write_gbps = 0, overlap = 0, stall = 0;
};

// The jobs of a run below each print their own message when they stop it and return the exit
// code: 0 to go on, 2 for a usage error (flags, files, sizes), 1 for a failure of the engine,
// the device or the disk.

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

// What the flags and files decide before any device or engine exists.
struct RunPlan {
  GptConfig model;
  EngineConfig config;
  uint64_t params = 0;  // ParamCount(model)
  TextData data;
};

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
  if (Status s = CheckNvme(plan->config, plan->params); !s.ok()) {
    std::fprintf(stderr, "zinf-train: %s\n", s.message().c_str());
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
// communicator (the model's forward and backward then run on the GPU).
int OpenDevice(const Flags& f, const RunPlan& plan, SingleRank* rank) {
  const EngineConfig& config = plan.config;
  if (f.device == "cuda") {
    CudaDeviceOptions copt;
    // 0: 90% of the free memory. Else the engine's budget plus the trainer's own device
    // memory (activations, one layer's gradients, scratch), which the engine does not plan.
    copt.memory_budget = config.device_budget_bytes;
    if (copt.memory_budget != 0) {
      const size_t trainer = GptTrainer::DeviceBytes(plan.model, f.batch, f.seq, config.bf16);
      if (trainer > (size_t{1} << 56) ||
          __builtin_add_overflow(copt.memory_budget, trainer + (size_t{1} << 20),
                                 &copt.memory_budget)) {
        std::fprintf(stderr,
                     "zinf-train: the trainer's activations for --batch %d x --seq %d are larger "
                     "than any device; lower --batch or --seq\n",
                     f.batch, f.seq);
        return 2;
      }
    }
    Result<SingleRank> cuda = NewCudaSingleRank(copt);
    if (!cuda.ok()) {
      std::fprintf(stderr, "zinf-train: --device cuda: %s\n", cuda.status().message().c_str());
      return 1;
    }
    *rank = std::move(cuda).value();
    return 0;
  }
  HostDeviceOptions dopt;
  // Without a budget the host device may use the machine's memory (it is host memory), or
  // what an address-space limit leaves of it.
  Result<uint64_t> budget = HostDeviceBudget(config.device_budget_bytes, config.pinned_budget_bytes,
                                             BudgetNames{"--device-budget", "--pinned-budget"});
  if (!budget.ok()) {
    std::fprintf(stderr, "zinf-train: %s\n", budget.status().message().c_str());
    return 2;
  }
  dopt.memory_budget = *budget;
  Result<SingleRank> host = NewHostSingleRank(dopt);
  if (!host.ok()) {
    std::fprintf(stderr, "zinf-train: %s\n", host.status().ToString().c_str());
    return 1;
  }
  *rank = std::move(host).value();
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
      config.bf16 ? "bf16" : "fp32", TierName(config.offload_optimizer.tier),
      StateTypeName(config.optimizer_state_type), StateBytesPerParam(config),
      UsesNvme(config) ? ("swap folder " + config.offload_optimizer.nvme_paths.front()).c_str()
                       : "no NVMe",
      f.batch, f.seq, f.steps);
  std::fflush(out);
}

// The engine and the model trained through it. Members are destroyed in reverse order: the
// trainer, which holds buffers of the engine, before the engine.
struct Session {
  std::unique_ptr<Engine> engine;
  std::unique_ptr<GptTrainer> trainer;
};

// Creates the engine on `rank` (with `config`: the plan's, or one allowed to replace the
// durable store) and the trainer, which registers the model's parameters.
int OpenSession(const Flags& f, const RunPlan& plan, const EngineConfig& config,
                const SingleRank& rank, Session* s) {
  Result<std::unique_ptr<Engine>> engine =
      Engine::Create(config, rank.device.get(), rank.comm.get());
  if (!engine.ok()) return FailSetup("creating the engine", engine.status());
  s->engine = std::move(engine).value();
  // Durable commits carry the run's record, so that a resume checks the model and the seed.
  if (Status st = s->engine->SetCommitUserData(RunRecord(plan.model, f.seed)); !st.ok()) {
    return FailSetup("creating the engine", st);
  }
  Result<std::unique_ptr<GptTrainer>> trainer = GptTrainer::Create(
      plan.model, f.batch, f.seq, f.seed, s->engine.get(), {}, rank.device.get());
  if (!trainer.ok()) return FailSetup("building the model", trainer.status());
  s->trainer = std::move(trainer).value();
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
int PlaceOrResumeDurable(const Flags& f, const RunPlan& plan, const SingleRank& rank, Session* s,
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

// What the training loop measured, for the report.
struct TrainLog {
  std::vector<StepRow> rows;
  double loss_first = 0, loss_last = 0;
  uint64_t read_bytes = 0, write_bytes = 0;
  double total_seconds = 0;
};

// Steps first_step + 1 .. --steps: each step's micro-steps, its progress line and, with
// --save-every, its checkpoint.
class TrainingLoop {
 public:
  TrainingLoop(const Flags& f, const RunPlan& plan, const Session& s, int64_t first_step)
      : f_(f),
        plan_(plan),
        engine_(s.engine.get()),
        trainer_(s.trainer.get()),
        first_step_(first_step),
        accum_(std::max(1, plan.config.gradient_accumulation_steps)),
        tokens_per_micro_(f.batch * f.seq),
        flops_per_token_(FlopsPerToken(plan.model, f.seq)),
        log_every_(f.log_every > 0 ? f.log_every : std::max(1, f.steps / 40)),
        warmup_(f.warmup >= 0 ? f.warmup : std::min(100, f.steps / 10)),
        tty_(isatty(fileno(out))),
        state_bytes_per_param_(StateBytesPerParam(plan.config)),
        tokens_(tokens_per_micro_),
        targets_(tokens_per_micro_) {}

  int Run(TrainLog* log) {
    for (int64_t step = first_step_; step < f_.steps; ++step) {
      auto t0 = Clock::now();
      double loss = 0;
      StepStats agg;
      if (int rc = Step(step, &loss, &agg); rc != 0) return rc;
      if (!std::isfinite(loss)) {
        // Training on would only spread it (and save it); the last checkpoint or durable
        // commit stays the one to resume from.
        std::fprintf(stderr,
                     "zinf-train: the loss of step %" PRId64
                     " is not finite (%g): stopping; lower "
                     "--lr or check the model and data, then resume from the last checkpoint\n",
                     step + 1, loss);
        return 1;
      }
      Record(step, loss, agg, Seconds(Clock::now() - t0), log);
      if (!f_.checkpoint_dir.empty() && f_.save_every > 0 && (step + 1) % f_.save_every == 0) {
        auto tc = Clock::now();
        if (Status s = SaveCheckpoint(f_.checkpoint_dir, plan_.model, f_.seed, engine_); !s.ok()) {
          return Fail("saving a checkpoint to " + f_.checkpoint_dir, s);
        }
        std::fprintf(out, "  checkpoint at step %" PRId64 " saved to %s in %.1f s\n", step + 1,
                     f_.checkpoint_dir.c_str(), Seconds(Clock::now() - tc));
      }
    }
    return 0;
  }

 private:
  // One optimizer step: its learning rate, then its micro-steps. *loss: their mean; *agg:
  // their NVMe traffic and waits summed, the overlap of the last (the optimizer's).
  int Step(int64_t step, double* loss, StepStats* agg) {
    // Linear warmup, then the base rate (Adam's first steps on a fresh model are large).
    const double lr_scale = warmup_ > 0 ? std::min(1.0, (step + 1.0) / warmup_) : 1.0;
    if (Status s =
            engine_->SetLearningRate(static_cast<float>(plan_.config.optimizer.lr * lr_scale));
        !s.ok()) {
      return Fail("setting the learning rate", s);
    }
    for (int micro = 0; micro < accum_; ++micro) {
      plan_.data.Batch(f_.seed, step * accum_ + micro, f_.batch, f_.seq, tokens_.data(),
                       targets_.data());
      StepStats st;
      Result<double> l = trainer_->MicroStep(tokens_.data(), targets_.data(), 1.0f / accum_, &st);
      if (!l.ok()) return Fail("step " + std::to_string(step + 1), l.status());
      *loss += *l / accum_;
      agg->nvme_read_bytes += st.nvme_read_bytes;
      agg->nvme_write_bytes += st.nvme_write_bytes;
      agg->acquire_wait_seconds += st.acquire_wait_seconds;
      agg->optimizer_wait_seconds += st.optimizer_wait_seconds;
      agg->overlap_efficiency = st.overlap_efficiency;  // of the optimizer micro-step
    }
    return 0;
  }

  // Adds the step to the log and prints its progress line: kept every --log-every steps and
  // at the first and last; on a terminal the others are shown in place.
  void Record(int64_t step, double loss, const StepStats& agg, double secs, TrainLog* log) {
    StepRow r;
    r.step = step + 1;
    r.loss = loss;
    r.seconds = secs;
    r.tokens_per_s = tokens_per_micro_ * accum_ / secs;
    r.tflops = r.tokens_per_s * flops_per_token_ / 1e12;
    r.read_gbps = agg.nvme_read_bytes / secs / 1e9;
    r.write_gbps = agg.nvme_write_bytes / secs / 1e9;
    r.overlap = agg.overlap_efficiency;
    r.stall = agg.acquire_wait_seconds + agg.optimizer_wait_seconds;
    log->rows.push_back(r);
    if (step == first_step_) log->loss_first = loss;
    log->loss_last = loss;
    log->read_bytes += agg.nvme_read_bytes;
    log->write_bytes += agg.nvme_write_bytes;
    log->total_seconds += secs;
    const bool keep = (step + 1) % log_every_ == 0 || step == first_step_ || step + 1 == f_.steps;
    if (keep || tty_) {
      std::fprintf(out,
                   "%sstep %5" PRId64
                   "/%d  loss %.4f  %8.0f tok/s  %.3f TFLOPS  nvme r %.2f w %.2f "
                   "GB/s  overlap %.2f  stall %.2f s  state %.2f B/param%s",
                   tty_ ? "\r" : "", r.step, f_.steps, r.loss, r.tokens_per_s, r.tflops,
                   r.read_gbps, r.write_gbps, r.overlap, r.stall, state_bytes_per_param_,
                   keep ? "\n" : "");
      std::fflush(out);
    }
  }

  const Flags& f_;
  const RunPlan& plan_;
  Engine* const engine_;
  GptTrainer* const trainer_;
  const int64_t first_step_;
  const int accum_;  // micro-steps per optimizer step
  const int tokens_per_micro_;
  const double flops_per_token_;
  const int log_every_;
  const int warmup_;                       // steps of linear learning-rate warmup
  const bool tty_;                         // progress on a terminal
  const double state_bytes_per_param_;     // master + states as stored
  std::vector<int32_t> tokens_, targets_;  // one micro-step's batch
};

// The final checkpoint, unless --save-every just wrote it or no step ran.
int SaveFinalCheckpoint(const Flags& f, const RunPlan& plan, Engine* engine, int64_t first_step) {
  if (f.checkpoint_dir.empty() || (f.save_every != 0 && f.steps % f.save_every == 0) ||
      f.steps <= first_step) {
    return 0;
  }
  if (Status s = SaveCheckpoint(f.checkpoint_dir, plan.model, f.seed, engine); !s.ok()) {
    return Fail("saving the final checkpoint to " + f.checkpoint_dir, s);
  }
  return 0;
}

// The summary table on the progress stream and the JSON line on stdout: medians over the
// steps after the first (which pays for warm-up), and the parameters' checksum, by which two
// runs are compared.
int Report(const Flags& f, const RunPlan& plan, GptTrainer* trainer, int64_t first_step,
           const TrainLog& log) {
  Result<uint64_t> checksum = trainer->ParamChecksum();
  if (!checksum.ok()) return Fail("checksumming the parameters", checksum.status());
  const std::vector<StepRow>& rows = log.rows;
  auto median = [&](auto field) {
    std::vector<double> v;
    for (size_t i = rows.size() > 1 ? 1 : 0; i < rows.size(); ++i) v.push_back(field(rows[i]));
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double tok_s = median([](const StepRow& r) { return r.tokens_per_s; });
  const double tflops = median([](const StepRow& r) { return r.tflops; });
  const double overlap = median([](const StepRow& r) { return r.overlap; });
  const double rgbps = median([](const StepRow& r) { return r.read_gbps; });
  const double wgbps = median([](const StepRow& r) { return r.write_gbps; });
  const double stall = median([](const StepRow& r) { return r.stall; });
  const bool ran = !rows.empty();
  if (!ran) {
    std::fprintf(out, "  no step to run: resumed at step %" PRId64 ", --steps is %d\n", first_step,
                 f.steps);
  }
  const uint64_t rss = PeakRssBytes();
  char hash[17];
  std::snprintf(hash, sizeof(hash), "%016" PRIx64, *checksum);
  const GptConfig& model = plan.model;
  std::fprintf(out,
               "\n  %-22s %s\n  %-22s %.4f -> %.4f\n  %-22s %.0f\n  %-22s %.3f\n"
               "  %-22s %.2f / %.2f GB/s\n  %-22s %.2f\n  %-22s %.2f s\n  %-22s %s\n"
               "  %-22s %.1f s\n  %-22s %s\n",
               "parameters", std::to_string(plan.params).c_str(), "loss (first -> last)",
               ran ? log.loss_first : NAN, ran ? log.loss_last : NAN, "tokens/s (median)", tok_s,
               "model TFLOPS", tflops, "NVMe read / write", rgbps, wgbps, "overlap efficiency",
               overlap, "stall per step", stall, "peak RSS", FormatBytes(rss).c_str(), "train time",
               log.total_seconds, "param checksum", hash);
  nlohmann::json j = {
      {"model", model.name},
      {"params", plan.params},
      {"layers", model.layers},
      {"d_model", model.d_model},
      {"steps", f.steps},
      {"first_step", first_step},
      {"batch", f.batch},
      {"seq", f.seq},
      // null when no step ran (a resume at or past --steps): there is no loss to report.
      {"loss_first", ran ? nlohmann::json(log.loss_first) : nlohmann::json(nullptr)},
      {"loss_last", ran ? nlohmann::json(log.loss_last) : nlohmann::json(nullptr)},
      {"tokens_per_s", tok_s},
      {"model_tflops", tflops},
      {"nvme_read_gbps", rgbps},
      {"nvme_write_gbps", wgbps},
      {"nvme_read_bytes", log.read_bytes},
      {"nvme_write_bytes", log.write_bytes},
      {"overlap_efficiency", overlap},
      {"stall_seconds", stall},
      {"train_seconds", log.total_seconds},
      {"peak_rss_bytes", rss},
      {"param_checksum", hash},
      {"param_tier", TierName(plan.config.offload_param.tier)},
      {"optimizer_tier", TierName(plan.config.offload_optimizer.tier)},
      {"optimizer_state_dtype", StateTypeName(plan.config.optimizer_state_type)},
      {"state_bytes_per_param", StateBytesPerParam(plan.config)},
  };
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

// A run, job by job. Each job prints why it stops the run; its exit code is passed on.
int Run(Flags f) {
  if (f.json) out = stderr;
  RunPlan plan;
  if (int rc = PlanRun(&f, &plan); rc != 0) return rc;
  SingleRank rank;  // declared before the session: the engine goes before its device
  if (int rc = OpenDevice(f, plan, &rank); rc != 0) return rc;
  PrintBanner(f, plan);
  Session session;
  if (int rc = OpenSession(f, plan, plan.config, rank, &session); rc != 0) return rc;
  int64_t first_step = 0;
  bool from_checkpoint = false;
  if (int rc = PlaceOrResumeDurable(f, plan, rank, &session, &first_step, &from_checkpoint);
      rc != 0) {
    return rc;
  }
  if (!f.checkpoint_dir.empty()) {
    if (int rc = PrepareCheckpointFolder(f, session.engine.get(), f.resume); rc != 0) return rc;
  }
  if (f.resume && (!plan.config.durable || from_checkpoint)) {
    if (int rc = ResumeFromCheckpoint(f, plan, session.engine.get(), &first_step); rc != 0) {
      return rc;
    }
  }
  TrainLog log;
  if (int rc = TrainingLoop(f, plan, session, first_step).Run(&log); rc != 0) return rc;
  if (int rc = SaveFinalCheckpoint(f, plan, session.engine.get(), first_step); rc != 0) {
    return rc;
  }
  return Report(f, plan, session.trainer.get(), first_step, log);
}

}  // namespace
}  // namespace zinf::train

int main(int argc, char** argv) {
  zinf::train::Flags f;
  CLI::App app{"zinf-train: trains a GPT-2-style byte-level model through the zinf engine"};
  std::string presets;
  for (const std::string& p : zinf::train::PresetNames())
    presets += (presets.empty() ? "" : ", ") + p;
  app.add_option("--preset", f.preset, "model size: " + presets + " (small: the demo)")
      ->capture_default_str();
  app.add_option("--layers", f.layers, "explicit size: blocks (with --d-model and --heads)");
  app.add_option("--d-model", f.d_model, "explicit size: model width");
  app.add_option("--heads", f.heads, "explicit size: attention heads");
  app.add_option("--max-seq", f.max_seq, "rows of the position table (default: the preset's)");
  app.add_option("--steps", f.steps, "optimizer steps")
      ->capture_default_str()
      ->check(CLI::Range(1, 100000000));
  app.add_option("--batch", f.batch, "sequences per micro-step")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--seq", f.seq, "tokens per sequence (default 128, or the model's maximum)")

      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--grad-accum", f.grad_accum, "micro-steps per optimizer step (default: config's)")
      ->check(CLI::Range(1, 1 << 20));
  const CLI::Validator& finite = zinf::FiniteNumber();
  app.add_option("--lr", f.lr, "learning rate (default: config's, or 1e-3)")
      ->check(finite)
      ->check(CLI::Range(1e-12, 10.0).description("a learning rate in [1e-12, 10]"));
  app.add_option("--warmup", f.warmup,
                 "linear learning-rate warmup steps (default steps/10, <= 100)")
      ->check(CLI::Range(0, 100000000));
  app.add_option("--config", f.config, "DeepSpeed-style JSON config (zero_optimization, bf16, ...)")
      ->check(CLI::ExistingFile);
  app.add_option("--nvme", f.nvme, "NVMe swap folder (repeatable; default ./zinf-swap)");
  app.add_option(
         "--device", f.device,
         "host (default) or cuda: the engine and the model on GPU 0 (cuBLAS GEMMs, bf16 with "
         "bf16 parameters; parameters, copies, NCCL and the device optimizer there)")
      ->check(CLI::IsMember({"host", "cuda"}));
  app.add_option("--param-tier", f.param_tier, "where parameters live: device, cpu, nvme");
  app.add_option("--optimizer-tier", f.optimizer_tier,
                 "where optimizer states live: device, cpu, nvme");
  app.add_option("--optimizer-ratio", f.optimizer_ratio,
                 "share of optimizer sub-groups offloaded to --optimizer-tier (the rest stay "
                 "in device memory, stepped on the device); default 1")
      ->check(finite)
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--device-budget", f.device_budget, "device memory budget, e.g. 4G");
  app.add_option("--pinned-budget", f.pinned_budget, "pinned host memory budget, e.g. 2G");
  app.add_flag("--fp32", f.fp32, "store parameters in fp32 (default bf16 with fp32 masters)");
  app.add_option("--state-dtype", f.state_dtype,
                 "optimizer states stored as fp32 (default), bf16 or int8 (blockwise 8-bit: "
                 "about half the bytes of a step's optimizer I/O); the masters stay fp32");
  app.add_flag("--durable", f.durable,
               "commit the NVMe swap store after every step, so that --resume continues from "
               "it after a crash without a checkpoint copy (needs optimizer states on NVMe, and "
               "parameters on NVMe with --delayed-update; up to twice the NVMe space)");
  app.add_option("--delayed-update-after", f.delayed_update_after,
                 "with --delayed-update: run the first N steps undelayed")
      ->check(CLI::Range(uint64_t{0}, uint64_t{100000000}));
  app.add_flag("--delayed-update", f.delayed_update,
               "one-step delayed parameter update: a step's optimizer runs on while the next "
               "step computes (on the parameters one update older)");
  app.add_option("--io-backend", f.io_backend,
                 "the swap store's I/O backend: io_uring (default; libaio, then psync, when "
                 "the kernel refuses it, with a warning), libaio or psync")
      ->check(CLI::IsMember({"io_uring", "libaio", "psync"}));
  app.add_option("--data", f.data, "training text (any file; default the repository's corpus)");
  app.add_option("--checkpoint-dir", f.checkpoint_dir, "checkpoint folder (save and --resume)");
  app.add_option("--save-every", f.save_every, "save a checkpoint every N steps (and at the end)")
      ->check(CLI::Range(1, 100000000));
  app.add_flag("--resume", f.resume,
               "continue from the newest checkpoint in --checkpoint-dir (a damaged newest one is "
               "skipped for the one before, with a warning), or with --durable from the swap "
               "store's last committed step");
  app.add_flag("--overwrite", f.overwrite,
               "start afresh although --checkpoint-dir holds checkpoints (they are removed) or "
               "the swap folder holds a durable store (it is replaced); without it such a "
               "run is refused");
  app.add_option("--seed", f.seed, "seed of the initialisation and the batches")
      ->capture_default_str();
  app.add_flag("--json", f.json, "only the final JSON line on stdout (progress on stderr)");
  app.add_option("--log-every", f.log_every,
                 "keep a progress line every N steps (default: ~40 lines)")
      ->check(CLI::Range(1, 100000000));
  // --help prints and exits 0; a usage error (unknown flag, a value out of range) exits 2.
  if (int rc = zinf::ParseCommandLine(app, argc, argv); rc >= 0) return rc;
  return zinf::train::Run(f);
}
