// The kernel tables behind zinf/cpu_adam.h: one per instruction-set variant, each compiled
// in its own translation unit with its own flags (see CMakeLists.txt). Only the table getters
// cross translation units, so no inline function compiled for a wide ISA can be picked by the
// linker for a narrow one.
#pragma once

#include <cstddef>
#include <cstdint>

#include "zinf/cpu_adam.h"

namespace zinf::cpu_adam_internal {

enum class KernelVariant { kScalar, kAvx2, kAvx512, kAvx512Bf16 };
inline constexpr int kNumKernelVariants = 4;
inline constexpr int kNumOptimizerKinds = 4;
inline constexpr int kNumGradTypes = 3;
inline constexpr int kNumParamCopyTypes = 3;
inline constexpr int kNumStateTypes = 3;

// SelectCpuIsa with the environment value and the CPU features passed in (for tests).
Result<CpuIsa> SelectCpuIsaFrom(std::optional<CpuIsa> requested, const char* env,
                                const CpuFeatures& features);

const char* KernelVariantName(KernelVariant variant);
bool KernelVariantSupported(KernelVariant variant, const CpuFeatures& features);
// The fastest variant of `isa` on this machine (kAvx512 -> kAvx512Bf16 when present).
KernelVariant BestVariantOf(CpuIsa isa, const CpuFeatures& features);
CpuIsa IsaOf(KernelVariant variant);

// Per-step constants, computed once per call in double and rounded once to float, so every
// variant (and every thread) uses the same float values.
struct StepCoefficients {
  float grad_scale = 1.0f;
  // Adam, Adagrad: g = fma(l2_decay, p, g) when has_weight_decay.
  // AdamW, Lion: p = p * param_decay (= 1 - lr * weight_decay) when has_weight_decay.
  bool has_weight_decay = false;
  float l2_decay = 0.0f;
  float param_decay = 1.0f;
  float beta1 = 0.0f;
  float one_minus_beta1 = 0.0f;
  float beta2 = 0.0f;
  float one_minus_beta2 = 0.0f;
  // Adam/AdamW: -lr / (1 - beta1^step); Adagrad: -lr / (1 + (step - 1) * lr_decay);
  // Lion: -lr.
  float neg_step_size = 0.0f;
  // Adam/AdamW: 1 / sqrt(1 - beta2^step).
  float inv_bias_correction2_sqrt = 1.0f;
  float eps = 0.0f;
};

struct StepBuffers {
  float* param = nullptr;
  const void* grad = nullptr;
  float* state1 = nullptr;  // exp_avg (Adam, AdamW, Lion) or sum (Adagrad), fp32 states
  float* state2 = nullptr;  // exp_avg_sq (Adam, AdamW), fp32 states
  void* param_copy = nullptr;
  void* q1 = nullptr;  // state1 and state2 in a compressed StateType (see OptimizerTensors)
  void* q2 = nullptr;
};

// Updates elements [begin, end). With compressed int8 states, begin is a multiple of
// kInt8StateBlock (tiles are).
using StepKernelFn = void (*)(const StepCoefficients& c, const StepBuffers& b, size_t begin,
                              size_t end);
// Adds the squares of grad[begin, end) to *sum_squares (in an order fixed by begin and end)
// and ORs whether any is inf or NaN into *has_inf_or_nan.
using SumSquaresFn = void (*)(const void* grad, size_t begin, size_t end, double* sum_squares,
                              bool* has_inf_or_nan);
// Whether grad[begin, end) holds no inf and no NaN (bits only: cheap from cache).
using AllFiniteFn = bool (*)(const void* grad, size_t begin, size_t end);
// dst[i] = convert(src[i]) for i in [begin, end).
using ConvertFn = void (*)(const float* src, void* dst, size_t begin, size_t end);

// A compressed state of n elements (starting a block) to fp32 and back.
using DecodeStateFn = void (*)(const void* q, size_t n, float* out);
using EncodeStateFn = void (*)(const float* in, size_t n, void* q);

struct KernelTable {
  KernelVariant variant;
  // [kind][grad][copy][state]; null for a combination that is refused (Adagrad with int8).
  StepKernelFn step[kNumOptimizerKinds][kNumGradTypes][kNumParamCopyTypes][kNumStateTypes];
  SumSquaresFn sum_squares[kNumGradTypes];
  AllFiniteFn all_finite[kNumGradTypes];
  ConvertFn convert[kNumParamCopyTypes];  // [kNone] is null
  // [state type][signed]; [kF32] is null.
  DecodeStateFn decode_state[kNumStateTypes][2];
  EncodeStateFn encode_state[kNumStateTypes][2];
};

// Each defined in its own kernels_<variant>.cc. Calling a getter is always safe; calling a
// kernel of a variant the CPU does not support is not.
const KernelTable& ScalarKernels();
const KernelTable& Avx2Kernels();
const KernelTable& Avx512Kernels();
const KernelTable& Avx512Bf16Kernels();
const KernelTable& KernelsFor(KernelVariant variant);

// The coefficients of a validated step.
StepCoefficients ComputeCoefficients(const OptimizerHyperParams& hp);
StepBuffers BuffersOf(const OptimizerHyperParams& hp, const OptimizerTensors& t);
inline StepKernelFn SelectStepKernel(const KernelTable& table, const OptimizerHyperParams& hp,
                                     const OptimizerTensors& t) {
  return table.step[static_cast<int>(hp.kind)][static_cast<int>(t.grad_type)]
                   [static_cast<int>(t.param_copy_type)][static_cast<int>(t.state_type)];
}

}  // namespace zinf::cpu_adam_internal
