#include "train/text_data.h"

#include <sys/mman.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <new>

#include "common/file_io.h"

namespace zinf::train {
namespace {
// Texts up to this size are read into memory; larger ones are mapped (address space, not
// memory).
constexpr uint64_t kReadLimit = uint64_t{1} << 30;
}  // namespace

Result<TextData> TextData::Load(const std::string& path, int seq) {
  uint64_t size = 0;
  Result<int> fd = OpenRegularFile(path, "--data", &size);
  if (!fd.ok()) {
    return fd.status().WithContext("the training text (give --data FILE with any text file)");
  }
  if (size < static_cast<uint64_t>(seq) + 2) {
    close(*fd);
    return Status::InvalidArgument("the training text " + path + " has " + std::to_string(size) +
                                   " bytes; --seq " + std::to_string(seq) + " needs at least " +
                                   std::to_string(seq + 2));
  }
  TextData d;
  d.size_ = size;
  if (size <= kReadLimit) {
    // Read into memory: a file cut while training cannot take the run down.
    auto* buf = new (std::nothrow) unsigned char[size];
    Status s = buf == nullptr ? Status::ResourceExhausted("no memory for the training text " + path)
                              : PreadAll(*fd, buf, size, 0, path, "it changed while being read");
    close(*fd);
    if (!s.ok()) {
      delete[] buf;
      return s;
    }
    d.text_ = std::shared_ptr<const unsigned char>(buf, std::default_delete<unsigned char[]>());
    return d;
  }
  void* p = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, *fd, 0);
  const int err = errno;
  close(*fd);  // the mapping stays valid
  if (p == MAP_FAILED) return ErrnoToStatus(err, "mapping the training text " + path);
  d.text_ = std::shared_ptr<const unsigned char>(
      static_cast<const unsigned char*>(p),
      [size](const unsigned char* q) { munmap(const_cast<unsigned char*>(q), size); });
  return d;
}

void TextData::Batch(uint64_t seed, int64_t index, int batch, int seq, int32_t* tokens,
                     int32_t* targets) const {
  const unsigned char* text = text_.get();
  const uint64_t windows = size_ - static_cast<uint64_t>(seq);  // offsets 0..windows-1
  for (int b = 0; b < batch; ++b) {
    // A hash of (seed, index, b) rather than a generator's stream: any batch can be drawn
    // without the ones before it (resume, gradient accumulation).
    uint64_t h = seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(index) * 0x100000001B3ull +
                 static_cast<uint64_t>(b);
    h = XXH3_64bits(&h, sizeof(h));
    const uint64_t off = h % windows;
    for (int t = 0; t < seq; ++t) {
      tokens[b * seq + t] = text[off + t];
      targets[b * seq + t] = text[off + t + 1];
    }
  }
}

}  // namespace zinf::train
