#include "engine/core/param_store.h"

#include <cstring>

namespace zinf {

ParamStore::ParamStore(const EngineContext& ctx)
    : ctx_(ctx),
      delayed_(ctx.config->delayed_update),
      homes_(ctx.layout->num_params()),
      hashes_(ctx.layout->num_params(), 0) {}

ParamStore::~ParamStore() {
  for (ParamId id = 0; id < homes_.size(); ++id) {
    for (void* part : homes_[id].device_part) {
      if (part != nullptr) ctx_.budget->Free(part, ctx_.layout->PartBytes(id));
    }
  }
}

void ParamStore::DeviceSlots(std::vector<DeviceSlot>* out) {
  for (ParamId id = 0; id < homes_.size(); ++id) {
    for (void*& part : homes_[id].device_part) {
      if (part == nullptr) continue;
      void** slot = &part;
      out->push_back({ctx_.layout->PartBytes(id), true,
                      "parameter '" + ctx_.layout->param(id).info.name + "'",
                      [slot] { return *slot; }, [slot](void* p) { *slot = p; }});
    }
  }
}

Status ParamStore::Init(ParamId id, PinnedBuffer image, const Resume& resume) {
  Home& h = homes_[id];
  const ParamLayout& p = ctx_.layout->param(id);
  const size_t bytes = ctx_.layout->PartBytes(id);
  // Version 0 goes to buffer 0. The delayed update's second buffer is written by the first
  // optimizer step (or a checkpoint load) before anything reads it; the in-memory tiers get a
  // copy anyway so that it never holds garbage.
  const int buffers = delayed_ && p.info.trainable ? 2 : 1;
  switch (ctx_.config->offload_param.tier) {
    case Tier::kDevice: {
      for (int b = 0; b < buffers; ++b) {
        ZINF_ASSIGN_OR_RETURN(h.device_part[b],
                              ctx_.budget->Alloc(bytes, "parameter '" + p.info.name + "'"));
        ctx_.budget->Plan(bytes);
        ZINF_RETURN_IF_ERROR(ctx_.device->CopyHostToDevice(h.device_part[b], image.data(), bytes,
                                                           ctx_.streams.copy));
      }
      return ctx_.device->SynchronizeStream(ctx_.streams.copy);
    }
    case Tier::kCpu:
      if (buffers == 2) {
        ZINF_ASSIGN_OR_RETURN(h.host_part[1], ctx_.arena->Allocate(bytes));
        std::memcpy(h.host_part[1].data(), image.data(), bytes);
      }
      h.host_part[0] = std::move(image);
      return Status::OK();
    case Tier::kNvme: {
      h.swap_key[0] = "param/" + p.info.name;
      if (buffers == 2) h.swap_key[1] = "param/" + p.info.name + "#1";
      if (resume.active && resume.stored_params) {
        // The committed parameter stores were written from these masters in this dtype (the
        // layout check compared the dtype); a size mismatch means another model. With the
        // delayed update the next micro-step reads the version before them.
        bool stored = true;
        for (int64_t v : {resume.step, resume.visible}) {
          Result<uint64_t> size = ctx_.swap->Size(h.swap_key[B(id, Buf(v))]);
          stored = stored && size.ok() && *size == bytes;
        }
        if (stored) return Status::OK();
      }
      if (resume.active && resume.visible != resume.step && p.info.trainable) {
        return Status::FailedPrecondition(
            "ResumeFromStore: the store lacks parameter '" + p.info.name + "' at step " +
            std::to_string(resume.visible) + ", which the delayed update reads next");
      }
      // Version 0, or at a resume the masters' version.
      const std::string& key = h.swap_key[B(id, Buf(resume.active ? resume.step : 0))];
      ZINF_ASSIGN_OR_RETURN(Ticket t, ctx_.swap->Write(key, image.data(), bytes, image.capacity()));
      return ctx_.swap->Wait(t);
    }
  }
  return Status::Internal("unknown parameter tier");
}

bool ParamStore::HoldsCommitted(ParamId id, const Resume& resume) const {
  if (ctx_.config->offload_param.tier != Tier::kNvme || !resume.active || !resume.stored_params) {
    return false;
  }
  Result<uint64_t> size = ctx_.swap->Size("param/" + ctx_.layout->param(id).info.name);
  return size.ok() && *size == ctx_.layout->PartBytes(id);
}

Status ParamStore::ReadFrozen(ParamId id, void* out, size_t capacity) {
  const Home& h = homes_[id];
  const size_t bytes = ctx_.layout->PartBytes(id);
  switch (ctx_.config->offload_param.tier) {
    case Tier::kDevice:
      ZINF_RETURN_IF_ERROR(
          ctx_.device->CopyDeviceToHost(out, h.device_part[0], bytes, ctx_.streams.update));
      return ctx_.device->SynchronizeStream(ctx_.streams.update);
    case Tier::kCpu:
      std::memcpy(out, h.host_part[0].data(), bytes);
      return Status::OK();
    case Tier::kNvme: {
      ZINF_ASSIGN_OR_RETURN(Ticket t, ctx_.swap->Read(h.swap_key[0], out, capacity));
      return ctx_.swap->Wait(t);
    }
  }
  return Status::Internal("unknown parameter tier");
}

Status ParamStore::WriteFrozen(ParamId id, const void* src, size_t capacity) {
  Home& h = homes_[id];
  const size_t bytes = ctx_.layout->PartBytes(id);
  switch (ctx_.config->offload_param.tier) {
    case Tier::kDevice:
      ZINF_RETURN_IF_ERROR(
          ctx_.device->CopyHostToDevice(h.device_part[0], src, bytes, ctx_.streams.update));
      return ctx_.device->SynchronizeStream(ctx_.streams.update);
    case Tier::kCpu:
      std::memcpy(h.host_part[0].data(), src, bytes);
      return Status::OK();
    case Tier::kNvme: {
      ZINF_ASSIGN_OR_RETURN(Ticket t, ctx_.swap->Write(h.swap_key[0], src, bytes, capacity));
      return ctx_.swap->Wait(t);
    }
  }
  return Status::Internal("unknown parameter tier");
}

Status ParamStore::WritePiece(ParamId id, const void* src, size_t begin, size_t end, int buf) {
  const ParamLayout& p = ctx_.layout->param(id);
  if (ctx_.config->offload_param.tier != Tier::kDevice || begin > end ||
      end > p.info.partition_numel || ctx_.layout->StoredInt8(id)) {
    return Status::Internal("parameter '" + p.info.name + "': a piece [" + std::to_string(begin) +
                            ", " + std::to_string(end) +
                            ") written outside a device store of its partition");
  }
  const size_t elem = ctx_.layout->elem_size();
  const size_t bytes = (end - begin) * elem;
  Status s = ctx_.stats->TimeCopy(ctx_.device, ctx_.streams.update, [&] {
    return ctx_.device->CopyHostToDevice(
        static_cast<char*>(homes_[id].device_part[B(id, buf)]) + begin * elem,
        static_cast<const char*>(src) + begin * elem, bytes, ctx_.streams.update);
  });
  ctx_.stats->AddH2D(bytes);
  return s;
}

Status ParamStore::WriteGroup(size_t gi, const float* master, const uint16_t* copy_out, int buf,
                              std::vector<Ticket>* writes, const std::vector<uint8_t>* written) {
  Status first;
  for (ParamId id : ctx_.layout->group(gi).params) {
    const ParamLayout& p = ctx_.layout->param(id);
    if (written != nullptr && (*written)[p.index_in_group]) continue;
    Home& h = homes_[id];
    const void* src = copy_out != nullptr ? static_cast<const void*>(copy_out + p.slice_offset)
                                          : static_cast<const void*>(master + p.slice_offset);
    const size_t bytes = ctx_.layout->PartBytes(id);
    switch (ctx_.config->offload_param.tier) {
      case Tier::kDevice:
        first = ctx_.stats->TimeCopy(ctx_.device, ctx_.streams.update, [&] {
          return ctx_.device->CopyHostToDevice(h.device_part[buf], src, bytes, ctx_.streams.update);
        });
        ctx_.stats->AddH2D(bytes);
        break;
      case Tier::kCpu:
        std::memcpy(h.host_part[buf].data(), src, bytes);
        break;
      case Tier::kNvme: {
        // Slices are 4 KiB aligned and padded inside the sub-group buffer.
        Result<Ticket> t = ctx_.swap->Write(h.swap_key[buf], src, bytes, RoundUp(bytes, 4096));
        if (t.ok()) writes->push_back(*t);
        first = t.status();
        break;
      }
    }
    if (!first.ok()) break;
  }
  // Device tier: the copies run on the update stream while the optimizer steps the next
  // sub-groups; the optimizer synchronizes it before a source buffer is reused and at the
  // step's end. Without `writes` the caller frees the sources on return: the copies issued
  // must be done first, an error or not.
  if (ctx_.config->offload_param.tier == Tier::kDevice && writes == nullptr) {
    Status synced = ctx_.device->SynchronizeStream(ctx_.streams.update);
    if (first.ok()) first = synced;
  }
  return first;
}

}  // namespace zinf
