// fp16 dgrad kernels: one tile configuration, fp16 or fp32 output.
#include "gemm/sm90_grouped_gemm.cuh"

namespace moe_grouped::gemm {
namespace {
using sm90::GroupedGemm;
using sm90::entry;
constexpr auto kKind = MG_GEMM_DGRAD;
constexpr auto kIn = MG_FLOAT16;

using Coop = GroupedGemm<kKind, kIn, kIn, TileConfig::kCoop128x256>;
using CoopF32 = GroupedGemm<kKind, kIn, MG_FLOAT32, TileConfig::kCoop128x256>;
using NoCluster = GroupedGemm<kKind, kIn, kIn, TileConfig::kCoop128x256NoCluster>;

const KernelEntry kEntries[] = {entry<Coop>(), entry<CoopF32>(), entry<NoCluster>()};
}  // namespace

KernelList sm90_dgrad_fp16_kernels() {
  return {kEntries, static_cast<int>(sizeof(kEntries) / sizeof(kEntries[0]))};
}

}  // namespace moe_grouped::gemm
