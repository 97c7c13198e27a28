// Expert-parallel dispatch and combine between the GPUs of one node, through
// peers' symmetric buffers (NVLink or PCIe peer access). See the C ABI header
// for the contract and docs/expert-parallel.md for the design.
//
// Every op is one kernel that first crosses a barrier of the whole group and
// then pulls: each rank has published (stream-ordered before the kernel) what
// it owns into its own buffer, and reads what it needs from the peers'.
//  - dispatch (receiver d):  out[s*S + p] = rows_s[index_s[d*S + p]] for
//    p < counts_s[d]; rows p >= counts_s[d] are zeroed.
//  - combine (token rank s): out[t] = sum over d = 0..ep-1 with pos[t][d] >= 0
//    of partial_d[s*S + pos[t][d]], in fp32 in that order (deterministic).
// The barrier: every block writes this op's epoch into each peer's flag slot
// for this rank (release, system scope) and waits until its own slots from
// every peer reach it (acquire). Epochs count the ops on this buffer; all
// ranks make the same calls in the same order, so their epochs agree. The
// last block to finish advances the local epoch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

#include "core/device_guard.h"
#include "core/error.h"
#include "core/kernel_attributes.h"

namespace moe_grouped {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
// Unused dynamic shared memory that keeps each SM to one block of these
// kernels, so `num_blocks` is the number of SMs they take from the GEMMs.
constexpr int kOneBlockPerSmBytes = 120 * 1024;
constexpr unsigned long long kTimeoutNs = 100ull * 1000 * 1000 * 1000;

struct Group {
  int rank, ep;
  const char* base[MG_EP_MAX_RANKS];
  int64_t flags_offset;
  unsigned long long* epoch;  // local state: the last epoch completed
  unsigned int* done;         // local state: blocks finished in the current op
};

__device__ __forceinline__ unsigned long long* flags_of(const Group& g, int r) {
  return reinterpret_cast<unsigned long long*>(const_cast<char*>(g.base[r]) + g.flags_offset);
}

__device__ __forceinline__ void store_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned long long load_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Returns this op's epoch once every rank of the group has entered it.
__device__ unsigned long long enter_barrier(const Group& g) {
  __shared__ unsigned long long target;
  if (threadIdx.x == 0) target = *reinterpret_cast<volatile unsigned long long*>(g.epoch) + 1;
  __syncthreads();
  const unsigned long long epoch = target;
  if (threadIdx.x < g.ep) {
    // Cumulative: the rows this rank published before the kernel are visible
    // to a peer that acquires the flag.
    __threadfence_system();
    store_release_sys(flags_of(g, threadIdx.x) + g.rank, epoch);
    const unsigned long long* mine = flags_of(g, g.rank) + threadIdx.x;
    const unsigned long long start = global_timer_ns();
    while (load_acquire_sys(mine) < epoch) {
      if (global_timer_ns() - start > kTimeoutNs) {
        printf("moe_grouped ep: rank %d waited 100 s for rank %d at epoch %llu; the ranks' calls differ\n",
               g.rank, threadIdx.x, epoch);
        __trap();
      }
    }
  }
  __syncthreads();
  return epoch;
}

__device__ void leave_barrier(const Group& g, unsigned long long epoch) {
  __syncthreads();
  if (threadIdx.x == 0) {
    if (atomicAdd(g.done, 1u) == gridDim.x - 1) {  // every block has read the old epoch
      *g.done = 0;
      *reinterpret_cast<volatile unsigned long long*>(g.epoch) = epoch;
      __threadfence();
    }
  }
}

__device__ __forceinline__ uint4 load_cg(const void* p) {
  return __ldcg(reinterpret_cast<const uint4*>(p));
}

// ---------------------------------------------------------------- dispatch
struct DispatchParams {
  Group g;
  int64_t segment_rows;
  int64_t counts_offset, index_offset, rows_offset, extra_offset;
  int64_t row_bytes, extra_bytes;
  char* out_rows;
  char* out_extra;
};

// Copies one row of `bytes` (a multiple of 16) with the warp: kBatch 16-byte
// loads per lane in flight before their stores.
template <int kBatch>
__device__ __forceinline__ void copy_row(const char* src, char* dst, int64_t bytes, int lane) {
  for (int64_t base = 0; base < bytes; base += 16 * 32 * kBatch) {
    uint4 v[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int64_t at = base + (static_cast<int64_t>(i) * 32 + lane) * 16;
      if (at < bytes) v[i] = load_cg(src + at);
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int64_t at = base + (static_cast<int64_t>(i) * 32 + lane) * 16;
      if (at < bytes) *reinterpret_cast<uint4*>(dst + at) = v[i];
    }
  }
}

__device__ __forceinline__ void zero_row(char* dst, int64_t bytes, int lane) {
  for (int64_t at = static_cast<int64_t>(lane) * 16; at < bytes; at += 16 * 32) {
    *reinterpret_cast<uint4*>(dst + at) = make_uint4(0, 0, 0, 0);
  }
}

__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(const DispatchParams p) {
  const Group& g = p.g;
  const unsigned long long epoch = enter_barrier(g);
  __shared__ int32_t counts[MG_EP_MAX_RANKS];
  if (threadIdx.x < g.ep) {
    const auto* peer_counts = reinterpret_cast<const int32_t*>(g.base[threadIdx.x] + p.counts_offset);
    counts[threadIdx.x] = __ldcg(peer_counts + g.rank);
  }
  __syncthreads();
  const int lane = threadIdx.x % 32;
  const int64_t S = p.segment_rows;
  const int64_t items = S * g.ep;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  // Item i is row i / ep of source (i + rank) % ep: consecutive items read
  // from different peers, and the ranks start at different peers.
  for (int64_t chunk = first * 32; chunk < items; chunk += warps * 32) {
    // Each lane reads one item's token index; the warp then copies the 32 rows.
    const int64_t mine = chunk + lane;
    int32_t token = -1;
    if (mine < items) {
      const int source = static_cast<int>((mine + g.rank) % g.ep);
      const int64_t row = mine / g.ep;
      if (row < counts[source]) {
        const auto* index = reinterpret_cast<const int32_t*>(g.base[source] + p.index_offset);
        token = __ldcg(index + g.rank * S + row);
      }
    }
    const int n = static_cast<int>(items - chunk < 32 ? items - chunk : 32);
    for (int i = 0; i < n; ++i) {
      const int64_t item = chunk + i;
      const int source = static_cast<int>((item + g.rank) % g.ep);
      const int64_t out_row = source * S + item / g.ep;
      const int32_t t = __shfl_sync(0xffffffffu, token, i);
      char* dst = p.out_rows + out_row * p.row_bytes;
      char* dst_extra = p.out_extra == nullptr ? nullptr : p.out_extra + out_row * p.extra_bytes;
      if (t >= 0) {
        const char* rows = g.base[source] + p.rows_offset;
        copy_row<8>(rows + t * p.row_bytes, dst, p.row_bytes, lane);
        if (dst_extra != nullptr) {
          const auto* extra = reinterpret_cast<const uint32_t*>(g.base[source] + p.extra_offset + t * p.extra_bytes);
          for (int64_t w = lane; w * 4 < p.extra_bytes; w += 32) {
            reinterpret_cast<uint32_t*>(dst_extra)[w] = __ldcg(extra + w);
          }
        }
      } else {
        zero_row(dst, p.row_bytes, lane);
        if (dst_extra != nullptr) {
          for (int64_t w = lane; w * 4 < p.extra_bytes; w += 32) reinterpret_cast<uint32_t*>(dst_extra)[w] = 0;
        }
      }
    }
  }
  leave_barrier(g, epoch);
}

// ---------------------------------------------------------------- combine
template <typename T>
struct Vec;  // 16 bytes of T as floats
template <>
struct Vec<float> {
  static constexpr int kN = 4;
  __device__ static void add(float* acc, uint4 v) {
    acc[0] += __uint_as_float(v.x);
    acc[1] += __uint_as_float(v.y);
    acc[2] += __uint_as_float(v.z);
    acc[3] += __uint_as_float(v.w);
  }
  __device__ static uint4 pack(const float* acc) {
    return make_uint4(__float_as_uint(acc[0]), __float_as_uint(acc[1]), __float_as_uint(acc[2]),
                      __float_as_uint(acc[3]));
  }
};
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
__device__ __forceinline__ float2 to_float2(__half2 v) { return __half22float2(v); }
template <typename H2>
__device__ H2 from_float2(float2 v);
template <>
__device__ __forceinline__ __nv_bfloat162 from_float2<__nv_bfloat162>(float2 v) { return __float22bfloat162_rn(v); }
template <>
__device__ __forceinline__ __half2 from_float2<__half2>(float2 v) { return __float22half2_rn(v); }
// 16 bytes of a 16-bit type as 8 floats, and back (round to nearest even).
template <typename H2>
struct Vec16 {
  static constexpr int kN = 8;
  __device__ static void add(float* acc, uint4 v) {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      H2 pair;
      memcpy(&pair, &words[i], 4);
      const float2 f = to_float2(pair);
      acc[2 * i] += f.x;
      acc[2 * i + 1] += f.y;
    }
  }
  __device__ static uint4 pack(const float* acc) {
    uint32_t words[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const H2 pair = from_float2<H2>(make_float2(acc[2 * i], acc[2 * i + 1]));
      memcpy(&words[i], &pair, 4);
    }
    return make_uint4(words[0], words[1], words[2], words[3]);
  }
};
template <>
struct Vec<__nv_bfloat16> : Vec16<__nv_bfloat162> {};
template <>
struct Vec<__half> : Vec16<__half2> {};

