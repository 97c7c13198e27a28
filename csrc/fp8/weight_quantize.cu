// FP8 128x128 block quantization of grouped weights, with the transposed copy
// the dgrad GEMM reads (the same fp8 bytes, so q and qt agree exactly).
#include <cstdint>

#include "core/device_guard.h"
#include "fp8/quantize_common.cuh"

namespace moe_grouped::quantize {
namespace {

struct WeightArgs {
  const void* base;  // [E][n, k] at base + e * group_stride, or ptrs[e]
  int64_t group_stride;
  const void* const* ptrs;
  int64_t n;
  int64_t k;
  int64_t row_tiles;  // ceil(n / 128)
  int64_t col_tiles;  // ceil(k / 128)
  float fp8_max;
  bool pow2;
  float epsilon;
  uint8_t* q;           // [E, n, k]
  float* scale_inv;     // [E, row_tiles, col_tiles]
  uint8_t* qt;          // [E, k, n], or nullptr
  float* scale_inv_t;   // [E, col_tiles, row_tiles]
  bool vector_q;        // k % 16 == 0 and q 16-byte aligned
  bool vector_qt;       // n % 16 == 0 and qt 16-byte aligned
};


// Byte offset of (r, c) in the fp8 tile: 128-byte rows of 16-byte chunks,
// XOR-swizzled by the row's 16-row segment (see grouped_quantize.cu).
__device__ inline int fp8_tile_offset(int r, int c) { return r * kBlock + ((c / 16) ^ ((r / kSegment) % 8)) * 16 + c % 16; }

// The largest |value| of a thread's 16 values in one pass, as fmaxf over their
// floats would give it (NaNs passed over). 16-bit values are compared as
// pairs in their own type, whose abs and max are exact, so that the tile
// stays packed in registers until it is converted for the fp8 store.
__device__ inline float chunk_amax(const uint4 (&chunks)[4], float) {
  const float* v = reinterpret_cast<const float*>(chunks);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(v[i]));
  return amax;
}
template <typename Pair>
__device__ inline float pair_amax(const uint4 (&chunks)[2]) {
  const Pair* v = reinterpret_cast<const Pair*>(chunks);
  Pair amax = __habs2(v[0]);
#pragma unroll
  for (int i = 1; i < 8; ++i) amax = __hmax2(amax, __habs2(v[i]));
  return fmaxf(to_float(amax.x), to_float(amax.y));
}
__device__ inline float chunk_amax(const uint4 (&chunks)[2], __nv_bfloat16) { return pair_amax<__nv_bfloat162>(chunks); }
__device__ inline float chunk_amax(const uint4 (&chunks)[2], __half) { return pair_amax<__half2>(chunks); }

// Columns c..c+3 of rows r0..r0+3 (words[i]: row r0 + i, column c + j in
// byte j) as rows r0..r0+3 of columns c..c+3 (out[j]: column c + j, row
// r0 + i in byte i).
__device__ inline void transpose_4x4_bytes(const uint32_t (&words)[4], uint32_t (&out)[4]) {
  const uint32_t low01 = __byte_perm(words[0], words[1], 0x5140);   // bytes 0 and 1 of rows 0 and 1
  const uint32_t high01 = __byte_perm(words[0], words[1], 0x7362);  // bytes 2 and 3
  const uint32_t low23 = __byte_perm(words[2], words[3], 0x5140);
  const uint32_t high23 = __byte_perm(words[2], words[3], 0x7362);
  out[0] = __byte_perm(low01, low23, 0x5410);
  out[1] = __byte_perm(low01, low23, 0x7632);
  out[2] = __byte_perm(high01, high23, 0x5410);
  out[3] = __byte_perm(high01, high23, 0x7632);
}

// One CTA per 128x128 block of one group: amax over the block, then the fp8
// block row-major into q and, through shared memory, column-major into qt.
// The block is held as its 16-bit values until the store: 80 registers,
// three CTAs an SM, where converted to floats up front it took 95-115 and
// two (docs/kernels.md, "FP8 quantize").
template <typename T, bool kE4M3>
__global__ void __launch_bounds__(kThreads, sizeof(T) == 2 ? 3 : 1) weight_128x128_kernel(const WeightArgs a) {
  __shared__ __align__(16) uint8_t tile[kBlock * kBlock];
  __shared__ float warp_amax[kThreads / 32];

  // 32-bit: the grid, n and k are under 2^31 (mg_quantize_weight_128x128).
  const int tiles = static_cast<int>(a.row_tiles * a.col_tiles);
  const int col_tiles = static_cast<int>(a.col_tiles);
  const int group = static_cast<int>(blockIdx.x) / tiles;
  const int row_tile = static_cast<int>(blockIdx.x) % tiles / col_tiles;
  const int col_tile = static_cast<int>(blockIdx.x) % col_tiles;
  const int row0 = row_tile * kBlock, col0 = col_tile * kBlock;
  const int valid_rows = static_cast<int>(a.n - row0 < kBlock ? a.n - row0 : kBlock);
  const int valid_cols = static_cast<int>(a.k - col0 < kBlock ? a.k - col0 : kBlock);
  const T* w = a.base != nullptr ? static_cast<const T*>(a.base) + static_cast<int64_t>(group) * a.group_stride
                                 : static_cast<const T*>(a.ptrs[group]);
  const int part = threadIdx.x % 8;
  const int c = part * 16;  // first of this thread's 16 columns in the block
  // Pointers from the device array are known only here.
  const bool vector_in = a.k % 16 == 0 && aligned16(w);

  uint4 raw[kPasses][sizeof(T)];  // this thread's 16 values of each pass
  if (vector_in) {
    load_tile_chunks(w + static_cast<int64_t>(row0) * a.k + col0 + c, a.k, valid_rows, c < valid_cols, raw);
  } else {
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const int r = p * kRowsPerPass + static_cast<int>(threadIdx.x) / 8;
      T* values = reinterpret_cast<T*>(raw[p]);
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        values[i] = r < valid_rows && c + i < valid_cols ? w[static_cast<int64_t>(row0 + r) * a.k + col0 + c + i] : T(0.f);
      }
    }
  }

  float amax = 0.f;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) amax = fmaxf(amax, chunk_amax(raw[p], T{}));
  amax = warp_max_xor(amax, 32);
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = warp_amax[0];
#pragma unroll
  for (int i = 1; i < kThreads / 32; ++i) amax = fmaxf(amax, warp_amax[i]);
  const float scale = compute_scale(amax, a.fp8_max, a.pow2, a.epsilon);
  if (threadIdx.x == 0) {
    a.scale_inv[static_cast<int64_t>(blockIdx.x)] = 1.f / scale;  // [E, row_tiles, col_tiles]: the CTA's order
    if (a.qt != nullptr) a.scale_inv_t[(static_cast<int64_t>(group) * col_tiles + col_tile) * a.row_tiles + row_tile] = 1.f / scale;
  }

