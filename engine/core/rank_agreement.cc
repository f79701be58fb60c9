#include "engine/core/rank_agreement.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <sstream>

namespace zinf {
namespace {

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::string Key(const std::string& line) {
  const size_t colon = line.find(": ");
  return colon == std::string::npos ? line : line.substr(0, colon);
}

std::string Value(const std::string& line) {
  const size_t colon = line.find(": ");
  return colon == std::string::npos ? "" : line.substr(colon + 2);
}

std::string Shape(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Exact text of a float (the same bits print the same everywhere).
std::string Num(double v) {
  std::ostringstream o;
  o.precision(17);
  o << v;
  return o.str();
}

}  // namespace

std::string DescribeForAgreement(const EngineConfig& c, const Layout& layout,
                                 const std::vector<std::pair<std::string, std::string>>& extra) {
  std::ostringstream o;
  o << "zero_optimization.stage: " << c.zero_stage << "\n";
  o << "optimizer.type: " << OptimizerTypeName(c.optimizer.type) << "\n";
  o << "optimizer.lr: " << Num(c.optimizer.lr) << "\n";
  o << "optimizer.betas: " << Num(c.optimizer.beta1) << ", " << Num(c.optimizer.beta2) << "\n";
  o << "optimizer.eps: " << Num(c.optimizer.eps) << "\n";
  o << "optimizer.weight_decay: " << Num(c.optimizer.weight_decay) << "\n";
  o << "bf16.enabled: " << (c.bf16 ? "true" : "false") << "\n";
  o << "fp16.enabled: " << (c.fp16.enabled ? "true" : "false") << "\n";
  if (c.fp16.enabled) {
    // (Every rank's scale follows the same verdicts: with the same settings, the same scale.)
    o << "fp16.loss_scale: " << Num(c.fp16.loss_scale) << "\n";
    o << "fp16.initial_scale_power: " << c.fp16.initial_scale_power << "\n";
    o << "fp16.loss_scale_window: " << c.fp16.loss_scale_window << "\n";
    o << "fp16.hysteresis: " << c.fp16.hysteresis << "\n";
    o << "fp16.consecutive_hysteresis: " << (c.fp16.consecutive_hysteresis ? "true" : "false")
      << "\n";
    o << "fp16.min_loss_scale: " << Num(c.fp16.min_loss_scale) << "\n";
  }
  o << "gradient_clipping: " << Num(c.gradient_clipping) << "\n";
  o << "gradient_accumulation_steps: " << c.gradient_accumulation_steps << "\n";
  o << "zinf.schedule: " << (c.layer_major ? "layer-major" : "micro-batch") << "\n";
  o << "zero_optimization.sub_group_size: " << c.sub_group_size << "\n";
  o << "zero_optimization.stage3_param_persistence_threshold: " << c.param_persistence_threshold
    << "\n";
  o << "zero_optimization.offload_param.device: " << TierName(c.offload_param.tier) << "\n";
  o << "zero_optimization.offload_optimizer.device: " << TierName(c.offload_optimizer.tier) << "\n";
  o << "zero_optimization.offload_optimizer.ratio: " << Num(c.offload_optimizer.ratio) << "\n";
  o << "zinf.delayed_update: " << (c.delayed_update ? "true" : "false") << " after "
    << c.delayed_update_after << "\n";
  o << "zinf.gradient_transfer_dtype: " << (c.gradient_transfer_bf16 ? "bf16" : "fp32") << "\n";
  o << "zinf.optimizer_state_dtype: " << StateTypeName(c.optimizer_state_type) << "\n";
  o << "zinf.frozen_weight_dtype: " << (c.frozen_int8 ? "int8" : "as-is") << "\n";
  o << "zero_optimization.zero_quantized_weights: " << (c.quantized_weights ? "true" : "false")
    << "\n";
  o << "zero_optimization.zero_quantized_nontrainable_weights: "
    << (c.quantized_nontrainable_weights ? "true" : "false") << "\n";
  o << "zero_optimization.zero_quantized_gradients: " << (c.quantized_gradients ? "true" : "false")
    << "\n";
  o << "zero_optimization.zero_hpz_partition_size: " << c.hpz_partition_size << "\n";
  // (Only where it applies: a rank is not refused over a setting without effect.)
  if (c.quantized_gradients) {
    o << "zinf.quantized_gradient_bits: " << c.quantized_gradient_bits << "\n";
  }
  if (c.quantized_weights || c.quantized_nontrainable_weights || c.quantized_gradients) {
    o << "zinf.quantization_block_size: " << c.quantization_block_size << "\n";
  }
  o << "zinf.speculative_step: "
    << (c.speculative_step == SpeculativeStep::kOn    ? "true"
        : c.speculative_step == SpeculativeStep::kOff ? "false"
                                                      : "auto")
    << "\n";
  o << "zinf.durable: " << (c.durable ? "true" : "false") << "\n";
  for (const auto& [name, value] : extra) o << name << ": " << value << "\n";
  o << "parameters: " << layout.num_params() << "\n";
  for (ParamId id = 0; id < layout.num_params(); ++id) {
    const ParamInfo& p = layout.param(id).info;
    o << "parameter " << id << ": '" << p.name << "' " << Shape(p.shape)
      << (p.trainable ? "" : " frozen")
      << (p.param_group != 0 ? " in parameter group " + std::to_string(p.param_group) : "") << "\n";
  }
  return o.str();
}

std::string DescribeValues(const Layout& layout, const std::vector<uint64_t>& hashes) {
  std::ostringstream o;
  for (ParamId id = 0; id < layout.num_params() && id < hashes.size(); ++id) {
    if (hashes[id] == 0) continue;  // replaced since (a load)
    char hex[17];
    std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(hashes[id]));
    o << "the initial value of '" << layout.param(id).info.name << "' (xxh3): " << hex << "\n";
  }
  return o.str();
}

std::string FirstDifference(const std::string& rank0, int other_rank, const std::string& other) {
  const std::vector<std::string> a = Lines(rank0);
  const std::vector<std::string> b = Lines(other);
  const std::string r = "rank " + std::to_string(other_rank);
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    if (i < a.size() && i < b.size() && a[i] == b[i]) continue;
    if (i >= a.size()) return r + " has " + b[i] + ", which rank 0 has not";
    if (i >= b.size()) return "rank 0 has " + a[i] + ", which " + r + " has not";
    if (Key(a[i]) == Key(b[i])) {
      return Key(a[i]) + ": rank 0 has " + Value(a[i]) + ", " + r + " has " + Value(b[i]);
    }
    return "rank 0 has " + a[i] + " where " + r + " has " + b[i];
  }
  return "the same lines";  // not reached for texts that differ
}

