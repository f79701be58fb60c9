#include "train/trainer.h"

#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "train/kernels.h"
#include "train/model_ops.h"
#include "train/param_transfer.h"
#include "zinf/crash_point.h"

namespace zinf::train {

namespace {

// The micro-batches a layer-major window keeps (0: the micro-batch schedule).
int WindowOf(const EngineConfig& c) {
  return c.layer_major ? std::max(1, c.gradient_accumulation_steps) : 0;
}

// What one block saves for its backward (memory of the trainer's ModelOps).
struct BlockActs {
  float* x = nullptr;  // input of the block (residual stream)
  float *ln1 = nullptr, *ln1_mean = nullptr, *ln1_rstd = nullptr, *qkv = nullptr, *att = nullptr,
        *atty = nullptr, *xmid = nullptr, *ln2 = nullptr, *ln2_mean = nullptr, *ln2_rstd = nullptr,
        *fch = nullptr, *fcg = nullptr;
};

}  // namespace

struct GptTrainer::Impl {
  Engine* engine = nullptr;
  // Where the math runs: the CPU (host device) or the GPU (a CUDA device). Every buffer
  // below is memory of `ops`.
  std::unique_ptr<ModelOps> ops;
  // How acquired parameters reach `ops` and gradients reach the engine: in place, or staged
  // through the device's copy API (hooks.stage_through_device); chosen by Create.
  std::unique_ptr<ParamTransfer> transfer;
  ~Impl() {
    ops.reset();  // drains the GPU's work before the engine's buffers (and the transfer's) go
  }
  TrainerHooks hooks;
  GptConfig m;
  int B = 0, T = 0, N = 0, C = 0, NH = 0, V = 0, L = 0;
  bool half = false;  // the engine stores 16-bit parameters: bf16 or fp16 (half_type)
  ParamCopyType half_type = ParamCopyType::kNone;
  std::vector<GptParam> list;
  std::vector<ParamId> ids;  // per ParamList entry

  std::vector<BlockActs> acts;  // per block
  float *x_final = nullptr, *lnf = nullptr, *lnf_mean = nullptr, *lnf_rstd = nullptr,
        *logits = nullptr, *dlogits = nullptr;
  float* wconv = nullptr;  // fp32 copies of an acquired group (16-bit storage)
  float* grads = nullptr;  // gradients of one group
  float *dres = nullptr, *dxmid = nullptr, *dln = nullptr, *datty = nullptr, *dqkv = nullptr,
        *dfch = nullptr, *dfcg = nullptr, *tmp = nullptr;
  float *dwte = nullptr, *dwpe = nullptr;
  int32_t *tokens = nullptr, *targets = nullptr;
  // zinf.schedule layer-major: the micro-batches of a window (0: the micro-batch schedule)
  // and what the window keeps per micro-batch j: each block's input (wx; l = L: the final
  // LayerNorm's), dL/dx on its way down (wdres), wte's gradient (wdwte: the head's share,
  // then the embedding's), the tokens and targets.
  int window = 0;
  float *wx = nullptr, *wdres = nullptr, *wdwte = nullptr;
  int32_t *wtokens = nullptr, *wtargets = nullptr;
  float* X(int l, int j) const { return wx + (static_cast<size_t>(l) * window + j) * N * C; }
  float* Dres(int j) const { return wdres + static_cast<size_t>(j) * N * C; }
  float* Dwte(int j) const { return wdwte + static_cast<size_t>(j) * list[0].numel(); }
  std::vector<float> observed;  // host copy of a device gradient for hooks.grad_observer

  ParamId wte() const { return ids[0]; }
  ParamId wpe() const { return ids[1]; }
  size_t BlockIndex(int l, int k) const { return 2 + static_cast<size_t>(l) * kBlockParams + k; }
  size_t LnfIndex() const { return 2 + static_cast<size_t>(L) * kBlockParams; }
  std::vector<ParamId> BlockIds(int l) const {
    std::vector<ParamId> out;
    for (int k = 0; k < kBlockParams; ++k) out.push_back(ids[BlockIndex(l, k)]);
    return out;
  }
  std::vector<ParamId> HeadIds() const { return {ids[LnfIndex()], ids[LnfIndex() + 1], wte()}; }

