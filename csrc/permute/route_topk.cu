// The router's expert choice: the top_k experts of each token's scores and
// the copies routed to each expert, in one pass with no host sync.
//
// One warp per token (a few tokens per warp in turn) chooses as
// route_select.cuh says; integer counts go through shared memory, then one
// global add per CTA and expert. It replaces torch.topk plus a scatter-add of
// ones (docs/routing.md).
#include <cstdint>

#include "core/device_guard.h"
#include "core/error.h"
#include "permute/route_select.cuh"

namespace moe_grouped {
namespace {

using route::kLanes;
using route::kThreads;
using route::kWarps;

// kPerLane: keys per lane, ceil(num_experts / 32) rounded up to a power of two.
template <int kPerLane>
__global__ void __launch_bounds__(kThreads)
    route_topk_kernel(const float* __restrict__ scores, int64_t num_tokens, int num_experts, int top_k,
                      int64_t* __restrict__ experts, unsigned long long* __restrict__ counts) {
  extern __shared__ int32_t hist[];  // [num_experts]
  route::clear_histogram(hist, num_experts);
  __syncthreads();
  const int lane = threadIdx.x % kLanes;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t token = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kLanes; token < num_tokens;
       token += warps) {
    float values[kPerLane];
    route::load_row(scores + token * num_experts, num_experts, lane, values);
    const int chosen = route::choose_topk(values, num_experts, top_k, lane);
    if (lane < top_k) {
      experts[token * top_k + lane] = chosen;
      atomicAdd(&hist[chosen], 1);
    }
  }
  __syncthreads();
  route::add_histogram(hist, num_experts, counts);
}

template <int kPerLane>
void launch(const float* scores, int64_t num_tokens, int num_experts, int top_k, int64_t* experts,
            int64_t* counts, cudaStream_t stream) {
  const auto blocks = static_cast<unsigned>(route::blocks_for(num_tokens, 65535));
  route_topk_kernel<kPerLane><<<blocks, kThreads, sizeof(int32_t) * num_experts, stream>>>(
      scores, num_tokens, num_experts, top_k, experts, reinterpret_cast<unsigned long long*>(counts));
}

}  // namespace
}  // namespace moe_grouped

using namespace moe_grouped;

extern "C" mg_status mg_route_topk(const float* scores, int64_t num_tokens, int num_experts, int top_k,
                                   int64_t* experts, int64_t* counts, void* stream) {
  MG_ENTER_DEVICE_OF(experts);
  MG_RETURN_IF_ERROR(route::check_choice("mg_route_topk", num_tokens, num_experts, top_k));
  if (counts == nullptr || (num_tokens > 0 && (scores == nullptr || experts == nullptr))) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "scores, experts and counts must be device pointers, got NULL");
  }
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  MG_CUDA_RETURN(cudaMemsetAsync(counts, 0, sizeof(int64_t) * num_experts, cuda_stream));
  if (num_tokens == 0) return ok();
  route::dispatch_per_lane(num_experts, [&](auto per_lane) {
    launch<decltype(per_lane)::value>(scores, num_tokens, num_experts, top_k, experts, counts, cuda_stream);
  });
  MG_CUDA_RETURN(cudaGetLastError());
  return ok();
}
