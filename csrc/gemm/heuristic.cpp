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

// The rule, from H100 bf16 sweeps over the five MoE shapes of
// benchmarks/grouped_gemm.py, balanced and skewed splits
// (benchmarks/results/grouped_gemm_tiles-h100.json and
// grouped_gemm_wgrad_tiles-h100.json): the cooperative 128x256 tile with a 2x1
// cluster matched or beat ping-pong 128x128, ping-pong 64x256 and cooperative
// 128x128 for fprop and dgrad everywhere (also at 256 tokens per expert and
// for skewed splits, whose partial last tile per expert the smaller tiles
// were meant to shrink), and for wgrad into an fp32 main_grad on all but one
// shape (E=32, K=7168, N=2048, where ping-pong 128x128 was 3-11% faster),
// so it was the only configuration built. Ping-pong 128x128 again for bf16
// wgrad into bf16 (the fused experts path's dW, whose short K per expert
// leaves the cooperative epilogue unhidden), against the core's choice,
// H100 2026-11-26, the five issue-19 shapes with top-k splits, graphed,
// interleaved: 0.88-1.00x with the 2x1 cluster (Qwen3-, OLMoE-, DeepSeek-
// V2-Lite-like, Mixtral-like fc2), 0.54-0.74x for H = 4096 and Mixtral-like
// fc1; 0.52-0.90x without a cluster. Not built.
//
// fprop and dgrad then moved to the same tile without a cluster. CUTLASS's
// grouped scheduler rounds each group's tile count up to the cluster shape,
// so with the 2x1 cluster a group whose rows fill an odd number of 128-row
// tiles runs one more, empty, tile (the same with 1x2 and an odd number of
// 256-column tiles). Routed token counts are rarely multiples of 128. On the
// five issue-19 shapes with top-k routing (H100, 2026-11-25; a development
// build with four configurations, graphed, interleaved) no cluster was
// 1.00-1.11x as fast as 2x1 for every fprop and dgrad, and 0.95-1.04x with
// every expert's count a multiple of 256. A 1x2 cluster matched it where the
// 256-column tiles come in even numbers and lost where they do not
// (N = 768, 2816: 7-28%); a 256x128 tile with a 1x2 cluster was 0.94-1.06x of 2x1.
// benchmarks/experts_gemm_tiles.py times the built configurations
// (results/experts_gemm_tiles-h100.json). wgrad's groups have fixed shapes
// (n x k), so the rounding costs nothing there and the 2x1 cluster stays
// (256x128 with 1x2 was 0.94-1.06x of it).
//
// The epilogue stores a tile in pieces: CUTLASS's default for this tile is
// 128x32; 128x64 pieces halve the shared-memory round trips. Measured on the
// H100 (2026-11-26, benchmarks/experts_gemm_tiles.py, the six expert GEMMs of
// the five issue-19 shapes, top-k and balanced splits, graphed, one process;
// the same kernel under two names read 0.91-1.06x, which is the noise):
// - fprop/dgrad without a cluster, 128x64 against 128x32: 1.009x geometric
//   mean over 40 cases (0.975-1.051). Not distinguishable from the noise, so
//   not built. Nor were more shared-memory buffers for those pieces, so that
//   the epilogue never waits for a store to drain (CUTLASS's builder gives
//   two; 2026-11-26, same 40 cases): four 1.003x (0.972-1.024), eight, which
//   leave three mainloop stages, 0.996x (0.951-1.048).
// - bf16 wgrad with the 2x1 cluster: it reads C, so 128x64 pieces leave three
//   mainloop stages instead of four. Two runs (32 wgrad cases each):
//   fc1 of the four fine-grained shapes (M = 2I = 1536-2816 output features,
//   N = H = 2048-4096): 1.020-1.039x in the first run, 0.991-1.050x in the
//   second (15 of 16 cases at 1.02x or more); fc2 with M = 2048, N = 768 or
//   1024: 0.94-1.00x; fc2 with N = 1408: 1.04x; M = 4096, N = 1024: 0.95-
//   1.00x; Mixtral-like fc1 (M = 28672): 0.83-0.87x, fc2 (M = 4096, N =
//   14336): 1.01-1.06x. So 128x64 only for bf16 dW with at most 3072 output
//   features and at least 2048 input features.
// New configurations go into this function with the measurement that
// justifies them.
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
// weight, if small, stays in L2. Measured on the H100 (2026-11-26, plain bf16
// fprop, 131072 rows of K = 2048 into N = 1536, E balanced groups, L2
// flushed, two runs, TFLOP/s along M -> along N): E = 1: 558-587 -> 745;
// E = 4: 554-586 -> 733-737; E = 8: 555-584 -> 722; E = 16 (32 MiB of rows
// per group): 626-675 -> 689-694; E = 32 (16 MiB): 651-662 -> 666-667; E =
// 64: 607-626 -> 636-645. On the issue-19 shapes with top-k splits (1024-
// 2048 rows per group, 4-16 MiB) along N was 2-11% slower (fc1: Qwen3-like
// 1.25-1.30 -> 1.33 ms, OLMoE-like 1.67-1.72 -> 1.82, H = 4096 6.6-6.8 ->
// 7.3). Hence along N only from 32 MiB of rows per group, and only for a
// weight of at most 8 MiB (measured: 6 MiB; a larger one, read once per row
// block along N, was not). benchmarks/tile_order.py (results/tile_order-
// h100.json: Qwen3-like fc1 and fc2, fprop and dgrad, 131072 rows, balanced
// and skewed, the two orders in interleaved rounds), this rule against along
// M: 4 experts 1.03-1.24x, 8 experts 1.02-1.19x, 16 experts (32 MiB, the
// boundary) 0.99-1.12x; the cases it keeps along M read 0.98-1.03x (the same
// kernel twice). wgrad keeps along M: its operands both grow with the group,
// and walking its shorter side measured within noise (see
// sm90_grouped_gemm.cuh).
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

// The ping-pong fprop against the cooperative kernel, H100, 2026-11-26
// (benchmarks/pingpong_fprop.py, results/pingpong_fprop-h100.json: the five
// issue-19 shapes with top-k routing, graphed, one process, bitwise equal;
// two runs, in which the same kernels under the two names read 0.99-1.03x):
// fprop with K <= 2048 1.00-1.08x for fc2 (I = 768-1408, K = 1024 at
// H = 4096) and 0.99-1.06x for fc1 at H = 2048. Development builds of the
// same kernel read 0.88-0.95x at K = 4096 and 0.91x at K = 14336. Gathered,
// at H = 2048, the development build read 0.97-1.01x of the gathered
// cooperative kernel alone, so that stays; with SwiGLU in its epilogue it
// reads 0.98-1.02x of the gathered cooperative kernel plus the SwiGLU pass
// (0.95-1.03x over the 2026-11-27 runs; 1.04x on Qwen3- and OLMoE-like and
// 1.00x on DSv2-Lite-like once its epilogue stored by bulk copies, one run
// of three rounds): at parity or better, and one kernel. It walks every
// group along M, so problems the cooperative kernel walks along N
// (raster_along_n: few groups of many rows, not measured with this kernel)
// keep that one.
bool prefer_pingpong_fprop(const GemmShape& shape, bool gathered, bool swiglu) {
  return shape.kind == MG_GEMM_FPROP && shape.dtype == MG_BFLOAT16 && shape.out_dtype == MG_BFLOAT16 &&
         shape.k <= 2048 && !raster_along_n(shape) && (swiglu || !gathered);
}

}  // namespace moe_grouped::gemm
