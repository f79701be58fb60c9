#include "train/trainer.h"

#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "train/kernels.h"
#include "zinf/crash_point.h"

namespace zinf::train {

// ---- TextData --------------------------------------------------------------------------------

Result<TextData> TextData::Load(const std::string& path, int seq) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return ErrnoToStatus(
        errno, "opening the training text " + path + " (give --data FILE with any text file)");
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  TextData d;
  d.text_ = ss.str();
  if (d.text_.size() < static_cast<size_t>(seq) + 2) {
    return Status::InvalidArgument(
        "the training text " + path + " has " + std::to_string(d.text_.size()) + " bytes; --seq " +
        std::to_string(seq) + " needs at least " + std::to_string(seq + 2));
  }
  return d;
}

void TextData::Batch(uint64_t seed, int64_t index, int batch, int seq, int32_t* tokens,
                     int32_t* targets) const {
  const uint64_t windows = text_.size() - static_cast<uint64_t>(seq);  // offsets 0..windows-1
  for (int b = 0; b < batch; ++b) {
    uint64_t h = seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(index) * 0x100000001B3ull +
                 static_cast<uint64_t>(b);
    h = XXH3_64bits(&h, sizeof(h));
    const uint64_t off = h % windows;
    for (int t = 0; t < seq; ++t) {
      tokens[b * seq + t] = static_cast<unsigned char>(text_[off + t]);
      targets[b * seq + t] = static_cast<unsigned char>(text_[off + t + 1]);
    }
  }
}

// ---- GptTrainer ------------------------------------------------------------------------------

namespace {

// What one block saves for its backward.
struct BlockActs {
  std::vector<float> x;  // input of the block (residual stream)
  std::vector<float> ln1, ln1_mean, ln1_rstd, qkv, att, atty, xmid, ln2, ln2_mean, ln2_rstd, fch,
      fcg;
};

}  // namespace

struct GptTrainer::Impl {
  Engine* engine = nullptr;
  // Staging (a device that is not the host, or hooks.stage_through_device): acquired
  // parameters are copied into `staged`, gradients into `device_grad` (device memory).
  Device* device = nullptr;
  bool staging = false;
  std::vector<uint8_t> staged;
  void* device_grad = nullptr;
  ~Impl() {
    if (device_grad != nullptr) device->Free(device_grad);
  }
  TrainerHooks hooks;
  GptConfig m;
  int B = 0, T = 0, N = 0, C = 0, NH = 0, V = 0, L = 0;
  bool bf16 = false;
  std::vector<GptParam> list;
  std::vector<ParamId> ids;  // per ParamList entry

  std::vector<BlockActs> acts;  // per block
  std::vector<float> x_final, lnf, lnf_mean, lnf_rstd, logits, dlogits;
  std::vector<float> wconv;  // fp32 copies of an acquired group (bf16)
  std::vector<float> grads;  // gradients of one group
  std::vector<float> dres, dxmid, dln, datty, dqkv, dfch, dfcg, tmp;
  std::vector<float> dwte, dwpe;
  std::vector<int32_t> tokens;

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

  // With bf16 storage and few tokens, a block's four weight matrices are used as bf16 by
  // the Matmul*Bf16 kernels (read once, widened in registers) instead of an fp32 copy.
  bool bf16_matmul = false;
  static bool IsBlockMatrix(int k) {
    return k == kQkvW || k == kAttnProjW || k == kFcW || k == kMlpProjW;
  }
  std::vector<const uint16_t*> raw16;  // the acquired group's bf16 matrices (else null)

  // Acquires `group` and returns fp32 pointers to the full parameters (converted from bf16
  // into wconv when the engine stores bf16; for a block with bf16_matmul, its weight matrices
  // stay bf16 in raw16 and their fp32 pointer is null).
  Result<std::vector<const float*>> AcquireFp32(const std::vector<ParamId>& group,
                                                bool block = false) {
    ZINF_ASSIGN_OR_RETURN(std::vector<void*> raw, engine->Acquire(group));
    if (staging) {
      const size_t elem = bf16 ? 2 : 4;
      size_t offset = 0;
      Stream* compute = device->ComputeStream();
      for (size_t i = 0; i < group.size(); ++i) {
        const size_t bytes = engine->param(group[i]).numel * elem;
        ZINF_RETURN_IF_ERROR(
            device->CopyDeviceToHost(staged.data() + offset, raw[i], bytes, compute));
        raw[i] = staged.data() + offset;
        offset += (bytes + 63) & ~size_t{63};
      }
      ZINF_RETURN_IF_ERROR(device->SynchronizeStream(compute));
    }
    std::vector<const float*> out(group.size());
    raw16.assign(group.size(), nullptr);
    size_t cursor = 0;
    for (size_t i = 0; i < group.size(); ++i) {
      const size_t n = engine->param(group[i]).numel;
      if (bf16 && block && bf16_matmul && IsBlockMatrix(static_cast<int>(i))) {
        raw16[i] = static_cast<const uint16_t*>(raw[i]);
        out[i] = nullptr;
      } else if (bf16) {
        Bf16ToFp32(wconv.data() + cursor, static_cast<const uint16_t*>(raw[i]), n);
        out[i] = wconv.data() + cursor;
        cursor += n;
      } else {
        out[i] = static_cast<const float*>(raw[i]);
      }
    }
    return out;
  }

