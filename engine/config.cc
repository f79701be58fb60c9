#include "zinf/config.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <span>
#include <string_view>
#include <utility>

#include "zinf/log.h"

namespace zinf {

const char* TierName(Tier tier) {
  switch (tier) {
    case Tier::kDevice:
      return "device";
    case Tier::kCpu:
      return "cpu";
    case Tier::kNvme:
      return "nvme";
  }
  return "unknown";
}

namespace {

using Json = nlohmann::json;

// Key paths of the sections, used in messages and in validation.
constexpr char kZero[] = "zero_optimization";
constexpr char kOffloadParam[] = "zero_optimization.offload_param";
constexpr char kOffloadOptimizer[] = "zero_optimization.offload_optimizer";

// Keys of the sections a user may write at the wrong level; an unknown top-level key that is
// one of these gets "did you mean zero_optimization.<key>?".
constexpr std::string_view kZeroKeys[] = {
    "stage",
    "offload_param",
    "offload_optimizer",
    "sub_group_size",
    "stage3_prefetch_bucket_size",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_param_persistence_threshold",
    "contiguous_gradients",
    "overlap_comm",
    "reduce_bucket_size",
    "reduce_scatter",
    "allgather_bucket_size",
    "stage3_gather_16bit_weights_on_model_save",
    "round_robin_gradients",
};
constexpr std::string_view kZinfKeys[] = {
    "device_budget_bytes", "pinned_budget_bytes",  "nvme_capacity_bytes",
    "nvme_reserve_bytes",  "delayed_update",       "checksums",
    "optimizer_threads",   "host_copy_gbps",       "io_backend",
    "nvme_paths",          "allowed_nvme_roots",   "durable",
    "durable_overwrite",   "delayed_update_after",
};
constexpr std::string_view kAioKeys[] = {
    "block_size", "queue_depth", "thread_count", "single_submit", "overlap_events", "use_gds",
};

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return out;
}

std::string FormatNumber(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

// A JSON value as a message shows it: "\"disk\"", "1.5", "true", "null", "an array".
std::string Describe(const Json& v) {
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  return v.dump(-1, ' ', false, Json::error_handler_t::replace);
}

// Edit distance with adjacent transpositions (optimal string alignment), for "did you mean".
size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

// The known key closest to `key` (case-insensitive), or "" when none is close enough to be a
// plausible typo. "max_live_parameters" also finds "stage3_max_live_parameters".
std::string SuggestKey(std::string_view key, const std::vector<std::string>& known) {
  const std::string lower = Lower(key);
  const size_t limit = lower.size() <= 4 ? 1 : lower.size() <= 10 ? 2 : 3;
  size_t best = limit + 1;
  std::string best_key;
  for (const std::string& candidate : known) {
    const std::string lower_candidate = Lower(candidate);
    if (lower_candidate == "stage3_" + lower) return candidate;
    size_t distance = EditDistance(lower, lower_candidate);
    if (distance < best) {
      best = distance;
      best_key = candidate;
    }
  }
  return best_key;
}

// Where warnings go: the caller's vector, or the zinf log when the caller passed none.
class WarningSink {
 public:
  explicit WarningSink(std::vector<std::string>* out) : out_(out) {}
  void Add(std::string warning) {
    if (out_ != nullptr) {
      out_->push_back(std::move(warning));
    } else {
      LogWarning(warning);
    }
  }

 private:
  std::vector<std::string>* out_;
};

struct ParseContext {
  explicit ParseContext(std::vector<std::string>* warnings) : warnings(warnings) {}
  WarningSink warnings;
  // Keys whose value was the Hugging Face placeholder "auto" (the default was kept); reported
  // in one warning at the end.
  std::vector<std::string> auto_keys;
};

Status TypeError(const std::string& path, std::string_view expected, const Json& got) {
  std::string msg = path + ": expected " + std::string(expected) + ", got " + Describe(got);
  if (got.is_string()) {
    const std::string& s = got.get_ref<const std::string&>();
    bool numeric = !s.empty() && s.find_first_not_of("0123456789.eE+-") == std::string::npos;
    if (numeric || s == "true" || s == "false") msg += "; write the value without quotes";
  }
  return Status::InvalidArgument(std::move(msg));
}

// A non-negative integer no larger than `max`. Integral floats count (DeepSpeed configs write
// 5e7 for 50000000); 1.5 and -4 do not.
Result<uint64_t> ToUnsigned(const Json& v, const std::string& path, uint64_t max) {
  uint64_t value = 0;
  if (v.is_number_unsigned()) {
    value = v.get<uint64_t>();
  } else if (v.is_number_integer()) {  // negative: unsigned ones were caught above
    return TypeError(path, "a non-negative integer", v);
  } else if (v.is_number_float()) {
    double d = v.get<double>();
    if (!(d >= 0) || std::floor(d) != d) return TypeError(path, "a non-negative integer", v);
    if (d >= 18446744073709551616.0) {
      return Status::InvalidArgument(path + ": " + Describe(v) + " is too large for an integer");
    }
    value = static_cast<uint64_t>(d);
  } else {
    return TypeError(path, "a non-negative integer", v);
  }
  if (value > max) {
    return Status::InvalidArgument(path + ": expected an integer no larger than " +
                                   std::to_string(max) + ", got " + Describe(v));
  }
  return value;
}

}  // namespace

Result<uint64_t> ParseByteSize(const std::string& text, const std::string& path) {
  auto bad = [&] {
    return Status::InvalidArgument(path + ": expected a byte count such as 4294967296 or \"4G\" " +
                                   "(units B, K, M, G, T; powers of 1024), got \"" + text + "\"");
  };
  size_t i = 0;
  while (i < text.size() && text[i] == ' ') ++i;
  const size_t number_begin = i;
  while (i < text.size() && ((text[i] >= '0' && text[i] <= '9') || text[i] == '.')) ++i;
  std::string number = text.substr(number_begin, i - number_begin);
  if (number.empty() || number == "." || std::count(number.begin(), number.end(), '.') > 1) {
    return bad();
  }
  while (i < text.size() && text[i] == ' ') ++i;
  std::string unit = Lower(std::string_view(text).substr(i));
  while (!unit.empty() && unit.back() == ' ') unit.pop_back();
  int shift = -1;
  const std::pair<const char*, int> kUnits[] = {
      {"", 0},    {"b", 0},    {"k", 10}, {"kb", 10}, {"kib", 10}, {"m", 20},
      {"mb", 20}, {"mib", 20}, {"g", 30}, {"gb", 30}, {"gib", 30}, {"t", 40},
      {"tb", 40}, {"tib", 40}, {"p", 50}, {"pb", 50}, {"pib", 50},
  };
  for (const auto& [name, unit_shift] : kUnits) {
    if (unit == name) shift = unit_shift;
  }
  if (shift < 0) return bad();
  long double value = std::strtold(number.c_str(), nullptr) * std::ldexp(1.0L, shift);
  if (std::floor(value) != value) {
    return Status::InvalidArgument(path + ": \"" + text + "\" is not a whole number of bytes");
  }
  if (value >= 18446744073709551616.0L) {
    return Status::InvalidArgument(path + ": \"" + text + "\" is too large");
  }
  return static_cast<uint64_t>(value);
}

namespace {

// Reads one JSON object at a key path. Each Read/Find call names a key this object may hold;
// Finish() then warns once for every key no call named.
class ObjectReader {
 public:
  ObjectReader(const Json& object, std::string path, ParseContext* ctx)
      : object_(&object), path_(std::move(path)), ctx_(ctx) {}

