// The softmax router after its gate GEMM, forward and backward each in one
// pass over the [T, E] logits: the choice of mg_route_topk, the routing
// weights, the per-token logsumexp, and the load-balancing and z losses;
// backward gives the logits' gradient from the weights' and the losses'
// gradients. It replaces some twenty small torch kernels (softmax, gather,
// the losses' reductions, the scatter of the weights' gradient into a zero
// [T, E] and the split into bf16 halves) whose launches and passes cost
// more than the work.
//
// Deterministic: each CTA sums its tokens' p_te and lse_t^2 in a fixed order
// into one row of `partials`, and the losses kernel adds the rows in order.
// Design: docs/routing.md.
#include <cstdint>

#include <cuda_bf16.h>

#include "core/device_guard.h"
#include "core/error.h"
#include "permute/route_select.cuh"

namespace moe_grouped {
namespace {

using route::kLanes;
using route::kThreads;
using route::kWarps;

constexpr int64_t kMaxPartialRows = 1024;  // CTAs of the forward, each one partials row
constexpr int kLossThreads = 1024;

int64_t partial_rows(int64_t num_tokens) { return route::blocks_for(num_tokens, kMaxPartialRows); }

template <int kPerLane>
__device__ inline float logsumexp(const float (&values)[kPerLane]) {
  float max = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) max = fmaxf(max, values[i]);
  max = route::warp_max(max);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) sum += expf(values[i] - max);
  return max + logf(route::warp_sum(sum));
}

// The unscaled weight of lane j's chosen expert (logit `chosen_logit`, lanes
// j >= top_k pass -inf and get 0).
__device__ inline float chosen_weight(int mode, float chosen_logit, float lse) {
  if (mode == MG_ROUTE_SOFTMAX_ALL) return expf(chosen_logit - lse);
  const float max = route::warp_max(chosen_logit);
  const float e = expf(chosen_logit - max);
  return e / route::warp_sum(e);
}

struct ForwardParams {
  const float* logits;
  int64_t num_tokens;
  int num_experts, top_k, mode;
  float scaling;
  int64_t* experts;
  unsigned long long* counts;
  float* weights;
  float* lse;
  float* partials;  // [gridDim.x, num_experts + 1]: sum_t p_te, then sum_t lse_t^2
};

// One warp per token, lane l holding experts l, l + 32, ... in registers:
//   lse_t = logsumexp(l_t), p_te = exp(l_te - lse_t);
//   weights (MG_ROUTE_SOFTMAX_CHOSEN): softmax over the chosen logits, which
//     is both topk_before_softmax and softmax + normalize_topk (p_i / sum
//     of the chosen p_j is the same ratio); (MG_ROUTE_SOFTMAX_ALL) p_te of
//     the chosen experts; both times `scaling`;
//   aux = E * sum_e f_e * P_e with f_e = counts_e / (T * k), P_e = mean_t p_te;
//   z = mean_t lse_t^2 (both from `partials`, by the losses kernel).
// The choice ranks the logits, which ranks the probabilities the same way
// (the softmax is monotonic) without the ties its rounding can make.
template <int kPerLane>
__global__ void __launch_bounds__(kThreads) route_softmax_kernel(ForwardParams p) {
  extern __shared__ float smem[];  // hist [E] int32, then per-warp sums [kWarps][E + 1]
  auto* hist = reinterpret_cast<int32_t*>(smem);
  float* warp_sums = smem + p.num_experts;
  const int cols = p.num_experts + 1;
  route::clear_histogram(hist, p.num_experts);
  __syncthreads();
  const int lane = threadIdx.x % kLanes, warp = threadIdx.x / kLanes;
  float prob_sum[kPerLane] = {};
  float lse_sq_sum = 0.f;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + warp; t < p.num_tokens; t += warps) {
    const float* row = p.logits + t * p.num_experts;
    float values[kPerLane];
    route::load_row(row, p.num_experts, lane, values);
    const float lse = logsumexp(values);
    const int chosen = route::choose_topk(values, p.num_experts, p.top_k, lane);
    const float weight = chosen_weight(p.mode, chosen >= 0 ? row[chosen] : -INFINITY, lse);
    if (lane < p.top_k) {
      p.experts[t * p.top_k + lane] = chosen;
      p.weights[t * p.top_k + lane] = p.scaling * weight;
      atomicAdd(&hist[chosen], 1);
    }
    if (lane == 0) {
      p.lse[t] = lse;
      lse_sq_sum += lse * lse;
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) prob_sum[i] += expf(values[i] - lse);
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + kLanes * i;
    if (e < p.num_experts) warp_sums[warp * cols + e] = prob_sum[i];
  }
  if (lane == 0) warp_sums[warp * cols + p.num_experts] = lse_sq_sum;
  __syncthreads();
  for (int c = threadIdx.x; c < cols; c += kThreads) {
    float sum = 0.f;
    for (int w = 0; w < kWarps; ++w) sum += warp_sums[w * cols + c];
    p.partials[blockIdx.x * static_cast<int64_t>(cols) + c] = sum;
  }
  route::add_histogram(hist, p.num_experts, p.counts);
}

