#include "nvme/swap_folders.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "common/file_io.h"
#include "common/json_seal.h"

namespace zinf::swap_folders {
namespace {

constexpr const char* kMarkFormat = "zinf-swap-folder-1";

// zinf-swap-<digits>.bin
bool IsSwapFileName(const std::string& n) {
  const std::string head = "zinf-swap-", tail = ".bin";
  if (n.size() <= head.size() + tail.size() || n.rfind(head, 0) != 0 ||
      n.compare(n.size() - tail.size(), tail.size(), tail) != 0) {
    return false;
  }
  for (size_t i = head.size(); i < n.size() - tail.size(); ++i) {
    if (n[i] < '0' || n[i] > '9') return false;
  }
  return true;
}

std::string JoinPaths(const std::vector<std::string>& paths) {
  std::string s;
  for (const std::string& p : paths) s += (s.empty() ? "" : ", ") + p;
  return s;
}

Status ParseMark(const std::string& text, const std::string& where, Mark* mark) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::Corruption(where + ": not valid JSON");
  ZINF_RETURN_IF_ERROR(CheckJsonSeal(j, where, /*required=*/true));
  try {
    if (j.at("format").get<std::string>() != kMarkFormat) {
      return Status::Corruption(where + ": not a zinf swap folder mark");
    }
    mark->store = j.at("store").get<std::string>();
    mark->folder = j.at("folder").get<size_t>();
    mark->folders = j.at("folders").get<size_t>();
    mark->committed = j.at("committed").get<bool>();
    mark->paths = j.at("paths").get<std::vector<std::string>>();
  } catch (const nlohmann::json::exception& e) {
    return Status::Corruption(where + ": a field is missing or mistyped (" + e.what() + ")");
  }
  if (mark->folders == 0 || mark->folder >= mark->folders || mark->paths.size() != mark->folders) {
    return Status::Corruption(where + ": its folder numbers are impossible");
  }
  return Status::OK();
}

Status SyncFolder(const std::string& dir) { return FsyncPath(dir, /*directory=*/true); }

Status Remove(const std::string& path) {
  if (unlink(path.c_str()) != 0 && errno != ENOENT) return ErrnoToStatus(errno, "removing " + path);
  return Status::OK();
}

// "give them as A, B (nvme_path / --nvme in that order)"
std::string OrderFix(const std::vector<std::string>& paths) {
  return "give the folders in the store's order: " + JoinPaths(paths) +
         " (nvme_path / --nvme in that order), or other folders for a new store";
}

}  // namespace

std::string SwapFileName(const std::string& dir, size_t i) {
  return dir + "/zinf-swap-" + std::to_string(i) + ".bin";
}

Result<std::vector<Survey>> SurveyFolders(const std::vector<std::string>& paths) {
  std::vector<Survey> out;
  for (const std::string& dir : paths) {
    Survey s;
    s.path = dir;
    char* real = realpath(dir.c_str(), nullptr);
    if (real == nullptr) return ErrnoToStatus(errno, "nvme path '" + dir + "'");
    s.canonical = real;
    std::free(real);
    DIR* d = opendir(dir.c_str());
    if (d == nullptr) return ErrnoToStatus(errno, "listing nvme path '" + dir + "'");
    errno = 0;
    while (dirent* e = readdir(d)) {
      const std::string n = e->d_name;
      if (n == kIndexName) s.index = true;
      if (n == kPrevIndexName) s.prev = true;
      if (n == kMarkName) s.has_mark = true;
      if (IsSwapFileName(n)) s.data_files.push_back(n);
      errno = 0;
    }
    const int err = errno;
    closedir(d);
    if (err != 0) return ErrnoToStatus(err, "listing nvme path '" + dir + "'");
    std::sort(s.data_files.begin(), s.data_files.end());
    if (s.has_mark) {
      const std::string where = dir + "/" + kMarkName;
      Result<std::string> text = ReadSmallFile(where, 1 << 20);
      s.mark_status = text.ok() ? ParseMark(*text, where, &s.mark) : text.status();
    }
    out.push_back(std::move(s));
  }
  // A folder listed twice is surveyed twice; the caller's positions stay meaningful.
  return out;
}

