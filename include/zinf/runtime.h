// What a program needs around its Engine, decided here once for every front end (zinf-train,
// the C API, the benches, the Python module): a device and the communicator of its rank, and
// the host device's budget rule. Libraries: NewHostRuntime and HostDeviceBudget in
// zinf::host_backends, NewRuntime and NewCudaRuntime in zinf::runtime (which links the CUDA
// backends). The memory a run needs (pinned bytes, the NVMe plan) is zinf/plan.h.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "zinf/comm.h"
#include "zinf/cuda.h"
#include "zinf/device.h"
#include "zinf/status.h"

namespace zinf {

// A device and the communicator of this process's rank on it: rank 0 of 1 (a one-rank
// LocalComm), or this process's rank of a group of processes (GlooComm on the host device,
// NcclComm on a GPU; zinf/comm.h, ProcessGroupFromEnv). Members are destroyed in
// reverse order: the communicator before the device it uses. Whoever creates an Engine on them
// destroys it first.
struct Runtime {
  std::unique_ptr<Device> device;
  std::unique_ptr<Communicator> comm;
};

// A HostDevice made with `options` and its communicator: a one-rank LocalComm when `group` has
// one rank, else GlooComm (which waits for every rank to join). Fails only when the
// communicator cannot be made.
Result<Runtime> NewHostRuntime(const HostDeviceOptions& options,
                               const ProcessGroupOptions& group = {});

// The CUDA device `options` describes and an NCCL communicator on it (one rank, or `group`'s
// rank, bootstrapped through the group's rendezvous store); the status of whichever failed
// first (NotSupported in a build without CUDA). In zinf::runtime.
Result<Runtime> NewCudaRuntime(const CudaDeviceOptions& options,
                               const ProcessGroupOptions& group = {});

// The names a user sets the two budgets by, for the messages of HostDeviceBudget: the config
// keys by default, a program's own flags where it has them.
struct BudgetNames {
  std::string device = "zinf.device_budget_bytes";
  std::string pinned = "zinf.pinned_budget_bytes";
};

// The host device's memory budget for an engine whose config asks for `device_budget_bytes`
// (EngineConfig::device_budget_bytes) beside a pinned arena of `pinned_budget_bytes`; the one
// rule for "0 = whatever the device reports" on a host device (zinf-train, the C API):
//   - not 0: that budget;
//   - 0: the machine's physical memory (the host device stands for a GPU in host memory).
// Under an address-space limit (ulimit -v) the budgets must fit in it (the host device
// reserves twice its budget of address space, the pinned arena its budget, the program about
// 3 GiB): an explicit budget that does not is InvalidArgument, with the numbers and the fix,
// before anything is allocated; the default one is lowered to fit, with a warning.
Result<uint64_t> HostDeviceBudget(uint64_t device_budget_bytes, uint64_t pinned_budget_bytes,
                                  const BudgetNames& names = {});

// The device a program asked for, with its budgets, by the rules above: the host device
// (budget HostDeviceBudget) or GPU `cuda_ordinal` (budget: device_budget_bytes plus
// `extra_device_bytes`, the program's own device memory beside the engine's, or 90 % of the free
// memory when device_budget_bytes is 0). In zinf::runtime.
struct RuntimeOptions {
  bool cuda = false;
  int cuda_ordinal = 0;
  uint64_t device_budget_bytes = 0;  // EngineConfig::device_budget_bytes
  uint64_t pinned_budget_bytes = 0;  // EngineConfig::pinned_budget_bytes
  uint64_t extra_device_bytes = 0;   // a trainer's activations (GPU)
  BudgetNames names;
  HostDeviceOptions host;  // its memory_budget is decided here
  // This process's place in its group (ProcessGroupFromEnv); one rank by default. With a GPU,
  // each process of a machine should use its own (cuda_ordinal = group.local_rank).
  ProcessGroupOptions group;
};
Result<Runtime> NewRuntime(const RuntimeOptions& options);

}  // namespace zinf
