#include "engine/core/gradient_window.h"

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

GradientWindow::GradientWindow(const EngineContext& ctx, FetchScheduler* fetch,
                               GradientAdder* adder, BlockPool* grad_pool, bool streaming)
    : ctx_(ctx),
      fetch_(fetch),
      adder_(adder),
      grad_pool_(grad_pool),
      streaming_(streaming),
      flags_(ctx.layout->num_params()),
      groups_(ctx.layout->num_groups()) {}

GradientWindow::~GradientWindow() {
  adder_->Drain();  // its queued jobs write into this object's accumulators
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    // (Null while offload_states has them freed.)
    if (groups_[gi].on_device && groups_[gi].data != nullptr) {
      ctx_.budget->Free(groups_[gi].data, ctx_.layout->GroupGradBytes(gi));
    }
  }
  if (zeros_registered_) {
    Status s = ctx_.device->UnregisterHostMemory(zeros_);
    if (!s.ok()) LogWarning("closing the engine: " + s.ToString());
  }
  std::free(zeros_);
}

Status GradientWindow::Init() {
  ZINF_ASSIGN_OR_RETURN(compute_done_, ctx_.device->CreateEvent());
  ZINF_ASSIGN_OR_RETURN(comm_done_, ctx_.device->CreateEvent());
  // At most kPartitionAlign * world_size - 1 elements of padding per parameter.
  zeros_bytes_ = RoundUp(
      kPartitionAlign * static_cast<size_t>(ctx_.comm->world_size()) * sizeof(float), size_t{4096});
  zeros_ = static_cast<float*>(std::aligned_alloc(4096, zeros_bytes_));
  if (zeros_ == nullptr) {
    return Status::ResourceExhausted("cannot allocate " + std::to_string(zeros_bytes_) +
                                     " bytes of gradient padding");
  }
  std::memset(zeros_, 0, zeros_bytes_);
  ZINF_RETURN_IF_ERROR(ctx_.device->RegisterHostMemory(zeros_, zeros_bytes_)
                           .WithContext("registering the gradient padding"));
  zeros_registered_ = true;
  return Status::OK();
}

void GradientWindow::DeviceSlots(std::vector<DeviceSlot>* out) {
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    if (!groups_[gi].on_device || groups_[gi].data == nullptr) continue;
    float** slot = &groups_[gi].data;
    out->push_back({ctx_.layout->GroupGradBytes(gi), false,
                    "the gradient accumulators of sub-group " + std::to_string(gi),
                    [slot] { return static_cast<void*>(*slot); },
                    [slot](void* p) { *slot = static_cast<float*>(p); }});
  }
}

Status GradientWindow::AllocateGroup(size_t gi) {
  Group& g = groups_[gi];
  if (ctx_.layout->group(gi).on_device && ctx_.config->offload_param.tier == Tier::kDevice) {
    // Stepped on the device (OptimizerPipeline::StepGroupOnDevice): its gradients accumulate
    // in device memory, planned with the rest of it. Only reduced parameters are read (the
    // others are not stepped, and count zero in the clipping norm), so no zeroing.
    const size_t bytes = ctx_.layout->GroupGradBytes(gi);
    ZINF_ASSIGN_OR_RETURN(void* d, ctx_.budget->Alloc(bytes, "device gradient accumulators"));
    ctx_.budget->Plan(bytes);
    g.on_device = true;
    g.data = static_cast<float*>(d);
    return Status::OK();
  }
  if (streaming_) return Status::OK();
  ZINF_ASSIGN_OR_RETURN(g.grads, ctx_.arena->Allocate(ctx_.layout->GroupGradBytes(gi)));
  std::memset(g.grads.data(), 0, g.grads.capacity());
  g.data = static_cast<float*>(g.grads.data());
  return Status::OK();
}

float* GradientWindow::Acc(ParamId id) const {
  const ParamLayout& p = ctx_.layout->param(id);
  return groups_[p.info.sub_group].data + p.slice_offset;
}

void GradientWindow::BeginMicroStep() {
  for (Flags& f : flags_) f.reduced_this_micro = false;
  reduced_this_micro_ = false;
}

void GradientWindow::EndWindow() {
  for (Flags& f : flags_) f.seen_this_window = false;
}

