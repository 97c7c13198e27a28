// Token permutation for MoE dispatch and combine, driven by device expert
// indices: no host synchronisation, static buffer sizes, deterministic.
//
// Index pass (mg_permute_index[_capacity]) over the n = tokens * top_k token
// copies, kChunk copies per CTA: count -> scan -> position (each kernel says
// what it computes). Kept rows are ordered by (expert, copy index), a stable
// sort; a copy ranked at or past the capacity is dropped (row -1), so dropping
// by position keeps each expert's first `capacity` copies. Without a capacity,
// capacity = INT32_MAX and nothing is dropped. Dropping by probability first
// ranks each expert's copies (priority_keys_kernel, a radix sort,
// mark_kept_kernel), then runs the passes again over the kept copies.
// Row passes: gather / weighted gather-sum / its backward, a warp per row.
// Design and measurements: docs/permute.md.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>

#include <climits>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "core/device_guard.h"
#include "core/elementwise.cuh"
#include "core/error.h"
#include "core/workspace.h"
#include "permute/permute.h"

namespace moe_grouped {
namespace {

constexpr int kChunk = 256;  // copies per CTA in the count and position passes
constexpr int kWarps = kChunk / 32;
constexpr int kScanThreads = 1024;
constexpr int kChunkScanThreads = 256;
// Shared memory per CTA: count pass 4 * E bytes, position pass kWarps * E bytes
// (one byte per warp and expert: a warp has at most 32 copies). 4096 experts
// use 32 KiB, under the 48 KiB a kernel gets without opting in.
constexpr int kMaxExperts = 4096;
constexpr int kElementThreads = 256;
constexpr int kRowThreads = 128;
constexpr int32_t kNoCapacity = INT32_MAX;

// The expert of copy i, or -1 past the end, outside [0, num_experts) or not
// kept (keep[i] == 0; keep NULL keeps every copy).
template <typename IndexT>
__device__ inline int load_expert(const IndexT* experts, const uint8_t* keep, int64_t i, int64_t n,
                                  int num_experts) {
  if (i >= n) return -1;
  if (keep != nullptr && keep[i] == 0) return -1;
  int64_t e = static_cast<int64_t>(experts[i]);
  return (e >= 0 && e < num_experts) ? static_cast<int>(e) : -1;
}

// counts[e][c] = copies of chunk c routed to expert e.
template <typename IndexT>
__global__ void __launch_bounds__(kChunk)
    count_kernel(const IndexT* __restrict__ experts, const uint8_t* __restrict__ keep, int64_t n,
                 int num_experts, int num_chunks, int32_t* __restrict__ counts) {
  extern __shared__ int32_t hist[];  // [num_experts]
  for (int e = threadIdx.x; e < num_experts; e += kChunk) hist[e] = 0;
  __syncthreads();
  int e = load_expert(experts, keep, static_cast<int64_t>(blockIdx.x) * kChunk + threadIdx.x, n, num_experts);
  if (e >= 0) atomicAdd(&hist[e], 1);  // integer counts: order does not matter
  __syncthreads();
  for (int g = threadIdx.x; g < num_experts; g += kChunk) {
    counts[static_cast<int64_t>(g) * num_chunks + blockIdx.x] = hist[g];
  }
}

// One CTA per expert e: exclusive scan of counts[e][c] over the chunks, in
// place, so counts[e][c] = copies of expert e in the chunks before c; expert
// e's total goes to starts[e + 1] for expert_scan_kernel. (A single CTA over
// all E * chunks entries was far slower: docs/permute.md.)
__global__ void __launch_bounds__(kChunkScanThreads)
    chunk_scan_kernel(int32_t* __restrict__ counts, int num_chunks, int32_t* __restrict__ starts) {
  using Scan = cub::BlockScan<int32_t, kChunkScanThreads>;
  __shared__ typename Scan::TempStorage storage;
  __shared__ int32_t carry;
  int32_t* row = counts + static_cast<int64_t>(blockIdx.x) * num_chunks;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < num_chunks; base += kChunkScanThreads) {
    const int c = base + threadIdx.x;
    const int32_t value = c < num_chunks ? row[c] : 0;
    int32_t prefix = 0, total = 0;
    Scan(storage).ExclusiveSum(value, prefix, total);
    if (c < num_chunks) row[c] = carry + prefix;
    __syncthreads();
    if (threadIdx.x == 0) carry += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) starts[blockIdx.x + 1] = carry;
}

// One CTA, after chunk_scan_kernel. In: starts[e + 1] = copies of expert e.
// Out: starts[e] = copies of the experts before e (starts[E] = all copies);
// per expert the kept count min(count, capacity) as m_splits[e] and the first
// row of its block, out_base[e] (packed, or e * capacity when padded).
__global__ void __launch_bounds__(kScanThreads)
    expert_scan_kernel(int num_experts, int32_t capacity, int pad_to_capacity, int32_t* __restrict__ starts,
                       int32_t* __restrict__ out_base, int64_t* __restrict__ m_splits) {
  using Scan = cub::BlockScan<int32_t, kScanThreads>;
  __shared__ typename Scan::TempStorage storage;
  __shared__ int32_t carry;
  if (threadIdx.x == 0) {
    carry = 0;
    starts[0] = 0;
  }
  __syncthreads();
  for (int base = 0; base < num_experts; base += kScanThreads) {
    const int e = base + threadIdx.x;
    const int32_t count = e < num_experts ? starts[e + 1] : 0;
    int32_t prefix = 0, total = 0;
    Scan(storage).ExclusiveSum(count, prefix, total);
    if (e < num_experts) starts[e + 1] = carry + prefix + count;  // each thread rewrites only what it read
    __syncthreads();
    if (threadIdx.x == 0) carry += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();  // also makes the global starts[] visible to the whole CTA
  for (int base = 0; base < num_experts; base += kScanThreads) {
    const int e = base + threadIdx.x;
    const int32_t kept = e < num_experts ? min(starts[e + 1] - starts[e], capacity) : 0;
    int32_t prefix = 0, total = 0;
    Scan(storage).ExclusiveSum(kept, prefix, total);
    if (e < num_experts) {
      out_base[e] = pad_to_capacity ? e * capacity : carry + prefix;
      m_splits[e] = pad_to_capacity ? capacity : kept;
    }
    __syncthreads();
    if (threadIdx.x == 0) carry += total;
    __syncthreads();
  }
}

// row_id_map[i] = out_base[e] + the rank of copy i among expert e's copies:
// bases[e][c] (the chunk scan) + its rank among chunk c's copies of expert e
// (warp match + per-warp counts); -1 for a copy without a valid, kept expert
// or whose rank reaches the capacity.
template <typename IndexT>
__global__ void __launch_bounds__(kChunk)
    position_kernel(const IndexT* __restrict__ experts, const uint8_t* __restrict__ keep, int64_t n,
                    int num_experts, int num_chunks, const int32_t* __restrict__ bases,
                    const int32_t* __restrict__ out_base, int32_t capacity,
                    int64_t* __restrict__ row_id_map) {
  extern __shared__ uint8_t warp_counts[];  // [kWarps][num_experts]
  for (int j = threadIdx.x; j < kWarps * num_experts; j += kChunk) warp_counts[j] = 0;
  __syncthreads();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kChunk + threadIdx.x;
  const int e = load_expert(experts, keep, i, n, num_experts);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned peers = __match_any_sync(0xffffffffu, e);
  const unsigned lower = peers & ((1u << lane) - 1u);
  int rank = __popc(lower);
  if (e >= 0 && lower == 0) warp_counts[warp * num_experts + e] = static_cast<uint8_t>(__popc(peers));
  __syncthreads();
  if (i >= n) return;
  if (e < 0) {
    row_id_map[i] = -1;
    return;
  }
  for (int w = 0; w < warp; ++w) rank += warp_counts[w * num_experts + e];
  rank += bases[static_cast<int64_t>(e) * num_chunks + blockIdx.x];
  row_id_map[i] = rank < capacity ? static_cast<int64_t>(out_base[e]) + rank : -1;
}

// The whole count -> scan -> position pass in one CTA, for at most
// kSmallMaxCopies copies and kSmallMaxExperts experts (eager steps of a few
// hundred tokens, where each launch of the four-kernel pass costs the host
// more than its work: docs/host-overhead.md). The experts are scanned as
// expert_scan_kernel scans them, then the copies are ranked in chunks of
// kSmallThreads in copy order, as position_kernel ranks them, with a running
// count per expert in place of the chunk scan: row_id_map, m_splits and
// starts are the four kernels' exactly. row_id_map NULL: no positions.
constexpr int kSmallThreads = 1024;
constexpr int kSmallWarps = kSmallThreads / 32;
constexpr int64_t kSmallMaxCopies = 4096;
constexpr int kSmallMaxExperts = 512;  // 16 KiB of per-warp counts

template <typename IndexT>
__global__ void __launch_bounds__(kSmallThreads)
    small_index_kernel(const IndexT* __restrict__ experts, const uint8_t* __restrict__ keep, int64_t n,
                       int num_experts, int32_t capacity, int pad_to_capacity, int32_t* __restrict__ starts,
                       int64_t* __restrict__ m_splits, int64_t* __restrict__ row_id_map) {
  using Scan = cub::BlockScan<int32_t, kSmallThreads>;
  __shared__ typename Scan::TempStorage storage;
  __shared__ int32_t seen[kSmallMaxExperts];      // copies of each expert: all, then those ranked so far
  __shared__ int32_t out_base[kSmallMaxExperts];  // first row of each expert's block
  __shared__ uint8_t warp_counts[kSmallWarps * kSmallMaxExperts];
  const int tid = static_cast<int>(threadIdx.x);
  for (int e = tid; e < num_experts; e += kSmallThreads) seen[e] = 0;
  __syncthreads();
  for (int64_t i = tid; i < n; i += kSmallThreads) {
    const int e = load_expert(experts, keep, i, n, num_experts);
    if (e >= 0) atomicAdd(&seen[e], 1);  // integer counts: order does not matter
  }
  __syncthreads();
  // num_experts <= kSmallThreads: thread e scans expert e.
  const int32_t count = tid < num_experts ? seen[tid] : 0;
  int32_t prefix = 0, total = 0;
  Scan(storage).ExclusiveSum(count, prefix, total);
  if (tid < num_experts) starts[tid + 1] = prefix + count;
  if (tid == 0) starts[0] = 0;
  __syncthreads();  // the scan storage is reused
  const int32_t kept = tid < num_experts ? min(count, capacity) : 0;
  Scan(storage).ExclusiveSum(kept, prefix, total);
  if (tid < num_experts) {
    out_base[tid] = pad_to_capacity ? tid * capacity : prefix;
    m_splits[tid] = pad_to_capacity ? capacity : kept;
    seen[tid] = 0;
  }
  if (row_id_map == nullptr) return;
  const int warp = tid / 32, lane = tid % 32;
  for (int64_t chunk = 0; chunk < n; chunk += kSmallThreads) {
    for (int j = tid; j < kSmallWarps * num_experts; j += kSmallThreads) warp_counts[j] = 0;
    __syncthreads();
    const int64_t i = chunk + tid;
    const int e = load_expert(experts, keep, i, n, num_experts);
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const unsigned lower = peers & ((1u << lane) - 1u);
    int rank = __popc(lower);
    if (e >= 0 && lower == 0) warp_counts[warp * num_experts + e] = static_cast<uint8_t>(__popc(peers));
    __syncthreads();
    if (i < n) {
      if (e < 0) {
        row_id_map[i] = -1;
      } else {
        for (int w = 0; w < warp; ++w) rank += warp_counts[w * num_experts + e];
        rank += seen[e];
        row_id_map[i] = rank < capacity ? static_cast<int64_t>(out_base[e]) + rank : -1;
      }
    }
    __syncthreads();  // every rank read seen[] before it moves on
    for (int e2 = tid; e2 < num_experts; e2 += kSmallThreads) {
      int32_t add = 0;
      for (int w = 0; w < kSmallWarps; ++w) add += warp_counts[w * num_experts + e2];
      seen[e2] += add;
    }
    __syncthreads();  // before the next chunk clears warp_counts and reads seen[]
  }
}

// Sort key of copy i: the expert in the high 32 bits (num_experts for an index
// outside [0, num_experts): sorted last), the probability descending in the
// low 32 (-0.0 counts as +0.0). Value: the copy index.
__device__ inline uint32_t descending_bits(float p) {
  if (p == 0.f) p = 0.f;
  uint32_t u = __float_as_uint(p);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // ascending as unsigned
  return ~u;
}

template <typename IndexT>
__global__ void __launch_bounds__(kElementThreads)
    priority_keys_kernel(const IndexT* __restrict__ experts, const float* __restrict__ probs, int64_t n,
                         int num_experts, uint64_t* __restrict__ keys, int32_t* __restrict__ copies) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kElementThreads + threadIdx.x;
  if (i >= n) return;
  const int e = load_expert(experts, static_cast<const uint8_t*>(nullptr), i, n, num_experts);
  const uint32_t high = e < 0 ? static_cast<uint32_t>(num_experts) : static_cast<uint32_t>(e);
  keys[i] = (static_cast<uint64_t>(high) << 32) | descending_bits(probs[i]);
  copies[i] = static_cast<int32_t>(i);
}

// After the sort: the copy at sorted position s is kept iff it is among the
// first `capacity` of its expert (starts[] from an unmasked count and scan).
__global__ void __launch_bounds__(kElementThreads)
    mark_kept_kernel(const uint64_t* __restrict__ sorted_keys, const int32_t* __restrict__ sorted_copies,
                     int64_t n, int num_experts, const int32_t* __restrict__ starts, int32_t capacity,
                     uint8_t* __restrict__ keep) {
  const int64_t s = static_cast<int64_t>(blockIdx.x) * kElementThreads + threadIdx.x;
  if (s >= n) return;
  const uint32_t e = static_cast<uint32_t>(sorted_keys[s] >> 32);
  keep[sorted_copies[s]] = e < static_cast<uint32_t>(num_experts) && s - starts[e] < capacity ? 1 : 0;
}

// Row passes: V elements per access (Pack), 16 bytes when every row starts
// 16-byte aligned, else 1. One warp per row (copy or token), kRowWarps rows
// per CTA; each lane moves kUnroll vectors of V elements per step, all loads
// issued before the stores (memory-level parallelism: a row is only 2-14 KiB).
constexpr int kRowWarps = kRowThreads / 32;
constexpr int kUnroll = 4;

__device__ inline int64_t warp_row() {
  return static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / 32;
}

// This lane's vectors of the step at `base`: src[base + u * 32 + lane] for
// u < kUnroll, those at or past `vectors` left alone.
template <typename P>
__device__ inline void load_step(const P* __restrict__ src, int64_t base, int lane, int64_t vectors,
                                 P (&v)[kUnroll]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t h = base + u * 32 + lane;
    if (h < vectors) v[u] = src[h];
  }
}