// One CTA: losses[0] = aux, losses[1] = z from the forward's partial rows.
// Column c (expert c, or the lse^2 column E) is summed in `groups` row
// strides by as many threads, whose sums then add in group order.
__global__ void __launch_bounds__(kLossThreads)
    route_softmax_losses_kernel(const float* partials, int rows, int num_experts, const int64_t* counts,
                                int64_t num_tokens, int top_k, float* losses) {
  __shared__ float group_sums[kLossThreads + kLanes];  // [groups][cols], cols <= kMaxExperts + 1
  __shared__ float warp_terms[kLossThreads / kLanes];
  const int cols = num_experts + 1;
  const int groups = cols < kLossThreads ? kLossThreads / cols : 1;
  for (int i = threadIdx.x; i < groups * cols; i += kLossThreads) {
    const int c = i % cols, g = i / cols;
    float sum = 0.f;
    // Loads issued kBatch at a time (one at a time, their latency dominated:
    // docs/routing.md); the adds keep row order.
    constexpr int kBatch = 8;
    for (int r0 = g; r0 < rows; r0 += groups * kBatch) {
      float v[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int r = r0 + b * groups;
        v[b] = r < rows ? partials[r * static_cast<int64_t>(cols) + c] : 0.f;
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) sum += v[b];
    }
    group_sums[i] = sum;
  }
  __syncthreads();
  float term = 0.f;  // sum_e counts_e * sum_t p_te over this thread's experts
  for (int c = threadIdx.x; c < cols; c += kLossThreads) {
    float total = 0.f;
    for (int g = 0; g < groups; ++g) total += group_sums[g * cols + c];
    if (c < num_experts) {
      term += static_cast<float>(counts[c]) * total;
    } else {
      losses[1] = total / static_cast<float>(num_tokens);  // z = mean_t lse_t^2
    }
  }
  term = route::warp_sum(term);
  if (threadIdx.x % kLanes == 0) warp_terms[threadIdx.x / kLanes] = term;
  __syncthreads();
  if (threadIdx.x < kLanes) {
    const float total = route::warp_sum(warp_terms[threadIdx.x]);
    if (threadIdx.x == 0) {
      const float tokens = static_cast<float>(num_tokens);
      losses[0] = static_cast<float>(num_experts) * total / (tokens * static_cast<float>(top_k)) / tokens;
    }
  }
}

struct BackwardParams {
  const float* logits;
  const float* lse;
  const int64_t* experts;
  const int64_t* counts;
  int64_t num_tokens;
  int num_experts, top_k, mode;
  float scaling;
  const float* grad_weights;  // [T, k] or NULL
  const float* grad_losses;   // [2] (aux, z) or NULL
  const float* grad_logits;   // [T, E] or NULL
  bool split_bf16;
  void* out;  // [T, E] fp32, or [T, 2E] bf16 (hi | lo)
};