std::string GradientWindow::Unreduced(size_t gi) const {
  for (ParamId q : ctx_.layout->group(gi).params) {
    if (ctx_.layout->param(q).info.trainable && !flags_[q].reduced_this_micro) {
      return ctx_.layout->param(q).info.name;
    }
  }
  return std::string();
}

void GradientWindow::MarkReduced(ParamId id, int64_t ready) {
  const ParamLayout& p = ctx_.layout->param(id);
  flags_[id].seen_this_window = true;
  // (A layer-major window's earlier micro-batches: the parameter's last gradient is to come.)
  if (ready != kNotLast) {
    flags_[id].reduced_this_micro = true;
    reduced_this_micro_ = true;
  }
  ctx_.board->MarkHasGrad(p.info.sub_group, p.index_in_group);
}

Status GradientWindow::EnsureBuffer(size_t gi) {
  Group& g = groups_[gi];
  if (g.data != nullptr) return Status::OK();
  if (!streaming_) return Status::Internal("gradient accumulators missing");
  // Wait for a free block; give up when the optimizer failed (it frees no more) or makes no
  // progress for a long time (it frees a sub-group's block after each step, so a stall means
  // it is stuck).
  return ctx_.board->WaitForGradBlock(
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

Result<GradientWindow::ReadyGroup> GradientWindow::WaitReady(size_t gi, const OptimizerTask& task,
                                                             bool speculate) {
  const Group& g = groups_[gi];
  ZINF_ASSIGN_OR_RETURN(
      GroupBoard::GroupReady board,
      ctx_.board->WaitGroupReady(gi, task, speculate,
                                 /*allow_partial=*/!g.on_device && !task.needs_norm));
  ReadyGroup ready;
  static_cast<GroupBoard::GroupReady&>(ready) = std::move(board);
  ready.grads = g.data;
  ready.on_device = g.on_device;
  return ready;
}

void GradientWindow::Release(size_t gi, int64_t step) {
  ReleaseBuffer(gi);
  ctx_.board->MarkStepped(gi, step);
}

void GradientWindow::ReleaseBuffer(size_t gi) {
  Group& g = groups_[gi];
  if (g.block.data() == nullptr) return;
  g.data = nullptr;
  g.block.Reset();
  ctx_.board->NoteGradRelease();
}

Status GradientWindow::LandAfterCopy(const ParamLayout& p, void* scratch, size_t scratch_bytes,
                                     int64_t ready) {
  const size_t gi = p.info.sub_group;
  return ctx_.device
      ->LaunchHostFunc(ctx_.streams.grad,
                       [this, scratch, scratch_bytes, gi, ready] {
                         ctx_.budget->Free(scratch, scratch_bytes);
                         ctx_.board->Land(gi, ready);
                       })
      .WithContext("landing the gradient of '" + p.info.name + "'");
}

Status GradientWindow::Reduce(ParamId id, const float* grad, int64_t ready) {
  const ParamLayout& p = ctx_.layout->param(id);
  ReduceJob job;
  job.id = id;
  job.p = &p;
  job.gi = p.info.sub_group;
  job.ready = ready;
  const size_t part = p.info.partition_numel;
  // Accumulated on the device (a sub-group the device steps): nothing crosses the link.
  job.on_device = groups_[job.gi].on_device;
  job.bf16 = ctx_.config->gradient_transfer_bf16 && !job.on_device;
  // One rank, first gradient of the window: the reduction is the identity.
  job.one_rank_first = ctx_.comm->world_size() == 1 && !flags_[id].seen_this_window;
  // The gradient straight into its accumulator on the compute stream (one copy, no device
  // scratch): one rank's first gradient when the accumulator is device memory, or, on the
  // host device whose compute stream is the caller, host memory. (Not with bf16 transfer: the
  // general path rounds on the device, so the link carries the halved bytes it counts.)
  if (job.one_rank_first && (job.on_device || (ctx_.device->ComputeRunsInline() && !job.bf16))) {
    return ReduceInline(job, grad);
  }
  ZINF_RETURN_IF_ERROR(fetch_->MakeRoom(0, 0, id));
  // Device scratch. One rank's first gradient: the copy out of the caller's buffer (fp32, or
  // bf16 when rounded). Otherwise: the padded full gradient, this rank's reduced partition,
  // and (bf16) the partition rounded.
  job.n = job.one_rank_first ? p.info.numel : part;
  job.link_bytes = job.n * (job.bf16 ? 2 : 4);
  job.scratch_bytes = job.one_rank_first
                          ? job.link_bytes
                          : p.padded_numel * sizeof(float) + part * sizeof(float) +
                                (job.bf16 ? part * 2 : 0) + QuantizedReduceBytes(p, *ctx_.config);
  ZINF_ASSIGN_OR_RETURN(job.scratch,
                        ctx_.budget->Alloc(job.scratch_bytes, "gradient of '" + p.info.name + "'"));
  ctx_.budget->PlanScratch(job.scratch_bytes);
  const void* out = nullptr;  // what crosses the link, in device memory
  Status s = StageForLink(job, grad, &out);
  job.first = !flags_[id].seen_this_window;
  if (s.ok()) s = EnsureBuffer(job.gi).WithContext("gradient of '" + p.info.name + "'");
  if (!s.ok()) return ReleaseScratch(job, s);
  float* acc = Acc(id);
  if (job.on_device) return AccumulateOnDevice(job, out, acc);
  ZINF_RETURN_IF_ERROR(job.first && !job.bf16 ? CopyToAccumulator(job, out, acc)
                                              : StageForAdder(job, out, acc));
  ctx_.stats->AddD2H(job.link_bytes);
  return Status::OK();
}

Status GradientWindow::ReduceInline(const ReduceJob& job, const float* grad) {
  const ParamLayout& p = *job.p;
  const ParamId id = job.id;
  const size_t part = p.info.partition_numel;
  const size_t numel = p.info.numel;
  Stream* compute = ctx_.device->ComputeStream();
  ZINF_RETURN_IF_ERROR(EnsureBuffer(job.gi).WithContext("gradient of '" + p.info.name + "'"));
  float* acc = Acc(id);
  const size_t bytes = numel * sizeof(float);
  MarkReduced(id, job.ready);
  if (job.on_device) {
    ZINF_RETURN_IF_ERROR(ctx_.device->CopyDeviceToDevice(acc, grad, bytes, compute));
    if (part > numel) {
      ZINF_RETURN_IF_ERROR(ctx_.device->CopyHostToDevice(acc + numel, zeros_,
                                                         (part - numel) * sizeof(float), compute));
    }
  } else {
    // At the window's end (`ready`) and without a global norm to wait for (clipping, fp16:
    // the norm needs every gradient whole), a large gradient is copied in pieces and each but the
    // last announced as it is copied (the copies on this inline stream are done when they return;
    // the last lands with Land below): if it is the sub-group's last gradient still to land, the
    // optimizer steps what has landed while the rest is copied (GroupBoard::LandPiece; MarkReduced
    // came first, so the has-grad flag is set before the optimizer takes the flags).
    const bool pieces = job.ready > 0 && !WaitsForGlobalNorm(*ctx_.config);
    const size_t piece = pieces ? RoundUp((numel + kLandPieces - 1) / kLandPieces, kLandPieceAlign)
                                : std::max<size_t>(numel, 1);
    for (size_t begin = 0; begin < numel; begin += piece) {
      const size_t end = std::min(numel, begin + piece);
      ZINF_RETURN_IF_ERROR(ctx_.stats->TimeCopy(ctx_.device, compute, [&] {
        return ctx_.device->CopyDeviceToHost(acc + begin, grad + begin,
                                             (end - begin) * sizeof(float), compute);
      }));
      if (pieces && end < numel) ctx_.board->LandPiece(job.gi, p.index_in_group, end, job.ready);
    }
    if (part > numel) std::memset(acc + numel, 0, (part - numel) * sizeof(float));
    ctx_.stats->AddD2H(bytes);
  }
  ZINF_RETURN_IF_ERROR(ctx_.device->RecordEvent(compute_done_.get(), compute));
  ZINF_RETURN_IF_ERROR(ctx_.device->StreamWaitEvent(ctx_.streams.grad, compute_done_.get()));
  const size_t gi = job.gi;
  const int64_t ready = job.ready;
  return ctx_.device
      ->LaunchHostFunc(ctx_.streams.grad, [this, gi, ready] { ctx_.board->Land(gi, ready); })
      .WithContext("landing the gradient of '" + p.info.name + "'");
}

Status GradientWindow::StageForLink(const ReduceJob& job, const float* grad, const void** out) {
  const ParamLayout& p = *job.p;
  Device* device = ctx_.device;
  Stream* compute = device->ComputeStream();
  if (job.one_rank_first) {
    // A compute stream running behind the host (a GPU): the gradient is copied (or rounded)
    // into device scratch on the compute stream (device bandwidth; the caller may then reuse
    // `grad`), and from there into its accumulator on the gradient stream, ordered by an
    // event: the compute stream never waits for the copy across PCIe.
    Status s =
        job.bf16 ? device->ConvertToBf16(static_cast<uint16_t*>(job.scratch), grad, job.n, compute)
                 : device->CopyDeviceToDevice(job.scratch, grad, job.link_bytes, compute);
    if (s.ok()) s = device->RecordEvent(compute_done_.get(), compute);
    if (s.ok()) s = device->StreamWaitEvent(ctx_.streams.grad, compute_done_.get());
    *out = job.scratch;
    return s;
  }
  const size_t part = p.info.partition_numel;
  float* full = static_cast<float*>(job.scratch);
  float* mine = full + p.padded_numel;
  Status s = device->CopyDeviceToDevice(full, grad, p.info.numel * sizeof(float), compute);
  if (s.ok() && p.padded_numel > p.info.numel) {
    s = device->CopyHostToDevice(full + p.info.numel, zeros_,
                                 (p.padded_numel - p.info.numel) * sizeof(float), compute);
  }
  if (s.ok()) s = device->RecordEvent(compute_done_.get(), compute);
  if (s.ok()) s = device->StreamWaitEvent(ctx_.streams.comm, compute_done_.get());
  if (s.ok()) s = ReduceScatter(job, full, mine);
  if (s.ok()) s = device->RecordEvent(comm_done_.get(), ctx_.streams.comm);
  if (s.ok()) s = device->StreamWaitEvent(ctx_.streams.grad, comm_done_.get());
  *out = mine;
  if (s.ok() && job.bf16) {
    uint16_t* rounded = reinterpret_cast<uint16_t*>(mine + part);
    s = device->ConvertToBf16(rounded, mine, part, ctx_.streams.grad);
    *out = rounded;
  }
  return s;
}

// zero_quantized_gradients' encoding of n fp32 values on the comm stream: int8, or int4 with
// zinf.quantized_gradient_bits 4, in blocks of zinf.quantization_block_size
// (GradientBlockBytes(n) bytes).
Status GradientWindow::Encode(void* dst, const float* src, size_t n) {
  const size_t block = ctx_.config->quantization_block_size;
  if (ctx_.config->quantized_gradient_bits == 4) {
    return ctx_.device->QuantizeInt4(dst, src, n, block, ctx_.streams.comm);
  }
  return ctx_.device->QuantizeInt8(dst, src, ParamCopyType::kNone, n, block, ctx_.streams.comm);
}

Status GradientWindow::Decode(float* dst, const void* src, size_t n) {
  const size_t block = ctx_.config->quantization_block_size;
  if (ctx_.config->quantized_gradient_bits == 4) {
    return ctx_.device->DequantizeInt4(dst, src, n, block, ctx_.streams.comm);
  }
  return ctx_.device->DequantizeInt8(dst, ParamCopyType::kNone, src, n, block, ctx_.streams.comm);
}

Status GradientWindow::ReduceScatter(const ReduceJob& job, float* full, float* mine) {
  const size_t part = job.p->info.partition_numel;
  Stream* comm = ctx_.streams.comm;
  const size_t quant = QuantizedReduceBytes(*job.p, *ctx_.config);
  if (quant == 0) return ctx_.comm->ReduceScatterSum(full, mine, part, comm);
  if (QuantizedReduceHops(*job.p, *ctx_.config) == 2 && ctx_.node_comm != nullptr &&
      ctx_.cross_comm != nullptr) {
    return ReduceScatterTwoHops(job, full, mine);
  }
  // zero_quantized_gradients: each rank's partitions of this gradient as int8 (or int4)
  // blocks, one to each owner in an all-to-all, decoded and summed in rank order there: ((g0 + g1)
  // + g2)..., as LocalComm and GlooComm add. The blocks sent are the scratch's tail; those received
  // and one decoded partition go into `full`, which the encoding (earlier on this stream) has read.
  const int world = ctx_.comm->world_size();
  const size_t blocks = GradientBlockBytes(part, *ctx_.config);
  char* send = static_cast<char*>(job.scratch) + job.scratch_bytes - quant;
  char* recv = reinterpret_cast<char*>(full);
  float* decoded = reinterpret_cast<float*>(recv + world * blocks);
  Device* device = ctx_.device;
  Status s;
  const size_t block = ctx_.config->quantization_block_size;
  if (part % block == 0) {  // every partition starts a block: one launch
    s = Encode(send, full, part * world);
  }
  for (int k = 0; s.ok() && part % block != 0 && k < world; ++k) {
    s = Encode(send + k * blocks, full + k * part, part);
  }
  if (s.ok()) s = ctx_.comm->AllToAll(send, recv, blocks, comm);
  if (s.ok()) s = Decode(mine, recv, part);
  for (int k = 1; s.ok() && k < world; ++k) {
    s = Decode(decoded, recv + k * blocks, part);
    if (s.ok()) s = device->AddInto(mine, decoded, part, comm);
  }
  return s;
}

Status GradientWindow::ReduceScatterTwoHops(const ReduceJob& job, float* full, float* mine) {
  // Ranks are (node n, place l), rank = n * K + l; partition q belongs to rank q.
  //   Hop 1, inside the node: this rank sends node peer l' the blocks of the partitions
  //   n' * K + l' (every node n'), and sums what its node sent it for n' * K + l, node peer by
  //   node peer in order: one fp32 sum per node n'.
  //   Hop 2, across the nodes (the ranks of place l): the sum for node n' goes, re-encoded,
  //   to the rank of node n', which decodes and sums them in node order. So partition q is
  //   sum over n (sum over l of g_{n,l}[q]), each rank's and each node sum's encoding off by
  //   its block's largest magnitude / 254 (int4: / 14); a NaN anywhere reaches the owner as NaN.
  // Memory: the blocks sent are the scratch's tail (world x blocks, used again for hop 2's);
  // hop 1's blocks received, then the N node sums (fp32), go into `full`, which the encoding
  // has read; `mine` is the decoding's temporary until the last sum; hop 2's blocks received
  // go to the front of `full` (hop 1's are decoded by then), and the node sums' place is the
  // last decoding's temporary.
  const size_t part = job.p->info.partition_numel;
  const int k = ctx_.node_comm->world_size();
  const int nodes = ctx_.cross_comm->world_size();
  const size_t blocks = GradientBlockBytes(part, *ctx_.config);
  Stream* comm = ctx_.streams.comm;
  Device* device = ctx_.device;
  char* send = static_cast<char*>(job.scratch) + job.scratch_bytes -
               QuantizedReduceBytes(*job.p, *ctx_.config);
  char* recv = reinterpret_cast<char*>(full);
  float* sums = reinterpret_cast<float*>(recv + static_cast<size_t>(k) * nodes * blocks);
  Status s;
  for (int to = 0; s.ok() && to < k; ++to) {
    for (int n = 0; s.ok() && n < nodes; ++n) {
      const size_t q = static_cast<size_t>(n) * k + to;
      s = Encode(send + (static_cast<size_t>(to) * nodes + n) * blocks, full + q * part, part);
    }
  }
  if (s.ok()) s = ctx_.node_comm->AllToAll(send, recv, nodes * blocks, comm);
  for (int n = 0; s.ok() && n < nodes; ++n) {
    float* sum = sums + static_cast<size_t>(n) * part;
    s = Decode(sum, recv + static_cast<size_t>(n) * blocks, part);
    for (int from = 1; s.ok() && from < k; ++from) {
      s = Decode(mine, recv + (static_cast<size_t>(from) * nodes + n) * blocks, part);
      if (s.ok()) s = device->AddInto(sum, mine, part, comm);
    }
  }
  for (int n = 0; s.ok() && n < nodes; ++n) {
    s = Encode(send + static_cast<size_t>(n) * blocks, sums + static_cast<size_t>(n) * part, part);
  }
  if (s.ok()) s = ctx_.cross_comm->AllToAll(send, recv, blocks, comm);
  if (s.ok()) s = Decode(mine, recv, part);
  for (int n = 1; s.ok() && n < nodes; ++n) {
    s = Decode(sums, recv + static_cast<size_t>(n) * blocks, part);
    if (s.ok()) s = device->AddInto(mine, sums, part, comm);
  }
  return s;
}

Status GradientWindow::AccumulateOnDevice(const ReduceJob& job, const void* out, float* acc) {
  const size_t part = job.p->info.partition_numel;
  const size_t n = job.n;
  Stream* grad = ctx_.streams.grad;
  // The accumulator is device memory: the partition is copied (first gradient of the
  // window, padding zeroed) or added there, on the gradient stream.
  Status s = job.first ? ctx_.device->CopyDeviceToDevice(acc, out, n * sizeof(float), grad)
                       : ctx_.device->AddInto(acc, static_cast<const float*>(out), n, grad);
  if (s.ok() && job.first && part > n) {
    s = ctx_.device->CopyHostToDevice(acc + n, zeros_, (part - n) * sizeof(float), grad);
  }
  if (!s.ok()) return ReleaseScratch(job, s);
  MarkReduced(job.id, job.ready);
  s = LandAfterCopy(*job.p, job.scratch, job.scratch_bytes, job.ready);
  return s.ok() ? s : ReleaseScratch(job, s);
}

Status GradientWindow::CopyToAccumulator(const ReduceJob& job, const void* out, float* acc) {
  const size_t part = job.p->info.partition_numel;
  const size_t n = job.n;
  // Straight into the accumulator; landed by a host function once copied.
  Status s = ctx_.stats->TimeCopy(ctx_.device, ctx_.streams.grad, [&] {
    return ctx_.device->CopyDeviceToHost(acc, out, job.link_bytes, ctx_.streams.grad);
  });
  if (!s.ok()) return ReleaseScratch(job, s);
  MarkReduced(job.id, job.ready);
  if (part > n) std::memset(acc + n, 0, (part - n) * sizeof(float));
  s = LandAfterCopy(*job.p, job.scratch, job.scratch_bytes, job.ready);
  return s.ok() ? s : ReleaseScratch(job, s);
}

Status GradientWindow::StageForAdder(const ReduceJob& job, const void* out, float* acc) {
  const ParamLayout& p = *job.p;
  const size_t part = p.info.partition_numel;
  const size_t n = job.n;
  const bool bf16 = job.bf16;
  // A first bf16 gradient lands in the first half of its own accumulator and is widened in
  // place, so it needs no staging.
  std::shared_ptr<PinnedBuffer> staging;
  void* dst = acc;
  if (!job.first) {
    Result<PinnedBuffer> buf = ctx_.arena->Allocate(job.link_bytes);
    if (!buf.ok()) {
      // The blocks of gradients in flight come back once copied and summed: wait for them.
      Status s = ctx_.device->SynchronizeStream(ctx_.streams.grad);
      if (!s.ok()) return ReleaseScratch(job, s);
      adder_->Drain();
      buf = ctx_.arena->Allocate(job.link_bytes);
    }
    if (!buf.ok()) {
      return ReleaseScratch(job,
                            buf.status().WithContext("staging gradient of '" + p.info.name + "'"));
    }
    staging = std::make_shared<PinnedBuffer>(std::move(buf).value());
    dst = staging->data();
  }
  // (ReleaseScratch below runs while `staging` is alive: the copy into it is waited for first.)
  Status s = ctx_.stats->TimeCopy(ctx_.device, ctx_.streams.grad, [&] {
    return ctx_.device->CopyDeviceToHost(dst, out, job.link_bytes, ctx_.streams.grad);
  });
  if (!s.ok()) return ReleaseScratch(job, s);
  MarkReduced(job.id, job.ready);
  if (job.first && part > n) std::memset(acc + n, 0, (part - n) * sizeof(float));
  // Once the copy has run, the scratch goes back and the widening or sum is handed to the
  // adder thread, which lands the gradient after it.
  void* scratch = job.scratch;
  const size_t scratch_bytes = job.scratch_bytes;
  const size_t gi = job.gi;
  const int64_t ready = job.ready;
  s = ctx_.device
          ->LaunchHostFunc(ctx_.streams.grad,
                           [this, scratch, scratch_bytes, n, bf16, acc, staging, gi, ready] {
                             ctx_.budget->Free(scratch, scratch_bytes);
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
                               ctx_.board->Land(gi, ready);
                             });
                           })
          .WithContext("landing the gradient of '" + p.info.name + "'");
  return s.ok() ? s : ReleaseScratch(job, s);
}

