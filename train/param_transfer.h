// ParamTransfer: how the trainer's model reads acquired parameters and hands its gradients to
// the engine. GptTrainer picks one implementation when it is created, so the per-layer path
// (Acquire before every forward and backward, ReduceGradient for every parameter) has no
// per-call branch on which one is in use:
//   - the direct transfer: the model reads the engine's buffers in place and the engine reads
//     the model's gradients in place. The host device with the CPU kernels, and a CUDA device
//     with the GPU kernels, where both are device memory already.
//   - the staged transfer (TrainerHooks::stage_through_device, host device only): each
//     acquired parameter is copied into a host staging buffer and each gradient into a device
//     buffer through the Device copy API, as an embedder whose model runs elsewhere would. It
//     lets tests run those copies on a machine without a GPU; the bits trained are the same.
// Not thread-safe: one trainer, one thread.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "zinf/device.h"
#include "zinf/engine.h"

namespace zinf::train {

class ParamTransfer {
 public:
  virtual ~ParamTransfer() = default;
  // Engine::Acquire(group) for training; returns where the model reads each parameter (fp32,
  // or bf16 when the engine stores bf16). The pointers stay valid until the group's Release
  // and, when staged, only until the next Acquire.
  virtual Result<std::vector<void*>> Acquire(const std::vector<ParamId>& group) = 0;
  // Engine::ReduceGradient(id, ...) with the parameter's `numel` fp32 gradient values at
  // `grad` (memory of the model's ops), of micro-batch `micro_batch` of the window
  // (zinf.schedule layer-major; -1: the micro-step's, the form without one). `grad` may be
  // reused as soon as this returns.
  virtual Status ReduceGradient(ParamId id, const float* grad, size_t numel, int micro_batch) = 0;
};

// The direct transfer over `engine` (which must outlive it).
std::unique_ptr<ParamTransfer> NewDirectTransfer(Engine* engine);

// The staged transfer over `engine` and its host `device` (both must outlive it).
// `staging_bytes`: room for the largest acquired group, each parameter's part starting on a
// 64-byte boundary; `largest_param_numel`: the most values any one gradient has (its device
// buffer is allocated here, from the device, and freed by the destructor).
// REQUIRES: device->IsHost().
Result<std::unique_ptr<ParamTransfer>> NewStagedTransfer(Engine* engine, Device* device,
                                                         size_t staging_bytes,
                                                         size_t largest_param_numel);

}  // namespace zinf::train
