// Hugging Face safetensors checkpoints: reading a file or a sharded checkpoint tensor by
// tensor. Loading one into an Engine's parameters and exporting an Engine's parameters as
// sharded files with an index: zinf/safetensors_engine.h.
//
// The format: an 8-byte little-endian header length N, N bytes of JSON (an object mapping each
// tensor name to {"dtype", "shape", "data_offsets": [begin, end]}, plus an optional
// "__metadata__" object of strings; trailing spaces allowed), then the data, little-endian and
// in C order, each tensor at [begin, end) relative to the data's start. A sharded checkpoint
// adds "model.safetensors.index.json": {"metadata": {...}, "weight_map": {tensor: file}}.
//
// Headers are hostile input: every check below is an error naming the file (and the tensor)
// rather than a crash or a read outside the file: the header length against the file, JSON
// that is an object of objects, known dtypes, non-negative shapes whose byte size (overflow
// checked) equals the data range, ranges that tile the data exactly (no holes, no overlaps, as
// the format requires), names repeated across shards.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "zinf/status.h"

namespace zinf::safetensors {

enum class DType {
  kBool,
  kU8,
  kI8,
  kF8E5M2,
  kF8E4M3,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kF64,
  kI64,
  kU64
};
// "F32", "BF16", ... as the format spells them.
const char* DTypeName(DType dtype);
// The dtype a name spells (nullopt for a name the format does not have).
std::optional<DType> DTypeByName(std::string_view name);
size_t DTypeSize(DType dtype);
// Whether a tensor of this dtype can be loaded into (or exported from) a float parameter:
// F32, BF16, F16.
bool IsFloatDType(DType dtype);

struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t numel = 0;
  uint64_t offset = 0;  // absolute offset of the first byte in the file
  uint64_t bytes = 0;
  size_t file = 0;  // index into Checkpoint::files
};

struct FileHeader {
  std::string path;
  uint64_t file_bytes = 0;
  uint64_t data_start = 0;  // 8 + N
  std::map<std::string, std::string> metadata;
  std::vector<TensorInfo> tensors;  // in data order
};

// Parses and checks a header (`header` is the N bytes after the length) of a file of
// `file_bytes` bytes; errors start with `path`. Exposed for the fuzzer.
Result<FileHeader> ParseHeader(std::string_view header, uint64_t file_bytes,
                               const std::string& path);
// Reads and checks the header of one .safetensors file.
Result<FileHeader> ReadHeader(const std::string& path);

// One file or a sharded checkpoint, every header read and checked, every tensor indexed by
// name.
struct Checkpoint {
  std::vector<FileHeader> files;
  std::map<std::string, TensorInfo> tensors;
};
// `path`: a .safetensors file, a model.safetensors.index.json, or a folder holding either
// (the index wins). NotFound naming the file for a missing shard; Corruption for a shard that
// lacks a tensor its index assigns to it, or a tensor found in two shards.
Result<Checkpoint> OpenCheckpoint(const std::string& path);

// Reads `t` (F32, BF16 or F16) from its file, converted to fp32, into out[0, t.numel).
// Reads in blocks of at most `block_bytes`; bf16 and fp16 convert exactly.
Status ReadTensorF32(const Checkpoint& ckpt, const TensorInfo& t, float* out,
                     size_t block_bytes = 16u << 20);

}  // namespace zinf::safetensors
