// CPU optimizers: Adam (L2), AdamW (decoupled decay), Adagrad and Lion over fp32 master
// parameters and states, one fused pass over memory per step.
//
// The kernels take pointers and lengths only (no torch or engine types). Each step reads the
// gradient (fp32, bf16 or fp16), updates the fp32 parameters and states in place, and can
// write a bf16 or fp16 copy of the updated parameters (the copy the GPU needs) in the same
// pass, so the mixed-precision path moves fewer bytes than an fp32 step plus a conversion.
//
// Cost, per element and step, is the bytes moved: fp32 AdamW reads and writes 28 bytes and
// runs at the memory bandwidth (bench/RESULTS.md). The scalar reference is ~20x slower; it is
// the fallback only for CPUs without AVX2.
//
// Every SIMD variant (AVX2+FMA+F16C, AVX-512, AVX-512 with avx512_bf16) performs the same
// sequence of correctly rounded IEEE operations as the scalar reference, so their results are
// bit-identical to it (NaN payloads aside: a NaN stays a NaN, its payload may differ).
// The variant is chosen at run time from CPUID and XGETBV, never from the build machine; the
// environment variable ZINF_CPU_ISA=scalar|avx2|avx512 forces one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include "zinf/status.h"

namespace zinf {

// ---- Instruction sets ----------------------------------------------------------------------

enum class CpuIsa {
  kScalar,  // any x86-64: the reference implementation
  kAvx2,    // AVX2 + FMA + F16C
  kAvx512,  // AVX-512F (+ avx512_bf16 conversions where the CPU has them)
};

// What this CPU and OS support. "os_*" say whether the OS saves the register state (XGETBV):
// a CPU flag without OS support cannot be used.
struct CpuFeatures {
  bool avx = false;
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512dq = false;
  bool avx512_bf16 = false;
  bool os_avx = false;     // XCR0 has SSE and AVX state
  bool os_avx512 = false;  // XCR0 has opmask and ZMM state
};

// Reads CPUID and XGETBV once per process (thread-safe).
const CpuFeatures& DetectCpuFeatures();

// Whether `isa` can run on a machine with `features`.
bool CpuIsaSupported(CpuIsa isa, const CpuFeatures& features);
bool CpuIsaSupported(CpuIsa isa);

// The widest supported instruction set.
CpuIsa BestCpuIsa();

// "scalar", "avx2" or "avx512".
const char* CpuIsaName(CpuIsa isa);

// Parses "scalar", "avx2", "avx512" (case-sensitive). InvalidArgument otherwise.
Result<CpuIsa> ParseCpuIsa(std::string_view name);

// The instruction set to use: `requested` when given, else ZINF_CPU_ISA when set and not
// "auto", else BestCpuIsa(). NotSupported when the requested or forced set cannot run here
// (the message names the missing CPU feature); InvalidArgument for an unknown ZINF_CPU_ISA.
Result<CpuIsa> SelectCpuIsa(std::optional<CpuIsa> requested = std::nullopt);

// ---- One optimizer step --------------------------------------------------------------------

enum class OptimizerKind {
  kAdam,     // torch.optim.Adam (amsgrad=False): weight decay added to the gradient (L2)
  kAdamW,    // torch.optim.AdamW (amsgrad=False): param *= 1 - lr * weight_decay first
  kAdagrad,  // torch.optim.Adagrad: L2 weight decay, lr / (1 + (step - 1) * lr_decay)
  kLion,     // Lion (Chen et al. 2023): sign update, decoupled weight decay
};

enum class GradType { kF32, kBf16, kF16 };
enum class ParamCopyType { kNone, kBf16, kF16 };

// How the optimizer states (Adam's two moments, Lion's momentum, Adagrad's sum) are stored
// between steps. A step decodes them, updates them and the parameters in fp32 (the parameter
// update uses the fp32 values), and stores them encoded again, in the same pass.
enum class StateType {
  kF32,   // fp32: 4 bytes per element and state
  kBf16,  // bf16, rounded to nearest even (Fp32ToBf16): 2 bytes
  kInt8,  // blockwise 8-bit (Adam, AdamW, Lion; Adagrad refuses it): 1 byte plus one fp32
          // scale per kInt8StateBlock elements. Each block stores codes of a small float
          // format scaled so that the block's largest magnitude is the largest code: the first
          // moment as sign + 4 exponent bits + 3 mantissa bits, the second (never negative) as
          // 4 exponent + 4 mantissa bits, rounded to nearest even, except that a positive
          // second moment never rounds to zero (it takes the smallest code: a zero there would
          // divide the first moment by eps alone). Dynamic range: 2^17 below the block's
          // largest magnitude (first moment), 2^18 (second); relative precision 1/16 and 1/32.
          // Non-finite values are not representable: a NaN stores as the block's largest
          // magnitude and an infinity saturates to FLT_MAX, so a scale is never NaN or
          // infinite; a block whose largest magnitude is below FLT_MIN stores as zeros.
          // bench/RESULTS.md ("Compressed optimizer states") records why this map and block.
};
inline constexpr size_t kInt8StateBlock = 256;

// "fp32", "bf16", "int8". (Inline, as ParseStateType and StateBytes: the checkpoint format
// uses them without the optimizer library.)
inline const char* StateTypeName(StateType type) {
  switch (type) {
    case StateType::kF32:
      return "fp32";
    case StateType::kBf16:
      return "bf16";
    case StateType::kInt8:
      return "int8";
  }
  return "unknown";
}
// Parses "fp32", "bf16", "int8". InvalidArgument otherwise.
inline Result<StateType> ParseStateType(std::string_view name) {
  if (name == "fp32") return StateType::kF32;
  if (name == "bf16") return StateType::kBf16;
  if (name == "int8") return StateType::kInt8;
  return Status::InvalidArgument("unknown optimizer state type \"" + std::string(name) +
                                 "\"; expected fp32, bf16 or int8");
}
// Which state a buffer holds: a first moment (exp_avg, Lion's momentum: signed) or a value
// that is never negative (exp_avg_sq, Adagrad's sum). Their int8 codes differ.
enum class StateRole { kSigned, kNonNegative };

// Converts one optimizer state of n elements (a buffer of its own, StateBytes(from, n) bytes)
// to StateBytes(to, n) bytes of `to`: decoded to fp32 and encoded again exactly as a step
// decodes and stores states, so that loading a checkpoint of another state dtype continues
// as if the states had been converted at the step. The buffers must not overlap; int8 ones
// 4-byte aligned. InvalidArgument otherwise.
Status ConvertOptimizerState(StateType from, const void* src, StateType to, void* dst, size_t n,
                             StateRole role);

// Bytes one state of n elements takes in `type`. int8: ceil(n / kInt8StateBlock) blocks of
// kInt8StateBlock codes, each followed by its fp32 scale (the last block padded to full size),
// so that a block's codes and scale are read and written together.
inline size_t StateBytes(StateType type, size_t n) {
  switch (type) {
    case StateType::kF32:
      return n * sizeof(float);
    case StateType::kBf16:
      return n * sizeof(uint16_t);
    case StateType::kInt8:
      return (n + kInt8StateBlock - 1) / kInt8StateBlock * (kInt8StateBlock + sizeof(float));
  }
  return 0;
}

const char* OptimizerKindName(OptimizerKind kind);  // "adam", "adamw", "adagrad", "lion"
const char* GradTypeName(GradType type);            // "f32", "bf16", "f16"
const char* ParamCopyTypeName(ParamCopyType type);  // "none", "bf16", "f16"

// Bytes per element of each type (kNone: 0).
size_t GradTypeSize(GradType type);
size_t ParamCopyTypeSize(ParamCopyType type);

// Hyper-parameters of one step. The defaults are torch's for Adam/AdamW; Adagrad uses lr,
// lr_decay, eps (torch's default 1e-10), weight_decay; Lion uses lr, beta1, beta2
// (0.9 / 0.99 in the paper) and weight_decay.
struct OptimizerHyperParams {
  OptimizerKind kind = OptimizerKind::kAdamW;
  // 1-based count of steps taken including this one (torch's state["step"] after += 1).
  int64_t step = 1;
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  float lr_decay = 0.0f;  // Adagrad only
  // Every gradient element is multiplied by this before use (1 / loss_scale, or a clipping
  // coefficient), in the same pass.
  float grad_scale = 1.0f;
};

// The buffers of one step, each of n elements. The fp32 buffers are updated in place.
// REQUIRES: the buffers do not overlap one another (checked). No alignment is required;
// 64-byte alignment is fastest.
struct OptimizerTensors {
  float* param = nullptr;      // fp32 master parameters (read, written)
  const void* grad = nullptr;  // gradients, of grad_type (read)
  GradType grad_type = GradType::kF32;
  float* exp_avg = nullptr;     // Adam, AdamW, Lion: first moment (read, written)
  float* exp_avg_sq = nullptr;  // Adam, AdamW: second moment (read, written)
  float* sum = nullptr;         // Adagrad: sum of squared gradients (torch's state_sum;
                                // initialise it with initial_accumulator_value)
  void* param_copy = nullptr;   // when param_copy_type != kNone: the updated parameters
                                // rounded to nearest-even bf16 or fp16 (written only; with
                                // non-temporal stores when 64-byte aligned, so the copy is
                                // not left in the CPU caches: it is meant for a DMA engine)
  ParamCopyType param_copy_type = ParamCopyType::kNone;
  size_t n = 0;
  // When state_type != kF32 the states are not in exp_avg / exp_avg_sq / sum (which must then
  // be null) but in state1 (exp_avg, or Adagrad's sum) and state2 (exp_avg_sq), each
  // StateBytes(state_type, n) bytes (int8: 4-byte aligned). Zero bytes are a zero state in
  // every type.
  StateType state_type = StateType::kF32;
  void* state1 = nullptr;
  void* state2 = nullptr;
};

// Checks every argument of a step: pointers (non-null when n > 0, non-overlapping), step >= 1,
// finite hyper-parameters, lr >= 0, eps >= 0, weight_decay >= 0, grad_scale > 0,
// betas in [0, 1) (Lion: [0, 1]), lr_decay >= 0. InvalidArgument naming the bad one.
Status ValidateOptimizerStep(const OptimizerHyperParams& hp, const OptimizerTensors& t);

// Elements [begin, end) of a step's tensors, as a step of its own: every buffer advanced by
// `begin` elements of its type. Stepping the slices of [0, n) one after another updates every
// element as one step over [0, n) does, bit for bit (each element's update depends on its own
// values only). InvalidArgument when begin > end, end > t.n, or (int8 states) begin is not a
// multiple of kInt8StateBlock, where a slice must start on a block of its own.
Result<OptimizerTensors> SliceOptimizerTensors(const OptimizerTensors& t, size_t begin, size_t end);

// One step over all n elements on the calling thread with the given instruction set.
// NotSupported when `isa` cannot run here.
Status OptimizerStep(const OptimizerHyperParams& hp, const OptimizerTensors& t, CpuIsa isa);

// Bit conversions used by the kernels, exposed for callers and tests.
// fp32 -> bf16 is round-to-nearest-even with fp32 subnormals flushed to signed zero (what
// VCVTNEPS2BF16 does); a NaN stays a quiet NaN. fp32 -> fp16 is IEEE round-to-nearest-even
// (what VCVTPS2PH does), with fp16 subnormals.
uint16_t Fp32ToBf16(float value);
float Bf16ToFp32(uint16_t value);
uint16_t Fp32ToFp16(float value);
float Fp16ToFp32(uint16_t value);
// A stored 16-bit parameter (ParamCopyType kBf16 or kF16) as fp32, and an fp32 value rounded
// to it as the step's param_copy rounds (kNone is not a 16-bit type: NaN / 0xFFFF).
float ParamCopyToFp32(ParamCopyType type, uint16_t value);
uint16_t Fp32ToParamCopy(ParamCopyType type, float value);

// memcpy with non-temporal stores (SSE2): past an unaligned head of under 16 bytes and up to a
// tail of under 64, the copy neither reads the destination's cache lines first nor leaves them
// in the cache (for copies read back rarely, such as the pre-step snapshot of a speculative
// step). The stores are fenced before it returns. Without SSE2, memcpy.
void StreamCopy(void* dst, const void* src, size_t bytes);

// Frozen weights stored as linear blockwise int8 (zinf.frozen_weight_dtype "int8"), in
// StateBytes(StateType::kInt8, n) bytes: per block of kInt8StateBlock elements, the codes
// round(x / scale) (nearest even, in -127..127), then the fp32 scale = the block's largest
// magnitude / 127. A value decodes to code * scale, so its error is at most scale / 2 (the
// block's largest magnitude / 254); a block whose largest magnitude is below 127 x FLT_MIN
// stores as zeros. InvalidArgument for an inf or NaN. `dst` 4-byte aligned.
Status QuantizeWeightsInt8(const float* src, size_t n, void* dst);
// Decodes into fp32, or into bf16 (the fp32 value rounded as Fp32ToBf16 rounds). `block`: the
// elements per block, kInt8StateBlock for stored weights (see QuantBlockValid).
void DequantizeWeightsInt8(const void* src, size_t n, float* dst, size_t block = kInt8StateBlock);
void DequantizeWeightsInt8Bf16(const void* src, size_t n, uint16_t* dst,
                               size_t block = kInt8StateBlock);
// Into fp16: the fp32 value rounded as Fp32ToFp16 rounds.
void DequantizeWeightsInt8F16(const void* src, size_t n, uint16_t* dst,
                              size_t block = kInt8StateBlock);

// The block sizes of the quantized collectives (zinf.quantization_block_size; the stored
// formats keep kInt8StateBlock): powers of two from kMinQuantBlock to kMaxQuantBlock (a GPU
// encodes a block with one thread per value). The functions below that take a `block` stop the
// process (ZINF_CHECK) on any other: callers check first. Int8Bytes: the int8 layout's bytes for n
// values in blocks of `block` (StateBytes(kInt8, n) at kInt8StateBlock).
inline constexpr size_t kMinQuantBlock = 64;
inline constexpr size_t kMaxQuantBlock = 1024;
inline bool QuantBlockValid(size_t block) {
  return block >= kMinQuantBlock && block <= kMaxQuantBlock && (block & (block - 1)) == 0;
}
inline size_t Int8Bytes(size_t n, size_t block) {
  return (n + block - 1) / block * (block + sizeof(float));
}
// What every device's quantization call checks first (InvalidArgument naming `what`): the int8
// or int4 side, whose fp32 scales a GPU reads as words, 4-byte aligned; a valid block size.
inline Status CheckQuantBlocks(const char* what, const void* blocks, size_t block) {
  if (reinterpret_cast<uintptr_t>(blocks) % 4 != 0) {
    return Status::InvalidArgument(std::string(what) +
                                   ": the int8 or int4 blocks are not 4-byte aligned");
  }
  if (!QuantBlockValid(block)) {
    return Status::InvalidArgument(std::string(what) + ": a block of " + std::to_string(block) +
                                   " values; use a power of two from " +
                                   std::to_string(kMinQuantBlock) + " to " +
                                   std::to_string(kMaxQuantBlock));
  }
  return Status::OK();
}

// The quantized parameter gather (zero_quantized_weights, ZeRO++'s qwZ) in the same layout:
// `n` parameters of `type` (kNone: fp32; kBf16 and kF16 read as their own bits) encoded as
// QuantizeWeightsInt8 encodes fp32 (the 16-bit values widened exactly first). It never fails:
// a block holding an inf or a NaN stores zero codes and a NaN scale, so all of it decodes to
// NaN (a non-finite weight never comes back finite). DequantizeParamsInt8 decodes into `type`
// (DequantizeWeightsInt8, ...Bf16 or ...F16). Blocks of `block` elements (QuantBlockValid), in
// Int8Bytes(n, block) bytes.
void QuantizeParamsInt8(const void* src, ParamCopyType type, size_t n, void* dst,
                        size_t block = kInt8StateBlock);
void DequantizeParamsInt8(const void* src, size_t n, ParamCopyType type, void* dst,
                          size_t block = kInt8StateBlock);

// Gradients as blockwise int4 (zero_quantized_gradients with zinf.quantized_gradient_bits 4):
// per block of `block` fp32 values (default kInt8StateBlock), block / 2 bytes of codes round(x /
// scale) (nearest even, in -7..7), two per byte (element 2i in the low nibble, 2i + 1 in the
// high; two's complement), then the fp32 scale = the block's largest magnitude / 7. A value
// decodes to code * scale, off by at most the block's largest magnitude / 14. As the int8
// encoding: a block holding an inf or a NaN stores zero codes and a NaN scale (it decodes to
// NaN), a block below 7 x FLT_MIN stores zeros; the last block is padded to full size. Blocks
// of `block` values (QuantBlockValid; kInt4BlockBytes at the default) in Int4Bytes(n, block).
inline constexpr size_t kInt4BlockBytes = kInt8StateBlock / 2 + sizeof(float);
inline size_t Int4Bytes(size_t n, size_t block = kInt8StateBlock) {
  return (n + block - 1) / block * (block / 2 + sizeof(float));
}
void QuantizeGradsInt4(const float* src, size_t n, void* dst, size_t block = kInt8StateBlock);
void DequantizeGradsInt4(const void* src, size_t n, float* dst, size_t block = kInt8StateBlock);

// Sum of squares of a gradient buffer (accumulated in double) and whether it holds an inf or
// a NaN: the inputs of gradient-norm clipping and of the fp16 overflow check, in one pass.
struct GradStats {
  double sum_squares = 0.0;
  bool has_inf_or_nan = false;
};

// ---- The parallel driver -------------------------------------------------------------------

// Runs optimizer steps and gradient reductions on a oneTBB arena of its own.
//
// Work is split statically: [0, n) is cut into tiles of tile_elements (a multiple of 256
// elements, so no two threads write the same cache line), and each thread takes one
// contiguous run of tiles. The step allocates nothing (oneTBB's task objects come from its
// per-thread pools). Element-wise results do not depend on the thread count; GradSumSquares
// adds per-tile sums in a fixed tree, so it is also identical for any thread count.
//
// Thread-safe: several threads may call Step concurrently (they share the arena's threads).
class CpuOptimizer {
 public:
  struct Options {
    // Threads in the arena, the calling thread included, at most the CPUs this process may
    // run on (a larger count is clamped to that). 0: all of those CPUs.
    int num_threads = 0;
    // Bind each arena thread to its own core with hwloc while it works for this optimizer
    // (cores first, then their SMT siblings); the previous binding is restored when a thread
    // leaves the arena.
    bool bind_to_cores = false;
    // Elements per tile; rounded up to a multiple of 256 (whole int8 state blocks).
    size_t tile_elements = size_t{1} << 16;
    // Instruction set; nullopt: SelectCpuIsa() (ZINF_CPU_ISA or the best one).
    std::optional<CpuIsa> isa;
  };

