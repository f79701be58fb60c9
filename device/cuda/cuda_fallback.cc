// zinf_cuda_backends in a build without CUDA: everything links, nothing runs.
#include "zinf/cuda.h"

namespace zinf {
namespace {

Status NoCuda() { return Status::NotSupported("built without CUDA"); }

}  // namespace

int CudaDeviceCount() { return 0; }

Result<std::unique_ptr<Device>> NewCudaDevice(const CudaDeviceOptions&) { return NoCuda(); }

void* CudaStreamOf(Stream*) { return nullptr; }

Result<std::unique_ptr<Communicator>> NewNcclComm(Device*, const NcclCommOptions&) {
  return NoCuda();
}

namespace cuda {

Status CastBf16ToF32(const uint16_t*, float*, size_t, Stream*) { return NoCuda(); }
Status CastF32ToBf16(const float*, uint16_t*, size_t, Stream*) { return NoCuda(); }
Status Scale(float*, size_t, float, Stream*) { return NoCuda(); }
Status Add(float*, const float*, size_t, Stream*) { return NoCuda(); }
Status QuantizeInt8(const void*, ParamCopyType, size_t, size_t, void*, Stream*) { return NoCuda(); }
Status DequantizeInt8(const void*, size_t, size_t, ParamCopyType, void*, Stream*) {
  return NoCuda();
}
Status QuantizeInt4(const float*, size_t, size_t, void*, Stream*) { return NoCuda(); }
Status DequantizeInt4(const void*, size_t, size_t, float*, Stream*) { return NoCuda(); }
Status SumSquares(const float*, size_t, double*, bool*, Stream*) { return NoCuda(); }
Status AdamStep(const OptimizerHyperParams&, const OptimizerTensors&, Stream*) { return NoCuda(); }
Status Spin(double, uint64_t*, Stream*) { return NoCuda(); }

}  // namespace cuda
}  // namespace zinf
