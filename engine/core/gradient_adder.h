// The thread that adds a later micro-step's gradient onto its accumulator and lands it. The
// gradient stream's host function only hands the job over (it never runs the loop): CUDA may
// run every stream's host functions on one thread, and a loop over a large partition there
// would hold up every other stream's callbacks. Jobs run in the order pushed. Its own
// component, below the gradient path (which pushes) and the fetch scheduler (which drains it
// when it needs the pinned staging the jobs hold). Thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>

#include "common/thread_annotations.h"

namespace zinf {

class GradientAdder {
 public:
  GradientAdder();
  ~GradientAdder();  // runs the jobs still queued, then joins
  GradientAdder(const GradientAdder&) = delete;
  GradientAdder& operator=(const GradientAdder&) = delete;
  void Push(std::function<void()> job) EXCLUDES(mu_);
  // Waits until every job pushed so far has run (and released what it captured).
  void Drain() EXCLUDES(mu_);

 private:
  void Main() EXCLUDES(mu_);
  Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> jobs_ GUARDED_BY(mu_);
  uint64_t pushed_ GUARDED_BY(mu_) = 0;
  uint64_t done_ GUARDED_BY(mu_) = 0;
  bool stopping_ GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: started once the rest is initialised
};

}  // namespace zinf
