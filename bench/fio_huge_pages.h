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
  // What Prepare did, for the log ("mounted hugetlbfs on ..., 132 more pages ... reserved").
  const std::string& summary() const { return summary_; }
  // Before each fio run with huge pages: removes a buffer file an earlier fio left, then
  // waits (at most `seconds`) until the pages Prepare counted are available again; false if
  // they are not.
  bool WaitForPages(double seconds);
  // For a SIGINT/SIGTERM handler (async-signal-safe calls only): gives back what Prepare set
  // up, as the destructor would.
  static void RestoreFromSignal();

 private:
  std::string TryPrepare(uint64_t bytes);
  void Release();  // what the destructor does; also after a Prepare that failed part-way

  std::string mount_dir_;
  bool mounted_ = false;  // we mounted mount_dir_ (and made the folder)
  long old_pages_ = -1;   // nr_hugepages before we raised it; -1: untouched
  long need_ = 0;         // huge pages one fio run needs
  std::string file_;      // fio's buffer file on the mount
  std::string iomem_;
  std::string summary_;
};

}  // namespace zinf
