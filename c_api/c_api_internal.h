// Shared by the C API translation units: the thread-local last-error message.
#pragma once

#include <string>

#include "zinf/status.h"

namespace zinf::capi {

// Stores `message` as this thread's zinf_last_error() and returns the C API error code (-1).
int Fail(const std::string& message);
// Stores status.ToString() (non-OK) and returns -1; returns 0 for OK and clears the error.
int FromStatus(const Status& status);
// Clears this thread's last error and returns 0.
int Succeed();

}  // namespace zinf::capi