template <int kPerLane>
__global__ void __launch_bounds__(kThreads) route_softmax_backward_kernel(BackwardParams p) {
  const int lane = threadIdx.x % kLanes;
  const float tokens = static_cast<float>(p.num_tokens);
  // d aux / d p_te = aux_scale * counts_e; d z / d l_te = z_scale * lse_t * p_te.
  const float aux_scale = p.grad_losses != nullptr
                              ? p.grad_losses[0] * static_cast<float>(p.num_experts) /
                                    (tokens * static_cast<float>(p.top_k)) / tokens
                              : 0.f;
  const float z_scale = p.grad_losses != nullptr ? p.grad_losses[1] * 2.f / tokens : 0.f;
  float counts[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + kLanes * i;
    counts[i] = e < p.num_experts ? static_cast<float>(p.counts[e]) : 0.f;
  }
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kLanes; t < p.num_tokens; t += warps) {
    const float* row = p.logits + t * p.num_experts;
    float values[kPerLane], prob[kPerLane], grad[kPerLane];
    route::load_row(row, p.num_experts, lane, values);
    const float lse = p.lse[t];
    float aux_dot = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + kLanes * i;
      prob[i] = expf(values[i] - lse);
      grad[i] = p.grad_logits != nullptr && e < p.num_experts ? p.grad_logits[t * p.num_experts + e] : 0.f;
      aux_dot += prob[i] * counts[i];
    }
    aux_dot = route::warp_sum(aux_dot);
    float spread = z_scale * lse - aux_scale * aux_dot;  // times p_te, on every expert
    if (p.grad_weights != nullptr) {
      const int chosen = lane < p.top_k ? static_cast<int>(p.experts[t * p.top_k + lane]) : -1;
      const float g = lane < p.top_k ? p.scaling * p.grad_weights[t * p.top_k + lane] : 0.f;
      const float w = chosen_weight(p.mode, chosen >= 0 ? row[chosen] : -INFINITY, lse);
      const float dot = route::warp_sum(w * g);
      // CHOSEN: d l_i = w_i (g_i - dot) on the chosen; ALL: d l_e = g_e p_e on
      // the chosen, - p_e * dot everywhere.
      const float own = p.mode == MG_ROUTE_SOFTMAX_ALL ? w * g : w * (g - dot);
      if (p.mode == MG_ROUTE_SOFTMAX_ALL) spread -= dot;
      for (int j = 0; j < p.top_k; ++j) {
        const int e = __shfl_sync(0xffffffffu, chosen, j);
        const float add = __shfl_sync(0xffffffffu, own, j);
        if (lane == e % kLanes) {
#pragma unroll
          for (int i = 0; i < kPerLane; ++i) {
            if (i == e / kLanes) grad[i] += add;
          }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + kLanes * i;
      if (e >= p.num_experts) continue;
      const float d = grad[i] + prob[i] * (aux_scale * counts[i] + spread);
      if (p.split_bf16) {
        auto* out = static_cast<__nv_bfloat16*>(p.out) + t * 2 * p.num_experts;
        const __nv_bfloat16 hi = __float2bfloat16(d);
        out[e] = hi;
        out[p.num_experts + e] = __float2bfloat16(d - __bfloat162float(hi));
      } else {
        static_cast<float*>(p.out)[t * p.num_experts + e] = d;
      }
    }
  }
}

mg_status check_mode(const char* op, int mode) {
  if (mode != MG_ROUTE_SOFTMAX_CHOSEN && mode != MG_ROUTE_SOFTMAX_ALL) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: weights_mode must be MG_ROUTE_SOFTMAX_CHOSEN (0) or "
                "MG_ROUTE_SOFTMAX_ALL (1), got %d", op, mode);
  }
  return MG_OK;
}

}  // namespace
}  // namespace moe_grouped

using namespace moe_grouped;

extern "C" mg_status mg_route_softmax_partial_rows(int64_t num_tokens, int64_t* out_rows) {
  if (num_tokens < 0 || out_rows == nullptr) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "mg_route_softmax_partial_rows: need num_tokens >= 0 and out_rows");
  }
  *out_rows = partial_rows(num_tokens);
  return ok();
}