  const std::string& path() const { return path_; }
  std::string PathOf(std::string_view key) const {
    return path_.empty() ? std::string(key) : path_ + "." + std::string(key);
  }

  // The value under `key`, or nullptr when absent. Marks `key` known.
  const Json* Find(std::string_view key) {
    known_.emplace_back(key);
    auto it = object_->find(std::string(key));
    return it == object_->end() ? nullptr : &*it;
  }

  // Known keys that zinf accepts and does not use.
  void Ignore(std::initializer_list<std::string_view> keys) {
    for (std::string_view key : keys) known_.emplace_back(key);
  }
  // A known key zinf does not implement: a warning with `note` when it is present.
  void IgnoreWithWarning(std::string_view key, std::string_view note) {
    if (Find(key) != nullptr) ctx_->warnings.Add(PathOf(key) + ": " + std::string(note));
  }
  // Every key of this object is accepted (a section zinf ignores as a whole).
  void IgnoreOtherKeys() { ignore_others_ = true; }

  // Each Read* leaves *out unchanged when the key is absent or "auto".
  Status ReadUint64(std::string_view key, uint64_t* out) {
    return ReadUnsigned(key, UINT64_MAX, out);
  }
  Status ReadUint32(std::string_view key, uint32_t* out) {
    uint64_t v = *out;
    ZINF_RETURN_IF_ERROR(ReadUnsigned(key, UINT32_MAX, &v));
    *out = static_cast<uint32_t>(v);
    return Status::OK();
  }
  Status ReadInt(std::string_view key, int* out) {
    uint64_t v = static_cast<uint64_t>(*out);
    ZINF_RETURN_IF_ERROR(ReadUnsigned(key, INT_MAX, &v));
    *out = static_cast<int>(v);
    return Status::OK();
  }

  Status ReadBool(std::string_view key, bool* out) {
    const Json* v = Find(key);
    if (v == nullptr || IsAuto(*v, key)) return Status::OK();
    if (!v->is_boolean()) return TypeError(PathOf(key), "true or false", *v);
    *out = v->get<bool>();
    return Status::OK();
  }

  Status ReadDouble(std::string_view key, double* out) {
    const Json* v = Find(key);
    if (v == nullptr || IsAuto(*v, key)) return Status::OK();
    ZINF_ASSIGN_OR_RETURN(*out, ToDouble(*v, PathOf(key)));
    return Status::OK();
  }

  Status ReadFloat(std::string_view key, float* out) {
    const Json* v = Find(key);
    if (v == nullptr || IsAuto(*v, key)) return Status::OK();
    ZINF_ASSIGN_OR_RETURN(*out, ToFloat(*v, PathOf(key)));
    return Status::OK();
  }

  // A byte count: an integer (5e9 allowed) or a string with a unit ("4G").
  Status ReadByteSize(std::string_view key, uint64_t* out) {
    const Json* v = Find(key);
    if (v == nullptr) return Status::OK();
    if (v->is_string()) {
      ZINF_ASSIGN_OR_RETURN(*out, ParseByteSize(v->get<std::string>(), PathOf(key)));
      return Status::OK();
    }
    if (!v->is_number()) {
      return TypeError(PathOf(key), "a byte count such as 4294967296 or \"4G\"", *v);
    }
    ZINF_ASSIGN_OR_RETURN(*out, ToUnsigned(*v, PathOf(key), UINT64_MAX));
    return Status::OK();
  }

  // One of `names` (compared case-insensitively); sets *out to the matching value.
  template <typename T>
  Status ReadEnum(std::string_view key, std::initializer_list<std::pair<const char*, T>> names,
                  T* out) {
    const Json* v = Find(key);
    if (v == nullptr) return Status::OK();
    std::string expected = "one of ";
    for (const auto& [name, value] : names) {
      if (expected.size() > 7) expected += ", ";
      expected += name;
    }
    if (!v->is_string()) return TypeError(PathOf(key), expected, *v);
    const std::string lower = Lower(v->get_ref<const std::string&>());
    for (const auto& [name, value] : names) {
      if (lower == Lower(name)) {
        *out = value;
        return Status::OK();
      }
    }
    return Status::InvalidArgument(PathOf(key) + ": expected " + expected + ", got " +
                                   Describe(*v));
  }

