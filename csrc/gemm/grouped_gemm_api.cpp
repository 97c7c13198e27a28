// The C entry points of the grouped GEMMs and the bias gradient. Each reads
// in one order: validate -> return early when there is nothing to compute ->
// pick a kernel (heuristic.h) -> take the workspace -> launch. Nothing here
// allocates (the workspace manager grows only outside capture), synchronises
// or copies from the host, so every call can be captured in a CUDA graph.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "core/error.h"
#include "core/workspace.h"
#include "gemm/api_common.h"
#include "gemm/grouped_gemm.h"
#include "gemm/heuristic.h"

namespace moe_grouped::gemm {
namespace {

// Debugging only: forces a tile configuration by name (see heuristic.cpp).
constexpr const char* kTileEnv = "MOE_GROUPED_GEMM_TILE";
// Measurement only: "in_kernel" stores D through CUTLASS's per-CTA maps,
// rewritten in the kernel at each change of group, instead of the per-group
// maps built before it ("prebuilt", the default; sm90_prebuilt_store_epilogue.cuh).
constexpr const char* kStoreMapsEnv = "MOE_GROUPED_GEMM_STORE_MAPS";

// Measurement and tests: "pingpong" or "cutlass" forces the bf16 fprop's
// kernel wherever the ping-pong kernel fits; "auto" (or unset) follows
// prefer_pingpong_fprop, except that a forced MOE_GROUPED_GEMM_TILE (a
// cooperative configuration) means "cutlass".
constexpr const char* kFpropEnv = "MOE_GROUPED_GEMM_FPROP";

mg_status tile_order(const GemmShape& shape, bool* along_n) {
  return forced_tile_order(raster_along_n(shape), along_n);
}

mg_status in_kernel_store_maps(bool* out) {
  int choice = 0;
  MG_RETURN_IF_ERROR(env_choice(kStoreMapsEnv, {"prebuilt", "in_kernel"}, &choice));
  *out = choice == 1;
  return MG_OK;
}

const KernelList& all_kernels(int index) {
  static const KernelList lists[] = {
      sm90_fprop_bf16_kernels(), sm90_dgrad_bf16_kernels(), sm90_wgrad_bf16_kernels(),
      sm90_fprop_fp16_kernels(), sm90_dgrad_fp16_kernels(), sm90_wgrad_fp16_kernels(),
      sm90_gathered_fprop_dgrad_bf16_kernels(), sm90_gathered_wgrad_bf16_kernels(),
      sm90_dgrad_swiglu_bf16_kernels()};
  return lists[index];
}
constexpr int kKernelLists = 9;

// Which kernel family a call needs besides its kind and dtypes.
struct Variant {
  bool gathered = false;
  bool swiglu_backward = false;
};

// The built kernel of this kind, dtypes, configuration and variant; config
// TileConfig::kCount takes the first configuration built for the rest.
const KernelEntry* find_kernel(mg_gemm_kind kind, mg_dtype dtype, mg_dtype out_dtype,
                               TileConfig config, Variant variant) {
  for (int l = 0; l < kKernelLists; ++l) {
    const KernelList& list = all_kernels(l);
    for (int i = 0; i < list.count; ++i) {
      const KernelEntry& e = list.entries[i];
      if (e.kind == kind && e.dtype == dtype && e.out_dtype == out_dtype &&
          (config == TileConfig::kCount || e.config == config) &&
          e.gathered == variant.gathered && e.swiglu_backward == variant.swiglu_backward) {
        return &e;
      }
    }
  }
  return nullptr;
}

// Workspace for any kernel of (kind, dtype): the largest of them, so that
// the size does not depend on the output dtype, the tile configuration or
// the variant (gathered, SwiGLU backward).
size_t workspace_bytes(mg_gemm_kind kind, mg_dtype dtype, int num_groups, int sms) {
  size_t bytes = 0;
  for (int l = 0; l < kKernelLists; ++l) {
    const KernelList& list = all_kernels(l);
    for (int i = 0; i < list.count; ++i) {
      const KernelEntry& e = list.entries[i];
      if (e.kind != kind || e.dtype != dtype) continue;
      size_t need = e.workspace_bytes(num_groups, sms);
      if (need > bytes) bytes = need;
    }
  }
  return bytes;
}

// The kernel for a problem: the heuristic's (or MOE_GROUPED_GEMM_TILE's) tile
// configuration, else kCoop128x256, else the first one built for the rest.
mg_status select_kernel(const GemmShape& shape, Variant variant, const KernelEntry** out) {
  TileConfig config = choose_tile_config(shape);
  if (const char* forced = std::getenv(kTileEnv); forced != nullptr && forced[0] != '\0') {
    if (!parse_tile_config(forced, &config)) {
      return fail(MG_ERROR_INVALID_ARGUMENT, "%s=%s names no tile configuration (e.g. %s)",
                  kTileEnv, forced, tile_config_name(TileConfig::kCoop128x256));
    }
  }
  const mg_gemm_kind kind = shape.kind;
  const KernelEntry* entry = find_kernel(kind, shape.dtype, shape.out_dtype, config, variant);
  if (entry == nullptr) entry = find_kernel(kind, shape.dtype, shape.out_dtype, TileConfig::kCoop128x256, variant);
  if (entry == nullptr) entry = find_kernel(kind, shape.dtype, shape.out_dtype, TileConfig::kCount, variant);
  if (entry == nullptr) {
    return fail(MG_ERROR_UNSUPPORTED, "no %sgrouped %s%s kernel is built for %s operands and %s output",
                variant.gathered ? "gathered " : "", kind_name(kind),
                variant.swiglu_backward ? " (SwiGLU backward)" : "", dtype_name(shape.dtype),
                dtype_name(shape.out_dtype));
  }
  *out = entry;
  return MG_OK;
}

mg_status run_gemm(const mg_grouped_problem* p, GroupedGemmCall call, mg_dtype out_dtype,
                   void* stream) {
  DeviceGuard guard;
  MG_RETURN_IF_ERROR(guard.enter(p->device));
  int sms = 0;
  MG_RETURN_IF_ERROR(sm_count(p->device, &sms));
  const KernelEntry* entry = nullptr;
  Variant variant;
  variant.gathered = call.gather_a.index != nullptr || call.gather_b.index != nullptr;
  variant.swiglu_backward = call.swiglu.g != nullptr;
  // Both choices (kernel, tile order) come from the host-side shape alone.
  const GemmShape shape{call.kind, p->dtype, out_dtype, p->num_groups, p->total_rows, p->n, p->k};
  MG_RETURN_IF_ERROR(select_kernel(shape, variant, &entry));
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  size_t bytes = workspace_bytes(call.kind, p->dtype, p->num_groups, sms);
  void* workspace = nullptr;
  MG_RETURN_IF_ERROR(workspace_get(p->device, p->workspace_slot, bytes, cuda_stream, &workspace));
  set_problem(call, p, sms, workspace);
  MG_RETURN_IF_ERROR(in_kernel_store_maps(&call.in_kernel_store_maps));
  MG_RETURN_IF_ERROR(tile_order(shape, &call.raster_along_n));
  MG_RETURN_IF_ERROR(entry->run(call, cuda_stream));
  return ok();
}

// Whether a validated fprop runs on the ping-pong kernel: it takes the call
// (bf16 in and out, no bias, W one tensor, pingpong_fprop_fits) and the
// heuristic or MOE_GROUPED_GEMM_FPROP picks it.
mg_status pingpong_chosen(const GroupedGemmCall& call, mg_dtype dtype, mg_dtype out_dtype, bool* chosen) {
  *chosen = false;
  const GemmShape shape{MG_GEMM_FPROP, dtype, out_dtype, call.num_groups, call.total_rows, call.n, call.k};
  // The cooperative kernel's switches are checked whichever kernel runs, so
  // that a mistyped value fails the same way everywhere.
  bool unused = false;
  MG_RETURN_IF_ERROR(in_kernel_store_maps(&unused));
  MG_RETURN_IF_ERROR(tile_order(shape, &unused));
  if (dtype != MG_BFLOAT16 || out_dtype != MG_BFLOAT16 || !pingpong_fprop_fits(call)) return MG_OK;
  const char* tile = std::getenv(kTileEnv);
  *chosen = (tile == nullptr || tile[0] == '\0') &&
            prefer_pingpong_fprop(shape, call.gather_a.index != nullptr, call.swiglu_h != nullptr);
  int forced = 0;
  MG_RETURN_IF_ERROR(env_choice(kFpropEnv, {"auto", "pingpong", "cutlass"}, &forced));
  if (forced != 0) *chosen = forced == 1;
  return MG_OK;
}

// A validated fprop (tokens, weight, out; bias, gather_a and swiglu_h where
// set) on the ping-pong kernel where pingpong_chosen says so, else on the
// cooperative kernel, followed for swiglu_h by the SwiGLU pass.
mg_status run_fprop(const mg_grouped_problem* p, GroupedGemmCall call, mg_dtype out_dtype, void* stream) {
  call.kind = MG_GEMM_FPROP;
  set_problem(call, p, 0, nullptr);
  bool pingpong = false;
  MG_RETURN_IF_ERROR(pingpong_chosen(call, p->dtype, out_dtype, &pingpong));
  if (pingpong) {
    DeviceGuard guard;
    MG_RETURN_IF_ERROR(guard.enter(p->device));
    MG_RETURN_IF_ERROR(sm_count(p->device, &call.sm_count));
    MG_RETURN_IF_ERROR(pingpong_fprop_bf16(call, static_cast<cudaStream_t>(stream)));
    return ok();
  }
  void* h = call.swiglu_h;
  call.swiglu_h = nullptr;
  MG_RETURN_IF_ERROR(run_gemm(p, call, out_dtype, stream));
  if (h == nullptr) return ok();
  return mg_swiglu_forward(call.out, out_dtype, p->total_rows, p->n / 2, h, stream);
}

// A gathered operand: a device index and a bf16 source of 1 .. 2^31 - 1 rows
// (TMA row coordinates are 32-bit), `cols` wide. Only bf16 kernels gather.
mg_status check_gather(const mg_grouped_problem* p, const char* op, const char* name,
                       const void* source, const mg_row_gather& rows, int64_t cols, RowGather* out) {
  if (p->dtype != MG_BFLOAT16) {
    return fail(MG_ERROR_UNSUPPORTED, "%s: gathered kernels are built for bf16 operands, got %s", op,
                dtype_name(p->dtype));
  }
  if (rows.index == nullptr) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: %s's row index must be a device pointer, got NULL", op, name);
  }
  if (reinterpret_cast<uintptr_t>(rows.index) % alignof(int32_t) != 0) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: %s's row index must be 4-byte aligned", op, name);
  }
  if (rows.source_rows < 1 || rows.source_rows > INT32_MAX) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: %s's source_rows must be in [1, 2^31), got %lld", op, name,
                static_cast<long long>(rows.source_rows));
  }
  MG_RETURN_IF_ERROR(check_aligned(op, name, source, false));
  *out = RowGather{rows.index, rows.source_rows, cols};
  return MG_OK;
}

