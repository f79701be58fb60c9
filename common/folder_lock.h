// An exclusive lock on a folder, so that two runs (or two engines in one process) never share
// a swap folder, a durable store or a checkpoint folder: flock(LOCK_EX | LOCK_NB) on a lock file
// inside it, held until the FolderLock is destroyed or the process ends (kill -9 leaves no
// lock behind: the kernel drops it with the process; the file itself stays, unlocked).
#pragma once

#include <memory>
#include <string>

#include "zinf/status.h"

namespace zinf {

class FolderLock {
 public:
  // Locks `dir` (which must exist) through `dir`/`file_name`. `what` names the folder's role in
  // the error ("swap folder", "checkpoint folder"). FailedPrecondition when another holder has
  // it, naming its process id and command line as the exclusive holder wrote them. `shared`
  // locks (readers) coexist with each other, not with an exclusive one.
  static Result<std::unique_ptr<FolderLock>> Acquire(const std::string& dir,
                                                     const std::string& file_name,
                                                     const std::string& what, bool shared = false);
  // Turns a shared lock into an exclusive one (a reader that starts writing); refused like
  // Acquire while other readers hold it. No-op when exclusive already.
  Status MakeExclusive();
  ~FolderLock();
  FolderLock(const FolderLock&) = delete;
  FolderLock& operator=(const FolderLock&) = delete;

  const std::string& path() const { return path_; }
  bool exclusive() const { return !shared_; }

 private:
  FolderLock(int fd, std::string path, std::string dir, std::string what, bool shared)
      : fd_(fd),
        path_(std::move(path)),
        dir_(std::move(dir)),
        what_(std::move(what)),
        shared_(shared) {}
  int fd_;
  std::string path_, dir_, what_;
  bool shared_;
};

}  // namespace zinf
