// The engine's device memory: what is allocated (changed on stream callbacks and the
// optimizer thread, under its own lock) and what the trainer's program order has planned.
//
// Decisions that issue collectives (fetch, prefetch, evict) look only at the planned bytes,
// never at the allocated ones, which frees on stream threads change at times that differ
// between ranks; so every rank takes the same decisions.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/thread_annotations.h"
#include "zinf/device.h"

namespace zinf {

// A device buffer a component holds for the engine's life, which offload_states moves to
// host memory (`keep`: its contents matter) or frees (they are rewritten before they are read
// again), and reload_states allocates again: its size, and how to read and replace the
// component's pointer.
struct DeviceSlot {
  size_t bytes = 0;
  bool keep = true;
  std::string what;
  std::function<void*()> get;
  std::function<void(void*)> set;
};

class DeviceBudget {
 public:
  // `budget`: zinf.device_budget_bytes (0: no engine-side limit). The streams are those whose
  // work may still use gradient scratch (see ReclaimScratch).
  DeviceBudget(Device* device, uint64_t budget, std::vector<Stream*> scratch_streams)
      : device_(device), budget_(budget), scratch_streams_(std::move(scratch_streams)) {}

  // Frees what FreeAfter deferred (waiting for it: closing, after every stream).
  ~DeviceBudget();
  DeviceBudget(const DeviceBudget&) = delete;
  DeviceBudget& operator=(const DeviceBudget&) = delete;

  // Any thread. When the budget or the device has no room, Alloc first waits for the buffers
  // FreeAfter deferred (the oldest first) until it fits.
  Result<void*> Alloc(size_t bytes, const std::string& what) EXCLUDES(mu_);
  void Free(void* ptr, size_t bytes) EXCLUDES(mu_);
  // Gives `ptr` back once the work queued on `stream` so far has run, without waiting for it
  // now: an event marks the point, and the buffer is freed by a later Alloc or Collect that
  // finds it passed (or needs the room and waits for it). On failure to mark it, nothing is
  // freed (nothing is known to be done with the buffer) and the error is returned.
  Status FreeAfter(void* ptr, size_t bytes, Stream* stream) EXCLUDES(mu_);
  // Frees the deferred buffers whose point has passed; with `wait`, waits for every one. A
  // failed wait keeps that buffer allocated for good (nothing is known to be done with it);
  // the others are still collected, and the first failure is returned.
  Status Collect(bool wait) EXCLUDES(mu_);
  // The peak allocated since the last call; the next period starts at what is allocated now.
  uint64_t TakePeak() EXCLUDES(mu_);

  // Trainer thread only: the plan.
  uint64_t budget() const { return budget_; }
  uint64_t planned() const { return planned_; }
  void Plan(uint64_t bytes) { planned_ += bytes; }
  void Unplan(uint64_t bytes) { planned_ -= bytes; }
  // Whether `bytes` more fit the budget as planned.
  bool Fits(uint64_t bytes) const { return budget_ == 0 || planned_ + bytes <= budget_; }
  // Gradient scratch planned and in flight on the streams; freed by their callbacks.
  void PlanScratch(uint64_t bytes) {
    planned_ += bytes;
    scratch_.push_back(bytes);
  }
  bool has_scratch() const { return !scratch_.empty(); }
  // Waits for the gradient reductions in flight; their scratch is free afterwards.
  Status ReclaimScratch();

 private:
  Device* const device_;
  const uint64_t budget_;
  const std::vector<Stream*> scratch_streams_;
  struct Deferred {
    void* ptr = nullptr;
    size_t bytes = 0;
    std::unique_ptr<Event> done;
  };
  // Takes one deferred buffer off the list and frees it: the oldest, waiting for its point
  // (`wait`), or any whose point has passed. A failed wait keeps it allocated and sets *error
  // (when not set yet). False when there was none to take.
  bool CollectOne(bool wait, Status* error) EXCLUDES(mu_);

  Mutex mu_;
  std::deque<Deferred> deferred_ GUARDED_BY(mu_);  // oldest first
  std::vector<std::unique_ptr<Event>> spare_events_ GUARDED_BY(mu_);
  uint64_t allocated_ GUARDED_BY(mu_) = 0;
  uint64_t peak_ GUARDED_BY(mu_) = 0;
  uint64_t planned_ = 0;           // trainer thread only
  std::vector<uint64_t> scratch_;  // trainer thread only
};

}  // namespace zinf
