// Argument checks, per-step coefficients, and the oneTBB driver with optional hwloc binding.
#include <hwloc.h>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/info.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/parallel_reduce.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>
#include <oneapi/tbb/task_scheduler_observer.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_adam/kernels.h"
#include "zinf/align.h"
#include "zinf/cpu_adam.h"
#include "zinf/log.h"

namespace zinf {

using cpu_adam_internal::BestVariantOf;
using cpu_adam_internal::KernelsFor;
using cpu_adam_internal::KernelTable;
using cpu_adam_internal::KernelVariant;
using cpu_adam_internal::KernelVariantName;
using cpu_adam_internal::StepBuffers;
using cpu_adam_internal::StepCoefficients;

const char* OptimizerKindName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdam:
      return "adam";
    case OptimizerKind::kAdamW:
      return "adamw";
    case OptimizerKind::kAdagrad:
      return "adagrad";
    case OptimizerKind::kLion:
      return "lion";
  }
  return "unknown";
}

const char* GradTypeName(GradType type) {
  switch (type) {
    case GradType::kF32:
      return "f32";
    case GradType::kBf16:
      return "bf16";
    case GradType::kF16:
      return "f16";
  }
  return "unknown";
}

const char* ParamCopyTypeName(ParamCopyType type) {
  switch (type) {
    case ParamCopyType::kNone:
      return "none";
    case ParamCopyType::kBf16:
      return "bf16";
    case ParamCopyType::kF16:
      return "f16";
  }
  return "unknown";
}

Status ConvertOptimizerState(StateType from, const void* src, StateType to, void* dst, size_t n,
                             StateRole role) {
  for (StateType t : {from, to}) {
    if (t != StateType::kF32 && t != StateType::kBf16 && t != StateType::kInt8) {
      return Status::InvalidArgument("optimizer state conversion: unknown state type");
    }
  }
  if (n == 0) return Status::OK();
  if (n > std::numeric_limits<size_t>::max() / 16) {
    return Status::InvalidArgument("optimizer state conversion: n is too large");
  }
  if (src == nullptr || dst == nullptr) {
    return Status::InvalidArgument("optimizer state conversion: a buffer is NULL");
  }
  const auto a = reinterpret_cast<uintptr_t>(src);
  const auto b = reinterpret_cast<uintptr_t>(dst);
  if (a < b + StateBytes(to, n) && b < a + StateBytes(from, n)) {
    return Status::InvalidArgument("optimizer state conversion: the buffers overlap");
  }
  for (auto [t, p] : {std::pair{from, a}, std::pair{to, b}}) {
    const size_t align = t == StateType::kBf16 ? alignof(uint16_t) : alignof(float);
    if (p % align != 0) {
      return Status::InvalidArgument(std::string("optimizer state conversion: ") +
                                     StateTypeName(t) + " states must be " + std::to_string(align) +
                                     "-byte aligned");
    }
  }
  if (from == to) {
    std::memcpy(dst, src, StateBytes(to, n));
    return Status::OK();
  }
  ZINF_ASSIGN_OR_RETURN(CpuIsa isa, SelectCpuIsa());
  const KernelTable& table = KernelsFor(BestVariantOf(isa, DetectCpuFeatures()));
  const int is_signed = role == StateRole::kSigned ? 1 : 0;
  // A block at a time through fp32 (nothing allocated): block k starts StateBytes(t, k * 256)
  // bytes into a buffer of either type.
  const auto* in = static_cast<const uint8_t*>(src);
  auto* out = static_cast<uint8_t*>(dst);
  alignas(64) float block[kInt8StateBlock];
  for (size_t at = 0; at < n; at += kInt8StateBlock) {
    const size_t len = std::min(kInt8StateBlock, n - at);
    const uint8_t* from_block = in + StateBytes(from, at);
    uint8_t* to_block = out + StateBytes(to, at);
    const float* values = block;
    if (from == StateType::kF32) {
      values = reinterpret_cast<const float*>(from_block);
    } else {
      table.decode_state[static_cast<int>(from)][is_signed](from_block, len, block);
    }
    if (to == StateType::kF32) {
      std::memcpy(to_block, values, len * sizeof(float));
    } else {
      table.encode_state[static_cast<int>(to)][is_signed](values, len, to_block);
    }
  }
  return Status::OK();
}

