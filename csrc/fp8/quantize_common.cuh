// Shared by the FP8 block quantizers (grouped_quantize.cu, weight_quantize.cu):
// the scale rule, the fp8 conversion, argument checks and dtype dispatch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "core/elementwise.cuh"
#include "core/error.h"
#include "moe_grouped/moe_grouped.h"

namespace moe_grouped::quantize {

constexpr int kBlock = 128;    // elements per scaling block (1x128 and 128x128)
constexpr int kThreads = 256;  // threads per CTA of every quantize kernel
// A 128x128 tile is read with eight threads per row, 16 columns each, in
// kPasses passes of kRowsPerPass rows; a column is later read as eight
// 16-row segments (the column passes and the tiles' swizzle).
constexpr int kRowsPerPass = kThreads / 8;
constexpr int kPasses = kBlock / kRowsPerPass;
constexpr int kSegment = 16;

// This thread's 16 columns of every pass of a tile, as 16-byte loads:
// `first` is the tile's first row at this thread's first column, `ld` the
// row stride; rows from valid_rows on, or all when !in_columns, read as zeros.
template <typename T>
__device__ inline void load_tile_chunks(const T* first, int64_t ld, int valid_rows, bool in_columns,
                                        uint4 (&raw)[kPasses][sizeof(T)]) {
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int r = p * kRowsPerPass + static_cast<int>(threadIdx.x) / 8;
    const bool valid = r < valid_rows && in_columns;
    const uint4* src = reinterpret_cast<const uint4*>(first + r * ld);
#pragma unroll
    for (int k = 0; k < static_cast<int>(sizeof(T)); ++k) {
      raw[p][k] = valid ? __ldg(src + k) : make_uint4(0, 0, 0, 0);
    }
  }
}

// TransformerEngine's block-scaling scale rule (see the C ABI header).
__device__ inline float compute_scale(float amax, float fp8_max, bool pow2, float epsilon) {
  if (amax < epsilon) amax = epsilon;
  if (isinf(amax) || amax == 0.f || isnan(amax)) return 1.f;
  float scale = __fdiv_rn(fp8_max, amax);
  if (isinf(scale)) scale = FLT_MAX;
  if (pow2) scale = __uint_as_float(__float_as_uint(scale) & 0xFF800000u);
  return scale;
}

template <bool kE4M3>
__device__ inline uint32_t to_fp8(float v) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, kE4M3 ? __NV_E4M3 : __NV_E5M2);
}

// Two values converted at once: x.x in the low byte, x.y in the high byte.
template <bool kE4M3>
__device__ inline uint32_t to_fp8x2(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, kE4M3 ? __NV_E4M3 : __NV_E5M2);
}

// Sixteen values scaled and converted, packed little-endian for one 16-byte
// store: value i lands at byte i.
template <bool kE4M3>
__device__ inline uint4 pack_fp8x16(const float (&v)[16], float scale) {
  uint32_t words[4];
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    words[w] = to_fp8x2<kE4M3>(v[4 * w] * scale, v[4 * w + 1] * scale) |
               to_fp8x2<kE4M3>(v[4 * w + 2] * scale, v[4 * w + 3] * scale) << 16;
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
}

__device__ inline uint8_t byte_of(const uint4& packed, int i) {
  const uint32_t word = i < 4 ? packed.x : i < 8 ? packed.y : i < 12 ? packed.z : packed.w;
  return static_cast<uint8_t>(word >> (8 * (i % 4)));
}

// Stores the first `count` (<= 16) bytes of `packed` at dst: one 16-byte
// store when all sixteen go and `vector` says dst is 16-byte aligned.
__device__ inline void store_fp8x16(uint8_t* dst, const uint4& packed, int count, bool vector) {
  if (vector && count >= 16) {
    *reinterpret_cast<uint4*>(dst) = packed;
    return;
  }
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    if (i < count) dst[i] = byte_of(packed, i);
  }
}

__device__ inline float warp_max_xor(float v, int lanes) {
  for (int offset = lanes / 2; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// A lane's place in the eight-lanes-per-block row-wise layout of a
// [rows, cols] matrix: its (row, 128-column block) pair, which 16 columns of
// it (part), whether the grid gave it a pair (active) and whether its
// columns start inside the row (in_range).
struct RowBlockLane {
  int64_t unit;
  int64_t row;
  int64_t col0;
  int part;
  bool active;
  bool in_range;
};

__device__ inline RowBlockLane row_block_lane(int64_t rows, int64_t cols) {
  const int64_t blocks_per_row = (cols + kBlock - 1) / kBlock;
  RowBlockLane lane;
  lane.unit = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 8;
  lane.part = threadIdx.x % 8;
  lane.active = lane.unit < rows * blocks_per_row;
  lane.row = lane.active ? lane.unit / blocks_per_row : 0;
  lane.col0 = (lane.unit % blocks_per_row) * kBlock + lane.part * 16;
  lane.in_range = lane.active && lane.col0 < cols;
  return lane;
}

// The end of a 1x128 row-wise block held by eight lanes, 16 values each (all
// eight call): the block's amax over them, then, for an active lane, its 16
// fp8 bytes at dst (16-byte aligned) when in_range, and from the block's
// first lane (part 0) the block's scale_inv.
template <bool kE4M3>
__device__ inline void finish_rowwise_block16(const float (&v)[16], bool active, bool in_range, int part,
                                              float fp8_max, bool pow2, float epsilon, uint8_t* dst,
                                              float* scale_inv) {
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(v[i]));
  amax = warp_max_xor(amax, 8);
  if (!active) return;
  const float scale = compute_scale(amax, fp8_max, pow2, epsilon);
  if (in_range) *reinterpret_cast<uint4*>(dst) = pack_fp8x16<kE4M3>(v, scale);
  if (part == 0) *scale_inv = 1.f / scale;
}

inline mg_status check_fp8_config(const mg_quantize_config& config, float* fp8_max) {
  if (config.fp8_dtype == MG_FLOAT8_E4M3) {
    *fp8_max = 448.f;
  } else if (config.fp8_dtype == MG_FLOAT8_E5M2) {
    *fp8_max = 57344.f;
  } else {
    return fail(MG_ERROR_INVALID_ARGUMENT, "fp8_dtype must be float8_e4m3fn or float8_e5m2, got %s",
                dtype_name(config.fp8_dtype));
  }
  if (!(config.amax_epsilon >= 0.f)) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "amax_epsilon must be non-negative, got %g",
                static_cast<double>(config.amax_epsilon));
  }
  return MG_OK;
}

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(std::bool_constant<value>{}).
template <typename F>
void dispatch_bool(bool value, F&& f) {
  if (value) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// Calls f(TypeTag<T>{}, std::bool_constant<kE4M3>{}) for the input dtype
// (checked beforehand, see with_type) and fp8 format, so that kernels are
// instantiated for every pair.
template <typename F>
void dispatch_types(mg_dtype x_dtype, mg_dtype fp8_dtype, F&& f) {
  with_type(x_dtype, [&](auto zero) {
    dispatch_bool(fp8_dtype == MG_FLOAT8_E4M3, [&](auto e4m3) { f(TypeTag<decltype(zero)>{}, e4m3); });
  });
}

__host__ __device__ inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace moe_grouped::quantize
