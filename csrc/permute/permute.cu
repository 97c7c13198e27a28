// Token permutation for MoE dispatch and combine, driven by device expert
// indices: no host synchronisation, static buffer sizes, deterministic.
//
// Index pass (mg_permute_index), over the n = tokens * top_k token copies in
// chunks of kChunk copies, one CTA per chunk:
//   1. count   : counts[e][c] = copies of chunk c routed to expert e
//   2. scan    : one CTA, exclusive scan of counts in (expert, chunk) order
//                -> the first row of (e, c) in the permuted buffer; m_splits
//   3. position: row of each copy = base[e][c] + its rank among the copies of
//                chunk c with expert e (warp match + per-warp counts), so rows
//                are ordered by (expert, copy index): a stable sort.
// Row passes: gather / weighted gather-sum / its backward, one CTA per row.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "core/error.h"
#include "core/workspace.h"

namespace moe_grouped {
namespace {

constexpr int kChunk = 256;  // copies per CTA in the count and position passes
constexpr int kWarps = kChunk / 32;
constexpr int kScanThreads = 1024;
constexpr int kMaxExperts = 1024;  // position pass: kWarps * E int32 of shared memory
constexpr int kRowThreads = 128;

__device__ inline float to_float(float v) { return v; }
__device__ inline float to_float(__half v) { return __half2float(v); }
__device__ inline float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ inline T from_float(float v);
template <> __device__ inline float from_float<float>(float v) { return v; }
template <> __device__ inline __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// The expert of copy i, or -1 past the end or outside [0, num_experts).
template <typename IndexT>
__device__ inline int load_expert(const IndexT* experts, int64_t i, int64_t n, int num_experts) {
  if (i >= n) return -1;
  int64_t e = static_cast<int64_t>(experts[i]);
  return (e >= 0 && e < num_experts) ? static_cast<int>(e) : -1;
}

template <typename IndexT>
__global__ void __launch_bounds__(kChunk)
    count_kernel(const IndexT* __restrict__ experts, int64_t n, int num_experts, int num_chunks,
                 int32_t* __restrict__ counts) {
  extern __shared__ int32_t hist[];  // [num_experts]
  for (int e = threadIdx.x; e < num_experts; e += kChunk) hist[e] = 0;
  __syncthreads();
  int e = load_expert(experts, static_cast<int64_t>(blockIdx.x) * kChunk + threadIdx.x, n, num_experts);
  if (e >= 0) atomicAdd(&hist[e], 1);  // integer counts: order does not matter
  __syncthreads();
  for (int g = threadIdx.x; g < num_experts; g += kChunk) {
    counts[static_cast<int64_t>(g) * num_chunks + blockIdx.x] = hist[g];
  }
}

__global__ void __launch_bounds__(kScanThreads)
    scan_kernel(int32_t* __restrict__ counts, int num_experts, int num_chunks,
                int64_t* __restrict__ m_splits) {
  using Scan = cub::BlockScan<int32_t, kScanThreads>;
  __shared__ typename Scan::TempStorage storage;
  __shared__ int32_t carry;
  __shared__ int32_t starts[kMaxExperts + 1];
  const int64_t entries = static_cast<int64_t>(num_experts) * num_chunks;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int64_t base = 0; base < entries; base += kScanThreads) {
    int64_t j = base + threadIdx.x;
    int32_t value = j < entries ? counts[j] : 0;
    int32_t prefix = 0, total = 0;
    Scan(storage).ExclusiveSum(value, prefix, total);
    if (j < entries) {
      int32_t start = carry + prefix;
      counts[j] = start;
      if (j % num_chunks == 0) starts[j / num_chunks] = start;
    }
    __syncthreads();
    if (threadIdx.x == 0) carry += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) starts[num_experts] = carry;
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += kScanThreads) m_splits[e] = starts[e + 1] - starts[e];
}

