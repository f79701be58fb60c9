// Counters of the current step (bytes copied, busy and wait times, prefetch hits), added to
// by the trainer thread, stream callbacks and the optimizer thread; taken by Step().
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>

#include "common/thread_annotations.h"
#include "zinf/device.h"
#include "zinf/engine_types.h"
#include "zinf/swap.h"

namespace zinf {

class StatsRecorder {
 public:
  struct Counters {
    uint64_t h2d = 0, d2h = 0;
    double copy_busy = 0, optimizer_busy = 0, acquire_wait = 0, optimizer_wait = 0;
    uint64_t hits = 0, misses = 0;
    uint64_t speculated = 0, kept = 0, redone = 0, rolled_back = 0;
    double redo_seconds = 0;
    uint64_t landing = 0;
  };

  void AddH2D(uint64_t bytes) EXCLUDES(mu_);
  void AddD2H(uint64_t bytes) EXCLUDES(mu_);
  void AddCopyBusy(double seconds) EXCLUDES(mu_);
  void AddOptimizerBusy(double seconds) EXCLUDES(mu_);
  void AddAcquireWait(double seconds) EXCLUDES(mu_);
  void AddOptimizerWait(double seconds) EXCLUDES(mu_);
  void CountAcquire(bool hit) EXCLUDES(mu_);
  // Speculative steps: sub-groups speculated, kept, redone, rolled back; redo seconds.
  void CountSpeculation(uint64_t speculated, uint64_t kept, uint64_t redone, uint64_t rolled_back,
                        double redo_seconds) EXCLUDES(mu_);
  // A sub-group stepped as its last gradient landed (StepStats::landing_groups).
  void CountLanding() EXCLUDES(mu_);
  // The counters so far; they start again from zero.
  Counters Take() EXCLUDES(mu_);

  // Issues `issue` on `stream` between two host functions that add the time between them to
  // the copy busy time. The first failure (a launch or the issue) is returned.
  Status TimeCopy(Device* device, Stream* stream, const std::function<Status()>& issue);

  // The statistics of the micro-step that ends now (Step): the counters taken, the step's
  // wall time since the last one ended, the optimizer wait Step itself measured, the device's
  // and the arena's peaks, and the swap store's traffic since the last one (`swap` may be
  // null); the overlap efficiency from them. `st` has the step's own fields set (step,
  // optimizer_ran, grad_norm, trace_valid). Trainer thread.
  struct StepSources {
    double optimizer_wait = 0;       // Step's own wait for the optimizer
    uint64_t peak_device_bytes = 0;  // since the last step
    uint64_t peak_pinned_bytes = 0;
    const SwapStore* swap = nullptr;
    double optimizer_cpu_seconds = 0;  // CpuOptimizer::cpu_seconds() now (0: no optimizer)
  };
  void FinishStep(const StepSources& sources, StepStats* st) EXCLUDES(mu_);

 private:
  Mutex mu_;
  Counters c_ GUARDED_BY(mu_);
  // Trainer thread only (FinishStep).
  std::chrono::steady_clock::time_point step_start_ = std::chrono::steady_clock::now();
  SwapStoreStats swap_base_;
  double process_cpu_base_ = 0, trainer_cpu_base_ = 0, optimizer_cpu_base_ = 0;
};

}  // namespace zinf
