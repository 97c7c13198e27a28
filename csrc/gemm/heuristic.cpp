#include "gemm/heuristic.h"

#include <cstring>

namespace moe_grouped::gemm {

const char* tile_config_name(TileConfig config) {
  switch (config) {
    case TileConfig::kCoop128x256: return "coop_128x256x64_c2x1";
    case TileConfig::kPong128x128: return "pong_128x128x64_c2x1";
    case TileConfig::kPong64x256: return "pong_64x256x64_c1x2";
    case TileConfig::kCoop128x128: return "coop_128x128x64_c2x1";
    case TileConfig::kCount: break;
  }
  return "unknown";
}

bool parse_tile_config(const char* name, TileConfig* out) {
  for (int i = 0; i < static_cast<int>(TileConfig::kCount); ++i) {
    auto config = static_cast<TileConfig>(i);
    if (std::strcmp(name, tile_config_name(config)) == 0) {
      *out = config;
      return true;
    }
  }
  return false;
}

// The rules, in order (H100 measurements in benchmarks/results/ back them):
//  - wgrad reduces over each expert's tokens; its output tiles are large
//    (N x K per expert), so the cooperative 128x256 tile wins unless the
//    reduction is short, where the ping-pong kernel hides the epilogue (the
//    fp32 main_grad read-modify-write) behind the other warp group's MMAs.
//  - fprop and dgrad tile the tokens of each expert: with few tokens per
//    expert (mean under 192) a 64-row tile wastes half as many rows in each
//    expert's last, partial tile; with a short reduction (K under 2560) the
//    ping-pong 128x128 kernel overlaps epilogues with MMAs; otherwise the
//    cooperative 128x256 tile has the highest MMA efficiency.
TileConfig choose_tile_config(const GemmShape& shape) {
  int64_t groups = shape.num_groups > 0 ? shape.num_groups : 1;
  int64_t mean_rows = shape.total_rows / groups;
  if (shape.kind == MG_GEMM_WGRAD) {
    return mean_rows < 512 ? TileConfig::kPong128x128 : TileConfig::kCoop128x256;
  }
  int64_t reduction = shape.kind == MG_GEMM_FPROP ? shape.k : shape.n;
  if (mean_rows < 192) return TileConfig::kPong64x256;
  if (reduction < 2560) return TileConfig::kPong128x128;
  return TileConfig::kCoop128x256;
}

}  // namespace moe_grouped::gemm
