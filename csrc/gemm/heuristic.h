// Tile-configuration choice for the SM90 grouped GEMMs: pure host code that
// maps a problem (kind, E, M, N, K, dtypes) to one of a handful of compiled
// kernel configurations. Kept apart from the kernels and from the C entry
// points so that it can be read, changed and tested on its own.
#pragma once

#include <cstdint>

#include "moe_grouped/moe_grouped.h"

namespace moe_grouped::gemm {

// The configurations compiled into the core. Not every configuration exists
// for every (kind, dtype, output dtype): the kernel table in
// grouped_gemm_api.cpp lists what was instantiated, and kCoop128x256 exists
// for all of them but the SwiGLU-backward dgrad (built on one tile); a
// configuration that is not built for a call falls back to kCoop128x256, or
// where that is missing too, to the first one built. The other tiles,
// clusters and epilogue pieces measured and dropped: docs/kernels.md.
enum class TileConfig : int {
  kCoop128x256 = 0,       // cooperative, 128x256x64 tile, 2x1 cluster
  kCoop128x256NoCluster,  // cooperative, 128x256x64 tile, 1x1 cluster (16-bit fprop and dgrad)
  kCoop128x256Epi128x64,  // as kCoop128x256, epilogue in 128x64 pieces (bf16 wgrad into bf16)
  kCount
};

const char* tile_config_name(TileConfig config);
// Parses a name of tile_config_name(); returns false for an unknown name.
bool parse_tile_config(const char* name, TileConfig* out);

struct GemmShape {
  mg_gemm_kind kind;
  mg_dtype dtype;       // operands
  mg_dtype out_dtype;   // y, dx or dW
  int num_groups;       // E
  int64_t total_rows;   // M, summed over experts
  int64_t n;            // out_features
  int64_t k;            // in_features
};

// The configuration to run. Only E, M, N and K are known on the host (the
// split is on the device), so the choice uses the mean tokens per expert,
// M / E, and never reads m_splits.
TileConfig choose_tile_config(const GemmShape& shape);

// Whether the scheduler walks each group's tiles along N (every N tile of a
// row block before the next row block) rather than along M, CUTLASS's order
// for grouped problems. Only the order of the tiles changes: the results are
// bitwise the same. From the mean rows per group, like the tile choice.
bool raster_along_n(const GemmShape& shape);

// Whether a bf16 fprop into bf16 should run the persistent ping-pong kernel
// (sm90_pingpong_fprop_bf16.cu) rather than the cooperative one, where it
// fits (pingpong_fprop_fits): gathered (A read through an index) and with
// SwiGLU in its epilogue or not. Also from the host-side shape alone.
bool prefer_pingpong_fprop(const GemmShape& shape, bool gathered, bool swiglu);

}  // namespace moe_grouped::gemm
