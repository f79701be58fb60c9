// zinf-adam-bench: the CPU optimizer step against the memory roofline measured in the same run.
//
// For every case (optimizer x gradient type x parameter-copy type x ISA x thread count) it
// times the step and a roofline kernel with Adam's access pattern (4 fp32 streams read, 3
// written: the least work that moves Adam's bytes) over the same n, threads and static tile
// partition, interleaved repeat by repeat, and prints one JSON line with the medians.
//
// Bytes counted per element ("bytes_per_elem"): what the step must read plus what it must
// write, for its dtypes: the fp32 parameter read and written (8), the gradient read (4 or 2),
// each fp32 state read and written (8 each: two for Adam/AdamW, one for Adagrad/Lion), and the
// parameter copy written (0 or 2). fp32 AdamW: 28 B; bf16 gradients + bf16 copy: 28 B as
// well (2 fewer read, 2 more written). The write-allocate read of the copy buffer (a store
// to a line not yet in cache first reads it) is real traffic but not counted, as in STREAM.
// The roofline kernel moves 28 B per element, so for fp32 AdamW roofline_ratio is simply the
// ratio of the two times.
//
// --state-dtype fp32,bf16,int8 times the step with its states stored in each type (zinf/
// cpu_adam.h StateType), interleaved repeat by repeat with the roofline, and counts each
// state's bytes as stored: 2 B per element read and written for bf16, 1 + 4/256 B for int8
// (codes and block scales). Each compressed line also gives "ns_vs_fp32": its median time per
// element over fp32 states' in the same run (when fp32 is in the list).
//
// --compare-unfused also times, per thread count, the fused mixed-precision step (bf16
// gradients in, bf16 parameter copy out, one pass) against the same optimizer with fp32
// gradients followed by a separate fp32 -> bf16 conversion pass (two passes), and prints
// {"fused_speedup": unfused time / fused time}. The separate pass is zinf's own
// CpuOptimizer::ConvertParams, the strongest one available (non-temporal stores, which skip
// the write-allocate read of the destination). Also printed: the same against bf16 gradients
// + a separate pass ("fused_speedup_vs_bf16_grads_unfused"), and against a conversion with
// ordinary stores as a plain loop would write it ("fused_speedup_vs_plain_store_convert";
// CPUs with avx512_bf16 only).
#include <immintrin.h>
#include <sys/mman.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "common/cli.h"
#include "zinf/align.h"
#include "zinf/cpu_adam.h"

