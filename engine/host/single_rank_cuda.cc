// NewCudaSingleRank (engine/host/single_rank.h): its own library, so that only the programs
// that can run on a GPU link the CUDA backends.
#include <utility>

#include "engine/host/single_rank.h"

namespace zinf {

Result<SingleRank> NewCudaSingleRank(const CudaDeviceOptions& options) {
  SingleRank rank;
  ZINF_ASSIGN_OR_RETURN(rank.device, NewCudaDevice(options));
  ZINF_ASSIGN_OR_RETURN(rank.comm, NewNcclComm(rank.device.get(), NcclCommOptions{}));
  return rank;
}

}  // namespace zinf
