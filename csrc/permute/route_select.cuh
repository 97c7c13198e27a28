// A token's top_k experts chosen by one warp, shared by the router kernels
// (route_topk.cu: the choice alone; route_softmax.cu: the choice with the
// softmax weights and losses).
//
// Lane l holds experts l, l + 32, ... as 64-bit keys (ordered float bits << 32
// | ~expert), so the largest key is the largest score and, among equal
// scores, the lowest expert. top_k rounds of a warp max pick the experts in
// order: NaN above +inf, as torch.topk ranks it; -0 equals +0 (a tie, so the
// lower expert wins, as in a stable sort).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/error.h"

namespace moe_grouped::route {

constexpr int kLanes = 32;
constexpr int kMaxExperts = 1024;  // 32 keys per lane
constexpr int kMaxTopK = 32;       // one choice per lane

// Both router kernels run one warp per token, in CTAs of kThreads, each warp
// taking kTokensPerWarp tokens one after another. That is latency-bound
// (top_k rounds of warp maxima), so more warps hide more of it; fewer tokens
// per warp mean more CTAs and more global count adds. 4 measured faster than
// 16 (docs/routing.md).
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kLanes;
constexpr int kTokensPerWarp = 4;

// CTAs for num_tokens at kTokensPerWarp, between 1 and max_blocks (the
// kernels' token loops stride over the rest).
inline int64_t blocks_for(int64_t num_tokens, int64_t max_blocks) {
  const int64_t warps = (num_tokens + kTokensPerWarp - 1) / kTokensPerWarp;
  const int64_t blocks = (warps + kWarps - 1) / kWarps;
  return blocks < 1 ? 1 : (blocks > max_blocks ? max_blocks : blocks);
}

__device__ inline uint32_t ordered_bits(float score) {
  if (score != score) return 0xffffffffu;
  if (score == 0.f) return 0x80000000u;
  const uint32_t bits = __float_as_uint(score);
  return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

// The inverse of ordered_bits (every NaN comes back as one NaN, -0 as +0).
__device__ inline float from_ordered_bits(uint32_t bits) {
  return __uint_as_float((bits & 0x80000000u) ? bits & 0x7fffffffu : ~bits);
}

// Warp maxima by redux.sync, one instruction per 32 bits where a shuffle tree
// takes five: the choice's top_k rounds were most of the router kernels'
// time. A 64-bit key is its high word's maximum, then the maximum low word
// among the lanes holding that high word.
__device__ inline uint64_t warp_max(uint64_t value) {
  const uint32_t high = __reduce_max_sync(0xffffffffu, static_cast<uint32_t>(value >> 32));
  const uint32_t low = __reduce_max_sync(
      0xffffffffu, static_cast<uint32_t>(value >> 32) == high ? static_cast<uint32_t>(value) : 0u);
  return (static_cast<uint64_t>(high) << 32) | low;
}

// NaN if any lane holds one (as torch's max), else the largest value.
__device__ inline float warp_max(float value) {
  return from_ordered_bits(__reduce_max_sync(0xffffffffu, ordered_bits(value)));
}

// The same butterfly on every lane, so every lane gets the same bits.
__device__ inline float warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// Lane j < top_k gets the token's j-th expert, the others -1. `scores[i]` is
// expert lane + 32 * i (ignored past num_experts).
template <int kPerLane>
__device__ inline int choose_topk(const float (&scores)[kPerLane], int num_experts, int top_k, int lane) {
  uint64_t keys[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + kLanes * i;
    // An absent expert is key 0: below every score (-inf is 0x007fffff << 32).
    keys[i] = e < num_experts
                  ? (static_cast<uint64_t>(ordered_bits(scores[i])) << 32) | (0xffffffffu - static_cast<uint32_t>(e))
                  : 0;
  }
  int chosen = -1;
  for (int j = 0; j < top_k; ++j) {
    uint64_t best = 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) best = keys[i] > best ? keys[i] : best;
    best = warp_max(best);
    const int e = static_cast<int>(0xffffffffu - static_cast<uint32_t>(best));
    if (lane == e % kLanes) {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        if (keys[i] == best) keys[i] = 0;
      }
    }
    if (lane == j) chosen = e;
  }
  return chosen;
}

// A token's scores as choose_topk and the softmax take them: lane l gets
// row[l + 32 i] in values[i], -inf past num_experts.
template <int kPerLane>
__device__ inline void load_row(const float* row, int num_experts, int lane, float (&values)[kPerLane]) {
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + kLanes * i;
    values[i] = e < num_experts ? row[e] : -INFINITY;
  }
}

// A CTA's expert histogram in shared memory: zeroed before its tokens, then
// added to the global counts (one atomic per expert it saw; the kernel
// synchronises the CTA in between).
__device__ inline void clear_histogram(int32_t* hist, int num_experts) {
  for (int e = threadIdx.x; e < num_experts; e += kThreads) hist[e] = 0;
}
__device__ inline void add_histogram(const int32_t* hist, int num_experts, unsigned long long* counts) {
  for (int e = threadIdx.x; e < num_experts; e += kThreads) {
    if (hist[e] != 0) atomicAdd(&counts[e], static_cast<unsigned long long>(hist[e]));
  }
}

// Calls launch(std::integral_constant<int, kPerLane>{}) with kPerLane =
// ceil(num_experts / 32) rounded up to a power of two.
template <class Launch>
void dispatch_per_lane(int num_experts, Launch&& launch) {
  const int per_lane = (num_experts + kLanes - 1) / kLanes;
  if (per_lane <= 1) launch(std::integral_constant<int, 1>{});
  else if (per_lane <= 2) launch(std::integral_constant<int, 2>{});
  else if (per_lane <= 4) launch(std::integral_constant<int, 4>{});
  else if (per_lane <= 8) launch(std::integral_constant<int, 8>{});
  else if (per_lane <= 16) launch(std::integral_constant<int, 16>{});
  else launch(std::integral_constant<int, 32>{});
}

// The argument rules every router entry point shares.
inline mg_status check_choice(const char* op, int64_t num_tokens, int num_experts, int top_k) {
  if (num_tokens < 0 || num_experts < 1 || num_experts > kMaxExperts) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: need num_tokens >= 0 and 1 <= num_experts <= %d, got %lld and %d", op,
                kMaxExperts, static_cast<long long>(num_tokens), num_experts);
  }
  if (top_k < 1 || top_k > num_experts || top_k > kMaxTopK) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: need 1 <= top_k <= min(num_experts, %d), got top_k=%d for %d experts",
                op, kMaxTopK, top_k, num_experts);
  }
  return MG_OK;
}

}  // namespace moe_grouped::route
