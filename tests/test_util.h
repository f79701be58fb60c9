// Helpers shared by the tests: temporary folders and deterministic random bytes.
#pragma once

#include <dirent.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "zinf/align.h"

namespace zinf::testing {

// A fresh folder under $TMPDIR (or /var/tmp: a disk, unlike /tmp on some systems), removed
// with its files at destruction.
class TempDir {
 public:
  explicit TempDir(const char* base = nullptr) {
    std::string root =
        base ? base : (getenv("ZINF_TEST_DIR") ? getenv("ZINF_TEST_DIR") : "/var/tmp");
    std::string templ = root + "/zinf-test-XXXXXX";
    std::vector<char> buf(templ.begin(), templ.end());
    buf.push_back('\0');
    char* p = mkdtemp(buf.data());
    if (p != nullptr) path_ = p;
  }
  ~TempDir() { RemoveTree(path_); }
  const std::string& path() const { return path_; }
  bool ok() const { return !path_.empty(); }

  static void RemoveTree(const std::string& path) {
    if (path.empty()) return;
    DIR* d = opendir(path.c_str());
    if (d != nullptr) {
      while (dirent* e = readdir(d)) {
        std::string name = e->d_name;
        if (name == "." || name == "..") continue;
        std::string child = path + "/" + name;
        struct stat st {};
        if (lstat(child.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
          RemoveTree(child);
        } else {
          unlink(child.c_str());
        }
      }
      closedir(d);
    }
    rmdir(path.c_str());
  }

 private:
  std::string path_;
};

inline void FillRandom(void* buf, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto* p = static_cast<unsigned char*>(buf);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v = rng();
    std::memcpy(p + i, &v, 8);
  }
  uint64_t v = rng();
  std::memcpy(p + i, &v, n - i);
}

// Aligned heap memory for direct I/O.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t n, size_t align = 4096) : size_(RoundUp(n, align)) {
    data_ = static_cast<unsigned char*>(aligned_alloc(align, size_ == 0 ? align : size_));
    std::memset(data_, 0, size_ == 0 ? align : size_);
  }
  ~AlignedBuffer() { free(data_); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  unsigned char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  size_t size_;
  unsigned char* data_;
};

}  // namespace zinf::testing