extern "C" mg_status mg_route_softmax(const float* logits, int64_t num_tokens, int num_experts, int top_k,
                                      int weights_mode, float scaling, int64_t* experts, int64_t* counts,
                                      float* weights, float* lse, float* partials, float* losses, void* stream) {
  MG_ENTER_DEVICE_OF(weights);
  MG_RETURN_IF_ERROR(route::check_choice("mg_route_softmax", num_tokens, num_experts, top_k));
  MG_RETURN_IF_ERROR(check_mode("mg_route_softmax", weights_mode));
  if (counts == nullptr || losses == nullptr ||
      (num_tokens > 0 && (logits == nullptr || experts == nullptr || weights == nullptr || lse == nullptr ||
                          partials == nullptr))) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "mg_route_softmax: every pointer must be a device pointer, got NULL");
  }
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  MG_CUDA_RETURN(cudaMemsetAsync(counts, 0, sizeof(int64_t) * num_experts, cuda_stream));
  if (num_tokens == 0) {
    // As the torch composition: both losses of no tokens are 0.
    MG_CUDA_RETURN(cudaMemsetAsync(losses, 0, 2 * sizeof(float), cuda_stream));
    return ok();
  }
  const ForwardParams params{logits, num_tokens, num_experts, top_k, weights_mode, scaling, experts,
                             reinterpret_cast<unsigned long long*>(counts), weights, lse, partials};
  const auto grid = static_cast<unsigned>(partial_rows(num_tokens));  // one partials row per CTA
  const size_t smem = sizeof(float) * (num_experts + static_cast<size_t>(kWarps) * (num_experts + 1));
  route::dispatch_per_lane(num_experts, [&](auto per_lane) {
    route_softmax_kernel<decltype(per_lane)::value><<<grid, kThreads, smem, cuda_stream>>>(params);
  });
  MG_CUDA_RETURN(cudaGetLastError());
  route_softmax_losses_kernel<<<1, kLossThreads, 0, cuda_stream>>>(partials, static_cast<int>(grid), num_experts,
                                                                   counts, num_tokens, top_k, losses);
  MG_CUDA_RETURN(cudaGetLastError());
  return ok();
}

extern "C" mg_status mg_route_softmax_backward(const float* logits, const float* lse, const int64_t* experts,
                                               const int64_t* counts, int64_t num_tokens, int num_experts,
                                               int top_k, int weights_mode, float scaling,
                                               const float* grad_weights, const float* grad_losses,
                                               const float* grad_logits, mg_dtype out_dtype, void* out,
                                               void* stream) {
  MG_ENTER_DEVICE_OF(out);
  MG_RETURN_IF_ERROR(route::check_choice("mg_route_softmax_backward", num_tokens, num_experts, top_k));
  MG_RETURN_IF_ERROR(check_mode("mg_route_softmax_backward", weights_mode));
  if (out_dtype != MG_FLOAT32 && out_dtype != MG_BFLOAT16) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "mg_route_softmax_backward: out_dtype must be fp32 or bf16, got %s",
                dtype_name(out_dtype));
  }
  if (num_tokens == 0) return ok();
  if (logits == nullptr || lse == nullptr || experts == nullptr || counts == nullptr || out == nullptr) {
    return fail(MG_ERROR_INVALID_ARGUMENT,
                "mg_route_softmax_backward: logits, lse, experts, counts and out must be device pointers, got NULL");
  }
  const BackwardParams params{logits, lse, experts, counts, num_tokens, num_experts, top_k, weights_mode,
                              scaling, grad_weights, grad_losses, grad_logits, out_dtype == MG_BFLOAT16, out};
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  const auto grid = static_cast<unsigned>(partial_rows(num_tokens));  // the forward's grid
  route::dispatch_per_lane(num_experts, [&](auto per_lane) {
    route_softmax_backward_kernel<decltype(per_lane)::value><<<grid, kThreads, 0, cuda_stream>>>(params);
  });
  MG_CUDA_RETURN(cudaGetLastError());
  return ok();
}
