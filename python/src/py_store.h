// A Python rendezvous store as a KeyValueStore (zinf/comm.h): what lets the ranks of a
// torchrun / accelerate job meet through the torch.distributed store the launcher already
// serves on MASTER_ADDR:MASTER_PORT (torchrun's agent holds that port, so zinf cannot serve
// its own store there).
#pragma once

#include <pybind11/pybind11.h>

#include <chrono>
#include <memory>
#include <string>

#include "zinf/comm.h"

namespace zinf::python {
namespace py = pybind11;

// The ProcessGroupOptions a Python dict describes: {"rank", "world_size", "local_rank",
// "local_world_size", "prefix", "timeout_seconds", "store"}, where "store" has set(key, bytes),
// wait([key], timedelta) and get(key) -> bytes (torch.distributed.Store does). None: one rank.
ProcessGroupOptions GroupFromPython(const py::object& group);

}  // namespace zinf::python