struct CombineParams {
  Group g;
  int64_t segment_rows, num_tokens;
  const int32_t* pos;
  int64_t partial_offset, row_bytes;
  char* out;
  int64_t extra_offset, extra_cols;
  float* out_extra;
};

// kMaxRanks: the group size rounded up (loads of every rank are issued before
// the fixed-order sum); kChunks: 16-byte chunks per lane per step.
template <typename T, int kMaxRanks, int kChunks>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(const CombineParams p) {
  const Group& g = p.g;
  const unsigned long long epoch = enter_barrier(g);
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t S = p.segment_rows;
  // This rank's rows in each peer's partial region (kernel parameters: no registers held).
  const int64_t first_row = g.rank * S;
  constexpr int kN = Vec<T>::kN;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; t < p.num_tokens; t += warps) {
    const int32_t my_pos = lane < g.ep ? p.pos[t * g.ep + lane] : -1;
    int32_t row[kMaxRanks];
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d) row[d] = __shfl_sync(0xffffffffu, my_pos, d);
    char* out = p.out + t * p.row_bytes;
    for (int64_t base = 0; base < p.row_bytes; base += 16 * 32 * kChunks) {
      uint4 v[kChunks][kMaxRanks];
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int64_t at = base + (static_cast<int64_t>(c) * 32 + lane) * 16;
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d) {
          if (d < g.ep && row[d] >= 0 && at < p.row_bytes) v[c][d] = load_cg(g.base[d] + p.partial_offset + (first_row + row[d]) * p.row_bytes + at);
        }
      }
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int64_t at = base + (static_cast<int64_t>(c) * 32 + lane) * 16;
        if (at >= p.row_bytes) continue;
        float acc[kN];