// Names of a gathered GEMM's operands, as its errors give them.
struct GatheredNames {
  const char* op;
  const char* a;          // the gathered operand
  const char* out;
  const char* out_dtype;
};

// The gathered fprop and dgrad: the problem, the output dtype, the gathered
// A (k wide for the fprop, n for the dgrad), the output and the weights
// checked in one order for both, then the fprop (ping-pong or cooperative)
// or the cooperative dgrad.
mg_status run_gathered(const mg_grouped_problem* p, mg_gemm_kind kind, const GatheredNames& names,
                       const void* a_source, const mg_row_gather& a_rows, mg_group_operand weight, void* out,
                       mg_dtype out_dtype, void* stream) {
  const char* op = names.op;
  MG_RETURN_IF_ERROR(check_gemm_problem(p, op));
  MG_RETURN_IF_ERROR(check_out_dtype(op, names.out_dtype, p->dtype, out_dtype));
  if (p->total_rows == 0) return ok();
  GroupedGemmCall call{};
  const int64_t cols = kind == MG_GEMM_FPROP ? p->k : p->n;
  MG_RETURN_IF_ERROR(check_gather(p, op, names.a, a_source, a_rows, cols, &call.gather_a));
  MG_RETURN_IF_ERROR(check_aligned(op, names.out, out, false));
  MG_RETURN_IF_ERROR(check_operand(op, "weight", weight, dtype_bytes(p->dtype)));
  call.tokens = a_source;
  call.weight = weight;
  call.out = out;
  if (kind == MG_GEMM_FPROP) return run_fprop(p, call, out_dtype, stream);
  call.kind = kind;
  return run_gemm(p, call, out_dtype, stream);
}

}  // namespace
}  // namespace moe_grouped::gemm