// permuted[row_id_map[t * top_k + j]] = x[t]; one warp per copy. With
// copy_values (else NULL), also row_values[row] = copy_values[copy].
template <typename T, int V>
__global__ void __launch_bounds__(kRowThreads)
    permute_rows_kernel(const T* __restrict__ x, int64_t n, int64_t hidden, int top_k,
                        const int64_t* __restrict__ row_id_map, T* __restrict__ permuted,
                        const float* __restrict__ copy_values, float* __restrict__ row_values) {
  using P = Pack<T, V>;
  const int64_t copy = warp_row();
  if (copy >= n) return;
  const int64_t row = row_id_map[copy];
  if (row < 0) return;
  const P* src = reinterpret_cast<const P*>(x + (copy / top_k) * hidden);
  P* dst = reinterpret_cast<P*>(permuted + row * hidden);
  const int64_t vectors = hidden / V;
  const int lane = threadIdx.x % 32;
  if (copy_values != nullptr && lane == 0) row_values[row] = copy_values[copy];
  for (int64_t base = 0; base < vectors; base += 32 * kUnroll) {
    P v[kUnroll];
    load_step(src, base, lane, vectors, v);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t h = base + u * 32 + lane;
      if (h < vectors) dst[h] = v[u];
    }
  }
}

// out[t] = sum_j w[t, j] * y[row_id_map[t * top_k + j]] (w = 1 when NULL); one warp per token.
// The copies are summed in j order for every element: deterministic.
template <typename T, typename W, int V>
__global__ void __launch_bounds__(kRowThreads)
    unpermute_rows_kernel(const T* __restrict__ y, int64_t num_tokens, int64_t hidden, int top_k,
                          const int64_t* __restrict__ row_id_map, const W* __restrict__ weights,
                          T* __restrict__ out) {
  using P = Pack<T, V>;
  const int64_t token = warp_row();
  if (token >= num_tokens) return;
  const int64_t vectors = hidden / V;
  const int lane = threadIdx.x % 32;
  P* dst = reinterpret_cast<P*>(out + token * hidden);
  for (int64_t base = 0; base < vectors; base += 32 * kUnroll) {
    float acc[kUnroll][V];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int i = 0; i < V; ++i) acc[u][i] = 0.f;
    }
    for (int j = 0; j < top_k; ++j) {
      const int64_t row = row_id_map[token * top_k + j];
      if (row < 0) continue;
      const float w = weights ? to_float(weights[token * top_k + j]) : 1.f;
      const P* src = reinterpret_cast<const P*>(y + row * hidden);
      P v[kUnroll];
      load_step(src, base, lane, vectors, v);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int i = 0; i < V; ++i) acc[u][i] += w * to_float(v[u].v[i]);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t h = base + u * 32 + lane;
      if (h >= vectors) continue;
      P o;
