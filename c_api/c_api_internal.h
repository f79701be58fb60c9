// Shared by the C API translation units: the thread-local last-error message.
#pragma once

#include <cstdint>
#include <exception>
#include <new>
#include <string>

#include "zinf/status.h"

namespace zinf::capi {

// Stores `message` as this thread's zinf_last_error() and returns the C API error code (-1).
int Fail(const std::string& message);
// Stores status.ToString() (non-OK) and returns -1; returns 0 for OK and clears the error.
int FromStatus(const Status& status);
// Clears this thread's last error and returns 0.
int Succeed();

// Every handle starts with a magic number that its destroy function clears: a handle used
// after it was closed is refused (while its memory has not been reused: beyond that, C cannot
// tell), and so is a pointer that never was a handle of that kind.
inline constexpr uint64_t kSwapStoreMagic = 0x7a696e6673776170ull;  // "zinfswap"
inline constexpr uint64_t kEngineMagic = 0x7a696e66656e6731ull;     // "zinfeng1"

// Closed handles are kept (their contents destroyed, their magic cleared) for a while instead
// of being freed, so that a double close or a use after close reads a cleared magic and is
// refused, rather than reading freed memory. The oldest of more than 4096 kept shells are
// freed. Thread-safe.
void RetireHandle(void* shell, void (*free_shell)(void*));

// Runs `body` (returning an int result code), turning a C++ exception into a failure: nothing
// escapes into C. `what` names the function.
template <typename Body>
int Guarded(const char* what, Body&& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return Fail(std::string(what) + ": out of memory");
  } catch (const std::exception& e) {
    return Fail(std::string(what) + ": " + e.what());
  }
}

}  // namespace zinf::capi