#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int r = p * kRowsPerPass + static_cast<int>(threadIdx.x) / 8;
    const T* values = reinterpret_cast<const T*>(raw[p]);
    float v[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = to_float(values[i]);
    const uint4 packed = pack_fp8x16<kE4M3>(v, scale);
    if (r < valid_rows && c < valid_cols) {
      store_fp8x16(a.q + (static_cast<int64_t>(group) * a.n + row0 + r) * a.k + col0 + c, packed, valid_cols - c, a.vector_q);
    }
    if (a.qt != nullptr) *reinterpret_cast<uint4*>(tile + fp8_tile_offset(r, c)) = packed;
  }
  if (a.qt == nullptr) return;
  __syncthreads();

  // Transposed copy: a lane takes four columns and one 16-row segment of
  // them, reads the segment's rows as 4-byte words and transposes them in
  // registers. The eight lanes of a column group hold its eight segments, so
  // each store of a warp writes four 128-byte runs of qt; the warp's loads
  // of a row step hit eight different chunks (the swizzle), so 32 banks.
  const int lane = threadIdx.x % 32;
  const int segment = lane % 8;
  const int first_col = (static_cast<int>(threadIdx.x) / 32 * 4 + lane / 8) * 4;
  const int segment_rows = valid_rows - segment * kSegment;
  if (first_col >= valid_cols || segment_rows <= 0) return;
  uint32_t columns[4][4];  // columns[j][w]: rows 4w..4w+3 of the segment in column first_col + j