  // A block's Linear layer (weight index kw, bias kb): the bf16 kernels or sgemm.
  void Linear(float* out, const float* inp, const float* const* w, int kw, int kb, int in,
              int outf) {
    if (raw16[kw] != nullptr) {
      MatmulForwardBf16(out, inp, raw16[kw], w[kb], N, in, outf);
    } else {
      MatmulForward(out, inp, w[kw], w[kb], N, in, outf);
    }
  }
  void LinearBackward(float* dinp, float* const* g, const float* dout, const float* inp,
                      const float* const* w, int kw, int kb, int in, int outf) {
    if (raw16[kw] != nullptr) {
      MatmulBackwardBf16(dinp, g[kw], g[kb], dout, inp, raw16[kw], N, in, outf,
                         /*accumulate_dw=*/true);
    } else {
      MatmulBackward(dinp, g[kw], g[kb], dout, inp, w[kw], N, in, outf);
    }
  }
  void ForwardBlock(int l, const float* const* w, float* x_next);
  // dres: dL/d(output of block l) on entry, dL/d(input) on return. g: gradients of the
  // block's parameters (zeroed here), laid out like BlockParam.
  void BackwardBlock(int l, const float* const* w, float* const* g);
  Result<double> Forward(const int32_t* targets, float loss_scale, bool backward);
  Status Reduce(size_t index, const float* grad) {
    if (hooks.grad_observer) hooks.grad_observer(index, grad, list[index].numel());
    if (staging) {
      // The engine's copy out of device_grad is ordered on the compute stream before the
      // next gradient's copy into it.
      Stream* compute = device->ComputeStream();
      ZINF_RETURN_IF_ERROR(device->CopyHostToDevice(device_grad, grad,
                                                    list[index].numel() * sizeof(float), compute));
      ZINF_RETURN_IF_ERROR(device->SynchronizeStream(compute));
      return engine->ReduceGradient(ids[index], static_cast<const float*>(device_grad));
    }
    return engine->ReduceGradient(ids[index], grad);
  }
};

void GptTrainer::Impl::ForwardBlock(int l, const float* const* w, float* x_next) {
  BlockActs& a = acts[l];
  LayerNormForward(a.ln1.data(), a.ln1_mean.data(), a.ln1_rstd.data(), a.x.data(), w[kLn1W],
                   w[kLn1B], N, C);
  Linear(a.qkv.data(), a.ln1.data(), w, kQkvW, kQkvB, C, 3 * C);
  AttentionForward(a.atty.data(), a.att.data(), a.qkv.data(), B, T, C, NH);
  Linear(tmp.data(), a.atty.data(), w, kAttnProjW, kAttnProjB, C, C);
  ResidualForward(a.xmid.data(), a.x.data(), tmp.data(), a.x.size());
  LayerNormForward(a.ln2.data(), a.ln2_mean.data(), a.ln2_rstd.data(), a.xmid.data(), w[kLn2W],
                   w[kLn2B], N, C);
  Linear(a.fch.data(), a.ln2.data(), w, kFcW, kFcB, C, 4 * C);
  GeluForward(a.fcg.data(), a.fch.data(), a.fch.size());
  Linear(tmp.data(), a.fcg.data(), w, kMlpProjW, kMlpProjB, 4 * C, C);
  ResidualForward(x_next, a.xmid.data(), tmp.data(), a.x.size());
}

