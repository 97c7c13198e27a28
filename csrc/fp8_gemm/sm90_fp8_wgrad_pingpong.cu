// FP8 block-scaled wgrad on the ping-pong schedule (E4M3 dy, fp32 main_grad),
// which fp8_gemm_api.cpp picks for short reductions (docs/kernels.md).
#include "fp8_gemm/sm90_fp8_grouped_gemm.cuh"

namespace moe_grouped::fp8_gemm {
namespace {
using sm90::entry;
using sm90::Fp8GroupedGemm;

const Fp8KernelEntry kEntries[] = {
    entry<Fp8GroupedGemm<MG_GEMM_WGRAD, MG_FLOAT8_E4M3, MG_FLOAT32, Fp8Schedule::kPingpong>>()};
}  // namespace

Fp8KernelList sm90_fp8_wgrad_pingpong_kernels() {
  return {kEntries, static_cast<int>(sizeof(kEntries) / sizeof(kEntries[0]))};
}

}  // namespace moe_grouped::fp8_gemm