  void SetShape(const GptConfig& model, int batch, int seq, bool half_storage, int window_size) {
    m = model;
    window = window_size;
    B = batch;
    T = seq;
    N = batch * seq;
    C = model.d_model;
    NH = model.heads;
    V = model.vocab;
    L = model.layers;
    half = half_storage;
    list = ParamList(model);
  }
  ModelDims Dims() const { return ModelDims{B, T, C, NH, V}; }
  // Elements of the largest acquired group: a block, the embeddings or the head.
  size_t LargestGroup() const {
    size_t block = 0;
    for (int k = 0; k < kBlockParams; ++k) block += list[BlockIndex(0, k)].numel();
    const size_t embed = list[0].numel() + list[1].numel();
    const size_t head = 2 * static_cast<size_t>(C) + list[0].numel();
    return std::max({block, embed, head});
  }
  // Every activation and gradient buffer, from the given allocators (the ops' memory, or a
  // counter for DeviceBytes).
  template <typename Floats, typename Ints>
  Status AllocateBuffers(const Floats& floats, const Ints& ints) {
    const size_t n = N;
    // Element counts as checked products of the shape: a product that does not fit (absurd
    // --batch / --seq / --d-model) is refused here, never allocated at its wrapped size.
    auto get = [&](float** p, std::initializer_list<size_t> factors) -> Status {
      size_t count = 1;
      for (size_t f : factors) {
        if (__builtin_mul_overflow(count, f, &count) || count > (SIZE_MAX >> 4)) {
          return Status::InvalidArgument("the trainer's buffers for --batch " + std::to_string(B) +
                                         " x --seq " + std::to_string(T) + " at --d-model " +
                                         std::to_string(C) +
                                         " are larger than any memory; lower --batch or --seq");
        }
      }
      ZINF_ASSIGN_OR_RETURN(*p, floats(count));
      return Status::OK();
    };
    const size_t c = static_cast<size_t>(C);
    acts.resize(L);
    for (BlockActs& a : acts) {
      for (float** p : {&a.x, &a.ln1, &a.atty, &a.xmid, &a.ln2}) {
        ZINF_RETURN_IF_ERROR(get(p, {n, c}));
      }
      for (float** p : {&a.ln1_mean, &a.ln1_rstd, &a.ln2_mean, &a.ln2_rstd}) {
        ZINF_RETURN_IF_ERROR(get(p, {n}));
      }
      ZINF_RETURN_IF_ERROR(get(&a.qkv, {3, n, c}));
      ZINF_RETURN_IF_ERROR(get(&a.att, {static_cast<size_t>(B), static_cast<size_t>(NH),
                                        static_cast<size_t>(T), static_cast<size_t>(T)}));
      ZINF_RETURN_IF_ERROR(get(&a.fch, {4, n, c}));
      ZINF_RETURN_IF_ERROR(get(&a.fcg, {4, n, c}));
    }
    for (float** p : {&x_final, &lnf, &dres, &dxmid, &dln, &datty, &tmp}) {
      ZINF_RETURN_IF_ERROR(get(p, {n, c}));
    }
    ZINF_RETURN_IF_ERROR(get(&lnf_mean, {n}));
    ZINF_RETURN_IF_ERROR(get(&lnf_rstd, {n}));
    ZINF_RETURN_IF_ERROR(get(&logits, {n, static_cast<size_t>(V)}));
    ZINF_RETURN_IF_ERROR(get(&dlogits, {n, static_cast<size_t>(V)}));
    if (half) ZINF_RETURN_IF_ERROR(get(&wconv, {LargestGroup()}));
    size_t block = 0;
    for (int k = 0; k < kBlockParams; ++k) block += list[BlockIndex(0, k)].numel();
    ZINF_RETURN_IF_ERROR(get(&grads, {block}));
    ZINF_RETURN_IF_ERROR(get(&dqkv, {3, n, c}));
    ZINF_RETURN_IF_ERROR(get(&dfch, {4, n, c}));
    ZINF_RETURN_IF_ERROR(get(&dfcg, {4, n, c}));
    ZINF_RETURN_IF_ERROR(get(&dwte, {list[0].numel()}));
    ZINF_RETURN_IF_ERROR(get(&dwpe, {list[1].numel()}));
    ZINF_ASSIGN_OR_RETURN(tokens, ints(n));
    ZINF_ASSIGN_OR_RETURN(targets, ints(n));
    if (window > 0) {
      const size_t k = static_cast<size_t>(window);
      ZINF_RETURN_IF_ERROR(get(&wx, {static_cast<size_t>(L) + 1, k, n, c}));
      ZINF_RETURN_IF_ERROR(get(&wdres, {k, n, c}));
      ZINF_RETURN_IF_ERROR(get(&wdwte, {k, list[0].numel()}));
      ZINF_ASSIGN_OR_RETURN(wtokens, ints(k * n));
      ZINF_ASSIGN_OR_RETURN(wtargets, ints(k * n));
    }
    return Status::OK();
  }