#pragma unroll
        for (int i = 0; i < kN; ++i) acc[i] = 0.0f;
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d) {
          if (d < g.ep && row[d] >= 0) Vec<T>::add(acc, v[c][d]);
        }
        *reinterpret_cast<uint4*>(out + at) = Vec<T>::pack(acc);
      }
    }
    for (int64_t col = lane; col < p.extra_cols; col += 32) {
      float acc = 0.0f;
#pragma unroll
      for (int d = 0; d < kMaxRanks; ++d) {
        if (d < g.ep && row[d] >= 0) acc += __ldcg(reinterpret_cast<const float*>(g.base[d] + p.extra_offset) + (first_row + row[d]) * p.extra_cols + col);
      }
      p.out_extra[t * p.extra_cols + col] = acc;
    }
  }
  leave_barrier(g, epoch);
}

// ---------------------------------------------------------------- plan
// Two kernels over chunks of consecutive tokens, one CTA a chunk: the first
// counts each chunk's tokens for every destination, the second gives each
// token its row (the counts of the chunks before it plus a block-wide scan
// over its own tile), so rows follow token order within every destination.
constexpr int kPlanThreads = 256;
constexpr int kPlanWarps = kPlanThreads / 32;
constexpr int kPlanMaxBlocks = 256;

__device__ __forceinline__ uint32_t destinations(const int64_t* experts, int64_t token, int top_k,
                                                 int experts_per_rank, int ep) {
  uint32_t mask = 0;
  for (int j = 0; j < top_k; ++j) {
    const int64_t e = experts[token * top_k + j];
    if (e >= 0 && e < static_cast<int64_t>(experts_per_rank) * ep) mask |= 1u << (e / experts_per_rank);
  }
  return mask;
}

