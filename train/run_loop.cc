// zinf-train's training loop and report (train/run.h).
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "train/checkpoint.h"
#include "train/run.h"
#include "zinf/log.h"

namespace zinf::train {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

uint64_t PeakRssBytes() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<uint64_t>(ru.ru_maxrss) * 1024;
}

struct StepRow {
  int64_t step = 0;
  double loss = 0, seconds = 0, tokens_per_s = 0, tflops = 0;
  double read_gbps = 0, write_gbps = 0, overlap = 0, stall = 0;
};

// What the training loop measured, for the report.
struct TrainLog {
  std::vector<StepRow> rows;
  double loss_first = 0, loss_last = 0;
  uint64_t read_bytes = 0, write_bytes = 0;
  uint64_t speculated = 0, kept = 0, redone = 0;  // speculative sub-group steps
  double loss_scale = 1;                          // fp16: the scale after the last step
  uint64_t skipped_steps = 0;                     // fp16: steps skipped for overflow so far
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
        rank_(s.rank),
        world_(s.world),
        comm_(s.comm),
        device_(s.device),
        first_step_(first_step),
        accum_(std::max(1, plan.config.gradient_accumulation_steps)),
        tokens_per_micro_(f.batch * f.seq),
        flops_per_token_(FlopsPerToken(plan.model, f.seq)),
        log_every_(f.log_every > 0 ? f.log_every : std::max(1, f.steps / 40)),
        warmup_(f.warmup >= 0 ? f.warmup : std::min(100, f.steps / 10)),
        tty_(isatty(fileno(out))),
        state_bytes_per_param_(StateBytesPerParam(plan.config)),
        tokens_(tokens_per_micro_),
        targets_(tokens_per_micro_),
        global_tokens_(world_ > 1 ? tokens_per_micro_ * world_ : 0),
        global_targets_(global_tokens_.size()),
        window_tokens_(plan.config.layer_major ? tokens_.size() * accum_ : 0),
        window_targets_(window_tokens_.size()) {}

