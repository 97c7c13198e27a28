// Shared by the core's memory-bound kernels over fp32 / fp16 / bf16 tensors
// (permutation, SwiGLU; the FP8 quantizers' input check): the dtype check and
// dispatch, and V-element packs for 16-byte accesses where rows allow them.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "core/convert.cuh"
#include "core/error.h"

namespace moe_grouped {

// V consecutive elements moved as one access (16 bytes: V = 16 / sizeof(T)).
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// The pack at p (aligned to the pack's size).
template <typename T, int V>
__device__ __forceinline__ Pack<T, V> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, V>*>(p);
}

template <typename T, int V>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, V>& pack) {
  *reinterpret_cast<Pack<T, V>*>(p) = pack;
}

// 16-byte accesses when the row length (`row_elements` of T) and every base
// address allow them; NULL pointers (absent operands) do not count.
template <typename T>
bool rows_are_16_byte_aligned(int64_t row_elements, std::initializer_list<const void*> pointers) {
  if ((row_elements * static_cast<int64_t>(sizeof(T))) % 16 != 0) return false;
  for (const void* p : pointers) {
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

inline mg_status check_float_dtype(const char* what, mg_dtype dtype) {
  if (dtype != MG_FLOAT32 && dtype != MG_FLOAT16 && dtype != MG_BFLOAT16) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s must be float32, float16 or bfloat16, got %s", what,
                dtype_name(dtype));
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

}  // namespace moe_grouped