Status GradientWindow::ReleaseScratch(const ReduceJob& job, const Status& s) {
  Stream* compute = ctx_.device->ComputeStream();
  if (ctx_.device->SynchronizeStream(compute).ok() &&
      ctx_.device->SynchronizeStream(ctx_.streams.grad).ok() &&
      ctx_.device->SynchronizeStream(ctx_.streams.comm).ok()) {
    ctx_.budget->Free(job.scratch, job.scratch_bytes);
  }
  return s;
}

Status GradientWindow::CompleteWindow(int64_t ready) {
  for (ParamId id = 0; id < flags_.size(); ++id) {
    const ParamLayout& p = ctx_.layout->param(id);
    if (flags_[id].reduced_this_micro || !p.info.trainable) continue;
    const size_t gi = p.info.sub_group;
    if (!flags_[id].seen_this_window) {
      Status s = WaitStepped(gi, ready - 1);
      if (!s.ok()) return s.WithContext("zero gradient of '" + p.info.name + "'");
      if (groups_[gi].data != nullptr && !groups_[gi].on_device) {
        std::memset(Acc(id), 0, p.info.partition_numel * sizeof(float));
      }
    }
    ctx_.board->Land(gi, ready);
  }
  return Status::OK();
}

Status GradientWindow::WaitStepped(size_t gi, int64_t step) {
  if (!ctx_.config->delayed_update) return Status::OK();
  double waited = 0;
  Status s = ctx_.board->WaitStepped(gi, step, &waited);
  if (waited > 0) ctx_.stats->AddOptimizerWait(waited);
  return s;
}

