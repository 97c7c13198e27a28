// The FP8 fused experts path's stages (moe_grouped/fp8/experts.py, Fp8Stages) as core calls. Each stage
// runs the kernels the Python stages run between two of their allocations, in their order and with
// their arguments, so the results are theirs bit for bit and every buffer is the caller's, taken where
// the Python stages take theirs (the same peak memory). What it saves is the host's work between the
// kernels: one crossing from Python per stage, not one op call per kernel.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/device_guard.h"
#include "core/error.h"
#include "experts/sequence_common.h"
#include "fp8_gemm/fp8_gemm.h"

namespace moe_grouped {
namespace {

using sequence::aligned;
using sequence::check_scratch_aligned;
using sequence::check_sizes;
using sequence::gemm_problem;

constexpr int64_t kBlock = 128;  // 1x128 quantization blocks

// A row-wise copy of [rows, cols]: fp8 data, then its [rows, ceil(cols / 128)] scales.
size_t rowwise_bytes(int64_t rows, int64_t cols) {
  return aligned(rows * cols) + aligned(rows * ((cols + kBlock - 1) / kBlock) * sizeof(float));
}

// A grouped column-wise copy of [rows, cols] (mg_quantize_columnwise_grouped_1x128's layout):
// qt [cols, padded rows], then its scales.
size_t columnwise_bytes(int64_t rows, int64_t cols, int num_groups) {
  return aligned(cols * columnwise_padded_rows(rows, num_groups)) +
         aligned(columnwise_scale_rows(rows, num_groups) * cols * sizeof(float));
}

// The fp8 operand that sits at `base`: data first, scales after (rowwise_bytes / columnwise_bytes).
mg_fp8_operand operand_at(void* base, size_t data_bytes, mg_dtype dtype) {
  auto* p = static_cast<char*>(base);
  return mg_fp8_operand{p, reinterpret_cast<const float*>(p + aligned(data_bytes)), dtype};
}

mg_status check(const mg_experts_fp8_args* a, const char* op) {
  if (a == nullptr) return fail(MG_ERROR_INVALID_ARGUMENT, "%s: args must not be NULL", op);
  const mg_grouped_problem& p = a->problem;
  if (p.dtype != MG_BFLOAT16) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: the FP8 stages run bf16 tokens, got %s", op, dtype_name(p.dtype));
  }
  MG_RETURN_IF_ERROR(check_sizes(a, op));
  if (a->row_id_map == nullptr || a->index == nullptr || a->g == nullptr) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: row_id_map, index and g must be device pointers", op);
  }
  return check_scratch_aligned(a->scratch, op);
}

mg_status require(bool present, const char* what, const char* op) {
  return present ? MG_OK : fail(MG_ERROR_INVALID_ARGUMENT, "%s: %s must be given for this stage", op, what);
}

}  // namespace
}  // namespace moe_grouped

using namespace moe_grouped;

extern "C" {

mg_status mg_experts_fp8_scratch_bytes(int stage, int64_t rows, int64_t hidden, int64_t ffn, int num_groups,
                                       size_t* out_bytes) {
  const char* op = "mg_experts_fp8_scratch_bytes";
  if (out_bytes == nullptr) return fail(MG_ERROR_INVALID_ARGUMENT, "%s: out_bytes must not be NULL", op);
  if (rows < 0 || hidden < 0 || ffn < 0 || num_groups < 0) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: rows, hidden, ffn and num_groups must be >= 0", op);
  }
  switch (stage) {
    case MG_FP8_FORWARD_FC1: *out_bytes = rowwise_bytes(rows, hidden); break;
    case MG_FP8_FORWARD_FC2: *out_bytes = rowwise_bytes(rows, ffn); break;
    case MG_FP8_BACKWARD_FC2_DGRAD: *out_bytes = rowwise_bytes(rows, hidden); break;
    case MG_FP8_BACKWARD_FC1_DGRAD: *out_bytes = rowwise_bytes(rows, 2 * ffn); break;
    case MG_FP8_BACKWARD_FC1_WGRAD: *out_bytes = columnwise_bytes(rows, hidden, num_groups); break;
    case MG_FP8_BACKWARD_SWIGLU:
    case MG_FP8_BACKWARD_FC2_WGRAD:
    case MG_FP8_BACKWARD_DPROBS:
    case MG_FP8_BACKWARD_DX:
    case MG_FP8_BACKWARD_DG_COLUMNWISE: *out_bytes = 0; break;
    default: return fail(MG_ERROR_INVALID_ARGUMENT, "%s: unknown stage %d", op, stage);
  }
  return MG_OK;
}