#pragma unroll
  for (int word = 0; word < 4; ++word) {
    uint32_t rows[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      rows[i] = *reinterpret_cast<const uint32_t*>(tile + fp8_tile_offset(segment * kSegment + word * 4 + i, first_col));
    }
    uint32_t out[4];
    transpose_4x4_bytes(rows, out);
#pragma unroll
    for (int j = 0; j < 4; ++j) columns[j][word] = out[j];
  }
  const int count = segment_rows < kSegment ? segment_rows : kSegment;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (first_col + j >= valid_cols) break;
    store_fp8x16(a.qt + (static_cast<int64_t>(group) * a.k + col0 + first_col + j) * a.n + row0 + segment * kSegment,
                 make_uint4(columns[j][0], columns[j][1], columns[j][2], columns[j][3]), count, a.vector_qt);
  }
}

}  // namespace
}  // namespace moe_grouped::quantize

using namespace moe_grouped;
using namespace moe_grouped::quantize;

extern "C" mg_status mg_quantize_weight_128x128(mg_group_operand w, mg_dtype w_dtype, int num_groups, int64_t n,
                                                int64_t k, mg_quantize_config config, void* q, float* scale_inv,
                                                void* qt, float* scale_inv_t, void* stream) {
  MG_ENTER_DEVICE_OF(q, qt);
  MG_RETURN_IF_ERROR(check_float_dtype("w", w_dtype));
  float fp8_max = 0.f;
  MG_RETURN_IF_ERROR(check_fp8_config(config, &fp8_max));
  if (num_groups < 0 || n < 0 || k < 0 || n > INT32_MAX || k > INT32_MAX) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "need num_groups >= 0 and n, k in [0, 2^31), got %d groups of %lld x %lld",
                num_groups, static_cast<long long>(n), static_cast<long long>(k));
  }
  if (num_groups == 0 || n == 0 || k == 0) return ok();
  if (w.base == nullptr && w.ptrs == nullptr) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "w needs a base pointer or a device array of %d pointers", num_groups);
  }
  if (w.base != nullptr && w.group_stride < n * k) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "w.group_stride must be at least n * k = %lld elements, got %lld",
                static_cast<long long>(n * k), static_cast<long long>(w.group_stride));
  }
  if (q == nullptr || scale_inv == nullptr || (qt != nullptr && scale_inv_t == nullptr)) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "q and scale_inv must not be NULL, nor scale_inv_t when qt is given");
  }
  WeightArgs args{};
  args.base = w.base;
  args.group_stride = w.group_stride;
  args.ptrs = w.ptrs;
  args.n = n;
  args.k = k;
  args.row_tiles = (n + kBlock - 1) / kBlock;
  args.col_tiles = (k + kBlock - 1) / kBlock;
  args.fp8_max = fp8_max;
  args.pow2 = config.pow2_scales != 0;
  args.epsilon = config.amax_epsilon;
  args.q = static_cast<uint8_t*>(q);
  args.scale_inv = scale_inv;
  args.qt = static_cast<uint8_t*>(qt);
  args.scale_inv_t = scale_inv_t;
  args.vector_q = k % 16 == 0 && aligned16(q);
  args.vector_qt = n % 16 == 0 && aligned16(qt);
  const int64_t grid = num_groups * args.row_tiles * args.col_tiles;
  if (grid > INT32_MAX) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "w is too large: %d groups of %lld x %lld", num_groups,
                static_cast<long long>(n), static_cast<long long>(k));
  }
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  dispatch_types(w_dtype, config.fp8_dtype, [&](auto tag, auto e4m3) {
    using T = typename decltype(tag)::type;
    weight_128x128_kernel<T, decltype(e4m3)::value>
        <<<static_cast<unsigned>(grid), kThreads, 0, cuda_stream>>>(args);
  });
  MG_CUDA_RETURN(cudaGetLastError());
  return ok();
}