  // The acquire sequence of one micro-step, as the engine's prefetch hint.
  std::vector<ParamId> AcquireOrder() const {
    std::vector<ParamId> order = {wte(), wpe()};
    for (int l = 0; l < L; ++l) {
      for (ParamId id : BlockIds(l)) order.push_back(id);
    }
    for (ParamId id : HeadIds()) order.push_back(id);
    for (int l = L - 1; l >= 0; --l) {
      for (ParamId id : BlockIds(l)) order.push_back(id);
    }
    return order;
  }

  // With bf16 storage, a block's four weight matrices are used as bf16 (on the CPU by the
  // Matmul*Bf16 kernels, read once and widened in registers, for few tokens; on the GPU by
  // cuBLAS bf16 GEMMs) instead of an fp32 copy.
  bool bf16_matmul = false;
  static bool IsBlockMatrix(int k) {
    return k == kQkvW || k == kAttnProjW || k == kFcW || k == kMlpProjW;
  }
  std::vector<const uint16_t*> raw16;  // the acquired group's bf16 matrices (else null)

  // Acquires `group` and returns fp32 pointers to the full parameters (converted from bf16 or
  // fp16 into wconv when the engine stores them so; for a block with bf16_matmul, its weight
  // matrices stay bf16 in raw16 and their fp32 pointer is null).
  Result<std::vector<const float*>> AcquireFp32(const std::vector<ParamId>& group,
                                                bool block = false) {
    ZINF_ASSIGN_OR_RETURN(std::vector<void*> raw, transfer->Acquire(group));
    std::vector<const float*> out(group.size());
    raw16.assign(group.size(), nullptr);
    size_t cursor = 0;
    for (size_t i = 0; i < group.size(); ++i) {
      const size_t n = engine->param(group[i]).numel;
      if (half && block && bf16_matmul && IsBlockMatrix(static_cast<int>(i))) {
        raw16[i] = static_cast<const uint16_t*>(raw[i]);
        out[i] = nullptr;
      } else if (half) {
        const auto* src = static_cast<const uint16_t*>(raw[i]);
        if (half_type == ParamCopyType::kF16) {
          ops->F16ToFp32(wconv + cursor, src, n);
        } else {
          ops->Bf16ToFp32(wconv + cursor, src, n);
        }
        out[i] = wconv + cursor;
        cursor += n;
      } else {
        out[i] = static_cast<const float*>(raw[i]);
      }
    }
    return out;
  }

