// The GPT-2-style model zinf-train trains: its shape, presets, parameter list and
// initialisation. No engine types here; trainer.h drives the model through the engine.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "zinf/status.h"

namespace zinf::train {

struct GptConfig {
  int vocab = 256;   // byte-level tokens
  int max_seq = 64;  // rows of the position embedding
  int layers = 2;
  int heads = 4;
  int d_model = 64;  // C; heads * head size
  std::string name = "custom";
};

// Presets: "tiny" (CI seconds), "small" (the demo: 3.2M parameters, minutes on two cores)
// and the GPT-3 shapes 125M, 350M, 1.3B, 2.7B, 6.7B, 13B (layers,
// d_model, heads), with a byte-level vocabulary and a 1,024-token position table. The names
// are the sizes with the GPT vocabulary; the byte-level models are smaller (no 50K-row
// embedding), ParamCount says by how much.
std::vector<std::string> PresetNames();
Result<GptConfig> Preset(const std::string& name);
// Checks the shape: positive sizes, d_model divisible by heads, at most kMaxParams
// parameters (counted without overflow). The message names the flag.
Status Validate(const GptConfig& c);
inline constexpr uint64_t kMaxParams = uint64_t{1} << 50;
// ParamCount in checked arithmetic: false when it does not fit 64 bits.
bool CheckedParamCount(const GptConfig& c, uint64_t* out);

// One parameter tensor of the model, in registration (layer) order.
struct GptParam {
  std::string name;
  std::vector<int64_t> shape;
  int layer = -1;  // -1: embeddings, 0..layers-1: a block, layers: final LayerNorm
  enum class Init { kNormal, kResidualProj, kZero, kOne } init = Init::kNormal;
  size_t numel() const;
};

// Per block, in this order (the trainer relies on it).
enum BlockParam {
  kLn1W,
  kLn1B,
  kQkvW,
  kQkvB,
  kAttnProjW,
  kAttnProjB,
  kLn2W,
  kLn2B,
  kFcW,
  kFcB,
  kMlpProjW,
  kMlpProjB,
  kBlockParams
};

// wte [vocab, C], wpe [max_seq, C], then kBlockParams per block, then lnf.w, lnf.b. The LM
// head is tied to wte.
std::vector<GptParam> ParamList(const GptConfig& c);
uint64_t ParamCount(const GptConfig& c);
// Forward + backward FLOPs per token (6 N plus attention), for "model TFLOPS".
double FlopsPerToken(const GptConfig& c, int seq);

// Initial values, a pure function of (seed, parameter index, element): weights ~ N(0, 0.02)
// (residual projections 0.02 / sqrt(2 layers), as GPT-2), biases 0, LayerNorm gains 1. The
// normal is the sum of four uniforms (Irwin-Hall, matched variance): cheap enough for
// billions of elements, and within 3.5 sigma by construction. Multi-threaded for large
// tensors; the values do not depend on the thread count.
void InitParam(const GptParam& p, int layers, uint64_t seed, uint32_t index, float* out,
               size_t numel);

}  // namespace zinf::train
