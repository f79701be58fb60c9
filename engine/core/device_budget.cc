#include "engine/core/device_budget.h"

#include <algorithm>

#include "zinf/log.h"

namespace zinf {

DeviceBudget::~DeviceBudget() {
  Status s = Collect(/*wait=*/true);
  if (!s.ok()) LogWarning("closing the engine: " + s.ToString());
}

Result<void*> DeviceBudget::Alloc(size_t bytes, const std::string& what) {
  Status collected = Collect(/*wait=*/false);
  if (!collected.ok()) return collected.WithContext("allocating device memory for " + what);
  for (;;) {
    bool over = false;
    {
      MutexLock lock(&mu_);
      over = budget_ != 0 && allocated_ + bytes > budget_;
      if (!over) {
        allocated_ += bytes;
        peak_ = std::max(peak_, allocated_);
      }
    }
    Status waited;
    if (over) {
      // Room the deferred frees will make: wait for the oldest, then look again.
      if (CollectOne(/*wait=*/true, &waited) && waited.ok()) continue;
      if (!waited.ok()) return waited.WithContext("allocating device memory for " + what);
      MutexLock lock(&mu_);
      return Status::ResourceExhausted("device budget exhausted allocating " + FormatBytes(bytes) +
                                       " for " + what + " (budget " + FormatBytes(budget_) +
                                       ", in use " + FormatBytes(allocated_) +
                                       "); raise zinf.device_budget_bytes")
          .WithKey("zinf.device_budget_bytes");
    }
    Result<void*> p = device_->Alloc(bytes);
    if (p.ok()) return p;
    {
      MutexLock lock(&mu_);
      allocated_ -= bytes;
    }
    // The device itself is full (its own budget, or fragmentation): a deferred free may help.
    if (p.status().code() == StatusCode::kResourceExhausted && CollectOne(/*wait=*/true, &waited) &&
        waited.ok()) {
      continue;
    }
    if (!waited.ok()) return waited.WithContext("allocating device memory for " + what);
    return p.status().WithContext("allocating device memory for " + what);
  }
}

Status DeviceBudget::FreeAfter(void* ptr, size_t bytes, Stream* stream) {
  std::unique_ptr<Event> event;
  {
    MutexLock lock(&mu_);
    if (!spare_events_.empty()) {
      event = std::move(spare_events_.back());
      spare_events_.pop_back();
    }
  }
  if (!event) {
    ZINF_ASSIGN_OR_RETURN(event, device_->CreateEvent());
  }
  ZINF_RETURN_IF_ERROR(device_->RecordEvent(event.get(), stream));
  MutexLock lock(&mu_);
  deferred_.push_back(Deferred{ptr, bytes, std::move(event)});
  return Status::OK();
}

bool DeviceBudget::CollectOne(bool wait, Status* error) {
  Deferred d;
  {
    MutexLock lock(&mu_);
    if (deferred_.empty()) return false;
    auto it = deferred_.begin();  // waiting: the oldest
    if (!wait) {
      // Any whose point has passed (a gather-stream free may pass before an older compute one).
      it = std::find_if(deferred_.begin(), deferred_.end(),
                        [this](const Deferred& x) { return device_->EventDone(x.done.get()); });
      if (it == deferred_.end()) return false;
    }
    d = std::move(*it);
    deferred_.erase(it);
  }
  // (Not waiting: EventDone said it passed, and a passed event's wait returns at once.)
  Status s = device_->SynchronizeEvent(d.done.get());
  if (!s.ok()) {
    // Nothing is known to be done with the buffer: it stays allocated (counted) for good.
    if (error->ok()) {
      *error = s.WithContext("waiting to free " + FormatBytes(d.bytes) + " of device memory");
    }
    return true;
  }
  Free(d.ptr, d.bytes);
  MutexLock lock(&mu_);
  spare_events_.push_back(std::move(d.done));
  return true;
}

Status DeviceBudget::Collect(bool wait) {
  Status error;  // the first failure; the others are collected (or kept) all the same
  while (CollectOne(wait, &error)) {
  }
  return error;
}

void DeviceBudget::Free(void* ptr, size_t bytes) {
  device_->Free(ptr);
  MutexLock lock(&mu_);
  allocated_ -= bytes;
}

uint64_t DeviceBudget::TakePeak() {
  MutexLock lock(&mu_);
  const uint64_t peak = peak_;
  peak_ = allocated_;
  return peak;
}

Status DeviceBudget::ReclaimScratch() {
  for (Stream* s : scratch_streams_) ZINF_RETURN_IF_ERROR(device_->SynchronizeStream(s));
  for (uint64_t b : scratch_) planned_ -= b;
  scratch_.clear();
  return Status::OK();
}

}  // namespace zinf
