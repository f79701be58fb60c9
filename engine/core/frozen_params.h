// Frozen parameters' values (ParamInfo::trainable false): data, not state. Each lives in its
// parameter store alone, in the storage dtype (fp32, bf16, or int8 with zinf.frozen_weight_dtype),
// and what checkpoints and commits record of it is a hash of the whole value as stored.
// Used by the trainer's thread only, between steps (registration, SetParameterValues,
// GatherMasterParameter).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "engine/core/engine_context.h"
#include "engine/core/param_store.h"
#include "zinf/cpu_adam.h"
#include "zinf/status.h"

namespace zinf {

class FrozenParams {
 public:
  // Values go to `store`'s homes; bf16 conversions through `optimizer`'s kernels.
  FrozenParams(const EngineContext& ctx, ParamStore* store, CpuOptimizer* optimizer)
      : ctx_(ctx), store_(store), optimizer_(optimizer) {}

  // The frozen sub-group `gi` at FinishRegistration: each parameter's value from its init
  // (`inits[id]`, also at a resume: the store never rewrites them) hashed and stored. At a
  // resume (`resume.active`) the hash must equal the commit's (`committed`, per parameter; 0:
  // unknown), and a store that holds the committed copy keeps it. With several ranks and no
  // resume, each hash also goes to `initial_hashes` (sized to the parameters) for the ranks'
  // comparison.
  Status InitGroup(size_t gi, const ParamStore::Resume& resume,
                   const std::vector<uint64_t>& committed,
                   const std::vector<std::function<void(float*, size_t)>>& inits,
                   std::vector<uint64_t>* initial_hashes);

  // This rank's partition of `id` as fp32 (partition_numel values into `out`), decoded from
  // its store as a fetch decodes it (int8 through bf16 when the parameters are bf16).
  Status ReadPartition(ParamId id, float* out);

  // Replaces the value of `id` with what `fill` writes (the whole padded value) and records
  // its hash. *wrote: whether its store was written to (then a failure may leave part of the
  // new values there).
  Status Set(ParamId id, const std::function<Status(ParamId, float*)>& fill, bool* wrote);

 private:
  // xxh3-64 of `n` fp32 values as the storage dtype holds them (bf16-rounded with bf16
  // storage; int8 storage is a cut of those per rank, not hashed); 0 if none could be taken.
  uint64_t ValueHash(const float* full, size_t n) const;
  // This rank's partition (fp32) of `id` in its store's form (Layout::PartBytes).
  Status Encode(ParamId id, const float* part, void* out);

  const EngineContext ctx_;
  ParamStore* const store_;
  CpuOptimizer* const optimizer_;
};

}  // namespace zinf
