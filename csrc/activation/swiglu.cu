// SwiGLU on the fused fc1 output h = [gate | up] ([rows, 2 * ffn]): the
// forward y = silu(gate) * up and its backward in one pass each, instead of
// the five elementwise kernels and the concatenation that the composed torch
// ops run (each of which reads strided halves of h).
//
// The arithmetic mirrors the composed ops step for step, rounding to the
// element type where they store a tensor, so the results equal
// `silu(gate) * up` and its autograd gradients in torch:
//   a      = T(gate / (1 + exp(-gate)))              silu, stored by torch
//   y      = T(a * up)
//   d_up   = T(dy * a)
//   d_a    = T(dy * up)
//   s      = 1 / (1 + exp(-gate))
//   d_gate = T(d_a * s * (1 + gate * (1 - s)))       silu's backward
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "activation/swiglu_backward_math.cuh"
#include "core/device_guard.h"
#include "core/elementwise.cuh"
#include "core/error.h"

namespace moe_grouped {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 20;  // grid-stride beyond this

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// Calls f(row, col) for every pack of V consecutive columns of a [rows, ffn]
// grid, one pack per thread, grid-striding past the launched threads.
template <int V, typename F>
__device__ __forceinline__ void for_each_pack(int64_t rows, int64_t ffn, F&& f) {
  const int64_t packs_per_row = ffn / V;
  const int64_t packs = rows * packs_per_row;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < packs;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t row = i / packs_per_row;
    f(row, (i - row * packs_per_row) * V);
  }
}

// Element (row, col) of gate is h[row * 2 * ffn + col], of up that + ffn.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    swiglu_forward_kernel(const T* __restrict__ h, int64_t rows, int64_t ffn, T* __restrict__ y) {
  for_each_pack<V>(rows, ffn, [&](int64_t row, int64_t col) {
    const T* gate_ptr = h + row * 2 * ffn + col;
    const Pack<T, V> gate = load_pack<T, V>(gate_ptr);
    const Pack<T, V> up = load_pack<T, V>(gate_ptr + ffn);
    Pack<T, V> out;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      out.v[j] = from_float<T>(swiglu_forward_element<T>(to_float(gate.v[j]), to_float(up.v[j])));
    }
    store_pack<T, V>(y + row * ffn + col, out);
  });
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_kernel(const T* __restrict__ dy, const T* __restrict__ h, int64_t rows, int64_t ffn,
                           T* __restrict__ dh) {
  for_each_pack<V>(rows, ffn, [&](int64_t row, int64_t col) {
    const int64_t gate_at = row * 2 * ffn + col;
    const Pack<T, V> grad = load_pack<T, V>(dy + row * ffn + col);
    const Pack<T, V> gate = load_pack<T, V>(h + gate_at);
    const Pack<T, V> up = load_pack<T, V>(h + gate_at + ffn);
    Pack<T, V> d_gate, d_up;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float g = to_float(gate.v[j]);
      const float d = to_float(grad.v[j]);
      d_up.v[j] = from_float<T>(d * silu_stored<T>(g));
      const float d_a = to_float(from_float<T>(d * to_float(up.v[j])));
      const float s = sigmoid(g);
      d_gate.v[j] = from_float<T>(d_a * s * (1.f + g * (1.f - s)));
    }
    store_pack<T, V>(dh + gate_at, d_gate);
    store_pack<T, V>(dh + gate_at + ffn, d_up);
  });
}

mg_status check_args(mg_dtype dtype, int64_t rows, int64_t ffn, std::initializer_list<const void*> pointers) {
  MG_RETURN_IF_ERROR(check_float_dtype("SwiGLU tensors", dtype));
  if (rows < 0 || ffn < 0) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "SwiGLU needs rows >= 0 and ffn >= 0, got %lld and %lld",
                static_cast<long long>(rows), static_cast<long long>(ffn));
  }
  if (rows > 0 && ffn > 0) {
    for (const void* p : pointers) {
      if (p == nullptr) return fail(MG_ERROR_INVALID_ARGUMENT, "SwiGLU tensors must not be NULL");
    }
  }
  return MG_OK;
}

// Runs launch(T{}, V) with 16-byte packs when every row start of h, the
// output and the gradients is 16-byte aligned (rows of ffn elements; h's
// halves are rows too), else element by element.
template <typename Launch>
mg_status dispatch(mg_dtype dtype, int64_t ffn, std::initializer_list<const void*> pointers, Launch&& launch) {
  with_type(dtype, [&](auto zero) {
    using T = decltype(zero);
    if (rows_are_16_byte_aligned<T>(ffn, pointers)) {
      launch(zero, std::integral_constant<int, 16 / sizeof(T)>{});
    } else {
      launch(zero, std::integral_constant<int, 1>{});
    }
  });
  MG_CUDA_RETURN(cudaGetLastError());
  return ok();
}

template <int V>
unsigned grid_for(int64_t rows, int64_t ffn) {
  const int64_t blocks = (rows * (ffn / V) + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

}  // namespace
}  // namespace moe_grouped

using namespace moe_grouped;

extern "C" mg_status mg_swiglu_forward(const void* h, mg_dtype dtype, int64_t rows, int64_t ffn, void* y,
                                       void* stream) {
  MG_ENTER_DEVICE_OF(y);
  MG_RETURN_IF_ERROR(check_args(dtype, rows, ffn, {h, y}));
  if (rows == 0 || ffn == 0) return ok();
  return dispatch(dtype, ffn, {h, y}, [&](auto zero, auto vector) {
    using T = decltype(zero);
    constexpr int V = decltype(vector)::value;
    swiglu_forward_kernel<T, V><<<grid_for<V>(rows, ffn), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(h), rows, ffn, static_cast<T*>(y));
  });
}

extern "C" mg_status mg_swiglu_backward(const void* dy, const void* h, mg_dtype dtype, int64_t rows,
                                        int64_t ffn, void* dh, void* stream) {
  MG_ENTER_DEVICE_OF(dh);
  MG_RETURN_IF_ERROR(check_args(dtype, rows, ffn, {dy, h, dh}));
  if (rows == 0 || ffn == 0) return ok();
  return dispatch(dtype, ffn, {dy, h, dh}, [&](auto zero, auto vector) {
    using T = decltype(zero);
    constexpr int V = decltype(vector)::value;
    swiglu_backward_kernel<T, V><<<grid_for<V>(rows, ffn), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(dy), static_cast<const T*>(h), rows, ffn, static_cast<T*>(dh));
  });
}
