// The SwiGLU backward of the fused MoE experts path, weighted by the routing
// weights, in one pass over the permuted rows.
//
// The fused path keeps g = [gate | up] (fc1's output) but not h = swiglu(g)
// nor the expert output y = h W2^T. Its backward starts from dh_u = dy_u W2,
// fc2's dgrad of the *unweighted* gathered output gradient, and needs per row
// r with routing weight w:
//   dg    = swiglu_backward(w * dh_u, g)       fc1's output gradient
//   wh    = w * h                              fc2's wgrad operand: dW2 = dy_u^T (w h)
//   dprob = <dh_u, h>  (= <dout_t, y_r>)       the routing weight's gradient
// so one pass reads g and dh_u once and writes what both wgrads, fc1's dgrad
// and the router need; no [rows, ffn] h or [rows, hidden] y is kept.
// Rounding follows the composed torch ops where they store a tensor, as in
// swiglu.cu; the per-element steps are in swiglu_backward_math.cuh, shared
// with fc2's dgrad epilogue, which fuses this pass
// (gemm/sm90_swiglu_backward_epilogue.cuh).
#include <cub/block/block_reduce.cuh>

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "activation/swiglu_backward_math.cuh"
#include "core/device_guard.h"
#include "core/elementwise.cuh"
#include "core/error.h"
#include "core/setup.cuh"

namespace moe_grouped {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpSize = 32;
constexpr int kRowsPerBlock = kThreads / kWarpSize;  // one warp per row
// Each block sums m_splits once; a grid-stride loop bounds that redundancy.
constexpr int64_t kMaxBlocks = 4096;

// The rows that hold real copies: the clamped sum of m_splits, cut at `rows`
// (offsets[num_groups] of the setup kernel). No m_splits: every row. Rows at
// or past it (e.g. the tail of a capacity-limited buffer) get dprob = 0 and,
// with zero_tail, dg = 0 and wh = 0, without reading rows no expert computed.
template <typename SplitT>
__device__ int64_t real_rows(const SplitT* m_splits, int num_groups, int64_t rows) {
  if (m_splits == nullptr) return rows;
  using Reduce = cub::BlockReduce<int64_t, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  __shared__ int64_t total;
  int64_t sum = 0;
  for (int g = threadIdx.x; g < num_groups; g += kThreads) {
    sum += clamp_split(static_cast<int64_t>(m_splits[g]), rows);
  }
  sum = Reduce(storage).Sum(sum);
  if (threadIdx.x == 0) total = sum < rows ? sum : rows;
  __syncthreads();
  return total;
}

// One warp per row. dprob = sum over the row of dh_u * h in fp32, in a fixed
// order (each lane sums its columns in order, then a butterfly), so the result
// is the same on every run. dh_u may alias wh and g may alias dg (in place):
// each element is read before the same thread writes it, so these pointers
// are not __restrict__.
template <typename T, int V, typename SplitT>
__global__ void __launch_bounds__(kThreads)
    swiglu_weighted_backward_kernel(const T* dh_u, const T* g, const float* __restrict__ weights,
                                    const SplitT* __restrict__ m_splits, int num_groups, int64_t rows,
                                    int64_t ffn, T* dg, T* wh, float* __restrict__ dprob, bool zero_tail) {
  const int64_t total = real_rows(m_splits, num_groups, rows);
  const int lane = threadIdx.x % kWarpSize;
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarpSize;
  const int64_t row_stride = static_cast<int64_t>(gridDim.x) * kRowsPerBlock;
  for (int64_t row = first_row; row < rows; row += row_stride) {
    const int64_t gate_row = row * 2 * ffn;
    const int64_t half_row = row * ffn;
    if (row >= total) {
      if (dprob != nullptr && lane == 0) dprob[row] = 0.f;
      if (!zero_tail) continue;
      Pack<T, V> zero;
#pragma unroll
      for (int j = 0; j < V; ++j) zero.v[j] = from_float<T>(0.f);
      for (int64_t col = static_cast<int64_t>(lane) * V; col < ffn; col += kWarpSize * V) {
        store_pack<T, V>(dg + gate_row + col, zero);
        store_pack<T, V>(dg + gate_row + ffn + col, zero);
        store_pack<T, V>(wh + half_row + col, zero);
      }
      continue;
    }
    const float w = weights != nullptr ? weights[row] : 1.f;
    float dot = 0.f;
    for (int64_t col = static_cast<int64_t>(lane) * V; col < ffn; col += kWarpSize * V) {
      const Pack<T, V> gate = load_pack<T, V>(g + gate_row + col);
      const Pack<T, V> up = load_pack<T, V>(g + gate_row + ffn + col);
      const Pack<T, V> grad = load_pack<T, V>(dh_u + half_row + col);
      Pack<T, V> d_gate, d_up, weighted;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        dot += swiglu_weighted_backward_element<T>(to_float(gate.v[j]), to_float(up.v[j]), to_float(grad.v[j]), w,
                                                   d_gate.v[j], d_up.v[j], weighted.v[j]);
      }
      store_pack<T, V>(dg + gate_row + col, d_gate);
      store_pack<T, V>(dg + gate_row + ffn + col, d_up);
      store_pack<T, V>(wh + half_row + col, weighted);
    }
    if (dprob != nullptr) {
#pragma unroll
      for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
        dot += __shfl_xor_sync(0xffffffffu, dot, offset);
      }
      if (lane == 0) dprob[row] = dot;
    }
  }
}