  // Fails on an unsupported or unknown ISA (see SelectCpuIsa), num_threads < 0, or when
  // bind_to_cores is asked and hwloc cannot read the topology.
  static Result<std::unique_ptr<CpuOptimizer>> Create(const Options& options);
  static Result<std::unique_ptr<CpuOptimizer>> Create() { return Create(Options()); }
  ~CpuOptimizer();

  CpuOptimizer(const CpuOptimizer&) = delete;
  CpuOptimizer& operator=(const CpuOptimizer&) = delete;

  // One step over all n elements (see ValidateOptimizerStep for the contract).
  Status Step(const OptimizerHyperParams& hp, const OptimizerTensors& t);

  // Step with the gradients checked for inf and NaN on the way: each tile's gradients are
  // checked just before the tile is stepped, while they are in cache, so the check costs no
  // memory pass of its own. A tile that holds one is not stepped, and neither is any tile not
  // yet begun once one has been seen. *non_finite tells whether one was: the buffers are then
  // updated in some tiles only (none with a value computed from a non-finite gradient), and the
  // caller must not publish them. Without one, the result is Step's, bit for bit.
  // `before_tile`, when set, is called on the stepping thread with each tile's [begin, end)
  // once its gradients are checked and just before it is stepped: a caller keeps what the step
  // is about to overwrite (and its reads bring the tile into cache for the step).
  Status StepIfFinite(const OptimizerHyperParams& hp, const OptimizerTensors& t, bool* non_finite,
                      const std::function<void(size_t begin, size_t end)>& before_tile = nullptr);

