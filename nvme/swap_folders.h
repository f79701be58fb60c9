// The folders of a swap store: what each one holds (a survey, which changes nothing), the mark
// every folder of a store that may be reopened carries (which store, which position in its
// list), and the checks built on them: a fresh store never replaces another one unless told
// to, and a store is reopened only from its own folders, in its own order. Private to nvme/.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "zinf/status.h"

namespace zinf::swap_folders {

inline constexpr const char* kIndexName = "zinf-swap.index.json";
// Durable stores that retain two commits: the one before the last.
inline constexpr const char* kPrevIndexName = "zinf-swap.index.prev.json";
inline constexpr const char* kMarkName = "zinf-swap.folder.json";
inline constexpr const char* kLockName = "zinf-swap.lock";

// `dir`/zinf-swap-<i>.bin: the swap file of the store's i-th folder.
std::string SwapFileName(const std::string& dir, size_t i);

// The mark of one folder of a store (`kMarkName`, JSON carrying its own checksum).
struct Mark {
  std::string store;       // the store's id (16 hex digits, random at creation)
  size_t folder = 0;       // this folder's position in the store's list
  size_t folders = 0;      // how many folders the store has
  bool committed = false;  // the store wrote (or was about to write) an index: it holds data
  std::vector<std::string> paths;  // the store's folders, resolved, in order
};

// What one folder holds.
struct Survey {
  std::string path;       // as given
  std::string canonical;  // resolved (links followed)
  bool index = false;     // kIndexName
  bool prev = false;      // kPrevIndexName
  bool has_mark = false;  // kMarkName is there (mark_status says whether it reads)
  Status mark_status;
  Mark mark;
  std::vector<std::string> data_files;  // names of the zinf-swap-<n>.bin files in it
  bool HoldsIndex() const { return index || prev; }
  bool Empty() const { return !HoldsIndex() && !has_mark && data_files.empty(); }
};

// What `paths` (existing folders) hold. Reads the marks, changes nothing.
Result<std::vector<Survey>> SurveyFolders(const std::vector<std::string>& paths);

// A fresh store is about to be created in the surveyed folders: AlreadyExists, naming the
// folder and what it holds, when one of them holds a store worth keeping (an index, a mark of a
// store that committed, a mark that cannot be read, swap files without a mark); OK when they
// hold nothing or only a store that never committed (nothing in it to keep).
Status RefuseToReplace(const std::vector<Survey>& folders);

// Removes every swap-store file from the surveyed folders (indexes, marks, swap files; not the
// lock), then fsyncs them. For a fresh store after RefuseToReplace passed or overwriting was
// allowed.
Status ClearFolders(const std::vector<Survey>& folders);

// Writes the mark of each folder of `store` (through ReplaceFile: fsync'ed, renamed).
Status WriteMarks(const std::vector<Survey>& folders, const std::string& store, bool committed);

// Reopening: what the folders hold when their first one has no index. NotFound when they hold
// nothing of a store; OK (*uncommitted set) for a store that never wrote an index (its run
// stopped while initialising: nothing to keep); FailedPrecondition when the folders are another
// store's or in another order (naming the order to give); Corruption when a store that
// committed has lost its index, or swap files lie there without one.
Status ClassifyWithoutIndex(const std::vector<Survey>& folders, bool* uncommitted);

// Reopening a store whose index (in the first folder) names `store` and `paths`: every folder
// must be that store's, at its position. A folder whose mark is missing passes when it
// resolves to the path the index records there. FailedPrecondition naming the order otherwise.
// An index without an id (written before marks): nothing to check.
Status VerifyFolders(const std::vector<Survey>& folders, const std::string& store,
                     const std::vector<std::string>& paths);

// A new store id: 16 hex digits from the kernel's random source.
Result<std::string> NewStoreId();

}  // namespace zinf::swap_folders
