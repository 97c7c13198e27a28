// bf16 wgrad kernels whose dy or x rows are read through the routing index:
// dW (+)= dy[index]^T . x or dy^T . x[index], into fp32 main_grad or bf16.
#include "gemm/sm90_gather_mainloop.cuh"
#include "gemm/sm90_grouped_gemm.cuh"

namespace moe_grouped::gemm {
namespace {
using sm90::GroupedGemm;
using sm90::entry;
constexpr auto kKind = MG_GEMM_WGRAD;
constexpr auto kIn = MG_BFLOAT16;
constexpr auto kTile = TileConfig::kCoop128x256;

using CoopF32 = GroupedGemm<kKind, kIn, MG_FLOAT32, kTile, /*Gathered=*/true>;
using Coop = GroupedGemm<kKind, kIn, kIn, kTile, /*Gathered=*/true>;

const KernelEntry kEntries[] = {entry<CoopF32>(), entry<Coop>()};
}  // namespace

KernelList sm90_gathered_wgrad_bf16_kernels() {
  return {kEntries, static_cast<int>(sizeof(kEntries) / sizeof(kEntries[0]))};
}

}  // namespace moe_grouped::gemm
