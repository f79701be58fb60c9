// The NVMe state buffers of one optimizer task. Reads run ahead of the step by up to
// `buffers - 1` sub-groups; a stepped sub-group's buffers (its states, its bf16 parameter
// copy) are held until their write-backs, and the device copies of updated parameters that
// read them, have finished, which is waited for only when a buffer is needed again.
#pragma once

#include <cstddef>
#include <deque>
#include <vector>

#include "engine/core/engine_context.h"
#include "engine/core/host_memory.h"
#include "engine/core/state_store.h"
#include "zinf/swap.h"

namespace zinf {

class StateWindow {
 public:
  // A stepped sub-group's buffers and the writes that read them.
  struct Retiring {
    PooledBlock states, copy;
    std::vector<Ticket> writes;
    bool empty() const {
      return states.data() == nullptr && copy.data() == nullptr && writes.empty();
    }
  };
  // `order`: the sub-groups in the order they are stepped. Failures of the writes and copies
  // waited for go to `*first` (the task's first failure).
  StateWindow(const EngineContext& ctx, StateStore* states, BlockPool* pool,
              const std::vector<size_t>* order, size_t buffers, Status* first);
  ~StateWindow() { Drain(); }
  StateWindow(const StateWindow&) = delete;
  StateWindow& operator=(const StateWindow&) = delete;

  size_t buffers() const { return buffers_; }
  // Issues the reads of the next sub-groups (in order) whose states are on NVMe while
  // buffers are free. A sub-group whose states are elsewhere takes no buffer.
  Status ReadAhead();
  // Retires write-backs until a buffer is free for the next read.
  void MakeRoomForRead();
  // Retires write-backs until fewer than `n` are in flight.
  void RetireBelow(size_t n);
  void RetireAll();
  // The states of sub-group gi, the oldest read issued: waits for the read. Its failure
  // (the block is given back) says which sub-group.
  Result<PooledBlock> TakeRead(size_t gi);
  // Holds `done`'s buffers until its writes complete (nothing to hold: dropped).
  void Retire(Retiring done);
  // Waits for the device copies of updated parameters (parameters on the device).
  void SyncUpdates();
  // However the task ends, no copy or I/O may still use the buffers it frees: write-backs
  // and device copies finish, reads issued for sub-groups never reached complete. Once: a
  // second call (the destructor's) does nothing; the window takes no more reads after it.
  void Drain();

 private:
  void RetireOldest();

  const EngineContext& ctx_;
  StateStore* const states_;
  BlockPool* const pool_;
  const std::vector<size_t>* const order_;
  const size_t buffers_;
  Status* const first_;
  const bool device_params_;
  struct Slot {
    PooledBlock states;
    Ticket read = 0;
  };
  std::deque<Slot> reading_;       // reads issued, oldest first
  size_t next_read_ = 0;           // index in order_ of the next sub-group to read
  std::deque<Retiring> retiring_;  // write-backs in flight, oldest first
  bool drained_ = false;
};

}  // namespace zinf
