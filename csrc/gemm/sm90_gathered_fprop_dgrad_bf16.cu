// bf16 fprop and dgrad kernels whose A rows (x, or the output gradient) are
// read through the routing index: y = x[index] . W^T, dx = dy[index] . W.
#include "gemm/sm90_gather_mainloop.cuh"
#include "gemm/sm90_grouped_gemm.cuh"

namespace moe_grouped::gemm {
namespace {
using sm90::GroupedGemm;
using sm90::entry;
constexpr auto kIn = MG_BFLOAT16;
constexpr auto kTile = TileConfig::kCoop128x256;
// The tile the heuristic picks for 16-bit fprop and dgrad (heuristic.cpp);
// the 2x1-cluster one stays as the fallback every kernel table has.
constexpr auto kNoCluster = TileConfig::kCoop128x256NoCluster;

using Fprop = GroupedGemm<MG_GEMM_FPROP, kIn, kIn, kTile, /*Gathered=*/true>;
using Dgrad = GroupedGemm<MG_GEMM_DGRAD, kIn, kIn, kTile, /*Gathered=*/true>;
using FpropNoCluster = GroupedGemm<MG_GEMM_FPROP, kIn, kIn, kNoCluster, /*Gathered=*/true>;
using DgradNoCluster = GroupedGemm<MG_GEMM_DGRAD, kIn, kIn, kNoCluster, /*Gathered=*/true>;

const KernelEntry kEntries[] = {entry<Fprop>(), entry<Dgrad>(), entry<FpropNoCluster>(), entry<DgradNoCluster>()};
}  // namespace

KernelList sm90_gathered_fprop_dgrad_bf16_kernels() {
  return {kEntries, static_cast<int>(sizeof(kEntries) / sizeof(kEntries[0]))};
}

}  // namespace moe_grouped::gemm
