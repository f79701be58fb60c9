// Parameter values written aside while a model is built (zinf.Init): an unlinked file in a
// folder on disk holding fp32 values, read back when the engine initialises its stores. The
// page cache holds the values, not the process, so a model larger than memory can be built.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <string_view>

#include "common/thread_annotations.h"
#include "zinf/status.h"

namespace zinf {

// The element types a framework hands over as initial parameter values.
enum class HostValueType { kF32, kBf16, kF16 };

// "float32", "bfloat16" or "float16" (torch's names); InvalidArgument naming the others.
Result<HostValueType> ParseHostValueType(std::string_view name);
size_t HostValueSize(HostValueType type);
// Converts n values at src to fp32 (exact: every bf16 and fp16 value is an fp32 value).
void HostValuesToF32(const void* src, HostValueType type, float* dst, size_t n);

class SpillFile {
 public:
  // An unlinked file in `dir` (O_TMPFILE; a named file unlinked at once where the file system
  // has no O_TMPFILE). The error names the folder.
  static Result<std::unique_ptr<SpillFile>> Create(const std::string& dir);
  ~SpillFile();
  SpillFile(const SpillFile&) = delete;
  SpillFile& operator=(const SpillFile&) = delete;

  // Appends n values of `type` at src as fp32; returns their offset. On failure nothing is
  // appended (a later Append reuses the offset). Thread-safe.
  Result<uint64_t> Append(const void* src, HostValueType type, size_t n) EXCLUDES(mu_);
  // Reads n fp32 values at `offset` (an offset Append returned); Corruption past the end,
  // FailedPrecondition for values given up (Release). Thread-safe (pread).
  Status Read(uint64_t offset, float* out, size_t n) const EXCLUDES(mu_);
  // The n values at `offset` were handed over for good (the engine holds them now): their disk
  // blocks go back (a hole is punched), so that the spill shrinks while the engine's stores
  // grow and the disk holds the larger of the two, not their sum. A later Read of them is
  // refused. A file system that cannot punch holes keeps the blocks (OK: only space).
  void Release(uint64_t offset, size_t n) EXCLUDES(mu_);
  uint64_t bytes() const EXCLUDES(mu_);
  const std::string& dir() const { return dir_; }

 private:
  SpillFile(std::string dir, int fd) : dir_(std::move(dir)), fd_(fd) {}
  Status WriteAll(const void* buf, size_t n, uint64_t offset);

  const std::string dir_;
  const int fd_;
  mutable Mutex mu_;
  uint64_t size_ GUARDED_BY(mu_) = 0;            // appends are serialised: each owns [offset, end)
  std::set<uint64_t> released_ GUARDED_BY(mu_);  // offsets given up (Release)
};

}  // namespace zinf
