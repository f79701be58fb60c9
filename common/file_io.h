// Whole-buffer file I/O on descriptors, with every result checked: the helpers the checkpoint
// and safetensors code share (private to zinf).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "zinf/status.h"

namespace zinf {

// pwrite until all `n` bytes are written (EINTR retried); errors name `path` and the offset.
Status PwriteAll(int fd, const void* buf, size_t n, uint64_t off, const std::string& path);
// pread until all `n` bytes are read; a file that ends first is Corruption naming the offset
// and `short_means` ("a torn checkpoint", "a truncated file").
Status PreadAll(int fd, void* buf, size_t n, uint64_t off, const std::string& path,
                const char* short_means);
// fsync of a file or a folder.
Status FsyncPath(const std::string& path, bool directory);
// Creates `path` for writing, exclusively (O_CREAT | O_EXCL), never through a symbolic link
// (O_NOFOLLOW), mode 0600. A file already there (a leftover temporary, or anything planted,
// a hard link included) is unlinked first, so it is never written through. Returns the fd.
Result<int> CreateExclusive(const std::string& path);

// For a replacement with a step of the caller's between the temporary's fsync and its rename.
struct ReplaceFileOptions {
  // Runs once the temporary is written and fsync'ed, just before it is renamed over `path`
  // (the swap store moves its last commit aside there). An error stops the replacement: the
  // temporary is removed, `path` is not touched, and the error is returned.
  std::function<Status()> before_rename;
  // Set to true once the temporary has been renamed over `path`: from then on `path` holds the
  // new contents, even when the folder's fsync that follows fails (and ReplaceFile fails).
  bool* renamed = nullptr;
};

// Writes the `n` bytes at `data` to `path` so that after a crash `path` holds either its old or
// its new contents (leveldb's SetCurrentFile): through `path`.tmp (created afresh with
// CreateExclusive: 0600, never written through a link or a leftover), fsync'ed, renamed over
// `path`, then the folder fsync'ed. An error before the rename removes the temporary and leaves
// `path` as it was; every error names the file and the step that failed. One writer per
// `path` at a time (callers hold the folder's FolderLock). The one place for that protocol.
Status ReplaceFile(const std::string& path, const void* data, size_t n,
                   const ReplaceFileOptions& options = {});
// The same for a text.
Status ReplaceFile(const std::string& path, std::string_view text);
// Opens `path` for reading without ever blocking on a FIFO or a device (O_NONBLOCK until
// fstat has shown a regular file; cleared before returning). Anything but a regular file is
// InvalidArgument naming `what` ("--data", "checkpoint manifest"), the path and its kind.
// *size (optional) gets the file's size. Returns the fd; the caller closes it.
Result<int> OpenRegularFile(const std::string& path, const std::string& what,
                            uint64_t* size = nullptr);
// A regular file's contents, at most `limit` bytes (Corruption otherwise; InvalidArgument for a
// FIFO, a device or a folder, never a blocking read).
Result<std::string> ReadSmallFile(const std::string& path, size_t limit);

}  // namespace zinf