size_t GradTypeSize(GradType type) { return type == GradType::kF32 ? 4 : 2; }
size_t ParamCopyTypeSize(ParamCopyType type) { return type == ParamCopyType::kNone ? 0 : 2; }

Result<OptimizerTensors> SliceOptimizerTensors(const OptimizerTensors& t, size_t begin,
                                               size_t end) {
  if (begin > end || end > t.n) {
    return Status::InvalidArgument("optimizer tensors: slice [" + std::to_string(begin) + ", " +
                                   std::to_string(end) + ") is outside [0, " + std::to_string(t.n) +
                                   ")");
  }
  if (t.state_type == StateType::kInt8 && begin % kInt8StateBlock != 0) {
    return Status::InvalidArgument(
        "optimizer tensors: an int8-state slice must start on a "
        "multiple of " +
        std::to_string(kInt8StateBlock) + " elements (got " + std::to_string(begin) + ")");
  }
  // (Null buffers stay null: a step refuses them, or they are not used.)
  auto advance = [&](auto* p, size_t bytes) {
    using T = std::remove_pointer_t<decltype(p)>;
    using Byte = std::conditional_t<std::is_const_v<T>, const char, char>;
    return p == nullptr ? p : reinterpret_cast<decltype(p)>(reinterpret_cast<Byte*>(p) + bytes);
  };
  OptimizerTensors s = t;
  s.n = end - begin;
  s.param = advance(t.param, begin * sizeof(float));
  s.grad = advance(t.grad, begin * GradTypeSize(t.grad_type));
  s.exp_avg = advance(t.exp_avg, begin * sizeof(float));
  s.exp_avg_sq = advance(t.exp_avg_sq, begin * sizeof(float));
  s.sum = advance(t.sum, begin * sizeof(float));
  s.param_copy = advance(t.param_copy, begin * ParamCopyTypeSize(t.param_copy_type));
  s.state1 = advance(t.state1, StateBytes(t.state_type, begin));
  s.state2 = advance(t.state2, StateBytes(t.state_type, begin));
  return s;
}

namespace {

std::string Num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return buf;
}

bool IsValidKind(OptimizerKind k) {
  return k == OptimizerKind::kAdam || k == OptimizerKind::kAdamW || k == OptimizerKind::kAdagrad ||
         k == OptimizerKind::kLion;
}

struct NamedBuffer {
  const char* name;
  const void* ptr;
  size_t bytes;
};

Status CheckBuffers(const std::string& what, const NamedBuffer* buffers, int count) {
  for (int i = 0; i < count; ++i) {
    if (buffers[i].ptr == nullptr) {
      return Status::InvalidArgument(what + ": " + buffers[i].name + " is NULL but n > 0");
    }
  }
  for (int i = 0; i < count; ++i) {
    const auto a = reinterpret_cast<uintptr_t>(buffers[i].ptr);
    for (int j = i + 1; j < count; ++j) {
      const auto b = reinterpret_cast<uintptr_t>(buffers[j].ptr);
      if (a < b + buffers[j].bytes && b < a + buffers[i].bytes) {
        return Status::InvalidArgument(what + ": " + buffers[i].name + " and " + buffers[j].name +
                                       " overlap; each needs a buffer of its own");
      }
    }
  }
  return Status::OK();
}

Status CheckStreamLength(const std::string& what, size_t n) {
  // Keeps every byte count (n * 4) and pointer end from overflowing.
  if (n > std::numeric_limits<size_t>::max() / 16) {
    return Status::InvalidArgument(what + ": n = " + std::to_string(n) + " is too large");
  }
  return Status::OK();
}

// `v` (the hyperparameter `name` of the step `what`) is finite and at least `lo`.
Status CheckFiniteAtLeast(const std::string& what, const char* name, float v, float lo) {
  if (!std::isfinite(v) || v < lo) {
    return Status::InvalidArgument(what + ": " + name + " must be finite and >= " + Num(lo) +
                                   " (got " + Num(v) + ")");
  }
  return Status::OK();
}