struct PlanParams {
  const int64_t* experts;
  int64_t num_tokens, segment_rows, chunk;  // chunk: tokens a CTA, a multiple of kPlanThreads
  int top_k, experts_per_rank, ep;
  int32_t* pos;
  int32_t* index;
  int32_t* counts;
  int32_t* chunk_counts;  // [blocks, ep]
};

__global__ void __launch_bounds__(kPlanThreads) plan_count_kernel(const PlanParams p) {
  __shared__ int counts[MG_EP_MAX_RANKS];
  if (threadIdx.x < MG_EP_MAX_RANKS) counts[threadIdx.x] = 0;
  __syncthreads();
  const int64_t begin = blockIdx.x * p.chunk;
  const int64_t end = begin + p.chunk < p.num_tokens ? begin + p.chunk : p.num_tokens;
  for (int64_t t = begin + threadIdx.x; t < end; t += kPlanThreads) {
    uint32_t mask = destinations(p.experts, t, p.top_k, p.experts_per_rank, p.ep);
    while (mask) {
      const int d = __ffs(mask) - 1;
      atomicAdd(&counts[d], 1);
      mask &= mask - 1;
    }
  }
  __syncthreads();
  if (threadIdx.x < p.ep) p.chunk_counts[blockIdx.x * p.ep + threadIdx.x] = counts[threadIdx.x];
}

__global__ void __launch_bounds__(kPlanThreads) plan_write_kernel(const PlanParams p) {
  __shared__ int next[MG_EP_MAX_RANKS];      // this CTA's next row for each destination
  __shared__ int warp_counts[kPlanWarps][MG_EP_MAX_RANKS];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (threadIdx.x < p.ep) {
    int before = 0, total = 0;
    for (int b = 0; b < static_cast<int>(gridDim.x); ++b) {
      const int c = p.chunk_counts[b * p.ep + threadIdx.x];
      if (b < static_cast<int>(blockIdx.x)) before += c;
      total += c;
    }
    next[threadIdx.x] = before;
    if (blockIdx.x == 0) p.counts[threadIdx.x] = total < p.segment_rows ? total : static_cast<int>(p.segment_rows);
  }
  __syncthreads();
  const int64_t begin = blockIdx.x * p.chunk;
  const int64_t end = begin + p.chunk < p.num_tokens ? begin + p.chunk : p.num_tokens;
  for (int64_t tile = begin; tile < end; tile += kPlanThreads) {
    const int64_t t = tile + threadIdx.x;
    const uint32_t mask = t < end ? destinations(p.experts, t, p.top_k, p.experts_per_rank, p.ep) : 0u;
    // For each destination: this token's rank among the tile's tokens that go there (warp ballots, then
    // the warps before it), in token order.
    int mine[MG_EP_MAX_RANKS];
#pragma unroll
    for (int d = 0; d < MG_EP_MAX_RANKS; ++d) {
      if (d >= p.ep) break;
      const unsigned ballot = __ballot_sync(0xffffffffu, (mask >> d) & 1u);
      mine[d] = __popc(ballot & ((1u << lane) - 1u));
      if (lane == 0) warp_counts[warp][d] = __popc(ballot);
    }
    __syncthreads();
#pragma unroll
    for (int d = 0; d < MG_EP_MAX_RANKS; ++d) {
      if (d >= p.ep) break;
      int row = next[d] + mine[d];
      for (int w = 0; w < warp; ++w) row += warp_counts[w][d];
      if (t < end) {
        int32_t at = -1;
        if ((mask >> d) & 1u) {
          if (row < p.segment_rows) {
            p.index[d * p.segment_rows + row] = static_cast<int32_t>(t);
            at = row;
          }  // else past the segment: the caller keeps every destination within it
        }
        p.pos[t * p.ep + d] = at;
      }
    }
    __syncthreads();
    if (threadIdx.x < p.ep) {
      int tile_total = 0;
      for (int w = 0; w < kPlanWarps; ++w) tile_total += warp_counts[w][threadIdx.x];
      next[threadIdx.x] += tile_total;
    }
    __syncthreads();
  }
  // Rows past each destination's count: -1, spread over the CTAs.
  if (threadIdx.x < p.ep) next[threadIdx.x] = 0;  // reuse: the totals again, from the chunk counts
  __syncthreads();
  if (threadIdx.x < p.ep) {
    int total = 0;
    for (int b = 0; b < static_cast<int>(gridDim.x); ++b) total += p.chunk_counts[b * p.ep + threadIdx.x];
    next[threadIdx.x] = total;
  }
  __syncthreads();
  for (int d = 0; d < p.ep; ++d) {
    for (int64_t r = next[d] + static_cast<int64_t>(blockIdx.x) * kPlanThreads + threadIdx.x; r < p.segment_rows;
         r += static_cast<int64_t>(gridDim.x) * kPlanThreads) {
      p.index[d * p.segment_rows + r] = -1;
    }
  }
}

