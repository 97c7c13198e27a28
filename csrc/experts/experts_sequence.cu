// The fused experts path's host-side sequences: the routing index's inverse
// (the token of each permuted row), the fused op's forward up to fc2 in one
// call and its backward in two. They call the core's own entry points in the
// order and with the arguments moe_grouped/experts.py's Python stages use, so
// the results are theirs bit for bit; what they save is the host's work
// between the calls (one crossing from Python per phase, not one per kernel).
#include <cuda_runtime.h>

#include <cstdint>

#include "core/device_guard.h"
#include "core/error.h"
#include "experts/sequence_common.h"
#include "permute/permute.h"

namespace moe_grouped {
namespace {

using sequence::aligned;
using sequence::check_scratch_aligned;
using sequence::check_sizes;
using sequence::gemm_problem;

constexpr int kThreads = 256;

size_t element_bytes(mg_dtype dtype) { return dtype == MG_FLOAT32 ? 4 : 2; }

__global__ void __launch_bounds__(kThreads)
    source_rows_kernel(const int64_t* row_id_map, int64_t num_copies, int top_k, int64_t num_rows, int32_t* source) {
  for (int64_t copy = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; copy < num_copies;
       copy += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = row_id_map[copy];
    if (row >= 0 && row < num_rows) source[row] = static_cast<int32_t>(copy / top_k);
  }
}

// Where each phase's buffers sit in its scratch.
struct Fc2Scratch {
  void* rows;          // [R, H]: dy_u
  void* wh;            // [R, I]: dh_u, then w * h
  float* row_weights;  // [R]
  float* dprob;        // [R]
  size_t bytes;
};

Fc2Scratch carve_fc2(void* base, int64_t rows, int64_t hidden, int64_t ffn, mg_dtype dtype) {
  auto* p = static_cast<char*>(base);
  Fc2Scratch s{};
  size_t at = 0;
  s.rows = p + at;
  at += aligned(rows * hidden * element_bytes(dtype));
  s.wh = p + at;
  at += aligned(rows * ffn * element_bytes(dtype));
  s.row_weights = reinterpret_cast<float*>(p + at);
  at += aligned(rows * sizeof(float));
  s.dprob = reinterpret_cast<float*>(p + at);
  at += aligned(rows * sizeof(float));
  s.bytes = at;
  return s;
}

mg_status check_args(const mg_experts_backward_args* a, const char* op) {
  if (a == nullptr) return fail(MG_ERROR_INVALID_ARGUMENT, "%s: args must not be NULL", op);
  const mg_grouped_problem& p = a->problem;
  if (p.dtype != MG_BFLOAT16 && p.dtype != MG_FLOAT16) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: the sequence runs bf16 or fp16 operands, got %s", op,
                dtype_name(p.dtype));
  }
  MG_RETURN_IF_ERROR(check_sizes(a, op));
  if (a->row_id_map == nullptr || a->g == nullptr || a->scratch == nullptr) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: row_id_map, g and scratch must be device pointers", op);
  }
  return check_scratch_aligned(a->scratch, op);
}

// The token rows of `x` [T, H] into `out` [R, H] through the routing index,
// zeroed first when rows no copy maps to exist; with copy_values (else
// NULL), each copy's value also goes to row_values at its row.
mg_status permute_tokens_into(const void* x, const mg_experts_backward_args* a, void* out, const float* copy_values,
                              float* row_values, cudaStream_t stream) {
  const mg_grouped_problem& p = a->problem;
  if (a->zero_unmapped != 0) {
    MG_CUDA_RETURN(cudaMemsetAsync(out, 0, p.total_rows * a->hidden * element_bytes(p.dtype), stream));
  }
  return permute_rows_and_values(x, p.dtype, a->num_tokens, a->hidden, a->top_k, a->row_id_map, out, copy_values,
                                 row_values, stream);
}

}  // namespace
}  // namespace moe_grouped

using namespace moe_grouped;

