#include "engine/core/gradient_path.h"

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "zinf/align.h"
#include "zinf/log.h"

namespace zinf {

namespace {

// The host half of zinf.gradient_transfer_dtype "bf16", written so that the compiler
// vectorises it (no calls): it runs over every gradient partition. Values pass through bytes
// (memcpy): the buffers hold bf16 written by a copy where floats will be.

inline float Widen(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// The first 2n bytes of `acc` hold n bf16 values: widened to n floats in place. Blocks from
// the end, each read whole before it is written: block [b, b + k) writes the bytes of bf16
// values [2b, 2b + 2k), which are its own or above it (already widened).
void WidenInPlace(float* acc, size_t n) {
  constexpr size_t kBlock = 64;
  auto* bytes = reinterpret_cast<unsigned char*>(acc);
  uint16_t in[kBlock];
  float out[kBlock];
  for (size_t end = n; end > 0;) {
    const size_t b = end >= kBlock ? end - kBlock : 0;
    const size_t k = end - b;
    std::memcpy(in, bytes + 2 * b, 2 * k);
    for (size_t j = 0; j < k; ++j) out[j] = Widen(in[j]);
    std::memcpy(bytes + 4 * b, out, 4 * k);
    end = b;
  }
}

void AddWidened(float* acc, const uint16_t* add, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += Widen(add[i]);
}

}  // namespace

GradientPath::GradientPath(const EngineContext& ctx, FetchScheduler* fetch, GradientAdder* adder,
                           BlockPool* grad_pool, bool streaming)
    : layout_(ctx.layout),
      config_(ctx.config),
      device_(ctx.device),
      comm_(ctx.comm),
      budget_(ctx.budget),
      stats_(ctx.stats),
      board_(ctx.board),
      fetch_(fetch),
      adder_(adder),
      streams_(ctx.streams),
      arena_(ctx.arena),
      grad_pool_(grad_pool),
      streaming_(streaming),
      flags_(ctx.layout->num_params()),
      groups_(ctx.layout->num_groups()) {}

GradientPath::~GradientPath() {
  adder_->Drain();  // its queued jobs write into this object's accumulators
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    if (groups_[gi].on_device) budget_->Free(groups_[gi].data, layout_->GroupGradBytes(gi));
  }
  if (zeros_registered_) {
    Status s = device_->UnregisterHostMemory(zeros_);
    if (!s.ok()) LogWarning("closing the engine: " + s.ToString());
  }
  std::free(zeros_);
}

Status GradientPath::Init() {
  ZINF_ASSIGN_OR_RETURN(compute_done_, device_->CreateEvent());
  ZINF_ASSIGN_OR_RETURN(comm_done_, device_->CreateEvent());
  // At most kPartitionAlign * world_size - 1 elements of padding per parameter.
  zeros_bytes_ = RoundUp(kPartitionAlign * static_cast<size_t>(comm_->world_size()) * sizeof(float),
                         size_t{4096});
  zeros_ = static_cast<float*>(std::aligned_alloc(4096, zeros_bytes_));
  if (zeros_ == nullptr) {
    return Status::ResourceExhausted("cannot allocate " + std::to_string(zeros_bytes_) +
                                     " bytes of gradient padding");
  }
  std::memset(zeros_, 0, zeros_bytes_);
  ZINF_RETURN_IF_ERROR(device_->RegisterHostMemory(zeros_, zeros_bytes_)
                           .WithContext("registering the gradient padding"));
  zeros_registered_ = true;
  return Status::OK();
}

Status GradientPath::AllocateGroup(size_t gi) {
  Group& g = groups_[gi];
  if (layout_->group(gi).on_device && config_->offload_param.tier == Tier::kDevice) {
    // Stepped on the device (OptimizerPipeline::StepGroupOnDevice): its gradients accumulate
    // in device memory, planned with the rest of it. Only reduced parameters are read (the
    // others are not stepped, and count zero in the clipping norm), so no zeroing.
    const size_t bytes = layout_->GroupGradBytes(gi);
    ZINF_ASSIGN_OR_RETURN(void* d, budget_->Alloc(bytes, "device gradient accumulators"));
    budget_->Plan(bytes);
    g.on_device = true;
    g.data = static_cast<float*>(d);
    return Status::OK();
  }
  if (streaming_) return Status::OK();
  ZINF_ASSIGN_OR_RETURN(g.grads, arena_->Allocate(layout_->GroupGradBytes(gi)));
  std::memset(g.grads.data(), 0, g.grads.capacity());
  g.data = static_cast<float*>(g.grads.data());
  return Status::OK();
}

float* GradientPath::Acc(ParamId id) const {
  const ParamLayout& p = layout_->param(id);
  return groups_[p.info.sub_group].data + p.slice_offset;
}

void GradientPath::BeginMicroStep() {
  for (Flags& f : flags_) f.reduced_this_micro = false;
  reduced_this_micro_ = false;
}

void GradientPath::EndWindow() {
  for (Flags& f : flags_) f.seen_this_window = false;
}

std::string GradientPath::Unreduced(size_t gi) const {
  for (ParamId q : layout_->group(gi).params) {
    if (layout_->param(q).info.trainable && !flags_[q].reduced_this_micro) {
      return layout_->param(q).info.name;
    }
  }
  return std::string();
}

void GradientPath::MarkReduced(ParamId id) {
  const ParamLayout& p = layout_->param(id);
  flags_[id].seen_this_window = true;
  flags_[id].reduced_this_micro = true;
  reduced_this_micro_ = true;
  board_->MarkHasGrad(p.info.sub_group, p.index_in_group);
}

Status GradientPath::EnsureBuffer(size_t gi) {
  Group& g = groups_[gi];
  if (g.data != nullptr) return Status::OK();
  if (!streaming_) return Status::Internal("gradient accumulators missing");
  // Wait for a free block; give up when the optimizer failed (it frees no more) or makes no
  // progress for a long time (it frees a sub-group's block after each step, so a stall means
  // it is stuck).
  return board_->WaitForGradBlock(
      [&] {
        PooledBlock block = grad_pool_->TryTake();
        if (block.data() == nullptr) return false;
        g.block = std::move(block);
        g.data = static_cast<float*>(g.block.data());
        return true;
      },
      [this](size_t waiting) { return Unreduced(waiting); }, grad_pool_->block_bytes(),
      std::chrono::seconds(300));
}

void GradientPath::ReleaseBuffer(size_t gi) {
  Group& g = groups_[gi];
  if (g.block.data() == nullptr) return;
  g.data = nullptr;
  g.block.Reset();
  board_->NoteGradRelease();
}

Status GradientPath::LandAfterCopy(const ParamLayout& p, void* scratch, size_t scratch_bytes,
                                   int64_t ready) {
  const size_t gi = p.info.sub_group;
  return device_
      ->LaunchHostFunc(streams_.grad,
                       [this, scratch, scratch_bytes, gi, ready] {
                         budget_->Free(scratch, scratch_bytes);
                         board_->Land(gi, ready);
                       })
      .WithContext("landing the gradient of '" + p.info.name + "'");
}

Status GradientPath::Reduce(ParamId id, const float* grad, int64_t ready) {
  const ParamLayout& p = layout_->param(id);
  const size_t gi = p.info.sub_group;
  const size_t full_bytes = p.padded_numel * sizeof(float);
  const size_t part = p.info.partition_numel;
  // Accumulated on the device (a sub-group the device steps): nothing crosses the link.
  const bool on_device = groups_[gi].on_device;
  const bool bf16 = config_->gradient_transfer_bf16 && !on_device;
  Stream* compute = device_->ComputeStream();
  // One rank, first gradient of the window: the reduction is the identity.
  const bool one_rank_first = comm_->world_size() == 1 && !flags_[id].seen_this_window;
  // The gradient straight into its accumulator on the compute stream (one copy, no device
  // scratch): one rank's first gradient when the accumulator is device memory, or, on the
  // host device whose compute stream is the caller, host memory. (Not with bf16 transfer: the
  // general path rounds on the device, so the link carries the halved bytes it counts.)
  if (one_rank_first && (on_device || (device_->ComputeRunsInline() && !bf16))) {
    ZINF_RETURN_IF_ERROR(EnsureBuffer(gi).WithContext("gradient of '" + p.info.name + "'"));
    float* acc = Acc(id);
    const size_t bytes = p.info.numel * sizeof(float);
    MarkReduced(id);
    if (on_device) {
      ZINF_RETURN_IF_ERROR(device_->CopyDeviceToDevice(acc, grad, bytes, compute));
      if (part > p.info.numel) {
        ZINF_RETURN_IF_ERROR(device_->CopyHostToDevice(
            acc + p.info.numel, zeros_, (part - p.info.numel) * sizeof(float), compute));
      }
    } else {
      // At the window's end (`ready`) and without clipping (the norm needs every gradient
      // whole), a large gradient is copied in pieces and each but the last announced as it is
      // copied (the copies on this inline stream are done when they return; the last lands
      // with Land below): if it is the sub-group's last gradient still to land, the optimizer
      // steps what has landed while the rest is copied (GroupBoard::LandPiece; MarkReduced
      // came first, so the has-grad flag is set before the optimizer takes the flags).
      const size_t numel = p.info.numel;
      const bool pieces = ready > 0 && config_->gradient_clipping <= 0;
      const size_t piece = pieces
                               ? RoundUp((numel + kLandPieces - 1) / kLandPieces, kLandPieceAlign)
                               : std::max<size_t>(numel, 1);
      for (size_t begin = 0; begin < numel; begin += piece) {
        const size_t end = std::min(numel, begin + piece);
        ZINF_RETURN_IF_ERROR(stats_->TimeCopy(device_, compute, [&] {
          return device_->CopyDeviceToHost(acc + begin, grad + begin, (end - begin) * sizeof(float),
                                           compute);
        }));
        if (pieces && end < numel) board_->LandPiece(gi, p.index_in_group, end, ready);
      }
      if (part > numel) std::memset(acc + numel, 0, (part - numel) * sizeof(float));
      stats_->AddD2H(bytes);
    }
    ZINF_RETURN_IF_ERROR(device_->RecordEvent(compute_done_.get(), compute));
    ZINF_RETURN_IF_ERROR(device_->StreamWaitEvent(streams_.grad, compute_done_.get()));
    return device_->LaunchHostFunc(streams_.grad, [this, gi, ready] { board_->Land(gi, ready); })
        .WithContext("landing the gradient of '" + p.info.name + "'");
  }
  ZINF_RETURN_IF_ERROR(fetch_->MakeRoom(0, 0, id));
  // Device scratch. One rank's first gradient: the copy out of the caller's buffer (fp32, or
  // bf16 when rounded). Otherwise: the padded full gradient, this rank's reduced partition,
  // and (bf16) the partition rounded.
  const size_t n = one_rank_first ? p.info.numel : part;  // values that cross the link
  const size_t link_bytes = n * (bf16 ? 2 : 4);
  const size_t scratch_bytes =
      one_rank_first ? link_bytes : full_bytes + part * sizeof(float) + (bf16 ? part * 2 : 0);
  ZINF_ASSIGN_OR_RETURN(void* scratch,
                        budget_->Alloc(scratch_bytes, "gradient of '" + p.info.name + "'"));
  budget_->PlanScratch(scratch_bytes);
  // Any failure from here on: no landing callback will free the scratch (or keep the staging
  // block alive), so once the streams that may still use them are done, it goes back here
  // (when waiting fails it stays allocated; the error stops the engine anyway).
  auto fail = [&](const Status& s) {
    if (device_->SynchronizeStream(compute).ok() &&
        device_->SynchronizeStream(streams_.grad).ok() &&
        device_->SynchronizeStream(streams_.comm).ok()) {
      budget_->Free(scratch, scratch_bytes);
    }
    return s;
  };
#define ZINF_OR_FAIL(expr)                   \
  do {                                       \
    Status status_ = (expr);                 \
    if (!status_.ok()) return fail(status_); \
  } while (0)
  // What crosses the link, in device memory once `grad_stream` reaches it.
  const void* out = nullptr;
  if (one_rank_first) {
    // A compute stream running behind the host (a GPU): the gradient is copied (or rounded)
    // into device scratch on the compute stream (device bandwidth; the caller may then reuse
    // `grad`), and from there into its accumulator on the gradient stream, ordered by an
    // event: the compute stream never waits for the copy across PCIe.
    ZINF_OR_FAIL(bf16 ? device_->ConvertToBf16(static_cast<uint16_t*>(scratch), grad, n, compute)
                      : device_->CopyDeviceToDevice(scratch, grad, link_bytes, compute));
    ZINF_OR_FAIL(device_->RecordEvent(compute_done_.get(), compute));
    ZINF_OR_FAIL(device_->StreamWaitEvent(streams_.grad, compute_done_.get()));
    out = scratch;
  } else {
    float* full = static_cast<float*>(scratch);
    float* mine = full + p.padded_numel;
    ZINF_OR_FAIL(device_->CopyDeviceToDevice(full, grad, p.info.numel * sizeof(float), compute));
    if (p.padded_numel > p.info.numel) {
      ZINF_OR_FAIL(device_->CopyHostToDevice(
          full + p.info.numel, zeros_, (p.padded_numel - p.info.numel) * sizeof(float), compute));
    }
    ZINF_OR_FAIL(device_->RecordEvent(compute_done_.get(), compute));
    ZINF_OR_FAIL(device_->StreamWaitEvent(streams_.comm, compute_done_.get()));
    ZINF_OR_FAIL(comm_->ReduceScatterSum(full, mine, part, streams_.comm));
    ZINF_OR_FAIL(device_->RecordEvent(comm_done_.get(), streams_.comm));
    ZINF_OR_FAIL(device_->StreamWaitEvent(streams_.grad, comm_done_.get()));
    out = mine;
    if (bf16) {
      uint16_t* rounded = reinterpret_cast<uint16_t*>(mine + part);
      ZINF_OR_FAIL(device_->ConvertToBf16(rounded, mine, part, streams_.grad));
      out = rounded;
    }
  }
  const bool first = !flags_[id].seen_this_window;
  ZINF_OR_FAIL(EnsureBuffer(gi).WithContext("gradient of '" + p.info.name + "'"));
  float* acc = Acc(id);
  if (on_device) {
    // The accumulator is device memory: the partition is copied (first gradient of the
    // window, padding zeroed) or added there, on the gradient stream.
    ZINF_OR_FAIL(first ? device_->CopyDeviceToDevice(acc, out, n * sizeof(float), streams_.grad)
                       : device_->AddInto(acc, static_cast<const float*>(out), n, streams_.grad));
    if (first && part > n) {
      ZINF_OR_FAIL(
          device_->CopyHostToDevice(acc + n, zeros_, (part - n) * sizeof(float), streams_.grad));
    }
    MarkReduced(id);
    ZINF_OR_FAIL(LandAfterCopy(p, scratch, scratch_bytes, ready));
    return Status::OK();
  }
  if (first && !bf16) {
    // Straight into the accumulator; landed by a host function once copied.
    ZINF_OR_FAIL(stats_->TimeCopy(device_, streams_.grad, [&] {
      return device_->CopyDeviceToHost(acc, out, link_bytes, streams_.grad);
    }));
    MarkReduced(id);
    if (part > n) std::memset(acc + n, 0, (part - n) * sizeof(float));
    ZINF_OR_FAIL(LandAfterCopy(p, scratch, scratch_bytes, ready));
  } else {
    // Into pinned memory the adder thread then widens (bf16) and adds (a later micro-step)
    // into the accumulator. A first bf16 gradient lands in the first half of its own
    // accumulator and is widened in place, so it needs no staging.
    std::shared_ptr<PinnedBuffer> staging;
    void* dst = acc;
    if (!first) {
      Result<PinnedBuffer> buf = arena_->Allocate(link_bytes);
      if (!buf.ok()) {
        // The blocks of gradients in flight come back once copied and summed: wait for them.
        ZINF_OR_FAIL(device_->SynchronizeStream(streams_.grad));
        adder_->Drain();
        buf = arena_->Allocate(link_bytes);
      }
      if (!buf.ok())
        return fail(buf.status().WithContext("staging gradient of '" + p.info.name + "'"));
      staging = std::make_shared<PinnedBuffer>(std::move(buf).value());
      dst = staging->data();
    }
    // (`fail` below runs while `staging` is alive: the copy into it is waited for first.)
    ZINF_OR_FAIL(stats_->TimeCopy(device_, streams_.grad, [&] {
      return device_->CopyDeviceToHost(dst, out, link_bytes, streams_.grad);
    }));
    MarkReduced(id);
    if (first && part > n) std::memset(acc + n, 0, (part - n) * sizeof(float));
    // Once the copy has run, the scratch goes back and the widening or sum is handed to the
    // adder thread, which lands the gradient after it.
    ZINF_OR_FAIL(device_
                     ->LaunchHostFunc(
                         streams_.grad,
                         [this, scratch, scratch_bytes, n, bf16, acc, staging, gi, ready] {
                           budget_->Free(scratch, scratch_bytes);
                           adder_->Push([this, n, bf16, acc, staging, gi, ready] {
                             if (staging == nullptr) {
                               WidenInPlace(acc, n);
                             } else if (bf16) {
                               AddWidened(acc, static_cast<const uint16_t*>(staging->data()), n);
                             } else {
                               const float* add = static_cast<const float*>(staging->data());
                               for (size_t i = 0; i < n; ++i) acc[i] += add[i];
                             }
                             if (staging != nullptr) staging->Reset();
                             board_->Land(gi, ready);
                           });
                         })
                     .WithContext("landing the gradient of '" + p.info.name + "'"));
  }
#undef ZINF_OR_FAIL
  stats_->AddD2H(link_bytes);
  return Status::OK();
}

Status GradientPath::CompleteWindow(int64_t ready) {
  for (ParamId id = 0; id < flags_.size(); ++id) {
    const ParamLayout& p = layout_->param(id);
    if (flags_[id].reduced_this_micro || !p.info.trainable) continue;
    const size_t gi = p.info.sub_group;
    if (!flags_[id].seen_this_window) {
      Status s = WaitStepped(gi, ready - 1);
      if (!s.ok()) return s.WithContext("zero gradient of '" + p.info.name + "'");
      if (groups_[gi].data != nullptr && !groups_[gi].on_device) {
        std::memset(Acc(id), 0, p.info.partition_numel * sizeof(float));
      }
    }
    board_->Land(gi, ready);
  }
  return Status::OK();
}

Status GradientPath::WaitStepped(size_t gi, int64_t step) {
  if (!config_->delayed_update) return Status::OK();
  double waited = 0;
  Status s = board_->WaitStepped(gi, step, &waited);
  if (waited > 0) stats_->AddOptimizerWait(waited);
  return s;
}

Result<float> GradientPath::ClipCoefficient(int64_t step, CpuOptimizer* optimizer,
                                            HostCollectives* collectives, double* norm) {
  ZINF_ASSIGN_OR_RETURN(const double local, LocalSumSquares(optimizer));
  float total = static_cast<float>(local);
  ZINF_RETURN_IF_ERROR(
      collectives->AllReduceSum(&total, 1, device_->ComputeStream(), "gradient norm"));
  *norm = std::sqrt(static_cast<double>(total));
  if (!std::isfinite(*norm)) {
    // No sub-group has been stepped for good: they wait for the norm, or were stepped
    // speculatively and are rolled back (Engine::Step posts the failure); nothing non-finite
    // is written, and the step is refused as a whole.
    return Status::FailedPrecondition(
        "the gradient norm of step " + std::to_string(step) +
        " is not finite (a gradient holds inf or NaN): no parameter was updated; lower the "
        "learning rate or look at the loss, then resume from the last checkpoint");
  }
  return *norm > config_->gradient_clipping
             ? static_cast<float>(config_->gradient_clipping / (*norm + 1e-6))
             : 1.0f;
}

Result<double> GradientPath::LocalSumSquares(CpuOptimizer* optimizer) {
  // Accumulators on the device: summed there (all queued, then one wait), each parameter
  // that got no gradient in the window counting zero, as its zeroed host accumulator would.
  std::vector<GradStats> on_device(flags_.size());
  bool any = false;
  Status queued;
  for (ParamId id = 0; id < flags_.size() && queued.ok(); ++id) {
    const ParamLayout& p = layout_->param(id);
    if (!groups_[p.info.sub_group].on_device || !flags_[id].seen_this_window) continue;
    queued = device_->SumSquares(Acc(id), p.info.partition_numel, &on_device[id], streams_.grad)
                 .WithContext("gradient norm of '" + p.info.name + "'");
    any = true;
  }
  // Even after a failure: the sums queued write into `on_device` until the stream is done.
  Status synced = any ? device_->SynchronizeStream(streams_.grad) : Status::OK();
  ZINF_RETURN_IF_ERROR(queued);
  ZINF_RETURN_IF_ERROR(synced);
  double local = 0;
  for (ParamId id = 0; id < flags_.size(); ++id) {
    const ParamLayout& p = layout_->param(id);
    if (!p.info.trainable) continue;  // no gradient, no accumulator
    if (groups_[p.info.sub_group].on_device) {
      local += on_device[id].sum_squares;
      continue;
    }
    Result<GradStats> gs =
        optimizer->GradSumSquares(Acc(id), GradType::kF32, p.info.partition_numel);
    ZINF_RETURN_IF_ERROR(gs.status());
    local += gs->sum_squares;
  }
  return local;
}

}  // namespace zinf
