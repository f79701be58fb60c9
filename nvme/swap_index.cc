#include "nvme/swap_index.h"

#include <nlohmann/json.hpp>

#include "common/json_seal.h"

namespace zinf {

std::string SerializeSwapIndex(const SwapIndex& index) {
  nlohmann::json j;
  j["version"] = kSwapIndexVersion;
  if (index.has_meta) j["meta"] = index.meta;
  j["alignment"] = index.alignment;
  j["chunk_size"] = index.chunk_size;
  j["checksums"] = index.checksums;
  nlohmann::json jf = nlohmann::json::array();
  for (const SwapIndex::File& f : index.files) jf.push_back({{"path", f.path}, {"size", f.size}});
  j["files"] = jf;
  nlohmann::json jt = nlohmann::json::object();
  for (const auto& [key, t] : index.tensors) {
    nlohmann::json ext = nlohmann::json::array();
    for (const Extent& x : t.extents) ext.push_back({x.file, x.offset, x.len});
    jt[key] = {{"size", t.size}, {"extents", ext}, {"checksums", t.checksums}};
  }
  j["tensors"] = jt;
  j["store"] = index.store;
  j["folders"] = index.folders;
  SealJson(&j);
  return j.dump();
}

Result<SwapIndex> ParseSwapIndex(const std::string& text, const std::string& where) {
  auto bad = [&](const std::string& why) {
    return Status::Corruption("swap index " + where + ": " + why +
                              "; the store cannot be reopened (start a fresh one)");
  };
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return bad("not valid JSON");
  const auto version = j.find("version");
  if (version == j.end() || !version->is_number_integer()) return bad("no version");
  SwapIndex index;
  index.version = version->get<int>();
  if (index.version != 1 && index.version != kSwapIndexVersion) {
    return bad("unknown version " + std::to_string(index.version));
  }
  ZINF_RETURN_IF_ERROR(CheckJsonSeal(j, "swap index " + where, /*required=*/index.version >= 2));
  try {
    index.alignment = j.at("alignment").get<uint64_t>();
    index.chunk_size = j.at("chunk_size").get<uint64_t>();
    index.checksums = j.at("checksums").get<bool>();
    if (j.contains("meta")) {
      index.has_meta = true;
      index.meta = j.at("meta").get<std::string>();
    }
    for (const auto& f : j.at("files")) {
      index.files.push_back({f.at("path").get<std::string>(), f.at("size").get<uint64_t>()});
    }
    for (const auto& [key, jt] : j.at("tensors").items()) {
      SwapIndexTensor t;
      t.size = jt.at("size").get<uint64_t>();
      for (const auto& x : jt.at("extents")) {
        t.extents.push_back(
            {x.at(0).get<uint32_t>(), x.at(1).get<uint64_t>(), x.at(2).get<uint64_t>()});
      }
      if (index.checksums) t.checksums = jt.at("checksums").get<std::vector<uint64_t>>();
      index.tensors.emplace(key, std::move(t));
    }
    if (index.version >= 2) {
      index.store = j.at("store").get<std::string>();
      index.folders = j.at("folders").get<std::vector<std::string>>();
    }
  } catch (const nlohmann::json::exception& ex) {
    return bad(std::string("missing or mistyped field (") + ex.what() + ")");
  }
  return index;
}

}  // namespace zinf
