// FP8 block-scaled GEMMs with E4M3 operands on 128x128 tiles (CUTLASS's
// mainloop): the wgrad and the dgrad, which fp8_gemm_api.cpp picks where the
// 128x256 tiles would leave a cluster's second 256 columns empty (e.g. an
// output of N = 768 columns).
#include "fp8_gemm/sm90_fp8_grouped_gemm.cuh"

namespace moe_grouped::fp8_gemm {
namespace {
using sm90::entry;
using sm90::Fp8GroupedGemm;

const Fp8KernelEntry kEntries[] = {
    entry<Fp8GroupedGemm<MG_GEMM_WGRAD, MG_FLOAT8_E4M3, MG_FLOAT32, Fp8Schedule::kNarrow>>(),
    entry<Fp8GroupedGemm<MG_GEMM_WGRAD, MG_FLOAT8_E4M3, MG_BFLOAT16, Fp8Schedule::kNarrow>>(),
    entry<Fp8GroupedGemm<MG_GEMM_DGRAD, MG_FLOAT8_E4M3, MG_BFLOAT16, Fp8Schedule::kNarrow>>()};
}  // namespace

Fp8KernelList sm90_fp8_narrow_kernels() {
  return {kEntries, static_cast<int>(sizeof(kEntries) / sizeof(kEntries[0]))};
}

}  // namespace moe_grouped::fp8_gemm
