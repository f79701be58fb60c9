// GptTrainer: the GPT model of gpt.h trained through the engine. Every parameter lives in the
// engine; the trainer acquires a layer's parameters around its forward and its backward,
// hands each gradient to the engine, and lets the engine step the optimizer. It holds only
// activations, gradient scratch for one layer and (with bf16 storage) an fp32 copy of the
// acquired layer.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "train/gpt.h"
#include "zinf/engine.h"

namespace zinf::train {

// Optional seams for tests and embedders.
struct TrainerHooks {
  // Called after a parameter's initial values are generated (index in ParamList, full fp32
  // tensor): e.g. to load pre-trained weights, or to perturb one value.
  std::function<void(size_t index, float* data, size_t numel)> post_init;
  // Called with every gradient (index in ParamList, full fp32 tensor) just before it is
  // handed to the engine.
  std::function<void(size_t index, const float* grad, size_t numel)> grad_observer;
  // On the host device: copy parameters and gradients through the device's copy API (acquired
  // parameters to a host staging buffer, gradients into a device buffer), as an embedder
  // whose model runs elsewhere would (tests of those copies on a machine without a GPU).
  // Read once, by Create (param_transfer.h); ignored on a CUDA device.
  bool stage_through_device = false;
};

class GptTrainer {
 public:
  // Registers every parameter with `engine` (which must outlive the trainer) in layer order,
  // with the acquire order as the prefetch hint. `device`: the engine's device (null: the
  // host device). On the host device the forward and backward run on the CPU (kernels.h);
  // on a CUDA device they run on the GPU (model_ops.h: cuBLAS and CUDA kernels, on the
  // device's compute stream), with activations and gradients in device memory taken from
  // the device's pool (DeviceBytes says how much).
  static Result<std::unique_ptr<GptTrainer>> Create(const GptConfig& model, int batch, int seq,
                                                    uint64_t seed, Engine* engine,
                                                    const TrainerHooks& hooks = {},
                                                    Device* device = nullptr);
  ~GptTrainer();

  // One micro-step (zinf.schedule micro-batch): forward, backward and Engine::Step on
  // batch*seq tokens. The loss is
  // scaled by `loss_scale` for the gradients (1 / accumulation steps for a mean); the
  // returned loss is the unscaled mean cross-entropy (nats per token).
  Result<double> MicroStep(const int32_t* tokens, const int32_t* targets, float loss_scale,
                           StepStats* stats);
  // zinf.schedule layer-major: one window of the engine's gradient_accumulation_steps
  // micro-batches (k) and its Engine::Step. tokens and targets hold k x batch x seq values,
  // micro-batch after micro-batch. Each block runs for every micro-batch before the next
  // (its parameters acquired once per pass), keeping each micro-batch's block inputs and
  // recomputing a block's activations in the backward; the gradients, summed in micro-batch
  // order by the engine, and so the parameters are MicroStep's bit for bit. Returns the k
  // unscaled losses.
  Result<std::vector<double>> Window(const int32_t* tokens, const int32_t* targets,
                                     float loss_scale, StepStats* stats);
  // xxh3-64 over the fp32 master values of every parameter in registration order (gathered
  // from the engine), so two runs can be compared.
  Result<uint64_t> ParamChecksum();
  // The fp32 master values of one parameter (by its index in ParamList).
  Status MasterValues(size_t index, std::vector<float>* out);

  // The device memory the trainer takes from a CUDA device's pool for this shape
  // (activations, gradients of one layer, scratch), beyond the engine's budget.
  // `half`: the engine stores 16-bit parameters (bf16 or fp16).
  // `window`: the micro-batches a layer-major window keeps (0: the micro-batch schedule).
  static size_t DeviceBytes(const GptConfig& model, int batch, int seq, bool half, int window = 0);
  // Of those, what a layer-major window of `window` micro-batches keeps (block inputs, the
  // gradient on its way down, wte's gradient, tokens): the activation bytes of the schedule.
  static size_t WindowBytes(const GptConfig& model, int batch, int seq, int window);

  const GptConfig& model() const { return model_; }
  int batch() const { return batch_; }
  int seq() const { return seq_; }
  uint64_t param_count() const { return ParamCount(model_); }

 private:
  struct Impl;
  explicit GptTrainer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  GptConfig model_;
  int batch_ = 0, seq_ = 0;
};

}  // namespace zinf::train
