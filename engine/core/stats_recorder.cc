#include "engine/core/stats_recorder.h"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <memory>

namespace zinf {

void StatsRecorder::AddH2D(uint64_t bytes) {
  MutexLock lock(&mu_);
  c_.h2d += bytes;
}
void StatsRecorder::AddD2H(uint64_t bytes) {
  MutexLock lock(&mu_);
  c_.d2h += bytes;
}
void StatsRecorder::AddCopyBusy(double seconds) {
  MutexLock lock(&mu_);
  c_.copy_busy += seconds;
}
void StatsRecorder::AddOptimizerBusy(double seconds) {
  MutexLock lock(&mu_);
  c_.optimizer_busy += seconds;
}
void StatsRecorder::AddAcquireWait(double seconds) {
  MutexLock lock(&mu_);
  c_.acquire_wait += seconds;
}
void StatsRecorder::AddOptimizerWait(double seconds) {
  MutexLock lock(&mu_);
  c_.optimizer_wait += seconds;
}
void StatsRecorder::CountAcquire(bool hit) {
  MutexLock lock(&mu_);
  (hit ? c_.hits : c_.misses) += 1;
}

void StatsRecorder::CountSpeculation(uint64_t speculated, uint64_t kept, uint64_t redone,
                                     uint64_t rolled_back, double redo_seconds) {
  MutexLock lock(&mu_);
  c_.speculated += speculated;
  c_.kept += kept;
  c_.redone += redone;
  c_.rolled_back += rolled_back;
  c_.redo_seconds += redo_seconds;
}

void StatsRecorder::CountLanding() {
  MutexLock lock(&mu_);
  ++c_.landing;
}

namespace {
double CpuSeconds(clockid_t clock) {
  timespec ts{};
  // (The process and calling-thread CPU clocks cannot fail on Linux; 0 if they did.)
  if (clock_gettime(clock, &ts) != 0) return 0;
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}
}  // namespace

StatsRecorder::Counters StatsRecorder::Take() {
  MutexLock lock(&mu_);
  Counters c = c_;
  c_ = Counters();
  return c;
}

Status StatsRecorder::TimeCopy(Device* device, Stream* stream,
                               const std::function<Status()>& issue) {
  using Clock = std::chrono::steady_clock;
  auto t0 = std::make_shared<Clock::time_point>();
  ZINF_RETURN_IF_ERROR(device->LaunchHostFunc(stream, [t0] { *t0 = Clock::now(); }));
  ZINF_RETURN_IF_ERROR(issue());
  return device->LaunchHostFunc(stream, [this, t0] {
    AddCopyBusy(std::chrono::duration<double>(Clock::now() - *t0).count());
  });
}

void StatsRecorder::FinishStep(const StepSources& sources, StepStats* st) {
  const auto now = std::chrono::steady_clock::now();
  st->step_seconds = std::chrono::duration<double>(now - step_start_).count();
  const Counters c = Take();
  st->h2d_bytes = c.h2d;
  st->d2h_bytes = c.d2h;
  st->copy_busy_seconds = c.copy_busy;
  st->optimizer_busy_seconds = c.optimizer_busy;
  st->acquire_wait_seconds = c.acquire_wait;
  st->optimizer_wait_seconds = sources.optimizer_wait + c.optimizer_wait;
  st->prefetch_hits = c.hits;
  st->prefetch_misses = c.misses;
  st->peak_device_bytes = sources.peak_device_bytes;
  if (sources.swap != nullptr) {
    const SwapStoreStats swap = sources.swap->stats();
    st->nvme_read_bytes = swap.bytes_read - swap_base_.bytes_read;
    st->nvme_write_bytes = swap.bytes_written - swap_base_.bytes_written;
    st->nvme_busy_seconds = swap.busy_seconds - swap_base_.busy_seconds;
    st->nvme_bytes = swap.file_bytes;
    swap_base_ = swap;
  }
  st->peak_pinned_bytes = sources.peak_pinned_bytes;
  st->speculated_groups = c.speculated;
  st->kept_groups = c.kept;
  st->redone_groups = c.redone;
  st->rolled_back_groups = c.rolled_back;
  st->speculation_redo_seconds = c.redo_seconds;
  st->landing_groups = c.landing;
  // (Step runs on the trainer's thread; so did the first FinishStep, at FinishRegistration.)
  const double process = CpuSeconds(CLOCK_PROCESS_CPUTIME_ID);
  const double trainer = CpuSeconds(CLOCK_THREAD_CPUTIME_ID);
  st->cpu_seconds_total = std::max(0.0, process - process_cpu_base_);
  st->cpu_seconds_trainer = std::max(0.0, trainer - trainer_cpu_base_);
  st->cpu_seconds_optimizer = std::max(0.0, sources.optimizer_cpu_seconds - optimizer_cpu_base_);
  process_cpu_base_ = process;
  trainer_cpu_base_ = trainer;
  optimizer_cpu_base_ = sources.optimizer_cpu_seconds;
  const double compute = st->step_seconds - st->acquire_wait_seconds - st->optimizer_wait_seconds;
  const double busiest = std::max({st->nvme_busy_seconds, st->copy_busy_seconds,
                                   st->optimizer_busy_seconds, std::max(compute, 0.0)});
  st->overlap_efficiency = st->step_seconds > 0 ? std::min(1.0, busiest / st->step_seconds) : 0;
  step_start_ = std::chrono::steady_clock::now();
}

}  // namespace zinf
