#include "engine/checkpoint_folder.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>

#include "common/file_io.h"
#include "zinf/crash_point.h"
#include "zinf/log.h"

namespace zinf::checkpoint_folder {
namespace {

// step-NNNNNNNNN[.k] -> (step, k); false for other names.
bool ParseStepName(const std::string& name, long long* step, long long* k) {
  if (name.rfind("step-", 0) != 0) return false;
  char tail = 0;
  *k = 0;
  if (std::sscanf(name.c_str() + 5, "%lld%c", step, &tail) == 1) return *step >= 0;
  return std::sscanf(name.c_str() + 5, "%lld.%lld%c", step, k, &tail) == 2 && *step >= 0 && *k > 0;
}

bool ValidName(const std::string& name) {
  return !name.empty() && name.find('/') == std::string::npos && name[0] != '.';
}

// mkdir -p with 0700 for the components it creates (existing ones keep their mode).
Status MakeFolders(const std::string& dir) {
  std::string path;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = dir.find('/', pos + 1);
    path = dir.substr(0, pos);
    if (path.empty()) continue;
    if (mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) {
      return ErrnoToStatus(errno, "creating checkpoint folder " + path);
    }
  }
  struct stat st {};
  if (stat(dir.c_str(), &st) != 0) return ErrnoToStatus(errno, "checkpoint folder " + dir);
  if (!S_ISDIR(st.st_mode)) {
    return Status::InvalidArgument("checkpoint folder " + dir + " is not a folder");
  }
  return Status::OK();
}

}  // namespace

Result<Listing> List(const std::string& dir) {
  namespace fs = std::filesystem;
  Listing l;
  std::error_code ec;
  if (!fs::exists(dir, ec)) return l;
  if (!fs::is_directory(dir, ec)) {
    return Status::InvalidArgument("checkpoint folder " + dir + " is not a folder");
  }
  l.exists = true;
  l.single = fs::exists(dir + "/rank0.json", ec);
  if (fs::exists(dir + "/" + kLatest, ec) || fs::is_symlink(dir + "/" + kLatest, ec)) {
    Result<std::string> name = ReadSmallFile(dir + "/" + kLatest, 4096);
    if (!name.ok()) {
      l.latest_status = name.status();
    } else {
      std::string n = *name;
      while (!n.empty() && (n.back() == '\n' || n.back() == ' ')) n.pop_back();
      if (!ValidName(n)) {
        l.latest_status = Status::Corruption(dir + "/latest does not name a checkpoint folder");
      } else {
        l.latest = n;
      }
    }
  }
  std::vector<std::pair<std::pair<long long, long long>, std::string>> steps;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    long long step = 0, k = 0;
    if (ParseStepName(n, &step, &k)) steps.push_back({{step, k}, n});
  }
  if (ec) return Status::IoError("listing checkpoint folder " + dir + ": " + ec.message());
  std::sort(steps.rbegin(), steps.rend());
  for (auto& s : steps) l.steps.push_back(std::move(s.second));
  return l;
}

std::vector<std::string> Candidates(const std::string& dir, const Listing& listing) {
  std::vector<std::string> out;
  if (listing.single && listing.latest.empty() && listing.steps.empty()) {
    out.push_back(dir);
    return out;
  }
  if (!listing.latest.empty()) out.push_back(dir + "/" + listing.latest);
  for (const std::string& s : listing.steps) {
    if (s != listing.latest) out.push_back(dir + "/" + s);
  }
  return out;
}

Status Prepare(const std::string& dir, std::unique_ptr<FolderLock>* lock) {
  ZINF_RETURN_IF_ERROR(MakeFolders(dir));
  const std::string probe = dir + "/.zinf-probe-" + std::to_string(getpid());
  Result<int> fd = CreateExclusive(probe);
  if (!fd.ok()) {
    return fd.status().WithContext("checkpoint folder " + dir +
                                   " is not writable (checkpoints go there; pick a writable "
                                   "folder)");
  }
  close(*fd);
  unlink(probe.c_str());
  if (*lock == nullptr) {
    ZINF_ASSIGN_OR_RETURN(*lock, FolderLock::Acquire(dir, kLockName, "checkpoint folder"));
  }
  return Status::OK();
}

Result<std::string> Commit(const std::string& dir, int64_t step) {
  namespace fs = std::filesystem;
  const std::string incoming = dir + "/" + kIncoming;
  ZINF_RETURN_IF_ERROR(FsyncPath(incoming, true));
  char base[32];
  std::snprintf(base, sizeof(base), "step-%09lld", static_cast<long long>(step));
  std::string name = base;
  std::error_code ec;
  for (int k = 1; fs::exists(dir + "/" + name, ec); ++k) {
    name = std::string(base) + "." + std::to_string(k);
  }
  if (rename(incoming.c_str(), (dir + "/" + name).c_str()) != 0) {
    return ErrnoToStatus(errno, "renaming " + incoming + " to " + dir + "/" + name);
  }
  CrashPoint("checkpoint.renamed");
  ZINF_RETURN_IF_ERROR(ReplaceFile(dir + "/" + kLatest, name + "\n"));
  CrashPoint("checkpoint.latest");
  return name;
}

void Prune(const std::string& dir, const std::string& newest,
           bool (*readable)(const std::string& folder)) {
  namespace fs = std::filesystem;
  Result<Listing> l = List(dir);
  if (!l.ok()) {
    LogWarning("not pruning old checkpoints: " + l.status().ToString());
    return;
  }
  // steps are newest first: keep everything up to and including the first readable one
  // after `newest`; remove what is older.
  bool kept = false;
  for (const std::string& s : l->steps) {
    if (s == newest) continue;
    if (!kept) {
      kept = readable(dir + "/" + s);
      continue;
    }
    std::error_code ec;
    fs::remove_all(dir + "/" + s, ec);
    if (ec) LogWarning("could not remove old checkpoint " + dir + "/" + s + ": " + ec.message());
  }
}

}  // namespace zinf::checkpoint_folder
