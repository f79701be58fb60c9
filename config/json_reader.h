// A reader of JSON configuration objects, apart from what the keys mean (config/config.cc maps
// DeepSpeed's and zinf's keys onto EngineConfig with it): parsing with line and column in
// errors and duplicate keys refused, typed reads that name the key path on a wrong type,
// "auto" placeholders kept at their default, and a warning for every key nobody read, with a
// "did you mean" suggestion.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "zinf/config.h"
#include "zinf/log.h"
#include "zinf/status.h"

namespace zinf::config_json {

using Json = nlohmann::json;

std::string Lower(std::string_view s);
std::string FormatNumber(double v);
// A JSON value as a message shows it: "\"disk\"", "1.5", "true", "null", "an array".
std::string Describe(const Json& v);
// The known key closest to `key` (case-insensitive), or "" when none is close enough to be a
// plausible typo. "max_live_parameters" also finds "stage3_max_live_parameters".
std::string SuggestKey(std::string_view key, const std::vector<std::string>& known);

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

// "<path>: expected <expected>, got <value>" (with a hint for quoted numbers and booleans).
Status TypeError(const std::string& path, std::string_view expected, const Json& got);
// A non-negative integer no larger than `max`. Integral floats count (DeepSpeed configs write
// 5e7 for 50000000); 1.5 and -4 do not.
Result<uint64_t> ToUnsigned(const Json& v, const std::string& path, uint64_t max);
Result<double> ToDouble(const Json& v, const std::string& path);
Result<float> ToFloat(const Json& v, const std::string& path);

// Parses `text` as one JSON object (comments allowed): InvalidArgument with line and column on
// a syntax error, naming the key path of a key repeated in one object, or when the top level
// is not an object.
Result<Json> ParseJsonObject(const std::string& text);

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

  // true, false or "auto": here "auto" is a value of its own (*out = nullopt), not the
  // Trainer's placeholder. *out is unchanged when the key is absent.
  Status ReadBoolOrAuto(std::string_view key, std::optional<bool>* out) {
    const Json* v = Find(key);
    if (v == nullptr) return Status::OK();
    if (v->is_string() && v->get_ref<const std::string&>() == "auto") {
      *out = std::nullopt;
      return Status::OK();
    }
    if (!v->is_boolean()) return TypeError(PathOf(key), "true, false or \"auto\"", *v);
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
      if (s.find('\0') != std::string::npos) {
        // The system would see the path cut at it: another folder than the one written.
        return Status::InvalidArgument(item_path +
                                       ": the path holds a NUL character (\\u0000); give a "
                                       "plain path");
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

  // True when `v` is the Hugging Face Trainer placeholder "auto"; the default stays.
  bool IsAuto(const Json& v, std::string_view key) {
    if (!v.is_string() || v.get_ref<const std::string&>() != "auto") return false;
    ctx_->auto_keys.push_back(PathOf(key));
    return true;
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
  Status ReadUnsigned(std::string_view key, uint64_t max, uint64_t* out) {
    const Json* v = Find(key);
    if (v == nullptr || IsAuto(*v, key)) return Status::OK();
    ZINF_ASSIGN_OR_RETURN(*out, ToUnsigned(*v, PathOf(key), max));
    return Status::OK();
  }

  const Json* object_;
  std::string path_;
  ParseContext* ctx_;
  std::vector<std::string> known_;
  bool ignore_others_ = false;
};

}  // namespace zinf::config_json
