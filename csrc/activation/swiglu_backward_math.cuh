// One element of SwiGLU, shared by the standalone passes (swiglu.cu,
// swiglu_weighted_backward.cu) and the GEMM epilogues that fuse them
// (gemm/sm90_pingpong_fprop_bf16.cu's fc1, gemm/sm90_swiglu_backward_epilogue.cuh's
// fc2 dgrad), so that all round alike and the epilogues' results are bitwise
// the passes'.
//
// Forward, from gate x and up u as stored in T: h = T(T(silu(x)) * u), the
// rounding of torch's composed silu(gate) * up.
#pragma once

#include "core/convert.cuh"

namespace moe_grouped {

template <typename T>
__device__ __forceinline__ float round_through(float x) {
  return to_float(from_float<T>(x));
}

// silu(x) as torch stores it: T(x * sigmoid(x)).
template <typename T>
__device__ __forceinline__ float silu_stored(float x) {
  return round_through<T>(x / (1.f + expf(-x)));
}

// h before its final rounding: the caller rounds (or packs) it to T.
template <typename T>
__device__ __forceinline__ float swiglu_forward_element(float x, float u) {
  return silu_stored<T>(x) * u;
}

// The fused experts path's weighted backward, from gate x, up u, the
// unweighted fc2 input gradient du (as stored in T) and the routing weight w,
// with the composed torch ops' roundings (T(.)):
//   a = T(silu(x))   h = T(a * u)   wh = T(w * h)
//   d = T(w * du)    d_up = T(d * a)   d_a = T(d * u)
//   d_gate = T(d_a * s * (1 + x * (1 - s))),  s = sigmoid(x)
// Returns du * h, the element's term of dprob = <dh_u, h>.
template <typename T>
__device__ __forceinline__ float swiglu_weighted_backward_element(float x, float u, float du, float w, T& d_gate,
                                                                 T& d_up, T& weighted) {
  const float a = round_through<T>(x / (1.f + expf(-x)));
  const float h = round_through<T>(a * u);
  weighted = from_float<T>(w * h);
  const float d = round_through<T>(w * du);
  d_up = from_float<T>(d * a);
  const float d_a = round_through<T>(d * u);
  const float s = 1.f / (1.f + expf(-x));
  d_gate = from_float<T>(d_a * s * (1.f + x * (1.f - s)));
  return du * h;
}

}  // namespace moe_grouped
