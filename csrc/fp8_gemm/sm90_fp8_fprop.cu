// FP8 block-scaled fprop: y = x . W^T (+ bias), E4M3 operands, bf16 output.
#include "fp8_gemm/sm90_fp8_grouped_gemm.cuh"

namespace moe_grouped::fp8_gemm {
namespace {
using sm90::entry;
using sm90::Fp8GroupedGemm;

const Fp8KernelEntry kEntries[] = {
    entry<Fp8GroupedGemm<MG_GEMM_FPROP, MG_FLOAT8_E4M3, MG_BFLOAT16>>()};
}  // namespace

Fp8KernelList sm90_fp8_fprop_kernels() {
  return {kEntries, static_cast<int>(sizeof(kEntries) / sizeof(kEntries[0]))};
}

}  // namespace moe_grouped::fp8_gemm
