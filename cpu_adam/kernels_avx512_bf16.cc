// AVX-512F variant with avx512_bf16: the fp32 -> bf16 store is VCVTNEPS2BF16. Compiled with
// -mavx512f -mavx512bw -mavx512bf16 -mavx2 -mfma -mf16c; chosen only where the CPU has them.
#include <immintrin.h>

#include <cstdint>

#include "cpu_adam/kernels.h"

namespace zinf::cpu_adam_internal::avx512_bf16 {

#define ZINF_AVX512_NATIVE_BF16 1
#include "cpu_adam/vec_avx512.h"
#undef ZINF_AVX512_NATIVE_BF16

}  // namespace zinf::cpu_adam_internal::avx512_bf16

#define ZINF_KERNEL_NS avx512_bf16
#include "cpu_adam/kernel_body.h"
#undef ZINF_KERNEL_NS

namespace zinf::cpu_adam_internal {

const KernelTable& Avx512Bf16Kernels() {
  static constexpr KernelTable kTable = avx512_bf16::MakeKernelTable(KernelVariant::kAvx512Bf16);
  return kTable;
}

}  // namespace zinf::cpu_adam_internal
