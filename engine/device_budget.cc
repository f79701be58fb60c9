#include "engine/device_budget.h"

#include <algorithm>

#include "zinf/log.h"

namespace zinf {

Result<void*> DeviceBudget::Alloc(size_t bytes, const std::string& what) {
  {
    MutexLock lock(&mu_);
    if (budget_ != 0 && allocated_ + bytes > budget_) {
      return Status::ResourceExhausted("device budget exhausted allocating " + FormatBytes(bytes) +
                                       " for " + what + " (budget " + FormatBytes(budget_) +
                                       ", in use " + FormatBytes(allocated_) +
                                       "); raise zinf.device_budget_bytes");
    }
    allocated_ += bytes;
    peak_ = std::max(peak_, allocated_);
  }
  Result<void*> p = device_->Alloc(bytes);
  if (!p.ok()) {
    MutexLock lock(&mu_);
    allocated_ -= bytes;
    return p.status().WithContext("allocating device memory for " + what);
  }
  return p;
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
