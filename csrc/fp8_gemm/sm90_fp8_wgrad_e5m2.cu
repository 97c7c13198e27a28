// FP8 block-scaled wgrad with dy in E5M2: dW (+)= dy^T . x from the
// column-wise operands, into fp32 (main_grad) or bf16.
#include "fp8_gemm/sm90_fp8_grouped_gemm.cuh"

namespace moe_grouped::fp8_gemm {
namespace {
using sm90::entry;
using sm90::Fp8GroupedGemm;

const Fp8KernelEntry kEntries[] = {
    entry<Fp8GroupedGemm<MG_GEMM_WGRAD, MG_FLOAT8_E5M2, MG_FLOAT32>>(),
    entry<Fp8GroupedGemm<MG_GEMM_WGRAD, MG_FLOAT8_E5M2, MG_BFLOAT16>>()};
}  // namespace

Fp8KernelList sm90_fp8_wgrad_e5m2_kernels() {
  return {kEntries, static_cast<int>(sizeof(kEntries) / sizeof(kEntries[0]))};
}

}  // namespace moe_grouped::fp8_gemm