template <typename IndexT>
__global__ void __launch_bounds__(kChunk)
    position_kernel(const IndexT* __restrict__ experts, int64_t n, int num_experts, int num_chunks,
                    const int32_t* __restrict__ bases, int64_t* __restrict__ row_id_map) {
  extern __shared__ int32_t warp_counts[];  // [kWarps][num_experts]
  for (int j = threadIdx.x; j < kWarps * num_experts; j += kChunk) warp_counts[j] = 0;
  __syncthreads();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kChunk + threadIdx.x;
  const int e = load_expert(experts, i, n, num_experts);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned peers = __match_any_sync(0xffffffffu, e);
  const unsigned lower = peers & ((1u << lane) - 1u);
  int rank = __popc(lower);
  if (e >= 0 && lower == 0) warp_counts[warp * num_experts + e] = __popc(peers);
  __syncthreads();
  if (i >= n) return;
  if (e < 0) {
    row_id_map[i] = -1;
    return;
  }
  for (int w = 0; w < warp; ++w) rank += warp_counts[w * num_experts + e];
  row_id_map[i] = static_cast<int64_t>(bases[static_cast<int64_t>(e) * num_chunks + blockIdx.x]) + rank;
}

// permuted[row_id_map[t * top_k + j]] = x[t]; one CTA per copy.
template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    permute_rows_kernel(const T* __restrict__ x, int64_t hidden, int top_k,
                        const int64_t* __restrict__ row_id_map, T* __restrict__ permuted) {
  const int64_t copy = blockIdx.x;
  const int64_t row = row_id_map[copy];
  if (row < 0) return;
  const T* src = x + (copy / top_k) * hidden;
  T* dst = permuted + row * hidden;
  for (int64_t h = threadIdx.x; h < hidden; h += kRowThreads) dst[h] = src[h];
}

// out[t] = sum_j w[t, j] * y[row_id_map[t * top_k + j]] (w = 1 when NULL); one CTA per token.
template <typename T, typename W>
__global__ void __launch_bounds__(kRowThreads)
    unpermute_rows_kernel(const T* __restrict__ y, int64_t hidden, int top_k,
                          const int64_t* __restrict__ row_id_map, const W* __restrict__ weights,
                          T* __restrict__ out) {
  const int64_t token = blockIdx.x;
  for (int64_t h = threadIdx.x; h < hidden; h += kRowThreads) {
    float acc = 0.f;
    for (int j = 0; j < top_k; ++j) {  // fixed order: deterministic
      const int64_t row = row_id_map[token * top_k + j];
      if (row < 0) continue;
      const float w = weights ? to_float(weights[token * top_k + j]) : 1.f;
      acc += w * to_float(y[row * hidden + h]);
    }
    out[token * hidden + h] = from_float<T>(acc);
  }
}

// dy[row] = w[t, j] * dout[t]; dw[t, j] = <dout[t], y[row]> (0 for dropped copies).
template <typename T, typename W>
__global__ void __launch_bounds__(kRowThreads)
    unpermute_rows_backward_kernel(const T* __restrict__ dout, const T* __restrict__ y, int64_t hidden,
                                   int top_k, const int64_t* __restrict__ row_id_map,
                                   const W* __restrict__ weights, T* __restrict__ dy,
                                   W* __restrict__ dweights) {
  using Reduce = cub::BlockReduce<float, kRowThreads>;
  __shared__ typename Reduce::TempStorage storage;
  const int64_t token = blockIdx.x;
  const T* g = dout + token * hidden;
  for (int j = 0; j < top_k; ++j) {
    const int64_t copy = token * top_k + j;
    const int64_t row = row_id_map[copy];
    if (row < 0) {
      if (threadIdx.x == 0 && dweights) dweights[copy] = from_float<W>(0.f);
      continue;
    }
    const float w = to_float(weights[copy]);
    float dot = 0.f;
    for (int64_t h = threadIdx.x; h < hidden; h += kRowThreads) {
      const float gv = to_float(g[h]);
      dy[row * hidden + h] = from_float<T>(w * gv);
      dot += gv * to_float(y[row * hidden + h]);
    }
    const float total = Reduce(storage).Sum(dot);
    if (threadIdx.x == 0 && dweights) dweights[copy] = from_float<W>(total);
    __syncthreads();  // storage is reused by the next copy
  }
}

mg_status check_float_dtype(const char* what, mg_dtype dtype) {
  if (dtype != MG_FLOAT32 && dtype != MG_FLOAT16 && dtype != MG_BFLOAT16) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s must be float32, float16 or bfloat16, got %s", what,
                dtype_name(dtype));
  }
  return MG_OK;
}

