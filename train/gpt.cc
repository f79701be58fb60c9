#include "train/gpt.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <cmath>
#include <cstdio>

namespace zinf::train {
namespace {

struct PresetShape {
  const char* name;
  int layers, d_model, heads, max_seq;
};

// GPT-3 paper, table 2.1 (1.3B and 13B use the common 16 heads of 128 and d_model 5120).
constexpr PresetShape kPresets[] = {
    {"tiny", 2, 64, 4, 64},       {"small", 4, 256, 8, 256},    {"125M", 12, 768, 12, 1024},
    {"350M", 24, 1024, 16, 1024}, {"1.3B", 24, 2048, 16, 1024}, {"2.7B", 32, 2560, 32, 1024},
    {"6.7B", 32, 4096, 32, 1024}, {"13B", 40, 5120, 40, 1024},
};

uint64_t Mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

std::vector<std::string> PresetNames() {
  std::vector<std::string> names;
  for (const PresetShape& p : kPresets) names.push_back(p.name);
  return names;
}

Result<GptConfig> Preset(const std::string& name) {
  for (const PresetShape& p : kPresets) {
    if (name == p.name) {
      GptConfig c;
      c.layers = p.layers;
      c.d_model = p.d_model;
      c.heads = p.heads;
      c.max_seq = p.max_seq;
      c.name = p.name;
      return c;
    }
  }
  std::string known;
  for (const PresetShape& p : kPresets) known += std::string(known.empty() ? "" : ", ") + p.name;
  return Status::InvalidArgument("--preset: unknown model preset '" + name + "' (known: " + known +
                                 "; or give --layers, --d-model and --heads)");
}

Status Validate(const GptConfig& c) {
  if (c.layers < 1) return Status::InvalidArgument("--layers must be at least 1");
  if (c.d_model < 1) return Status::InvalidArgument("--d-model must be at least 1");
  if (c.heads < 1) return Status::InvalidArgument("--heads must be at least 1");
  if (c.d_model % c.heads != 0) {
    return Status::InvalidArgument("--d-model (" + std::to_string(c.d_model) +
                                   ") must be a multiple of --heads (" + std::to_string(c.heads) +
                                   ")");
  }
  if (c.max_seq < 1 || c.vocab < 1) {
    return Status::InvalidArgument("the position table and vocabulary need at least one row");
  }
  // The count in checked arithmetic: every size derived from it (bytes per tier, the space
  // check, budgets) is then a product of it by a small factor, far from 2^64.
  uint64_t count = 0;
  if (!CheckedParamCount(c, &count) || count > kMaxParams) {
    char have[64];
    std::snprintf(
        have, sizeof(have), "%.3g",
        static_cast<double>(c.layers) * (12.0 * c.d_model * c.d_model + 13.0 * c.d_model));
    return Status::InvalidArgument("--layers " + std::to_string(c.layers) + " with --d-model " +
                                   std::to_string(c.d_model) + " gives about " + have +
                                   " parameters, more than zinf-train handles (2^50, about 1.1e15: "
                                   "petabytes of optimizer states); pick a smaller model");
  }
  return Status::OK();
}

bool CheckedParamCount(const GptConfig& c, uint64_t* out) {
  if (c.layers < 0 || c.d_model < 0 || c.vocab < 0 || c.max_seq < 0) return false;
  const uint64_t C = static_cast<uint64_t>(c.d_model);
  uint64_t cc = 0, block = 0, blocks = 0, embed = 0, total = 0;
  return !__builtin_mul_overflow(C, C, &cc) && !__builtin_mul_overflow(cc, uint64_t{12}, &block) &&
         !__builtin_add_overflow(block, 13 * C, &block) &&
         !__builtin_mul_overflow(block, static_cast<uint64_t>(c.layers), &blocks) &&
         !__builtin_mul_overflow(static_cast<uint64_t>(c.vocab) + c.max_seq, C, &embed) &&
         !__builtin_add_overflow(blocks, embed, &total) &&
         !__builtin_add_overflow(total, 2 * C, out);
}

size_t GptParam::numel() const {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

std::vector<GptParam> ParamList(const GptConfig& c) {
  using Init = GptParam::Init;
  const int64_t C = c.d_model;
  std::vector<GptParam> out;
  out.push_back({"wte", {c.vocab, C}, -1, Init::kNormal});
  out.push_back({"wpe", {c.max_seq, C}, -1, Init::kNormal});
  for (int l = 0; l < c.layers; ++l) {
    const std::string b = "h" + std::to_string(l) + ".";
    out.push_back({b + "ln1.w", {C}, l, Init::kOne});
    out.push_back({b + "ln1.b", {C}, l, Init::kZero});
    out.push_back({b + "attn.qkv.w", {3 * C, C}, l, Init::kNormal});
    out.push_back({b + "attn.qkv.b", {3 * C}, l, Init::kZero});
    out.push_back({b + "attn.proj.w", {C, C}, l, Init::kResidualProj});
    out.push_back({b + "attn.proj.b", {C}, l, Init::kZero});
    out.push_back({b + "ln2.w", {C}, l, Init::kOne});
    out.push_back({b + "ln2.b", {C}, l, Init::kZero});
    out.push_back({b + "mlp.fc.w", {4 * C, C}, l, Init::kNormal});
    out.push_back({b + "mlp.fc.b", {4 * C}, l, Init::kZero});
    out.push_back({b + "mlp.proj.w", {C, 4 * C}, l, Init::kResidualProj});
    out.push_back({b + "mlp.proj.b", {C}, l, Init::kZero});
  }
  out.push_back({"lnf.w", {C}, c.layers, Init::kOne});
  out.push_back({"lnf.b", {C}, c.layers, Init::kZero});
  return out;
}

uint64_t ParamCount(const GptConfig& c) {
  const uint64_t C = c.d_model;
  return static_cast<uint64_t>(c.vocab + c.max_seq) * C +
         static_cast<uint64_t>(c.layers) * (12 * C * C + 13 * C) + 2 * C;
}

double FlopsPerToken(const GptConfig& c, int seq) {
  // 6 flops per parameter per token (2 forward, 4 backward) for the matrix products, the LM
  // head included (tied: counted once more), plus attention's scores and weighted sums:
  // 2 * 2 * seq * C per layer forward (causal: half of that on average), times 3 with backward.
  const double C = c.d_model;
  const double matmul = 6.0 * (c.layers * 12.0 * C * C + c.vocab * C);
  const double attention = 3.0 * c.layers * 2.0 * seq * C;
  return matmul + attention;
}

void InitParam(const GptParam& p, int layers, uint64_t seed, uint32_t index, float* out,
               size_t numel) {
  using Init = GptParam::Init;
  if (p.init == Init::kZero || p.init == Init::kOne) {
    const float v = p.init == Init::kOne ? 1.0f : 0.0f;
    for (size_t i = 0; i < numel; ++i) out[i] = v;
    return;
  }
  const float stddev =
      p.init == Init::kResidualProj ? 0.02f / std::sqrt(2.0f * static_cast<float>(layers)) : 0.02f;
  // Sum of four uniforms on [0, 1): mean 2, variance 4/12; scaled to the standard deviation.
  const float scale = stddev * std::sqrt(3.0f) / 65536.0f;
  const uint64_t base = Mix64(seed ^ (static_cast<uint64_t>(index) << 40));
  auto fill = [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      uint64_t h = Mix64(base + i);
      uint32_t s = static_cast<uint32_t>(h & 0xFFFF) + static_cast<uint32_t>((h >> 16) & 0xFFFF) +
                   static_cast<uint32_t>((h >> 32) & 0xFFFF) + static_cast<uint32_t>(h >> 48);
      out[i] = (static_cast<float>(static_cast<int32_t>(s) - 2 * 65536 + 2)) * scale;
    }
  };
  constexpr size_t kGrain = 1 << 16;
  if (numel < 4 * kGrain) {
    fill(0, numel);
  } else {
    tbb::parallel_for(tbb::blocked_range<size_t>(0, numel, kGrain),
                      [&](const tbb::blocked_range<size_t>& r) { fill(r.begin(), r.end()); });
  }
}

}  // namespace zinf::train