Status RefuseToReplace(const std::vector<Survey>& folders) {
  for (const Survey& s : folders) {
    std::string what;
    if (s.HoldsIndex()) {
      what = "a swap store's index (" + std::string(s.index ? kIndexName : kPrevIndexName) + ")";
    } else if (s.has_mark && !s.mark_status.ok()) {
      what = "a swap folder mark that cannot be read (" + s.mark_status.message() + ")";
    } else if (s.has_mark && s.mark.committed) {
      what = "part " + std::to_string(s.mark.folder + 1) + " of " + std::to_string(s.mark.folders) +
             " of a swap store that committed data (its " + "folders: " + JoinPaths(s.mark.paths) +
             ")";
    } else if (!s.has_mark && !s.data_files.empty()) {
      what = "swap files without a store mark (" + s.data_files.front() +
             (s.data_files.size() > 1 ? ", ..." : "") +
             "): an earlier store, left by a run that was killed or whose index is lost";
    }
    if (!what.empty()) {
      return Status::AlreadyExists("the swap folder " + s.path + " holds " + what +
                                   "; nothing was changed");
    }
  }
  return Status::OK();
}

Status ClearFolders(const std::vector<Survey>& folders) {
  for (const Survey& s : folders) {
    for (const char* name : {kIndexName, kPrevIndexName, kMarkName}) {
      ZINF_RETURN_IF_ERROR(Remove(s.path + "/" + name));
      ZINF_RETURN_IF_ERROR(Remove(s.path + "/" + name + std::string(".tmp")));
    }
    for (const std::string& f : s.data_files) ZINF_RETURN_IF_ERROR(Remove(s.path + "/" + f));
    ZINF_RETURN_IF_ERROR(SyncFolder(s.path));
  }
  return Status::OK();
}

Status WriteMarks(const std::vector<Survey>& folders, const std::string& store, bool committed) {
  std::vector<std::string> paths;
  for (const Survey& s : folders) paths.push_back(s.canonical);
  for (size_t i = 0; i < folders.size(); ++i) {
    nlohmann::json j = {{"format", kMarkFormat},     {"store", store},         {"folder", i},
                        {"folders", folders.size()}, {"committed", committed}, {"paths", paths}};
    SealJson(&j);
    ZINF_RETURN_IF_ERROR(ReplaceFile(folders[i].path + "/" + kMarkName, j.dump(1) + "\n"));
  }
  return Status::OK();
}

