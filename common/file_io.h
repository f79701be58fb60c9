// Whole-buffer file I/O on descriptors, with every result checked: the helpers the checkpoint
// and safetensors code share (private to zinf).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

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
// Writes `text` to `path` (0600, fsync'ed) through `path`.tmp, renamed over `path`, and fsyncs
// the folder: after a crash `path` holds either the old or the new text. The one place for
// that protocol.
Status ReplaceFile(const std::string& path, const std::string& text);
// A regular file's contents, at most `limit` bytes (Corruption otherwise).
Result<std::string> ReadSmallFile(const std::string& path, size_t limit);

}  // namespace zinf
