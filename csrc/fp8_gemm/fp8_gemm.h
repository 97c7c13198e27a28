// The internal contract between the FP8 grouped-GEMM entry points
// (fp8_gemm_api.cpp) and the kernel translation units (sm90_fp8_*.cu):
// plain types only, so that the API file compiles without CUTLASS.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/columnwise_layout.h"
#include "moe_grouped/moe_grouped.h"

namespace moe_grouped::fp8_gemm {

// One block-scaled FP8 grouped GEMM, validated by the API layer. Operand
// layouts per kind are those of the header's FP8 GEMM section.
struct Fp8GemmCall {
  mg_gemm_kind kind;
  int num_groups;
  int64_t total_rows;
  int64_t n;
  int64_t k;
  const void* m_splits;
  mg_dtype splits_dtype;
  mg_fp8_operand a;         // x (fprop), dy (dgrad), dy^T column-wise (wgrad)
  mg_fp8_operand b;         // W (fprop), W^T (dgrad), x^T column-wise (wgrad)
  mg_group_operand dw;      // wgrad only: [E][N, K]
  const void* bias;         // fprop only: [E, N] or NULL
  void* out;                // y [M, N] (fprop) or dx [M, K] (dgrad)
  bool accumulate;          // wgrad only
  int sm_count;
  void* workspace;
  // The shared launch reads it (gemm/heuristic.h): the FP8 kernels keep
  // CUTLASS's order along M unless MOE_GROUPED_GEMM_RASTER forces N.
  bool raster_along_n = false;
};

// kCooperative: two warpgroups on a 128x256 tile (WideTileMainloop);
// kNarrow: two warpgroups on a 128x128 tile, CUTLASS's mainloop (wgrad and
// dgrad, where N suits 256 columns badly).
enum class Fp8Schedule : int { kCooperative = 0, kNarrow = 1 };

// One compiled kernel: (kind, dtype of A, output dtype, schedule).
struct Fp8KernelEntry {
  mg_gemm_kind kind;
  mg_dtype a_dtype;
  mg_dtype out_dtype;
  Fp8Schedule schedule;
  size_t (*workspace_bytes)(int num_groups, int sm_count);
  mg_status (*run)(const Fp8GemmCall& call, cudaStream_t stream);
};

struct Fp8KernelList {
  const Fp8KernelEntry* entries;
  int count;
};
Fp8KernelList sm90_fp8_fprop_kernels();
Fp8KernelList sm90_fp8_dgrad_kernels();
Fp8KernelList sm90_fp8_wgrad_e4m3_kernels();
Fp8KernelList sm90_fp8_wgrad_e5m2_kernels();
Fp8KernelList sm90_fp8_narrow_kernels();

}  // namespace moe_grouped::fp8_gemm
