// The safetensors header format (zinf/safetensors.h): parsing and checking, with no I/O and no
// engine, so that the fuzzer links this alone.
#include "formats/safetensors_format.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>

#include "zinf/safetensors.h"

namespace zinf::safetensors {
namespace {

using nlohmann::json;

struct DTypeEntry {
  DType dtype;
  const char* name;
  size_t size;
};
constexpr DTypeEntry kDTypes[] = {
    {DType::kBool, "BOOL", 1},      {DType::kU8, "U8", 1},          {DType::kI8, "I8", 1},
    {DType::kF8E5M2, "F8_E5M2", 1}, {DType::kF8E4M3, "F8_E4M3", 1}, {DType::kI16, "I16", 2},
    {DType::kU16, "U16", 2},        {DType::kF16, "F16", 2},        {DType::kBF16, "BF16", 2},
    {DType::kI32, "I32", 4},        {DType::kU32, "U32", 4},        {DType::kF32, "F32", 4},
    {DType::kF64, "F64", 8},        {DType::kI64, "I64", 8},        {DType::kU64, "U64", 8},
};

}  // namespace

Result<nlohmann::json> ParseJsonObject(std::string_view text, const std::string& what) {
  std::string repeated;
  std::vector<std::set<std::string>> keys;  // one per open object or array (arrays: unused)
  json j = json::parse(
      text.begin(), text.end(),
      [&](int /*depth*/, json::parse_event_t event, json& parsed) {
        switch (event) {
          case json::parse_event_t::object_start:
          case json::parse_event_t::array_start:
            keys.emplace_back();
            break;
          case json::parse_event_t::object_end:
          case json::parse_event_t::array_end:
            if (!keys.empty()) keys.pop_back();
            break;
          case json::parse_event_t::key:
            if (!keys.empty() && parsed.is_string() &&
                !keys.back().insert(parsed.get<std::string>()).second && repeated.empty()) {
              repeated = parsed.get<std::string>();
            }
            break;
          default:
            break;
        }
        return true;
      },
      /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status::Corruption(what + ": not valid JSON");
  if (!j.is_object()) return Status::Corruption(what + ": expected a JSON object");
  if (!repeated.empty()) {
    return Status::Corruption(what + ": the key \"" + repeated + "\" appears twice");
  }
  return j;
}

namespace {

Result<uint64_t> NonNegative(const json& v, const std::string& what) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0)
    return static_cast<uint64_t>(v.get<int64_t>());
  return Status::Corruption(what + " must be a non-negative integer");
}

Result<TensorInfo> ParseTensor(const std::string& name, const json& v, uint64_t data_start,
                               uint64_t data_bytes, const std::string& where) {
  const std::string w = where + ": tensor '" + name + "'";
  if (!v.is_object()) return Status::Corruption(w + ": expected an object");
  TensorInfo t;
  t.name = name;
  auto dt = v.find("dtype");
  if (dt == v.end() || !dt->is_string())
    return Status::Corruption(w + ": \"dtype\" must be a string");
  std::optional<DType> dtype = DTypeByName(dt->get<std::string>());
  if (!dtype) {
    return Status::Corruption(w + ": unknown dtype \"" + dt->get<std::string>() + "\"");
  }
  t.dtype = *dtype;
  auto shape = v.find("shape");
  if (shape == v.end() || !shape->is_array()) {
    return Status::Corruption(w + ": \"shape\" must be an array");
  }
  uint64_t numel = 1;
  for (const json& d : *shape) {
    ZINF_ASSIGN_OR_RETURN(uint64_t dim, NonNegative(d, w + ": each dimension"));
    if (dim > (uint64_t{1} << 62) || __builtin_mul_overflow(numel, dim, &numel)) {
      return Status::Corruption(w + ": the shape's element count overflows");
    }
    t.shape.push_back(static_cast<int64_t>(dim));
  }
  t.numel = numel;
  auto offs = v.find("data_offsets");
  if (offs == v.end() || !offs->is_array() || offs->size() != 2) {
    return Status::Corruption(w + ": \"data_offsets\" must be [begin, end]");
  }
  ZINF_ASSIGN_OR_RETURN(uint64_t begin, NonNegative((*offs)[0], w + ": data_offsets"));
  ZINF_ASSIGN_OR_RETURN(uint64_t end, NonNegative((*offs)[1], w + ": data_offsets"));
  if (begin > end || end > data_bytes) {
    return Status::Corruption(w + ": data_offsets [" + std::to_string(begin) + ", " +
                              std::to_string(end) + "] lie outside the " +
                              std::to_string(data_bytes) + " bytes of data");
  }
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(numel, static_cast<uint64_t>(DTypeSize(t.dtype)), &bytes) ||
      bytes != end - begin) {
    return Status::Corruption(w + ": " + std::to_string(end - begin) + " bytes of data for " +
                              std::to_string(numel) + " elements of " + DTypeName(t.dtype));
  }
  t.offset = data_start + begin;
  t.bytes = bytes;
  return t;
}

}  // namespace

