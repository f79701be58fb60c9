// Run-time instruction-set detection (CPUID + XGETBV) and the ZINF_CPU_ISA override.
#include <cpuid.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "cpu_adam/kernels.h"
#include "zinf/cpu_adam.h"

namespace zinf {
namespace {

// XGETBV without -mxsave: the instruction is only executed after CPUID says OSXSAVE is set.
uint64_t ReadXcr0() {
  uint32_t eax = 0;
  uint32_t edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

CpuFeatures Detect() {
  CpuFeatures f;
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return f;
  const bool osxsave = (ecx >> 27) & 1u;
  f.fma = (ecx >> 12) & 1u;
  f.avx = (ecx >> 28) & 1u;
  f.f16c = (ecx >> 29) & 1u;
  if (osxsave) {
    const uint64_t xcr0 = ReadXcr0();
    f.os_avx = (xcr0 & 0x6u) == 0x6u;                   // SSE + AVX state
    f.os_avx512 = f.os_avx && (xcr0 & 0xe0u) == 0xe0u;  // opmask + ZMM_Hi256 + Hi16_ZMM
  }
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) {
    const unsigned max_subleaf = eax;
    f.avx2 = (ebx >> 5) & 1u;
    f.avx512f = (ebx >> 16) & 1u;
    f.avx512dq = (ebx >> 17) & 1u;
    f.avx512bw = (ebx >> 30) & 1u;
    f.avx512vl = (ebx >> 31) & 1u;
    if (max_subleaf >= 1 && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) {
      f.avx512_bf16 = (eax >> 5) & 1u;
    }
  }
  return f;
}

// Why `isa` cannot run on `f`, or "" when it can.
std::string MissingFor(CpuIsa isa, const CpuFeatures& f) {
  std::string missing;
  auto need = [&missing](bool have, const char* what) {
    if (!have) missing += missing.empty() ? what : std::string(", ") + what;
  };
  switch (isa) {
    case CpuIsa::kScalar:
      break;
    case CpuIsa::kAvx512:
      need(f.avx512f, "avx512f");
      need(f.os_avx512, "OS support for AVX-512 state (XCR0)");
      [[fallthrough]];
    case CpuIsa::kAvx2:
      need(f.avx, "avx");
      need(f.avx2, "avx2");
      need(f.fma, "fma");
      need(f.f16c, "f16c");
      need(f.os_avx, "OS support for AVX state (XCR0)");
      break;
  }
  return missing;
}

}  // namespace

const CpuFeatures& DetectCpuFeatures() {
  static const CpuFeatures features = Detect();
  return features;
}

bool CpuIsaSupported(CpuIsa isa, const CpuFeatures& features) {
  return MissingFor(isa, features).empty();
}

bool CpuIsaSupported(CpuIsa isa) { return CpuIsaSupported(isa, DetectCpuFeatures()); }

CpuIsa BestCpuIsa() {
  if (CpuIsaSupported(CpuIsa::kAvx512)) return CpuIsa::kAvx512;
  if (CpuIsaSupported(CpuIsa::kAvx2)) return CpuIsa::kAvx2;
  return CpuIsa::kScalar;
}

const char* CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar:
      return "scalar";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

Result<CpuIsa> ParseCpuIsa(std::string_view name) {
  if (name == "scalar") return CpuIsa::kScalar;
  if (name == "avx2") return CpuIsa::kAvx2;
  if (name == "avx512") return CpuIsa::kAvx512;
  return Status::InvalidArgument("unknown CPU instruction set \"" + std::string(name) +
                                 "\"; expected scalar, avx2 or avx512");
}

Result<CpuIsa> SelectCpuIsa(std::optional<CpuIsa> requested) {
  return cpu_adam_internal::SelectCpuIsaFrom(requested, std::getenv("ZINF_CPU_ISA"),
                                             DetectCpuFeatures());
}

namespace cpu_adam_internal {

Result<CpuIsa> SelectCpuIsaFrom(std::optional<CpuIsa> requested, const char* env,
                                const CpuFeatures& features) {
  std::string source = "requested";
  if (!requested) {
    if (env == nullptr || *env == '\0' || std::string_view(env) == "auto") {
      for (CpuIsa isa : {CpuIsa::kAvx512, CpuIsa::kAvx2}) {
        if (CpuIsaSupported(isa, features)) return isa;
      }
      return CpuIsa::kScalar;
    }
    Result<CpuIsa> parsed = ParseCpuIsa(env);
    if (!parsed.ok()) {
      return Status::InvalidArgument("ZINF_CPU_ISA=" + std::string(env) + ": " +
                                     parsed.status().message() + " (or auto, or unset)");
    }
    requested = *parsed;
    source = "ZINF_CPU_ISA=" + std::string(env);
  }
  const std::string missing = MissingFor(*requested, features);
  if (!missing.empty()) {
    const CpuIsa best = SelectCpuIsaFrom(std::nullopt, nullptr, features).value();
    return Status::NotSupported(source + ": this CPU cannot run the " + CpuIsaName(*requested) +
                                " kernels (missing: " + missing + "); the best it supports is " +
                                CpuIsaName(best) + ": unset ZINF_CPU_ISA or choose that one");
  }
  return *requested;
}

const char* KernelVariantName(KernelVariant variant) {
  switch (variant) {
    case KernelVariant::kScalar:
      return "scalar";
    case KernelVariant::kAvx2:
      return "avx2";
    case KernelVariant::kAvx512:
      return "avx512";
    case KernelVariant::kAvx512Bf16:
      return "avx512_bf16";
  }
  return "unknown";
}

CpuIsa IsaOf(KernelVariant variant) {
  switch (variant) {
    case KernelVariant::kScalar:
      return CpuIsa::kScalar;
    case KernelVariant::kAvx2:
      return CpuIsa::kAvx2;
    case KernelVariant::kAvx512:
    case KernelVariant::kAvx512Bf16:
      return CpuIsa::kAvx512;
  }
  return CpuIsa::kScalar;
}

bool KernelVariantSupported(KernelVariant variant, const CpuFeatures& features) {
  if (!CpuIsaSupported(IsaOf(variant), features)) return false;
  // -mavx512bf16 implies avx512bw in GCC, so that variant may use BW instructions.
  if (variant == KernelVariant::kAvx512Bf16) return features.avx512_bf16 && features.avx512bw;
  return true;
}

KernelVariant BestVariantOf(CpuIsa isa, const CpuFeatures& features) {
  switch (isa) {
    case CpuIsa::kScalar:
      return KernelVariant::kScalar;
    case CpuIsa::kAvx2:
      return KernelVariant::kAvx2;
    case CpuIsa::kAvx512:
      return KernelVariantSupported(KernelVariant::kAvx512Bf16, features)
                 ? KernelVariant::kAvx512Bf16
                 : KernelVariant::kAvx512;
  }
  return KernelVariant::kScalar;
}

const KernelTable& KernelsFor(KernelVariant variant) {
  switch (variant) {
    case KernelVariant::kScalar:
      return ScalarKernels();
    case KernelVariant::kAvx2:
      return Avx2Kernels();
    case KernelVariant::kAvx512:
      return Avx512Kernels();
    case KernelVariant::kAvx512Bf16:
      return Avx512Bf16Kernels();
  }
  return ScalarKernels();
}

}  // namespace cpu_adam_internal
}  // namespace zinf
