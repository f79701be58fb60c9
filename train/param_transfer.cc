#include "train/param_transfer.h"

#include <cstdint>

#include "zinf/align.h"

namespace zinf::train {
namespace {

// The engine's call for micro-batch `micro_batch` (-1: the form without one).
Status Reduce(Engine* engine, ParamId id, const float* grad, int micro_batch) {
  return micro_batch < 0 ? engine->ReduceGradient(id, grad)
                         : engine->ReduceGradient(id, grad, micro_batch);
}

class DirectTransfer final : public ParamTransfer {
 public:
  explicit DirectTransfer(Engine* engine) : engine_(engine) {}

  Result<std::vector<void*>> Acquire(const std::vector<ParamId>& group) override {
    return engine_->Acquire(group);
  }
  Status ReduceGradient(ParamId id, const float* grad, size_t /*numel*/, int micro_batch) override {
    // On the GPU `grad` was produced on the compute stream, which the engine's copy follows.
    return Reduce(engine_, id, grad, micro_batch);
  }

 private:
  Engine* const engine_;
};

class StagedTransfer final : public ParamTransfer {
 public:
  StagedTransfer(Engine* engine, Device* device, size_t staging_bytes, void* device_grad)
      : engine_(engine),
        device_(device),
        elem_bytes_(StoredParamBytes(engine->config())),
        staged_(staging_bytes),
        device_grad_(device_grad) {}
  ~StagedTransfer() override { device_->Free(device_grad_); }
  StagedTransfer(const StagedTransfer&) = delete;
  StagedTransfer& operator=(const StagedTransfer&) = delete;

  Result<std::vector<void*>> Acquire(const std::vector<ParamId>& group) override {
    ZINF_ASSIGN_OR_RETURN(std::vector<void*> raw, engine_->Acquire(group));
    size_t offset = 0;
    Stream* compute = device_->ComputeStream();
    for (size_t i = 0; i < group.size(); ++i) {
      const size_t bytes = engine_->param(group[i]).numel * elem_bytes_;
      ZINF_RETURN_IF_ERROR(
          device_->CopyDeviceToHost(staged_.data() + offset, raw[i], bytes, compute));
      raw[i] = staged_.data() + offset;
      offset += RoundUp(bytes, 64);
    }
    // The model reads the staged copies on the CPU right away.
    ZINF_RETURN_IF_ERROR(device_->SynchronizeStream(compute));
    return raw;
  }

  Status ReduceGradient(ParamId id, const float* grad, size_t numel, int micro_batch) override {
    // The engine's copy out of device_grad_ is ordered on the compute stream before the next
    // gradient's copy into it.
    Stream* compute = device_->ComputeStream();
    ZINF_RETURN_IF_ERROR(
        device_->CopyHostToDevice(device_grad_, grad, numel * sizeof(float), compute));
    ZINF_RETURN_IF_ERROR(device_->SynchronizeStream(compute));
    return Reduce(engine_, id, static_cast<const float*>(device_grad_), micro_batch);
  }

 private:
  Engine* const engine_;
  Device* const device_;
  const size_t elem_bytes_;      // of a stored parameter: bf16, fp16 or fp32
  std::vector<uint8_t> staged_;  // the acquired group's host copies
  void* const device_grad_;      // one gradient in device memory; owned
};

}  // namespace

std::unique_ptr<ParamTransfer> NewDirectTransfer(Engine* engine) {
  return std::make_unique<DirectTransfer>(engine);
}

Result<std::unique_ptr<ParamTransfer>> NewStagedTransfer(Engine* engine, Device* device,
                                                         size_t staging_bytes,
                                                         size_t largest_param_numel) {
  ZINF_CHECK_MSG(device != nullptr && device->IsHost(),
                 "the staged transfer stands in for a GPU on the host device only");
  ZINF_ASSIGN_OR_RETURN(void* device_grad, device->Alloc(largest_param_numel * sizeof(float)));
  return std::unique_ptr<ParamTransfer>(
      new StagedTransfer(engine, device, staging_bytes, device_grad));
}

}  // namespace zinf::train