mg_status check_args(mg_dtype dtype, int64_t rows, int64_t ffn, mg_dtype splits_dtype, const void* m_splits,
                     int num_groups, std::initializer_list<const void*> pointers) {
  MG_RETURN_IF_ERROR(check_float_dtype("SwiGLU weighted backward tensors", dtype));
  if (rows < 0 || ffn < 0) {
    return fail(MG_ERROR_INVALID_ARGUMENT,
                "SwiGLU weighted backward needs rows >= 0 and ffn >= 0, got %lld and %lld",
                static_cast<long long>(rows), static_cast<long long>(ffn));
  }
  if (m_splits != nullptr) {
    if (splits_dtype != MG_INT32 && splits_dtype != MG_INT64) {
      return fail(MG_ERROR_INVALID_ARGUMENT, "m_splits must be int32 or int64, got %s", dtype_name(splits_dtype));
    }
    if (num_groups <= 0) {
      return fail(MG_ERROR_INVALID_ARGUMENT, "m_splits needs num_groups > 0, got %d", num_groups);
    }
  }
  if (rows > 0 && ffn > 0) {
    for (const void* p : pointers) {
      if (p == nullptr) {
        return fail(MG_ERROR_INVALID_ARGUMENT, "SwiGLU weighted backward: dh_u, g, dg and wh must not be NULL");
      }
    }
  }
  return MG_OK;
}

unsigned grid_for(int64_t rows) {
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

}  // namespace
}  // namespace moe_grouped

using namespace moe_grouped;

extern "C" mg_status mg_swiglu_weighted_backward(const void* dh_u, const void* g, const float* weights,
                                                 const void* m_splits, mg_dtype splits_dtype, int num_groups,
                                                 mg_dtype dtype, int64_t rows, int64_t ffn, void* dg, void* wh,
                                                 float* dprob, int zero_tail, void* stream) {
  MG_ENTER_DEVICE_OF(dg);
  MG_RETURN_IF_ERROR(check_args(dtype, rows, ffn, splits_dtype, m_splits, num_groups, {dh_u, g, dg, wh}));
  if (rows == 0) return ok();
  if (ffn == 0) {  // empty rows: only dprob, all zero
    if (dprob != nullptr) {
      MG_CUDA_RETURN(cudaMemsetAsync(dprob, 0, rows * sizeof(float), static_cast<cudaStream_t>(stream)));
    }
    return ok();
  }
  with_type(dtype, [&](auto zero) {
    using T = decltype(zero);
    auto launch = [&](auto vector, auto split) {
      constexpr int V = decltype(vector)::value;
      using SplitT = decltype(split);
      swiglu_weighted_backward_kernel<T, V, SplitT>
          <<<grid_for(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
              static_cast<const T*>(dh_u), static_cast<const T*>(g), weights,
              static_cast<const SplitT*>(m_splits), num_groups, rows, ffn, static_cast<T*>(dg),
              static_cast<T*>(wh), dprob, zero_tail != 0);
    };
    auto with_splits = [&](auto vector) {
      if (splits_dtype == MG_INT32 && m_splits != nullptr) {
        launch(vector, int32_t{});
      } else {
        launch(vector, int64_t{});
      }
    };
    // 16-byte packs when every row start of g, dg (halves of 2 * ffn) and of
    // dh_u, wh (rows of ffn) is 16-byte aligned.
    if (rows_are_16_byte_aligned<T>(ffn, {dh_u, g, dg, wh})) {
      with_splits(std::integral_constant<int, 16 / sizeof(T)>{});
    } else {
      with_splits(std::integral_constant<int, 1>{});
    }
  });
  MG_CUDA_RETURN(cudaGetLastError());
  return ok();
}
