// NewRuntime and NewCudaRuntime (zinf/runtime.h): their own library, zinf::runtime, so that only
// the programs that can run on a GPU link the CUDA backends.
#include <utility>

#include "zinf/runtime.h"

namespace zinf {

Result<Runtime> NewCudaRuntime(const CudaDeviceOptions& options) {
  Runtime rank;
  ZINF_ASSIGN_OR_RETURN(rank.device, NewCudaDevice(options));
  ZINF_ASSIGN_OR_RETURN(rank.comm, NewNcclComm(rank.device.get(), NcclCommOptions{}));
  return rank;
}

Result<Runtime> NewRuntime(const RuntimeOptions& options) {
  if (options.cuda) {
    CudaDeviceOptions copt;
    copt.device = options.cuda_ordinal;
    // 0: 90 % of the free memory. Else the engine's budget plus the program's own device
    // memory, which the engine does not plan.
    copt.memory_budget = options.device_budget_bytes;
    if (copt.memory_budget != 0 &&
        __builtin_add_overflow(copt.memory_budget, options.extra_device_bytes + (size_t{1} << 20),
                               &copt.memory_budget)) {
      return Status::InvalidArgument(options.names.device +
                                     ": the device budget and the program's own device memory "
                                     "exceed any device")
          .WithKey("zinf.device_budget_bytes");
    }
    return NewCudaRuntime(copt);
  }
  HostDeviceOptions host = options.host;
  ZINF_ASSIGN_OR_RETURN(
      host.memory_budget,
      HostDeviceBudget(options.device_budget_bytes, options.pinned_budget_bytes, options.names));
  return NewHostRuntime(host);
}

}  // namespace zinf