void GptTrainer::Impl::BackwardBlock(int l, const float* const* w, float* const* g) {
  BlockActs& a = acts[l];
  const size_t nc = static_cast<size_t>(N) * C;
  auto zero = [](std::vector<float>& v) { std::fill(v.begin(), v.end(), 0.0f); };
  // x_next = xmid + mlp(ln2(xmid)): the residual passes dres through unchanged.
  zero(dfcg);
  LinearBackward(dfcg.data(), g, dres.data(), a.fcg.data(), w, kMlpProjW, kMlpProjB, 4 * C, C);
  zero(dfch);
  GeluBackward(dfch.data(), a.fch.data(), dfcg.data(), dfch.size());
  zero(dln);
  LinearBackward(dln.data(), g, dfch.data(), a.ln2.data(), w, kFcW, kFcB, C, 4 * C);
  std::copy(dres.begin(), dres.begin() + nc, dxmid.begin());
  LayerNormBackward(dxmid.data(), g[kLn2W], g[kLn2B], dln.data(), a.xmid.data(), w[kLn2W],
                    a.ln2_mean.data(), a.ln2_rstd.data(), N, C);
  // xmid = x + proj(attn(ln1(x))).
  zero(datty);
  LinearBackward(datty.data(), g, dxmid.data(), a.atty.data(), w, kAttnProjW, kAttnProjB, C, C);
  zero(dqkv);
  AttentionBackward(dqkv.data(), datty.data(), a.qkv.data(), a.att.data(), B, T, C, NH);
  zero(dln);
  LinearBackward(dln.data(), g, dqkv.data(), a.ln1.data(), w, kQkvW, kQkvB, C, 3 * C);
  std::copy(dxmid.begin(), dxmid.begin() + nc, dres.begin());
  LayerNormBackward(dres.data(), g[kLn1W], g[kLn1B], dln.data(), a.x.data(), w[kLn1W],
                    a.ln1_mean.data(), a.ln1_rstd.data(), N, C);
}

Result<double> GptTrainer::Impl::Forward(const int32_t* targets, float loss_scale, bool backward) {
  // Embeddings.
  {
    std::vector<ParamId> group = {wte(), wpe()};
    ZINF_ASSIGN_OR_RETURN(std::vector<const float*> w, AcquireFp32(group));
    EncoderForward(acts[0].x.data(), tokens.data(), w[0], w[1], B, T, C);
    ZINF_RETURN_IF_ERROR(engine->Release(group));
  }
  // Blocks.
  for (int l = 0; l < L; ++l) {
    std::vector<ParamId> group = BlockIds(l);
    ZINF_ASSIGN_OR_RETURN(std::vector<const float*> w, AcquireFp32(group, /*block=*/true));
    ForwardBlock(l, w.data(), l + 1 < L ? acts[l + 1].x.data() : x_final.data());
    ZINF_RETURN_IF_ERROR(engine->Release(group));
  }
  // Final LayerNorm and the tied LM head; its backward right away, while it is acquired.
  double loss;
  {
    std::vector<ParamId> group = HeadIds();
    ZINF_ASSIGN_OR_RETURN(std::vector<const float*> w, AcquireFp32(group));
    LayerNormForward(lnf.data(), lnf_mean.data(), lnf_rstd.data(), x_final.data(), w[0], w[1], N,
                     C);
    MatmulForward(logits.data(), lnf.data(), w[2], static_cast<const float*>(nullptr), N, C, V);
    loss = CrossEntropyForwardBackward(backward ? dlogits.data() : nullptr, logits.data(), targets,
                                       N, V, static_cast<double>(loss_scale));
    if (backward) {
      std::fill(dln.begin(), dln.end(), 0.0f);
      std::fill(dwte.begin(), dwte.end(), 0.0f);
      MatmulBackward(dln.data(), dwte.data(), static_cast<float*>(nullptr), dlogits.data(),
                     lnf.data(), w[2], N, C, V);
      std::fill(dres.begin(), dres.end(), 0.0f);
      float* glnf_w = grads.data();
      float* glnf_b = grads.data() + C;
      std::fill(grads.begin(), grads.begin() + 2 * C, 0.0f);
      LayerNormBackward(dres.data(), glnf_w, glnf_b, dln.data(), x_final.data(), w[0],
                        lnf_mean.data(), lnf_rstd.data(), N, C);
      ZINF_RETURN_IF_ERROR(Reduce(LnfIndex(), glnf_w));
      ZINF_RETURN_IF_ERROR(Reduce(LnfIndex() + 1, glnf_b));
    }
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
      g[k] = grads.data() + cursor;
      cursor += engine->param(group[k]).numel;
    }
    std::fill(grads.begin(), grads.begin() + cursor, 0.0f);
    BackwardBlock(l, w.data(), g);
    for (int k = 0; k < kBlockParams; ++k) {
      ZINF_RETURN_IF_ERROR(Reduce(BlockIndex(l, k), g[k]));
    }
    ZINF_RETURN_IF_ERROR(engine->Release(group));
    CrashPoint("train.backward");
  }
  // Embeddings: their backward needs no parameter values.
  std::fill(dwpe.begin(), dwpe.end(), 0.0f);
  EncoderBackward(dwte.data(), dwpe.data(), dres.data(), tokens.data(), B, T, C);
  ZINF_RETURN_IF_ERROR(Reduce(0, dwte.data()));
  ZINF_RETURN_IF_ERROR(Reduce(1, dwpe.data()));
  return loss;
}

