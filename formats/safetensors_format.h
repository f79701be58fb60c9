// Internal to the safetensors component: the strict JSON object parser both the header and the
// index use.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "zinf/status.h"

namespace zinf::safetensors {

// Parses `text` as a JSON object; Corruption (starting with `what`) for invalid JSON, another
// top-level type, or a key repeated within one object (the first one is named).
Result<nlohmann::json> ParseJsonObject(std::string_view text, const std::string& what);

}  // namespace zinf::safetensors
