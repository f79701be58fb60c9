// One rank's device and communicator, as the single-process entry points make them (zinf-train,
// zinf-engine-bench, the C API): a HostDevice with a one-rank LocalComm, or a CUDA device with a
// one-rank NCCL communicator.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "zinf/comm.h"
#include "zinf/cuda.h"
#include "zinf/device.h"
#include "zinf/status.h"

namespace zinf {

// A device and the communicator of rank 0 of 1 on it. Members are destroyed in reverse order:
// the communicator before the device it uses. Whoever creates an Engine on them destroys it
// first.
struct SingleRank {
  std::unique_ptr<Device> device;
  std::unique_ptr<Communicator> comm;
};

// A HostDevice made with `options` and its one-rank LocalComm. Fails only when the
// communicator cannot be made.
Result<SingleRank> NewHostSingleRank(const HostDeviceOptions& options);

// The CUDA device `options` describes and a one-rank NCCL communicator on it; the status of
// whichever failed first (NotSupported in a build without CUDA). Defined in
// zinf_cuda_single_rank (single_rank_cuda.cc), which links the CUDA backends: link that library
// to call it.
Result<SingleRank> NewCudaSingleRank(const CudaDeviceOptions& options);

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

}  // namespace zinf