// beta1 and beta2 of an Adam-like or Lion step are in [0, 1) (Lion: [0, 1]).
Status CheckBetas(const std::string& what, const OptimizerHyperParams& hp) {
  // Adam's bias corrections divide by 1 - beta^step, so a beta of 1 is rejected; Lion has
  // none and accepts beta = 1 (a frozen momentum).
  const bool closed = hp.kind == OptimizerKind::kLion;
  for (auto [name, beta] : {std::pair{"beta1", hp.beta1}, std::pair{"beta2", hp.beta2}}) {
    const bool ok = beta >= 0.0f && (closed ? beta <= 1.0f : beta < 1.0f);  // false for NaN
    if (!ok) {
      return Status::InvalidArgument(what + ": " + name + " must be in [0, 1" +
                                     (closed ? "]" : ")") + " (got " + Num(beta) + ")");
    }
  }
  return Status::OK();
}

// The hyperparameters `hp.kind` reads are in range (the first one that is not is named).
Status CheckHyperParams(const std::string& what, const OptimizerHyperParams& hp) {
  if (hp.step < 1) {
    return Status::InvalidArgument(what + ": step must be >= 1 (got " + std::to_string(hp.step) +
                                   "); steps are counted from 1, as torch's state['step'] after "
                                   "its increment");
  }
  ZINF_RETURN_IF_ERROR(CheckFiniteAtLeast(what, "lr", hp.lr, 0.0f));
  ZINF_RETURN_IF_ERROR(CheckFiniteAtLeast(what, "weight_decay", hp.weight_decay, 0.0f));
  if (!std::isfinite(hp.grad_scale) || !(hp.grad_scale > 0.0f)) {
    return Status::InvalidArgument(what + ": grad_scale must be finite and > 0 (got " +
                                   Num(hp.grad_scale) + ")");
  }
  if (hp.kind != OptimizerKind::kLion) {
    ZINF_RETURN_IF_ERROR(CheckFiniteAtLeast(what, "eps", hp.eps, 0.0f));
  }
  if (hp.kind == OptimizerKind::kAdagrad) {
    return CheckFiniteAtLeast(what, "lr_decay", hp.lr_decay, 0.0f);
  }
  return CheckBetas(what, hp);
}

// The tensors' types are known and supported by `hp.kind`, and the states are in the slots of
// their type (exp_avg / exp_avg_sq / sum for fp32, state1 / state2 for compressed ones).
Status CheckTensorTypes(const std::string& what, const OptimizerHyperParams& hp,
                        const OptimizerTensors& t) {
  if (t.grad_type != GradType::kF32 && t.grad_type != GradType::kBf16 &&
      t.grad_type != GradType::kF16) {
    return Status::InvalidArgument(what + ": unknown gradient type");
  }
  if (t.param_copy_type != ParamCopyType::kNone && t.param_copy_type != ParamCopyType::kBf16 &&
      t.param_copy_type != ParamCopyType::kF16) {
    return Status::InvalidArgument(what + ": unknown parameter copy type");
  }
  if (t.state_type != StateType::kF32 && t.state_type != StateType::kBf16 &&
      t.state_type != StateType::kInt8) {
    return Status::InvalidArgument(what + ": unknown optimizer state type");
  }
  if (hp.kind == OptimizerKind::kAdagrad && t.state_type == StateType::kInt8) {
    return Status::InvalidArgument(
        what +
        ": int8 states are not supported for Adagrad (its sum of squares only grows, "
        "and a blockwise 8-bit code cannot follow that); use fp32 or bf16 states");
  }
  const bool compressed = t.state_type != StateType::kF32;
  if (compressed && (t.exp_avg != nullptr || t.exp_avg_sq != nullptr || t.sum != nullptr)) {
    return Status::InvalidArgument(what + ": with " + StateTypeName(t.state_type) +
                                   " states the states go in state1/state2; exp_avg, exp_avg_sq "
                                   "and sum must be null");
  }
  if (!compressed && (t.state1 != nullptr || t.state2 != nullptr)) {
    return Status::InvalidArgument(what +
                                   ": state1/state2 are for compressed states (state_type bf16 "
                                   "or int8); fp32 states go in exp_avg, exp_avg_sq or sum");
  }
  return Status::OK();
}