  // A block's Linear layer (weight index kw, bias kb).
  void Linear(float* out, const float* inp, const float* const* w, int kw, int kb, int in,
              int outf) {
    ops->Linear(out, inp, w[kw], raw16[kw], w[kb], N, in, outf);
  }
  void LinearBackward(float* dinp, float* const* g, const float* dout, const float* inp,
                      const float* const* w, int kw, int kb, int in, int outf) {
    ops->LinearBackward(dinp, g[kw], g[kb], dout, inp, w[kw], raw16[kw], N, in, outf);
  }
  void ForwardBlock(int l, const float* const* w, float* x_next);
  // dres: dL/d(output of block l) on entry, dL/d(input) on return. g: gradients of the
  // block's parameters (zeroed by the caller), laid out like BlockParam.
  void BackwardBlock(int l, const float* const* w, float* const* g);
  Result<double> Forward(float loss_scale, bool backward);
  // zinf.schedule layer-major: the window's forward, layer by layer for every micro-batch,
  // the head's forward and backward (the losses, one per micro-batch), then the backward.
  Status WindowForward(float loss_scale, std::vector<double>* losses);
  Status WindowBackward();
  Status Reduce(size_t index, float* grad, int micro_batch = -1) {
    const size_t numel = list[index].numel();
    // fp16: the gradient an fp16 model computes holds fp16 values (inf where the scaled value
    // overflows fp16, which the engine's norm sees and skips the step for).
    if (half_type == ParamCopyType::kF16) ops->RoundToF16(grad, numel);
    if (hooks.grad_observer) {
      if (ops->on_device()) {
        observed.resize(numel);
        ZINF_RETURN_IF_ERROR(ops->Download(observed.data(), grad, numel));
        hooks.grad_observer(index, observed.data(), numel);
      } else {
        hooks.grad_observer(index, grad, numel);
      }
    }
    return transfer->ReduceGradient(ids[index], grad, numel, micro_batch);
  }
};

void GptTrainer::Impl::ForwardBlock(int l, const float* const* w, float* x_next) {
  BlockActs& a = acts[l];
  const size_t nc = static_cast<size_t>(N) * C;
  ops->LayerNormForward(a.ln1, a.ln1_mean, a.ln1_rstd, a.x, w[kLn1W], w[kLn1B], N, C);
  Linear(a.qkv, a.ln1, w, kQkvW, kQkvB, C, 3 * C);
  ops->AttentionForward(a.atty, a.att, a.qkv, B, T, C, NH);
  Linear(tmp, a.atty, w, kAttnProjW, kAttnProjB, C, C);
  ops->ResidualForward(a.xmid, a.x, tmp, nc);
  ops->LayerNormForward(a.ln2, a.ln2_mean, a.ln2_rstd, a.xmid, w[kLn2W], w[kLn2B], N, C);
  Linear(a.fch, a.ln2, w, kFcW, kFcB, C, 4 * C);
  ops->GeluForward(a.fcg, a.fch, 4 * nc);
  Linear(tmp, a.fcg, w, kMlpProjW, kMlpProjB, 4 * C, C);
  ops->ResidualForward(x_next, a.xmid, tmp, nc);
}

void GptTrainer::Impl::BackwardBlock(int l, const float* const* w, float* const* g) {
  BlockActs& a = acts[l];
  const size_t nc = static_cast<size_t>(N) * C;
  // x_next = xmid + mlp(ln2(xmid)): the residual passes dres through unchanged.
  ops->Zero(dfcg, 4 * nc);
  LinearBackward(dfcg, g, dres, a.fcg, w, kMlpProjW, kMlpProjB, 4 * C, C);
  ops->Zero(dfch, 4 * nc);
  ops->GeluBackward(dfch, a.fch, dfcg, 4 * nc);
  ops->Zero(dln, nc);
  LinearBackward(dln, g, dfch, a.ln2, w, kFcW, kFcB, C, 4 * C);
  ops->Copy(dxmid, dres, nc);
  ops->LayerNormBackward(dxmid, g[kLn2W], g[kLn2B], dln, a.xmid, w[kLn2W], a.ln2_mean, a.ln2_rstd,
                         N, C);
  // xmid = x + proj(attn(ln1(x))).
  ops->Zero(datty, nc);
  LinearBackward(datty, g, dxmid, a.atty, w, kAttnProjW, kAttnProjB, C, C);
  ops->Zero(dqkv, 3 * nc);
  ops->AttentionBackward(dqkv, datty, a.qkv, a.att, B, T, C, NH);
  ops->Zero(dln, nc);
  LinearBackward(dln, g, dqkv, a.ln1, w, kQkvW, kQkvB, C, 3 * C);
  ops->Copy(dres, dxmid, nc);
  ops->LayerNormBackward(dres, g[kLn1W], g[kLn1B], dln, a.x, w[kLn1W], a.ln1_mean, a.ln1_rstd, N,
                         C);
}

Result<double> GptTrainer::Impl::Forward(float loss_scale, bool backward) {
  const size_t nc = static_cast<size_t>(N) * C;
  // Embeddings.
  {
    std::vector<ParamId> group = {wte(), wpe()};
    ZINF_ASSIGN_OR_RETURN(std::vector<const float*> w, AcquireFp32(group));
    ops->EncoderForward(acts[0].x, tokens, w[0], w[1], B, T, C);
    ZINF_RETURN_IF_ERROR(ops->status());
    ZINF_RETURN_IF_ERROR(engine->Release(group));
  }
  // Blocks.
  for (int l = 0; l < L; ++l) {
    std::vector<ParamId> group = BlockIds(l);
    ZINF_ASSIGN_OR_RETURN(std::vector<const float*> w, AcquireFp32(group, /*block=*/true));
    ForwardBlock(l, w.data(), l + 1 < L ? acts[l + 1].x : x_final);
    ZINF_RETURN_IF_ERROR(ops->status());
    ZINF_RETURN_IF_ERROR(engine->Release(group));
  }
  // Final LayerNorm and the tied LM head; its backward right away, while it is acquired.
  double loss;
  {
    std::vector<ParamId> group = HeadIds();
    ZINF_ASSIGN_OR_RETURN(std::vector<const float*> w, AcquireFp32(group));
    ops->LayerNormForward(lnf, lnf_mean, lnf_rstd, x_final, w[0], w[1], N, C);
    ops->Linear(logits, lnf, w[2], nullptr, nullptr, N, C, V);
    ZINF_ASSIGN_OR_RETURN(loss, ops->CrossEntropy(backward ? dlogits : nullptr, logits, targets, N,
                                                  V, static_cast<double>(loss_scale)));
    if (backward) {
      ops->Zero(dln, nc);
      ops->Zero(dwte, list[0].numel());
      ops->LinearBackward(dln, dwte, nullptr, dlogits, lnf, w[2], nullptr, N, C, V);
      ops->Zero(dres, nc);
      float* glnf_w = grads;
      float* glnf_b = grads + C;
      ops->Zero(grads, 2 * static_cast<size_t>(C));
      ops->LayerNormBackward(dres, glnf_w, glnf_b, dln, x_final, w[0], lnf_mean, lnf_rstd, N, C);
      ZINF_RETURN_IF_ERROR(ops->status());
      ZINF_RETURN_IF_ERROR(Reduce(LnfIndex(), glnf_w));
      ZINF_RETURN_IF_ERROR(Reduce(LnfIndex() + 1, glnf_b));
    }
    ZINF_RETURN_IF_ERROR(ops->status());
    ZINF_RETURN_IF_ERROR(engine->Release(group));
  }
  if (!backward) return loss;
  // Blocks, last first.
  for (int l = L - 1; l >= 0; --l) {
    std::vector<ParamId> group = BlockIds(l);
    ZINF_ASSIGN_OR_RETURN(std::vector<const float*> w, AcquireFp32(group, /*block=*/true));
    float* g[kBlockParams];
    size_t cursor = 0;
    for (int k = 0; k < kBlockParams; ++k) {
      g[k] = grads + cursor;
      cursor += engine->param(group[k]).numel;
    }
    ops->Zero(grads, cursor);
    BackwardBlock(l, w.data(), g);
    ZINF_RETURN_IF_ERROR(ops->status());
    for (int k = 0; k < kBlockParams; ++k) {
      ZINF_RETURN_IF_ERROR(Reduce(BlockIndex(l, k), g[k]));
    }
    ZINF_RETURN_IF_ERROR(engine->Release(group));
    CrashPoint("train.backward");
  }
  // Embeddings: their backward needs no parameter values.
  ops->Zero(dwpe, list[1].numel());
  ops->EncoderBackward(dwte, dwpe, dres, tokens, B, T, C);
  ZINF_RETURN_IF_ERROR(ops->status());
  ZINF_RETURN_IF_ERROR(Reduce(0, dwte));
  ZINF_RETURN_IF_ERROR(Reduce(1, dwpe));
  return loss;
}

Status GptTrainer::Impl::WindowForward(float loss_scale, std::vector<double>* losses) {
  const size_t nc = static_cast<size_t>(N) * C;
  {
    std::vector<ParamId> group = {wte(), wpe()};
    ZINF_ASSIGN_OR_RETURN(std::vector<const float*> w, AcquireFp32(group));
    for (int j = 0; j < window; ++j) {
      ops->EncoderForward(X(0, j), wtokens + static_cast<size_t>(j) * N, w[0], w[1], B, T, C);
    }
    ZINF_RETURN_IF_ERROR(ops->status());
    ZINF_RETURN_IF_ERROR(engine->Release(group));
  }
  // Each block for every micro-batch; only its input is kept (the backward recomputes the
  // rest from it).
  for (int l = 0; l < L; ++l) {
    std::vector<ParamId> group = BlockIds(l);
    ZINF_ASSIGN_OR_RETURN(std::vector<const float*> w, AcquireFp32(group, /*block=*/true));
    for (int j = 0; j < window; ++j) {
      ops->Copy(acts[l].x, X(l, j), nc);
      ForwardBlock(l, w.data(), X(l + 1, j));
    }
    ZINF_RETURN_IF_ERROR(ops->status());
    ZINF_RETURN_IF_ERROR(engine->Release(group));
  }
  // The head, forward and backward per micro-batch, as Forward does.
  std::vector<ParamId> group = HeadIds();
  ZINF_ASSIGN_OR_RETURN(std::vector<const float*> w, AcquireFp32(group));
  losses->clear();
  for (int j = 0; j < window; ++j) {
    const float* x = X(L, j);
    ops->LayerNormForward(lnf, lnf_mean, lnf_rstd, x, w[0], w[1], N, C);
    ops->Linear(logits, lnf, w[2], nullptr, nullptr, N, C, V);
    ZINF_ASSIGN_OR_RETURN(
        double loss, ops->CrossEntropy(dlogits, logits, wtargets + static_cast<size_t>(j) * N, N, V,
                                       static_cast<double>(loss_scale)));
    losses->push_back(loss);
    ops->Zero(dln, nc);
    ops->Zero(Dwte(j), list[0].numel());
    ops->LinearBackward(dln, Dwte(j), nullptr, dlogits, lnf, w[2], nullptr, N, C, V);
    ops->Zero(Dres(j), nc);
    float* glnf_w = grads;
    float* glnf_b = grads + C;
    ops->Zero(grads, 2 * static_cast<size_t>(C));
    ops->LayerNormBackward(Dres(j), glnf_w, glnf_b, dln, x, w[0], lnf_mean, lnf_rstd, N, C);
    ZINF_RETURN_IF_ERROR(ops->status());
    ZINF_RETURN_IF_ERROR(Reduce(LnfIndex(), glnf_w, j));
    ZINF_RETURN_IF_ERROR(Reduce(LnfIndex() + 1, glnf_b, j));
  }
  ZINF_RETURN_IF_ERROR(ops->status());
  return engine->Release(group);
}

Status GptTrainer::Impl::WindowBackward() {
  const size_t nc = static_cast<size_t>(N) * C;
  for (int l = L - 1; l >= 0; --l) {
    std::vector<ParamId> group = BlockIds(l);
    ZINF_ASSIGN_OR_RETURN(std::vector<const float*> w, AcquireFp32(group, /*block=*/true));
    float* g[kBlockParams];
    size_t cursor = 0;
    for (int k = 0; k < kBlockParams; ++k) {
      g[k] = grads + cursor;
      cursor += engine->param(group[k]).numel;
    }
    for (int j = 0; j < window; ++j) {
      // The block's activations again, from its kept input (the same kernels on the same
      // values: the forward's bits), then its backward.
      ops->Copy(acts[l].x, X(l, j), nc);
      ForwardBlock(l, w.data(), X(l + 1, j));
      ops->Copy(dres, Dres(j), nc);
      ops->Zero(grads, cursor);
      BackwardBlock(l, w.data(), g);
      ops->Copy(Dres(j), dres, nc);
      ZINF_RETURN_IF_ERROR(ops->status());
      for (int k = 0; k < kBlockParams; ++k) {
        ZINF_RETURN_IF_ERROR(Reduce(BlockIndex(l, k), g[k], j));
      }
    }
    ZINF_RETURN_IF_ERROR(engine->Release(group));
    CrashPoint("train.backward");
  }
  for (int j = 0; j < window; ++j) {
    ops->Zero(dwpe, list[1].numel());
    ops->EncoderBackward(Dwte(j), dwpe, Dres(j), wtokens + static_cast<size_t>(j) * N, B, T, C);
    ZINF_RETURN_IF_ERROR(ops->status());
    ZINF_RETURN_IF_ERROR(Reduce(0, Dwte(j), j));
    ZINF_RETURN_IF_ERROR(Reduce(1, dwpe, j));
  }
  return Status::OK();
}

GptTrainer::GptTrainer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
  model_ = impl_->m;
  batch_ = impl_->B;
  seq_ = impl_->T;
}
GptTrainer::~GptTrainer() = default;

