// The setup kernel behind mg_grouped_setup: offsets and per-group problem
// shapes from device m_splits, with no host synchronisation; and the kernel
// behind mg_zero_rows_past_splits, which clears the rows past their sum.
#include <cub/block/block_reduce.cuh>

#include "device_guard.h"
#include "error.h"
#include "setup.cuh"

namespace moe_grouped {
namespace {

template <typename SplitT>
__global__ void __launch_bounds__(kSetupThreads)
    grouped_setup_kernel(const SplitT* m_splits, int num_groups, int64_t total_rows, int32_t n,
                         int32_t k, mg_gemm_kind kind, int64_t* offsets, int32_t* shapes) {
  scan_splits(m_splits, num_groups, total_rows, offsets, [&](int g, int64_t, int64_t count) {
    if (shapes == nullptr) return;
    int32_t m = static_cast<int32_t>(count);
    int32_t* shape = shapes + 3 * g;
    switch (kind) {
      case MG_GEMM_FPROP: shape[0] = m; shape[1] = n; shape[2] = k; break;
      case MG_GEMM_DGRAD: shape[0] = m; shape[1] = k; shape[2] = n; break;
      case MG_GEMM_WGRAD: shape[0] = n; shape[1] = k; shape[2] = m; break;
    }
  });
}

constexpr int kZeroThreads = 256;
constexpr int kZeroBlocksPerSm = 2;  // enough stores in flight for the tail; few blocks to launch without one

// Every block sums the clamped counts itself (no other kernel has to run
// first), then clears its share of the words past the last expert's rows.
template <typename SplitT, typename Word>
__global__ void __launch_bounds__(kZeroThreads)
    zero_rows_past_splits_kernel(const SplitT* m_splits, int num_groups, int64_t total_rows,
                                 Word* out, int64_t words_per_row) {
  using Reduce = cub::BlockReduce<int64_t, kZeroThreads>;
  __shared__ typename Reduce::TempStorage storage;
  __shared__ int64_t end;
  int64_t partial = 0;
  for (int g = static_cast<int>(threadIdx.x); g < num_groups; g += kZeroThreads) {
    partial += clamp_split(static_cast<int64_t>(m_splits[g]), total_rows);
  }
  const int64_t sum = Reduce(storage).Sum(partial);
  if (threadIdx.x == 0) end = sum < total_rows ? sum : total_rows;
  __syncthreads();
  const int64_t last = total_rows * words_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kZeroThreads;
  for (int64_t i = end * words_per_row + static_cast<int64_t>(blockIdx.x) * kZeroThreads + threadIdx.x;
       i < last; i += stride) {
    out[i] = Word{};
  }
}

template <typename Word, typename SplitT>
void launch_zero_rows(const SplitT* m_splits, int num_groups, int64_t total_rows, void* out,
                      int64_t row_bytes, int max_blocks, cudaStream_t stream) {
  const int64_t words_per_row = row_bytes / static_cast<int64_t>(sizeof(Word));
  const int64_t words = total_rows * words_per_row;
  int64_t blocks = (words + kZeroThreads - 1) / kZeroThreads;
  if (blocks > max_blocks) blocks = max_blocks;
  zero_rows_past_splits_kernel<<<static_cast<unsigned>(blocks), kZeroThreads, 0, stream>>>(
      m_splits, num_groups, total_rows, static_cast<Word*>(out), words_per_row);
}

// The widest store (16 bytes down to 1) that every row start allows.
template <typename SplitT>
void zero_rows(const SplitT* m_splits, int num_groups, int64_t total_rows, void* out,
               int64_t row_bytes, int max_blocks, cudaStream_t stream) {
  const uint64_t alignment = reinterpret_cast<uintptr_t>(out) | static_cast<uint64_t>(row_bytes);
  if (alignment % 16 == 0) {
    launch_zero_rows<uint4>(m_splits, num_groups, total_rows, out, row_bytes, max_blocks, stream);
  } else if (alignment % 8 == 0) {
    launch_zero_rows<uint2>(m_splits, num_groups, total_rows, out, row_bytes, max_blocks, stream);
  } else if (alignment % 4 == 0) {
    launch_zero_rows<uint32_t>(m_splits, num_groups, total_rows, out, row_bytes, max_blocks, stream);
  } else if (alignment % 2 == 0) {
    launch_zero_rows<uint16_t>(m_splits, num_groups, total_rows, out, row_bytes, max_blocks, stream);
  } else {
    launch_zero_rows<uint8_t>(m_splits, num_groups, total_rows, out, row_bytes, max_blocks, stream);
  }
}

}  // namespace

mg_status check_splits_dtype(mg_dtype dtype) {
  if (dtype != MG_INT32 && dtype != MG_INT64) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "m_splits must be int32 or int64, got %s",
                dtype_name(dtype));
  }
  return MG_OK;
}

}  // namespace moe_grouped