#pragma unroll
      for (int i = 0; i < V; ++i) o.v[i] = from_float<T>(acc[u][i]);
      dst[h] = o;
    }
  }
}

// dy[row] = w[t, j] * dout[t]; dw[t, j] = <dout[t], y[row]> (0 for dropped copies); one warp
// per token. Each lane sums its elements in a fixed order, then a fixed shuffle tree: deterministic.
template <typename T, typename W, int V>
__global__ void __launch_bounds__(kRowThreads)
    unpermute_rows_backward_kernel(const T* __restrict__ dout, const T* __restrict__ y, int64_t num_tokens,
                                   int64_t hidden, int top_k, const int64_t* __restrict__ row_id_map,
                                   const W* __restrict__ weights, T* __restrict__ dy,
                                   W* __restrict__ dweights) {
  using P = Pack<T, V>;
  const int64_t token = warp_row();
  if (token >= num_tokens) return;
  const int64_t vectors = hidden / V;
  const int lane = threadIdx.x % 32;
  const P* g = reinterpret_cast<const P*>(dout + token * hidden);
  for (int j = 0; j < top_k; ++j) {
    const int64_t copy = token * top_k + j;
    const int64_t row = row_id_map[copy];
    if (row < 0) {
      if (lane == 0 && dweights) dweights[copy] = from_float<W>(0.f);
      continue;
    }
    const float w = to_float(weights[copy]);
    const P* yr = reinterpret_cast<const P*>(y + row * hidden);
    P* dyr = reinterpret_cast<P*>(dy + row * hidden);
    float dot = 0.f;
    for (int64_t base = 0; base < vectors; base += 32 * kUnroll) {
      P gv[kUnroll], yv[kUnroll];
      load_step(g, base, lane, vectors, gv);
      load_step(yr, base, lane, vectors, yv);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t h = base + u * 32 + lane;
        if (h >= vectors) continue;
        P d;
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float gi = to_float(gv[u].v[i]);
          d.v[i] = from_float<T>(w * gi);
          dot += gi * to_float(yv[u].v[i]);
        }
        dyr[h] = d;
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    if (lane == 0 && dweights) dweights[copy] = from_float<W>(dot);
  }
}

