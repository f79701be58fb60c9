// libFuzzer target: the checkpoint manifest parser treats its input as hostile. A manifest it
// accepts is self-consistent (tensors inside their sub-groups, sub-groups inside the file) and
// survives a serialize / parse round trip unchanged.
#include <cstddef>
#include <cstdint>
#include <string>

#include "formats/checkpoint_format.h"
#include "zinf/cpu_adam.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  zinf::Result<zinf::RankManifest> m = zinf::ParseRankManifest(text, "fuzz");
  if (!m.ok()) {
    if (m.status().message().empty()) __builtin_trap();
    return 0;
  }
  // The states as the manifest says they are stored (fp32, bf16 or int8).
  zinf::Result<zinf::StateType> states = zinf::ParseStateType(m->state_dtype);
  if (!states.ok()) __builtin_trap();
  for (const zinf::CheckpointGroup& g : m->groups) {
    if (g.offset + g.numel * 4 + 2 * zinf::StateBytes(*states, g.numel) > m->file_bytes) {
      __builtin_trap();
    }
  }
  for (const zinf::CheckpointTensor& t : m->tensors) {
    if (t.sub_group >= m->groups.size()) __builtin_trap();
    if (t.slice_offset + t.partition_numel > m->groups[t.sub_group].numel) __builtin_trap();
  }
  zinf::Result<zinf::RankManifest> again =
      zinf::ParseRankManifest(zinf::SerializeRankManifest(*m), "round trip");
  if (!again.ok() || zinf::SerializeRankManifest(*again) != zinf::SerializeRankManifest(*m)) {
    __builtin_trap();
  }
  return 0;
}
