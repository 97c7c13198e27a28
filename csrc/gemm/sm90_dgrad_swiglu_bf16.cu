// bf16 dgrad with the fused experts path's weighted SwiGLU backward in the
// epilogue (fc2's dgrad: dh_u = dy_u . W2, never stored).
#include "gemm/sm90_grouped_gemm.cuh"
#include "gemm/sm90_swiglu_backward_epilogue.cuh"

namespace moe_grouped::gemm {
namespace {
using sm90::GroupedGemm;
using sm90::entry;
constexpr auto kIn = MG_BFLOAT16;

// The dgrad heuristic's tile (heuristic.cpp): no cluster.
using NoCluster = GroupedGemm<MG_GEMM_DGRAD, kIn, kIn, TileConfig::kCoop128x256NoCluster, false, true>;
static_assert(cute::size<1>(typename NoCluster::Tiles::Tile{}) == kSwigluBackwardTileColumns);

const KernelEntry kEntries[] = {entry<NoCluster>()};
}  // namespace

KernelList sm90_dgrad_swiglu_bf16_kernels() {
  return {kEntries, static_cast<int>(sizeof(kEntries) / sizeof(kEntries[0]))};
}

}  // namespace moe_grouped::gemm