mg_status check_rows(int64_t num_tokens, int64_t hidden, int top_k) {
  if (num_tokens < 0 || hidden < 0 || top_k <= 0 || num_tokens * top_k > INT32_MAX) {
    return fail(MG_ERROR_INVALID_ARGUMENT,
                "need num_tokens >= 0, hidden >= 0, top_k > 0 and num_tokens * top_k < 2^31, got "
                "num_tokens=%lld hidden=%lld top_k=%d",
                static_cast<long long>(num_tokens), static_cast<long long>(hidden), top_k);
  }
  return MG_OK;
}

// Calls fn(T{}) for the element type named by dtype (checked beforehand).
template <typename Fn>
void with_type(mg_dtype dtype, Fn fn) {
  if (dtype == MG_FLOAT32) fn(float{});
  else if (dtype == MG_FLOAT16) fn(__half{});
  else fn(__nv_bfloat16{});
}

// The weights are float32 or the rows' own type.
mg_status check_weights_dtype(mg_dtype weights_dtype, mg_dtype dtype) {
  if (weights_dtype != MG_FLOAT32 && weights_dtype != dtype) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "weights must be float32 or the rows' dtype %s, got %s",
                dtype_name(dtype), dtype_name(weights_dtype));
  }
  return MG_OK;
}

template <typename IndexT>
mg_status launch_index(const IndexT* experts, int64_t n, int num_experts, int num_chunks, int32_t* counts,
                       int64_t* row_id_map, int64_t* m_splits, cudaStream_t stream) {
  const size_t hist_bytes = sizeof(int32_t) * num_experts;
  count_kernel<<<num_chunks, kChunk, hist_bytes, stream>>>(experts, n, num_experts, num_chunks, counts);
  MG_CUDA_RETURN(cudaGetLastError());
  scan_kernel<<<1, kScanThreads, 0, stream>>>(counts, num_experts, num_chunks, m_splits);
  MG_CUDA_RETURN(cudaGetLastError());
  position_kernel<<<num_chunks, kChunk, hist_bytes * kWarps, stream>>>(experts, n, num_experts, num_chunks,
                                                                       counts, row_id_map);
  MG_CUDA_RETURN(cudaGetLastError());
  return MG_OK;
}

}  // namespace
}  // namespace moe_grouped

using namespace moe_grouped;

extern "C" mg_status mg_permute_index(const void* experts, mg_dtype experts_dtype, int64_t num_tokens,
                                      int top_k, int num_experts, int64_t* row_id_map, int64_t* m_splits,
                                      int device, int workspace_slot, void* stream) {
  if (experts_dtype != MG_INT32 && experts_dtype != MG_INT64) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "experts must be int32 or int64, got %s", dtype_name(experts_dtype));
  }
  MG_RETURN_IF_ERROR(check_rows(num_tokens, 0, top_k));
  if (num_experts <= 0 || num_experts > kMaxExperts) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "num_experts must be in [1, %d], got %d", kMaxExperts, num_experts);
  }
  const int64_t n = num_tokens * top_k;
  if (m_splits == nullptr || (n > 0 && (experts == nullptr || row_id_map == nullptr))) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "experts, row_id_map and m_splits must be device pointers, got NULL");
  }
  // At least one chunk, so that an empty input still writes zero m_splits.
  const int num_chunks = n > 0 ? static_cast<int>((n + kChunk - 1) / kChunk) : 1;
  const size_t bytes = align_up(sizeof(int32_t) * static_cast<size_t>(num_experts) * num_chunks);
  void* scratch = nullptr;
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  MG_RETURN_IF_ERROR(workspace_get(device, workspace_slot, bytes, cuda_stream, &scratch));
  auto counts = static_cast<int32_t*>(scratch);
  mg_status status;
  if (experts_dtype == MG_INT32) {
    status = launch_index(static_cast<const int32_t*>(experts), n, num_experts, num_chunks, counts,
                          row_id_map, m_splits, cuda_stream);
  } else {
    status = launch_index(static_cast<const int64_t*>(experts), n, num_experts, num_chunks, counts,
                          row_id_map, m_splits, cuda_stream);
  }
  MG_RETURN_IF_ERROR(status);
  return ok();
}

