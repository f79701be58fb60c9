#include "engine/core/param_store.h"

#include <cstring>

namespace zinf {

ParamStore::ParamStore(const EngineContext& ctx)
    : layout_(ctx.layout),
      config_(ctx.config),
      device_(ctx.device),
      budget_(ctx.budget),
      stats_(ctx.stats),
      copy_stream_(ctx.streams.copy),
      update_stream_(ctx.streams.update),
      arena_(ctx.arena),
      swap_(ctx.swap),
      delayed_(ctx.config->delayed_update),
      homes_(ctx.layout->num_params()),
      hashes_(ctx.layout->num_params(), 0) {}

ParamStore::~ParamStore() {
  for (ParamId id = 0; id < homes_.size(); ++id) {
    for (void* part : homes_[id].device_part) {
      if (part != nullptr) budget_->Free(part, layout_->PartBytes(id));
    }
  }
}

Status ParamStore::Init(ParamId id, PinnedBuffer image, const Resume& resume) {
  Home& h = homes_[id];
  const ParamLayout& p = layout_->param(id);
  const size_t bytes = layout_->PartBytes(id);
  // Version 0 goes to buffer 0. The delayed update's second buffer is written by the first
  // optimizer step (or a checkpoint load) before anything reads it; the in-memory tiers get a
  // copy anyway so that it never holds garbage.
  const int buffers = delayed_ && p.info.trainable ? 2 : 1;
  switch (config_->offload_param.tier) {
    case Tier::kDevice: {
      for (int b = 0; b < buffers; ++b) {
        ZINF_ASSIGN_OR_RETURN(h.device_part[b],
                              budget_->Alloc(bytes, "parameter '" + p.info.name + "'"));
        budget_->Plan(bytes);
        ZINF_RETURN_IF_ERROR(
            device_->CopyHostToDevice(h.device_part[b], image.data(), bytes, copy_stream_));
      }
      return device_->SynchronizeStream(copy_stream_);
    }
    case Tier::kCpu:
      if (buffers == 2) {
        ZINF_ASSIGN_OR_RETURN(h.host_part[1], arena_->Allocate(bytes));
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
          Result<uint64_t> size = swap_->Size(h.swap_key[B(id, Buf(v))]);
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
      ZINF_ASSIGN_OR_RETURN(Ticket t, swap_->Write(key, image.data(), bytes, image.capacity()));
      return swap_->Wait(t);
    }
  }
  return Status::Internal("unknown parameter tier");
}

bool ParamStore::HoldsCommitted(ParamId id, const Resume& resume) const {
  if (config_->offload_param.tier != Tier::kNvme || !resume.active || !resume.stored_params) {
    return false;
  }
  Result<uint64_t> size = swap_->Size("param/" + layout_->param(id).info.name);
  return size.ok() && *size == layout_->PartBytes(id);
}

Status ParamStore::ReadFrozen(ParamId id, void* out, size_t capacity) {
  const Home& h = homes_[id];
  const size_t bytes = layout_->PartBytes(id);
  switch (config_->offload_param.tier) {
    case Tier::kDevice:
      ZINF_RETURN_IF_ERROR(device_->CopyDeviceToHost(out, h.device_part[0], bytes, update_stream_));
      return device_->SynchronizeStream(update_stream_);
    case Tier::kCpu:
      std::memcpy(out, h.host_part[0].data(), bytes);
      return Status::OK();
    case Tier::kNvme: {
      ZINF_ASSIGN_OR_RETURN(Ticket t, swap_->Read(h.swap_key[0], out, capacity));
      return swap_->Wait(t);
    }
  }
  return Status::Internal("unknown parameter tier");
}

Status ParamStore::WriteFrozen(ParamId id, const void* src, size_t capacity) {
  Home& h = homes_[id];
  const size_t bytes = layout_->PartBytes(id);
  switch (config_->offload_param.tier) {
    case Tier::kDevice:
      ZINF_RETURN_IF_ERROR(device_->CopyHostToDevice(h.device_part[0], src, bytes, update_stream_));
      return device_->SynchronizeStream(update_stream_);
    case Tier::kCpu:
      std::memcpy(h.host_part[0].data(), src, bytes);
      return Status::OK();
    case Tier::kNvme: {
      ZINF_ASSIGN_OR_RETURN(Ticket t, swap_->Write(h.swap_key[0], src, bytes, capacity));
      return swap_->Wait(t);
    }
  }
  return Status::Internal("unknown parameter tier");
}

Status ParamStore::WritePiece(ParamId id, const void* src, size_t begin, size_t end, int buf) {
  const ParamLayout& p = layout_->param(id);
  if (config_->offload_param.tier != Tier::kDevice || begin > end || end > p.info.partition_numel ||
      layout_->StoredInt8(id)) {
    return Status::Internal("parameter '" + p.info.name + "': a piece [" + std::to_string(begin) +
                            ", " + std::to_string(end) +
                            ") written outside a device store of its partition");
  }
  const size_t elem = layout_->elem_size();
  const size_t bytes = (end - begin) * elem;
  Status s = stats_->TimeCopy(device_, update_stream_, [&] {
    return device_->CopyHostToDevice(
        static_cast<char*>(homes_[id].device_part[B(id, buf)]) + begin * elem,
        static_cast<const char*>(src) + begin * elem, bytes, update_stream_);
  });
  stats_->AddH2D(bytes);
  return s;
}

Status ParamStore::WriteGroup(size_t gi, const float* master, const uint16_t* copy_out, int buf,
                              std::vector<Ticket>* writes, const std::vector<uint8_t>* written) {
  Status first;
  for (ParamId id : layout_->group(gi).params) {
    const ParamLayout& p = layout_->param(id);
    if (written != nullptr && (*written)[p.index_in_group]) continue;
    Home& h = homes_[id];
    const void* src = copy_out != nullptr ? static_cast<const void*>(copy_out + p.slice_offset)
                                          : static_cast<const void*>(master + p.slice_offset);
    const size_t bytes = layout_->PartBytes(id);
    switch (config_->offload_param.tier) {
      case Tier::kDevice:
        first = stats_->TimeCopy(device_, update_stream_, [&] {
          return device_->CopyHostToDevice(h.device_part[buf], src, bytes, update_stream_);
        });
        stats_->AddH2D(bytes);
        break;
      case Tier::kCpu:
        std::memcpy(h.host_part[buf].data(), src, bytes);
        break;
      case Tier::kNvme: {
        // Slices are 4 KiB aligned and padded inside the sub-group buffer.
        Result<Ticket> t = swap_->Write(h.swap_key[buf], src, bytes, RoundUp(bytes, 4096));
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
  if (config_->offload_param.tier == Tier::kDevice && writes == nullptr) {
    Status synced = device_->SynchronizeStream(update_stream_);
    if (first.ok()) first = synced;
  }
  return first;
}

}  // namespace zinf