// Compressed states: state1 and state2 are aligned for their element (int8 blocks hold fp32
// scales).
Status CheckStateAlignment(const std::string& what, const OptimizerTensors& t) {
  const size_t align = t.state_type == StateType::kInt8 ? alignof(float) : alignof(uint16_t);
  for (auto [name, q] : {std::pair{"state1", t.state1}, std::pair{"state2", t.state2}}) {
    if (reinterpret_cast<uintptr_t>(q) % align != 0) {
      return Status::InvalidArgument(
          what + ": " + StateTypeName(t.state_type) + " " + name + " must be " +
          std::to_string(align) + "-byte aligned" +
          (t.state_type == StateType::kInt8 ? " (it holds fp32 block scales)" : ""));
    }
  }
  return Status::OK();
}

// The buffers the step reads and writes (n > 0) are non-null and do not overlap.
Status CheckStepBuffers(const std::string& what, const OptimizerHyperParams& hp,
                        const OptimizerTensors& t) {
  const bool compressed = t.state_type != StateType::kF32;
  const bool adam_like = hp.kind == OptimizerKind::kAdam || hp.kind == OptimizerKind::kAdamW;
  NamedBuffer buffers[5];
  int count = 0;
  buffers[count++] = {"param", t.param, t.n * 4};
  buffers[count++] = {"grad", t.grad, t.n * GradTypeSize(t.grad_type)};
  const size_t state_bytes = StateBytes(t.state_type, t.n);
  if (hp.kind == OptimizerKind::kAdagrad) {
    buffers[count++] = compressed ? NamedBuffer{"state1", t.state1, state_bytes}
                                  : NamedBuffer{"sum", t.sum, state_bytes};
  } else {
    buffers[count++] = compressed ? NamedBuffer{"state1", t.state1, state_bytes}
                                  : NamedBuffer{"exp_avg", t.exp_avg, state_bytes};
  }
  if (adam_like) {
    buffers[count++] = compressed ? NamedBuffer{"state2", t.state2, state_bytes}
                                  : NamedBuffer{"exp_avg_sq", t.exp_avg_sq, state_bytes};
  }
  if (t.param_copy_type != ParamCopyType::kNone) {
    buffers[count++] = {"param_copy", t.param_copy, t.n * ParamCopyTypeSize(t.param_copy_type)};
  }
  return CheckBuffers(what, buffers, count);
}

}  // namespace

Status ValidateOptimizerStep(const OptimizerHyperParams& hp, const OptimizerTensors& t) {
  if (!IsValidKind(hp.kind)) {
    return Status::InvalidArgument("optimizer step: unknown optimizer kind");
  }
  const std::string what = std::string(OptimizerKindName(hp.kind)) + " step";
  ZINF_RETURN_IF_ERROR(CheckHyperParams(what, hp));
  ZINF_RETURN_IF_ERROR(CheckTensorTypes(what, hp, t));
  ZINF_RETURN_IF_ERROR(CheckStreamLength(what, t.n));
  if (t.n == 0) return Status::OK();
  if (t.state_type != StateType::kF32) ZINF_RETURN_IF_ERROR(CheckStateAlignment(what, t));
  return CheckStepBuffers(what, hp, t);
}

