// FP8 1x128 block quantization: row-wise (fprop/dgrad operands) and grouped
// column-wise (the transposed per-expert copies that wgrad reduces over).
// Group boundaries come from device m_splits; nothing syncs with the host.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cfloat>
#include <cstdint>

#include "core/error.h"
#include "core/setup.cuh"
#include "core/workspace.h"

namespace moe_grouped {
namespace {

constexpr int kBlock = 128;       // elements per scaling block
constexpr int kTileCols = 64;     // columns per CTA in the column-wise kernel
constexpr int kThreads = 256;

__device__ inline float to_float(float v) { return v; }
__device__ inline float to_float(__half v) { return __half2float(v); }
__device__ inline float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

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
__device__ inline uint8_t to_fp8(float v) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, kE4M3 ? __NV_E4M3 : __NV_E5M2);
}

// One warp per (row, 128-column block); each lane owns 4 consecutive columns.
template <typename T, bool kE4M3>
__global__ void __launch_bounds__(kThreads)
    rowwise_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, float fp8_max, bool pow2,
                   float epsilon, uint8_t* __restrict__ q, float* __restrict__ scale_inv) {
  const int64_t blocks_per_row = (cols + kBlock - 1) / kBlock;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= rows * blocks_per_row) return;
  const int64_t row = warp / blocks_per_row;
  const int64_t col0 = (warp % blocks_per_row) * kBlock + lane * 4;
  const T* src = x + row * cols;
  float v[4];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[i] = (col0 + i < cols) ? to_float(src[col0 + i]) : 0.f;
    amax = fmaxf(amax, fabsf(v[i]));
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  const float scale = compute_scale(amax, fp8_max, pow2, epsilon);
  uint8_t* dst = q + row * cols;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (col0 + i < cols) dst[col0 + i] = to_fp8<kE4M3>(v[i] * scale);
  }
  if (lane == 0) scale_inv[row * blocks_per_row + warp % blocks_per_row] = 1.f / scale;
}

// Vectorised row-wise path (cols % 16 == 0, 16-byte aligned rows): eight
// lanes per 128-column block, 16 consecutive elements per lane, so each lane
// has two or more 16-byte loads in flight and writes its 16 fp8 bytes at once.
template <typename T>
struct Vec16 {
  static constexpr int kLoads = sizeof(T) * 16 / 16;  // 16-byte loads per lane
};

