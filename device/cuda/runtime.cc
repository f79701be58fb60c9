// NewRuntime and NewCudaRuntime (zinf/runtime.h): their own library, zinf::runtime, so that only
// the programs that can run on a GPU link the CUDA backends.
#include "zinf/runtime.h"

#include <utility>

namespace zinf {

Result<Runtime> NewCudaRuntime(const CudaDeviceOptions& options, const ProcessGroupOptions& group) {
  Runtime rank;
  ZINF_ASSIGN_OR_RETURN(rank.device, NewCudaDevice(options));
  NcclCommOptions nccl;
  nccl.rank = group.rank;
  nccl.world_size = group.world_size;
  nccl.local_rank = group.local_rank;
  nccl.timeout_seconds = std::chrono::duration<double>(group.timeout).count();
  if (group.world_size > 1) {
    ZINF_ASSIGN_OR_RETURN(nccl.store, RendezvousStore(group));
    nccl.store_key = group.prefix + "/nccl/unique_id";
  }
  ZINF_ASSIGN_OR_RETURN(rank.comm, NewNcclComm(rank.device.get(), nccl));
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
    return NewCudaRuntime(copt, options.group);
  }
  HostDeviceOptions host = options.host;
  ZINF_ASSIGN_OR_RETURN(
      host.memory_budget,
      HostDeviceBudget(options.device_budget_bytes, options.pinned_budget_bytes, options.names));
  return NewHostRuntime(host, options.group);
}

}  // namespace zinf
