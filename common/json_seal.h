// JSON documents that carry a checksum of themselves: the swap index, the swap folder marks,
// the checkpoint manifests. "xxh3" holds the xxh3-64 (16 hex digits) of the object's compact
// form without that field; a reader rebuilds that form from what it parsed, so whitespace does
// not matter and every value does. Header-only (users link nlohmann_json and xxhash).
#pragma once

#include <xxhash.h>

#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "zinf/status.h"

namespace zinf {

inline std::string JsonSealHex(const nlohmann::json& body) {
  const std::string text = body.dump();
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx",
                static_cast<unsigned long long>(XXH3_64bits(text.data(), text.size())));
  return buf;
}

// Adds (or replaces) the "xxh3" field of the object `j`.
inline void SealJson(nlohmann::json* j) {
  j->erase("xxh3");
  (*j)["xxh3"] = JsonSealHex(*j);
}

// Whether the object `j` carries its checksum; *sealed says so. A checksum that does not
// match (or is not 16 hex digits) is Corruption naming `where`; a missing one is Corruption
// when `required`, else OK with *sealed false (documents from before sealing).
inline Status CheckJsonSeal(const nlohmann::json& j, const std::string& where, bool required,
                            bool* sealed = nullptr) {
  if (sealed != nullptr) *sealed = false;
  if (!j.is_object()) return Status::Corruption(where + ": expected a JSON object");
  auto it = j.find("xxh3");
  if (it == j.end()) {
    if (!required) return Status::OK();
    return Status::Corruption(where + ": its checksum (\"xxh3\") is missing");
  }
  nlohmann::json body = j;
  body.erase("xxh3");
  if (!it->is_string() || it->get<std::string>() != JsonSealHex(body)) {
    return Status::Corruption(where + ": does not match its own checksum (edited or damaged)");
  }
  if (sealed != nullptr) *sealed = true;
  return Status::OK();
}

}  // namespace zinf