namespace cpu_adam_internal {

StepCoefficients ComputeCoefficients(const OptimizerHyperParams& hp) {
  StepCoefficients c;
  const double lr = hp.lr;
  const double wd = hp.weight_decay;
  const double beta1 = hp.beta1;
  const double beta2 = hp.beta2;
  const double step = static_cast<double>(hp.step);
  c.grad_scale = hp.grad_scale;
  c.has_weight_decay = hp.weight_decay != 0.0f;
  c.l2_decay = hp.weight_decay;
  c.param_decay = static_cast<float>(1.0 - lr * wd);
  c.beta1 = hp.beta1;
  c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  c.beta2 = hp.beta2;
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.eps = hp.eps;
  switch (hp.kind) {
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW: {
      const double bias_correction1 = 1.0 - std::pow(beta1, step);
      const double bias_correction2 = 1.0 - std::pow(beta2, step);
      c.neg_step_size = static_cast<float>(-lr / bias_correction1);
      c.inv_bias_correction2_sqrt = static_cast<float>(1.0 / std::sqrt(bias_correction2));
      break;
    }
    case OptimizerKind::kAdagrad:
      c.neg_step_size = static_cast<float>(-lr / (1.0 + (step - 1.0) * hp.lr_decay));
      break;
    case OptimizerKind::kLion:
      c.neg_step_size = static_cast<float>(-lr);
      break;
  }
  return c;
}

StepBuffers BuffersOf(const OptimizerHyperParams& hp, const OptimizerTensors& t) {
  StepBuffers b;
  b.param = t.param;
  b.grad = t.grad;
  b.state1 = hp.kind == OptimizerKind::kAdagrad ? t.sum : t.exp_avg;
  b.state2 = t.exp_avg_sq;
  b.param_copy = t.param_copy;
  b.q1 = t.state1;
  b.q2 = t.state2;
  return b;
}

}  // namespace cpu_adam_internal

Status OptimizerStep(const OptimizerHyperParams& hp, const OptimizerTensors& t, CpuIsa isa) {
  ZINF_ASSIGN_OR_RETURN(CpuIsa chosen, SelectCpuIsa(isa));
  ZINF_RETURN_IF_ERROR(ValidateOptimizerStep(hp, t));
  if (t.n == 0) return Status::OK();
  const KernelTable& table = KernelsFor(BestVariantOf(chosen, DetectCpuFeatures()));
  const StepCoefficients c = cpu_adam_internal::ComputeCoefficients(hp);
  cpu_adam_internal::SelectStepKernel(table, hp, t)(c, cpu_adam_internal::BuffersOf(hp, t), 0, t.n);
  return Status::OK();
}

namespace {

// Binds each arena slot to one PU while a thread occupies it, and restores the thread's
// previous binding when it leaves. Slot s goes to core s % cores (cores first, so two threads
// never share a core while another core is idle), then to that core's next SMT sibling.
class CoreBinder final : public tbb::task_scheduler_observer {
 public:
  CoreBinder(tbb::task_arena& arena, hwloc_topology_t topology, int slots)
      : tbb::task_scheduler_observer(arena), topology_(topology) {
    std::vector<std::vector<hwloc_obj_t>> pus_by_core;
    const int cores = hwloc_get_nbobjs_by_type(topology, HWLOC_OBJ_CORE);
    if (cores > 0) {
      for (int c = 0; c < cores; ++c) {
        hwloc_obj_t core = hwloc_get_obj_by_type(topology, HWLOC_OBJ_CORE, c);
        std::vector<hwloc_obj_t> pus;
        for (hwloc_obj_t pu = nullptr;
             (pu = hwloc_get_next_obj_inside_cpuset_by_type(topology, core->cpuset, HWLOC_OBJ_PU,
                                                            pu)) != nullptr;) {
          pus.push_back(pu);
        }
        if (!pus.empty()) pus_by_core.push_back(std::move(pus));
      }
    }
    if (pus_by_core.empty()) {  // no core level (some VMs): every PU is its own core
      const int n = hwloc_get_nbobjs_by_type(topology, HWLOC_OBJ_PU);
      for (int i = 0; i < n; ++i)
        pus_by_core.push_back({hwloc_get_obj_by_type(topology, HWLOC_OBJ_PU, i)});
    }
    for (int s = 0; s < slots && !pus_by_core.empty(); ++s) {
      const auto& core = pus_by_core[s % pus_by_core.size()];
      const size_t sibling = (s / pus_by_core.size()) % core.size();
      targets_.push_back(hwloc_bitmap_dup(core[sibling]->cpuset));
      saved_.push_back(hwloc_bitmap_alloc());
    }
    observe(true);
  }

