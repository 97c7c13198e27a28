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

// One CTA per 128x128 block of one group: amax over the block, then the fp8
// block row-major into q and, through shared memory, column-major into qt.
template <typename T, bool kE4M3>
__global__ void __launch_bounds__(kThreads) weight_128x128_kernel(const WeightArgs a) {
  __shared__ __align__(16) uint8_t tile[kBlock * kBlock];
  __shared__ float warp_amax[kThreads / 32];

  const int64_t tiles = a.row_tiles * a.col_tiles;
  const int64_t group = static_cast<int64_t>(blockIdx.x) / tiles;
  const int64_t row_tile = static_cast<int64_t>(blockIdx.x) % tiles / a.col_tiles;
  const int64_t col_tile = static_cast<int64_t>(blockIdx.x) % a.col_tiles;
  const int64_t row0 = row_tile * kBlock, col0 = col_tile * kBlock;
  const int valid_rows = static_cast<int>(a.n - row0 < kBlock ? a.n - row0 : kBlock);
  const int valid_cols = static_cast<int>(a.k - col0 < kBlock ? a.k - col0 : kBlock);
  const T* w = a.base != nullptr ? static_cast<const T*>(a.base) + group * a.group_stride
                                 : static_cast<const T*>(a.ptrs[group]);
  const int part = threadIdx.x % 8;
  const int c = part * 16;  // first of this thread's 16 columns in the block
  // Pointers from the device array are known only here.
  const bool vector_in = a.k % 16 == 0 && aligned16(w);

  float v[kPasses][16];
  if (vector_in) {
    constexpr int kChunks = sizeof(T);
    uint4 raw[kPasses][kChunks];
    load_tile_chunks(w + row0 * a.k + col0 + c, a.k, valid_rows, c < valid_cols, raw);
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const T* values = reinterpret_cast<const T*>(raw[p]);
#pragma unroll
      for (int i = 0; i < 16; ++i) v[p][i] = to_float(values[i]);
    }
  } else {
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const int r = p * kRowsPerPass + static_cast<int>(threadIdx.x) / 8;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        v[p][i] = r < valid_rows && c + i < valid_cols ? to_float(w[(row0 + r) * a.k + col0 + c + i]) : 0.f;
      }
    }
  }

  float amax = 0.f;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
#pragma unroll
    for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(v[p][i]));
  }
  amax = warp_max_xor(amax, 32);
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = warp_amax[0];
#pragma unroll
  for (int i = 1; i < kThreads / 32; ++i) amax = fmaxf(amax, warp_amax[i]);
  const float scale = compute_scale(amax, a.fp8_max, a.pow2, a.epsilon);
  if (threadIdx.x == 0) {
    a.scale_inv[(group * a.row_tiles + row_tile) * a.col_tiles + col_tile] = 1.f / scale;
    if (a.qt != nullptr) a.scale_inv_t[(group * a.col_tiles + col_tile) * a.row_tiles + row_tile] = 1.f / scale;
  }

#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int r = p * kRowsPerPass + static_cast<int>(threadIdx.x) / 8;
    const uint4 packed = pack_fp8x16<kE4M3>(v[p], scale);
    if (r < valid_rows && c < valid_cols) {
      store_fp8x16(a.q + (group * a.n + row0 + r) * a.k + col0 + c, packed, valid_cols - c, a.vector_q);
    }
    if (a.qt != nullptr) *reinterpret_cast<uint4*>(tile + fp8_tile_offset(r, c)) = packed;
  }
  if (a.qt == nullptr) return;
  __syncthreads();

  // Transposed copy: a warp takes four columns of the block, eight lanes per
  // column, each lane 16 consecutive rows, and writes four 128-byte runs of qt.
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int segment = lane % 8;
  const int segment_rows = valid_rows - segment * kSegment;
#pragma unroll 1
  for (int round = 0; round < kBlock / 32; ++round) {
    const int col = round * 32 + warp * 4 + lane / 8;
    if (col >= valid_cols || segment_rows <= 0) continue;
    uint32_t words[4];
#pragma unroll
    for (int word = 0; word < 4; ++word) {
      uint32_t bits = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        bits |= static_cast<uint32_t>(tile[fp8_tile_offset(segment * kSegment + word * 4 + b, col)]) << (8 * b);
      }
      words[word] = bits;
    }
    store_fp8x16(a.qt + (group * a.k + col0 + col) * a.n + row0 + segment * kSegment,
                 make_uint4(words[0], words[1], words[2], words[3]),
                 segment_rows < kSegment ? segment_rows : kSegment, a.vector_qt);
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