Status AgreeAcrossRanks(HostCollectives* collectives, int world, const std::string& what,
                        const std::string& text, const std::string& remedy) {
  if (world <= 1) return Status::OK();
  const std::string doing = "comparing " + what + " across the ranks";
  const XXH128_hash_t h = XXH3_128bits(text.data(), text.size());
  const uint64_t mine[2] = {h.low64, h.high64};
  std::vector<uint64_t> digests(2 * static_cast<size_t>(world));
  ZINF_RETURN_IF_ERROR(collectives->AllGather(mine, digests.data(), sizeof(mine), doing));
  bool same = true;
  for (int r = 1; r < world; ++r) {
    same = same && digests[2 * r] == digests[0] && digests[2 * r + 1] == digests[1];
  }
  if (same) return Status::OK();
  // Every rank saw the same digests, so every rank is here: the texts, in chunks that fit the
  // small collectives' scratch (no allocation that could fail on one rank only).
  const uint64_t length = text.size();
  std::vector<uint64_t> lengths(world);
  ZINF_RETURN_IF_ERROR(collectives->AllGather(&length, lengths.data(), sizeof(length), doing));
  const uint64_t longest = *std::max_element(lengths.begin(), lengths.end());
  const size_t chunk =
      std::max<size_t>(1, HostCollectives::kSmallScratchBytes / (static_cast<size_t>(world) + 1));
  std::vector<std::string> texts(world, std::string(longest, '\0'));
  std::string send(chunk, '\0');
  std::vector<char> recv(chunk * world);
  for (uint64_t at = 0; at < longest; at += chunk) {
    const size_t n = std::min<uint64_t>(chunk, longest - at);
    std::fill(send.begin(), send.end(), '\0');
    if (at < text.size()) text.copy(send.data(), std::min<size_t>(n, text.size() - at), at);
    ZINF_RETURN_IF_ERROR(collectives->AllGather(send.data(), recv.data(), chunk, doing));
    for (int r = 0; r < world; ++r) std::memcpy(texts[r].data() + at, &recv[r * chunk], n);
  }
  for (int r = 0; r < world; ++r) texts[r].resize(lengths[r]);
  for (int r = 1; r < world; ++r) {
    if (texts[r] == texts[0]) continue;
    return Status::FailedPrecondition("the ranks disagree on " + what + ": " +
                                      FirstDifference(texts[0], r, texts[r]) + ". " + remedy);
  }
  return Status::FailedPrecondition("the ranks disagree on " + what +
                                    " (their digests differ, their texts do not): " + remedy);
}

}  // namespace zinf