extern "C" mg_status mg_permute_rows(const void* x, mg_dtype dtype, int64_t num_tokens, int64_t hidden,
                                     int top_k, const int64_t* row_id_map, void* permuted, void* stream) {
  MG_RETURN_IF_ERROR(check_float_dtype("x", dtype));
  MG_RETURN_IF_ERROR(check_rows(num_tokens, hidden, top_k));
  const int64_t n = num_tokens * top_k;
  if (n == 0 || hidden == 0) return ok();
  if (x == nullptr || row_id_map == nullptr || permuted == nullptr) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "x, row_id_map and permuted must be device pointers, got NULL");
  }
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    permute_rows_kernel<T><<<static_cast<unsigned>(n), kRowThreads, 0, cuda_stream>>>(
        static_cast<const T*>(x), hidden, top_k, row_id_map, static_cast<T*>(permuted));
  });
  MG_CUDA_RETURN(cudaGetLastError());
  return ok();
}

extern "C" mg_status mg_unpermute_rows(const void* y, mg_dtype dtype, int64_t num_tokens, int64_t hidden,
                                       int top_k, const int64_t* row_id_map, const void* weights,
                                       mg_dtype weights_dtype, void* out, void* stream) {
  MG_RETURN_IF_ERROR(check_float_dtype("y", dtype));
  MG_RETURN_IF_ERROR(check_rows(num_tokens, hidden, top_k));
  if (weights != nullptr) MG_RETURN_IF_ERROR(check_weights_dtype(weights_dtype, dtype));
  if (num_tokens == 0 || hidden == 0) return ok();
  if (y == nullptr || row_id_map == nullptr || out == nullptr) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "y, row_id_map and out must be device pointers, got NULL");
  }
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    const unsigned grid = static_cast<unsigned>(num_tokens);
    if (weights == nullptr || weights_dtype != MG_FLOAT32) {
      unpermute_rows_kernel<T, T><<<grid, kRowThreads, 0, cuda_stream>>>(
          static_cast<const T*>(y), hidden, top_k, row_id_map, static_cast<const T*>(weights), static_cast<T*>(out));
    } else {
      unpermute_rows_kernel<T, float><<<grid, kRowThreads, 0, cuda_stream>>>(
          static_cast<const T*>(y), hidden, top_k, row_id_map, static_cast<const float*>(weights),
          static_cast<T*>(out));
    }
  });
  MG_CUDA_RETURN(cudaGetLastError());
  return ok();
}

extern "C" mg_status mg_unpermute_rows_backward(const void* dout, const void* y, mg_dtype dtype,
                                                int64_t num_tokens, int64_t hidden, int top_k,
                                                const int64_t* row_id_map, const void* weights,
                                                mg_dtype weights_dtype, void* dy, void* dweights,
                                                void* stream) {
  MG_RETURN_IF_ERROR(check_float_dtype("dout", dtype));
  MG_RETURN_IF_ERROR(check_rows(num_tokens, hidden, top_k));
  MG_RETURN_IF_ERROR(check_weights_dtype(weights_dtype, dtype));
  if (num_tokens == 0) return ok();
  if (dout == nullptr || y == nullptr || row_id_map == nullptr || weights == nullptr || dy == nullptr) {
    return fail(MG_ERROR_INVALID_ARGUMENT,
                "dout, y, row_id_map, weights and dy must be device pointers, got NULL");
  }
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    const unsigned grid = static_cast<unsigned>(num_tokens);
    if (weights_dtype != MG_FLOAT32) {
      unpermute_rows_backward_kernel<T, T><<<grid, kRowThreads, 0, cuda_stream>>>(
          static_cast<const T*>(dout), static_cast<const T*>(y), hidden, top_k, row_id_map,
          static_cast<const T*>(weights), static_cast<T*>(dy), static_cast<T*>(dweights));
    } else {
      unpermute_rows_backward_kernel<T, float><<<grid, kRowThreads, 0, cuda_stream>>>(
          static_cast<const T*>(dout), static_cast<const T*>(y), hidden, top_k, row_id_map,
          static_cast<const float*>(weights), static_cast<T*>(dy), static_cast<float*>(dweights));
    }
  });
  MG_CUDA_RETURN(cudaGetLastError());
  return ok();
}
