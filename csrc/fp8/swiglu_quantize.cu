// h = swiglu(g) quantized row-wise in 1x128 blocks from one read of g, for
// the FP8 fused experts path's fc2 input: h itself is never stored. Each
// element of h is computed and rounded to g's type exactly as mg_swiglu_forward
// stores it, then quantized as mg_quantize_rowwise_1x128 does, so the result
// is bitwise the two passes.
#include <cstdint>

#include "activation/swiglu_backward_math.cuh"
#include "core/device_guard.h"
#include "fp8/quantize_common.cuh"

namespace moe_grouped::quantize {
namespace {

// Eight threads per (row, 128-column block) of h, 16 consecutive columns each:
// the gate's 16 elements and the up projection's 16 (ffn further on) by
// 16-byte loads. Needs ffn % 16 == 0 and 16-byte aligned g and q.
template <typename T, bool kE4M3>
__global__ void __launch_bounds__(kThreads)
    swiglu_rowwise_kernel(const T* __restrict__ g, int64_t rows, int64_t ffn, float fp8_max, bool pow2,
                          float epsilon, uint8_t* __restrict__ q, float* __restrict__ scale_inv) {
  constexpr int kLoads = sizeof(T);  // 16-byte loads per 16 elements
  const RowBlockLane lane = row_block_lane(rows, ffn);
  float v[16];
  if (lane.in_range) {
    const T* gate_ptr = g + lane.row * 2 * ffn + lane.col0;
    uint4 gate_raw[kLoads], up_raw[kLoads];
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      gate_raw[i] = __ldg(reinterpret_cast<const uint4*>(gate_ptr) + i);
      up_raw[i] = __ldg(reinterpret_cast<const uint4*>(gate_ptr + ffn) + i);
    }
    const T* gate = reinterpret_cast<const T*>(gate_raw);
    const T* up = reinterpret_cast<const T*>(up_raw);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      v[i] = round_through<T>(swiglu_forward_element<T>(to_float(gate[i]), to_float(up[i])));
    }
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = 0.f;
  }
  finish_rowwise_block16<kE4M3>(v, lane.active, lane.in_range, lane.part, fp8_max, pow2, epsilon,
                                q + lane.row * ffn + lane.col0, scale_inv + lane.unit);
}

}  // namespace
}  // namespace moe_grouped::quantize

using namespace moe_grouped;
using namespace moe_grouped::quantize;

extern "C" mg_status mg_swiglu_quantize_rowwise_1x128(const void* g, mg_dtype dtype, int64_t rows, int64_t ffn,
                                                      mg_quantize_config config, void* q, float* scale_inv,
                                                      void* stream) {
  MG_ENTER_DEVICE_OF(q);
  float fp8_max = 0.f;
  MG_RETURN_IF_ERROR(check_float_dtype("g", dtype));
  MG_RETURN_IF_ERROR(check_fp8_config(config, &fp8_max));
  if (rows < 0 || ffn < 0 || rows > INT32_MAX || ffn > INT32_MAX / 2) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "rows and ffn must be in [0, 2^31) and [0, 2^30), got %lld x %lld",
                static_cast<long long>(rows), static_cast<long long>(ffn));
  }
  if (rows == 0 || ffn == 0) return ok();
  if (g == nullptr || q == nullptr || scale_inv == nullptr) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "g, q and scale_inv must not be NULL");
  }
  if (ffn % 16 != 0 || !aligned16(g) || !aligned16(q)) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "needs ffn %% 16 == 0 and 16-byte aligned g and q, got ffn %lld",
                static_cast<long long>(ffn));
  }
  const int64_t units = rows * ((ffn + kBlock - 1) / kBlock);
  const int64_t grid = (units * 8 + kThreads - 1) / kThreads;
  if (grid > INT32_MAX) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "g is too large: %lld blocks", static_cast<long long>(grid));
  }
  const bool pow2 = config.pow2_scales != 0;
  dispatch_types(dtype, config.fp8_dtype, [&](auto tag, auto e4m3) {
    using T = typename decltype(tag)::type;
    swiglu_rowwise_kernel<T, decltype(e4m3)::value><<<static_cast<unsigned>(grid), kThreads, 0,
                                                      static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(g), rows, ffn, fp8_max, pow2, config.amax_epsilon, static_cast<uint8_t*>(q),
        scale_inv);
  });
  MG_CUDA_RETURN(cudaGetLastError());
  return ok();
}