std::optional<DType> DTypeByName(std::string_view name) {
  for (const DTypeEntry& e : kDTypes) {
    if (name == e.name) return e.dtype;
  }
  return std::nullopt;
}

const char* DTypeName(DType dtype) {
  for (const DTypeEntry& e : kDTypes) {
    if (e.dtype == dtype) return e.name;
  }
  return "?";
}

size_t DTypeSize(DType dtype) {
  for (const DTypeEntry& e : kDTypes) {
    if (e.dtype == dtype) return e.size;
  }
  return 0;
}

bool IsFloatDType(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16;
}

Result<FileHeader> ParseHeader(std::string_view header, uint64_t file_bytes,
                               const std::string& path) {
  if (header.empty() || header[0] != '{') {
    return Status::Corruption(path +
                              ": the header does not start with '{' (not a safetensors "
                              "file?)");
  }
  if (8 + static_cast<uint64_t>(header.size()) > file_bytes) {
    return Status::Corruption(path + ": the header is longer than the file");
  }
  ZINF_ASSIGN_OR_RETURN(json j, ParseJsonObject(header, path + ": header"));
  FileHeader h;
  h.path = path;
  h.file_bytes = file_bytes;
  h.data_start = 8 + header.size();
  const uint64_t data_bytes = file_bytes - h.data_start;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it.value().is_object()) {
        return Status::Corruption(path + ": \"__metadata__\" must be an object of strings");
      }
      for (auto m = it.value().begin(); m != it.value().end(); ++m) {
        if (!m.value().is_string()) {
          return Status::Corruption(path + ": \"__metadata__\"." + m.key() + " must be a string");
        }
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    ZINF_ASSIGN_OR_RETURN(TensorInfo t,
                          ParseTensor(it.key(), it.value(), h.data_start, data_bytes, path));
    h.tensors.push_back(std::move(t));
  }
  // The ranges must tile the data: no holes, no overlaps (the format forbids both, so that a
  // file cannot hide other content).
  std::sort(h.tensors.begin(), h.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.offset != b.offset ? a.offset < b.offset : a.bytes < b.bytes;
  });
  uint64_t at = h.data_start;
  for (const TensorInfo& t : h.tensors) {
    if (t.offset != at) {
      return Status::Corruption(
          path + ": tensor '" + t.name + "' starts at data offset " +
          std::to_string(t.offset - h.data_start) + ", expected " +
          std::to_string(at - h.data_start) +
          (t.offset < at ? " (it overlaps the one before)" : " (a hole before it)"));
    }
    at += t.bytes;
  }
  if (at != file_bytes) {
    return Status::Corruption(path + ": the tensors cover " + std::to_string(at - h.data_start) +
                              " bytes of data but the file holds " + std::to_string(data_bytes) +
                              " (a truncated or padded file)");
  }
  return h;
}

}  // namespace zinf::safetensors
