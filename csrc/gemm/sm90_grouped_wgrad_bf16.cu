// bf16 wgrad kernels: dW (+)= dy^T . x, into fp32 main_grad or bf16.
#include "gemm/sm90_grouped_gemm.cuh"

namespace moe_grouped::gemm {
namespace {
using sm90::GroupedGemm;
using sm90::entry;
constexpr auto kKind = MG_GEMM_WGRAD;
constexpr auto kIn = MG_BFLOAT16;

using CoopF32 = GroupedGemm<kKind, kIn, MG_FLOAT32, TileConfig::kCoop128x256>;
using Coop = GroupedGemm<kKind, kIn, kIn, TileConfig::kCoop128x256>;
using CoopEpi = GroupedGemm<kKind, kIn, kIn, TileConfig::kCoop128x256Epi128x64>;

const KernelEntry kEntries[] = {entry<CoopF32>(), entry<Coop>(), entry<CoopEpi>()};
}  // namespace

KernelList sm90_wgrad_bf16_kernels() {
  return {kEntries, static_cast<int>(sizeof(kEntries) / sizeof(kEntries[0]))};
}

}  // namespace moe_grouped::gemm