template <typename T, bool kE4M3>
__global__ void __launch_bounds__(kThreads)
    rowwise_vec16_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, float fp8_max, bool pow2,
                         float epsilon, uint8_t* __restrict__ q, float* __restrict__ scale_inv) {
  const int64_t blocks_per_row = (cols + kBlock - 1) / kBlock;
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t unit = thread / 8;  // (row, block) pair
  const int part = threadIdx.x % 8;
  const bool active = unit < rows * blocks_per_row;
  const int64_t row = active ? unit / blocks_per_row : 0;
  const int64_t col0 = (unit % blocks_per_row) * kBlock + part * 16;
  const bool in_range = active && col0 < cols;
  float v[16];
  if (in_range) {
    const uint4* src = reinterpret_cast<const uint4*>(x + row * cols + col0);
    uint4 raw[Vec16<T>::kLoads];
#pragma unroll
    for (int i = 0; i < Vec16<T>::kLoads; ++i) raw[i] = __ldg(src + i);
    const T* values = reinterpret_cast<const T*>(raw);
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = to_float(values[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = 0.f;
  }
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
  for (int offset = 4; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  if (!active) return;
  const float scale = compute_scale(amax, fp8_max, pow2, epsilon);
  if (in_range) {
    uint4 packed;
    uint8_t* bytes = reinterpret_cast<uint8_t*>(&packed);
#pragma unroll
    for (int i = 0; i < 16; ++i) bytes[i] = to_fp8<kE4M3>(v[i] * scale);
    *reinterpret_cast<uint4*>(q + row * cols + col0) = packed;
  }
  if (part == 0) scale_inv[unit] = 1.f / scale;
}

// Group offsets o_e and block offsets b_e (prefix sums of ceil(m_e / 128)).
template <typename SplitT>
__global__ void __launch_bounds__(kSetupThreads)
    columnwise_setup_kernel(const SplitT* m_splits, int num_groups, int64_t rows, int64_t* offsets,
                            int64_t* block_offsets) {
  // First pass: clamped offsets; block counts parked in block_offsets[g + 1].
  scan_splits(m_splits, num_groups, rows, offsets, [&](int g, int64_t, int64_t count) {
    block_offsets[g + 1] = (count + kBlock - 1) / kBlock;
  });
  __syncthreads();
  if (threadIdx.x == 0) {
    // E is small (<= a few thousand): a serial prefix over cached values is
    // cheaper than a second block scan's bookkeeping.
    block_offsets[0] = 0;
    for (int g = 0; g < num_groups; ++g) block_offsets[g + 1] += block_offsets[g];
  }
}

// One CTA per (128-row block of one group, 64 columns): amax per column over
// the block's rows, then the transposed fp8 tile written row-contiguous.
template <typename T, bool kE4M3>
__global__ void __launch_bounds__(kThreads)
    columnwise_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, int num_groups,
                      const int64_t* __restrict__ offsets, const int64_t* __restrict__ block_offsets,
                      int64_t scale_columns, float fp8_max, bool pow2, float epsilon,
                      uint8_t* __restrict__ qt, float* __restrict__ scale_inv_t) {
  __shared__ float tile[kBlock][kTileCols + 1];
  __shared__ float scales[kTileCols];
  const int64_t block = blockIdx.y;
  if (block >= block_offsets[num_groups]) return;
  // The group whose blocks contain `block`: largest g with b_g <= block < b_{g+1}.
  int lo = 0, hi = num_groups - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (block_offsets[mid] <= block) lo = mid; else hi = mid - 1;
  }
  const int group = lo;
  const int64_t row0 = offsets[group] + (block - block_offsets[group]) * kBlock;
  const int64_t group_end = offsets[group + 1];
  const int64_t remaining = group_end - row0;
  const int valid_rows = static_cast<int>(remaining < kBlock ? remaining : kBlock);
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTileCols;

  constexpr int kPerLoad = 16 / sizeof(T);                  // elements per 16-byte load
  constexpr int kThreadsPerRow = kTileCols / kPerLoad;
  constexpr int kRowsPerPass = kThreads / kThreadsPerRow;
  const bool vector_ok = (cols % kPerLoad == 0) && (reinterpret_cast<uintptr_t>(x) % 16 == 0);
  if (vector_ok) {
    const int c = (threadIdx.x % kThreadsPerRow) * kPerLoad;
    uint4 raw[kBlock / kRowsPerPass];
#pragma unroll
    for (int pass = 0; pass < kBlock / kRowsPerPass; ++pass) {
      const int r = threadIdx.x / kThreadsPerRow + pass * kRowsPerPass;
      raw[pass] = make_uint4(0, 0, 0, 0);
      if (r < valid_rows && col0 + c < cols) {
        raw[pass] = __ldg(reinterpret_cast<const uint4*>(x + (row0 + r) * cols + col0 + c));
      }
    }
#pragma unroll
    for (int pass = 0; pass < kBlock / kRowsPerPass; ++pass) {
      const int r = threadIdx.x / kThreadsPerRow + pass * kRowsPerPass;
      const T* values = reinterpret_cast<const T*>(&raw[pass]);
#pragma unroll
      for (int i = 0; i < kPerLoad; ++i) tile[r][c + i] = to_float(values[i]);
    }
  } else {
    const int c = threadIdx.x % kTileCols;
    for (int r = threadIdx.x / kTileCols; r < kBlock; r += kThreads / kTileCols) {
      float v = 0.f;
      if (r < valid_rows && col0 + c < cols) v = to_float(x[(row0 + r) * cols + col0 + c]);
      tile[r][c] = v;
    }
  }
  __syncthreads();

  {  // Four threads per column, 32 rows each.
    const int column = threadIdx.x / 4, part = threadIdx.x % 4;
    float amax = 0.f;
    for (int r = part * 32; r < part * 32 + 32; ++r) amax = fmaxf(amax, fabsf(tile[r][column]));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    if (part == 0) {
      const float scale = compute_scale(amax, fp8_max, pow2, epsilon);
      scales[column] = scale;
      if (col0 + column < cols) scale_inv_t[(col0 + column) * scale_columns + block] = 1.f / scale;
    }
  }
  __syncthreads();

  const int r = threadIdx.x % kBlock;
  if (r >= valid_rows) return;
  for (int column = threadIdx.x / kBlock; column < kTileCols; column += kThreads / kBlock) {
    if (col0 + column >= cols) break;
    qt[(col0 + column) * rows + row0 + r] = to_fp8<kE4M3>(tile[r][column] * scales[column]);
  }
}

mg_status check_quantize_args(const void* x, mg_dtype x_dtype, int64_t rows, int64_t cols,
                              const mg_quantize_config& config, float* fp8_max) {
  if (x_dtype != MG_BFLOAT16 && x_dtype != MG_FLOAT16 && x_dtype != MG_FLOAT32) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "x must be bfloat16, float16 or float32, got %s",
                dtype_name(x_dtype));
  }
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
  if (rows < 0 || cols < 0 || rows > INT32_MAX || cols > INT32_MAX) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "rows and cols must be in [0, 2^31), got %lld x %lld",
                static_cast<long long>(rows), static_cast<long long>(cols));
  }
  if (x == nullptr && rows * cols > 0) return fail(MG_ERROR_INVALID_ARGUMENT, "x must not be NULL");
  return MG_OK;
}