  // The sum of squares and the inf/NaN flag of n gradient elements.
  Result<GradStats> GradSumSquares(const void* grad, GradType type, size_t n);

  // Writes n fp32 values as bf16 or fp16 (same rounding as the step's param_copy): the
  // separate conversion pass a non-fused pipeline needs.
  Status ConvertParams(const float* src, void* dst, ParamCopyType type, size_t n);

  // Calls fn(begin, end) over the same static tile partition that Step uses, on the arena's
  // threads; returns when all calls have returned. fn must not throw.
  template <typename Fn>
  void ParallelFor(size_t n, Fn&& fn) {
    using F = std::remove_reference_t<Fn>;
    ParallelForImpl(
        n, [](void* ctx, size_t b, size_t e) { (*static_cast<F*>(ctx))(b, e); },
        const_cast<void*>(static_cast<const void*>(&fn)));
  }

  // CPU seconds spent so far in this optimizer's parallel loops (Step, StepIfFinite,
  // ConvertParams, ParallelFor), summed over the threads that ran them (thread CPU time, so a
  // thread that waits for memory counts and one that is descheduled does not).
  double cpu_seconds() const;

  CpuIsa isa() const;
  // The kernel variant in use: "scalar", "avx2", "avx512" or "avx512_bf16".
  const char* kernel_name() const;
  int num_threads() const;
  size_t tile_elements() const;
  bool bound_to_cores() const;

 private:
  struct Impl;
  explicit CpuOptimizer(std::unique_ptr<Impl> impl);
  void ParallelForImpl(size_t n, void (*fn)(void*, size_t, size_t), void* ctx);

  std::unique_ptr<Impl> impl_;
};

}  // namespace zinf
