// NewCudaModelOps in a build without CUDA: there is no GPU to run the model on.
#include "train/model_ops.h"

namespace zinf::train {

Result<std::unique_ptr<ModelOps>> NewCudaModelOps(Device*, const ModelDims&) {
  return Status::NotSupported("zinf was built without CUDA: the model runs on the host device");
}

size_t CudaModelOpsScratchBytes(const ModelDims&) { return 0; }

}  // namespace zinf::train