  ~CoreBinder() override {
    observe(false);
    for (hwloc_bitmap_t b : targets_) hwloc_bitmap_free(b);
    for (hwloc_bitmap_t b : saved_) hwloc_bitmap_free(b);
  }

  void on_scheduler_entry(bool /*is_worker*/) override {
    const int slot = tbb::this_task_arena::current_thread_index();
    if (slot < 0 || slot >= static_cast<int>(targets_.size())) return;
    if (hwloc_get_cpubind(topology_, saved_[slot], HWLOC_CPUBIND_THREAD) != 0) {
      hwloc_bitmap_zero(saved_[slot]);
    }
    if (hwloc_set_cpubind(topology_, targets_[slot], HWLOC_CPUBIND_THREAD) != 0 &&
        !warned_.exchange(true)) {
      LogWarning(
          "cpu optimizer: binding a thread to a core with hwloc failed; threads run "
          "unbound");
    }
  }

  void on_scheduler_exit(bool /*is_worker*/) override {
    const int slot = tbb::this_task_arena::current_thread_index();
    if (slot < 0 || slot >= static_cast<int>(targets_.size())) return;
    if (!hwloc_bitmap_iszero(saved_[slot])) {
      hwloc_set_cpubind(topology_, saved_[slot], HWLOC_CPUBIND_THREAD);
    }
  }

 private:
  hwloc_topology_t topology_;
  std::vector<hwloc_bitmap_t> targets_;  // per slot; fixed after construction
  std::vector<hwloc_bitmap_t> saved_;    // per slot; touched only by the slot's occupant
  std::atomic<bool> warned_{false};
};

// Elements: one cache line of fp32, two of bf16, and whole blocks of int8 states.
constexpr size_t kTileAlignment = std::max<size_t>(64, kInt8StateBlock);

}  // namespace

struct CpuOptimizer::Impl {
  CpuIsa isa = CpuIsa::kScalar;
  KernelVariant variant = KernelVariant::kScalar;
  const KernelTable* kernels = nullptr;
  int num_threads = 1;
  size_t tile = 0;
  bool bind = false;
  hwloc_topology_t topology = nullptr;
  std::unique_ptr<tbb::task_arena> arena;
  std::unique_ptr<CoreBinder> binder;  // destroyed before the arena and the topology
  std::atomic<uint64_t> cpu_ns{0};     // thread CPU time in parallel loops (cpu_seconds)

  ~Impl() {
    binder.reset();
    arena.reset();
    if (topology != nullptr) hwloc_topology_destroy(topology);
  }

  // Thread t of p gets tiles [tiles * t / p, tiles * (t + 1) / p).
  size_t ChunkBegin(size_t n, size_t tiles, size_t t, size_t p) const {
    return std::min(n, tiles * t / p * tile);
  }
};

CpuOptimizer::CpuOptimizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CpuOptimizer::~CpuOptimizer() = default;

Result<std::unique_ptr<CpuOptimizer>> CpuOptimizer::Create(const Options& options) {
  auto impl = std::make_unique<Impl>();
  ZINF_ASSIGN_OR_RETURN(impl->isa, SelectCpuIsa(options.isa));
  impl->variant = BestVariantOf(impl->isa, DetectCpuFeatures());
  impl->kernels = &KernelsFor(impl->variant);
  if (options.num_threads < 0 || options.num_threads > 4096) {
    return Status::InvalidArgument("cpu optimizer: num_threads must be in [0, 4096] (got " +
                                   std::to_string(options.num_threads) + "); 0 means all CPUs");
  }
  // More threads than CPUs cannot speed up a memory-bound pass; oneTBB would not start them
  // anyway (it caps its workers at the CPU count), so the count is clamped to what runs.
  const int available = std::max(1, tbb::info::default_concurrency());
  impl->num_threads =
      options.num_threads == 0 ? available : std::min(options.num_threads, available);
  const size_t tile = std::max<size_t>(options.tile_elements, 1);
  impl->tile = RoundUp(tile, kTileAlignment);
  impl->bind = options.bind_to_cores;
  impl->arena = std::make_unique<tbb::task_arena>(impl->num_threads, 1);
  impl->arena->initialize();
  if (impl->bind) {
    if (hwloc_topology_init(&impl->topology) != 0 || hwloc_topology_load(impl->topology) != 0) {
      return Status::FailedPrecondition(
          "cpu optimizer: hwloc could not read the CPU topology, so threads cannot be bound to "
          "cores; create the optimizer with bind_to_cores = false");
    }
    impl->binder = std::make_unique<CoreBinder>(*impl->arena, impl->topology, impl->num_threads);
  }
  return std::unique_ptr<CpuOptimizer>(new CpuOptimizer(std::move(impl)));
}

