#include "engine/persistence/checkpoint_folder.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>

#include "common/file_io.h"
#include "formats/checkpoint_format.h"
#include "zinf/crash_point.h"
#include "zinf/log.h"

namespace zinf::checkpoint_folder {
namespace {

// Digits only, 1 to 18 of them (no sign, no space: what %lld would also accept is not a name
// zinf writes).
bool ParseDigits(const std::string& s, size_t min_digits, long long* out) {
  if (s.size() < min_digits || s.size() > 18) return false;
  long long v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + (c - '0');
  }
  *out = v;
  return true;
}

// step-NNNNNNNNN[.k] (what Commit names, at least nine digits; k from 1, no leading zero)
// -> (step, k); false for any other name.
bool ParseStepName(const std::string& name, long long* step, long long* k) {
  if (name.rfind("step-", 0) != 0) return false;
  const std::string rest = name.substr(5);
  const size_t dot = rest.find('.');
  *k = 0;
  if (!ParseDigits(rest.substr(0, dot), 9, step)) return false;
  if (dot == std::string::npos) return true;
  const std::string suffix = rest.substr(dot + 1);
  return !suffix.empty() && suffix[0] != '0' && ParseDigits(suffix, 1, k);
}

bool ValidName(const std::string& name) {
  return !name.empty() && name.find('/') == std::string::npos && name[0] != '.';
}

std::string NameSum(const std::string& name) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx",
                static_cast<unsigned long long>(XXH3_64bits(name.data(), name.size())));
  return buf;
}

// `latest`: the folder's name on the first line, "xxh3 <16 hex digits of the name>" on the
// second (a flipped digit must not name another, older checkpoint). Files from builds before
// the checksum hold the name alone.
std::string LatestText(const std::string& name) { return name + "\nxxh3 " + NameSum(name) + "\n"; }

Result<std::string> ParseLatest(const std::string& text, const std::string& where) {
  const size_t nl = text.find('\n');
  std::string name = text.substr(0, nl);
  std::string rest = nl == std::string::npos ? "" : text.substr(nl + 1);
  while (!rest.empty() && (rest.back() == '\n' || rest.back() == ' ')) rest.pop_back();
  while (!name.empty() && name.back() == ' ') name.pop_back();
  if (!ValidName(name)) return Status::Corruption(where + " does not name a checkpoint folder");
  if (!rest.empty() && rest != "xxh3 " + NameSum(name)) {
    return Status::Corruption(where + " does not match its own checksum (edited or damaged)");
  }
  return name;
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
      Result<std::string> n = ParseLatest(*name, dir + "/" + kLatest);
      if (!n.ok()) {
        l.latest_status = n.status();
      } else {
        l.latest = *n;
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

bool IsZinfCheckpoint(const std::string& dir, const std::string& name) {
  long long step = 0, k = 0;
  if (!ParseStepName(name, &step, &k)) return false;
  const std::string folder = dir + "/" + name;
  struct stat st {};
  if (lstat(folder.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return false;
  if (lstat((folder + "/" + kMark).c_str(), &st) == 0 && S_ISREG(st.st_mode)) return true;
  Result<std::string> text = ReadSmallFile(folder + "/rank0.json", 1 << 30);
  return text.ok() && ParseRankManifest(*text, folder + "/rank0.json").ok();
}

Result<std::vector<std::string>> ZinfEntries(const std::string& dir) {
  ZINF_ASSIGN_OR_RETURN(Listing l, List(dir));
  std::vector<std::string> out;
  if (!l.exists) return out;
  struct stat st {};
  for (const char* name : {kLatest, kIncoming}) {
    if (lstat((dir + "/" + name).c_str(), &st) == 0) out.push_back(name);
  }
  for (const std::string& s : l.steps) {
    if (IsZinfCheckpoint(dir, s)) out.push_back(s);
  }
  return out;
}

Status RemoveZinfEntries(const std::string& dir) {
  namespace fs = std::filesystem;
  ZINF_ASSIGN_OR_RETURN(std::vector<std::string> entries, ZinfEntries(dir));
  for (const std::string& name : entries) {
    std::error_code ec;
    fs::remove_all(dir + "/" + name, ec);
    if (ec) return Status::IoError("removing " + dir + "/" + name + ": " + ec.message());
  }
  return FsyncPath(dir, /*directory=*/true);
}

Status MarkIncoming(const std::string& dir) {
  return ReplaceFile(dir + "/" + kIncoming + "/" + kMark, "zinf checkpoint\n");
}

Status Prepare(const std::string& dir, std::unique_ptr<FolderLock>* lock) {
  ZINF_RETURN_IF_ERROR(MakeFolders(dir));
  const std::string probe = dir + "/.zinf-probe-" + std::to_string(getpid());
  Result<int> fd = CreateExclusive(probe);
  if (!fd.ok()) {
    const int err = fd.status().sys_errno();
    if (err == EACCES || err == EPERM || err == EROFS) {
      return fd.status().WithContext("checkpoint folder " + dir +
                                     " is not writable (checkpoints go there; pick a writable "
                                     "folder)");
    }
    // Not a property of the folder (EMFILE, ENOSPC, EIO...): the errno says what.
    return fd.status().WithContext("checkpoint folder " + dir + ": cannot create a file in it" +
                                   (err == EMFILE || err == ENFILE
                                        ? " (too many open files: raise the limit, ulimit -n)"
                                        : ""));
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
  ZINF_RETURN_IF_ERROR(ReplaceFile(dir + "/" + kLatest, LatestText(name)));
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
    if (!IsZinfCheckpoint(dir, s)) continue;  // named like one, not written by zinf: the user's
    std::error_code ec;
    fs::remove_all(dir + "/" + s, ec);
    if (ec) LogWarning("could not remove old checkpoint " + dir + "/" + s + ": " + ec.message());
  }
}

}  // namespace zinf::checkpoint_folder
