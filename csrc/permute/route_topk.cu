// The router's expert choice: the top_k experts of each token's scores and
// the copies routed to each expert, in one pass with no host sync.
//
// One warp per token (a few tokens per warp in turn): lane l holds experts
// l, l + 32, ... as 64-bit keys (ordered float bits << 32 | ~expert), so the
// largest key is the largest score and, among equal scores, the lowest
// expert. top_k rounds of a warp max pick the experts in order; integer
// counts go through shared memory, then one global add per CTA and expert.
// torch.topk plus a scatter-add of ones took 138 us for 16384 tokens and 128
// experts on an H100.
#include <cstdint>

#include "core/error.h"

namespace moe_grouped {
namespace {

constexpr int kTopkThreads = 256;
constexpr int kTopkWarps = kTopkThreads / 32;
constexpr int kTopkMaxExperts = 1024;  // 32 keys per lane
constexpr int kTopkMax = 32;           // one result per lane
constexpr int kTokensPerWarp = 16;     // amortises each CTA's global count adds

// Monotonic in the score; NaN (any sign) above +inf, as torch.topk ranks it;
// -0 equals +0 (a tie, so the lower expert wins, as in a stable sort).
__device__ inline uint32_t ordered_bits(float score) {
  if (score != score) return 0xffffffffu;
  if (score == 0.f) return 0x80000000u;
  const uint32_t bits = __float_as_uint(score);
  return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

__device__ inline uint64_t warp_max(uint64_t value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const uint64_t other = __shfl_xor_sync(0xffffffffu, value, offset);
    value = other > value ? other : value;
  }
  return value;
}

// kPerLane: keys per lane, ceil(num_experts / 32) rounded up to a power of two.
template <int kPerLane>
__global__ void __launch_bounds__(kTopkThreads)
    route_topk_kernel(const float* __restrict__ scores, int64_t num_tokens, int num_experts, int top_k,
                      int64_t* __restrict__ experts, unsigned long long* __restrict__ counts) {
  extern __shared__ int32_t hist[];  // [num_experts]
  for (int e = threadIdx.x; e < num_experts; e += kTopkThreads) hist[e] = 0;
  __syncthreads();
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kTopkWarps;
  for (int64_t token = static_cast<int64_t>(blockIdx.x) * kTopkWarps + threadIdx.x / 32; token < num_tokens;
       token += warps) {
    const float* row = scores + token * num_experts;
    uint64_t keys[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      // An absent expert is key 0: below every score (-inf is 0x007fffff << 32).
      keys[i] = e < num_experts
                    ? (static_cast<uint64_t>(ordered_bits(row[e])) << 32) | (0xffffffffu - static_cast<uint32_t>(e))
                    : 0;
    }
    int chosen = -1;  // lane j keeps the j-th choice
    for (int j = 0; j < top_k; ++j) {
      uint64_t best = 0;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) best = keys[i] > best ? keys[i] : best;
      best = warp_max(best);
      const int e = static_cast<int>(0xffffffffu - static_cast<uint32_t>(best));
      if (lane == e % 32) {
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          if (keys[i] == best) keys[i] = 0;
        }
      }
      if (lane == j) chosen = e;
    }
    if (lane < top_k) {
      experts[token * top_k + lane] = chosen;
      atomicAdd(&hist[chosen], 1);
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += kTopkThreads) {
    if (hist[e] != 0) atomicAdd(&counts[e], static_cast<unsigned long long>(hist[e]));
  }
}

template <int kPerLane>
void launch(const float* scores, int64_t num_tokens, int num_experts, int top_k, int64_t* experts,
            int64_t* counts, cudaStream_t stream) {
  const int64_t warps_needed = (num_tokens + kTokensPerWarp - 1) / kTokensPerWarp;
  int64_t blocks = (warps_needed + kTopkWarps - 1) / kTopkWarps;
  if (blocks < 1) blocks = 1;
  if (blocks > 65535) blocks = 65535;  // the grid-stride loop covers the rest
  route_topk_kernel<kPerLane><<<static_cast<unsigned>(blocks), kTopkThreads, sizeof(int32_t) * num_experts,
                                stream>>>(scores, num_tokens, num_experts, top_k, experts,
                                          reinterpret_cast<unsigned long long*>(counts));
}

}  // namespace
}  // namespace moe_grouped

using namespace moe_grouped;

extern "C" mg_status mg_route_topk(const float* scores, int64_t num_tokens, int num_experts, int top_k,
                                   int64_t* experts, int64_t* counts, void* stream) {
  if (num_tokens < 0 || num_experts < 1 || num_experts > kTopkMaxExperts) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "need num_tokens >= 0 and 1 <= num_experts <= %d, got %lld and %d",
                kTopkMaxExperts, static_cast<long long>(num_tokens), num_experts);
  }
  if (top_k < 1 || top_k > num_experts || top_k > kTopkMax) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "need 1 <= top_k <= min(num_experts, %d), got top_k=%d for %d experts",
                kTopkMax, top_k, num_experts);
  }
  if (counts == nullptr || (num_tokens > 0 && (scores == nullptr || experts == nullptr))) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "scores, experts and counts must be device pointers, got NULL");
  }
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  MG_CUDA_RETURN(cudaMemsetAsync(counts, 0, sizeof(int64_t) * num_experts, cuda_stream));
  if (num_tokens == 0) return ok();
  const int per_lane = (num_experts + 31) / 32;
  if (per_lane <= 1) launch<1>(scores, num_tokens, num_experts, top_k, experts, counts, cuda_stream);
  else if (per_lane <= 2) launch<2>(scores, num_tokens, num_experts, top_k, experts, counts, cuda_stream);
  else if (per_lane <= 4) launch<4>(scores, num_tokens, num_experts, top_k, experts, counts, cuda_stream);
  else if (per_lane <= 8) launch<8>(scores, num_tokens, num_experts, top_k, experts, counts, cuda_stream);
  else if (per_lane <= 16) launch<16>(scores, num_tokens, num_experts, top_k, experts, counts, cuda_stream);
  else launch<32>(scores, num_tokens, num_experts, top_k, experts, counts, cuda_stream);
  MG_CUDA_RETURN(cudaGetLastError());
  return ok();
}