// The kernels are instantiated for every (input dtype, fp8 format) pair;
// `Launch` is a struct template whose static run<T, kE4M3>(args...) launches.
template <template <typename, bool> class Launch, typename... Args>
void dispatch(mg_dtype x_dtype, mg_dtype fp8_dtype, Args... args) {
  const bool e4m3 = fp8_dtype == MG_FLOAT8_E4M3;
  switch (x_dtype) {
    case MG_BFLOAT16:
      e4m3 ? Launch<__nv_bfloat16, true>::run(args...) : Launch<__nv_bfloat16, false>::run(args...);
      break;
    case MG_FLOAT16:
      e4m3 ? Launch<__half, true>::run(args...) : Launch<__half, false>::run(args...);
      break;
    default:
      e4m3 ? Launch<float, true>::run(args...) : Launch<float, false>::run(args...);
      break;
  }
}

template <typename T, bool kE4M3>
struct LaunchRowwise {
  static void run(dim3 grid, cudaStream_t stream, const void* x, int64_t rows, int64_t cols,
                  float fp8_max, bool pow2, float epsilon, void* q, float* scale_inv) {
    rowwise_kernel<T, kE4M3><<<grid, kThreads, 0, stream>>>(
        static_cast<const T*>(x), rows, cols, fp8_max, pow2, epsilon, static_cast<uint8_t*>(q), scale_inv);
  }
};

template <typename T, bool kE4M3>
struct LaunchRowwiseVec16 {
  static void run(dim3 grid, cudaStream_t stream, const void* x, int64_t rows, int64_t cols,
                  float fp8_max, bool pow2, float epsilon, void* q, float* scale_inv) {
    rowwise_vec16_kernel<T, kE4M3><<<grid, kThreads, 0, stream>>>(
        static_cast<const T*>(x), rows, cols, fp8_max, pow2, epsilon, static_cast<uint8_t*>(q), scale_inv);
  }
};

template <typename T, bool kE4M3>
struct LaunchColumnwise {
  static void run(dim3 grid, cudaStream_t stream, const void* x, int64_t rows, int64_t cols,
                  int num_groups, const int64_t* offsets, const int64_t* block_offsets,
                  int64_t scale_columns, float fp8_max, bool pow2, float epsilon, void* qt,
                  float* scale_inv_t) {
    columnwise_kernel<T, kE4M3><<<grid, kThreads, 0, stream>>>(
        static_cast<const T*>(x), rows, cols, num_groups, offsets, block_offsets, scale_columns, fp8_max,
        pow2, epsilon, static_cast<uint8_t*>(qt), scale_inv_t);
  }
};

}  // namespace
}  // namespace moe_grouped

using namespace moe_grouped;