namespace {
uint64_t ThreadCpuNanos() {
  timespec ts{};
  // (CLOCK_THREAD_CPUTIME_ID of the calling thread cannot fail on Linux; 0 if it did.)
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) != 0) return 0;
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000u + static_cast<uint64_t>(ts.tv_nsec);
}
}  // namespace

double CpuOptimizer::cpu_seconds() const {
  return static_cast<double>(impl_->cpu_ns.load(std::memory_order_relaxed)) * 1e-9;
}

void CpuOptimizer::ParallelForImpl(size_t n, void (*fn)(void*, size_t, size_t), void* ctx) {
  if (n == 0) return;
  Impl& im = *impl_;
  const size_t tiles = (n + im.tile - 1) / im.tile;
  const size_t p = std::min<size_t>(static_cast<size_t>(im.num_threads), tiles);
  // Each chunk's thread CPU time (two clock reads per chunk, not per tile).
  auto timed = [&](size_t begin, size_t end) {
    const uint64_t t0 = ThreadCpuNanos();
    fn(ctx, begin, end);
    const uint64_t t1 = ThreadCpuNanos();
    if (t1 > t0) im.cpu_ns.fetch_add(t1 - t0, std::memory_order_relaxed);
  };
  if (p <= 1 && !im.bind) {
    timed(0, n);  // one tile or one thread: no hand-off to the arena
    return;
  }
  im.arena->execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<size_t>(0, p, 1),
        [&](const tbb::blocked_range<size_t>& r) {
          for (size_t t = r.begin(); t != r.end(); ++t) {
            const size_t begin = im.ChunkBegin(n, tiles, t, p);
            const size_t end = im.ChunkBegin(n, tiles, t + 1, p);
            if (begin < end) timed(begin, end);
          }
        },
        tbb::static_partitioner());
  });
}

namespace {
// A validated step's kernel and its arguments.
struct PreparedStep {
  StepCoefficients c;
  StepBuffers b;
  cpu_adam_internal::StepKernelFn kernel;
};
PreparedStep Prepare(const cpu_adam_internal::KernelTable& kernels, const OptimizerHyperParams& hp,
                     const OptimizerTensors& t) {
  return {cpu_adam_internal::ComputeCoefficients(hp), cpu_adam_internal::BuffersOf(hp, t),
          cpu_adam_internal::SelectStepKernel(kernels, hp, t)};
}
}  // namespace

Status CpuOptimizer::Step(const OptimizerHyperParams& hp, const OptimizerTensors& t) {
  ZINF_RETURN_IF_ERROR(ValidateOptimizerStep(hp, t));
  if (t.n == 0) return Status::OK();
  const PreparedStep s = Prepare(*impl_->kernels, hp, t);
  ParallelFor(t.n, [&](size_t begin, size_t end) { s.kernel(s.c, s.b, begin, end); });
  return Status::OK();
}