Status ClassifyWithoutIndex(const std::vector<Survey>& folders, bool* uncommitted) {
  *uncommitted = false;
  std::vector<std::string> given;
  for (const Survey& s : folders) given.push_back(s.path);
  // An index in another folder, or marks of other positions: the order (or the set) differs.
  for (size_t k = 1; k < folders.size(); ++k) {
    if (folders[k].HoldsIndex()) {
      const Survey& s = folders[k];
      return Status::FailedPrecondition(
          "the swap folders " + JoinPaths(given) +
          " are not in the store's order: its index is in " + s.path + ", which must come first" +
          (s.has_mark && s.mark_status.ok() ? "; " + OrderFix(s.mark.paths) : std::string()));
    }
  }
  const Survey* ref = nullptr;  // the first folder with a mark
  for (const Survey& s : folders) {
    if (!s.has_mark) continue;
    if (!s.mark_status.ok()) return s.mark_status;
    if (ref == nullptr) ref = &s;
  }
  bool files_unmarked = false;
  for (const Survey& s : folders)
    files_unmarked = files_unmarked || (!s.has_mark && !s.data_files.empty());
  if (ref == nullptr) {
    if (files_unmarked) {
      return Status::Corruption("the folders " + JoinPaths(given) +
                                " hold swap files but no store index or mark (an earlier "
                                "store whose index is lost, or one of an older zinf left by a "
                                "killed run): there is nothing to reopen; allow replacing them");
    }
    return Status::NotFound("no swap store in " + JoinPaths(given) +
                            " (no index, no store mark, no swap file)");
  }
  // The folders given must be exactly the store's, in its order: each carries the store's mark
  // at its position, or (a mark lost) is the folder the store recorded there.
  const std::vector<std::string>& expected = ref->mark.paths;
  bool committed = false;
  for (size_t i = 0; i < folders.size(); ++i) {
    const Survey& s = folders[i];
    const bool marked = s.has_mark && s.mark.store == ref->mark.store && s.mark.folder == i &&
                        s.mark.folders == folders.size();
    const bool placed =
        !s.has_mark && expected.size() == folders.size() && expected[i] == s.canonical;
    if (!(marked || placed) || expected.size() != folders.size()) {
      std::string why;
      if (s.has_mark && s.mark.store == ref->mark.store) {
        why = s.path + " is its folder " + std::to_string(s.mark.folder + 1) + " of " +
              std::to_string(s.mark.folders) + ", given as " + std::to_string(i + 1) + " of " +
              std::to_string(folders.size());
      } else if (s.has_mark) {
        why = s.path + " belongs to another store";
      } else {
        why = s.path + " holds no part of it";
      }
      return Status::FailedPrecondition("the swap folders " + JoinPaths(given) + " are not the " +
                                        "store's (" + ref->path + " is part of a store whose " +
                                        "folders are " + JoinPaths(expected) + "; " + why + "); " +
                                        OrderFix(expected));
    }
    committed = committed || (s.has_mark && s.mark.committed);
  }
  if (committed || files_unmarked) {
    return Status::Corruption(
        "the swap store in " + JoinPaths(given) + " has lost its index (" + folders[0].path + "/" +
        kIndexName + " is missing" +
        (committed ? ", although the store committed data" : "; swap files lie there without one") +
        "): it cannot be reopened; restore the index, resume from a checkpoint, or allow "
        "replacing the store");
  }
  *uncommitted = true;
  return Status::OK();
}

Status VerifyFolders(const std::vector<Survey>& folders, const std::string& store,
                     const std::vector<std::string>& paths) {
  if (store.empty()) return Status::OK();
  for (size_t i = 0; i < folders.size(); ++i) {
    const Survey& s = folders[i];
    if (s.has_mark && !s.mark_status.ok()) return s.mark_status;
    const bool mark_ok = s.has_mark && s.mark.store == store && s.mark.folder == i &&
                         s.mark.folders == folders.size();
    const bool place_ok = !s.has_mark && folders.size() == paths.size() && paths[i] == s.canonical;
    if (mark_ok || place_ok) continue;
    std::string why;
    if (folders.size() != paths.size()) {
      why = "the store has " + std::to_string(paths.size()) + " folders, " +
            std::to_string(folders.size()) + " were given";
    } else if (s.has_mark && s.mark.store == store) {
      why = s.path + " is its folder " + std::to_string(s.mark.folder + 1) + ", given as " +
            std::to_string(i + 1);
    } else if (s.has_mark) {
      why = s.path + " belongs to another store (its folders: " + JoinPaths(s.mark.paths) + ")";
    } else {
      why = s.path + " holds no part of it";
    }
    return Status::FailedPrecondition("the swap folders given are not the store's, in its order (" +
                                      why + "); " + OrderFix(paths));
  }
  return Status::OK();
}

Result<std::string> NewStoreId() {
  uint64_t v = 0;
  for (;;) {
    ssize_t n = getrandom(&v, sizeof(v), 0);
    if (n == static_cast<ssize_t>(sizeof(v))) break;
    if (n < 0 && errno == EINTR) continue;
    return ErrnoToStatus(n < 0 ? errno : EIO, "getrandom for a swap store id");
  }
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return std::string(buf);
}

}  // namespace zinf::swap_folders
