#include "engine/stats_recorder.h"

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

}  // namespace zinf