Status CpuOptimizer::StepIfFinite(const OptimizerHyperParams& hp, const OptimizerTensors& t,
                                  bool* non_finite,
                                  const std::function<void(size_t, size_t)>& before_tile) {
  *non_finite = false;
  ZINF_RETURN_IF_ERROR(ValidateOptimizerStep(hp, t));
  if (t.n == 0) return Status::OK();
  const PreparedStep s = Prepare(*impl_->kernels, hp, t);
  const cpu_adam_internal::AllFiniteFn all_finite =
      impl_->kernels->all_finite[static_cast<int>(t.grad_type)];
  const size_t tile = impl_->tile;
  std::atomic<bool> seen{false};
  // Chunks start on tile boundaries, so these tiles are Step's tiles and its element order.
  ParallelFor(t.n, [&](size_t begin, size_t end) {
    for (size_t tb = begin; tb < end; tb += tile) {
      if (seen.load(std::memory_order_relaxed)) return;
      const size_t te = std::min(end, tb + tile);
      if (!all_finite(t.grad, tb, te)) {
        seen.store(true, std::memory_order_relaxed);
        return;
      }
      if (before_tile) before_tile(tb, te);
      s.kernel(s.c, s.b, tb, te);
    }
  });
  *non_finite = seen.load(std::memory_order_relaxed);
  return Status::OK();
}

Result<GradStats> CpuOptimizer::GradSumSquares(const void* grad, GradType type, size_t n) {
  if (type != GradType::kF32 && type != GradType::kBf16 && type != GradType::kF16) {
    return Status::InvalidArgument("gradient sum of squares: unknown gradient type");
  }
  ZINF_RETURN_IF_ERROR(CheckStreamLength("gradient sum of squares", n));
  if (n == 0) return GradStats{};
  if (grad == nullptr) {
    return Status::InvalidArgument("gradient sum of squares: grad is NULL but n > 0");
  }
  const Impl& im = *impl_;
  const cpu_adam_internal::SumSquaresFn kernel = im.kernels->sum_squares[static_cast<int>(type)];
  const size_t tile = im.tile;
  const size_t tiles = (n + tile - 1) / tile;
  // One leaf per tile and a split tree fixed by the tile count: the same additions in the same
  // order whatever the number of threads (parallel_deterministic_reduce's guarantee).
  GradStats result;
  im.arena->execute([&] {
    result = tbb::parallel_deterministic_reduce(
        tbb::blocked_range<size_t>(0, tiles, 1), GradStats{},
        [&](const tbb::blocked_range<size_t>& r, GradStats acc) {
          for (size_t k = r.begin(); k != r.end(); ++k) {
            double sum = 0.0;
            bool inf_or_nan = false;
            kernel(grad, k * tile, std::min(n, (k + 1) * tile), &sum, &inf_or_nan);
            acc.sum_squares += sum;
            acc.has_inf_or_nan = acc.has_inf_or_nan || inf_or_nan;
          }
          return acc;
        },
        [](GradStats a, const GradStats& b) {
          a.sum_squares += b.sum_squares;
          a.has_inf_or_nan = a.has_inf_or_nan || b.has_inf_or_nan;
          return a;
        },
        tbb::simple_partitioner());
  });
  return result;
}

Status CpuOptimizer::ConvertParams(const float* src, void* dst, ParamCopyType type, size_t n) {
  if (type != ParamCopyType::kBf16 && type != ParamCopyType::kF16) {
    return Status::InvalidArgument("parameter conversion: the target type must be bf16 or f16");
  }
  ZINF_RETURN_IF_ERROR(CheckStreamLength("parameter conversion", n));
  if (n == 0) return Status::OK();
  const NamedBuffer buffers[2] = {{"src", src, n * 4}, {"dst", dst, n * 2}};
  ZINF_RETURN_IF_ERROR(CheckBuffers("parameter conversion", buffers, 2));
  const cpu_adam_internal::ConvertFn kernel = impl_->kernels->convert[static_cast<int>(type)];
  ParallelFor(n, [&](size_t begin, size_t end) { kernel(src, dst, begin, end); });
  return Status::OK();
}

CpuIsa CpuOptimizer::isa() const { return impl_->isa; }
const char* CpuOptimizer::kernel_name() const { return KernelVariantName(impl_->variant); }
int CpuOptimizer::num_threads() const { return impl_->num_threads; }
size_t CpuOptimizer::tile_elements() const { return impl_->tile; }
bool CpuOptimizer::bound_to_cores() const { return impl_->bind; }

}  // namespace zinf
