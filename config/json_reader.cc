#include "config/json_reader.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <set>

#include "zinf/log.h"

namespace zinf::config_json {

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

std::string Describe(const Json& v) {
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  return v.dump(-1, ' ', false, Json::error_handler_t::replace);
}

namespace {

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

}  // namespace

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

Status TypeError(const std::string& path, std::string_view expected, const Json& got) {
  std::string msg = path + ": expected " + std::string(expected) + ", got " + Describe(got);
  if (got.is_string()) {
    const std::string& s = got.get_ref<const std::string&>();
    bool numeric = !s.empty() && s.find_first_not_of("0123456789.eE+-") == std::string::npos;
    if (numeric || s == "true" || s == "false") msg += "; write the value without quotes";
  }
  return Status::InvalidArgument(std::move(msg));
}

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

Result<double> ToDouble(const Json& v, const std::string& path) {
  if (!v.is_number()) return TypeError(path, "a number", v);
  double d = v.get<double>();
  if (!std::isfinite(d)) return TypeError(path, "a finite number", v);
  return d;
}

Result<float> ToFloat(const Json& v, const std::string& path) {
  ZINF_ASSIGN_OR_RETURN(double d, ToDouble(v, path));
  if (std::fabs(d) > FLT_MAX) {
    return Status::InvalidArgument(path + ": " + Describe(v) + " is out of range for a float");
  }
  return static_cast<float>(d);
}

namespace {

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

}  // namespace

Result<Json> ParseJsonObject(const std::string& text) {
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

}  // namespace zinf::config_json