Result<std::unique_ptr<GptTrainer>> GptTrainer::Create(const GptConfig& model, int batch, int seq,
                                                       uint64_t seed, Engine* engine,
                                                       const TrainerHooks& hooks, Device* device) {
  ZINF_RETURN_IF_ERROR(Validate(model));
  if (batch < 1) return Status::InvalidArgument("--batch must be at least 1");
  if (seq < 1 || seq > model.max_seq) {
    return Status::InvalidArgument("--seq must be in 1.." + std::to_string(model.max_seq) +
                                   " (the model's position table)");
  }
  if (static_cast<int64_t>(batch) * seq > INT32_MAX) {
    return Status::InvalidArgument("--batch x --seq is " +
                                   std::to_string(static_cast<int64_t>(batch) * seq) +
                                   " tokens per step; at most 2^31 - 1 are supported");
  }
  if (engine == nullptr) return Status::InvalidArgument("GptTrainer: no engine");
  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  m.engine = engine;
  m.hooks = hooks;
  m.half_type = StoredParamType(engine->config());
  m.SetShape(model, batch, seq, m.half_type != ParamCopyType::kNone, WindowOf(engine->config()));
  // On the CPU, up to 64 tokens the bf16 kernels beat widening + sgemm (they read each
  // weight once); beyond, sgemm's blocking wins. On the GPU, cuBLAS bf16 GEMMs always. (fp16
  // weights are widened: the GEMMs take bf16 or fp32.)
  m.bf16_matmul = m.half_type == ParamCopyType::kBf16 &&
                  (m.N <= 64 || (device != nullptr && !device->IsHost()));
  for (size_t i = 0; i < m.list.size(); ++i) {
    const GptParam& p = m.list[i];
    ParamSpec spec;
    spec.name = p.name;
    spec.shape = p.shape;
    const int layers = model.layers;
    const uint32_t index = static_cast<uint32_t>(i);
    auto post = hooks.post_init;
    spec.init = [p, layers, seed, index, post](float* data, size_t numel) {
      InitParam(p, layers, seed, index, data, numel);
      if (post) post(index, data, numel);
    };
    Result<ParamId> id = engine->RegisterParameter(spec);
    if (!id.ok()) return id.status().WithContext("registering " + p.name);
    m.ids.push_back(*id);
  }
  ZINF_RETURN_IF_ERROR(engine->SetAcquireOrder(m.AcquireOrder()));

  const bool gpu = device != nullptr && !device->IsHost();
  if (gpu) {
    ZINF_ASSIGN_OR_RETURN(m.ops, NewCudaModelOps(device, m.Dims()));
  } else {
    m.ops = NewHostModelOps();
  }
  ModelOps* ops = m.ops.get();
  if (!gpu) {
    // Refused up front when the buffers exceed the machine's memory (an allocation that large
    // would fail anyway, or start swapping).
    const size_t need =
        DeviceBytes(model, batch, seq, m.half, m.window) - CudaModelOpsScratchBytes(m.Dims());
    const long pages = sysconf(_SC_PHYS_PAGES), page_size = sysconf(_SC_PAGESIZE);
    if (pages > 0 && page_size > 0 &&
        need > static_cast<size_t>(pages) * static_cast<size_t>(page_size)) {
      char msg[160];
      std::snprintf(msg, sizeof(msg), "%.2f GiB, more than this machine's %.2f GiB of memory",
                    static_cast<double>(need) / (1 << 30),
                    static_cast<double>(pages) * page_size / (1 << 30));
      return Status::ResourceExhausted(
          std::string("the trainer's activations and gradients for --batch ") +
          std::to_string(batch) + " x --seq " + std::to_string(seq) + " need " + msg +
          "; lower --batch or --seq");
    }
  }
  Status allocated = m.AllocateBuffers([ops](size_t n) { return ops->AllocFloats(n); },
                                       [ops](size_t n) { return ops->AllocInts(n); });
  if (!allocated.ok()) {
    const double gib =
        static_cast<double>(DeviceBytes(model, batch, seq, m.half, m.window)) / (1 << 30);
    char need[64];
    std::snprintf(need, sizeof(need), "%.2f GiB", gib);
    return allocated.WithContext(
        std::string("allocating the trainer's activations and gradients (") + need +
        " for --batch " + std::to_string(batch) + " x --seq " + std::to_string(seq) +
        (gpu ? " in the GPU's pool; lower --batch or --seq, or raise --device-budget)"
             : "; lower --batch or --seq)"));
  }
  // The transfer is picked here, once: the per-layer path calls it without asking which.
  if (device != nullptr && device->IsHost() && hooks.stage_through_device) {
    size_t largest_param = 0;
    for (const GptParam& p : m.list) largest_param = std::max(largest_param, p.numel());
    // The largest acquired group as fp32 (bf16 needs half), each part 64-byte aligned.
    const size_t staging_bytes = m.LargestGroup() * 4 + kBlockParams * 64;
    ZINF_ASSIGN_OR_RETURN(m.transfer,
                          NewStagedTransfer(engine, device, staging_bytes, largest_param));
  } else {
    m.transfer = NewDirectTransfer(engine);
  }
  return std::unique_ptr<GptTrainer>(new GptTrainer(std::move(impl)));
}