// ---------------------------------------------------------------- host side
mg_status make_group(const char* op, const mg_ep_group* group, Group* g) {
  if (group == nullptr) return fail(MG_ERROR_INVALID_ARGUMENT, "%s: group must not be NULL", op);
  if (group->world_size < 1 || group->world_size > MG_EP_MAX_RANKS) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: world_size must be in [1, %d], got %d", op, MG_EP_MAX_RANKS,
                group->world_size);
  }
  if (group->rank < 0 || group->rank >= group->world_size) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: rank %d is outside [0, %d)", op, group->rank, group->world_size);
  }
  if (group->num_blocks < 1) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: num_blocks must be positive, got %d", op, group->num_blocks);
  }
  if (group->flags_offset % 8 || group->state_offset % 8) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: flags_offset and state_offset must be multiples of 8", op);
  }
  g->rank = group->rank;
  g->ep = group->world_size;
  for (int r = 0; r < MG_EP_MAX_RANKS; ++r) {
    g->base[r] = r < group->world_size ? static_cast<const char*>(group->base[r]) : nullptr;
    if (r < group->world_size && g->base[r] == nullptr) {
      return fail(MG_ERROR_INVALID_ARGUMENT, "%s: base[%d] (rank %d's buffer) is NULL", op, r, r);
    }
  }
  g->flags_offset = group->flags_offset;
  char* local = const_cast<char*>(g->base[group->rank]) + group->state_offset;
  g->epoch = reinterpret_cast<unsigned long long*>(local);
  g->done = reinterpret_cast<unsigned int*>(local + 8);
  return ok();
}

template <auto kernel, typename Params>
mg_status launch_pull(const char* op, int num_blocks, const Params& params, cudaStream_t stream) {
  int device = 0;
  MG_CUDA_RETURN(cudaGetDevice(&device));
  MG_RETURN_IF_ERROR(raise_shared_memory_once<kernel>(device, kOneBlockPerSmBytes));
  kernel<<<num_blocks, kThreads, kOneBlockPerSmBytes, stream>>>(params);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return cuda_fail(err, op);
  return ok();
}

template <typename T, int kMaxRanks>
mg_status launch_combine(const CombineParams& params, int num_blocks, cudaStream_t stream) {
  constexpr int kChunks = kMaxRanks >= 16 ? 1 : 16 / kMaxRanks;
  return launch_pull<combine_kernel<T, kMaxRanks, kChunks>>("mg_ep_combine", num_blocks, params, stream);
}

