// The rule that makes engine memory safe to hand to a framework as tensors: Engine::Release
// is issued only once the framework holds no view of the parameter's memory. Each tensor made
// over a parameter is a view until the framework frees it (DLPack's deleter, on any thread);
// the framework's "done with this acquisition" is owed as a pending release and becomes due
// when the parameter's views reach zero. The ledger only counts; the caller issues the
// Releases that TakeDue returns, outside any lock.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "common/thread_annotations.h"
#include "zinf/engine_types.h"
#include "zinf/status.h"

namespace zinf {

class ViewLedger {
 public:
  // Parameters [0, n) exist (registration grows it; ids never shrink).
  void Resize(size_t n) EXCLUDES(mu_);
  // A tensor over `id` was handed out / freed. Freeing more views than were handed out is a
  // bug in the caller (FailedPrecondition; the count is left unchanged).
  Status AddView(ParamId id) EXCLUDES(mu_);
  Status DropView(ParamId id) EXCLUDES(mu_);
  // One release of each id is owed; all or nothing (an unknown id owes nothing).
  Status OweRelease(const std::vector<ParamId>& ids) EXCLUDES(mu_);
  // The releases now due (owed, no views left), each id as many times as it is owed, in id
  // order; they are no longer owed.
  std::vector<ParamId> TakeDue() EXCLUDES(mu_);
  // {id: count} of parameters with views / with releases owed.
  std::map<ParamId, int64_t> Views() const EXCLUDES(mu_);
  std::map<ParamId, int64_t> Owed() const EXCLUDES(mu_);

 private:
  Status CheckId(ParamId id, const char* what) const REQUIRES(mu_);

  mutable Mutex mu_;
  std::vector<int64_t> views_ GUARDED_BY(mu_);
  std::vector<int64_t> owed_ GUARDED_BY(mu_);
};

}  // namespace zinf