using namespace moe_grouped;
using namespace moe_grouped::gemm;

extern "C" {

mg_status mg_grouped_gemm_workspace_size(const mg_grouped_problem* p, mg_gemm_kind kind,
                                         size_t* out_bytes) {
  const char* op = "mg_grouped_gemm_workspace_size";
  if (out_bytes == nullptr) return fail(MG_ERROR_INVALID_ARGUMENT, "%s: out_bytes must not be NULL", op);
  MG_RETURN_IF_ERROR(check_kind(op, kind));
  MG_RETURN_IF_ERROR(check_gemm_problem(p, op));
  int sms = 0;
  MG_RETURN_IF_ERROR(sm_count(p->device, &sms));
  *out_bytes = workspace_bytes(kind, p->dtype, p->num_groups, sms);
  return ok();
}

mg_status mg_grouped_fprop(const mg_grouped_problem* p, const void* x, mg_group_operand weight,
                           const void* bias, void* y, mg_dtype y_dtype, void* stream) {
  const char* op = "mg_grouped_fprop";
  MG_RETURN_IF_ERROR(check_gemm_problem(p, op));
  MG_RETURN_IF_ERROR(check_out_dtype(op, "y_dtype", p->dtype, y_dtype));
  bool empty = p->total_rows == 0;
  MG_RETURN_IF_ERROR(check_aligned(op, "x", x, empty));
  MG_RETURN_IF_ERROR(check_aligned(op, "y", y, empty));
  MG_RETURN_IF_ERROR(check_operand(op, "weight", weight, dtype_bytes(p->dtype)));
  if (empty) return ok();
  GroupedGemmCall call{};
  call.tokens = x;
  call.weight = weight;
  call.bias = bias;
  call.out = y;
  return run_fprop(p, call, y_dtype, stream);
}

mg_status mg_grouped_dgrad(const mg_grouped_problem* p, const void* dy, mg_group_operand weight,
                           void* dx, mg_dtype dx_dtype, void* stream) {
  const char* op = "mg_grouped_dgrad";
  MG_RETURN_IF_ERROR(check_gemm_problem(p, op));
  MG_RETURN_IF_ERROR(check_out_dtype(op, "dx_dtype", p->dtype, dx_dtype));
  bool empty = p->total_rows == 0;
  MG_RETURN_IF_ERROR(check_aligned(op, "dy", dy, empty));
  MG_RETURN_IF_ERROR(check_aligned(op, "dx", dx, empty));
  MG_RETURN_IF_ERROR(check_operand(op, "weight", weight, dtype_bytes(p->dtype)));
  if (empty) return ok();
  GroupedGemmCall call{};
  call.kind = MG_GEMM_DGRAD;
  call.tokens = dy;
  call.weight = weight;
  call.out = dx;
  return run_gemm(p, call, dx_dtype, stream);
}

mg_status mg_grouped_wgrad(const mg_grouped_problem* p, const void* dy, const void* x,
                           mg_group_operand dw, mg_dtype dw_dtype, int accumulate, void* stream) {
  const char* op = "mg_grouped_wgrad";
  MG_RETURN_IF_ERROR(check_gemm_problem(p, op));
  MG_RETURN_IF_ERROR(check_out_dtype(op, "dw_dtype", p->dtype, dw_dtype));
  // With no tokens at all the GEMM has no tiles; the zero fill still runs.
  bool empty = p->total_rows == 0;
  MG_RETURN_IF_ERROR(check_aligned(op, "dy", dy, empty));
  MG_RETURN_IF_ERROR(check_aligned(op, "x", x, empty));
  MG_RETURN_IF_ERROR(check_operand(op, "dw", dw, dtype_bytes(dw_dtype)));
  GroupedGemmCall call{};
  call.kind = MG_GEMM_WGRAD;
  call.tokens = dy;
  call.tokens_b = x;
  call.weight = dw;
  call.accumulate = accumulate != 0;
  return run_gemm(p, call, dw_dtype, stream);
}

mg_status mg_grouped_fprop_gathered(const mg_grouped_problem* p, const void* x_source, mg_row_gather x_rows,
                                    mg_group_operand weight, void* y, mg_dtype y_dtype, void* stream) {
  return run_gathered(p, MG_GEMM_FPROP, {"mg_grouped_fprop_gathered", "x", "y", "y_dtype"}, x_source, x_rows, weight,
                      y, y_dtype, stream);
}

mg_status mg_grouped_fprop_swiglu(const mg_grouped_problem* p, const void* x, const mg_row_gather* x_rows,
                                  mg_group_operand weight, void* g, void* h, void* stream) {
  const char* op = "mg_grouped_fprop_swiglu";
  MG_RETURN_IF_ERROR(check_gemm_problem(p, op));
  if (p->dtype != MG_BFLOAT16) {
    return fail(MG_ERROR_UNSUPPORTED, "%s: built for bf16 operands, got %s", op, dtype_name(p->dtype));
  }
  if (p->n % 16 != 0) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: n (2 * ffn, gate then up) must be a multiple of 16, got %lld", op,
                static_cast<long long>(p->n));
  }
  const bool empty = p->total_rows == 0;
  MG_RETURN_IF_ERROR(check_aligned(op, "g", g, empty));
  MG_RETURN_IF_ERROR(check_aligned(op, "h", h, empty));
  MG_RETURN_IF_ERROR(check_operand(op, "weight", weight, dtype_bytes(p->dtype)));
  GroupedGemmCall call{};
  // No rows: nothing is read, and an empty index has no storage (NULL), as in the other gathered ops.
  if (x_rows != nullptr && !empty) {
    MG_RETURN_IF_ERROR(check_gather(p, op, "x", x, *x_rows, p->k, &call.gather_a));
  } else {
    MG_RETURN_IF_ERROR(check_aligned(op, "x", x, empty));
  }
  if (empty) return ok();
  call.tokens = x;
  call.weight = weight;
  call.out = g;
  call.swiglu_h = h;
  return run_fprop(p, call, MG_BFLOAT16, stream);
}