template <typename T>
mg_status launch_combine_for(const CombineParams& params, int num_blocks, cudaStream_t stream) {
  if (params.g.ep <= 2) return launch_combine<T, 2>(params, num_blocks, stream);
  if (params.g.ep <= 4) return launch_combine<T, 4>(params, num_blocks, stream);
  if (params.g.ep <= 8) return launch_combine<T, 8>(params, num_blocks, stream);
  return launch_combine<T, 16>(params, num_blocks, stream);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace
}  // namespace moe_grouped

using namespace moe_grouped;

extern "C" mg_status mg_ep_dispatch(const mg_ep_group* group, const mg_ep_dispatch_args* args, void* stream) {
  MG_ENTER_DEVICE_OF(args != nullptr ? args->out_rows : nullptr);
  const char* op = "mg_ep_dispatch";
  DispatchParams p{};
  MG_RETURN_IF_ERROR(make_group(op, group, &p.g));
  if (args == nullptr) return fail(MG_ERROR_INVALID_ARGUMENT, "%s: args must not be NULL", op);
  if (args->segment_rows < 0 || args->segment_rows > INT32_MAX) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: segment_rows must be in [0, 2^31), got %lld", op,
                static_cast<long long>(args->segment_rows));
  }
  if (args->row_bytes <= 0 || args->row_bytes % 16) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: row_bytes must be a positive multiple of 16, got %lld", op,
                static_cast<long long>(args->row_bytes));
  }
  if (args->extra_bytes < 0 || args->extra_bytes % 4 || (args->extra_bytes > 0) != (args->out_extra != nullptr)) {
    return fail(MG_ERROR_INVALID_ARGUMENT,
                "%s: extra_bytes must be a multiple of 4, positive exactly when out_extra is given, got %lld", op,
                static_cast<long long>(args->extra_bytes));
  }
  if (args->out_rows == nullptr || !aligned16(args->out_rows) || args->rows_offset % 16) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: out_rows and the rows region must be 16-byte aligned", op);
  }
  for (int r = 0; r < group->world_size; ++r) {
    if (!aligned16(group->base[r])) {
      return fail(MG_ERROR_INVALID_ARGUMENT, "%s: base[%d] must be 16-byte aligned", op, r);
    }
  }
  p.segment_rows = args->segment_rows;
  p.counts_offset = args->counts_offset;
  p.index_offset = args->index_offset;
  p.rows_offset = args->rows_offset;
  p.extra_offset = args->extra_offset;
  p.row_bytes = args->row_bytes;
  p.extra_bytes = args->extra_bytes;
  p.out_rows = static_cast<char*>(args->out_rows);
  p.out_extra = static_cast<char*>(args->out_extra);
  return launch_pull<dispatch_kernel>(op, group->num_blocks, p, static_cast<cudaStream_t>(stream));
}

extern "C" mg_status mg_ep_combine(const mg_ep_group* group, const mg_ep_combine_args* args, void* stream) {
  MG_ENTER_DEVICE_OF(args != nullptr ? args->out : nullptr);
  const char* op = "mg_ep_combine";
  CombineParams p{};
  MG_RETURN_IF_ERROR(make_group(op, group, &p.g));
  if (args == nullptr) return fail(MG_ERROR_INVALID_ARGUMENT, "%s: args must not be NULL", op);
  if (args->num_tokens < 0 || args->segment_rows < 0) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: num_tokens and segment_rows must be non-negative", op);
  }
  int element = 0;
  switch (args->dtype) {
    case MG_FLOAT32: element = 4; break;
    case MG_FLOAT16: case MG_BFLOAT16: element = 2; break;
    default:
      return fail(MG_ERROR_INVALID_ARGUMENT, "%s: rows must be float32, float16 or bfloat16, got %s", op,
                  dtype_name(args->dtype));
  }
  p.row_bytes = args->hidden * element;
  if (args->hidden <= 0 || p.row_bytes % 16) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: hidden * element size must be a positive multiple of 16, got %lld",
                op, static_cast<long long>(p.row_bytes));
  }
  if (args->extra_cols < 0 || args->extra_cols > 64 || (args->extra_cols > 0) != (args->out_extra != nullptr)) {
    return fail(MG_ERROR_INVALID_ARGUMENT,
                "%s: extra_cols must be in [0, 64], positive exactly when out_extra is given, got %lld", op,
                static_cast<long long>(args->extra_cols));
  }
  if (args->num_tokens > 0 && (args->pos == nullptr || args->out == nullptr || !aligned16(args->out))) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: pos and a 16-byte aligned out are required", op);
  }
  if (args->partial_offset % 16 || args->extra_offset % 4) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: the partial region must be 16-byte aligned", op);
  }
  p.segment_rows = args->segment_rows;
  p.num_tokens = args->num_tokens;
  p.pos = args->pos;
  p.partial_offset = args->partial_offset;
  p.out = static_cast<char*>(args->out);
  p.extra_offset = args->extra_offset;
  p.extra_cols = args->extra_cols;
  p.out_extra = args->out_extra;
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  switch (args->dtype) {
    case MG_FLOAT32: return launch_combine_for<float>(p, group->num_blocks, cuda_stream);
    case MG_FLOAT16: return launch_combine_for<__half>(p, group->num_blocks, cuda_stream);
    default: return launch_combine_for<__nv_bfloat16>(p, group->num_blocks, cuda_stream);
  }
}

