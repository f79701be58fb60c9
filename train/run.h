// zinf-train's run, in jobs (main.cc calls them in order): the plan the flags and files decide
// (the model, the engine configuration, the swap folders, the training text), the device, the
// engine session, the resume (from the durable store or checkpoints), then the training loop
// and the report. Each job prints why it stops the run and returns the exit code: 0 to go on,
// 2 when something asked for was refused before anything ran, 1 when the run failed. Private to
// zinf-train.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "config/engine_flags.h"
#include "train/gpt.h"
#include "train/text_data.h"
#include "train/trainer.h"
#include "zinf/config.h"
#include "zinf/engine.h"
#include "zinf/runtime.h"

namespace zinf::train {

struct Flags {
  std::string preset = "small";
  int layers = 0, d_model = 0, heads = 0, max_seq = 0;
  int steps = 400;
  int batch = 8;
  int seq = 0;         // 0: 128, or the model's position table when shorter
  int grad_accum = 0;  // 0: config's gradient_accumulation_steps
  // --schedule: "layer-major", "micro-batch" or "auto" (layer-major where parameters are
  // offloaded and a window has several micro-batches, or the config says so).
  std::string schedule = "auto";
  double lr = 0;    // 0: config's (or 1e-3)
  int warmup = -1;  // -1: steps / 10, at most 100
  std::string config;
  std::string device = "host";  // host | cuda
  // The engine flags (config/engine_flags.h); each not given keeps the config's. Without
  // --nvme: the config's folders, or ./zinf-swap.
  EngineFlags engine;
  std::string device_budget, pinned_budget;
  std::string data;
  std::string checkpoint_dir;
  int save_every = 0;
  bool resume = false;
  uint64_t seed = 1;
  bool json = false;
  int log_every = 0;  // 0: about 40 lines per run
  bool fp32 = false;
  bool fp16 = false;
  uint64_t delayed_update_after = 0;
  bool durable = false;
  bool overwrite = false;
  int nproc = 0;  // --nproc: this run as that many rank processes (LaunchRanks)
};

// The progress stream: stdout, or stderr with --json (the JSON line alone on stdout).
extern FILE* out;

// What the flags and files decide before any device or engine exists.
struct RunPlan {
  GptConfig model;
  EngineConfig config;
  uint64_t params = 0;  // ParamCount(model)
  TextData data;
};

// The engine and the model trained through it. Members are destroyed in reverse order: the
// trainer, which holds buffers of the engine, before the engine.
struct Session {
  std::unique_ptr<Engine> engine;
  std::unique_ptr<GptTrainer> trainer;
  // This process's rank of the group (ProcessGroupFromEnv; 0 of 1 without a launcher) and its
  // communicator, which the loop uses to average the ranks' losses on the host device.
  int rank = 0;
  int world = 1;
  Communicator* comm = nullptr;
  Device* device = nullptr;
};

// ---- Setup (run_setup.cc) ----

// The model, the engine configuration, the swap folders (created, with room for the model)
// and the training text. Sets f->seq when it was not given.
int PlanRun(Flags* f, RunPlan* plan);
int OpenDevice(const Flags& f, const RunPlan& plan, Runtime* rank);
void PrintBanner(const Flags& f, const RunPlan& plan);
// Creates the engine on `rank` (with `config`: the plan's, or one allowed to replace the
// durable store) and the trainer, which registers the model's parameters.
int OpenSession(const Flags& f, const RunPlan& plan, const EngineConfig& config,
                const Runtime& rank, Session* s);
// Gives the parameters their values: with --durable --resume those of the swap store's last
// committed step, else their initial values placed in their tiers. Sets *first_step. When the
// store holds no usable commit, *from_checkpoint says to resume from --checkpoint-dir instead
// (the engine then starts a fresh store); a resume never silently starts over.
int PlaceOrResumeDurable(const Flags& f, const RunPlan& plan, const Runtime& rank, Session* s,
                         int64_t* first_step, bool* from_checkpoint);
// The checkpoint folder: usable (created, writable, locked) before any step is spent, and
// not another run's checkpoints unless resuming or told to overwrite them.
int PrepareCheckpointFolder(const Flags& f, Engine* engine, bool resuming);
// --resume without --durable (or falling back from it): continues from the newest readable
// checkpoint in --checkpoint-dir (from step 0 when there is none yet). Sets *first_step.
int ResumeFromCheckpoint(const Flags& f, const RunPlan& plan, Engine* engine, int64_t* first_step);

// ---- Training and the report (run_loop.cc) ----

// Steps first_step + 1 .. --steps with their progress lines and checkpoints, the final
// checkpoint, then the summary table and the JSON line.
int TrainAndReport(const Flags& f, const RunPlan& plan, const Session& s, int64_t first_step);

// ---- Messages and exit codes (run_setup.cc) ----

// Stops the run after an engine, device or trainer call failed: one line naming what was being
// done, naming the flag of the configuration key it is about. Returns 1.
int Fail(const std::string& what, const Status& s);
// The exit code of a failure before the first step: 2 when it refuses what was asked, 1 when
// something failed.
int SetupExitCode(const Status& s);
// Fail, before training: the same line, the exit code SetupExitCode gives.
int FailSetup(const std::string& what, const Status& s);
// Bytes the optimizer keeps per parameter (master and states as stored).
double StateBytesPerParam(const EngineConfig& c);
bool UsesNvme(const EngineConfig& c);

}  // namespace zinf::train
