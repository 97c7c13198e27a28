// FP8 block-scaled dgrad: dx = dy . W, dy in E4M3 or E5M2 (the recipe's
// gradient format), W^T in E4M3, bf16 output.
#include "fp8_gemm/sm90_fp8_grouped_gemm.cuh"

namespace moe_grouped::fp8_gemm {
namespace {
using sm90::entry;
using sm90::Fp8GroupedGemm;

const Fp8KernelEntry kEntries[] = {
    entry<Fp8GroupedGemm<MG_GEMM_DGRAD, MG_FLOAT8_E4M3, MG_BFLOAT16>>(),
    entry<Fp8GroupedGemm<MG_GEMM_DGRAD, MG_FLOAT8_E5M2, MG_BFLOAT16>>()};
}  // namespace

Fp8KernelList sm90_fp8_dgrad_kernels() {
  return {kEntries, static_cast<int>(sizeof(kEntries) / sizeof(kEntries[0]))};
}

}  // namespace moe_grouped::fp8_gemm
