// NcclCommOptionsFromEnv: plain C++, built with and without CUDA.
#include <cerrno>
#include <cstdlib>
#include <string>

#include "zinf/cuda.h"

namespace zinf {
namespace {

// The variable as an integer >= min, `fallback` when unset or empty.
Result<int> IntFromEnv(const char* name, int fallback, int min) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  errno = 0;
  const long value = std::strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || value < min || value > (1 << 24)) {
    return Status::InvalidArgument(std::string("NcclCommOptionsFromEnv: ") + name + "='" + text +
                                   "' is not an integer >= " + std::to_string(min));
  }
  return static_cast<int>(value);
}

}  // namespace

Result<NcclCommOptions> NcclCommOptionsFromEnv() {
  NcclCommOptions options;
  ZINF_ASSIGN_OR_RETURN(options.rank, IntFromEnv("RANK", 0, 0));
  ZINF_ASSIGN_OR_RETURN(options.world_size, IntFromEnv("WORLD_SIZE", 1, 1));
  ZINF_ASSIGN_OR_RETURN(options.local_rank, IntFromEnv("LOCAL_RANK", 0, 0));
  if (options.rank >= options.world_size) {
    return Status::InvalidArgument(
        "NcclCommOptionsFromEnv: RANK=" + std::to_string(options.rank) +
        " is not below WORLD_SIZE=" + std::to_string(options.world_size));
  }
  if (const char* file = std::getenv("ZINF_NCCL_ID_FILE"); file != nullptr) {
    options.unique_id_file = file;
  }
  if (options.world_size > 1 && options.unique_id_file.empty()) {
    return Status::InvalidArgument(
        "NcclCommOptionsFromEnv: WORLD_SIZE=" + std::to_string(options.world_size) +
        " needs ZINF_NCCL_ID_FILE, a path on a folder every rank can read (rank 0 writes the "
        "NCCL unique id there); use a fresh path per job");
  }
  if (const char* text = std::getenv("ZINF_NCCL_TIMEOUT_S"); text != nullptr && *text != '\0') {
    char* end = nullptr;
    errno = 0;
    const double seconds = std::strtod(text, &end);
    if (errno != 0 || end == text || *end != '\0' || !(seconds > 0) || seconds > 1e7) {
      return Status::InvalidArgument(std::string("NcclCommOptionsFromEnv: ZINF_NCCL_TIMEOUT_S='") +
                                     text + "' is not a positive number of seconds");
    }
    options.timeout_seconds = seconds;
  }
  return options;
}

}  // namespace zinf
