// The engine's vocabulary, below the Engine class: parameter ids and descriptions, the
// acquire modes and the statistics of a step. The engine's own components (layout, memory
// plan, statistics) use these without the Engine API above them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "zinf/field_count.h"

namespace zinf {

using ParamId = uint32_t;

// One parameter group's optimizer hyperparameters (torch's param_groups, DeepSpeed's
// model_parameters groups): every parameter belongs to one group (ParamSpec::param_group), and
// the optimizer steps it with its group's values. The optimizer type is the engine's
// (EngineConfig::optimizer.type): Adam and AdamW read every field, Adagrad lr, eps and
// weight_decay, Lion lr, beta1, beta2 and weight_decay. Group 0 starts as the config's
// optimizer.params (Engine::SetParamGroup adds and changes groups).
struct ParamGroupHyper {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
};

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  // Fills the full fp32 tensor (numel elements) with its initial values. Called once per rank
  // when registration ends (FinishRegistration), in registration order; every rank must produce
  // the same values.
  std::function<void(float* data, size_t numel)> init;
  // false: a frozen parameter: data, not state. It is stored (once, in the storage dtype, or
  // int8 with zinf.frozen_weight_dtype) and fetched like the others, but has no fp32 master,
  // no optimizer states and no gradient (ReduceGradient refuses it), and is never written
  // back. Checkpoints and durable commits record it by the hash of its value (registered with
  // init or set with SetParameterValues); loading either into an engine whose value or whose
  // trainable flag differs is refused, naming it. Fixed at registration.
  bool trainable = true;
  // The parameter group whose hyperparameters step it (Engine::SetParamGroup; 0: the
  // config's). Must name a group that exists when the parameter is registered.
  size_t param_group = 0;
};

// What the engine knows of a registered parameter.
struct ParamInfo {
  std::string name;
  std::vector<int64_t> shape;
  size_t numel = 0;
  size_t partition_numel = 0;  // elements each rank owns (numel padded to world_size parts)
  size_t sub_group = 0;        // optimizer sub-group
  bool persistent = false;     // small enough to stay on the device once fetched
  bool trainable = true;       // ParamSpec::trainable
  size_t param_group = 0;      // ParamSpec::param_group
};

// Acquire's purpose. kTraining acquires make up the micro-step: they start it (the optimizer
// gets its epoch at a boundary), the first step's are recorded as the prefetch trace, and later
// steps are checked against it. kInference acquires (a forward pass without gradients, e.g. an
// evaluation between steps) do none of that: they neither start a micro-step nor record or
// invalidate the trace, and may come between optimizer steps (before SaveCheckpoint, say).
enum class AcquireMode { kTraining, kInference };

