#include "gemm/heuristic.h"

#include <cstring>

namespace moe_grouped::gemm {

const char* tile_config_name(TileConfig config) {
  switch (config) {
    case TileConfig::kCoop128x256: return "coop_128x256x64_c2x1";
    case TileConfig::kPong128x128: return "pong_128x128x64_c2x1";
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

// The rules (H100, bf16; benchmarks/results/grouped_gemm_tiles-h100.json has
// the sweep behind them):
//  - fprop and dgrad: the cooperative 128x256 tile with a 2x1 cluster. On the
//    five MoE shapes of benchmarks/grouped_gemm.py, balanced and skewed, it
//    matched or beat ping-pong 128x128, ping-pong 64x256 and cooperative
//    128x128 everywhere, also for 256 tokens per expert and for skewed splits
//    (whose last partial tile per expert the smaller tiles were meant to
//    shrink).
//  - wgrad into fp32 (main_grad) with a short reduction (under 512 tokens per
//    expert): the ping-pong kernel, whose second warp group computes while the
//    first runs the epilogue's read-modify-write of fp32 dW; otherwise the
//    cooperative tile.
TileConfig choose_tile_config(const GemmShape& shape) {
  int64_t groups = shape.num_groups > 0 ? shape.num_groups : 1;
  int64_t mean_rows = shape.total_rows / groups;
  if (shape.kind == MG_GEMM_WGRAD && shape.out_dtype == MG_FLOAT32 && mean_rows < 512) {
    return TileConfig::kPong128x128;
  }
  return TileConfig::kCoop128x256;
}

}  // namespace moe_grouped::gemm
