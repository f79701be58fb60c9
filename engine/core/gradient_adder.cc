#include "engine/core/gradient_adder.h"

namespace zinf {

GradientAdder::GradientAdder() : thread_([this] { Main(); }) {}

GradientAdder::~GradientAdder() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  cv_.NotifyAll();
  thread_.join();
}

void GradientAdder::Push(std::function<void()> job) {
  {
    MutexLock lock(&mu_);
    jobs_.push_back(std::move(job));
    ++pushed_;
  }
  cv_.NotifyAll();
}

void GradientAdder::Drain() {
  MutexLock lock(&mu_);
  const uint64_t target = pushed_;
  while (done_ < target) cv_.Wait(&mu_);
}

void GradientAdder::Main() {
  for (;;) {
    std::function<void()> job;
    {
      MutexLock lock(&mu_);
      while (!stopping_ && jobs_.empty()) cv_.Wait(&mu_);
      if (jobs_.empty()) return;  // stopping, and every job has run
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
    job = nullptr;  // what it captured (the staging block) goes back before it counts as done
    {
      MutexLock lock(&mu_);
      ++done_;
    }
    cv_.NotifyAll();
  }
}

}  // namespace zinf
