// The acquire order of one training micro-step: recorded during the first one (or given by
// SetAcquireOrder), then checked against every later micro-step. Prefetch follows it and
// eviction picks the parameter whose next use is farthest along it. Pure; trainer thread only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/core/layout.h"

namespace zinf {

class AcquireTrace {
 public:
  enum class Mode {
    kRecord,    // the first micro-step: every training acquire is appended
    kComplete,  // a full micro-step's order: prefetch follows it
    kInvalid,   // a micro-step diverged from it (or an empty order was given): no prefetch
  };

  // The order given by the trainer (SetAcquireOrder): complete, or invalid when empty.
  void SetOrder(std::vector<ParamId> order);
  // A training acquire of `id`: recorded, or checked against the trace. Returns a warning
  // (non-empty) when this acquire invalidates the trace.
  std::string Check(ParamId id, const Layout& layout);
  // The micro-step ended: a recorded trace is complete; the cursor goes back to the start.
  void EndMicroStep();

  Mode mode() const { return mode_; }
  bool valid() const { return mode_ == Mode::kComplete; }
  // The acquires still expected in this micro-step, from the cursor on.
  size_t cursor() const { return pos_; }
  const std::vector<ParamId>& ids() const { return ids_; }
  // Elements acquired between the cursor and the next use of `id` (UINT64_MAX: none, or no
  // valid trace).
  uint64_t ReuseDistance(ParamId id, const Layout& layout) const;

 private:
  Mode mode_ = Mode::kRecord;
  std::vector<ParamId> ids_;
  size_t pos_ = 0;  // next expected position this micro-step
};

}  // namespace zinf
