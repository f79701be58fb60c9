#include "interop/view_ledger.h"

#include <string>

namespace zinf {

void ViewLedger::Resize(size_t n) {
  MutexLock lock(&mu_);
  if (n > views_.size()) {
    views_.resize(n, 0);
    owed_.resize(n, 0);
  }
}

Status ViewLedger::CheckId(ParamId id, const char* what) const {
  if (id >= views_.size()) {
    return Status::InvalidArgument(std::string(what) + ": unknown parameter id " +
                                   std::to_string(id));
  }
  return Status::OK();
}

Status ViewLedger::AddView(ParamId id) {
  MutexLock lock(&mu_);
  Status s = CheckId(id, "a view");
  if (!s.ok()) return s;
  ++views_[id];
  return Status::OK();
}

Status ViewLedger::DropView(ParamId id) {
  MutexLock lock(&mu_);
  Status s = CheckId(id, "freeing a view");
  if (!s.ok()) return s;
  if (views_[id] == 0) {
    return Status::FailedPrecondition("freeing a view of parameter " + std::to_string(id) +
                                      " that has none");
  }
  --views_[id];
  return Status::OK();
}

Status ViewLedger::OweRelease(const std::vector<ParamId>& ids) {
  MutexLock lock(&mu_);
  for (ParamId id : ids) {
    Status s = CheckId(id, "release");
    if (!s.ok()) return s;
  }
  for (ParamId id : ids) ++owed_[id];
  return Status::OK();
}

std::vector<ParamId> ViewLedger::TakeDue() {
  std::vector<ParamId> due;
  MutexLock lock(&mu_);
  for (ParamId id = 0; id < owed_.size(); ++id) {
    if (owed_[id] == 0 || views_[id] != 0) continue;
    due.insert(due.end(), static_cast<size_t>(owed_[id]), id);
    owed_[id] = 0;
  }
  return due;
}

std::map<ParamId, int64_t> ViewLedger::Views() const {
  std::map<ParamId, int64_t> out;
  MutexLock lock(&mu_);
  for (ParamId id = 0; id < views_.size(); ++id) {
    if (views_[id] != 0) out[id] = views_[id];
  }
  return out;
}

std::map<ParamId, int64_t> ViewLedger::Owed() const {
  std::map<ParamId, int64_t> out;
  MutexLock lock(&mu_);
  for (ParamId id = 0; id < owed_.size(); ++id) {
    if (owed_[id] != 0) out[id] = owed_[id];
  }
  return out;
}

}  // namespace zinf
