#include "engine/core/group_board.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "zinf/log.h"

namespace zinf {

using Clock = std::chrono::steady_clock;

GroupBoard::GroupBoard(const Layout* layout) : layout_(layout) {
  MutexLock lock(&mu_);
  groups_.resize(layout->num_groups());
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    groups_[gi].has_grad.assign(layout->group(gi).params.size(), 0);
  }
}

void GroupBoard::BeginMicroStep(bool boundary, int64_t step) {
  MutexLock lock(&mu_);
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    // Frozen parameters never hand in a gradient: a sub-group of only those is complete at once.
    groups_[gi].pending = layout_->group(gi).trainable;
    groups_[gi].partial = -1;
    if (boundary && groups_[gi].pending == 0) groups_[gi].ready_step = step + 1;
  }
}

void GroupBoard::Push(const OptimizerTask& task) {
  MutexLock lock(&mu_);
  tasks_.push_back(task);
  cv_.NotifyAll();
}

void GroupBoard::MarkHasGrad(size_t gi, size_t index) {
  MutexLock lock(&mu_);
  groups_[gi].has_grad[index] = 1;
}

Status GroupBoard::WaitStepped(size_t gi, int64_t step, double* waited) {
  const auto t0 = Clock::now();
  MutexLock lock(&mu_);
  if (groups_[gi].stepped_step >= step) return Status::OK();
  while (!stopping_ && groups_[gi].stepped_step < step) cv_.Wait(&mu_);
  *waited = std::chrono::duration<double>(Clock::now() - t0).count();
  if (stopping_) return Status::FailedPrecondition("engine shutting down");
  return Status::OK();
}

Status GroupBoard::WaitDone(int64_t target) {
  MutexLock lock(&mu_);
  while (!stopping_ && done_step_ < target) cv_.Wait(&mu_);
  if (!optimizer_status_.ok()) return optimizer_status_;
  if (done_step_ < target) return Status::FailedPrecondition("engine shutting down");
  return Status::OK();
}

void GroupBoard::SetClipCoef(int64_t step, float coef) {
  MutexLock lock(&mu_);
  clip_coefs_[step] = coef;
  cv_.NotifyAll();
}

void GroupBoard::SetNormFailed(int64_t step) {
  SetClipCoef(step, std::numeric_limits<float>::quiet_NaN());
}

void GroupBoard::SetSkipped(int64_t step) {
  MutexLock lock(&mu_);
  skipped_.insert(step);
  clip_coefs_[step] = 1.0f;
  cv_.NotifyAll();
}

bool GroupBoard::NormFailed(int64_t step) const {
  MutexLock lock(&mu_);
  auto it = clip_coefs_.find(step);
  return it != clip_coefs_.end() && std::isnan(it->second);
}

namespace {
Status NormFailedError(int64_t step) {
  return Status::FailedPrecondition("the gradient norm of step " + std::to_string(step) +
                                    " could not be had (see the error of that Step): the optimizer "
                                    "stepped nothing of it");
}
}  // namespace

void GroupBoard::ResetTo(int64_t step) {
  MutexLock lock(&mu_);
  done_step_ = step;
  for (Group& g : groups_) g.ready_step = g.stepped_step = step;
  clip_coefs_.clear();  // (verdicts of steps that never finished: those steps will run again)
  skipped_.clear();
}

Status GroupBoard::Stop(int64_t drain_to) {
  Status unseen;
  {
    MutexLock lock(&mu_);
    if (drain_to >= 0) {
      while (done_step_ < drain_to) cv_.Wait(&mu_);
      unseen = optimizer_status_;
    }
    stopping_ = true;
  }
  cv_.NotifyAll();
  return unseen;
}

void GroupBoard::Land(size_t gi, int64_t ready) {
  if (ready == kNotLast) return;
  MutexLock lock(&mu_);
  Group& g = groups_[gi];
  if (--g.pending == 0 && ready > 0) {
    g.ready_step = ready;
    g.partial = -1;
    cv_.NotifyAll();
  }
}

void GroupBoard::LandPiece(size_t gi, size_t index, size_t landed, int64_t ready) {
  MutexLock lock(&mu_);
  Group& g = groups_[gi];
  // Only the group's last gradient: the others (landed or not) must be whole for the step.
  if (ready <= 0 || g.pending != 1) return;
  g.partial = static_cast<int>(index);
  g.partial_landed = landed;
  g.partial_step = ready;
  cv_.NotifyAll();
}

Status GroupBoard::WaitLanded(size_t gi, int64_t step, size_t upto) {
  MutexLock lock(&mu_);
  Group& g = groups_[gi];
  while (!stopping_ && g.ready_step < step &&
         !(g.partial >= 0 && g.partial_step == step && g.partial_landed >= upto)) {
    cv_.Wait(&mu_);
  }
  if (stopping_) return Status::FailedPrecondition("engine shutting down");
  return Status::OK();
}

void GroupBoard::NoteGradRelease() {
  MutexLock lock(&mu_);
  ++grad_releases_;
  cv_.NotifyAll();
}

