#include "engine/state_window.h"

#include <string>
#include <utility>

#include "zinf/config.h"

namespace zinf {

StateWindow::StateWindow(const EngineContext& ctx, StateStore* states, BlockPool* pool,
                         const std::vector<size_t>* order, size_t buffers, Status* first)
    : ctx_(ctx),
      states_(states),
      pool_(pool),
      order_(order),
      buffers_(buffers),
      first_(first),
      device_params_(ctx.config->offload_param.tier == Tier::kDevice) {}

Status StateWindow::ReadAhead() {
  if (drained_) return Status::Internal("reading optimizer states ahead after the task ended");
  while (next_read_ < order_->size() && reading_.size() + retiring_.size() < buffers_) {
    const size_t gi = (*order_)[next_read_];
    if (!states_->on_nvme(gi)) {  // states not on NVMe: nothing to read ahead
      ++next_read_;
      continue;
    }
    Slot slot;
    ZINF_ASSIGN_OR_RETURN(slot.states, pool_->Take());
    ZINF_ASSIGN_OR_RETURN(slot.read, ctx_.swap->Read(states_->swap_key(gi), slot.states.data(),
                                                     slot.states.capacity()));
    reading_.push_back(std::move(slot));
    ++next_read_;
  }
  return Status::OK();
}

void StateWindow::MakeRoomForRead() {
  while (!retiring_.empty() && reading_.size() + retiring_.size() >= buffers_) RetireOldest();
}

void StateWindow::RetireBelow(size_t n) {
  while (!retiring_.empty() && retiring_.size() >= n) RetireOldest();
}

void StateWindow::RetireAll() {
  while (!retiring_.empty()) RetireOldest();
}

Result<PooledBlock> StateWindow::TakeRead(size_t gi) {
  Slot slot = std::move(reading_.front());
  reading_.pop_front();
  Status s = ctx_.swap->Wait(slot.read);
  if (!s.ok()) return s.WithContext("reading optimizer states of sub-group " + std::to_string(gi));
  return std::move(slot.states);
}

void StateWindow::Retire(Retiring done) {
  // Nothing to hold (fp32 parameters copied to the device straight from CPU-resident masters,
  // which only the optimizer thread rewrites, after the task's final sync): the copies run on
  // under the next sub-groups' steps instead of being waited for `buffers` later.
  if (!done.empty()) retiring_.push_back(std::move(done));
}

void StateWindow::SyncUpdates() {
  if (!device_params_) return;
  first_->Update(ctx_.device->SynchronizeStream(ctx_.streams.update)
                     .WithContext("copying updated parameters to the device"));
}

void StateWindow::RetireOldest() {
  // Device copies of the updated parameters read from the retiring buffers (and, for fp32
  // parameters with CPU states, from the states themselves): they finish before reuse.
  SyncUpdates();
  for (Ticket t : retiring_.front().writes) first_->Update(ctx_.swap->Wait(t));
  retiring_.pop_front();
}

void StateWindow::Drain() {
  if (drained_) return;
  drained_ = true;
  RetireAll();
  SyncUpdates();
  for (Slot& slot : reading_) {
    // Only waits so that the buffer is free; nobody uses the states of a sub-group never
    // reached, and the failure that stopped the task is the one reported.
    (void)ctx_.swap->Wait(slot.read);  // safe to drop: see above
  }
  reading_.clear();
}

}  // namespace zinf