  // Paths: a string (DeepSpeed's nvme_path), an array of strings (zinf), or null (none).
  // Appends to *out, skipping paths already there.
  Status ReadPaths(std::string_view key, std::vector<std::string>* out, bool* present) {
    const Json* v = Find(key);
    *present = false;
    if (v == nullptr || v->is_null()) return Status::OK();
    const std::string path = PathOf(key);
    auto add = [&](const Json& item, const std::string& item_path) -> Status {
      if (!item.is_string()) {
        return TypeError(item_path, "a path string or an array of path strings", item);
      }
      const std::string& s = item.get_ref<const std::string&>();
      if (s.empty()) {
        return Status::InvalidArgument(item_path +
                                       ": empty path; give a directory on an NVMe drive, such "
                                       "as \"/local_nvme\"");
      }
      if (std::find(out->begin(), out->end(), s) == out->end()) out->push_back(s);
      *present = true;
      return Status::OK();
    };
    if (v->is_array()) {
      for (size_t i = 0; i < v->size(); ++i) {
        ZINF_RETURN_IF_ERROR(add((*v)[i], path + "[" + std::to_string(i) + "]"));
      }
      return Status::OK();
    }
    return add(*v, path);
  }

  // The object under `key`; nullopt when absent or null.
  Result<std::optional<ObjectReader>> Object(std::string_view key) {
    const Json* v = Find(key);
    if (v == nullptr || v->is_null()) return std::optional<ObjectReader>();
    if (!v->is_object()) return TypeError(PathOf(key), "an object {...}", *v);
    return std::optional<ObjectReader>(ObjectReader(*v, PathOf(key), ctx_));
  }

  // Warns once for each key that no call named. `elsewhere` lists keys that belong to other
  // sections (section name, its keys), for "did you mean zero_optimization.stage?".
  void Finish(std::initializer_list<std::pair<std::string_view, std::span<const std::string_view>>>
                  elsewhere = {}) {
    if (ignore_others_) return;
    for (const auto& [key, value] : object_->items()) {
      if (std::find(known_.begin(), known_.end(), key) != known_.end()) continue;
      std::string warning = PathOf(key) + ": unknown key, ignored";
      // A key of another section is a surer guess than a near miss in this one.
      std::string suggestion;
      for (const auto& [section, keys] : elsewhere) {
        if (std::find(keys.begin(), keys.end(), key) != keys.end()) {
          suggestion = std::string(section) + "." + key;
          break;
        }
      }
      if (suggestion.empty()) suggestion = SuggestKey(key, known_);
      if (!suggestion.empty()) warning += " (did you mean " + suggestion + "?)";
      ctx_->warnings.Add(std::move(warning));
    }
  }

 private:
  // True when `v` is the Hugging Face Trainer placeholder "auto"; the default stays.
  bool IsAuto(const Json& v, std::string_view key) {
    if (!v.is_string() || v.get_ref<const std::string&>() != "auto") return false;
    ctx_->auto_keys.push_back(PathOf(key));
    return true;
  }

  Status ReadUnsigned(std::string_view key, uint64_t max, uint64_t* out) {
    const Json* v = Find(key);
    if (v == nullptr || IsAuto(*v, key)) return Status::OK();
    ZINF_ASSIGN_OR_RETURN(*out, ToUnsigned(*v, PathOf(key), max));
    return Status::OK();
  }

  static Result<double> ToDouble(const Json& v, const std::string& path) {
    if (!v.is_number()) return TypeError(path, "a number", v);
    double d = v.get<double>();
    if (!std::isfinite(d)) return TypeError(path, "a finite number", v);
    return d;
  }

  static Result<float> ToFloat(const Json& v, const std::string& path) {
    ZINF_ASSIGN_OR_RETURN(double d, ToDouble(v, path));
    if (std::fabs(d) > FLT_MAX) {
      return Status::InvalidArgument(path + ": " + Describe(v) + " is out of range for a float");
    }
    return static_cast<float>(d);
  }

  friend Status ReadBetas(ObjectReader& params, OptimizerConfig* optimizer);