using namespace moe_grouped;

extern "C" mg_status mg_grouped_setup(const void* m_splits, mg_dtype splits_dtype, int num_groups,
                                      int64_t total_rows, int64_t n, int64_t k, mg_gemm_kind kind,
                                      int64_t* offsets, int32_t* problem_shapes, void* stream) {
  MG_ENTER_DEVICE_OF(offsets);
  MG_RETURN_IF_ERROR(check_splits_dtype(splits_dtype));
  if (num_groups <= 0) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "num_groups must be positive, got %d", num_groups);
  }
  if (m_splits == nullptr || offsets == nullptr) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "m_splits and offsets must be device pointers, got NULL");
  }
  if (total_rows < 0 || n < 0 || k < 0 || n > INT32_MAX || k > INT32_MAX || total_rows > INT32_MAX) {
    return fail(MG_ERROR_INVALID_ARGUMENT,
                "total_rows, n and k must be in [0, 2^31), got total_rows=%lld n=%lld k=%lld",
                static_cast<long long>(total_rows), static_cast<long long>(n),
                static_cast<long long>(k));
  }
  if (kind != MG_GEMM_FPROP && kind != MG_GEMM_DGRAD && kind != MG_GEMM_WGRAD) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "unknown gemm kind %d", static_cast<int>(kind));
  }
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  if (splits_dtype == MG_INT32) {
    grouped_setup_kernel<<<1, kSetupThreads, 0, cuda_stream>>>(
        static_cast<const int32_t*>(m_splits), num_groups, total_rows, static_cast<int32_t>(n),
        static_cast<int32_t>(k), kind, offsets, problem_shapes);
  } else {
    grouped_setup_kernel<<<1, kSetupThreads, 0, cuda_stream>>>(
        static_cast<const int64_t*>(m_splits), num_groups, total_rows, static_cast<int32_t>(n),
        static_cast<int32_t>(k), kind, offsets, problem_shapes);
  }
  MG_CUDA_RETURN(cudaGetLastError());
  return ok();
}

extern "C" mg_status mg_zero_rows_past_splits(const void* m_splits, mg_dtype splits_dtype,
                                              int num_groups, int64_t total_rows, void* out,
                                              int64_t row_bytes, int device, void* stream) {
  MG_RETURN_IF_ERROR(check_splits_dtype(splits_dtype));
  if (num_groups <= 0) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "num_groups must be positive, got %d", num_groups);
  }
  if (total_rows < 0 || row_bytes < 0) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "total_rows and row_bytes must be non-negative, got %lld and %lld",
                static_cast<long long>(total_rows), static_cast<long long>(row_bytes));
  }
  if (total_rows == 0 || row_bytes == 0) return ok();
  if (m_splits == nullptr || out == nullptr) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "m_splits and out must be device pointers, got NULL");
  }
  int sms = 0;
  MG_CUDA_RETURN(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  DeviceGuard guard;
  MG_RETURN_IF_ERROR(guard.enter(device));
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  const int max_blocks = kZeroBlocksPerSm * sms;
  if (splits_dtype == MG_INT32) {
    zero_rows(static_cast<const int32_t*>(m_splits), num_groups, total_rows, out, row_bytes, max_blocks,
              cuda_stream);
  } else {
    zero_rows(static_cast<const int64_t*>(m_splits), num_groups, total_rows, out, row_bytes, max_blocks,
              cuda_stream);
  }
  MG_CUDA_RETURN(cudaGetLastError());
  return ok();
}