Result<double> GptTrainer::MicroStep(const int32_t* tokens, const int32_t* targets,
                                     float loss_scale, StepStats* stats) {
  Impl& m = *impl_;
  if (m.window > 0) {
    return Status::FailedPrecondition(
        "GptTrainer::MicroStep: the engine's zinf.schedule is layer-major; call Window");
  }
  for (int i = 0; i < m.N; ++i) {
    if (tokens[i] < 0 || tokens[i] >= m.V || targets[i] < 0 || targets[i] >= m.V) {
      return Status::InvalidArgument("token " + std::to_string(i) + " is outside the vocabulary");
    }
  }
  m.ops->UploadInts(m.tokens, tokens, m.N);
  m.ops->UploadInts(m.targets, targets, m.N);
  // fp16: the engine's loss scale multiplies the loss's gradient (the loss is reported unscaled).
  const float scaled = static_cast<float>(loss_scale * m.engine->loss_scale());
  ZINF_ASSIGN_OR_RETURN(double loss, m.Forward(scaled, /*backward=*/true));
  ZINF_ASSIGN_OR_RETURN(StepStats st, m.engine->Step());
  if (stats != nullptr) *stats = st;
  return loss;
}

Result<std::vector<double>> GptTrainer::Window(const int32_t* tokens, const int32_t* targets,
                                               float loss_scale, StepStats* stats) {
  Impl& m = *impl_;
  if (m.window == 0) {
    return Status::FailedPrecondition(
        "GptTrainer::Window: the engine's zinf.schedule is micro-batch; call MicroStep");
  }
  const size_t n = static_cast<size_t>(m.N) * m.window;
  for (size_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= m.V || targets[i] < 0 || targets[i] >= m.V) {
      return Status::InvalidArgument("token " + std::to_string(i % m.N) + " of micro-batch " +
                                     std::to_string(i / m.N) + " is outside the vocabulary");
    }
  }
  m.ops->UploadInts(m.wtokens, tokens, n);
  m.ops->UploadInts(m.wtargets, targets, n);
  const float scaled = static_cast<float>(loss_scale * m.engine->loss_scale());
  std::vector<double> losses;
  ZINF_RETURN_IF_ERROR(m.WindowForward(scaled, &losses));
  ZINF_RETURN_IF_ERROR(m.WindowBackward());
  ZINF_ASSIGN_OR_RETURN(StepStats st, m.engine->Step());
  if (stats != nullptr) *stats = st;
  return losses;
}