extern "C" mg_status mg_quantize_rowwise_1x128(const void* x, mg_dtype x_dtype, int64_t rows,
                                               int64_t cols, mg_quantize_config config, void* q,
                                               float* scale_inv, void* stream) {
  float fp8_max = 0.f;
  MG_RETURN_IF_ERROR(check_quantize_args(x, x_dtype, rows, cols, config, &fp8_max));
  if (rows == 0 || cols == 0) return ok();
  if (q == nullptr || scale_inv == nullptr) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "q and scale_inv must not be NULL");
  }
  const int64_t units = rows * ((cols + kBlock - 1) / kBlock);  // (row, 128-column block) pairs
  // 16 elements per lane wants 16-byte aligned rows of whole 16-element chunks.
  const bool vectorised = cols % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                          reinterpret_cast<uintptr_t>(q) % 16 == 0;
  const int64_t threads = units * (vectorised ? 8 : 32);
  const int64_t grid = (threads + kThreads - 1) / kThreads;
  if (grid > INT32_MAX) return fail(MG_ERROR_INVALID_ARGUMENT, "x is too large: %lld blocks", static_cast<long long>(grid));
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  const dim3 blocks(static_cast<unsigned>(grid));
  if (vectorised) {
    dispatch<LaunchRowwiseVec16>(x_dtype, config.fp8_dtype, blocks, cuda_stream, x, rows, cols, fp8_max,
                                 config.pow2_scales != 0, config.amax_epsilon, q, scale_inv);
  } else {
    dispatch<LaunchRowwise>(x_dtype, config.fp8_dtype, blocks, cuda_stream, x, rows, cols, fp8_max,
                            config.pow2_scales != 0, config.amax_epsilon, q, scale_inv);
  }
  MG_CUDA_RETURN(cudaGetLastError());
  return ok();
}

extern "C" mg_status mg_quantize_columnwise_grouped_1x128(
    const void* x, mg_dtype x_dtype, int64_t rows, int64_t cols, const void* m_splits,
    mg_dtype splits_dtype, int num_groups, mg_quantize_config config, void* qt, float* scale_inv_t,
    int device, int workspace_slot, void* stream) {
  float fp8_max = 0.f;
  MG_RETURN_IF_ERROR(check_quantize_args(x, x_dtype, rows, cols, config, &fp8_max));
  if (splits_dtype != MG_INT32 && splits_dtype != MG_INT64) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "m_splits must be int32 or int64, got %s", dtype_name(splits_dtype));
  }
  if (num_groups <= 0 || m_splits == nullptr) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "need num_groups > 0 and device m_splits, got %d groups", num_groups);
  }
  if (cols > 0 && rows > 0 && (qt == nullptr || scale_inv_t == nullptr)) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "qt and scale_inv_t must not be NULL");
  }
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  WorkspaceCarver plan(nullptr);
  plan.take<int64_t>(num_groups + 1);
  plan.take<int64_t>(num_groups + 1);
  void* base = nullptr;
  MG_RETURN_IF_ERROR(workspace_get(device, workspace_slot, plan.bytes_used(), cuda_stream, &base));
  WorkspaceCarver carve(base);
  int64_t* offsets = carve.take<int64_t>(num_groups + 1);
  int64_t* block_offsets = carve.take<int64_t>(num_groups + 1);
  if (splits_dtype == MG_INT32) {
    columnwise_setup_kernel<<<1, kSetupThreads, 0, cuda_stream>>>(
        static_cast<const int32_t*>(m_splits), num_groups, rows, offsets, block_offsets);
  } else {
    columnwise_setup_kernel<<<1, kSetupThreads, 0, cuda_stream>>>(
        static_cast<const int64_t*>(m_splits), num_groups, rows, offsets, block_offsets);
  }
  MG_CUDA_RETURN(cudaGetLastError());
  if (rows == 0 || cols == 0) return ok();
  const int64_t scale_columns = (rows + kBlock - 1) / kBlock + num_groups;
  if (scale_columns > 65535) {
    return fail(MG_ERROR_INVALID_ARGUMENT,
                "rows / 128 + num_groups must be at most 65535 for the column-wise quantizer, got %lld",
                static_cast<long long>(scale_columns));
  }
  dim3 grid(static_cast<unsigned>((cols + kTileCols - 1) / kTileCols), static_cast<unsigned>(scale_columns));
  dispatch<LaunchColumnwise>(x_dtype, config.fp8_dtype, grid, cuda_stream, x, rows, cols, num_groups, offsets,
                             block_offsets, scale_columns, fp8_max, config.pow2_scales != 0,
                             config.amax_epsilon, qt, scale_inv_t);
  MG_CUDA_RETURN(cudaGetLastError());
  return ok();
}
