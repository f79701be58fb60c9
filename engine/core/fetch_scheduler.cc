#include "engine/core/fetch_scheduler.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <unordered_map>

#include "zinf/cpu_adam.h"
#include "zinf/log.h"

namespace zinf {

using Clock = std::chrono::steady_clock;

FetchScheduler::FetchScheduler(const EngineContext& ctx, const ParamStore* store,
                               AcquireTrace* trace, GradientAdder* adder)
    : ctx_(ctx),
      store_(store),
      trace_(trace),
      adder_(adder),
      res_(ctx.layout->num_params()),
      fetch_status_(ctx.layout->num_params()) {}

FetchScheduler::~FetchScheduler() {
  // The engine synchronised every stream before this: nothing uses the buffers any more. A
  // read still in flight (a prefetch never acquired) must end before its buffers go.
  for (ParamId id : reading_) {
    if (res_[id].from_secondary) continue;  // (no read)
    Status s = ctx_.swap->Wait(res_[id].read);
    if (!s.ok()) LogWarning("closing: a parameter read nobody used failed: " + s.ToString());
  }
  for (const auto& [ptr, bytes] : graveyard_) ctx_.budget->Free(ptr, bytes);
  for (ParamId id = 0; id < res_.size(); ++id) {
    if (res_[id].quant != nullptr) ctx_.budget->Free(res_[id].quant, QuantScratchBytes(id));
    if (res_[id].device_full != nullptr && !res_[id].aliased) {
      ctx_.budget->Free(res_[id].device_full, ctx_.layout->FullBytes(id));
    }
  }
}

Status FetchScheduler::Init() {
  ZINF_ASSIGN_OR_RETURN(copy_done_, ctx_.device->CreateEvent());
  if (ctx_.node_comm == nullptr) return Status::OK();
  for (ParamId id = 0; id < res_.size(); ++id) {
    if (!KeepsSecondary(id)) continue;
    Result<PinnedBuffer> b =
        ctx_.arena->Allocate(ctx_.layout->SecondaryBytes(id, ctx_.config->hpz_partition_size));
    if (!b.ok()) {
      return b.status().WithContext("hpZ's secondary shard of parameter '" +
                                    ctx_.layout->param(id).info.name + "'");
    }
    res_[id].secondary = std::move(b).value();
  }
  return Status::OK();
}

Status FetchScheduler::Replace(ParamId id) {
  res_[id].secondary_version = kNotFetched;
  return Evict(id);
}

Status FetchScheduler::IssueFromSecondary(ParamId id) {
  Resident& r = res_[id];
  const size_t bytes = ctx_.layout->SecondaryBytes(id, ctx_.config->hpz_partition_size);
  char* mine =
      static_cast<char*>(r.device_full) + static_cast<size_t>(ctx_.node_comm->rank()) * bytes;
  Stream* comm = ctx_.streams.comm;
  // On the comm stream, which wrote the shard (KeepSecondary): ordered after that copy.
  Status s = ctx_.device->CopyHostToDevice(mine, r.secondary.data(), bytes, comm);
  if (s.ok()) {
    ctx_.stats->AddH2D(bytes);
    s = ctx_.node_comm->AllGather(mine, r.device_full, bytes, comm);
  }
  if (s.ok()) s = ctx_.device->RecordEvent(r.ready.get(), comm);
  if (!s.ok()) {
    FailFetch(id);
    return s;
  }
  r.state = State::kFetching;
  return Status::OK();
}

Status FetchScheduler::KeepSecondary(ParamId id) {
  Resident& r = res_[id];
  const size_t bytes = ctx_.layout->SecondaryBytes(id, ctx_.config->hpz_partition_size);
  const char* mine =
      static_cast<const char*>(r.device_full) + static_cast<size_t>(ctx_.node_comm->rank()) * bytes;
  ZINF_RETURN_IF_ERROR(
      ctx_.device->CopyDeviceToHost(r.secondary.data(), mine, bytes, ctx_.streams.comm));
  ctx_.stats->AddD2H(bytes);
  // (A failed read's NaN part is kept too, as on every rank: the ranks' shards stay at the
  // same versions, so they all go on choosing the same gathers.)
  r.secondary_version = r.fetched_version;
  return Status::OK();
}

void FetchScheduler::SetFetchStatus(ParamId id, const Status& s) {
  if (fetch_status_[id].ok()) fetch_status_[id] = s;
}

Status FetchScheduler::TakeFetchStatus(ParamId id) {
  Status s = fetch_status_[id];
  fetch_status_[id] = Status::OK();
  return s;
}

Status FetchScheduler::Evict(ParamId id) {
  Resident& r = res_[id];
  if (r.aliased || r.device_full == nullptr) return Status::OK();
  if (r.state == State::kReading) {
    // No stream has touched the buffer yet: once the read into the staging block has ended,
    // both go back. Its error, if any, is reported by the next Acquire of the parameter.
    Status read = r.from_secondary ? Status::OK() : ctx_.swap->Wait(r.read);
    if (!read.ok()) SetFetchStatus(id, read);
    reading_.erase(std::find(reading_.begin(), reading_.end(), id));
    DropDeviceCopy(id);
    return Status::OK();
  }
  // Nothing may use or write the buffer when it goes back, and the host does not wait for
  // that here (on a GPU the compute stream runs behind the trainer): it goes back after the
  // compute stream's work issued so far when it was acquired (that work read it), or after
  // the gather stream's when it was fetched and never acquired (its copy and gather).
  Stream* after = r.state == State::kFetching ? ctx_.streams.comm : ctx_.device->ComputeStream();
  Status s = ctx_.budget->FreeAfter(r.device_full, ctx_.layout->FullBytes(id), after);
  if (!s.ok()) {
    return s.WithContext("evicting parameter '" + ctx_.layout->param(id).info.name +
                         "' (its device memory stays allocated: nothing is known to be done "
                         "with it)");
  }
  ForgetDeviceCopy(id);
  return Status::OK();
}

size_t QuantizedGatherScratch(const ParamLayout& p, const EngineConfig& c, int world,
                              bool stored_int8, size_t elem_size) {
  if (world == 1 || ReplicatesParameters(c)) return 0;
  const size_t n = p.info.partition_numel;
  // (Stored int8 goes in its stored blocks, the rest in zinf.quantization_block_size's.)
  const size_t blocks = Int8Bytes(n, stored_int8 ? kInt8StateBlock : c.quantization_block_size);
  const size_t scratch = blocks * (static_cast<size_t>(world) + 1);
  if (stored_int8) return scratch;  // (already its blocks)
  const bool frozen = !p.info.trainable;
  // A partition whose blocks are no smaller than it (the block's padding and scale: up to 65
  // fp32 values with blocks of 256, 257 with blocks of 1024) goes as it is.
  const bool on = c.quantized_weights || (frozen && c.quantized_nontrainable_weights);
  return on && blocks < n * elem_size ? scratch : 0;
}

bool FetchScheduler::QuantizedGather(ParamId id) const { return QuantScratchBytes(id) != 0; }

size_t FetchScheduler::QuantScratchBytes(ParamId id) const {
  return QuantizedGatherScratch(ctx_.layout->param(id), *ctx_.config, ctx_.comm->world_size(),
                                ctx_.layout->StoredInt8(id), ctx_.layout->elem_size());
}

void FetchScheduler::DropQuant(ParamId id) {
  Resident& r = res_[id];
  if (r.quant == nullptr) return;
  ctx_.budget->Free(r.quant, QuantScratchBytes(id));
  ctx_.budget->Unplan(QuantScratchBytes(id));
  r.quant = nullptr;
}

void FetchScheduler::DropDeviceCopy(ParamId id) {
  DropQuant(id);
  ctx_.budget->Free(res_[id].device_full, ctx_.layout->FullBytes(id));
  ForgetDeviceCopy(id);
}

void FetchScheduler::ForgetDeviceCopy(ParamId id) {
  Resident& r = res_[id];
  r.staging.reset();
  r.decoded.reset();
  r.device_full = nullptr;
  r.fetched_version = kNotFetched;
  r.state = State::kAbsent;
  r.from_secondary = false;
  live_elems_ -= ctx_.layout->param(id).padded_numel;
  ctx_.budget->Unplan(ctx_.layout->FullBytes(id));
}

Status FetchScheduler::MakeRoom(uint64_t elems, uint64_t bytes, ParamId for_id) {
  const ParamLayout& target = ctx_.layout->param(for_id);
  const uint64_t grad_room = GradientScratchBytes(target, *ctx_.config);
  auto fits = [&] {
    return ctx_.budget->Fits(bytes + grad_room) && live_elems_ + elems <= MaxLive();
  };
  while (!fits()) {
    if (ctx_.budget->has_scratch()) {
      ZINF_RETURN_IF_ERROR(ctx_.budget->ReclaimScratch());
      continue;
    }
    // Evict the released parameter whose next use is farthest away.
    ParamId victim = UINT32_MAX;
    uint64_t best = 0;
    for (ParamId id = 0; id < res_.size(); ++id) {
      const Resident& r = res_[id];
      if (r.acquired > 0 || r.aliased || r.device_full == nullptr || id == for_id) continue;
      const uint64_t d = trace_->ReuseDistance(id, *ctx_.layout);
      if (victim == UINT32_MAX || d > best) {
        victim = id;
        best = d;
      }
    }
    if (victim == UINT32_MAX) {
      return Status::ResourceExhausted(
                 "device budget too small to fetch parameter '" + target.info.name +
                 "' while the acquired ones stay resident (budget " +
                 FormatBytes(ctx_.config->device_budget_bytes) + ", max_live_parameters " +
                 std::to_string(ctx_.config->max_live_parameters) +
                 "); raise zinf.device_budget_bytes / stage3_max_live_parameters or acquire fewer "
                 "parameters at once")
          .WithKey("zinf.device_budget_bytes");
    }
    ZINF_RETURN_IF_ERROR(Evict(victim));
  }
  return Status::OK();
}

Status FetchScheduler::Fetch(ParamId id, int64_t visible, bool prefetch) {
  Resident& r = res_[id];
  const ParamLayout& p = ctx_.layout->param(id);
  if (r.aliased) {
    r.device_full = store_->device_part(id, store_->Buf(visible));
    r.state = State::kResident;
    r.fetched_version = static_cast<uint64_t>(visible);
    return Status::OK();
  }
  if (r.device_full != nullptr) ZINF_RETURN_IF_ERROR(Evict(id));  // stale copy
  // hpZ: a shard of this version is kept: the node has the whole parameter between its ranks.
  const bool from_secondary = SecondaryFresh(id, visible);
  // NVMe: the pinned staging block first, so that a fetch that cannot have one leaves nothing
  // behind (so is an int8 weight's decode block: with several ranks, nothing may fail between
  // a read and its gather). Prefetches issued in earlier calls may hold it all while their
  // reads are slow.
  std::shared_ptr<PinnedBuffer> staging, decoded;
  if (ctx_.config->offload_param.tier == Tier::kNvme && !from_secondary) {
    ZINF_ASSIGN_OR_RETURN(staging, TakeBlock(id, ctx_.layout->PartBytes(id), prefetch));
  }
  const bool quantized = QuantizedGather(id) && !from_secondary;
  if (ctx_.layout->StoredInt8(id) && !quantized && !from_secondary) {
    ZINF_ASSIGN_OR_RETURN(decoded, TakeBlock(id, ctx_.layout->DevicePartBytes(id), prefetch));
  }
  const size_t full = ctx_.layout->FullBytes(id);
  const size_t quant = quantized ? QuantScratchBytes(id) : 0;
  ZINF_RETURN_IF_ERROR(MakeRoom(p.padded_numel, FetchBytes(id), id));
  ZINF_ASSIGN_OR_RETURN(r.device_full, ctx_.budget->Alloc(full, "parameter '" + p.info.name + "'"));
  live_elems_ += p.padded_numel;
  ctx_.budget->Plan(full);
  if (quantized) {
    Result<void*> scratch =
        ctx_.budget->Alloc(quant, "the quantized gather of parameter '" + p.info.name + "'");
    if (!scratch.ok()) {
      DropDeviceCopy(id);
      return scratch.status();
    }
    r.quant = *scratch;
    ctx_.budget->Plan(quant);
  }
  if (!r.ready) {
    Result<std::unique_ptr<Event>> ev = ctx_.device->CreateEvent();
    if (!ev.ok()) {
      DropDeviceCopy(id);
      return ev.status();
    }
    r.ready = std::move(ev).value();
  }
  // The fetch status is not reset here: a failed read whose copy was evicted before any
  // Acquire saw it (a prefetch that MakeRoom, a load or new values dropped) is still reported,
  // once, by the next Acquire of the parameter, so that no I/O error goes unseen.
  const int buf = store_->Buf(visible);
  r.fetched_version = static_cast<uint64_t>(visible);
  r.decoded = std::move(decoded);
  if (from_secondary && ctx_.config->offload_param.tier == Tier::kNvme) {
    r.from_secondary = true;
    r.state = State::kReading;
    reading_.push_back(id);
    return Status::OK();
  }
  if (from_secondary) return IssueFromSecondary(id);
  switch (ctx_.config->offload_param.tier) {
    case Tier::kNvme: {
      // Urgent: the trainer waits on parameters; optimizer read-ahead and write-backs can wait.
      Result<Ticket> t = ctx_.swap->Read(store_->swap_key(id, buf), staging->data(),
                                         staging->capacity(), /*urgent=*/true);
      if (!t.ok()) {
        DropDeviceCopy(id);  // nothing was issued into it
        return t.status();
      }
      r.read = *t;
      r.staging = std::move(staging);
      r.state = State::kReading;
      reading_.push_back(id);
      return Status::OK();
    }
    case Tier::kCpu:
      return IssueCopies(id, store_->host_part(id, buf), nullptr);
    case Tier::kDevice:
      return IssueCopies(id, store_->device_part(id, buf), nullptr);
  }
  return Status::Internal("unknown parameter tier");
}

void FetchScheduler::FailFetch(ParamId id) {
  Resident& r = res_[id];
  const ParamLayout& p = ctx_.layout->param(id);
  // A buffer without a complete fetch issued into it must not stay: an Acquire would take
  // whatever that memory held for the parameter. Nothing may still write into it when it
  // goes back; when that cannot be known (waiting failed), it stays allocated and unfetched.
  Status quiet = ctx_.device->SynchronizeStream(ctx_.streams.copy);
  if (quiet.ok()) quiet = ctx_.device->SynchronizeStream(ctx_.streams.comm);
  if (quiet.ok()) {
    DropDeviceCopy(id);
    return;
  }
  // Nothing is known to be done with it: it goes to the buffers freed only when the engine
  // closes (after every stream), still counted in the plan, never used again.
  LogWarning("the device copy of '" + p.info.name +
             "' stays allocated until the engine closes after a failed fetch: " + quiet.ToString());
  graveyard_.push_back({r.device_full, ctx_.layout->FullBytes(id)});
  if (r.quant != nullptr) {
    graveyard_.push_back({r.quant, QuantScratchBytes(id)});  // (still planned, as device_full)
    r.quant = nullptr;
  }
  r.device_full = nullptr;
  r.staging.reset();
  r.decoded.reset();
  r.fetched_version = kNotFetched;
  r.state = State::kAbsent;
  r.from_secondary = false;
  live_elems_ -= p.padded_numel;
}

Status FetchScheduler::IssueCopies(ParamId id, const void* src,
                                   std::shared_ptr<PinnedBuffer> staging) {
  Resident& r = res_[id];
  const size_t part = ctx_.layout->DevicePartBytes(id);
  char* slot = static_cast<char*>(r.device_full) + static_cast<size_t>(ctx_.comm->rank()) * part;
  Stream* copy = ctx_.streams.copy;
  const bool device_tier = ctx_.config->offload_param.tier == Tier::kDevice;
  size_t bytes = part;
  void* dst = slot;
  if (r.quant != nullptr && ctx_.layout->StoredInt8(id)) {
    // An int8 frozen weight gathers its stored blocks: they go to the scratch as they are.
    bytes = ctx_.layout->PartBytes(id);
    dst = r.quant;
  }
  if (r.decoded) {
    // int8 frozen weights: dequantised into the decode block by a host function queued on
    // the copy stream before the copy that reads it (off the trainer's thread); the int8
    // block goes back once decoded, the decode block once copied.
    std::shared_ptr<PinnedBuffer> decoded = std::move(r.decoded);
    Status queued = QueueDequantize(id, src, std::move(staging), decoded->data());
    if (!queued.ok()) {
      FailFetch(id);
      return queued;
    }
    staging = std::move(decoded);
    src = staging->data();
  }
  Status s = device_tier ? ctx_.device->CopyDeviceToDevice(dst, src, bytes, copy)
                         : ctx_.stats->TimeCopy(ctx_.device, copy, [&] {
                             return ctx_.device->CopyHostToDevice(dst, src, bytes, copy);
                           });
  // The staging block goes back once the copy out of it has run (a host function that only
  // drops a reference: it never blocks).
  if (s.ok() && staging) s = ctx_.device->LaunchHostFunc(copy, [staging] { staging->Reset(); });
  if (s.ok() && !device_tier) ctx_.stats->AddH2D(bytes);
  if (s.ok()) s = ctx_.device->RecordEvent(copy_done_.get(), copy);
  if (s.ok()) s = ctx_.device->StreamWaitEvent(ctx_.streams.comm, copy_done_.get());
  if (s.ok() && r.quant != nullptr) {
    s = IssueQuantizedGather(id, slot);
  } else if (s.ok()) {
    s = ctx_.comm->AllGather(slot, r.device_full, part, ctx_.streams.comm);
  }
  if (s.ok() && KeepsSecondary(id)) s = KeepSecondary(id);
  if (s.ok()) s = ctx_.device->RecordEvent(r.ready.get(), ctx_.streams.comm);
  if (!s.ok()) {
    FailFetch(id);
    return s;
  }
  r.staging.reset();
  r.state = State::kFetching;
  return Status::OK();
}

Status FetchScheduler::IssueQuantizedGather(ParamId id, void* slot) {
  Resident& r = res_[id];
  const size_t n = ctx_.layout->param(id).info.partition_numel;
  const size_t part = ctx_.layout->DevicePartBytes(id);
  const bool stored = ctx_.layout->StoredInt8(id);
  const size_t block = stored ? kInt8StateBlock : ctx_.config->quantization_block_size;
  const size_t blocks = Int8Bytes(n, block);
  const ParamCopyType type = StoredParamType(*ctx_.config);
  Stream* comm = ctx_.streams.comm;
  char* mine = static_cast<char*>(r.quant);
  char* all = mine + blocks;
  Status s;
  if (!stored) s = ctx_.device->QuantizeInt8(mine, slot, type, n, block, comm);
  if (s.ok()) s = ctx_.comm->AllGather(mine, all, blocks, comm);
  // Every rank's part decoded, this rank's too: every rank computes with the same values.
  char* full = static_cast<char*>(r.device_full);
  for (int k = 0; s.ok() && k < ctx_.comm->world_size(); ++k) {
    s = ctx_.device->DequantizeInt8(full + k * part, type, all + k * blocks, n, block, comm);
  }
  if (s.ok()) s = ctx_.budget->FreeAfter(r.quant, QuantScratchBytes(id), comm);
  if (!s.ok()) return s;  // (the caller's FailFetch frees the scratch with the copy)
  ctx_.budget->Unplan(QuantScratchBytes(id));
  r.quant = nullptr;
  return Status::OK();
}

Result<std::shared_ptr<PinnedBuffer>> FetchScheduler::TakeBlock(ParamId id, size_t bytes,
                                                                bool prefetch) {
  Result<PinnedBuffer> buf = ctx_.arena->Allocate(bytes);
  if (!buf.ok() && !prefetch) {
    // Wait for the blocks in use to come back: one rank, the prefetch reads still in flight
    // (their copies are issued; with several ranks their gathers wait for their Acquire);
    // then the copies in flight, each handing its block back once copied (fetches on the
    // copy stream, gradient partitions on the gradient stream, then summed by the gradient
    // path's adder).
    if (ctx_.comm->world_size() == 1 && !reading_.empty()) {
      const ParamId last = reading_.back();
      Status s = FinishRead(last);
      if (!s.ok()) SetFetchStatus(last, s);  // the next Acquire of it reports it
    }
    ZINF_RETURN_IF_ERROR(ctx_.device->SynchronizeStream(ctx_.streams.copy));
    ZINF_RETURN_IF_ERROR(ctx_.device->SynchronizeStream(ctx_.streams.grad));
    adder_->Drain();
    buf = ctx_.arena->Allocate(bytes);
  }
  if (!buf.ok()) {
    return buf.status().WithContext("staging parameter '" + ctx_.layout->param(id).info.name + "'");
  }
  return std::make_shared<PinnedBuffer>(std::move(buf).value());
}

Status FetchScheduler::QueueDequantize(ParamId id, const void* src,
                                       std::shared_ptr<PinnedBuffer> src_block, void* out) {
  // `out` lives until the copy after this function has read it (IssueCopies' release);
  // `src_block` (null for a cpu-tier home, which lives as long as the engine) until it ran.
  const size_t n = ctx_.layout->param(id).info.partition_numel;
  const ParamCopyType type = StoredParamType(*ctx_.config);
  return ctx_.device->LaunchHostFunc(ctx_.streams.copy, [src, src_block, out, n, type] {
    if (type == ParamCopyType::kBf16) {
      DequantizeWeightsInt8Bf16(src, n, static_cast<uint16_t*>(out));
    } else if (type == ParamCopyType::kF16) {
      DequantizeWeightsInt8F16(src, n, static_cast<uint16_t*>(out));
    } else {
      DequantizeWeightsInt8(src, n, static_cast<float*>(out));
    }
  });
}

Status FetchScheduler::FinishOneRead(ParamId id) {
  Resident& r = res_[id];
  if (r.from_secondary) {
    r.from_secondary = false;
    return IssueFromSecondary(id);
  }
  Status read = ctx_.swap->Wait(r.read);
  if (!read.ok() && ctx_.comm->world_size() == 1) {
    DropDeviceCopy(id);  // no stream has touched it
    return read;
  }
  if (!read.ok()) {
    // Several ranks: the others issue this gather too, and leaving it out here would pair
    // their next collective with another one of ours (a hang, or mixed-up data). This rank's
    // part goes out as NaN, so that a peer using it gets non-finite values (its gradient
    // checks stop that step) rather than stale memory, and this rank reports the read's error;
    // the copy is never taken for the parameter's value (unfetched).
    std::memset(r.staging->data(), 0xFF, r.staging->capacity());
    std::shared_ptr<PinnedBuffer> staging = std::move(r.staging);
    if (IssueCopies(id, staging->data(), staging).ok()) r.fetched_version = kNotFetched;
    return read;
  }
  std::shared_ptr<PinnedBuffer> staging = std::move(r.staging);
  return IssueCopies(id, staging->data(), staging);
}

Status FetchScheduler::FinishRead(ParamId id) {
  // The reads issued before this one are finished first, in issue order: every rank then
  // issues the same gathers in the same order.
  while (!reading_.empty()) {
    const ParamId first = reading_.front();
    reading_.pop_front();
    Status s = FinishOneRead(first);
    if (first == id) return s;
    // A read error is the parameter's to report (by its next Acquire); a failure to issue
    // left it absent: a demand fetch issues it again and reports what fails then.
    if (!s.ok() && res_[first].state == State::kAbsent) SetFetchStatus(first, s);
  }
  return Status::Internal("no read in flight for parameter '" + ctx_.layout->param(id).info.name +
                          "'");
}

void FetchScheduler::IssueEndedReads() {
  // With several ranks, when a read ends differs between them, and its gather must be issued
  // at the same point of every rank's call sequence: those wait for their Acquire.
  if (ctx_.comm->world_size() != 1) return;
  while (!reading_.empty() &&
         (res_[reading_.front()].from_secondary || ctx_.swap->Done(res_[reading_.front()].read))) {
    const ParamId first = reading_.front();
    reading_.pop_front();
    Status s = FinishOneRead(first);
    if (!s.ok() && res_[first].state == State::kAbsent) SetFetchStatus(first, s);
  }
}

void FetchScheduler::Prefetch(int64_t visible, const Rewriting& rewriting) {
  IssueEndedReads();
  if (!trace_->valid()) return;
  uint64_t inflight = 0;
  const std::vector<ParamId>& ids = trace_->ids();
  for (size_t i = trace_->cursor(); i < ids.size(); ++i) {
    const ParamId id = ids[i];
    const Resident& r = res_[id];
    const ParamLayout& p = ctx_.layout->param(id);
    if (Fresh(id, visible)) continue;
    // Still acquired from an older version (the trainer holds it): its memory must not move.
    if (r.acquired > 0) continue;
    if (rewriting(id)) continue;
    if (inflight + p.padded_numel > ctx_.config->prefetch_bucket_size && inflight > 0) return;
    // Only prefetch into free budget: never evict for a prefetch.
    const uint64_t grad_room = GradientScratchBytes(p, *ctx_.config);
    if (!ctx_.budget->Fits(FetchBytes(id) + grad_room)) return;
    if (live_elems_ + p.padded_numel > MaxLive()) return;
    if (r.aliased) continue;
    // A prefetch failure resurfaces on demand.
    if (!Fetch(id, visible, /*prefetch=*/true).ok()) return;
    inflight += p.padded_numel;
  }
}

Status FetchScheduler::DropAll() {
  for (ParamId id = 0; id < res_.size(); ++id) {
    Resident& r = res_[id];
    r.secondary_version = kNotFetched;  // (its pinned memory is released with the arena)
    if (r.aliased) {
      r.device_full = nullptr;
      r.fetched_version = kNotFetched;
      r.state = State::kAbsent;
      continue;
    }
    ZINF_RETURN_IF_ERROR(Evict(id));
  }
  return Status::OK();
}

void FetchScheduler::Refresh(int64_t visible, const Rewriting& rewriting) {
  IssueEndedReads();
  // Several ranks with NVMe parameters: a read's gather waits for its Acquire, and every read
  // queued before it is gathered first (FinishRead), so the reads must be queued in the order
  // the parameters are acquired, on every rank alike: the trace's prefetch does that; how far a
  // refresh in registration order got would depend on when each rank's staging came back.
  if (ctx_.comm->world_size() > 1 && ctx_.config->offload_param.tier == Tier::kNvme) return;
  for (ParamId id = 0; id < res_.size(); ++id) {
    const Resident& r = res_[id];
    const ParamLayout& p = ctx_.layout->param(id);
    if (r.aliased || Fresh(id, visible) || r.acquired > 0 || rewriting(id)) continue;
    if (r.device_full != nullptr && !Evict(id).ok()) return;  // (its Acquire fetches it)
    if (!ctx_.budget->Fits(FetchBytes(id) + GradientScratchBytes(p, *ctx_.config))) {
      return;
    }
    if (live_elems_ + p.padded_numel > MaxLive()) return;
    // A failure resurfaces at the parameter's Acquire, as a prefetch's does.
    if (!Fetch(id, visible, /*prefetch=*/true).ok()) return;
  }
}

Result<std::vector<void*>> FetchScheduler::Acquire(const std::vector<ParamId>& ids, int64_t visible,
                                                   bool training, const Rewriting& rewriting) {
  std::vector<void*> out;
  out.reserve(ids.size());
  // On failure no acquisition of this call stays counted.
  size_t counted = 0;
  auto undo = [&] {
    for (size_t k = 0; k < counted; ++k) --res_[ids[k]].acquired;
  };
  for (ParamId id : ids) {
    if (training) {
      const std::string warning = trace_->Check(id, *ctx_.layout);
      if (!warning.empty()) LogWarning(warning);
    }
    Resident& r = res_[id];
    if (training && rewriting(id)) {
      undo();
      return Status::FailedPrecondition(
          "Acquire('" + ctx_.layout->param(id).info.name +
          "') after its ReduceGradient in the same micro-step: with zinf.delayed_update the "
          "optimizer may already be rewriting it; acquire a parameter for the last time before "
          "reducing its gradient");
    }
    const bool fresh = Fresh(id, visible);
    // Prefetch follows the training trace: inference acquires are not its hits or misses.
    if (training) ctx_.stats->CountAcquire(fresh);
    if (!fresh) {
      Status s = Fetch(id, visible, /*prefetch=*/false);
      if (!s.ok()) {
        undo();
        return s;
      }
    }
    ++r.acquired;
    ++counted;
  }
  Prefetch(visible, rewriting);
  const auto t0 = Clock::now();
  for (ParamId id : ids) {
    Resident& r = res_[id];
    if (r.state == State::kReading) {
      // The read's result is known here, on the host, before the buffer is handed out.
      Status read = FinishRead(id);
      if (!read.ok()) {
        undo();
        // The peers issue the gathers of this call's other reads now: so does this rank.
        if (ctx_.comm->world_size() > 1) {
          for (ParamId other : ids) {
            if (res_[other].state != State::kReading) continue;
            Status s = FinishRead(other);
            if (!s.ok()) SetFetchStatus(other, s);
          }
        }
        return read.WithContext("fetching parameter '" + ctx_.layout->param(id).info.name + "'");
      }
    }
    if (r.state == State::kFetching) {
      Status w = ctx_.device->StreamWaitEvent(ctx_.device->ComputeStream(), r.ready.get());
      if (!w.ok()) {
        undo();
        return w;
      }
      // From here the compute stream is ordered after the fetch: its events cover it.
      r.state = State::kResident;
    }
    Status s = TakeFetchStatus(id);
    if (!s.ok()) {
      undo();
      // A failed fetch is no cached copy: drop it so a later Acquire fetches again. Marked
      // unfetched first, so that even a buffer the eviction must keep is never taken for the
      // parameter's value.
      r.fetched_version = kNotFetched;
      Status evicted = Evict(id);
      if (!evicted.ok()) LogWarning(evicted.ToString());  // the fetch's error is the one to report
      return s.WithContext("fetching parameter '" + ctx_.layout->param(id).info.name + "'");
    }
    out.push_back(r.device_full);
  }
  ctx_.stats->AddAcquireWait(std::chrono::duration<double>(Clock::now() - t0).count());
  return out;
}

Status FetchScheduler::Release(const std::vector<ParamId>& ids, int64_t visible,
                               const Rewriting& rewriting) {
  // All or nothing: every id is checked (a repeated id counts once per occurrence) before any
  // is uncounted, so a refused call changes nothing and a failed eviction leaves none of the
  // others acquired.
  std::unordered_map<ParamId, int> count;
  for (ParamId id : ids) {
    if (id >= res_.size() || ++count[id] > res_[id].acquired) {
      return Status::FailedPrecondition("Release of parameter " + std::to_string(id) +
                                        " that is not acquired");
    }
  }
  Status first;
  for (ParamId id : ids) {
    Resident& r = res_[id];
    if (--r.acquired > 0) continue;
    if (ctx_.layout->param(id).info.persistent || r.aliased) continue;
    if (trace_->ReuseDistance(id, *ctx_.layout) <= ctx_.config->max_reuse_distance) continue;
    Status s = Evict(id);
    if (first.ok()) first = s;
  }
  Prefetch(visible, rewriting);
  return first;
}

}  // namespace zinf