  const Json* object_;
  std::string path_;
  ParseContext* ctx_;
  std::vector<std::string> known_;
  bool ignore_others_ = false;
};

// "betas": [beta1, beta2].
Status ReadBetas(ObjectReader& params, OptimizerConfig* optimizer) {
  const Json* v = params.Find("betas");
  if (v == nullptr || params.IsAuto(*v, "betas")) return Status::OK();
  const std::string path = params.PathOf("betas");
  if (!v->is_array() || v->size() != 2) {
    std::string got = Describe(*v);
    if (v->is_array()) got = "an array of length " + std::to_string(v->size());
    return Status::InvalidArgument(path +
                                   ": expected an array of two numbers [beta1, beta2], got " + got);
  }
  ZINF_ASSIGN_OR_RETURN(optimizer->beta1, ObjectReader::ToFloat((*v)[0], path + "[0]"));
  ZINF_ASSIGN_OR_RETURN(optimizer->beta2, ObjectReader::ToFloat((*v)[1], path + "[1]"));
  return Status::OK();
}

// offload_param or offload_optimizer (is_optimizer): the keys DeepSpeed defines for each.
Status ParseOffload(ObjectReader& r, bool is_optimizer, OffloadConfig* offload, ParseContext* ctx) {
  ZINF_RETURN_IF_ERROR(r.ReadEnum<Tier>(
      "device", {{"none", Tier::kDevice}, {"cpu", Tier::kCpu}, {"nvme", Tier::kNvme}},
      &offload->tier));
  bool has_path = false;
  ZINF_RETURN_IF_ERROR(r.ReadPaths("nvme_path", &offload->nvme_paths, &has_path));
  if (has_path && offload->tier != Tier::kNvme) {
    ctx->warnings.Add(r.PathOf("nvme_path") + ": not used, because device is \"" +
                      (offload->tier == Tier::kCpu ? "cpu" : "none") + "\"");
  }
  ZINF_RETURN_IF_ERROR(r.ReadUint32("buffer_count", &offload->buffer_count));
  ZINF_RETURN_IF_ERROR(r.ReadBool("pin_memory", &offload->pin_memory));
  if (!is_optimizer) {
    ZINF_RETURN_IF_ERROR(r.ReadUint64("buffer_size", &offload->buffer_size));
    ZINF_RETURN_IF_ERROR(r.ReadUint64("max_in_cpu", &offload->max_in_cpu));
  } else {
    bool pipeline = false;
    ZINF_RETURN_IF_ERROR(r.ReadBool("pipeline", &pipeline));
    if (pipeline) offload->pipeline_read = offload->pipeline_write = true;
    ZINF_RETURN_IF_ERROR(r.ReadBool("pipeline_read", &offload->pipeline_read));
    ZINF_RETURN_IF_ERROR(r.ReadBool("pipeline_write", &offload->pipeline_write));
    bool fast_init = false;  // DeepSpeed's swap-file initialisation shortcut; zinf fallocates
    ZINF_RETURN_IF_ERROR(r.ReadBool("fast_init", &fast_init));
    ZINF_RETURN_IF_ERROR(r.ReadDouble("ratio", &offload->ratio));
  }
  r.Finish();
  return Status::OK();
}

Status ParseZeroOptimization(ObjectReader& r, EngineConfig* config, ParseContext* ctx) {
  if (const Json* stage = r.Find("stage"); stage != nullptr) {
    ZINF_ASSIGN_OR_RETURN(uint64_t value, ToUnsigned(*stage, r.PathOf("stage"), UINT64_MAX));
    if (value <= 2) {
      return Status::NotSupported(r.PathOf("stage") + ": zinf implements ZeRO stage 3 only, got " +
                                  std::to_string(value) + "; set \"stage\": 3");
    }
    if (value != 3) {
      return Status::InvalidArgument(r.PathOf("stage") + ": expected 3 (DeepSpeed stages are " +
                                     "0 to 3 and zinf implements 3), got " + Describe(*stage));
    }
    config->zero_stage = 3;
  }
  ZINF_ASSIGN_OR_RETURN(std::optional<ObjectReader> param, r.Object("offload_param"));
  if (param) ZINF_RETURN_IF_ERROR(ParseOffload(*param, false, &config->offload_param, ctx));
  ZINF_ASSIGN_OR_RETURN(std::optional<ObjectReader> opt, r.Object("offload_optimizer"));
  if (opt) ZINF_RETURN_IF_ERROR(ParseOffload(*opt, true, &config->offload_optimizer, ctx));
  ZINF_RETURN_IF_ERROR(r.ReadUint64("sub_group_size", &config->sub_group_size));
  ZINF_RETURN_IF_ERROR(r.ReadUint64("stage3_prefetch_bucket_size", &config->prefetch_bucket_size));
  ZINF_RETURN_IF_ERROR(r.ReadUint64("stage3_max_live_parameters", &config->max_live_parameters));
  ZINF_RETURN_IF_ERROR(r.ReadUint64("stage3_max_reuse_distance", &config->max_reuse_distance));
  ZINF_RETURN_IF_ERROR(
      r.ReadUint64("stage3_param_persistence_threshold", &config->param_persistence_threshold));
  // Communication and bucketing knobs of DeepSpeed's own implementation: no zinf meaning.
  r.Ignore({"contiguous_gradients", "overlap_comm", "reduce_bucket_size", "reduce_scatter",
            "allgather_bucket_size", "allgather_partitions",
            "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
            "round_robin_gradients", "memory_efficient_linear", "ignore_unused_parameters",
            "elastic_checkpoint", "load_from_fp32_weights", "stage3_model_persistence_threshold",
            "stage3_module_granularity_threshold", "log_trace_cache_warnings",
            "use_multi_rank_bucket_allreduce", "legacy_stage1"});
  for (std::string_view key : {"cpu_offload", "cpu_offload_params", "cpu_offload_use_pin_memory"}) {
    r.IgnoreWithWarning(key,
                        "deprecated DeepSpeed key, ignored; use offload_optimizer / offload_param "
                        "with \"device\": \"cpu\"");
  }
  for (std::string_view key :
       {"zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
        "zero_quantized_gradients", "mics_shard_size", "mics_hierarchical_params_gather"}) {
    r.IgnoreWithWarning(key, "DeepSpeed feature not implemented by zinf, ignored");
  }
  r.Finish();
  return Status::OK();
}

Status ParseOptimizer(ObjectReader& r, OptimizerConfig* optimizer, ParseContext* ctx) {
  const Json* type = r.Find("type");
  if (type == nullptr) {
    return Status::InvalidArgument(r.PathOf("type") +
                                   ": missing; set \"type\" to one of Adam, AdamW, Adagrad, Lion");
  }
  OptimizerType kind = OptimizerType::kAdamW;
  ZINF_RETURN_IF_ERROR(r.ReadEnum<OptimizerType>("type",
                                                 {{"Adam", OptimizerType::kAdam},
                                                  {"AdamW", OptimizerType::kAdamW},
                                                  {"Adagrad", OptimizerType::kAdagrad},
                                                  {"Lion", OptimizerType::kLion}},
                                                 &kind));
  r.Ignore({"legacy_fusion"});
  std::optional<bool> adam_w_mode;
  ZINF_ASSIGN_OR_RETURN(std::optional<ObjectReader> params, r.Object("params"));
  if (params) {
    ZINF_RETURN_IF_ERROR(params->ReadFloat("lr", &optimizer->lr));
    ZINF_RETURN_IF_ERROR(ReadBetas(*params, optimizer));
    ZINF_RETURN_IF_ERROR(params->ReadFloat("eps", &optimizer->eps));
    ZINF_RETURN_IF_ERROR(params->ReadFloat("weight_decay", &optimizer->weight_decay));
    if (params->Find("adam_w_mode") != nullptr) {
      bool mode = true;
      ZINF_RETURN_IF_ERROR(params->ReadBool("adam_w_mode", &mode));
      adam_w_mode = mode;
    }
    bool bias_correction = true;
    ZINF_RETURN_IF_ERROR(params->ReadBool("bias_correction", &bias_correction));
    if (!bias_correction) {
      return Status::NotSupported(params->PathOf("bias_correction") +
                                  ": zinf always applies Adam bias correction; remove the key or "
                                  "set it to true");
    }
    bool amsgrad = false;
    ZINF_RETURN_IF_ERROR(params->ReadBool("amsgrad", &amsgrad));
    if (amsgrad) {
      return Status::NotSupported(params->PathOf("amsgrad") +
                                  ": AMSGrad is not supported; remove the key or set it to false");
    }
    params->Ignore({"torch_adam", "fused"});  // implementation choices; zinf has its own
    if (adam_w_mode.has_value() &&
        (kind == OptimizerType::kAdagrad || kind == OptimizerType::kLion)) {
      ctx->warnings.Add(params->PathOf("adam_w_mode") + ": applies only to type Adam; ignored");
    } else if (adam_w_mode == false && kind == OptimizerType::kAdamW) {
      ctx->warnings.Add(params->PathOf("adam_w_mode") +
                        ": false has no effect with type AdamW; use type Adam for L2 weight decay");
    }
    params->Finish();
  }
  // As in DeepSpeed, type Adam means AdamW (decoupled weight decay) unless adam_w_mode is false.
  if (kind == OptimizerType::kAdam && adam_w_mode.value_or(true)) kind = OptimizerType::kAdamW;
  optimizer->type = kind;
  r.Finish();
  return Status::OK();
}

Status ParseAio(ObjectReader& r, AioConfig* aio, ParseContext* ctx) {
  ZINF_RETURN_IF_ERROR(r.ReadUint32("block_size", &aio->block_size));
  ZINF_RETURN_IF_ERROR(r.ReadUint32("queue_depth", &aio->queue_depth));
  ZINF_RETURN_IF_ERROR(r.ReadUint32("intra_op_parallelism", &aio->thread_count));  // newer name
  ZINF_RETURN_IF_ERROR(r.ReadUint32("thread_count", &aio->thread_count));
  ZINF_RETURN_IF_ERROR(r.ReadBool("single_submit", &aio->single_submit));
  ZINF_RETURN_IF_ERROR(r.ReadBool("overlap_events", &aio->overlap_events));
  bool use_gds = false;
  ZINF_RETURN_IF_ERROR(r.ReadBool("use_gds", &use_gds));
  if (use_gds) {
    ctx->warnings.Add(r.PathOf("use_gds") +
                      ": GPUDirect Storage is not supported; ignored, NVMe I/O goes through "
                      "pinned host buffers");
  }
  r.Finish();
  return Status::OK();
}

// "zinf": {...}. zinf.nvme_paths go to *extra_nvme_paths; the caller adds them to nvme tiers.
Status ParseZinf(ObjectReader& r, EngineConfig* config, std::vector<std::string>* extra_nvme_paths,
                 bool* has_extra_paths) {
  ZINF_RETURN_IF_ERROR(r.ReadByteSize("device_budget_bytes", &config->device_budget_bytes));
  ZINF_RETURN_IF_ERROR(r.ReadByteSize("pinned_budget_bytes", &config->pinned_budget_bytes));
  ZINF_RETURN_IF_ERROR(r.ReadByteSize("nvme_capacity_bytes", &config->nvme_capacity_bytes));
  ZINF_RETURN_IF_ERROR(r.ReadByteSize("nvme_reserve_bytes", &config->nvme_reserve_bytes));
  ZINF_RETURN_IF_ERROR(r.ReadBool("delayed_update", &config->delayed_update));
  ZINF_RETURN_IF_ERROR(r.ReadBool("durable", &config->durable));
  ZINF_RETURN_IF_ERROR(r.ReadBool("durable_overwrite", &config->durable_overwrite));
  ZINF_RETURN_IF_ERROR(r.ReadUint64("delayed_update_after", &config->delayed_update_after));
  ZINF_RETURN_IF_ERROR(r.ReadBool("checksums", &config->checksums));
  ZINF_RETURN_IF_ERROR(r.ReadInt("optimizer_threads", &config->optimizer_threads));
  ZINF_RETURN_IF_ERROR(r.ReadDouble("host_copy_gbps", &config->host_copy_gbps));
  ZINF_RETURN_IF_ERROR(r.ReadEnum<std::string>(
      "io_backend", {{"io_uring", "io_uring"}, {"libaio", "libaio"}, {"psync", "psync"}},
      &config->aio.backend));
  if (const Json* paths = r.Find("nvme_paths"); paths != nullptr && !paths->is_null()) {
    if (!paths->is_array()) {
      return TypeError(r.PathOf("nvme_paths"), "an array of path strings", *paths);
    }
    ZINF_RETURN_IF_ERROR(r.ReadPaths("nvme_paths", extra_nvme_paths, has_extra_paths));
  }
  if (const Json* roots = r.Find("allowed_nvme_roots"); roots != nullptr && !roots->is_null()) {
    if (!roots->is_array()) {
      return TypeError(r.PathOf("allowed_nvme_roots"), "an array of folder strings", *roots);
    }
    bool present = false;
    ZINF_RETURN_IF_ERROR(r.ReadPaths("allowed_nvme_roots", &config->allowed_nvme_roots, &present));
  }
  r.Finish();
  return Status::OK();
}

// Precision sections: "bf16" (and its old name "bfloat16"), "fp16", "amp".
Status ParsePrecision(ObjectReader& root, EngineConfig* config) {
  for (const char* name : {"bfloat16", "bf16"}) {
    ZINF_ASSIGN_OR_RETURN(std::optional<ObjectReader> bf16, root.Object(name));
    if (!bf16) continue;
    ZINF_RETURN_IF_ERROR(bf16->ReadBool("enabled", &config->bf16));
    bf16->Ignore({"immediate_grad_update", "check_grad_overflow"});
    bf16->Finish();
  }
  ZINF_ASSIGN_OR_RETURN(std::optional<ObjectReader> fp16, root.Object("fp16"));
  if (fp16) {
    bool enabled = false;
    ZINF_RETURN_IF_ERROR(fp16->ReadBool("enabled", &enabled));
    if (enabled) {
      return Status::NotSupported(fp16->PathOf("enabled") +
                                  ": fp16 is not supported; use bf16 (set \"fp16\": {\"enabled\": "
                                  "false} and \"bf16\": {\"enabled\": true})");
    }
    fp16->IgnoreOtherKeys();  // loss scaling settings, moot while fp16 is off
  }
  ZINF_ASSIGN_OR_RETURN(std::optional<ObjectReader> amp, root.Object("amp"));
  if (amp) {
    bool enabled = false;
    ZINF_RETURN_IF_ERROR(amp->ReadBool("enabled", &enabled));
    if (enabled) {
      return Status::NotSupported(amp->PathOf("enabled") +
                                  ": Apex AMP is not supported; use bf16 (set \"amp\": "
                                  "{\"enabled\": false} and \"bf16\": {\"enabled\": true})");
    }
    amp->IgnoreOtherKeys();
  }
  return Status::OK();
}

Status ParseRoot(ObjectReader& root, EngineConfig* config, ParseContext* ctx) {
  ZINF_RETURN_IF_ERROR(root.ReadUint64("train_batch_size", &config->train_batch_size));
  ZINF_RETURN_IF_ERROR(
      root.ReadUint64("train_micro_batch_size_per_gpu", &config->train_micro_batch_size_per_gpu));
  ZINF_RETURN_IF_ERROR(
      root.ReadInt("gradient_accumulation_steps", &config->gradient_accumulation_steps));
  ZINF_RETURN_IF_ERROR(root.ReadDouble("gradient_clipping", &config->gradient_clipping));
  ZINF_RETURN_IF_ERROR(ParsePrecision(root, config));

  ZINF_ASSIGN_OR_RETURN(std::optional<ObjectReader> optimizer, root.Object("optimizer"));
  if (optimizer) ZINF_RETURN_IF_ERROR(ParseOptimizer(*optimizer, &config->optimizer, ctx));
  ZINF_ASSIGN_OR_RETURN(std::optional<ObjectReader> zero, root.Object(kZero));
  if (zero) ZINF_RETURN_IF_ERROR(ParseZeroOptimization(*zero, config, ctx));
  ZINF_ASSIGN_OR_RETURN(std::optional<ObjectReader> aio, root.Object("aio"));
  if (aio) ZINF_RETURN_IF_ERROR(ParseAio(*aio, &config->aio, ctx));

  std::vector<std::string> extra_paths;
  bool has_extra_paths = false;
  ZINF_ASSIGN_OR_RETURN(std::optional<ObjectReader> zinf, root.Object("zinf"));
  if (zinf) ZINF_RETURN_IF_ERROR(ParseZinf(*zinf, config, &extra_paths, &has_extra_paths));
  bool any_nvme = false;
  for (OffloadConfig* offload : {&config->offload_param, &config->offload_optimizer}) {
    if (offload->tier != Tier::kNvme) continue;
    any_nvme = true;
    for (const std::string& path : extra_paths) {
      if (std::find(offload->nvme_paths.begin(), offload->nvme_paths.end(), path) ==
          offload->nvme_paths.end()) {
        offload->nvme_paths.push_back(path);
      }
    }
  }
  if (has_extra_paths && !any_nvme) {
    ctx->warnings.Add(
        "zinf.nvme_paths: not used, because neither offload_param nor offload_optimizer has "
        "\"device\": \"nvme\"");
  }

  // Keys a DeepSpeed config carries that have no zinf meaning (logging, monitoring,
  // communication dtype, activation checkpointing that the trainer owns).
  root.Ignore({"steps_per_print",
               "wall_clock_breakdown",
               "zero_allow_untested_optimizer",
               "gradient_predivide_factor",
               "prescale_gradients",
               "communication_data_type",
               "seq_parallel_communication_data_type",
               "flops_profiler",
               "tensorboard",
               "wandb",
               "csv_monitor",
               "comet",
               "comms_logger",
               "activation_checkpointing",
               "memory_breakdown",
               "dump_state",
               "zero_force_ds_cpu_optimizer",
               "checkpoint",
               "load_universal_checkpoint",
               "data_types",
               "disable_allgather"});
  root.IgnoreWithWarning("scheduler",
                         "ignored; zinf does not run DeepSpeed learning-rate schedulers, the "
                         "trainer sets the learning rate each step");
  for (std::string_view key :
       {"elasticity", "autotuning", "compression_training", "data_efficiency",
        "curriculum_learning", "sparse_attention", "pipeline", "sparse_gradients"}) {
    root.IgnoreWithWarning(key, "DeepSpeed feature not implemented by zinf, ignored");
  }
  root.Finish({{kZero, kZeroKeys}, {"zinf", kZinfKeys}, {"aio", kAioKeys}});
  return Status::OK();
}

Status Validate(const EngineConfig& c) {
  auto invalid = [](const std::string& path, const std::string& what) {
    return Status::InvalidArgument(path + ": " + what);
  };
  const std::pair<const OffloadConfig*, const char*> offloads[] = {
      {&c.offload_param, kOffloadParam}, {&c.offload_optimizer, kOffloadOptimizer}};
  for (const auto& [offload, path] : offloads) {
    if (offload->tier == Tier::kNvme && offload->nvme_paths.empty()) {
      return invalid(std::string(path) + ".nvme_path",
                     "device is \"nvme\" but no NVMe path is set; set \"nvme_path\": "
                     "\"/local_nvme\" (a directory on an NVMe drive) there, or list paths in "
                     "zinf.nvme_paths");
    }
    if (offload->buffer_count < 1) {
      return invalid(std::string(path) + ".buffer_count", "must be at least 1, got 0");
    }
  }
  if (c.offload_param.buffer_size == 0) {
    return invalid(std::string(kOffloadParam) + ".buffer_size",
                   "must be positive (elements per swap buffer), got 0");
  }
  if (!(c.offload_optimizer.ratio >= 0 && c.offload_optimizer.ratio <= 1)) {
    return invalid(std::string(kOffloadOptimizer) + ".ratio",
                   "must be in [0, 1] (the fraction of optimizer state offloaded), got " +
                       FormatNumber(c.offload_optimizer.ratio));
  }
  if (c.sub_group_size == 0) {
    return invalid(std::string(kZero) + ".sub_group_size",
                   "must be positive (elements per optimizer sub-group, e.g. 1e9), got 0");
  }
  if (c.max_live_parameters == 0) {
    return invalid(std::string(kZero) + ".stage3_max_live_parameters",
                   "must be positive (elements resident on the device, e.g. 1e9), got 0");
  }

  const OptimizerConfig& o = c.optimizer;
  if (!(o.lr >= 0))
    return invalid("optimizer.params.lr", "must be >= 0, got " + FormatNumber(o.lr));
  const std::pair<float, const char*> betas[] = {{o.beta1, "beta1"}, {o.beta2, "beta2"}};
  for (const auto& [beta, name] : betas) {
    if (!(beta >= 0 && beta < 1)) {
      return invalid("optimizer.params.betas", std::string(name) + " must be in [0, 1), got " +
                                                   FormatNumber(beta) +
                                                   "; typical values are [0.9, 0.999]");
    }
  }
  if (!(o.eps > 0)) {
    return invalid("optimizer.params.eps", "must be > 0 (e.g. 1e-8), got " + FormatNumber(o.eps));
  }
  if (!(o.weight_decay >= 0)) {
    return invalid("optimizer.params.weight_decay",
                   "must be >= 0, got " + FormatNumber(o.weight_decay));
  }

  if (c.gradient_accumulation_steps < 1) {
    return invalid("gradient_accumulation_steps",
                   "must be at least 1, got " + std::to_string(c.gradient_accumulation_steps));
  }
  if (!(c.gradient_clipping >= 0)) {
    return invalid("gradient_clipping",
                   "must be >= 0 (0 turns clipping off), got " + FormatNumber(c.gradient_clipping));
  }
  if (c.train_batch_size > 0 && c.train_micro_batch_size_per_gpu > 0) {
    unsigned __int128 per_rank = static_cast<unsigned __int128>(c.train_micro_batch_size_per_gpu) *
                                 static_cast<unsigned>(c.gradient_accumulation_steps);
    if (c.train_batch_size % per_rank != 0) {
      return invalid("train_batch_size",
                     std::to_string(c.train_batch_size) +
                         " is not a multiple of train_micro_batch_size_per_gpu (" +
                         std::to_string(c.train_micro_batch_size_per_gpu) +
                         ") x gradient_accumulation_steps (" +
                         std::to_string(c.gradient_accumulation_steps) +
                         "); it must equal micro batch x accumulation steps x data-parallel ranks");
    }
  }

  if (c.aio.block_size == 0 || c.aio.block_size % 4096 != 0) {
    return invalid("aio.block_size",
                   "must be a positive multiple of 4096 bytes (e.g. 1048576), got " +
                       std::to_string(c.aio.block_size));
  }
  if (c.aio.queue_depth < 1 || c.aio.queue_depth > 4096) {
    return invalid("aio.queue_depth",
                   "must be in 1..4096, got " + std::to_string(c.aio.queue_depth));
  }
  if (c.aio.thread_count < 1 || c.aio.thread_count > 1024) {
    return invalid("aio.thread_count",
                   "must be in 1..1024, got " + std::to_string(c.aio.thread_count));
  }

  if (c.pinned_budget_bytes == 0) {
    return invalid("zinf.pinned_budget_bytes",
                   "must be positive (pinned host memory for transfers), e.g. \"1G\"; got 0");
  }
  if (!(c.host_copy_gbps >= 0)) {
    return invalid("zinf.host_copy_gbps",
                   "must be >= 0 (0 means memcpy speed), got " + FormatNumber(c.host_copy_gbps));
  }
  return Status::OK();
}

// 1-based line and column (in characters) of the byte at `offset` in `text`.
std::pair<size_t, size_t> LineColumn(const std::string& text, size_t offset) {
  offset = std::min(offset, text.size());
  size_t line = 1;
  size_t line_begin = 0;
  for (size_t i = 0; i < offset; ++i) {
    if (text[i] == '\n') {
      ++line;
      line_begin = i + 1;
    }
  }
  size_t column = 1;
  for (size_t i = line_begin; i < offset; ++i) {
    if ((static_cast<unsigned char>(text[i]) & 0xC0) != 0x80) ++column;  // skip UTF-8 tails
  }
  return {line, column};
}

// Finds the first key repeated within one object (DeepSpeed rejects those too; nlohmann
// silently keeps the last).
class DuplicateKeyFinder {
 public:
  bool OnEvent(Json::parse_event_t event, const Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
      case Json::parse_event_t::array_start:
        stack_.push_back(Frame{event == Json::parse_event_t::object_start, {}, {}, 0});
        break;
      case Json::parse_event_t::object_end:
      case Json::parse_event_t::array_end:
        if (!stack_.empty()) stack_.pop_back();
        if (!stack_.empty() && !stack_.back().is_object) ++stack_.back().next_index;
        break;
      case Json::parse_event_t::key: {
        Frame& top = stack_.back();
        top.key = parsed.get<std::string>();
        if (!top.keys.insert(top.key).second && duplicate_.empty()) duplicate_ = Path();
        break;
      }
      case Json::parse_event_t::value:
        if (!stack_.empty() && !stack_.back().is_object) ++stack_.back().next_index;
        break;
    }
    return true;
  }
  // The key path of the first repeated key, or "".
  const std::string& duplicate() const { return duplicate_; }

