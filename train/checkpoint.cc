#include "train/checkpoint.h"

#include <nlohmann/json.hpp>

#include "zinf/log.h"

namespace zinf::train {
namespace {

nlohmann::json Record(const GptConfig& m, uint64_t seed) {
  return {{"trainer", "zinf-train"},
          {"vocab", m.vocab},
          {"max_seq", m.max_seq},
          {"layers", m.layers},
          {"heads", m.heads},
          {"d_model", m.d_model},
          {"seed", seed}};
}

}  // namespace

std::string RunRecord(const GptConfig& model, uint64_t seed) { return Record(model, seed).dump(); }

Status CheckRunRecord(const std::string& where, const std::string& record, const GptConfig& model,
                      uint64_t seed) {
  nlohmann::json saved = nlohmann::json::parse(record, nullptr, /*allow_exceptions=*/false);
  nlohmann::json mine = Record(model, seed);
  if (saved.is_discarded() || !saved.is_object() || saved.value("trainer", "") != "zinf-train") {
    LogWarning(where + " has no zinf-train record; its tensors match this model");
    return Status::OK();
  }
  static const std::pair<const char*, const char*> kFlags[] = {{"vocab", "the vocabulary"},
                                                               {"max_seq", "--max-seq"},
                                                               {"layers", "--layers"},
                                                               {"heads", "--heads"},
                                                               {"d_model", "--d-model"}};
  for (const auto& [key, flag] : kFlags) {
    if (saved.value(key, -1) != mine.value(key, -1)) {
      return Status::FailedPrecondition(where + " is of another model (" + flag + " " +
                                        std::to_string(saved.value(key, -1)) + ", this run " +
                                        std::to_string(mine.value(key, -1)) +
                                        "); use its flags or other folders");
    }
  }
  if (saved.value("seed", uint64_t{0}) != seed) {
    LogWarning(where + " was written with --seed " +
               std::to_string(saved.value("seed", uint64_t{0})) + ", this run uses " +
               std::to_string(seed) + "; batches will differ from the original run");
  }
  return Status::OK();
}

Status SaveCheckpoint(const std::string& dir, const GptConfig& model, uint64_t seed,
                      Engine* engine) {
  return engine->SaveCheckpoint(dir, RunRecord(model, seed));
}

Result<int64_t> LoadCheckpoint(const std::string& dir, const GptConfig& model, uint64_t seed,
                               Engine* engine, bool fall_back) {
  // The engine verifies its layout (names and sizes of every tensor) before changing anything,
  // which already refuses another shape; the record gives the clearer message.
  std::string user;
  ZINF_RETURN_IF_ERROR(engine->LoadCheckpoint(dir, &user, fall_back));
  ZINF_RETURN_IF_ERROR(CheckRunRecord("the checkpoint in " + dir, user, model, seed));
  return engine->global_step();
}

}  // namespace zinf::train