mg_status mg_grouped_dgrad_gathered(const mg_grouped_problem* p, const void* dy_source, mg_row_gather dy_rows,
                                    mg_group_operand weight, void* dx, mg_dtype dx_dtype, void* stream) {
  return run_gathered(p, MG_GEMM_DGRAD, {"mg_grouped_dgrad_gathered", "dy", "dx", "dx_dtype"}, dy_source, dy_rows,
                      weight, dx, dx_dtype, stream);
}

mg_status mg_grouped_wgrad_gathered(const mg_grouped_problem* p, const void* dy, const mg_row_gather* dy_rows,
                                    const void* x, const mg_row_gather* x_rows, mg_group_operand dw,
                                    mg_dtype dw_dtype, int accumulate, void* stream) {
  const char* op = "mg_grouped_wgrad_gathered";
  MG_RETURN_IF_ERROR(check_gemm_problem(p, op));
  MG_RETURN_IF_ERROR(check_out_dtype(op, "dw_dtype", p->dtype, dw_dtype));
  MG_RETURN_IF_ERROR(check_operand(op, "dw", dw, dtype_bytes(dw_dtype)));
  GroupedGemmCall call{};
  // With no tokens at all the GEMM has no tiles; the zero fill still runs.
  const bool empty = p->total_rows == 0;
  if (dy_rows != nullptr && !empty) {
    MG_RETURN_IF_ERROR(check_gather(p, op, "dy", dy, *dy_rows, p->n, &call.gather_a));
  } else {
    MG_RETURN_IF_ERROR(check_aligned(op, "dy", dy, empty));
  }
  if (x_rows != nullptr && !empty) {
    MG_RETURN_IF_ERROR(check_gather(p, op, "x", x, *x_rows, p->k, &call.gather_b));
  } else {
    MG_RETURN_IF_ERROR(check_aligned(op, "x", x, empty));
  }
  call.kind = MG_GEMM_WGRAD;
  call.tokens = dy;
  call.tokens_b = x;
  call.weight = dw;
  call.accumulate = accumulate != 0;
  return run_gemm(p, call, dw_dtype, stream);
}

