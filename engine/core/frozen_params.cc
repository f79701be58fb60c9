#include "engine/core/frozen_params.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "engine/core/host_memory.h"
#include "formats/checkpoint_format.h"
#include "zinf/log.h"

namespace zinf {

Status FrozenParams::InitGroup(size_t gi, const ParamStore::Resume& resume,
                               const std::vector<uint64_t>& committed,
                               const std::vector<std::function<void(float*, size_t)>>& inits,
                               std::vector<uint64_t>* initial_hashes) {
  const Layout& layout = *ctx_.layout;
  const int rank = ctx_.comm->rank();
  const int world = ctx_.comm->world_size();
  std::vector<float> full;
  for (ParamId id : layout.group(gi).params) {
    const ParamLayout& p = layout.param(id);
    const uint64_t want = resume.active && id < committed.size() ? committed[id] : 0;
    if (want != 0 && store_->HoldsCommitted(id, resume)) {
      // The store holds the committed copy (NVMe parameters): the run goes on with it, as
      // with every other committed value (a trainer that loads the base after registering,
      // as from safetensors, registers other values than the ones committed).
      store_->set_value_hash(id, want);
      ZINF_RETURN_IF_ERROR(store_->Init(id, PinnedBuffer(), resume));
      continue;
    }
    full.assign(p.padded_numel, 0.0f);
    inits[id](full.data(), p.info.numel);
    const uint64_t hash = ValueHash(full.data(), p.info.numel);
    if (want != 0 && want != hash) {
      return Status::FailedPrecondition(
          "ResumeFromStore: the frozen parameter '" + p.info.name +
          "' is registered with other values than the run that wrote the store had (value "
          "hash " +
          HashHex(hash) + ", the store's " + HashHex(want) +
          "); register it with the same values (the same base weights) to resume");
    }
    store_->set_value_hash(id, hash);
    if (world > 1 && !resume.active) {
      initial_hashes->resize(layout.num_params(), 0);
      (*initial_hashes)[id] = hash;
    }
    ZINF_ASSIGN_OR_RETURN(PinnedBuffer image, ctx_.arena->Allocate(layout.PartBytes(id)));
    ZINF_RETURN_IF_ERROR(
        Encode(id, full.data() + static_cast<size_t>(rank) * p.info.partition_numel, image.data()));
    ZINF_RETURN_IF_ERROR(store_->Init(id, std::move(image), resume));
  }
  return Status::OK();
}

Status FrozenParams::ReadPartition(ParamId id, float* out) {
  const Layout& layout = *ctx_.layout;
  const ParamLayout& p = layout.param(id);
  const size_t part = p.info.partition_numel;
  const ParamCopyType type = StoredParamType(*ctx_.config);
  AlignedBuffer stored(RoundUp(layout.PartBytes(id), 4096));
  if (stored.data == nullptr) {
    return Status::ResourceExhausted("gathering '" + p.info.name + "': a buffer of " +
                                     FormatBytes(layout.PartBytes(id)));
  }
  ZINF_RETURN_IF_ERROR(store_->ReadFrozen(id, stored.data, stored.bytes)
                           .WithContext("reading the frozen parameter '" + p.info.name + "'"));
  if (layout.StoredInt8(id) && type == ParamCopyType::kNone) {
    DequantizeWeightsInt8(stored.data, part, out);
  } else if (layout.StoredInt8(id)) {  // as the fetch decodes it: into bf16 or fp16
    std::vector<uint16_t> b(part);
    if (type == ParamCopyType::kBf16) {
      DequantizeWeightsInt8Bf16(stored.data, part, b.data());
    } else {
      DequantizeWeightsInt8F16(stored.data, part, b.data());
    }
    for (size_t i = 0; i < part; ++i) out[i] = ParamCopyToFp32(type, b[i]);
  } else if (type != ParamCopyType::kNone) {
    const uint16_t* b = static_cast<const uint16_t*>(stored.data);
    for (size_t i = 0; i < part; ++i) out[i] = ParamCopyToFp32(type, b[i]);
  } else {
    std::memcpy(out, stored.data, part * sizeof(float));
  }
  return Status::OK();
}

Status FrozenParams::Set(ParamId id, const std::function<Status(ParamId, float*)>& fill,
                         bool* wrote) {
  const Layout& layout = *ctx_.layout;
  const ParamLayout& p = layout.param(id);
  std::vector<float> full(p.padded_numel, 0.0f);
  ZINF_RETURN_IF_ERROR(fill(id, full.data()).WithContext("values of '" + p.info.name + "'"));
  AlignedBuffer image(RoundUp(layout.PartBytes(id), 4096));
  if (image.data == nullptr) {
    return Status::ResourceExhausted("values of '" + p.info.name + "': a buffer of " +
                                     FormatBytes(layout.PartBytes(id)));
  }
  const size_t rank = static_cast<size_t>(ctx_.comm->rank());
  ZINF_RETURN_IF_ERROR(Encode(id, full.data() + rank * p.info.partition_numel, image.data));
  *wrote = true;  // from here on the store may hold part of the new values
  ZINF_RETURN_IF_ERROR(store_->WriteFrozen(id, image.data, image.bytes));
  store_->set_value_hash(id, ValueHash(full.data(), p.info.numel));
  return Status::OK();
}

uint64_t FrozenParams::ValueHash(const float* full, size_t n) const {
  const ParamCopyType type = StoredParamType(*ctx_.config);
  if (type == ParamCopyType::kNone) return XXH3_64bits(full, n * sizeof(float));
  // bf16 or fp16 storage: the values as stored, so that values exported from the store (rounded
  // already) and registered again hash the same.
  XXH3_state_t* state = XXH3_createState();
  if (state == nullptr || XXH3_64bits_reset(state) != XXH_OK) {
    XXH3_freeState(state);
    return 0;  // (no frozen hash: nothing is compared)
  }
  float chunk[1024];
  for (size_t at = 0; at < n; at += 1024) {
    const size_t len = std::min<size_t>(1024, n - at);
    for (size_t i = 0; i < len; ++i)
      chunk[i] = ParamCopyToFp32(type, Fp32ToParamCopy(type, full[at + i]));
    XXH3_64bits_update(state, chunk, len * sizeof(float));
  }
  const uint64_t h = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return h;
}

Status FrozenParams::Encode(ParamId id, const float* part, void* out) {
  const ParamLayout& p = ctx_.layout->param(id);
  if (ctx_.layout->StoredInt8(id)) {
    return QuantizeWeightsInt8(part, p.info.partition_numel, out)
        .WithContext("storing the frozen parameter '" + p.info.name + "' as int8");
  }
  if (StoredParamType(*ctx_.config) != ParamCopyType::kNone) {
    return optimizer_->ConvertParams(part, out, StoredParamType(*ctx_.config),
                                     p.info.partition_numel);
  }
  std::memcpy(out, part, ctx_.layout->PartBytes(id));
  return Status::OK();
}

}  // namespace zinf