unsigned row_grid(int64_t rows) { return static_cast<unsigned>((rows + kRowWarps - 1) / kRowWarps); }
// Kernels with a thread per item (copy, token or narrow row).
unsigned element_grid(int64_t items) {
  return static_cast<unsigned>((items + kElementThreads - 1) / kElementThreads);
}

// Rows of at most kNarrowRow elements (the routing weights as [T * k, 1]
// rows): one thread per row, where a warp per row would leave 31 of its 32
// lanes idle. Same arithmetic, same order.
constexpr int64_t kNarrowRow = 8;

template <typename T>
__global__ void __launch_bounds__(kElementThreads)
    permute_narrow_rows_kernel(const T* __restrict__ x, int64_t n, int64_t hidden, int top_k,
                               const int64_t* __restrict__ row_id_map, T* __restrict__ permuted,
                               const float* __restrict__ copy_values, float* __restrict__ row_values) {
  const int64_t copy = static_cast<int64_t>(blockIdx.x) * kElementThreads + threadIdx.x;
  if (copy >= n) return;
  const int64_t row = row_id_map[copy];
  if (row < 0) return;
  if (copy_values != nullptr) row_values[row] = copy_values[copy];
  const T* src = x + (copy / top_k) * hidden;
  T* dst = permuted + row * hidden;
  for (int64_t h = 0; h < hidden; ++h) dst[h] = src[h];
}

