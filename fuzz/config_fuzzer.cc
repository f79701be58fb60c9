// libFuzzer target: the DeepSpeed-style JSON config parser must turn any input into a config
// or an error, never a crash, hang or sanitizer report.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "zinf/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> warnings;
  zinf::Result<zinf::EngineConfig> c = zinf::ParseEngineConfig(text, &warnings);
  if (c.ok()) {
    // A config that parsed is valid: the checks the engine relies on hold.
    if (c->gradient_accumulation_steps < 1 || c->sub_group_size == 0) __builtin_trap();
  } else if (c.status().message().empty()) {
    __builtin_trap();  // every error says what is wrong
  }
  (void)zinf::ParseByteSize(text, "fuzz");
  return 0;
}
