#include "train/text_data.h"

#include <xxhash.h>

#include <cerrno>
#include <fstream>
#include <sstream>

namespace zinf::train {

Result<TextData> TextData::Load(const std::string& path, int seq) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return ErrnoToStatus(
        errno, "opening the training text " + path + " (give --data FILE with any text file)");
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  TextData d;
  d.text_ = ss.str();
  if (d.text_.size() < static_cast<size_t>(seq) + 2) {
    return Status::InvalidArgument(
        "the training text " + path + " has " + std::to_string(d.text_.size()) + " bytes; --seq " +
        std::to_string(seq) + " needs at least " + std::to_string(seq + 2));
  }
  return d;
}

void TextData::Batch(uint64_t seed, int64_t index, int batch, int seq, int32_t* tokens,
                     int32_t* targets) const {
  const uint64_t windows = text_.size() - static_cast<uint64_t>(seq);  // offsets 0..windows-1
  for (int b = 0; b < batch; ++b) {
    // A hash of (seed, index, b) rather than a generator's stream: any batch can be drawn
    // without the ones before it (resume, gradient accumulation).
    uint64_t h = seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(index) * 0x100000001B3ull +
                 static_cast<uint64_t>(b);
    h = XXH3_64bits(&h, sizeof(h));
    const uint64_t off = h % windows;
    for (int t = 0; t < seq; ++t) {
      tokens[b * seq + t] = static_cast<unsigned char>(text_[off + t]);
      targets[b * seq + t] = static_cast<unsigned char>(text_[off + t + 1]);
    }
  }
}

}  // namespace zinf::train
