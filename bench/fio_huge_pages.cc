#include "bench/fio_huge_pages.h"

#include <fcntl.h>
#include <sys/mount.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
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

// What a signal handler must undo, kept in plain buffers (FioHugePages::RestoreFromSignal
// may only make async-signal-safe calls).
char g_pages_path[] = "/proc/sys/vm/nr_hugepages";
char g_old_pages[32];     // "<n>\n" to write back; empty: untouched
char g_mount_dir[256];    // our mount; empty: none
char g_buffer_file[320];  // fio's buffer file; empty: none

void CopyTo(char* dst, size_t size, const std::string& src) {
  std::snprintf(dst, size, "%s", src.c_str());
}

// Free huge pages not promised to a mapping yet.
long Available() { return MemInfo("HugePages_Free") - std::max(0L, MemInfo("HugePages_Rsvd")); }

}  // namespace

void FioHugePages::RestoreFromSignal() {
  if (g_buffer_file[0] != '\0') unlink(g_buffer_file);
  if (g_old_pages[0] != '\0') {
    const int fd = open(g_pages_path, O_WRONLY);
    if (fd >= 0) {
      // (Nothing to do if it fails: the process is dying of the signal.)
      if (write(fd, g_old_pages, std::strlen(g_old_pages)) < 0) g_old_pages[0] = '\0';
      close(fd);
    }
  }
  if (g_mount_dir[0] != '\0' && umount2(g_mount_dir, MNT_DETACH) == 0) rmdir(g_mount_dir);
}

FioHugePages::~FioHugePages() { Release(); }

void FioHugePages::Release() {
  // Best effort: a failure here leaves the system as a user who set it up by hand would have
  // it (pages reserved, a mount in /tmp), and says so.
  if (!file_.empty()) unlink(file_.c_str());
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
  old_pages_ = -1;
  mounted_ = false;
  file_.clear();
  g_old_pages[0] = g_mount_dir[0] = g_buffer_file[0] = '\0';
}

std::string FioHugePages::Prepare(uint64_t bytes) {
  std::string why = TryPrepare(bytes);
  if (!why.empty()) Release();  // nothing half set up stays for the run
  return why;
}

std::string FioHugePages::TryPrepare(uint64_t bytes) {
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
    CopyTo(g_mount_dir, sizeof(g_mount_dir), mount_dir_);
    summary_ = "mounted hugetlbfs on " + mount_dir_;
  } else {
    summary_ = "hugetlbfs at " + mount_dir_;
  }
  // fio maps block size x queue depth (+ 4 KiB for O_DIRECT alignment) in one piece, rounded
  // up to its --hugepage-size (4 MiB by default): at most two pages of 2 MiB more; a few spare.
  const uint64_t page = static_cast<uint64_t>(page_kb) << 10;
  need_ = static_cast<long>((bytes + 4096 + page - 1) / page) + 4;
  const long avail = Available();
  if (avail < need_) {
    const long total = ReadLong(kNrHugePages);
    if (total < 0) return std::string("cannot read ") + kNrHugePages;
    const long want = total + (need_ - avail);
    if (!root) {
      return std::to_string(need_) + " available huge pages needed, " + std::to_string(avail) +
             " available; as root: echo " + std::to_string(want) + " > " + kNrHugePages;
    }
    // Recorded before the write, so that a signal right after it still restores the count.
    old_pages_ = total;
    CopyTo(g_old_pages, sizeof(g_old_pages), std::to_string(total) + "\n");
    if (!WriteLong(kNrHugePages, want)) return std::string("cannot write ") + kNrHugePages;
    if (Available() < need_) {
      return "the kernel made only " + std::to_string(Available()) + " huge pages available of " +
             "the " + std::to_string(need_) + " needed (memory fragmented or short)";
    }
    summary_ += ", " + std::to_string(need_ - avail) + " more pages of " + std::to_string(page_kb) +
                " KiB reserved";
  }
  file_ = mount_dir_ + "/zinf-fio-" + std::to_string(getpid());
  CopyTo(g_buffer_file, sizeof(g_buffer_file), file_);
  iomem_ = "mmaphuge:" + file_;
  return "";
}

bool FioHugePages::WaitForPages(double seconds) {
  // A file an earlier fio left behind holds pages (fio keeps a file it did not create).
  unlink(file_.c_str());
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (Available() < need_) {
    // The pages of the previous fio's registered buffers come back once the kernel has torn
    // its ring down, after that fio exited.
    if (std::chrono::steady_clock::now() >= deadline) return false;
    usleep(20 * 1000);
  }
  return true;
}

}  // namespace zinf