extern "C" size_t mg_ep_plan_scratch_bytes(int64_t num_tokens, int world_size) {
  (void)num_tokens;
  return sizeof(int32_t) * kPlanMaxBlocks * (world_size > 0 ? world_size : 1);
}

extern "C" mg_status mg_ep_plan(const int64_t* experts, int64_t num_tokens, int top_k, int experts_per_rank,
                                int world_size, int64_t segment_rows, int32_t* pos, int32_t* index, int32_t* counts,
                                int32_t* scratch, void* stream) {
  MG_ENTER_DEVICE_OF(experts);
  const char* op = "mg_ep_plan";
  if (world_size < 1 || world_size > MG_EP_MAX_RANKS) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: world_size must be in [1, %d], got %d", op, MG_EP_MAX_RANKS,
                world_size);
  }
  if (top_k < 1 || experts_per_rank < 1 || num_tokens < 0 || num_tokens > INT32_MAX || segment_rows < 0 ||
      segment_rows > INT32_MAX) {
    return fail(MG_ERROR_INVALID_ARGUMENT,
                "%s: top_k and experts_per_rank must be positive and num_tokens, segment_rows in [0, 2^31), got "
                "top_k=%d experts_per_rank=%d num_tokens=%lld segment_rows=%lld",
                op, top_k, experts_per_rank, static_cast<long long>(num_tokens),
                static_cast<long long>(segment_rows));
  }
  if (counts == nullptr || scratch == nullptr || (num_tokens > 0 && (experts == nullptr || pos == nullptr)) ||
      (segment_rows > 0 && index == nullptr)) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: experts, pos, index, counts and scratch must be device pointers",
                op);
  }
  PlanParams p{};
  p.experts = experts;
  p.num_tokens = num_tokens;
  p.segment_rows = segment_rows;
  p.top_k = top_k;
  p.experts_per_rank = experts_per_rank;
  p.ep = world_size;
  p.pos = pos;
  p.index = index;
  p.counts = counts;
  p.chunk_counts = scratch;
  // About 4 tiles a CTA, at most kPlanMaxBlocks CTAs.
  const int64_t tiles = (num_tokens + kPlanThreads - 1) / kPlanThreads;
  int64_t blocks = (tiles + 3) / 4;
  blocks = blocks < 1 ? 1 : (blocks > kPlanMaxBlocks ? kPlanMaxBlocks : blocks);
  p.chunk = (tiles + blocks - 1) / blocks * kPlanThreads;
  if (p.chunk == 0) p.chunk = kPlanThreads;
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  plan_count_kernel<<<static_cast<unsigned>(blocks), kPlanThreads, 0, cuda_stream>>>(p);
  plan_write_kernel<<<static_cast<unsigned>(blocks), kPlanThreads, 0, cuda_stream>>>(p);
  MG_CUDA_RETURN(cudaGetLastError());
  return ok();
}
