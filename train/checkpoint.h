// zinf-train's checkpoints: the engine's (optimizer states, step, layout; atomic commit)
// plus the trainer's own record (model shape and seed), so that a resume with another model
// is refused and the data position follows from the step.
#pragma once

#include <cstdint>
#include <string>

#include "train/gpt.h"
#include "zinf/engine.h"

namespace zinf::train {

// The trainer's record kept with its checkpoints and durable commits: the model's shape and the
// seed (JSON).
std::string RunRecord(const GptConfig& model, uint64_t seed);
// Checks a record read back from `where` (a checkpoint, a durable store) against this run:
// another model shape is FailedPrecondition naming the flag and both values; another seed is a
// warning (the batches then differ from the run that wrote it); no record, a warning.
Status CheckRunRecord(const std::string& where, const std::string& record, const GptConfig& model,
                      uint64_t seed);

Status SaveCheckpoint(const std::string& dir, const GptConfig& model, uint64_t seed,
                      Engine* engine);
// Returns the step to continue from. A checkpoint of another model shape is refused with a
// message naming both; another seed gets a warning (the batches then differ from the run that
// saved it). `fall_back`: a damaged newest checkpoint is skipped for the newest readable one,
// with a warning (Engine::LoadCheckpoint).
Result<int64_t> LoadCheckpoint(const std::string& dir, const GptConfig& model, uint64_t seed,
                               Engine* engine, bool fall_back = false);

}  // namespace zinf::train
