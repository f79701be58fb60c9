// The C API of the CPU optimizers (include/zinf/zinf.h, "CPU optimizers").
#include <cstdint>
#include <memory>
#include <string>

#include "c_api/c_api_internal.h"
#include "zinf/cpu_adam.h"
#include "zinf/zinf.h"

namespace {

// One optimizer for the whole process, on every CPU the process may use, created on first
// use (thread-safe). Never destroyed: a step may still run from another thread's atexit, and
// oneTBB's own teardown must not race with the arena's.
const zinf::Result<std::unique_ptr<zinf::CpuOptimizer>>& ProcessOptimizer() {
  static const auto* optimizer =
      new zinf::Result<std::unique_ptr<zinf::CpuOptimizer>>(zinf::CpuOptimizer::Create());
  return *optimizer;
}

int AdamStep(const char* fn, float* param, const void* grad, zinf::GradType grad_type,
             float* exp_avg, float* exp_avg_sq, void* param_copy,
             zinf::ParamCopyType param_copy_type, size_t n, int64_t step, float lr, float beta1,
             float beta2, float eps, float weight_decay, int adamw) {
  if (adamw != 0 && adamw != 1) {
    return zinf::capi::Fail(std::string(fn) + ": adamw must be 0 (Adam) or 1 (AdamW), got " +
                            std::to_string(adamw));
  }
  const auto& optimizer = ProcessOptimizer();
  if (!optimizer.ok()) return zinf::capi::FromStatus(optimizer.status().WithContext(fn));
  zinf::OptimizerHyperParams hp;
  hp.kind = adamw ? zinf::OptimizerKind::kAdamW : zinf::OptimizerKind::kAdam;
  hp.step = step;
  hp.lr = lr;
  hp.beta1 = beta1;
  hp.beta2 = beta2;
  hp.eps = eps;
  hp.weight_decay = weight_decay;
  zinf::OptimizerTensors t;
  t.param = param;
  t.grad = grad;
  t.grad_type = grad_type;
  t.exp_avg = exp_avg;
  t.exp_avg_sq = exp_avg_sq;
  t.param_copy = param_copy;
  t.param_copy_type = param_copy_type;
  t.n = n;
  return zinf::capi::FromStatus((*optimizer)->Step(hp, t).WithContext(fn));
}

}  // namespace

extern "C" {

int zinf_adam_step_f32(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, size_t n,
                       int64_t step, float lr, float beta1, float beta2, float eps,
                       float weight_decay, int adamw) {
  return AdamStep("zinf_adam_step_f32", param, grad, zinf::GradType::kF32, exp_avg, exp_avg_sq,
                  nullptr, zinf::ParamCopyType::kNone, n, step, lr, beta1, beta2, eps, weight_decay,
                  adamw);
}

int zinf_adam_step_bf16(float* param, const uint16_t* grad_bf16, float* exp_avg, float* exp_avg_sq,
                        uint16_t* param_bf16_out, size_t n, int64_t step, float lr, float beta1,
                        float beta2, float eps, float weight_decay, int adamw) {
  return AdamStep(
      "zinf_adam_step_bf16", param, grad_bf16, zinf::GradType::kBf16, exp_avg, exp_avg_sq,
      param_bf16_out,
      param_bf16_out != nullptr ? zinf::ParamCopyType::kBf16 : zinf::ParamCopyType::kNone, n, step,
      lr, beta1, beta2, eps, weight_decay, adamw);
}

const char* zinf_cpu_adam_kernel(void) {
  const auto& optimizer = ProcessOptimizer();
  if (!optimizer.ok()) {
    zinf::capi::FromStatus(optimizer.status().WithContext("zinf_cpu_adam_kernel"));
    return nullptr;
  }
  zinf::capi::Succeed();
  return (*optimizer)->kernel_name();
}

}  // extern "C"
