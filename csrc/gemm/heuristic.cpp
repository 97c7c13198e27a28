#include "gemm/heuristic.h"

#include <cstring>

namespace moe_grouped::gemm {

const char* tile_config_name(TileConfig config) {
  switch (config) {
    case TileConfig::kCoop128x256: return "coop_128x256x64_c2x1";
    case TileConfig::kCoop128x256NoCluster: return "coop_128x256x64_c1x1";
    case TileConfig::kCoop128x256Epi128x64: return "coop_128x256x64_c2x1_e128x64";
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

// One configuration per (kind, dtypes), from the host-side shape alone:
// - fprop and dgrad: cooperative 128x256 without a cluster. CUTLASS's grouped
//   scheduler rounds each group's tile count up to the cluster shape, so with
//   a 2x1 cluster a group whose rows fill an odd number of 128-row tiles runs
//   one more, empty, tile; routed token counts are rarely multiples of 128.
// - wgrad: cooperative 128x256 with the 2x1 cluster (its groups have the
//   fixed shape n x k, so the rounding costs nothing there). bf16 into bf16
//   with at most 3072 output (n) and at least 2048 input features (k), fc1's
//   dW of fine-grained experts, stores its tile in 128x64 epilogue pieces
//   instead of CUTLASS's 128x32 (half the shared-memory round trips).
// The sweeps behind each choice and the configurations measured and dropped:
// docs/kernels.md, "Tile, cluster and epilogue". A new configuration goes in
// here with the measurement that justifies it.
TileConfig choose_tile_config(const GemmShape& shape) {
  if (shape.kind == MG_GEMM_WGRAD) {
    const bool bf16 = shape.dtype == MG_BFLOAT16 && shape.out_dtype == MG_BFLOAT16;
    const bool narrow_and_deep = shape.n <= 3072 && shape.k >= 2048;
    return bf16 && narrow_and_deep ? TileConfig::kCoop128x256Epi128x64 : TileConfig::kCoop128x256;
  }
  return TileConfig::kCoop128x256NoCluster;
}

// The tile order, for 16-bit fprop and dgrad. Along M, a wave of persistent
// CTAs works down a group's row blocks one N tile at a time, so a group whose
// rows do not stay in L2 is read from memory once per N tile; along N, a wave
// covers all N tiles of a few row blocks, so the rows are read once and the
// weight, if small, stays in L2. Hence along N only from 32 MiB of rows per
// group, and only for a weight of at most 8 MiB (measured up to 6 MiB; a
// larger one, read once per row block along N, was not). wgrad keeps along M:
// its operands both grow with the group. Measurements: docs/kernels.md, "Tile
// order".
bool raster_along_n(const GemmShape& shape) {
  if (shape.kind == MG_GEMM_WGRAD || shape.num_groups <= 0) return false;
  constexpr double kElementBytes = 2.0;  // the 16-bit kernels this order is measured for
  constexpr double kMiB = 1024.0 * 1024.0;
  const double rows_per_group = static_cast<double>(shape.total_rows) / shape.num_groups;
  const double row_elements = static_cast<double>(shape.kind == MG_GEMM_FPROP ? shape.k : shape.n);
  const double group_rows_bytes = rows_per_group * row_elements * kElementBytes;
  const double weight_bytes = static_cast<double>(shape.n) * static_cast<double>(shape.k) * kElementBytes;
  return group_rows_bytes >= 32 * kMiB && weight_bytes <= 8 * kMiB;
}

// The ping-pong fprop where it measured at parity or faster than the
// cooperative kernel: bf16 into bf16 with K <= 2048 (slower from K = 4096).
// Gathered, only with SwiGLU in its epilogue, where it replaces the gathered
// cooperative kernel plus the SwiGLU pass with one kernel; without SwiGLU the
// gathered cooperative kernel is as fast, so that stays. It walks every group
// along M, so problems the cooperative kernel walks along N (raster_along_n,
// not measured with this kernel) keep that one. Figures: docs/kernels.md,
// "Ping-pong fprop".
bool prefer_pingpong_fprop(const GemmShape& shape, bool gathered, bool swiglu) {
  return shape.kind == MG_GEMM_FPROP && shape.dtype == MG_BFLOAT16 && shape.out_dtype == MG_BFLOAT16 &&
         shape.k <= 2048 && !raster_along_n(shape) && (swiglu || !gathered);
}

}  // namespace moe_grouped::gemm
