// The checkpoint folder: `dir`/step-NNNNNNNNN[.k]/ (one per checkpoint: every rank's
// rank<r>.json manifest and rank<r>.states), `dir`/latest (the name of the newest committed
// one), `dir`/.incoming (the one being written), `dir`/zinf-checkpoint.lock (the run that
// owns the folder). Private to the engine.
//
// What a reader may conclude: "no checkpoint yet" only when the folder holds none of these
// (no `latest`, no step folder, no rank0.json). Anything else that cannot be read is damage,
// reported as such (Corruption naming the piece), never taken for "none".
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/folder_lock.h"
#include "zinf/status.h"

namespace zinf::checkpoint_folder {

inline constexpr const char* kLatest = "latest";
inline constexpr const char* kIncoming = ".incoming";
inline constexpr const char* kLockName = "zinf-checkpoint.lock";
// Inside every checkpoint folder zinf writes: what makes a step folder zinf's (and so
// removable by pruning or an overwrite); names alone never do.
inline constexpr const char* kMark = "zinf-checkpoint.mark";

struct Listing {
  bool exists = false;             // the folder exists
  bool single = false;             // the folder is itself one checkpoint (holds rank0.json)
  std::string latest;              // the name `latest` holds ("" when there is no such file)
  Status latest_status;            // why `latest` could not be read (OK when read or absent)
  std::vector<std::string> steps;  // step-* folders, newest (highest step) first
  bool Empty() const { return !single && latest.empty() && latest_status.ok() && steps.empty(); }
};

// Reads the folder's layout (no file contents beyond `latest`).
Result<Listing> List(const std::string& dir);

// The checkpoints to try, newest first: `dir` itself when it is one, else the one `latest`
// names, then the other step folders by step. Paths, not names.
std::vector<std::string> Candidates(const std::string& dir, const Listing& listing);

// Whether `dir`/`name` is a checkpoint zinf wrote: a step folder name (step-NNNNNNNNN with
// at least nine digits, optionally .k) holding kMark, or, from builds before the mark, a
// rank0.json that parses as a zinf manifest.
bool IsZinfCheckpoint(const std::string& dir, const std::string& name);

// The entries of `dir` that zinf wrote and an overwrite removes: `latest`, `.incoming`, and
// the step folders IsZinfCheckpoint accepts, newest first. Nothing else (user files named
// like checkpoints included). Empty for a missing folder.
Result<std::vector<std::string>> ZinfEntries(const std::string& dir);

// Removes ZinfEntries(dir); the caller holds the folder's lock.
Status RemoveZinfEntries(const std::string& dir);

// Writes kMark into the folder being committed (`dir`/.incoming).
Status MarkIncoming(const std::string& dir);

// Makes the folder usable for saving: created (missing components 0700), a folder, writable
// (a probe file is created and removed), and locked for this process (the lock goes into
// *lock). Errors name the folder and the fix.
Status Prepare(const std::string& dir, std::unique_ptr<FolderLock>* lock);

// Publishes the complete, fsync'ed `dir`/.incoming as the checkpoint of `step`: renamed to
// step-NNNNNNNNN (a suffix .k when taken), then `latest` replaced (ReplaceFile). Returns the
// new folder's name. Crash points "checkpoint.renamed", "checkpoint.latest".
Result<std::string> Commit(const std::string& dir, int64_t step);

// After a commit of `newest`: removes the step folders older than the newest other one that
// `readable` accepts (so the newest readable checkpoint before `newest` always stays, and
// damaged folders newer than it stay for inspection), only those IsZinfCheckpoint accepts.
// Failures are logged, not returned.
void Prune(const std::string& dir, const std::string& newest,
           bool (*readable)(const std::string& folder));

}  // namespace zinf::checkpoint_folder
