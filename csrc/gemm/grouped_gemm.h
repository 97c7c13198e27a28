// The internal contract between the grouped-GEMM entry points
// (grouped_gemm_api.cpp) and the kernel translation units (sm90_*.cu): plain
// types only, so that the API file compiles without CUTLASS.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "gemm/heuristic.h"
#include "moe_grouped/moe_grouped.h"

namespace moe_grouped::gemm {

// Rows of an operand read through an index (gathered kernels): row r of the
// operand is row index[r] of its source [source_rows, cols]; an index outside
// [0, source_rows) reads zeros. index NULL: the operand is read as stored.
struct RowGather {
  const int32_t* index = nullptr;
  int64_t source_rows = 0;
  int64_t cols = 0;
};

// The fused experts path's SwiGLU backward in a dgrad's epilogue
// (sm90_swiglu_backward_epilogue.cuh); the dgrad's `out` is then wh [M, K].
// g NULL: a plain dgrad.
struct SwigluBackwardOperands {
  void* g = nullptr;                // [M, 2K]: gate | up in, dg out
  const float* weights = nullptr;   // [M] or NULL
  float* partials = nullptr;        // [M, partial_cols] or NULL
  int64_t partial_cols = 0;
};

// One grouped GEMM, validated by the API layer.
struct GroupedGemmCall {
  mg_gemm_kind kind;
  int num_groups;
  int64_t total_rows;
  int64_t n;
  int64_t k;
  const void* m_splits;
  mg_dtype splits_dtype;
  const void* tokens;       // x (fprop), dy (dgrad, wgrad): [M, K] or [M, N]
  const void* tokens_b;     // x (wgrad only): [M, K]
  mg_group_operand weight;  // W (fprop, dgrad) or dW (wgrad), [E][N, K]
  const void* bias;         // fprop only: [E, N] or NULL
  void* out;                // y [M, N] (fprop) or dx [M, K] (dgrad)
  bool accumulate;          // wgrad only: dW += instead of dW =
  RowGather gather_a;       // gathered kernels: tokens is then A's source
  RowGather gather_b;       // gathered wgrad: tokens_b is then B's source
  SwigluBackwardOperands swiglu;  // dgrad with the SwiGLU-backward epilogue
  void* swiglu_h = nullptr;  // fprop: also h = silu(gate) * up [M, N / 2] of out = [gate | up]
  int sm_count;
  void* workspace;          // at least workspace_bytes(num_groups, sm_count)
  // CUTLASS's own D-map updates inside the kernel instead of the prebuilt
  // per-group maps (sm90_prebuilt_store_epilogue.cuh); for A/B measurements.
  bool in_kernel_store_maps = false;
  // Walk each group's tiles along N instead of along M (heuristic.h).
  bool raster_along_n = false;
};

// One compiled kernel configuration.
struct KernelEntry {
  mg_gemm_kind kind;
  mg_dtype dtype;
  mg_dtype out_dtype;
  TileConfig config;
  bool gathered;  // reads gather_a / gather_b (the others ignore them)
  bool swiglu_backward;  // dgrad with the SwiGLU-backward epilogue (reads swiglu)
  // Bytes of workspace a call with this kernel uses (argument arrays and
  // CUTLASS's own workspace, each aligned to kWorkspaceAlignment).
  size_t (*workspace_bytes)(int num_groups, int sm_count);
  // Enqueues the setup kernel, any zero-fill and the GEMM on `stream`.
  mg_status (*run)(const GroupedGemmCall& call, cudaStream_t stream);
};

// The bias gradient, validated by the API layer (grouped_dbias.cu).
struct DbiasCall {
  int num_groups;
  int64_t total_rows;
  int64_t n;
  const void* m_splits;
  mg_dtype splits_dtype;
  const void* dy;  // [M, N]
  mg_dtype dtype;  // bf16 or fp16
  void* dbias;     // [E, N]
  mg_dtype dbias_dtype;  // fp32 or dtype
};
mg_status grouped_dbias(const DbiasCall& call, cudaStream_t stream);

// Tables of the kernels each translation unit compiles.
struct KernelList {
  const KernelEntry* entries;
  int count;
};
KernelList sm90_fprop_bf16_kernels();
KernelList sm90_dgrad_bf16_kernels();
KernelList sm90_wgrad_bf16_kernels();
KernelList sm90_fprop_fp16_kernels();
KernelList sm90_dgrad_fp16_kernels();
KernelList sm90_wgrad_fp16_kernels();
KernelList sm90_gathered_fprop_dgrad_bf16_kernels();
KernelList sm90_gathered_wgrad_bf16_kernels();
KernelList sm90_dgrad_swiglu_bf16_kernels();

// The persistent ping-pong fprop (sm90_pingpong_fprop_bf16.cu): bf16 in and
// out, no bias, W one [E, N, K] tensor (weight.base), tokens read as stored or
// through gather_a, SwiGLU in the epilogue where swiglu_h is set. Its schedule
// lives in shared memory, hence the group limit; it needs no workspace.
constexpr int kPingPongMaxGroups = 256;
// Whether the kernel takes the call (shapes, group count, index ranges);
// the heuristic (heuristic.h) says whether it should.
bool pingpong_fprop_fits(const GroupedGemmCall& call);
mg_status pingpong_fprop_bf16(const GroupedGemmCall& call, cudaStream_t stream);

// Columns per tile of the SwiGLU-backward dgrad kernels: its per-row partial
// sums come one per tile of this many of the K columns.
constexpr int64_t kSwigluBackwardTileColumns = 256;

}  // namespace moe_grouped::gemm