template <typename T, typename W>
__global__ void __launch_bounds__(kElementThreads)
    unpermute_narrow_rows_kernel(const T* __restrict__ y, int64_t num_tokens, int64_t hidden, int top_k,
                                 const int64_t* __restrict__ row_id_map, const W* __restrict__ weights,
                                 T* __restrict__ out) {
  const int64_t token = static_cast<int64_t>(blockIdx.x) * kElementThreads + threadIdx.x;
  if (token >= num_tokens) return;
  for (int64_t h = 0; h < hidden; ++h) {
    float acc = 0.f;
    for (int j = 0; j < top_k; ++j) {
      const int64_t row = row_id_map[token * top_k + j];
      if (row < 0) continue;
      const float w = weights ? to_float(weights[token * top_k + j]) : 1.f;
      acc += w * to_float(y[row * hidden + h]);
    }
    out[token * hidden + h] = from_float<T>(acc);
  }
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

// The weights are float32 or the rows' own type.
mg_status check_weights_dtype(mg_dtype weights_dtype, mg_dtype dtype) {
  if (weights_dtype != MG_FLOAT32 && weights_dtype != dtype) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "weights must be float32 or the rows' dtype %s, got %s",
                dtype_name(dtype), dtype_name(weights_dtype));
  }
  return MG_OK;
}

// Bits of the sort key: 32 for the probability, enough above them for
// num_experts (the key of a copy with an invalid expert index).
int sort_end_bit(int num_experts) {
  int bits = 0;
  while ((1 << bits) <= num_experts) ++bits;
  return 32 + bits;
}

// The index pass's scratch, carved from the (device, slot) workspace.
struct IndexScratch {
  int32_t* counts = nullptr;    // [num_experts * num_chunks]
  int32_t* starts = nullptr;    // [num_experts + 1]
  int32_t* out_base = nullptr;  // [num_experts]
  // Dropping by probability only:
  uint8_t* keep = nullptr;  // [n]
  uint64_t* keys_in = nullptr;
  uint64_t* keys_out = nullptr;  // [n] each
  int32_t* copies_in = nullptr;
  int32_t* copies_out = nullptr;  // [n] each
  void* sort_temp = nullptr;
  size_t sort_temp_bytes = 0;
};