GptTrainer::GptTrainer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
  model_ = impl_->m;
  batch_ = impl_->B;
  seq_ = impl_->T;
}
GptTrainer::~GptTrainer() = default;

Result<std::unique_ptr<GptTrainer>> GptTrainer::Create(const GptConfig& model, int batch, int seq,
                                                       uint64_t seed, Engine* engine,
                                                       const TrainerHooks& hooks,
                                                       Device* device) {
  ZINF_RETURN_IF_ERROR(Validate(model));
  if (batch < 1) return Status::InvalidArgument("--batch must be at least 1");
  if (seq < 1 || seq > model.max_seq) {
    return Status::InvalidArgument("--seq must be in 1.." + std::to_string(model.max_seq) +
                                   " (the model's position table)");
  }
  if (engine == nullptr) return Status::InvalidArgument("GptTrainer: no engine");
  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  m.engine = engine;
  m.hooks = hooks;
  m.m = model;
  m.B = batch;
  m.T = seq;
  m.N = batch * seq;
  m.C = model.d_model;
  m.NH = model.heads;
  m.V = model.vocab;
  m.L = model.layers;
  m.bf16 = engine->config().bf16;
  // Up to 64 tokens the bf16 kernels beat widening + sgemm (they read each weight once);
  // beyond, sgemm's blocking wins.
  m.bf16_matmul = m.bf16 && m.N <= 64;
  m.list = ParamList(model);
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

  const size_t N = m.N, C = m.C;
  m.acts.resize(m.L);
  for (BlockActs& a : m.acts) {
    a.x.resize(N * C);
    a.ln1.resize(N * C);
    a.ln1_mean.resize(N);
    a.ln1_rstd.resize(N);
    a.qkv.resize(N * 3 * C);
    a.att.resize(static_cast<size_t>(batch) * m.NH * seq * seq);
    a.atty.resize(N * C);
    a.xmid.resize(N * C);
    a.ln2.resize(N * C);
    a.ln2_mean.resize(N);
    a.ln2_rstd.resize(N);
    a.fch.resize(N * 4 * C);
    a.fcg.resize(N * 4 * C);
  }
  m.x_final.resize(N * C);
  m.lnf.resize(N * C);
  m.lnf_mean.resize(N);
  m.lnf_rstd.resize(N);
  m.logits.resize(N * m.V);
  m.dlogits.resize(N * m.V);
  size_t block = 0;
  for (int k = 0; k < kBlockParams; ++k) block += m.list[m.BlockIndex(0, k)].numel();
  const size_t embed = m.list[0].numel() + m.list[1].numel();
  const size_t head = 2 * C + m.list[0].numel();
  const size_t largest = std::max({block, embed, head});
  if (m.bf16) m.wconv.resize(largest);
  m.grads.resize(block);
  for (auto* v : {&m.dres, &m.dxmid, &m.dln, &m.datty, &m.tmp}) v->resize(N * C);
  m.dqkv.resize(N * 3 * C);
  m.dfch.resize(N * 4 * C);
  m.dfcg.resize(N * 4 * C);
  m.dwte.resize(m.list[0].numel());
  m.dwpe.resize(m.list[1].numel());
  m.tokens.resize(N);
  m.device = device;
  m.staging = device != nullptr && (!device->IsHost() || hooks.stage_through_device);
  if (m.staging) {
    size_t staged = 0, largest_param = 0;
    for (const GptParam& p : m.list) largest_param = std::max(largest_param, p.numel());
    // The largest acquired group: a block, the embeddings or the head (64-byte aligned parts).
    for (size_t n : {block, embed, head}) staged = std::max(staged, n * 4 + kBlockParams * 64);
    m.staged.resize(staged);
    ZINF_ASSIGN_OR_RETURN(m.device_grad, device->Alloc(largest_param * sizeof(float)));
  }
  return std::unique_ptr<GptTrainer>(new GptTrainer(std::move(impl)));
}

Result<double> GptTrainer::MicroStep(const int32_t* tokens, const int32_t* targets,
                                     float loss_scale, StepStats* stats) {
  Impl& m = *impl_;
  for (int i = 0; i < m.N; ++i) {
    if (tokens[i] < 0 || tokens[i] >= m.V || targets[i] < 0 || targets[i] >= m.V) {
      return Status::InvalidArgument("token " + std::to_string(i) + " is outside the vocabulary");
    }
  }
  std::copy(tokens, tokens + m.N, m.tokens.begin());
  ZINF_ASSIGN_OR_RETURN(double loss, m.Forward(targets, loss_scale, /*backward=*/true));
  ZINF_ASSIGN_OR_RETURN(StepStats st, m.engine->Step());
  if (stats != nullptr) *stats = st;
  return loss;
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