Result<double> GradientWindow::GlobalNorm(CpuOptimizer* optimizer, HostCollectives* collectives) {
  ZINF_ASSIGN_OR_RETURN(const double local, LocalSumSquares(optimizer));
  float total = static_cast<float>(local);
  ZINF_RETURN_IF_ERROR(
      collectives->AllReduceSum(&total, 1, ctx_.device->ComputeStream(), "gradient norm"));
  return std::sqrt(static_cast<double>(total));
}

Result<double> GradientWindow::LocalSumSquares(CpuOptimizer* optimizer) {
  // Accumulators on the device: summed there (all queued, then one wait), each parameter
  // that got no gradient in the window counting zero, as its zeroed host accumulator would.
  std::vector<GradStats> on_device(flags_.size());
  bool any = false;
  Status queued;
  for (ParamId id = 0; id < flags_.size() && queued.ok(); ++id) {
    const ParamLayout& p = ctx_.layout->param(id);
    if (!groups_[p.info.sub_group].on_device || !flags_[id].seen_this_window) continue;
    queued =
        ctx_.device->SumSquares(Acc(id), p.info.partition_numel, &on_device[id], ctx_.streams.grad)
            .WithContext("gradient norm of '" + p.info.name + "'");
    any = true;
  }
  // Even after a failure: the sums queued write into `on_device` until the stream is done.
  Status synced = any ? ctx_.device->SynchronizeStream(ctx_.streams.grad) : Status::OK();
  ZINF_RETURN_IF_ERROR(queued);
  ZINF_RETURN_IF_ERROR(synced);
  double local = 0;
  for (ParamId id = 0; id < flags_.size(); ++id) {
    const ParamLayout& p = ctx_.layout->param(id);
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