extern "C" {

mg_status mg_permute_source_rows(const int64_t* row_id_map, int64_t num_copies, int top_k, int64_t num_rows,
                                 int32_t* source, void* stream) {
  MG_ENTER_DEVICE_OF(source);
  const char* op = "mg_permute_source_rows";
  if (num_copies < 0 || num_rows < 0 || top_k <= 0) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: num_copies, num_rows must be >= 0 and top_k > 0, got %lld, %lld, %d",
                op, static_cast<long long>(num_copies), static_cast<long long>(num_rows), top_k);
  }
  if (num_rows == 0) return ok();
  if (source == nullptr || (num_copies > 0 && row_id_map == nullptr)) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: row_id_map and source must be device pointers", op);
  }
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  MG_CUDA_RETURN(cudaMemsetAsync(source, 0xff, num_rows * sizeof(int32_t), cuda_stream));  // -1 everywhere
  if (num_copies == 0) return ok();
  const int64_t blocks = (num_copies + kThreads - 1) / kThreads;
  source_rows_kernel<<<static_cast<unsigned>(blocks < 4096 ? blocks : 4096), kThreads, 0, cuda_stream>>>(
      row_id_map, num_copies, top_k, num_rows, source);
  MG_CUDA_RETURN(cudaGetLastError());
  return ok();
}

mg_status mg_experts_forward_scratch_bytes(int64_t rows, int64_t ffn, mg_dtype dtype, size_t* out_bytes) {
  const char* op = "mg_experts_forward_scratch_bytes";
  if (out_bytes == nullptr) return fail(MG_ERROR_INVALID_ARGUMENT, "%s: out_bytes must not be NULL", op);
  if (rows < 0 || ffn < 0) return fail(MG_ERROR_INVALID_ARGUMENT, "%s: rows and ffn must be >= 0", op);
  *out_bytes = aligned(rows * sizeof(int32_t)) + aligned(rows * ffn * element_bytes(dtype));
  return ok();
}

mg_status mg_experts_forward_fc(const mg_experts_forward_args* a, void* stream) {
  MG_ENTER_DEVICE_OF(a != nullptr ? a->g : nullptr);
  const char* op = "mg_experts_forward_fc";
  if (a == nullptr) return fail(MG_ERROR_INVALID_ARGUMENT, "%s: args must not be NULL", op);
  const mg_grouped_problem& p = a->problem;
  if (p.dtype != MG_BFLOAT16) {
    return fail(MG_ERROR_UNSUPPORTED, "%s: the gathered fc1 runs bf16 operands, got %s", op, dtype_name(p.dtype));
  }
  MG_RETURN_IF_ERROR(check_sizes(a, op));
  if (a->row_id_map == nullptr || a->tokens == nullptr || a->scratch == nullptr || a->g == nullptr ||
      a->y == nullptr) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: row_id_map, tokens, scratch, g and y must be device pointers", op);
  }
  MG_RETURN_IF_ERROR(check_scratch_aligned(a->scratch, op));
  auto* index = static_cast<int32_t*>(a->scratch);
  void* h = static_cast<char*>(a->scratch) + aligned(p.total_rows * sizeof(int32_t));
  MG_RETURN_IF_ERROR(
      mg_permute_source_rows(a->row_id_map, a->num_tokens * a->top_k, a->top_k, p.total_rows, index, stream));
  const mg_grouped_problem fc1 = gemm_problem(p, 2 * a->ffn, a->hidden, MG_SLOT_FPROP_DGRAD);
  const mg_row_gather rows{index, a->num_tokens};
  MG_RETURN_IF_ERROR(mg_grouped_fprop_swiglu(&fc1, a->tokens, &rows, a->w1, a->g, h, stream));
  const mg_grouped_problem fc2 = gemm_problem(p, a->hidden, a->ffn, MG_SLOT_FPROP_DGRAD);
  return mg_grouped_fprop(&fc2, h, a->w2, nullptr, a->y, p.dtype, stream);
}

mg_status mg_experts_backward_scratch_bytes(int phase, int64_t rows, int64_t hidden, int64_t ffn, mg_dtype dtype,
                                            size_t* out_bytes) {
  const char* op = "mg_experts_backward_scratch_bytes";
  if (out_bytes == nullptr) return fail(MG_ERROR_INVALID_ARGUMENT, "%s: out_bytes must not be NULL", op);
  if (rows < 0 || hidden < 0 || ffn < 0) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: rows, hidden and ffn must be >= 0", op);
  }
  if (phase == 2) {
    *out_bytes = carve_fc2(nullptr, rows, hidden, ffn, dtype).bytes;
  } else if (phase == 1) {
    *out_bytes = aligned(rows * hidden * element_bytes(dtype));
  } else {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: phase must be 2 (fc2) or 1 (fc1), got %d", op, phase);
  }
  return ok();
}

