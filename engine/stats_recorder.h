// Counters of the current step (bytes copied, busy and wait times, prefetch hits), added to
// by the trainer thread, stream callbacks and the optimizer thread; taken by Step().
#pragma once

#include <cstdint>
#include <functional>

#include "common/thread_annotations.h"
#include "zinf/device.h"

namespace zinf {

class StatsRecorder {
 public:
  struct Counters {
    uint64_t h2d = 0, d2h = 0;
    double copy_busy = 0, optimizer_busy = 0, acquire_wait = 0, optimizer_wait = 0;
    uint64_t hits = 0, misses = 0;
  };

  void AddH2D(uint64_t bytes) EXCLUDES(mu_);
  void AddD2H(uint64_t bytes) EXCLUDES(mu_);
  void AddCopyBusy(double seconds) EXCLUDES(mu_);
  void AddOptimizerBusy(double seconds) EXCLUDES(mu_);
  void AddAcquireWait(double seconds) EXCLUDES(mu_);
  void AddOptimizerWait(double seconds) EXCLUDES(mu_);
  void CountAcquire(bool hit) EXCLUDES(mu_);
  // The counters so far; they start again from zero.
  Counters Take() EXCLUDES(mu_);

  // Issues `issue` on `stream` between two host functions that add the time between them to
  // the copy busy time. The first failure (a launch or the issue) is returned.
  Status TimeCopy(Device* device, Stream* stream, const std::function<Status()>& issue);

 private:
  Mutex mu_;
  Counters c_ GUARDED_BY(mu_);
};

}  // namespace zinf
