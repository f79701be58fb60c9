// AVX-512F variant (16 lanes) for CPUs without avx512_bf16: the fp32 -> bf16 store is the exact
// integer emulation of VCVTNEPS2BF16. Compiled with -mavx512f -mavx2 -mfma -mf16c only.
#include <immintrin.h>

#include <cstdint>

#include "cpu_adam/kernels.h"

namespace zinf::cpu_adam_internal::avx512 {

#define ZINF_AVX512_NATIVE_BF16 0
#include "cpu_adam/vec_avx512.h"
#undef ZINF_AVX512_NATIVE_BF16

}  // namespace zinf::cpu_adam_internal::avx512

#define ZINF_KERNEL_NS avx512
#include "cpu_adam/kernel_body.h"
#undef ZINF_KERNEL_NS

namespace zinf::cpu_adam_internal {

const KernelTable& Avx512Kernels() {
  static constexpr KernelTable kTable = avx512::MakeKernelTable(KernelVariant::kAvx512);
  return kTable;
}

}  // namespace zinf::cpu_adam_internal