mg_status mg_experts_fp8_stage(const mg_experts_fp8_args* a, int stage, void* stream) {
  MG_ENTER_DEVICE_OF(a != nullptr ? a->g : nullptr);
  const char* op = "mg_experts_fp8_stage";
  MG_RETURN_IF_ERROR(check(a, op));
  const mg_grouped_problem& p = a->problem;
  const int64_t rows = p.total_rows, hidden = a->hidden, ffn = a->ffn, copies = a->num_tokens * a->top_k;
  const int groups = p.num_groups;
  const mg_quantize_config fwd = a->forward, bwd = a->backward;
  switch (stage) {
    case MG_FP8_FORWARD_FC1: {  // Fp8Stages.fc1_swiglu up to fc1: the index (kept), x's rows, g
      MG_RETURN_IF_ERROR(require(a->tokens != nullptr, "tokens", op));
      MG_RETURN_IF_ERROR(mg_permute_source_rows(a->row_id_map, copies, a->top_k, rows, a->index, stream));
      const mg_fp8_operand xq = operand_at(a->scratch, rows * hidden, fwd.fp8_dtype);
      MG_RETURN_IF_ERROR(mg_quantize_gathered_1x128(a->tokens, MG_BFLOAT16, a->num_tokens, hidden, a->index, rows,
                                                    nullptr, p.splits_dtype, 0, fwd, const_cast<void*>(xq.data),
                                                    const_cast<float*>(xq.scale_inv), nullptr, nullptr, p.device,
                                                    MG_SLOT_WGRAD, stream));
      const mg_grouped_problem fc1 = gemm_problem(p, 2 * ffn, hidden, MG_SLOT_FPROP_DGRAD);
      return mg_grouped_fp8_fprop(&fc1, xq, a->w1, nullptr, a->g, stream);
    }
    case MG_FP8_FORWARD_FC2: {  // h = swiglu(g) quantized, then fc2
      MG_RETURN_IF_ERROR(require(a->y != nullptr, "y", op));
      const mg_fp8_operand hq = operand_at(a->scratch, rows * ffn, fwd.fp8_dtype);
      MG_RETURN_IF_ERROR(mg_swiglu_quantize_rowwise_1x128(a->g, MG_BFLOAT16, rows, ffn, fwd,
                                                          const_cast<void*>(hq.data),
                                                          const_cast<float*>(hq.scale_inv), stream));
      const mg_grouped_problem fc2 = gemm_problem(p, hidden, ffn, MG_SLOT_FPROP_DGRAD);
      return mg_grouped_fp8_fprop(&fc2, hq, a->w2, nullptr, a->y, stream);
    }
    case MG_FP8_BACKWARD_FC2_DGRAD: {  // the row weights, dout through the index (both copies), fc2's dgrad
      MG_RETURN_IF_ERROR(require(a->dout != nullptr && a->probs != nullptr && a->row_weights != nullptr &&
                                     a->dh != nullptr && a->dout_t != nullptr && a->dout_t_scale_inv != nullptr,
                                 "dout, probs, row_weights, dh and dout_t", op));
      MG_CUDA_RETURN(cudaMemsetAsync(a->row_weights, 0, rows * sizeof(float), static_cast<cudaStream_t>(stream)));
      MG_RETURN_IF_ERROR(
          mg_permute_rows(a->probs, MG_FLOAT32, copies, 1, 1, a->row_id_map, a->row_weights, stream));
      const mg_fp8_operand dyq = operand_at(a->scratch, rows * hidden, bwd.fp8_dtype);
      MG_RETURN_IF_ERROR(mg_quantize_gathered_1x128(
          a->dout, MG_BFLOAT16, a->num_tokens, hidden, a->index, rows, p.m_splits, p.splits_dtype, groups, bwd,
          const_cast<void*>(dyq.data), const_cast<float*>(dyq.scale_inv), a->dout_t, a->dout_t_scale_inv, p.device,
          MG_SLOT_WGRAD, stream));
      const mg_grouped_problem fc2 = gemm_problem(p, hidden, ffn, MG_SLOT_FPROP_DGRAD);
      return mg_grouped_fp8_dgrad(&fc2, dyq, a->w2_t, a->dh, stream);
    }
    case MG_FP8_BACKWARD_SWIGLU:  // the weighted SwiGLU backward in place; wh column-wise when wh_t
      MG_RETURN_IF_ERROR(require(a->dh != nullptr && a->row_weights != nullptr && a->dprob != nullptr,
                                 "dh, row_weights and dprob", op));
      MG_RETURN_IF_ERROR(mg_swiglu_weighted_backward(a->dh, a->g, a->row_weights, p.m_splits, p.splits_dtype,
                                                     groups, MG_BFLOAT16, rows, ffn, a->g, a->dh, a->dprob,
                                                     /*zero_tail=*/0, stream));
      if (a->wh_t == nullptr) return MG_OK;
      return mg_quantize_columnwise_grouped_1x128(a->dh, MG_BFLOAT16, rows, ffn, p.m_splits, p.splits_dtype, groups,
                                                  fwd, a->wh_t, a->wh_t_scale_inv, nullptr, p.device,
                                                  MG_SLOT_WGRAD, stream);
    case MG_FP8_BACKWARD_FC2_WGRAD: {
      MG_RETURN_IF_ERROR(require(a->dout_t != nullptr && a->wh_t != nullptr && a->dw2 != nullptr,
                                 "dout_t, wh_t and dw2", op));
      const mg_grouped_problem wgrad = gemm_problem(p, hidden, ffn, MG_SLOT_WGRAD);
      const mg_fp8_operand dyt{a->dout_t, a->dout_t_scale_inv, bwd.fp8_dtype};
      const mg_fp8_operand wht{a->wh_t, a->wh_t_scale_inv, fwd.fp8_dtype};
      const mg_group_operand dw2{a->dw2, hidden * ffn, nullptr};
      return mg_grouped_fp8_wgrad(&wgrad, dyt, wht, dw2, MG_BFLOAT16, /*accumulate=*/0, stream);
    }
    case MG_FP8_BACKWARD_DPROBS:
      MG_RETURN_IF_ERROR(require(a->dprob != nullptr && a->dprobs != nullptr, "dprob and dprobs", op));
      return mg_unpermute_rows(a->dprob, MG_FLOAT32, copies, 1, 1, a->row_id_map, nullptr, MG_FLOAT32, a->dprobs,
                               stream);
    case MG_FP8_BACKWARD_FC1_DGRAD: {  // dg row-wise, fc1's dgrad into dxp
      MG_RETURN_IF_ERROR(require(a->dxp != nullptr, "dxp", op));
      const mg_fp8_operand dgq = operand_at(a->scratch, rows * 2 * ffn, bwd.fp8_dtype);
      MG_RETURN_IF_ERROR(mg_quantize_rowwise_1x128(a->g, MG_BFLOAT16, rows, 2 * ffn, bwd,
                                                   const_cast<void*>(dgq.data), const_cast<float*>(dgq.scale_inv),
                                                   stream));
      const mg_grouped_problem fc1 = gemm_problem(p, 2 * ffn, hidden, MG_SLOT_FPROP_DGRAD);
      return mg_grouped_fp8_dgrad(&fc1, dgq, a->w1_t, a->dxp, stream);
    }
    case MG_FP8_BACKWARD_DX:
      MG_RETURN_IF_ERROR(require(a->dxp != nullptr && a->dx != nullptr, "dxp and dx", op));
      return mg_unpermute_rows(a->dxp, MG_BFLOAT16, a->num_tokens, hidden, a->top_k, a->row_id_map, nullptr,
                               MG_BFLOAT16, a->dx, stream);
    case MG_FP8_BACKWARD_DG_COLUMNWISE:  // fc1's wgrad operand from dg (whose memory the caller then frees)
      MG_RETURN_IF_ERROR(require(a->dg_t != nullptr && a->dg_t_scale_inv != nullptr, "dg_t", op));
      return mg_quantize_columnwise_grouped_1x128(a->g, MG_BFLOAT16, rows, 2 * ffn, p.m_splits, p.splits_dtype,
                                                  groups, bwd, a->dg_t, a->dg_t_scale_inv, nullptr, p.device,
                                                  MG_SLOT_WGRAD, stream);
    case MG_FP8_BACKWARD_FC1_WGRAD: {  // the token rows column-wise through the index, fc1's wgrad
      MG_RETURN_IF_ERROR(require(a->tokens != nullptr && a->dg_t != nullptr && a->dg_t_scale_inv != nullptr &&
                                     a->dw1 != nullptr,
                                 "tokens, dg_t and dw1", op));
      const mg_fp8_operand xt =
          operand_at(a->scratch, hidden * columnwise_padded_rows(rows, groups), fwd.fp8_dtype);
      MG_RETURN_IF_ERROR(mg_quantize_gathered_1x128(a->tokens, MG_BFLOAT16, a->num_tokens, hidden, a->index, rows,
                                                    p.m_splits, p.splits_dtype, groups, fwd, nullptr, nullptr,
                                                    const_cast<void*>(xt.data), const_cast<float*>(xt.scale_inv),
                                                    p.device, MG_SLOT_WGRAD, stream));
      const mg_grouped_problem wgrad = gemm_problem(p, 2 * ffn, hidden, MG_SLOT_WGRAD);
      const mg_fp8_operand dgt{a->dg_t, a->dg_t_scale_inv, bwd.fp8_dtype};
      const mg_group_operand dw1{a->dw1, 2 * ffn * hidden, nullptr};
      return mg_grouped_fp8_wgrad(&wgrad, dgt, xt, dw1, MG_BFLOAT16, /*accumulate=*/0, stream);
    }
    default:
      return fail(MG_ERROR_INVALID_ARGUMENT, "%s: unknown stage %d", op, stage);
  }
}

}  // extern "C"