// Carves the scratch out of `base` (NULL: only counts the bytes).
size_t carve_index_scratch(void* base, int64_t n, int num_experts, int num_chunks, bool by_probs,
                           size_t sort_temp_bytes, IndexScratch* scratch) {
  WorkspaceCarver carver(base);
  scratch->counts = carver.take<int32_t>(static_cast<size_t>(num_experts) * num_chunks);
  scratch->starts = carver.take<int32_t>(static_cast<size_t>(num_experts) + 1);
  scratch->out_base = carver.take<int32_t>(static_cast<size_t>(num_experts));
  if (by_probs) {
    const size_t copies = static_cast<size_t>(n);
    scratch->keep = carver.take<uint8_t>(copies);
    scratch->keys_in = carver.take<uint64_t>(copies);
    scratch->keys_out = carver.take<uint64_t>(copies);
    scratch->copies_in = carver.take<int32_t>(copies);
    scratch->copies_out = carver.take<int32_t>(copies);
    scratch->sort_temp = carver.take<uint8_t>(sort_temp_bytes);
    scratch->sort_temp_bytes = sort_temp_bytes;
  }
  return carver.bytes_used();
}

// count -> scan (-> position) over the kept copies (keep NULL: all copies).
template <typename IndexT>
mg_status launch_count_scan_position(const IndexT* experts, const uint8_t* keep, int64_t n, int num_experts,
                                     int num_chunks, int32_t capacity, int pad_to_capacity, bool positions,
                                     const IndexScratch& s, int64_t* row_id_map, int64_t* m_splits,
                                     cudaStream_t stream) {
  if (n <= kSmallMaxCopies && num_experts <= kSmallMaxExperts) {
    small_index_kernel<<<1, kSmallThreads, 0, stream>>>(experts, keep, n, num_experts, capacity, pad_to_capacity,
                                                        s.starts, m_splits, positions ? row_id_map : nullptr);
    MG_CUDA_RETURN(cudaGetLastError());
    return MG_OK;
  }
  const size_t hist_bytes = sizeof(int32_t) * num_experts;
  const size_t warp_bytes = sizeof(uint8_t) * kWarps * num_experts;
  count_kernel<<<num_chunks, kChunk, hist_bytes, stream>>>(experts, keep, n, num_experts, num_chunks, s.counts);
  MG_CUDA_RETURN(cudaGetLastError());
  chunk_scan_kernel<<<num_experts, kChunkScanThreads, 0, stream>>>(s.counts, num_chunks, s.starts);
  MG_CUDA_RETURN(cudaGetLastError());
  expert_scan_kernel<<<1, kScanThreads, 0, stream>>>(num_experts, capacity, pad_to_capacity, s.starts, s.out_base,
                                                     m_splits);
  MG_CUDA_RETURN(cudaGetLastError());
  if (!positions || n == 0) return MG_OK;
  position_kernel<<<num_chunks, kChunk, warp_bytes, stream>>>(experts, keep, n, num_experts, num_chunks, s.counts,
                                                              s.out_base, capacity, row_id_map);
  MG_CUDA_RETURN(cudaGetLastError());
  return MG_OK;
}

template <typename IndexT>
mg_status launch_index(const IndexT* experts, const float* probs, int64_t n, int num_experts, int num_chunks,
                       int32_t capacity, int pad_to_capacity, const IndexScratch& s, int64_t* row_id_map,
                       int64_t* m_splits, cudaStream_t stream) {
  const uint8_t* keep = nullptr;
  if (probs != nullptr && n > 0) {
    // Rank each expert's copies by probability: an unmasked count and scan
    // give the first sorted position of each expert (starts), the sort orders
    // the copies by (expert, probability descending, copy index).
    MG_RETURN_IF_ERROR(launch_count_scan_position<IndexT>(experts, nullptr, n, num_experts, num_chunks,
                                                          kNoCapacity, 0, false, s, row_id_map, m_splits,
                                                          stream));
    const unsigned blocks = element_grid(n);
    priority_keys_kernel<<<blocks, kElementThreads, 0, stream>>>(experts, probs, n, num_experts, s.keys_in,
                                                                 s.copies_in);
    MG_CUDA_RETURN(cudaGetLastError());
    size_t temp_bytes = s.sort_temp_bytes;
    MG_CUDA_RETURN(cub::DeviceRadixSort::SortPairs(s.sort_temp, temp_bytes, s.keys_in, s.keys_out, s.copies_in,
                                                   s.copies_out, static_cast<int>(n), 0,
                                                   sort_end_bit(num_experts), stream));
    mark_kept_kernel<<<blocks, kElementThreads, 0, stream>>>(s.keys_out, s.copies_out, n, num_experts, s.starts,
                                                             capacity, s.keep);
    MG_CUDA_RETURN(cudaGetLastError());
    keep = s.keep;
  }
  return launch_count_scan_position(experts, keep, n, num_experts, num_chunks, capacity, pad_to_capacity, true,
                                    s, row_id_map, m_splits, stream);
}