 private:
  struct Frame {
    bool is_object;
    std::set<std::string> keys;
    std::string key;
    size_t next_index;
  };
  std::string Path() const {
    std::string path;
    for (const Frame& frame : stack_) {
      if (frame.is_object) {
        path += (path.empty() ? "" : ".") + frame.key;
      } else {
        path += "[" + std::to_string(frame.next_index) + "]";
      }
    }
    return path;
  }

  std::vector<Frame> stack_;
  std::string duplicate_;
};

Result<Json> ParseJson(const std::string& text) {
  DuplicateKeyFinder duplicates;
  Json root;
  try {
    root = Json::parse(
        text,
        [&duplicates](int /*depth*/, Json::parse_event_t event, Json& parsed) {
          return duplicates.OnEvent(event, parsed);
        },
        /*allow_exceptions=*/true, /*ignore_comments=*/true);
  } catch (const Json::parse_error& e) {
    if (text.find_first_not_of(" \t\r\n") == std::string::npos) {
      return Status::InvalidArgument(
          "invalid JSON: the config is empty; write an object such as {\"zero_optimization\": "
          "{\"stage\": 3}}");
    }
    auto [line, column] = LineColumn(text, e.byte == 0 ? 0 : e.byte - 1);
    // nlohmann's text: "[json.exception.parse_error.101] parse error at line 3, column 8:
    // syntax error while parsing value - unexpected '}'; ..."; keep what follows the position.
    std::string what = e.what();
    size_t at = what.find("parse error");
    size_t colon = at == std::string::npos ? std::string::npos : what.find(": ", at);
    std::string detail = colon == std::string::npos ? what : what.substr(colon + 2);
    return Status::InvalidArgument("invalid JSON at line " + std::to_string(line) + ", column " +
                                   std::to_string(column) + ": " + detail);
  } catch (const Json::exception& e) {  // e.g. out_of_range.406: number overflow parsing '1e400'
    std::string what = e.what();
    size_t bracket = what.find("] ");
    return Status::InvalidArgument(
        "invalid JSON: " + (bracket == std::string::npos ? what : what.substr(bracket + 2)));
  }
  if (!duplicates.duplicate().empty()) {
    return Status::InvalidArgument(duplicates.duplicate() +
                                   ": key appears twice in the same object; keep one");
  }
  if (!root.is_object()) {
    return Status::InvalidArgument("expected a JSON object {...} at the top level, got " +
                                   Describe(root));
  }
  return root;
}

}  // namespace