mg_status mg_grouped_dgrad_swiglu_partial_cols(int64_t k, int64_t* out_cols) {
  const char* op = "mg_grouped_dgrad_swiglu_partial_cols";
  if (out_cols == nullptr) return fail(MG_ERROR_INVALID_ARGUMENT, "%s: out_cols must not be NULL", op);
  if (k < 0) return fail(MG_ERROR_INVALID_ARGUMENT, "%s: k must be >= 0, got %lld", op, static_cast<long long>(k));
  *out_cols = (k + kSwigluBackwardTileColumns - 1) / kSwigluBackwardTileColumns;
  return ok();
}

mg_status mg_grouped_dgrad_swiglu(const mg_grouped_problem* p, const void* dy, mg_group_operand weight, void* g,
                                  const float* weights, void* wh, float* dprob_partials, int64_t partial_cols,
                                  void* stream) {
  const char* op = "mg_grouped_dgrad_swiglu";
  MG_RETURN_IF_ERROR(check_gemm_problem(p, op));
  if (p->dtype != MG_BFLOAT16) {
    return fail(MG_ERROR_UNSUPPORTED, "%s: built for bf16 operands, got %s", op, dtype_name(p->dtype));
  }
  const bool empty = p->total_rows == 0;
  MG_RETURN_IF_ERROR(check_aligned(op, "dy", dy, empty));
  MG_RETURN_IF_ERROR(check_aligned(op, "g", g, empty));
  MG_RETURN_IF_ERROR(check_aligned(op, "wh", wh, empty));
  MG_RETURN_IF_ERROR(check_operand(op, "weight", weight, dtype_bytes(p->dtype)));
  if (weights != nullptr && reinterpret_cast<uintptr_t>(weights) % alignof(float) != 0) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: weights must be 4-byte aligned", op);
  }
  int64_t cols = 0;
  MG_RETURN_IF_ERROR(mg_grouped_dgrad_swiglu_partial_cols(p->k, &cols));
  if (dprob_partials != nullptr && partial_cols != cols) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: dprob_partials needs %lld columns for k = %lld, got %lld", op,
                static_cast<long long>(cols), static_cast<long long>(p->k), static_cast<long long>(partial_cols));
  }
  if (dprob_partials != nullptr && reinterpret_cast<uintptr_t>(dprob_partials) % alignof(float) != 0) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: dprob_partials must be 4-byte aligned", op);
  }
  if (empty) return ok();
  GroupedGemmCall call{};
  call.kind = MG_GEMM_DGRAD;
  call.tokens = dy;
  call.weight = weight;
  call.out = wh;
  call.swiglu = SwigluBackwardOperands{g, weights, dprob_partials, cols};
  return run_gemm(p, call, p->dtype, stream);
}

mg_status mg_grouped_dbias(const mg_grouped_problem* p, const void* dy, void* dbias,
                           mg_dtype dbias_dtype, void* stream) {
  const char* op = "mg_grouped_dbias";
  MG_RETURN_IF_ERROR(check_problem(p, op));
  if (p->n <= 0 || p->n > INT32_MAX) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: n must be in [1, 2^31), got %lld", op,
                static_cast<long long>(p->n));
  }
  MG_RETURN_IF_ERROR(check_out_dtype(op, "dbias_dtype", p->dtype, dbias_dtype));
  if (dbias == nullptr) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: dbias must be a device pointer, got NULL", op);
  }
  if (dy == nullptr && p->total_rows > 0) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: dy must be a device pointer, got NULL", op);
  }
  DeviceGuard guard;
  MG_RETURN_IF_ERROR(guard.enter(p->device));
  DbiasCall call{p->num_groups, p->total_rows, p->n, p->m_splits, p->splits_dtype,
                 dy, p->dtype, dbias, dbias_dtype};
  MG_RETURN_IF_ERROR(grouped_dbias(call, static_cast<cudaStream_t>(stream)));
  return ok();
}

}  // extern "C"
