#include "bench/fio_huge_pages.h"

#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

namespace zinf {
namespace {

constexpr char kNrHugePages[] = "/proc/sys/vm/nr_hugepages";

// A /proc/meminfo field in its unit (kB for sizes, a count for pages); -1 when absent.
long MemInfo(const std::string& key) {
  std::ifstream in("/proc/meminfo");
  std::string name;
  long value = 0;
  std::string rest;
  while (in >> name >> value) {
    std::getline(in, rest);
    if (name == key + ":") return value;
  }
  return -1;
}

long ReadLong(const char* path) {
  std::ifstream in(path);
  long v = -1;
  if (!(in >> v)) return -1;
  return v;
}

bool WriteLong(const char* path, long v) {
  std::ofstream out(path);
  out << v << "\n";
  out.flush();
  return static_cast<bool>(out);
}

// The first hugetlbfs mount with the default huge page size, or "".
std::string FindHugetlbfs(long page_kb) {
  std::ifstream in("/proc/mounts");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string device, dir, type, options;
    if (!(fields >> device >> dir >> type >> options) || type != "hugetlbfs") continue;
    const size_t at = options.find("pagesize=");
    if (at != std::string::npos) {
      const long size = std::atol(options.c_str() + at + 9);  // "2M", "1024M", "1G"
      const size_t u = options.find_first_not_of("0123456789", at + 9);
      const char unit = u == std::string::npos ? 'B' : options[u];
      const long kb = unit == 'G'   ? size << 20
                      : unit == 'M' ? size << 10
                      : unit == 'K' ? size
                                    : size >> 10;
      if (kb != page_kb) continue;
    }
    if (access(dir.c_str(), W_OK) == 0) return dir;
  }
  return "";
}

}  // namespace

FioHugePages::~FioHugePages() {
  // Best effort: the bench is ending, and a failure here leaves the system as a user who set
  // it up by hand would have it (pages reserved, a mount in /tmp), which the log names.
  if (old_pages_ >= 0 && !WriteLong(kNrHugePages, old_pages_)) {
    std::fprintf(stderr, "zinf-nvme-bench: could not restore %s to %ld\n", kNrHugePages,
                 old_pages_);
  }
  if (mounted_) {
    if (umount2(mount_dir_.c_str(), MNT_DETACH) != 0 || rmdir(mount_dir_.c_str()) != 0) {
      std::fprintf(stderr, "zinf-nvme-bench: could not remove the hugetlbfs mount %s: %s\n",
                   mount_dir_.c_str(), std::strerror(errno));
    }
  }
}

std::string FioHugePages::Prepare(uint64_t bytes) {
  const long page_kb = MemInfo("Hugepagesize");
  if (page_kb <= 0) return "the kernel reports no huge page size (no hugetlb support)";
  const bool root = geteuid() == 0;
  mount_dir_ = FindHugetlbfs(page_kb);
  if (mount_dir_.empty()) {
    if (!root) {
      return "no writable hugetlbfs mount, and mounting one needs root (as root: mount -t "
             "hugetlbfs none /dev/hugepages)";
    }
    char dir[] = "/tmp/zinf-hugetlbfs-XXXXXX";
    if (mkdtemp(dir) == nullptr) {
      return std::string("cannot make a folder for a hugetlbfs mount: ") + std::strerror(errno);
    }
    if (mount("zinf-hugetlbfs", dir, "hugetlbfs", 0, "mode=0700") != 0) {
      const std::string why = std::strerror(errno);
      rmdir(dir);
      return "mounting hugetlbfs on " + std::string(dir) + " failed: " + why;
    }
    mount_dir_ = dir;
    mounted_ = true;
    summary_ = "mounted hugetlbfs on " + mount_dir_;
  } else {
    summary_ = "hugetlbfs at " + mount_dir_;
  }
  // fio maps its buffers (block size x queue depth) in one piece; a few pages spare.
  const uint64_t page = static_cast<uint64_t>(page_kb) << 10;
  const long need = static_cast<long>((bytes + page - 1) / page) + 4;
  const long free_pages = MemInfo("HugePages_Free");
  if (free_pages < need) {
    if (!root) {
      return std::to_string(need) + " free huge pages needed, " + std::to_string(free_pages) +
             " free; as root: echo " + std::to_string(need) + " > " + kNrHugePages;
    }
    const long total = ReadLong(kNrHugePages);
    if (total < 0) return std::string("cannot read ") + kNrHugePages;
    if (!WriteLong(kNrHugePages, total + (need - free_pages))) {
      return std::string("cannot write ") + kNrHugePages;
    }
    old_pages_ = total;
    const long now_free = MemInfo("HugePages_Free");
    if (now_free < need) {
      return "the kernel reserved only " + std::to_string(now_free) + " free huge pages of the " +
             std::to_string(need) + " needed (memory fragmented or short)";
    }
    summary_ += ", reserved " + std::to_string(need - free_pages) + " pages of " +
                std::to_string(page_kb) + " KiB";
  }
  iomem_ = "mmaphuge:" + mount_dir_ + "/zinf-fio-" + std::to_string(getpid());
  return "";
}

}  // namespace zinf
