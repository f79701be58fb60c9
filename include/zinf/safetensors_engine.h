// Hugging Face safetensors checkpoints and the Engine (the zinf::interop library): loading a
// checkpoint (zinf/safetensors.h) into an Engine's parameters, and exporting an Engine's
// parameters as sharded files with an index.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "zinf/engine.h"
#include "zinf/safetensors.h"
#include "zinf/status.h"

namespace zinf::safetensors {

// Loads tensors into engine parameters: `mapping` pairs each parameter with the name of its
// tensor in the checkpoint. Everything is checked before any value changes: every name present,
// a float dtype, the same number of elements and the same shape (a shape that only differs by
// dimensions of size 1, or an exact match of the element count when `allow_reshape`, is
// accepted); the first problem is the error (InvalidArgument naming the tensor, the parameter
// and both shapes). Then Engine::SetParameterValues reads each tensor once, so host memory
// stays within the largest tensor plus one sub-group's states. Collective like
// SetParameterValues (every rank passes the same arguments).
Status LoadIntoEngine(Engine* engine, const Checkpoint& ckpt,
                      const std::vector<std::pair<ParamId, std::string>>& mapping,
                      bool allow_reshape = false);

// Exports parameters: each mapped parameter's gathered fp32 master (Engine::
// GatherMasterParameter, collective), as F32 or BF16 (round to nearest even), under its name,
// in the order given. Files are cut at `shard_bytes` of data (a tensor larger than that gets a
// file of its own): one file is written as "model.safetensors"; several as
// "model-00001-of-0000K.safetensors"... with "model.safetensors.index.json". Each file is
// written to a temporary name (created exclusively, 0600, never through a symbolic link),
// fsync'ed and renamed; the index comes last. Every header's "__metadata__" holds `metadata`
// and "zinf_export": "1". A folder that already holds a safetensors checkpoint zinf did not
// write is refused (FailedPrecondition); an earlier zinf export is replaced: its index (or
// single file) is removed before the first new file is written, so a failure part-way leaves
// no index over mixed files, and its shards that the new export does not overwrite are
// removed at the end. Only rank 0 writes (the others gather with it; with several ranks a
// write failure is reported by rank 0's call only). Host memory: one tensor at a time.
// `extra`: tensors in host memory written after the parameters, as they are (their own
// dtype, little-endian bytes): a model's buffers (BatchNorm's running statistics, counters).
struct HostTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;  // numel x DTypeSize(dtype) bytes, valid during the call
};
Status SaveFromEngine(Engine* engine, const std::vector<std::pair<ParamId, std::string>>& mapping,
                      const std::string& dir, uint64_t shard_bytes, DType dtype,
                      const std::map<std::string, std::string>& metadata = {},
                      const std::vector<HostTensor>& extra = {});

}  // namespace zinf::safetensors