mg_status permute_index(const void* experts, mg_dtype experts_dtype, int64_t num_tokens, int top_k,
                        int num_experts, const float* probs, int32_t capacity, int pad_to_capacity,
                        int64_t* row_id_map, int64_t* m_splits, int device, int workspace_slot,
                        cudaStream_t stream) {
  const int64_t n = num_tokens * top_k;
  if (m_splits == nullptr || (n > 0 && (experts == nullptr || row_id_map == nullptr))) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "experts, row_id_map and m_splits must be device pointers, got NULL");
  }
  // At least one chunk, so that an empty input still writes m_splits.
  const int num_chunks = n > 0 ? static_cast<int>((n + kChunk - 1) / kChunk) : 1;
  const bool by_probs = probs != nullptr && n > 0;
  size_t sort_temp_bytes = 0;
  if (by_probs) {  // a size query: no launch, no allocation
    MG_CUDA_RETURN(cub::DeviceRadixSort::SortPairs(
        nullptr, sort_temp_bytes, static_cast<const uint64_t*>(nullptr), static_cast<uint64_t*>(nullptr),
        static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), static_cast<int>(n), 0,
        sort_end_bit(num_experts), stream));
  }
  IndexScratch scratch;
  const size_t bytes = carve_index_scratch(nullptr, n, num_experts, num_chunks, by_probs, sort_temp_bytes, &scratch);
  void* base = nullptr;
  MG_RETURN_IF_ERROR(workspace_get(device, workspace_slot, bytes, stream, &base));
  carve_index_scratch(base, n, num_experts, num_chunks, by_probs, sort_temp_bytes, &scratch);
  if (experts_dtype == MG_INT32) {
    return launch_index(static_cast<const int32_t*>(experts), probs, n, num_experts, num_chunks, capacity,
                        pad_to_capacity, scratch, row_id_map, m_splits, stream);
  }
  return launch_index(static_cast<const int64_t*>(experts), probs, n, num_experts, num_chunks, capacity,
                      pad_to_capacity, scratch, row_id_map, m_splits, stream);
}

mg_status check_index_arguments(mg_dtype experts_dtype, int64_t num_tokens, int top_k, int num_experts) {
  if (experts_dtype != MG_INT32 && experts_dtype != MG_INT64) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "experts must be int32 or int64, got %s", dtype_name(experts_dtype));
  }
  MG_RETURN_IF_ERROR(check_rows(num_tokens, 0, top_k));
  if (num_experts <= 0 || num_experts > kMaxExperts) {
    return fail(MG_ERROR_INVALID_ARGUMENT,
                "num_experts must be in [1, %d] for the permute kernels, got %d", kMaxExperts, num_experts);
  }
  return MG_OK;
}

}  // namespace
}  // namespace moe_grouped

using namespace moe_grouped;

extern "C" mg_status mg_permute_index(const void* experts, mg_dtype experts_dtype, int64_t num_tokens,
                                      int top_k, int num_experts, int64_t* row_id_map, int64_t* m_splits,
                                      int device, int workspace_slot, void* stream) {
  MG_ENTER_DEVICE(device);
  MG_RETURN_IF_ERROR(check_index_arguments(experts_dtype, num_tokens, top_k, num_experts));
  MG_RETURN_IF_ERROR(permute_index(experts, experts_dtype, num_tokens, top_k, num_experts, nullptr, kNoCapacity,
                                   0, row_id_map, m_splits, device, workspace_slot,
                                   static_cast<cudaStream_t>(stream)));
  return ok();
}

extern "C" mg_status mg_permute_index_capacity(const void* experts, mg_dtype experts_dtype, int64_t num_tokens,
                                               int top_k, int num_experts, const float* probs, int64_t capacity,
                                               int pad_to_capacity, int64_t* row_id_map, int64_t* m_splits,
                                               int device, int workspace_slot, void* stream) {
  MG_ENTER_DEVICE(device);
  MG_RETURN_IF_ERROR(check_index_arguments(experts_dtype, num_tokens, top_k, num_experts));
  if (capacity < 0 || capacity >= kNoCapacity) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "capacity must be in [0, %d), got %lld", kNoCapacity,
                static_cast<long long>(capacity));
  }
  if (pad_to_capacity && capacity * num_experts > INT32_MAX) {
    return fail(MG_ERROR_INVALID_ARGUMENT,
                "pad_to_capacity needs num_experts * capacity < 2^31 rows, got %d * %lld", num_experts,
                static_cast<long long>(capacity));
  }
  MG_RETURN_IF_ERROR(permute_index(experts, experts_dtype, num_tokens, top_k, num_experts, probs,
                                   static_cast<int32_t>(capacity), pad_to_capacity ? 1 : 0, row_id_map, m_splits,
                                   device, workspace_slot, static_cast<cudaStream_t>(stream)));
  return ok();
}

