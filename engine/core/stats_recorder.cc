#include "engine/core/stats_recorder.h"

#include <algorithm>
#include <chrono>
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
  const double compute = st->step_seconds - st->acquire_wait_seconds - st->optimizer_wait_seconds;
  const double busiest = std::max({st->nvme_busy_seconds, st->copy_busy_seconds,
                                   st->optimizer_busy_seconds, std::max(compute, 0.0)});
  st->overlap_efficiency = st->step_seconds > 0 ? std::min(1.0, busiest / st->step_seconds) : 0;
  step_start_ = std::chrono::steady_clock::now();
}

}  // namespace zinf