size_t GptTrainer::WindowBytes(const GptConfig& model, int batch, int seq, int window) {
  if (window <= 0) return 0;
  const size_t with = DeviceBytes(model, batch, seq, false, window);
  const size_t without = DeviceBytes(model, batch, seq, false, 0);
  return with == SIZE_MAX ? SIZE_MAX : with - without;
}

size_t GptTrainer::DeviceBytes(const GptConfig& model, int batch, int seq, bool half, int window) {
  // Create refuses these shapes.
  if (batch < 1 || seq < 1 || static_cast<int64_t>(batch) * seq > INT32_MAX) return 0;
  Impl m;
  m.SetShape(model, batch, seq, half, window);
  // Count what AllocateBuffers asks for (each allocation rounded to the CUDA pool's 256
  // bytes); the pointers handed back are never used.
  size_t bytes = 0;
  static float dummy_float;
  static int32_t dummy_int;
  // Saturating: a shape whose bytes do not fit 64 bits counts as SIZE_MAX (more than any
  // memory), which Create refuses.
  bool overflow = false;
  auto add = [&](size_t n, size_t elem) {
    size_t b = 0;
    overflow = overflow || __builtin_mul_overflow(n, elem, &b) || b > SIZE_MAX - 255 ||
               __builtin_add_overflow(bytes, (b + 255) / 256 * 256, &bytes);
  };
  Status s = m.AllocateBuffers(
      [&](size_t n) -> Result<float*> {
        add(n, sizeof(float));
        return &dummy_float;
      },
      [&](size_t n) -> Result<int32_t*> {
        add(n, sizeof(int32_t));
        return &dummy_int;
      });
  // The counters never fail; AllocateBuffers fails only for an element count that overflows.
  if (!s.ok() || overflow) return SIZE_MAX;
  const size_t scratch = CudaModelOpsScratchBytes(m.Dims());
  return bytes > SIZE_MAX - scratch ? SIZE_MAX : bytes + scratch;
}

Status GptTrainer::MasterValues(size_t index, std::vector<float>* out) {
  Impl& m = *impl_;
  if (index >= m.ids.size()) return Status::InvalidArgument("MasterValues: bad index");
  out->resize(m.list[index].numel());
  return m.engine->GatherMasterParameter(m.ids[index], out->data());
}

Result<uint64_t> GptTrainer::ParamChecksum() {
  XXH3_state_t* state = XXH3_createState();
  if (state == nullptr) return Status::ResourceExhausted("XXH3_createState failed");
  XXH3_64bits_reset(state);
  std::vector<float> values;
  Status s;
  for (size_t i = 0; i < impl_->ids.size() && s.ok(); ++i) {
    s = MasterValues(i, &values);
    if (s.ok()) XXH3_64bits_update(state, values.data(), values.size() * sizeof(float));
  }
  uint64_t h = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  ZINF_RETURN_IF_ERROR(s);
  return h;
}

}  // namespace zinf::train