namespace zinf {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

using bench::Median;

// One 2 MiB-aligned block per buffer, transparent huge pages requested, so the pass is not
// paying TLB misses (and a fresh 4 KiB page costs ~12 us to fault in on this VM).
class HugeBuffer {
 public:
  explicit HugeBuffer(size_t bytes) {
    constexpr size_t kHuge = size_t{2} << 20;
    bytes_ = std::max(kHuge, RoundUp(bytes, kHuge));
    ptr_ = std::aligned_alloc(kHuge, bytes_);
    if (ptr_ == nullptr) {
      std::fprintf(stderr, "zinf-adam-bench: cannot allocate %zu bytes\n", bytes_);
      std::exit(1);
    }
    madvise(ptr_, bytes_, MADV_HUGEPAGE);  // a hint: failure only costs speed
  }
  ~HugeBuffer() { std::free(ptr_); }
  HugeBuffer(const HugeBuffer&) = delete;
  HugeBuffer& operator=(const HugeBuffer&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// The roofline kernel: Adam's streams (p, g, m, v read; p, m, v written) with one FMA each,
// and the same software prefetch as the optimizer kernels (256 elements ahead, one per line
// per stream), so the peer is as tight as the kernel it measures. 0.5 keeps the values
// bounded over many repeats.
constexpr size_t kRooflinePrefetch = 256;

__attribute__((target("avx512f"))) void RooflineAvx512(float* p, const float* g, float* m, float* v,
                                                       size_t b, size_t e) {
  const __m512 half = _mm512_set1_ps(0.5f);
  size_t i = b;
  for (; i + 16 <= e; i += 16) {
    if (i + kRooflinePrefetch + 16 <= e) {
      __builtin_prefetch(p + i + kRooflinePrefetch, 1, 3);
      __builtin_prefetch(m + i + kRooflinePrefetch, 1, 3);
      __builtin_prefetch(v + i + kRooflinePrefetch, 1, 3);
      __builtin_prefetch(g + i + kRooflinePrefetch, 0, 3);
    }
    const __m512 gv = _mm512_loadu_ps(g + i);
    _mm512_storeu_ps(m + i, _mm512_fmadd_ps(_mm512_loadu_ps(m + i), half, gv));
    _mm512_storeu_ps(v + i, _mm512_fmadd_ps(_mm512_loadu_ps(v + i), half, gv));
    _mm512_storeu_ps(p + i, _mm512_fmadd_ps(_mm512_loadu_ps(p + i), half, gv));
  }
  for (; i < e; ++i) {
    m[i] = m[i] * 0.5f + g[i];
    v[i] = v[i] * 0.5f + g[i];
    p[i] = p[i] * 0.5f + g[i];
  }
}

__attribute__((target("avx2,fma"))) void RooflineAvx2(float* p, const float* g, float* m, float* v,
                                                      size_t b, size_t e) {
  const __m256 half = _mm256_set1_ps(0.5f);
  size_t i = b;
  for (; i + 16 <= e; i += 16) {
    if (i + kRooflinePrefetch + 16 <= e) {
      __builtin_prefetch(p + i + kRooflinePrefetch, 1, 3);
      __builtin_prefetch(m + i + kRooflinePrefetch, 1, 3);
      __builtin_prefetch(v + i + kRooflinePrefetch, 1, 3);
      __builtin_prefetch(g + i + kRooflinePrefetch, 0, 3);
    }
    for (size_t j = i; j < i + 16; j += 8) {
      const __m256 gv = _mm256_loadu_ps(g + j);
      _mm256_storeu_ps(m + j, _mm256_fmadd_ps(_mm256_loadu_ps(m + j), half, gv));
      _mm256_storeu_ps(v + j, _mm256_fmadd_ps(_mm256_loadu_ps(v + j), half, gv));
      _mm256_storeu_ps(p + j, _mm256_fmadd_ps(_mm256_loadu_ps(p + j), half, gv));
    }
  }
  for (; i < e; ++i) {
    m[i] = m[i] * 0.5f + g[i];
    v[i] = v[i] * 0.5f + g[i];
    p[i] = p[i] * 0.5f + g[i];
  }
}

void RooflineScalar(float* p, const float* g, float* m, float* v, size_t b, size_t e) {
  for (size_t i = b; i < e; ++i) {
    m[i] = m[i] * 0.5f + g[i];
    v[i] = v[i] * 0.5f + g[i];
    p[i] = p[i] * 0.5f + g[i];
  }
}

// A conversion pass as a straightforward implementation writes it (ordinary stores, as
// torch's copy_ does): the second, weaker baseline of --compare-unfused. Needs avx512_bf16.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void ConvertPlainAvx512Bf16(const float* src,
                                                                                   uint16_t* dst,
                                                                                   size_t b,
                                                                                   size_t e) {
  size_t i = b;
  for (; i + 16 <= e; i += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
  }
  for (; i < e; ++i) dst[i] = Fp32ToBf16(src[i]);
}

using RooflineFn = void (*)(float*, const float*, float*, float*, size_t, size_t);

RooflineFn BestRoofline() {
  if (CpuIsaSupported(CpuIsa::kAvx512)) return RooflineAvx512;
  if (CpuIsaSupported(CpuIsa::kAvx2)) return RooflineAvx2;
  return RooflineScalar;
}

double StepBytesPerElement(OptimizerKind kind, GradType grad, ParamCopyType copy, StateType state,
                           size_t n) {
  const size_t states = kind == OptimizerKind::kAdam || kind == OptimizerKind::kAdamW ? 2 : 1;
  const double state_bytes = static_cast<double>(StateBytes(state, n)) / static_cast<double>(n);
  return 8.0 + static_cast<double>(GradTypeSize(grad) + ParamCopyTypeSize(copy)) +
         2.0 * state_bytes * static_cast<double>(states);
}
constexpr size_t kRooflineBytesPerElement = 28;

struct Buffers {
  explicit Buffers(size_t n)
      : n(n),
        param(4 * n),
        grad32(4 * n),
        grad16(2 * n),
        m(4 * n),
        v(4 * n),
        copy(2 * n),
        m16(StateBytes(StateType::kBf16, n)),
        v16(StateBytes(StateType::kBf16, n)),
        m8(StateBytes(StateType::kInt8, n)),
        v8(StateBytes(StateType::kInt8, n)) {}
  size_t n;
  // Each state type has buffers of its own: interleaved steps never decode another type's
  // bytes.
  HugeBuffer param, grad32, grad16, m, v, copy, m16, v16, m8, v8;
};

// Fills every buffer through the optimizer's own partition, so each page is faulted in (by
// the thread that will later stream it) before anything is timed.
void Touch(CpuOptimizer& opt, Buffers& b) {
  opt.ParallelFor(b.n, [&](size_t begin, size_t end) {
    float* p = b.param.as<float>();
    float* g = b.grad32.as<float>();
    uint16_t* g16 = b.grad16.as<uint16_t>();
    float* m = b.m.as<float>();
    float* v = b.v.as<float>();
    uint16_t* c = b.copy.as<uint16_t>();
    for (size_t i = begin; i < end; ++i) {
      const float x = static_cast<float>((i * 2654435761u) % 1000003) / 1000003.0f;  // [0, 1)
      p[i] = x - 0.5f;
      g[i] = (x - 0.5f) * 1e-3f;
      g16[i] = Fp32ToBf16(g[i]);
      m[i] = g[i] * 0.1f;
      v[i] = g[i] * g[i];
      c[i] = 0;
    }
  });
  // Compressed states start at zero (all-zero bytes), the first steps fill them.
  for (HugeBuffer* q : {&b.m16, &b.v16}) {
    std::memset(q->as<uint8_t>(), 0, StateBytes(StateType::kBf16, b.n));
  }
  for (HugeBuffer* q : {&b.m8, &b.v8}) {
    std::memset(q->as<uint8_t>(), 0, StateBytes(StateType::kInt8, b.n));
  }
}

OptimizerHyperParams HyperParams(OptimizerKind kind, int64_t step) {
  OptimizerHyperParams hp;
  hp.kind = kind;
  hp.step = step;
  hp.weight_decay = 0.01f;
  if (kind == OptimizerKind::kAdagrad) hp.eps = 1e-10f;
  if (kind == OptimizerKind::kLion) {
    hp.lr = 1e-4f;
    hp.beta2 = 0.99f;
  }
  return hp;
}

OptimizerTensors Tensors(Buffers& b, OptimizerKind kind, GradType grad, ParamCopyType copy,
                         StateType state = StateType::kF32) {
  OptimizerTensors t;
  t.n = b.n;
  t.param = b.param.as<float>();
  t.grad_type = grad;
  t.grad = grad == GradType::kF32 ? static_cast<const void*>(b.grad32.as<float>())
                                  : static_cast<const void*>(b.grad16.as<uint16_t>());
  if (kind == OptimizerKind::kAdagrad) {
    t.sum = b.v.as<float>();
  } else {
    t.exp_avg = b.m.as<float>();
  }
  if (kind == OptimizerKind::kAdam || kind == OptimizerKind::kAdamW) t.exp_avg_sq = b.v.as<float>();
  t.param_copy = copy == ParamCopyType::kNone ? nullptr : b.copy.as<uint16_t>();
  t.param_copy_type = copy;
  if (state != StateType::kF32) {
    t.exp_avg = t.exp_avg_sq = t.sum = nullptr;
    t.state_type = state;
    const bool int8 = state == StateType::kInt8;
    t.state1 = (int8 ? b.m8 : b.m16).as<uint8_t>();
    if (kind == OptimizerKind::kAdam || kind == OptimizerKind::kAdamW) {
      t.state2 = (int8 ? b.v8 : b.v16).as<uint8_t>();
    }
  }
  return t;
}

void CheckOk(const Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "zinf-adam-bench: %s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

double TimeRoofline(CpuOptimizer& opt, Buffers& b, RooflineFn roofline) {
  const auto t0 = Clock::now();
  opt.ParallelFor(b.n, [&](size_t begin, size_t end) {
    roofline(b.param.as<float>(), b.grad32.as<float>(), b.m.as<float>(), b.v.as<float>(), begin,
             end);
  });
  return Seconds(t0, Clock::now());
}

struct Flags {
  std::vector<std::string> optimizers{"adamw"};
  size_t n = size_t{1} << 26;
  std::vector<int> threads{1};
  std::vector<std::string> grad_dtypes{"f32"};
  std::vector<std::string> param_outs{"none"};
  std::vector<std::string> isas{"auto"};
  std::vector<std::string> state_dtypes{"fp32"};
  int repeats = 11;
  int warmup = 2;
  bool compare_unfused = false;
  bool bind = false;
  size_t tile = size_t{1} << 16;
};

template <typename T, typename Parse>
std::vector<T> ParseAll(const std::vector<std::string>& names, Parse parse, const char* flag) {
  std::vector<T> out;
  for (const std::string& name : names) {
    std::optional<T> v = parse(name);
    if (!v) {
      std::fprintf(stderr, "zinf-adam-bench: %s: unknown value \"%s\"\n", flag, name.c_str());
      std::exit(2);
    }
    out.push_back(*v);
  }
  return out;
}

std::optional<OptimizerKind> ParseOptimizer(const std::string& s) {
  for (auto k : {OptimizerKind::kAdam, OptimizerKind::kAdamW, OptimizerKind::kAdagrad,
                 OptimizerKind::kLion}) {
    if (s == OptimizerKindName(k)) return k;
  }
  return std::nullopt;
}
std::optional<GradType> ParseGrad(const std::string& s) {
  for (auto g : {GradType::kF32, GradType::kBf16, GradType::kF16}) {
    if (s == GradTypeName(g)) return g;
  }
  return std::nullopt;
}
std::optional<ParamCopyType> ParseCopy(const std::string& s) {
  for (auto c : {ParamCopyType::kNone, ParamCopyType::kBf16, ParamCopyType::kF16}) {
    if (s == ParamCopyTypeName(c)) return c;
  }
  return std::nullopt;
}
std::optional<StateType> ParseState(const std::string& s) {
  Result<StateType> t = ParseStateType(s);
  if (!t.ok()) return std::nullopt;
  return *t;
}
// An --isa value; auto (isa empty) lets SelectCpuIsa choose: ZINF_CPU_ISA or the best.
struct IsaChoice {
  std::optional<CpuIsa> isa;
};
std::optional<IsaChoice> ParseIsa(const std::string& s) {
  if (s == "auto") return IsaChoice{};
  Result<CpuIsa> isa = ParseCpuIsa(s);
  if (!isa.ok()) return std::nullopt;
  return IsaChoice{*isa};
}

// What every measured case shares: the flags, the buffers and the roofline kernel, and the
// step counter (each Step call takes the next step number, across all cases).
struct BenchState {
  const Flags& f;
  Buffers& b;
  RooflineFn roofline;
  int64_t step = 1;
};

// One (optimizer, gradient type, parameter-copy type) case, timed for every state type.
struct StepCase {
  OptimizerKind kind;
  GradType grad;
  ParamCopyType copy;
};

// Timed repeats of one case: the step per state type (empty where the optimizer has no such
// states), and the roofline once per repeat.
struct CaseTimes {
  std::vector<std::vector<double>> step_s;
  std::vector<double> roof_s;
};

CaseTimes TimeCase(BenchState& s, CpuOptimizer& opt, const StepCase& c,
                   const std::vector<StateType>& states) {
  // The state types interleaved repeat by repeat, with one roofline run per repeat.
  CaseTimes times;
  times.step_s.resize(states.size());
  for (int r = 0; r < s.f.warmup + s.f.repeats; ++r) {
    const double roof = TimeRoofline(opt, s.b, s.roofline);
    if (r >= s.f.warmup) times.roof_s.push_back(roof);
    for (size_t k = 0; k < states.size(); ++k) {
      if (c.kind == OptimizerKind::kAdagrad && states[k] == StateType::kInt8) continue;
      const OptimizerTensors t = Tensors(s.b, c.kind, c.grad, c.copy, states[k]);
      const auto t0 = Clock::now();
      CheckOk(opt.Step(HyperParams(c.kind, s.step++), t), "step");
      if (r >= s.f.warmup) times.step_s[k].push_back(Seconds(t0, Clock::now()));
    }
  }
  return times;
}

// Prints one JSON line per state type that ran.
void ReportCase(const Flags& f, const CpuOptimizer& opt, const StepCase& c,
                const std::vector<StateType>& states, const CaseTimes& times) {
  const double roof_med = Median(times.roof_s);
  const double roof_gbps = kRooflineBytesPerElement * static_cast<double>(f.n) / roof_med / 1e9;
  std::optional<double> fp32_med;
  for (size_t k = 0; k < states.size(); ++k) {
    if (states[k] == StateType::kF32) fp32_med = Median(times.step_s[k]);
  }
  for (size_t k = 0; k < states.size(); ++k) {
    const std::vector<double>& step_s = times.step_s[k];
    if (step_s.empty()) {
      std::fprintf(stderr, "zinf-adam-bench: %s has no int8 states; skipped\n",
                   OptimizerKindName(c.kind));
      continue;
    }
    const double med = Median(step_s);
    const double bytes = StepBytesPerElement(c.kind, c.grad, c.copy, states[k], f.n);
    const double gbps = bytes * static_cast<double>(f.n) / med / 1e9;
    nlohmann::json j = {
        {"optimizer", OptimizerKindName(c.kind)},
        {"isa", CpuIsaName(opt.isa())},
        {"kernel", opt.kernel_name()},
        {"threads", opt.num_threads()},
        {"bind", opt.bound_to_cores()},
        {"n", f.n},
        {"grad_dtype", GradTypeName(c.grad)},
        {"param_out", ParamCopyTypeName(c.copy)},
        {"state_dtype", StateTypeName(states[k])},
        {"repeats", f.repeats},
        {"ms_median", med * 1e3},
        {"ms_min", *std::min_element(step_s.begin(), step_s.end()) * 1e3},
        {"ns_per_elem", med * 1e9 / static_cast<double>(f.n)},
        {"bytes_per_elem", bytes},
        {"gbps", gbps},
        {"roofline_ms_median", roof_med * 1e3},
        {"roofline_gbps", roof_gbps},
        {"roofline_ratio", gbps / roof_gbps},
    };
    if (fp32_med && states[k] != StateType::kF32) j["ns_vs_fp32"] = med / *fp32_med;
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
  }
}

// Timed repeats of --compare-unfused: the fused step, the fp32 step and the conversion pass
// after it, the bf16-gradient step with its conversion, and the plain-store conversion (empty
// unless plain).
struct UnfusedTimes {
  std::vector<double> fused_s, unfused_s, step32_s, convert_s, unfused_bf16_s, plain_s;
};

UnfusedTimes TimeUnfused(BenchState& s, CpuOptimizer& opt, OptimizerKind kind, bool plain) {
  const Flags& f = s.f;
  Buffers& b = s.b;
  const OptimizerTensors fused = Tensors(b, kind, GradType::kBf16, ParamCopyType::kBf16);
  const OptimizerTensors fp32 = Tensors(b, kind, GradType::kF32, ParamCopyType::kNone);
  const OptimizerTensors bf16_grads = Tensors(b, kind, GradType::kBf16, ParamCopyType::kNone);
  UnfusedTimes times;
  for (int r = 0; r < f.warmup + f.repeats; ++r) {
    auto t0 = Clock::now();
    CheckOk(opt.Step(HyperParams(kind, s.step++), fused), "fused step");
    auto t1 = Clock::now();
    CheckOk(opt.Step(HyperParams(kind, s.step++), fp32), "fp32 step");
    auto t2 = Clock::now();
    CheckOk(opt.ConvertParams(fp32.param, b.copy.as<uint16_t>(), ParamCopyType::kBf16, f.n),
            "conversion");
    auto t3 = Clock::now();
    CheckOk(opt.Step(HyperParams(kind, s.step++), bf16_grads), "bf16-gradient step");
    CheckOk(opt.ConvertParams(fp32.param, b.copy.as<uint16_t>(), ParamCopyType::kBf16, f.n),
            "conversion");
    auto t5 = Clock::now();
    if (plain) {
      opt.ParallelFor(f.n, [&](size_t begin, size_t end) {
        ConvertPlainAvx512Bf16(fp32.param, b.copy.as<uint16_t>(), begin, end);
      });
    }
    auto t6 = Clock::now();
    if (r < f.warmup) continue;
    times.plain_s.push_back(Seconds(t5, t6));
    times.fused_s.push_back(Seconds(t0, t1));
    times.step32_s.push_back(Seconds(t1, t2));
    times.convert_s.push_back(Seconds(t2, t3));
    times.unfused_s.push_back(Seconds(t1, t3));
    times.unfused_bf16_s.push_back(Seconds(t3, t5));
  }
  return times;
}

void ReportUnfused(const Flags& f, const CpuOptimizer& opt, OptimizerKind kind, bool plain,
                   const UnfusedTimes& t) {
  const double n = static_cast<double>(f.n);
  const double fused_med = Median(t.fused_s);
  nlohmann::json j = {
      {"compare", "unfused"},
      {"optimizer", OptimizerKindName(kind)},
      {"isa", CpuIsaName(opt.isa())},
      {"kernel", opt.kernel_name()},
      {"threads", opt.num_threads()},
      {"n", f.n},
      {"repeats", f.repeats},
      {"fused_ns_per_elem", fused_med * 1e9 / n},
      {"unfused_ns_per_elem", Median(t.unfused_s) * 1e9 / n},
      {"unfused_fp32_step_ns_per_elem", Median(t.step32_s) * 1e9 / n},
      {"unfused_convert_ns_per_elem", Median(t.convert_s) * 1e9 / n},
      {"fused_speedup", Median(t.unfused_s) / fused_med},
      {"fused_speedup_vs_bf16_grads_unfused", Median(t.unfused_bf16_s) / fused_med},
  };
  if (plain) {
    // The same fp32 step followed by the plain-store conversion pass.
    std::vector<double> unfused_plain;
    for (size_t k = 0; k < t.step32_s.size(); ++k)
      unfused_plain.push_back(t.step32_s[k] + t.plain_s[k]);
    j["plain_convert_ns_per_elem"] = Median(t.plain_s) * 1e9 / n;
    j["fused_speedup_vs_plain_store_convert"] = Median(unfused_plain) / fused_med;
  }
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);
}

int Run(const Flags& f) {
  const auto kinds = ParseAll<OptimizerKind>(f.optimizers, ParseOptimizer, "--optimizer");
  const auto grads = ParseAll<GradType>(f.grad_dtypes, ParseGrad, "--grad-dtype");
  const auto copies = ParseAll<ParamCopyType>(f.param_outs, ParseCopy, "--param-out");
  const auto isas = ParseAll<IsaChoice>(f.isas, ParseIsa, "--isa");
  const auto states = ParseAll<StateType>(f.state_dtypes, ParseState, "--state-dtype");
  Buffers b(f.n);
  BenchState s{f, b, BestRoofline()};
  bool touched = false;
  for (const IsaChoice& choice : isas) {
    for (int threads : f.threads) {
      CpuOptimizer::Options o;
      o.num_threads = threads;
      o.isa = choice.isa;
      o.bind_to_cores = f.bind;
      o.tile_elements = f.tile;
      auto created = CpuOptimizer::Create(o);
      if (!created.ok()) CheckOk(created.status(), "create");
      CpuOptimizer& opt = **created;
      if (!touched) {
        Touch(opt, b);
        touched = true;
      }
      for (OptimizerKind kind : kinds) {
        for (GradType grad : grads) {
          for (ParamCopyType copy : copies) {
            const StepCase c{kind, grad, copy};
            ReportCase(f, opt, c, states, TimeCase(s, opt, c, states));
          }
        }
      }
      if (f.compare_unfused) {
        const OptimizerKind kind = kinds.front();
        const bool plain = DetectCpuFeatures().avx512_bf16 && CpuIsaSupported(CpuIsa::kAvx512);
        ReportUnfused(f, opt, kind, plain, TimeUnfused(s, opt, kind, plain));
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace zinf

int main(int argc, char** argv) {
  zinf::Flags f;
  CLI::App app{"zinf-adam-bench: CPU optimizer step vs. the memory roofline (JSON lines)"};
  app.add_option("--optimizer", f.optimizers, "adam, adamw, adagrad, lion (comma list)")
      ->delimiter(',');
  app.add_option("--n", f.n, "elements per buffer")->check(CLI::Range(size_t{1}, size_t{1} << 34));
  app.add_option("--threads", f.threads, "thread counts (comma list)")
      ->delimiter(',')
      ->check(CLI::Range(1, 1024));
  app.add_option("--grad-dtype", f.grad_dtypes, "f32, bf16, f16 (comma list)")->delimiter(',');
  app.add_option("--param-out", f.param_outs, "none, bf16, f16 (comma list)")->delimiter(',');
  app.add_option("--isa", f.isas, "auto, scalar, avx2, avx512 (comma list)")->delimiter(',');
  app.add_option("--state-dtype", f.state_dtypes,
                 "optimizer states stored as fp32, bf16, int8 (comma list, interleaved)")
      ->delimiter(',');
  app.add_option("--repeats", f.repeats, "timed repeats (the median is reported)")
      ->check(CLI::Range(1, 100000));
  app.add_option("--warmup", f.warmup, "untimed repeats first")->check(CLI::Range(0, 100000));
  app.add_flag("--compare-unfused", f.compare_unfused,
               "also time fused bf16-in/bf16-out against fp32 step + separate conversion");
  app.add_flag("--bind", f.bind, "bind threads to cores with hwloc");
  app.add_option("--tile", f.tile, "elements per tile")
      ->check(CLI::Range(size_t{16}, size_t{1} << 30));
  if (int rc = zinf::ParseCommandLine(app, argc, argv); rc >= 0) return rc;
  return zinf::Run(f);
}
