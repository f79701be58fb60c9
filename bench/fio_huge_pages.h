// Huge pages for fio's I/O buffers, so that zinf-nvme-bench --compare-fio measures fio at its
// best: fio's --iomem=mmaphuge:FILE maps its buffers from a file on a hugetlbfs mount, which
// needs free huge pages. With 4 KiB pages this disk splits each request into up to 254
// segments, and the comparison then mostly measures fio's buffer pages.
#pragma once

#include <cstdint>
#include <string>

namespace zinf {

class FioHugePages {
 public:
  FioHugePages() = default;
  // Gives back what Prepare set up: the huge pages it reserved, the mount it made.
  ~FioHugePages();
  FioHugePages(const FioHugePages&) = delete;
  FioHugePages& operator=(const FioHugePages&) = delete;

  // Makes `bytes` of buffers mappable from huge pages: finds a hugetlbfs mount (or, as root,
  // mounts one in a temporary folder) and enough free huge pages (or, as root, reserves the
  // missing ones through /proc/sys/vm/nr_hugepages). Returns "" when ready, else why not, in
  // words a user can act on.
  std::string Prepare(uint64_t bytes);
  // The --iomem argument for fio ("mmaphuge:<mount>/zinf-fio-<pid>"); valid after Prepare
  // returned "".
  const std::string& iomem() const { return iomem_; }
  // What Prepare did, for the log ("found /dev/hugepages, reserved 140 pages of 2048 KiB").
  const std::string& summary() const { return summary_; }

 private:
  std::string mount_dir_;
  bool mounted_ = false;  // we mounted mount_dir_ (and made the folder)
  long old_pages_ = -1;   // nr_hugepages before we raised it; -1: untouched
  std::string iomem_;
  std::string summary_;
};

}  // namespace zinf