Status GroupBoard::WaitForGradBlock(const std::function<bool()>& try_take,
                                    const std::function<std::string(size_t)>& unreduced,
                                    uint64_t block_bytes, std::chrono::seconds no_progress) {
  MutexLock lock(&mu_);
  uint64_t seen = grad_releases_;
  auto deadline = Clock::now() + no_progress;
  for (;;) {
    if (try_take()) return Status::OK();
    if (stopping_) return Status::FailedPrecondition("engine shutting down");
    if (!optimizer_status_.ok()) {
      return optimizer_status_.WithContext(
          "no gradient accumulators are freed after an optimizer failure");
    }
    if (tasks_.empty()) {
      return Status::Internal("every gradient block is taken with no optimizer step to free one");
    }
    // Blocks are freed only by stepping sub-groups, in order. When the optimizer waits for a
    // sub-group with a parameter the trainer has not reduced yet in this micro-step (it comes
    // after this gradient in program order, or lands only at Step), no block will come.
    // Gradients already reduced but still landing do not count: they complete the sub-group.
    std::string missing;
    if (waiting_group_ != SIZE_MAX && groups_[waiting_group_].ready_step < waiting_step_) {
      missing = unreduced(waiting_group_);
    }
    if (!missing.empty()) {
      return Status::ResourceExhausted(
                 "every streaming gradient block (" + FormatBytes(block_bytes) +
                 " each) is taken by sub-groups the optimizer reaches only after sub-group " +
                 std::to_string(waiting_group_) + ", which still waits for the gradient of '" +
                 missing +
                 "'; the optimizer steps sub-groups in reverse registration order. Raise "
                 "zinf.pinned_budget_bytes (more blocks), lower sub_group_size, or register "
                 "parameters so that their gradients come in reverse registration order")
          .WithKey("zinf.pinned_budget_bytes");
    }
    if (!cv_.WaitUntil(&mu_, deadline)) {
      if (grad_releases_ == seen) {
        return Status::ResourceExhausted(
                   "waited " + std::to_string(no_progress.count()) +
                   " s for the optimizer to free gradient accumulators (every block of " +
                   FormatBytes(block_bytes) +
                   " is taken); is the backward order far from the registration order? raise "
                   "zinf.pinned_budget_bytes or lower sub_group_size")
            .WithKey("zinf.pinned_budget_bytes");
      }
      seen = grad_releases_;
      deadline = Clock::now() + no_progress;
    }
  }
}

bool GroupBoard::NextTask(OptimizerTask* task) {
  MutexLock lock(&mu_);
  while (!stopping_ && tasks_.empty()) cv_.Wait(&mu_);
  if (tasks_.empty()) return false;
  *task = tasks_.front();
  return true;
}

bool GroupBoard::failed() const {
  MutexLock lock(&mu_);
  return !optimizer_status_.ok();
}

Result<GroupBoard::GroupReady> GroupBoard::WaitGroupReady(size_t gi, const OptimizerTask& task,
                                                          bool speculate, bool allow_partial) {
  MutexLock lock(&mu_);
  Group& g = groups_[gi];
  waiting_group_ = gi;
  waiting_step_ = task.step;
  cv_.NotifyAll();  // a trainer waiting for a gradient block re-checks for a deadlock
  // (Landing in pieces: only without clipping, where nothing else is waited for.)
  auto landing = [&] {
    return allow_partial && !task.needs_norm && g.ready_step < task.step && g.partial >= 0 &&
           g.partial_step == task.step && g.partial_landed > 0;
  };
  while (!stopping_ && !landing() &&
         !(g.ready_step >= task.step &&
           (speculate || !task.needs_norm || clip_coefs_.count(task.step) != 0))) {
    cv_.Wait(&mu_);
  }
  waiting_group_ = SIZE_MAX;
  if (stopping_) return Status::FailedPrecondition("engine shutting down");
  GroupReady ready;
  ready.partial = landing() ? g.partial : -1;
  ready.coef_known = !task.needs_norm || clip_coefs_.count(task.step) != 0;
  ready.coef = task.needs_norm && ready.coef_known ? clip_coefs_[task.step] : 1.0f;
  if (std::isnan(ready.coef)) return NormFailedError(task.step);
  ready.with_grad.swap(g.has_grad);
  g.has_grad.assign(layout_->group(gi).params.size(), 0);
  // A skipped step: no parameter is stepped (the flags are taken all the same).
  if (ready.coef_known && skipped_.count(task.step) != 0) {
    ready.with_grad.assign(ready.with_grad.size(), 0);
  }
  return ready;
}

Status GroupBoard::Verdict(const OptimizerTask& task, bool wait, float* coef, bool* known,
                           bool* skipped) {
  MutexLock lock(&mu_);
  while (wait && !stopping_ && clip_coefs_.count(task.step) == 0) cv_.Wait(&mu_);
  auto it = clip_coefs_.find(task.step);
  *known = it != clip_coefs_.end();
  if (!*known) {
    return wait ? Status::FailedPrecondition("engine shutting down") : Status::OK();
  }
  *coef = it->second;
  *skipped = skipped_.count(task.step) != 0;
  return std::isnan(*coef) ? NormFailedError(task.step) : Status::OK();
}

void GroupBoard::MarkStepped(size_t gi, int64_t step) {
  MutexLock lock(&mu_);
  groups_[gi].stepped_step = step;
  cv_.NotifyAll();
}

void GroupBoard::FinishTask(int64_t step, const Status& s) {
  MutexLock lock(&mu_);
  tasks_.pop_front();
  if (!s.ok() && optimizer_status_.ok()) optimizer_status_ = s;
  done_step_ = step;
  // Sub-groups a failed task did not reach: their accumulators are not needed any more.
  for (Group& g : groups_) g.stepped_step = std::max(g.stepped_step, step);
  clip_coefs_.erase(clip_coefs_.begin(), clip_coefs_.upper_bound(step));
  skipped_.erase(skipped_.begin(), skipped_.upper_bound(step));
  cv_.NotifyAll();
}

}  // namespace zinf
