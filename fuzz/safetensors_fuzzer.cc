// libFuzzer target: a safetensors file's header is hostile input. The input is a whole file
// (the 8-byte length, the header, the data); a header that is accepted describes tensors that
// tile the data exactly, each with as many bytes as its shape and dtype need.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "zinf/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8) return 0;
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | data[i];
  if (n > size - 8) return 0;  // ReadHeader refuses it before parsing
  std::string_view header(reinterpret_cast<const char*>(data) + 8, static_cast<size_t>(n));
  namespace st = zinf::safetensors;
  zinf::Result<st::FileHeader> h = st::ParseHeader(header, size, "fuzz");
  if (!h.ok()) {
    if (h.status().message().empty()) __builtin_trap();
    return 0;
  }
  uint64_t at = 8 + n;
  if (h->data_start != at) __builtin_trap();
  for (const st::TensorInfo& t : h->tensors) {
    if (t.offset != at || t.bytes != t.numel * st::DTypeSize(t.dtype)) __builtin_trap();
    at += t.bytes;
  }
  if (at != size) __builtin_trap();
  return 0;
}