mg_status mg_experts_backward_fc2(const mg_experts_backward_args* a, void* stream) {
  MG_ENTER_DEVICE_OF(a != nullptr ? a->g : nullptr);
  MG_RETURN_IF_ERROR(check_args(a, "mg_experts_backward_fc2"));
  if (a->dout == nullptr || a->probs == nullptr) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "mg_experts_backward_fc2: dout and probs must be device pointers");
  }
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  const mg_grouped_problem& p = a->problem;
  const int64_t copies = a->num_tokens * a->top_k;
  const Fc2Scratch s = carve_fc2(a->scratch, p.total_rows, a->hidden, a->ffn, p.dtype);
  // dy_u, and each copy's routing weight at its row (0 where no copy is) from the same launch: the values
  // the two permute_rows calls of the Python stages write.
  MG_CUDA_RETURN(cudaMemsetAsync(s.row_weights, 0, p.total_rows * sizeof(float), cuda_stream));
  MG_RETURN_IF_ERROR(permute_tokens_into(a->dout, a, s.rows, a->probs, s.row_weights, cuda_stream));
  const mg_grouped_problem fc2 = gemm_problem(p, a->hidden, a->ffn, MG_SLOT_FPROP_DGRAD);
  MG_RETURN_IF_ERROR(mg_grouped_dgrad(&fc2, s.rows, a->w2, s.wh, p.dtype, stream));
  MG_RETURN_IF_ERROR(mg_swiglu_weighted_backward(s.wh, a->g, s.row_weights, p.m_splits, p.splits_dtype,
                                                 p.num_groups, p.dtype, p.total_rows, a->ffn, a->g, s.wh,
                                                 s.dprob, /*zero_tail=*/0, stream));
  if (a->dw2 != nullptr) {
    const mg_grouped_problem wgrad = gemm_problem(p, a->hidden, a->ffn, MG_SLOT_WGRAD);
    const mg_group_operand dw2{a->dw2, a->hidden * a->ffn, nullptr};
    MG_RETURN_IF_ERROR(mg_grouped_wgrad(&wgrad, s.rows, s.wh, dw2, p.dtype, /*accumulate=*/0, stream));
  }
  if (a->dprobs != nullptr) {
    MG_RETURN_IF_ERROR(mg_unpermute_rows(s.dprob, MG_FLOAT32, copies, 1, 1, a->row_id_map, nullptr, MG_FLOAT32,
                                         a->dprobs, stream));
  }
  return ok();
}

mg_status mg_experts_backward_fc1(const mg_experts_backward_args* a, void* stream) {
  MG_ENTER_DEVICE_OF(a != nullptr ? a->g : nullptr);
  MG_RETURN_IF_ERROR(check_args(a, "mg_experts_backward_fc1"));
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  const mg_grouped_problem& p = a->problem;
  void* rows = a->scratch;  // [R, H]: dxp, then the gathered tokens
  if (a->dx != nullptr) {
    const mg_grouped_problem fc1 = gemm_problem(p, 2 * a->ffn, a->hidden, MG_SLOT_FPROP_DGRAD);
    MG_RETURN_IF_ERROR(mg_grouped_dgrad(&fc1, a->g, a->w1, rows, p.dtype, stream));
    MG_RETURN_IF_ERROR(mg_unpermute_rows(rows, p.dtype, a->num_tokens, a->hidden, a->top_k, a->row_id_map, nullptr,
                                         p.dtype, a->dx, stream));
  }
  if (a->dw1 != nullptr) {
    if (a->tokens == nullptr) {
      return fail(MG_ERROR_INVALID_ARGUMENT, "mg_experts_backward_fc1: tokens must be a device pointer");
    }
    MG_RETURN_IF_ERROR(permute_tokens_into(a->tokens, a, rows, nullptr, nullptr, cuda_stream));
    const mg_grouped_problem wgrad = gemm_problem(p, 2 * a->ffn, a->hidden, MG_SLOT_WGRAD);
    const mg_group_operand dw1{a->dw1, 2 * a->ffn * a->hidden, nullptr};
    MG_RETURN_IF_ERROR(mg_grouped_wgrad(&wgrad, a->g, rows, dw1, p.dtype, /*accumulate=*/0, stream));
  }
  return ok();
}

}  // extern "C"
