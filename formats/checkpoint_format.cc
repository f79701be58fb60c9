#include "formats/checkpoint_format.h"

#include <xxhash.h>

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>
#include <type_traits>

#include "common/json_seal.h"
#include "zinf/cpu_adam.h"

namespace zinf {
namespace {

using nlohmann::json;

constexpr const char* kFormatName = "zinf-checkpoint-rank";
// Far above any real model, low enough that products below cannot overflow 64 bits.
constexpr uint64_t kMaxElems = uint64_t{1} << 50;

Result<uint64_t> U64(const json& obj, const char* key, const std::string& where) {
  auto it = obj.find(key);
  if (it == obj.end()) return Status::Corruption(where + ": missing \"" + key + "\"");
  if (!it->is_number_unsigned() && !(it->is_number_integer() && it->get<int64_t>() >= 0)) {
    return Status::Corruption(where + ": \"" + key + "\" must be a non-negative integer");
  }
  return it->get<uint64_t>();
}

Result<std::string> Str(const json& obj, const char* key, const std::string& where) {
  auto it = obj.find(key);
  if (it == obj.end() || !it->is_string()) {
    return Status::Corruption(where + ": \"" + key + "\" must be a string");
  }
  return it->get<std::string>();
}

std::string Hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

Result<uint64_t> ParseHex(const json& v, const std::string& where) {
  if (!v.is_string() || v.get<std::string>().size() != 16) {
    return Status::Corruption(where + ": expected a 16-digit hex checksum");
  }
  uint64_t out = 0;
  for (char c : v.get<std::string>()) {
    int d;
    if (c >= '0' && c <= '9') {
      d = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      d = c - 'a' + 10;
    } else {
      return Status::Corruption(where + ": expected a 16-digit hex checksum");
    }
    out = out << 4 | static_cast<uint64_t>(d);
  }
  return out;
}

}  // namespace

std::string HashHex(uint64_t v) { return Hex(v); }

Result<uint64_t> ParseHashHex(const std::string& text) {
  Result<uint64_t> v = ParseHex(json(text), "hash");
  if (!v.ok()) return Status::InvalidArgument(v.status().message());
  return v;
}

std::string SerializeRankManifest(const RankManifest& m) {
  json j;
  j["format"] = kFormatName;
  // fp32 states: version 2, which builds from before compressed states read too; 3 with
  // compressed states; 4 only with frozen tensors.
  const bool fp32_states = m.state_dtype == "fp32";
  const bool frozen = std::any_of(m.tensors.begin(), m.tensors.end(),
                                  [](const CheckpointTensor& t) { return t.frozen; });
  j["version"] = frozen ? kCheckpointFormatVersion : fp32_states ? 2 : 3;
  j["rank"] = m.rank;
  j["world"] = m.world;
  j["step"] = m.step;
  j["optimizer"] = m.optimizer;
  if (!fp32_states || frozen) j["state_dtype"] = m.state_dtype;
  j["states_file"] = m.states_file;
  j["file_bytes"] = m.file_bytes;
  j["groups"] = json::array();
  for (const CheckpointGroup& g : m.groups) {
    j["groups"].push_back({{"numel", g.numel}, {"offset", g.offset}});
  }
  j["tensors"] = json::array();
  for (const CheckpointTensor& t : m.tensors) {
    if (t.frozen) {
      j["tensors"].push_back({{"name", t.name},
                              {"numel", t.numel},
                              {"partition_numel", t.partition_numel},
                              {"sub_group", t.sub_group},
                              {"frozen", Hex(t.value_hash)}});
      continue;
    }
    j["tensors"].push_back({{"name", t.name},
                            {"numel", t.numel},
                            {"partition_numel", t.partition_numel},
                            {"sub_group", t.sub_group},
                            {"slice_offset", t.slice_offset},
                            {"xxh3", {Hex(t.hash[0]), Hex(t.hash[1]), Hex(t.hash[2])}}});
    if (t.updates >= 0) j["tensors"].back()["updates"] = t.updates;
  }
  j["user_data"] = m.user_data;
  if (m.loss_scale.has_value()) {
    const CheckpointLossScale& l = *m.loss_scale;
    j["loss_scale"] = {{"scale", l.scale},
                       {"iteration", l.iteration},
                       {"last_overflow", l.last_overflow},
                       {"hysteresis_left", l.hysteresis_left},
                       {"skipped_steps", l.skipped_steps}};
  }
  SealJson(&j);  // the manifest's own checksum
  return j.dump(1) + "\n";
}

namespace {

// The manifest's format version, once its format name, the version's range and its seal
// (the manifest's own checksum) check.
Result<uint64_t> CheckManifestFormat(const json& j, const std::string& where) {
  ZINF_ASSIGN_OR_RETURN(std::string format, Str(j, "format", where));
  if (format != kFormatName) {
    return Status::Corruption(where + ": not a zinf checkpoint manifest (format \"" + format +
                              "\")");
  }
  ZINF_ASSIGN_OR_RETURN(uint64_t version, U64(j, "version", where));
  if (version < 2 || version > kCheckpointFormatVersion) {
    return Status::NotSupported(where + ": checkpoint format version " + std::to_string(version) +
                                " (this build reads versions 2 to " +
                                std::to_string(kCheckpointFormatVersion) + ")");
  }
  ZINF_RETURN_IF_ERROR(CheckJsonSeal(j, where, /*required=*/true));
  return version;
}

// "loss_scale" (optional: an fp16 engine's) into m->loss_scale. Its values' ranges are the
// scaler's to check (LossScaler::Restore); here, their JSON types.
Status ParseLossScale(const json& j, const std::string& where, RankManifest* m) {
  auto it = j.find("loss_scale");
  if (it == j.end()) return Status::OK();
  const std::string lw = where + ": loss_scale";
  if (!it->is_object()) return Status::Corruption(lw + ": expected an object");
  CheckpointLossScale l;
  auto number = [&](const char* key, auto* out) -> Status {
    auto v = it->find(key);
    using T = std::remove_pointer_t<decltype(out)>;
    const bool ok = v != it->end() && (std::is_floating_point_v<T> ? v->is_number()
                                       : std::is_signed_v<T>       ? v->is_number_integer()
                                                                   : v->is_number_unsigned());
    if (!ok) return Status::Corruption(lw + ": \"" + key + "\" missing or of the wrong type");
    *out = v->get<T>();
    return Status::OK();
  };
  ZINF_RETURN_IF_ERROR(number("scale", &l.scale));
  ZINF_RETURN_IF_ERROR(number("iteration", &l.iteration));
  ZINF_RETURN_IF_ERROR(number("last_overflow", &l.last_overflow));
  ZINF_RETURN_IF_ERROR(number("hysteresis_left", &l.hysteresis_left));
  ZINF_RETURN_IF_ERROR(number("skipped_steps", &l.skipped_steps));
  m->loss_scale = l;
  return Status::OK();
}

// The manifest's scalar fields into *m (rank and world, step, optimizer, state dtype from
// version 3 on, states file, its size, user data); *state_type: how its states are stored.
Status ParseManifestFields(const json& j, uint64_t version, const std::string& where,
                           RankManifest* m, StateType* state_type) {
  ZINF_ASSIGN_OR_RETURN(uint64_t world, U64(j, "world", where));
  ZINF_ASSIGN_OR_RETURN(uint64_t rank, U64(j, "rank", where));
  if (world < 1 || world > 65536 || rank >= world) {
    return Status::Corruption(where + ": rank " + std::to_string(rank) + " of world " +
                              std::to_string(world) + " is impossible");
  }
  m->world = static_cast<int>(world);
  m->rank = static_cast<int>(rank);
  ZINF_ASSIGN_OR_RETURN(uint64_t step, U64(j, "step", where));
  if (step > static_cast<uint64_t>(std::numeric_limits<int64_t>::max() / 2)) {
    return Status::Corruption(where + ": step out of range");
  }
  m->step = static_cast<int64_t>(step);
  ZINF_ASSIGN_OR_RETURN(m->optimizer, Str(j, "optimizer", where));
  *state_type = StateType::kF32;
  if (version >= 3) {
    ZINF_ASSIGN_OR_RETURN(m->state_dtype, Str(j, "state_dtype", where));
    Result<StateType> parsed = ParseStateType(m->state_dtype);
    if (!parsed.ok()) {
      return Status::NotSupported(where + ": optimizer states stored as \"" + m->state_dtype +
                                  "\", which this build does not know (fp32, bf16, int8): "
                                  "written by a newer zinf?");
    }
    *state_type = *parsed;
  }
  ZINF_ASSIGN_OR_RETURN(m->states_file, Str(j, "states_file", where));
  if (m->states_file.empty() || m->states_file.find('/') != std::string::npos ||
      m->states_file == "." || m->states_file == "..") {
    return Status::Corruption(where + ": states_file must be a plain file name");
  }
  ZINF_ASSIGN_OR_RETURN(m->file_bytes, U64(j, "file_bytes", where));
  ZINF_ASSIGN_OR_RETURN(m->user_data, Str(j, "user_data", where));
  return ParseLossScale(j, where, m);
}

// "groups" into m->groups: each sub-group's size and offset, which must lie inside the
// states file (m->file_bytes) with its states stored as `state_type`.
Status ParseManifestGroups(const json& j, StateType state_type, const std::string& where,
                           RankManifest* m) {
  auto groups = j.find("groups");
  if (groups == j.end() || !groups->is_array()) {
    return Status::Corruption(where + ": \"groups\" must be an array");
  }
  for (size_t i = 0; i < groups->size(); ++i) {
    const std::string gw = where + ": groups[" + std::to_string(i) + "]";
    const json& g = (*groups)[i];
    if (!g.is_object()) return Status::Corruption(gw + ": expected an object");
    CheckpointGroup cg;
    ZINF_ASSIGN_OR_RETURN(cg.numel, U64(g, "numel", gw));
    ZINF_ASSIGN_OR_RETURN(cg.offset, U64(g, "offset", gw));
    if (cg.numel > kMaxElems || cg.offset > kMaxElems ||
        cg.offset + cg.numel * sizeof(float) + 2 * StateBytes(state_type, cg.numel) >
            m->file_bytes) {
      return Status::Corruption(gw + ": extends past the end of the states file (" +
                                std::to_string(m->file_bytes) + " bytes)");
    }
    m->groups.push_back(cg);
  }
  return Status::OK();
}

// One entry of "tensors" (`tw` names it in messages), checked against m's sub-groups and
// step: a frozen tensor's value hash, or a trainable one's slice, checksums and update count.
Result<CheckpointTensor> ParseManifestTensor(const json& t, const RankManifest& m, std::string tw) {
  if (!t.is_object()) return Status::Corruption(tw + ": expected an object");
  CheckpointTensor ct;
  ZINF_ASSIGN_OR_RETURN(ct.name, Str(t, "name", tw));
  tw += " ('" + ct.name + "')";
  ZINF_ASSIGN_OR_RETURN(ct.numel, U64(t, "numel", tw));
  ZINF_ASSIGN_OR_RETURN(ct.partition_numel, U64(t, "partition_numel", tw));
  ZINF_ASSIGN_OR_RETURN(ct.sub_group, U64(t, "sub_group", tw));
  if (t.contains("frozen")) {  // no slice, no states: its value's hash
    ZINF_ASSIGN_OR_RETURN(ct.value_hash, ParseHex(t["frozen"], tw + ": frozen"));
    ct.frozen = true;
    if (ct.numel > kMaxElems || ct.partition_numel > kMaxElems || ct.sub_group >= m.groups.size() ||
        m.groups[ct.sub_group].numel != 0) {
      return Status::Corruption(tw + ": a frozen tensor outside a state-less sub-group");
    }
    return ct;
  }
  ZINF_ASSIGN_OR_RETURN(ct.slice_offset, U64(t, "slice_offset", tw));
  if (ct.numel > kMaxElems || ct.partition_numel > kMaxElems) {
    return Status::Corruption(tw + ": size out of range");
  }
  if (ct.sub_group >= m.groups.size() ||
      ct.slice_offset + ct.partition_numel > m.groups[ct.sub_group].numel) {
    return Status::Corruption(tw + ": lies outside its sub-group");
  }
  auto hashes = t.find("xxh3");
  if (hashes == t.end() || !hashes->is_array() || hashes->size() != 3) {
    return Status::Corruption(tw + ": \"xxh3\" must hold three checksums");
  }
  for (int k = 0; k < 3; ++k) {
    ZINF_ASSIGN_OR_RETURN(ct.hash[k], ParseHex((*hashes)[k], tw + ": xxh3"));
  }
  if (t.contains("updates")) {
    const uint64_t step = static_cast<uint64_t>(m.step);  // parsed as unsigned, never negative
    ZINF_ASSIGN_OR_RETURN(uint64_t updates, U64(t, "updates", tw));
    if (updates > step) {
      return Status::Corruption(tw + ": " + std::to_string(updates) +
                                " updates, more than the checkpoint's step " +
                                std::to_string(step));
    }
    ct.updates = static_cast<int64_t>(updates);
  }
  return ct;
}

// "tensors" into m->tensors, in order (after the groups they refer to).
Status ParseManifestTensors(const json& j, const std::string& where, RankManifest* m) {
  auto tensors = j.find("tensors");
  if (tensors == j.end() || !tensors->is_array()) {
    return Status::Corruption(where + ": \"tensors\" must be an array");
  }
  for (size_t i = 0; i < tensors->size(); ++i) {
    ZINF_ASSIGN_OR_RETURN(
        CheckpointTensor ct,
        ParseManifestTensor((*tensors)[i], *m, where + ": tensors[" + std::to_string(i) + "]"));
    m->tensors.push_back(std::move(ct));
  }
  return Status::OK();
}

}  // namespace

Result<RankManifest> ParseRankManifest(const std::string& text, const std::string& where) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status::Corruption(where + ": not valid JSON");
  if (!j.is_object()) return Status::Corruption(where + ": expected a JSON object");
  ZINF_ASSIGN_OR_RETURN(const uint64_t version, CheckManifestFormat(j, where));
  RankManifest m;
  StateType state_type = StateType::kF32;
  ZINF_RETURN_IF_ERROR(ParseManifestFields(j, version, where, &m, &state_type));
  ZINF_RETURN_IF_ERROR(ParseManifestGroups(j, state_type, where, &m));
  ZINF_RETURN_IF_ERROR(ParseManifestTensors(j, where, &m));
  return m;
}

}  // namespace zinf