  ~TrainingLoop() {
    // The loss buffer's collectives ran on the compute stream and were waited for.
    if (loss_buf_ != nullptr) device_->Free(loss_buf_);
  }
  TrainingLoop(const TrainingLoop&) = delete;
  TrainingLoop& operator=(const TrainingLoop&) = delete;

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
    // Linear warmup, then the base rate (Adam's first steps on a fresh model are large). Steps
    // skipped for an fp16 overflow do not count, as DeepSpeed's scheduler does not step on one.
    const double sched = static_cast<double>(step - static_cast<int64_t>(engine_->skipped_steps()));
    const double lr_scale = warmup_ > 0 ? std::min(1.0, (sched + 1.0) / warmup_) : 1.0;
    if (Status s =
            engine_->SetLearningRate(static_cast<float>(plan_.config.optimizer.lr * lr_scale));
        !s.ok()) {
      return Fail("setting the learning rate", s);
    }
    // zinf.schedule layer-major: the window's micro-batches gathered, then one Window.
    const bool layer_major = plan_.config.layer_major;
    std::vector<double> losses;
    for (int micro = 0; micro < accum_; ++micro) {
      FillBatch(step * accum_ + micro);
      if (layer_major) {
        const size_t at = static_cast<size_t>(micro) * tokens_per_micro_;
        std::copy(tokens_.begin(), tokens_.end(), window_tokens_.begin() + at);
        std::copy(targets_.begin(), targets_.end(), window_targets_.begin() + at);
        continue;
      }
      StepStats st;
      // Gradients averaged over the ranks and the accumulation window.
      Result<double> l =
          trainer_->MicroStep(tokens_.data(), targets_.data(), 1.0f / (accum_ * world_), &st);
      if (!l.ok()) return Fail("step " + std::to_string(step + 1), l.status());
      losses.push_back(*l);
      AddStats(st, agg);
    }
    if (layer_major) {
      StepStats st;
      Result<std::vector<double>> l = trainer_->Window(
          window_tokens_.data(), window_targets_.data(), 1.0f / (accum_ * world_), &st);
      if (!l.ok()) return Fail("step " + std::to_string(step + 1), l.status());
      losses = std::move(l).value();
      AddStats(st, agg);
    }
    for (double micro_loss : losses) {
      if (world_ > 1) {
        Result<double> mean = MeanOverRanks(micro_loss);
        if (!mean.ok()) return Fail("step " + std::to_string(step + 1), mean.status());
        micro_loss = *mean;
      }
      *loss += micro_loss / accum_;
    }
    return 0;
  }

  // Micro-batch `micro` of the run into tokens_ and targets_ (with several ranks, this rank's
  // rows of the global micro-batch).
  void FillBatch(int64_t micro) {
    if (world_ == 1) {
      plan_.data.Batch(f_.seed, micro, f_.batch, f_.seq, tokens_.data(), targets_.data());
      return;
    }
    // The ranks split one global micro-batch of world x --batch sequences, the one a single
    // rank with --batch world x B draws: rank r takes rows [r B, (r + 1) B).
    plan_.data.Batch(f_.seed, micro, f_.batch * world_, f_.seq, global_tokens_.data(),
                     global_targets_.data());
    const size_t begin = static_cast<size_t>(rank_) * tokens_per_micro_;
    std::copy_n(global_tokens_.begin() + begin, tokens_per_micro_, tokens_.begin());
    std::copy_n(global_targets_.begin() + begin, tokens_per_micro_, targets_.begin());
  }

  // A Step's figures into the optimizer step's: NVMe traffic and waits summed, the overlap of
  // the last (the optimizer's).
  static void AddStats(const StepStats& st, StepStats* agg) {
    agg->nvme_read_bytes += st.nvme_read_bytes;
    agg->nvme_write_bytes += st.nvme_write_bytes;
    agg->acquire_wait_seconds += st.acquire_wait_seconds;
    agg->optimizer_wait_seconds += st.optimizer_wait_seconds;
    agg->overlap_efficiency = st.overlap_efficiency;
    agg->speculated_groups += st.speculated_groups;
    agg->kept_groups += st.kept_groups;
    agg->redone_groups += st.redone_groups;
    agg->loss_scale = st.loss_scale;  // (after the step's last micro-step)
    agg->skipped_steps = st.skipped_steps;
  }

  // The mean of the ranks' losses (each its own rows' mean), so that every rank reports the
  // global batch's loss: the double carried as two floats (high part and remainder) through
  // the communicator, staged in a small device buffer (a GPU's NCCL reads device memory).
  Result<double> MeanOverRanks(double local) {
    Stream* s = device_->ComputeStream();
    if (loss_buf_ == nullptr) {
      ZINF_ASSIGN_OR_RETURN(loss_buf_, device_->Alloc(2 * sizeof(float)));
    }
    float parts[2];
    parts[0] = static_cast<float>(local);
    parts[1] = static_cast<float>(local - parts[0]);
    ZINF_RETURN_IF_ERROR(device_->CopyHostToDevice(loss_buf_, parts, sizeof(parts), s));
    ZINF_RETURN_IF_ERROR(comm_->AllReduceSum(static_cast<float*>(loss_buf_), 2, s));
    ZINF_RETURN_IF_ERROR(device_->CopyDeviceToHost(parts, loss_buf_, sizeof(parts), s));
    ZINF_RETURN_IF_ERROR(device_->SynchronizeStream(s));
    return (static_cast<double>(parts[0]) + parts[1]) / world_;
  }

  // fp16: "  scale S skipped N" for the progress line ("" otherwise).
  std::string Fp16Note(const StepStats& agg) const {
    if (!plan_.config.fp16.enabled) return "";
    char note[64];
    std::snprintf(note, sizeof(note), "  scale %g skipped %llu", agg.loss_scale,
                  static_cast<unsigned long long>(agg.skipped_steps));
    return note;
  }

  // Adds the step to the log and prints its progress line: kept every --log-every steps and
  // at the first and last; on a terminal the others are shown in place.
  void Record(int64_t step, double loss, const StepStats& agg, double secs, TrainLog* log) {
    StepRow r;
    r.step = step + 1;
    r.loss = loss;
    r.seconds = secs;
    r.tokens_per_s = static_cast<double>(tokens_per_micro_) * accum_ * world_ / secs;  // group
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
    log->speculated += agg.speculated_groups;
    log->kept += agg.kept_groups;
    log->redone += agg.redone_groups;
    log->loss_scale = agg.loss_scale;
    log->skipped_steps = agg.skipped_steps;
    log->total_seconds += secs;
    const bool keep = (step + 1) % log_every_ == 0 || step == first_step_ || step + 1 == f_.steps;
    if (keep || tty_) {
      std::fprintf(out,
                   "%sstep %5" PRId64
                   "/%d  loss %.4f  %8.0f tok/s  %.3f TFLOPS  nvme r %.2f w %.2f "
                   "GB/s  overlap %.2f  stall %.2f s  state %.2f B/param%s%s",
                   tty_ ? "\r" : "", r.step, f_.steps, r.loss, r.tokens_per_s, r.tflops,
                   r.read_gbps, r.write_gbps, r.overlap, r.stall, state_bytes_per_param_,
                   Fp16Note(agg).c_str(), keep ? "\n" : "");
      std::fflush(out);
    }
  }

  const Flags& f_;
  const RunPlan& plan_;
  Engine* const engine_;
  GptTrainer* const trainer_;
  const int rank_;
  const int world_;
  Communicator* const comm_;
  Device* const device_;
  const int64_t first_step_;
  const int accum_;  // micro-steps per optimizer step
  const int tokens_per_micro_;
  const double flops_per_token_;
  const int log_every_;
  const int warmup_;                       // steps of linear learning-rate warmup
  const bool tty_;                         // progress on a terminal
  const double state_bytes_per_param_;     // master + states as stored
  std::vector<int32_t> tokens_, targets_;  // one micro-step's batch
  // With several ranks: the global micro-batch the ranks split.
  std::vector<int32_t> global_tokens_, global_targets_;
  // zinf.schedule layer-major: the window's micro-batches, one after the other.
  std::vector<int32_t> window_tokens_, window_targets_;
  void* loss_buf_ = nullptr;  // device memory for MeanOverRanks (freed with the loop)
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
           const TrainLog& log, int world) {
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
      {"gradient_clipping", plan.config.gradient_clipping},
      // Sub-group steps taken before the norm was known, and of those kept or redone.
      {"speculated_groups", log.speculated},
      {"kept_groups", log.kept},
      {"redone_groups", log.redone},
      {"param_tier", TierName(plan.config.offload_param.tier)},
      {"optimizer_tier", TierName(plan.config.offload_optimizer.tier)},
      {"optimizer_state_dtype", StateTypeName(plan.config.optimizer_state_type)},
      {"state_bytes_per_param", StateBytesPerParam(plan.config)},
      {"param_dtype", StoredParamName(plan.config)},
      {"zero_stage", plan.config.zero_stage},
      {"grad_accum", std::max(1, plan.config.gradient_accumulation_steps)},
      {"schedule", plan.config.layer_major ? "layer-major" : "micro-batch"},
      // The block inputs and gradients a layer-major window keeps (0: micro-batch).
      {"window_activation_bytes",
       plan.config.layer_major
           ? GptTrainer::WindowBytes(plan.model, f.batch, f.seq,
                                     std::max(1, plan.config.gradient_accumulation_steps))
           : 0},
      // fp16: the loss scale after the last step and the steps skipped for overflow.
      {"loss_scale", log.loss_scale},
      {"skipped_steps", log.skipped_steps},
      {"ranks", world},
  };
  nlohmann::json losses = nlohmann::json::array();
  for (const StepRow& r : rows) losses.push_back(r.loss);
  j["losses"] = losses;  // per step (the ranks' mean with several)
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace

int TrainAndReport(const Flags& f, const RunPlan& plan, const Session& s, int64_t first_step) {
  TrainLog log;
  if (int rc = TrainingLoop(f, plan, s, first_step).Run(&log); rc != 0) return rc;
  if (int rc = SaveFinalCheckpoint(f, plan, s.engine.get(), first_step); rc != 0) return rc;
  return Report(f, plan, s.trainer.get(), first_step, log, s.world);
}

}  // namespace zinf::train
