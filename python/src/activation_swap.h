// zinf._zinf.ActivationSwap: saved activations on NVMe (zinf.checkpoint with
// nvme_checkpointing). A pinned arena (the staging budget) and a swap store of its own in a
// folder the caller made: zinf.checkpoint writes each segment's boundary activations through
// it in forward and reads them back ahead of use in backward. Blocks of the arena reach torch
// as DLPack uint8 tensors; a block returns to the arena when torch frees the tensor.
// Thread-safe (the store and the arena are).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "zinf/swap.h"

namespace zinf::python {
namespace py = pybind11;

class ActivationSwap {
 public:
  ActivationSwap(const std::vector<std::string>& paths, uint64_t buffer_bytes,
                 const std::string& backend, uint32_t block_size, uint32_t queue_depth);
  ~ActivationSwap();
  // Closes the store (its swap files are removed); later calls are refused.
  void Close();

  // A block of at least `bytes` (rounded up to the alignment) as a capsule, or None when the
  // arena has no room now (the caller waits for a transfer and asks again).
  py::object Buffer(uint64_t bytes);
  Ticket Write(const std::string& key, uintptr_t ptr, uint64_t size, uint64_t capacity);
  Ticket Read(const std::string& key, uintptr_t ptr, uint64_t capacity, bool urgent);
  void Wait(Ticket ticket);
  bool Done(Ticket ticket);
  void Remove(const std::string& key);
  uint64_t alignment();
  uint64_t capacity() const { return arena_->capacity(); }
  uint64_t used() const { return arena_->used(); }
  uint64_t peak_used() const { return arena_->peak_used(); }
  py::dict Stats();

 private:
  void Open() const;

  std::shared_ptr<PinnedArena> arena_;
  std::unique_ptr<SwapStore> store_;
};

}  // namespace zinf::python