// Figures for one Step() call (one micro-step; optimizer figures when it ran).
struct StepStats {
  int64_t step = 0;            // global optimizer steps taken so far
  bool optimizer_ran = false;  // this micro-step ended an accumulation boundary
  double step_seconds = 0;     // since the previous Step() returned
  // Bytes per link.
  uint64_t nvme_read_bytes = 0;
  uint64_t nvme_write_bytes = 0;
  uint64_t h2d_bytes = 0;
  uint64_t d2h_bytes = 0;
  // Busy time per resource (seconds within this step).
  double nvme_busy_seconds = 0;       // time with at least one swap request in flight
  double copy_busy_seconds = 0;       // host<->device copies
  double optimizer_busy_seconds = 0;  // CPU optimizer kernels
  double acquire_wait_seconds = 0;    // the trainer blocked in Acquire
  double optimizer_wait_seconds = 0;  // Step() blocked waiting for the optimizer
  // Peaks over the step.
  uint64_t peak_device_bytes = 0;
  uint64_t peak_pinned_bytes = 0;
  uint64_t nvme_bytes = 0;        // swap store size
  double overlap_efficiency = 0;  // max(busy) / step_seconds
  double grad_norm = 0;           // global L2 norm before clipping (when clipping is on)
  // Training acquires (AcquireMode::kTraining) whose data was already fetched or in flight,
  // and the others; inference acquires count in neither.
  uint64_t prefetch_hits = 0;
  uint64_t prefetch_misses = 0;
  bool trace_valid = false;
  // CPU seconds within the step (the busy times above are wall-clock spans, and on a host
  // device or with a CPU optimizer they share the same cores): the whole process, the
  // trainer's thread (with the copies a host device runs inline on it), and the CPU
  // optimizer's loops on any thread. The rest of the process (copy and landing workers, swap
  // I/O, collectives) is total - trainer - optimizer. cpu_seconds_total / (cores x
  // step_seconds) near 1 means the step is CPU-bound, whatever overlap_efficiency says.
  double cpu_seconds_total = 0;
  double cpu_seconds_trainer = 0;
  double cpu_seconds_optimizer = 0;
  // Speculative steps (zinf.speculative_step) in this step: sub-groups stepped before the
  // norm was known, and of those settled, how many were kept, redone with the clipping
  // coefficient, or rolled back (the norm failed); the seconds the redos and rollbacks took.
  uint64_t speculated_groups = 0;
  uint64_t kept_groups = 0;
  uint64_t redone_groups = 0;
  uint64_t rolled_back_groups = 0;
  double speculation_redo_seconds = 0;
  // Sub-groups the CPU optimizer began before their last gradient had landed whole, stepping
  // it piece by piece as it landed (one rank on the host device, at a window's end, without
  // clipping: GradientWindow's inline copy).
  uint64_t landing_groups = 0;
  // fp16 (EngineConfig::fp16): the loss scale the next micro-steps' backward uses (1 without
  // fp16), and the optimizer steps skipped so far because a gradient overflowed (inf or NaN
  // under the scale); a skipped step changes no parameter or state.
  double loss_scale = 1;
  uint64_t skipped_steps = 0;
};

// Calls visit(name, value) for every StepStats field, in declaration order, so that a front end
// (the Python module, a bench's JSON line) reports them all without copying field by field.
template <typename Visit>
void VisitStepStats(const StepStats& s, Visit&& visit) {
  visit("step", s.step);
  visit("optimizer_ran", s.optimizer_ran);
  visit("step_seconds", s.step_seconds);
  visit("nvme_read_bytes", s.nvme_read_bytes);
  visit("nvme_write_bytes", s.nvme_write_bytes);
  visit("h2d_bytes", s.h2d_bytes);
  visit("d2h_bytes", s.d2h_bytes);
  visit("nvme_busy_seconds", s.nvme_busy_seconds);
  visit("copy_busy_seconds", s.copy_busy_seconds);
  visit("optimizer_busy_seconds", s.optimizer_busy_seconds);
  visit("acquire_wait_seconds", s.acquire_wait_seconds);
  visit("optimizer_wait_seconds", s.optimizer_wait_seconds);
  visit("peak_device_bytes", s.peak_device_bytes);
  visit("peak_pinned_bytes", s.peak_pinned_bytes);
  visit("nvme_bytes", s.nvme_bytes);
  visit("overlap_efficiency", s.overlap_efficiency);
  visit("grad_norm", s.grad_norm);
  visit("prefetch_hits", s.prefetch_hits);
  visit("prefetch_misses", s.prefetch_misses);
  visit("trace_valid", s.trace_valid);
  visit("cpu_seconds_total", s.cpu_seconds_total);
  visit("cpu_seconds_trainer", s.cpu_seconds_trainer);
  visit("cpu_seconds_optimizer", s.cpu_seconds_optimizer);
  visit("speculated_groups", s.speculated_groups);
  visit("kept_groups", s.kept_groups);
  visit("redone_groups", s.redone_groups);
  visit("rolled_back_groups", s.rolled_back_groups);
  visit("speculation_redo_seconds", s.speculation_redo_seconds);
  visit("landing_groups", s.landing_groups);
  visit("loss_scale", s.loss_scale);
  visit("skipped_steps", s.skipped_steps);
}

#ifdef ZINF_HAS_FIELD_COUNT_CHECK
// VisitStepStats visits 31 fields: a field added to StepStats without a visit fails here.
static_assert(HasFields<StepStats, 31>,
              "StepStats gained or lost a field: update VisitStepStats and this count");
#endif

}  // namespace zinf
