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
#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>

#include "common/cli.h"
#include "common/rank_launcher.h"
#include "train/run.h"

namespace zinf::train {
namespace {

// A run, job by job. Each job prints why it stops the run; its exit code is passed on.
int Run(Flags f) {
  if (f.json) out = stderr;
  RunPlan plan;
  if (int rc = PlanRun(&f, &plan); rc != 0) return rc;
  Runtime rank;  // declared before the session: the engine goes before its device
  if (int rc = OpenDevice(f, plan, &rank); rc != 0) return rc;
  if (rank.comm->rank() != 0) {
    // Rank 0 reports for the group; the others' errors still reach stderr.
    if (std::freopen("/dev/null", "w", stdout) == nullptr) {
      std::fprintf(stderr, "zinf-train: rank %d cannot silence its stdout\n", rank.comm->rank());
      return 1;
    }
    out = stdout;
  }
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
  return TrainAndReport(f, plan, session, first_step);
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
  app.add_option("--schedule", f.schedule,
                 "zinf.schedule: layer-major (each block for every micro-batch of the window "
                 "before the next, so a parameter is fetched once per pass whatever "
                 "--grad-accum; each micro-batch's block inputs kept, blocks recomputed in the "
                 "backward), micro-batch (one micro-batch's forward and backward at a time) or "
                 "auto: layer-major with --grad-accum above 1 and parameters offloaded "
                 "(--param-tier cpu or nvme) or where the config says so, else micro-batch. "
                 "The same bits either way")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "layer-major", "micro-batch"}));
  const CLI::Validator& finite = zinf::FiniteNumber();
  app.add_option("--lr", f.lr, "learning rate (default: config's, or 1e-3)")
      ->check(finite)
      ->check(CLI::Range(1e-12, 10.0).description("a learning rate in [1e-12, 10]"));
  app.add_option("--warmup", f.warmup,
                 "linear learning-rate warmup steps (default steps/10, <= 100)")
      ->check(CLI::Range(0, 100000000));
  app.add_option("--config", f.config, "DeepSpeed-style JSON config (zero_optimization, bf16, ...)")
      ->check(CLI::ExistingFile);
  app.add_option(
         "--device", f.device,
         "host (default) or cuda: the engine and the model on GPU 0 (cuBLAS GEMMs, bf16 with "
         "bf16 parameters; parameters, copies, NCCL and the device optimizer there)")
      ->check(CLI::IsMember({"host", "cuda"}));
  zinf::AddEngineFlags(app, &f.engine);
  app.get_option("--nvme")->description(
      "NVMe swap folder (repeatable; default: the config's, or ./zinf-swap)");
  app.get_option("--optimizer-ratio")
      ->description(app.get_option("--optimizer-ratio")->get_description() + "; default 1");
  app.add_option("--device-budget", f.device_budget, "device memory budget, e.g. 4G");
  app.add_option("--pinned-budget", f.pinned_budget, "pinned host memory budget, e.g. 2G");
  app.add_flag("--fp32", f.fp32, "store parameters in fp32 (default bf16 with fp32 masters)");
  app.add_flag("--fp16", f.fp16,
               "store parameters in fp16 with fp32 masters and dynamic loss scaling (V100s: no "
               "bf16); the config's \"fp16\" block sets the scale's schedule; overflowing steps "
               "are skipped (the JSON line's skipped_steps, loss_scale)");
  app.add_flag("--durable", f.durable,
               "commit the NVMe swap store after every step, so that --resume continues from "
               "it after a crash without a checkpoint copy (needs optimizer states on NVMe, and "
               "parameters on NVMe with --delayed-update; up to twice the NVMe space)");
  app.add_option("--delayed-update-after", f.delayed_update_after,
                 "with --delayed-update: run the first N steps undelayed")
      ->check(CLI::Range(uint64_t{0}, uint64_t{100000000}));
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
  app.add_option("--nproc", f.nproc,
                 "run as N rank processes on this machine (ZeRO-3 across them over gloo, or "
                 "NCCL with --device cuda: GPU r for rank r); each rank takes --batch of the N x "
                 "--batch sequences of a micro-step. Under torchrun / mpirun leave it out: the "
                 "launcher's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT are used")
      ->check(CLI::Range(1, 1024));
  app.add_option("--log-every", f.log_every,
                 "keep a progress line every N steps (default: ~40 lines)")
      ->check(CLI::Range(1, 100000000));
  // --help prints and exits 0; a usage error (unknown flag, a value out of range) exits 2.
  if (int rc = zinf::ParseCommandLine(app, argc, argv); rc >= 0) return rc;
  if (f.nproc > 1) return zinf::LaunchRanks("zinf-train", argc, argv, f.nproc);
  return zinf::train::Run(f);
}