mg_status moe_grouped::permute_rows_and_values(const void* x, mg_dtype dtype, int64_t num_tokens, int64_t hidden,
                                               int top_k, const int64_t* row_id_map, void* permuted,
                                               const float* copy_values, float* row_values, cudaStream_t stream) {
  MG_RETURN_IF_ERROR(check_float_dtype("x", dtype));
  MG_RETURN_IF_ERROR(check_rows(num_tokens, hidden, top_k));
  const int64_t n = num_tokens * top_k;
  if (n == 0 || hidden == 0) return ok();
  if (x == nullptr || row_id_map == nullptr || permuted == nullptr) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "x, row_id_map and permuted must be device pointers, got NULL");
  }
  if (copy_values != nullptr && row_values == nullptr) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "row_values must be a device pointer where copy_values is, got NULL");
  }
  with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    const unsigned grid = row_grid(n);
    const auto* src = static_cast<const T*>(x);
    auto* dst = static_cast<T*>(permuted);
    if (hidden <= kNarrowRow) {
      permute_narrow_rows_kernel<T><<<element_grid(n), kElementThreads, 0, stream>>>(
          src, n, hidden, top_k, row_id_map, dst, copy_values, row_values);
    } else if (rows_are_16_byte_aligned<T>(hidden, {x, permuted})) {
      permute_rows_kernel<T, V><<<grid, kRowThreads, 0, stream>>>(src, n, hidden, top_k, row_id_map, dst,
                                                                   copy_values, row_values);
    } else {
      permute_rows_kernel<T, 1><<<grid, kRowThreads, 0, stream>>>(src, n, hidden, top_k, row_id_map, dst,
                                                                   copy_values, row_values);
    }
  });
  MG_CUDA_RETURN(cudaGetLastError());
  return ok();
}

extern "C" mg_status mg_permute_rows(const void* x, mg_dtype dtype, int64_t num_tokens, int64_t hidden,
                                     int top_k, const int64_t* row_id_map, void* permuted, void* stream) {
  MG_ENTER_DEVICE_OF(permuted);
  return permute_rows_and_values(x, dtype, num_tokens, hidden, top_k, row_id_map, permuted, nullptr, nullptr,
                                 static_cast<cudaStream_t>(stream));
}

extern "C" mg_status mg_unpermute_rows(const void* y, mg_dtype dtype, int64_t num_tokens, int64_t hidden,
                                       int top_k, const int64_t* row_id_map, const void* weights,
                                       mg_dtype weights_dtype, void* out, void* stream) {
  MG_ENTER_DEVICE_OF(out);
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
    const unsigned grid = row_grid(num_tokens);
    auto launch = [&](auto weight_tag, auto width) {
      using W = decltype(weight_tag);
      if (hidden <= kNarrowRow) {
        unpermute_narrow_rows_kernel<T, W><<<element_grid(num_tokens), kElementThreads, 0, cuda_stream>>>(
            static_cast<const T*>(y), num_tokens, hidden, top_k, row_id_map, static_cast<const W*>(weights),
            static_cast<T*>(out));
        return;
      }
      unpermute_rows_kernel<T, W, decltype(width)::value><<<grid, kRowThreads, 0, cuda_stream>>>(
          static_cast<const T*>(y), num_tokens, hidden, top_k, row_id_map, static_cast<const W*>(weights), static_cast<T*>(out));
    };
    const bool wide = rows_are_16_byte_aligned<T>(hidden, {y, out});
    if (weights == nullptr || weights_dtype != MG_FLOAT32) {
      wide ? launch(T{}, std::integral_constant<int, 16 / sizeof(T)>{}) : launch(T{}, std::integral_constant<int, 1>{});
    } else {
      wide ? launch(float{}, std::integral_constant<int, 16 / sizeof(T)>{})
           : launch(float{}, std::integral_constant<int, 1>{});
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
  MG_ENTER_DEVICE_OF(dy);
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
    const unsigned grid = row_grid(num_tokens);
    auto launch = [&](auto weight_tag, auto width) {
      using W = decltype(weight_tag);
      unpermute_rows_backward_kernel<T, W, decltype(width)::value><<<grid, kRowThreads, 0, cuda_stream>>>(
          static_cast<const T*>(dout), static_cast<const T*>(y), num_tokens, hidden, top_k, row_id_map,
          static_cast<const W*>(weights), static_cast<T*>(dy), static_cast<W*>(dweights));
    };
    const bool wide = rows_are_16_byte_aligned<T>(hidden, {dout, y, dy});
    if (weights_dtype != MG_FLOAT32) {
      wide ? launch(T{}, std::integral_constant<int, 16 / sizeof(T)>{}) : launch(T{}, std::integral_constant<int, 1>{});
    } else {
      wide ? launch(float{}, std::integral_constant<int, 16 / sizeof(T)>{})
           : launch(float{}, std::integral_constant<int, 1>{});
    }
  });
  MG_CUDA_RETURN(cudaGetLastError());
  return ok();
}
