// TextData: the training text zinf-train reads (any file, byte-level tokens) and the batches
// drawn from it. Batches depend only on (seed, index), not on what was drawn before, so a run
// resumed at step k draws the same batches as one that never stopped.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "zinf/status.h"

namespace zinf::train {

class TextData {
 public:
  // A regular file (a FIFO or a device is refused, never read), read into memory up to 1 GiB
  // and mapped beyond (address space, not memory); it must hold more than seq + 1 bytes.
  static Result<TextData> Load(const std::string& path, int seq);
  // Batch `index`: `batch` windows at offsets drawn from (seed, index); tokens[b*seq + t] =
  // text[off_b + t], targets the next byte.
  // REQUIRES: seq <= the seq given to Load; tokens and targets hold batch * seq values.
  void Batch(uint64_t seed, int64_t index, int batch, int seq, int32_t* tokens,
             int32_t* targets) const;
  size_t size() const { return size_; }

 private:
  std::shared_ptr<const unsigned char> text_;  // the mapping, unmapped by its deleter
  size_t size_ = 0;
};

}  // namespace zinf::train