Result<EngineConfig> ParseEngineConfig(const std::string& json_text,
                                       std::vector<std::string>* warnings) {
  ZINF_ASSIGN_OR_RETURN(Json root, ParseJson(json_text));
  ParseContext ctx(warnings);
  EngineConfig config;
  ObjectReader reader(root, "", &ctx);
  Status status = ParseRoot(reader, &config, &ctx);
  if (!ctx.auto_keys.empty()) {
    std::string list;
    for (const std::string& key : ctx.auto_keys) list += (list.empty() ? "" : ", ") + key;
    ctx.warnings.Add(list + ": \"auto\" is filled in by the Hugging Face Trainer, not by zinf; " +
                     "using the zinf defaults (write explicit values to choose others)");
  }
  ZINF_RETURN_IF_ERROR(status);
  ZINF_RETURN_IF_ERROR(Validate(config));
  return config;
}

Result<EngineConfig> LoadEngineConfig(const std::string& path, std::vector<std::string>* warnings) {
  if (path.empty()) {
    return Status::InvalidArgument("config file path is empty; pass the path of a JSON config");
  }
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    int err = errno;
    if (err == ENOENT || err == ENOTDIR) {
      return Status::NotFound("config file " + path + " does not exist");
    }
    return ErrnoToStatus(err, "stat config file " + path);
  }
  if (S_ISDIR(st.st_mode)) {
    return Status::InvalidArgument("config file " + path +
                                   " is a directory; pass the path of the JSON file inside it "
                                   "(e.g. " +
                                   path + "/ds_config.json)");
  }
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoToStatus(errno, "open config file " + path);
  std::string text;
  char buf[65536];
  while (true) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int err = errno;
      ::close(fd);
      return ErrnoToStatus(err, "read config file " + path);
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);

  std::vector<std::string> local_warnings;
  Result<EngineConfig> config = ParseEngineConfig(text, &local_warnings);
  WarningSink sink(warnings);
  for (std::string& warning : local_warnings) sink.Add(path + ": " + warning);
  if (!config.ok()) return config.status().WithContext(path);
  return config;
}

}  // namespace zinf
