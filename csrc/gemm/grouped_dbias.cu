// Per-group column sums of dy for the bias gradient: dbias[e, :] = sum of the
// rows of expert e. Graph-safe and workspace-free: every block finds its
// group's rows from m_splits itself (clamped by clamp_split, as scan_splits
// does), so nothing is shared with a GEMM that may run beside it.
// Deterministic: a fixed reduction order, no atomics.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/convert.cuh"
#include "core/error.h"
#include "core/setup.cuh"
#include "gemm/grouped_gemm.h"

namespace moe_grouped::gemm {
namespace {

constexpr int kColumnThreads = 8;  // threads across columns
constexpr int kRowThreads = 32;    // threads down the rows

// Grid (column blocks, E); block (kColumnThreads, kRowThreads). Each thread
// owns kVec adjacent columns; kVec = 8 reads 16 bytes at a time.
template <class T, class OutT, class SplitT, int kVec>
__global__ void __launch_bounds__(kColumnThreads * kRowThreads)
    grouped_dbias_kernel(const T* dy, const SplitT* m_splits, int num_groups, int64_t total_rows,
                         int n, OutT* dbias) {
  constexpr int kThreads = kColumnThreads * kRowThreads;
  constexpr int kColumns = kColumnThreads * kVec;
  __shared__ int64_t partial[kThreads];
  __shared__ float sums[kRowThreads][kColumns + 1];

  const int g = blockIdx.y;
  const int tid = threadIdx.y * kColumnThreads + threadIdx.x;

  // Rows of group g: after the clamped counts of the groups before it.
  int64_t before = 0;
  for (int i = tid; i < g; i += kThreads) before += clamp_split(static_cast<int64_t>(m_splits[i]), total_rows);
  partial[tid] = before;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (tid < stride) partial[tid] += partial[tid + stride];
    __syncthreads();
  }
  const GroupRows rows =
      group_rows(partial[0], clamp_split(static_cast<int64_t>(m_splits[g]), total_rows), total_rows);
  const int64_t start = rows.start;
  const int64_t count = rows.count;

  const int column = blockIdx.x * kColumns + threadIdx.x * kVec;
  float acc[kVec];
#pragma unroll
  for (int v = 0; v < kVec; ++v) acc[v] = 0.0f;
  if (column < n) {
    for (int64_t r = start + threadIdx.y; r < start + count; r += kRowThreads) {
      const T* row = dy + r * n + column;
      if constexpr (kVec == 8) {
        uint4 packed = *reinterpret_cast<const uint4*>(row);
        const T* values = reinterpret_cast<const T*>(&packed);
#pragma unroll
        for (int v = 0; v < kVec; ++v) acc[v] += to_float(values[v]);
      } else {
#pragma unroll
        for (int v = 0; v < kVec; ++v) {
          if (column + v < n) acc[v] += to_float(row[v]);
        }
      }
    }
  }
#pragma unroll
  for (int v = 0; v < kVec; ++v) sums[threadIdx.y][threadIdx.x * kVec + v] = acc[v];
  __syncthreads();
  for (int c = tid; c < kColumns; c += kThreads) {
    float total = 0.0f;
    for (int y = 0; y < kRowThreads; ++y) total += sums[y][c];
    int out_column = blockIdx.x * kColumns + c;
    if (out_column < n) dbias[static_cast<int64_t>(g) * n + out_column] = from_float<OutT>(total);
  }
}

template <class T, class OutT, class SplitT>
mg_status launch(const DbiasCall& call, cudaStream_t stream) {
  const auto* dy = static_cast<const T*>(call.dy);
  const auto* splits = static_cast<const SplitT*>(call.m_splits);
  auto* out = static_cast<OutT*>(call.dbias);
  dim3 block(kColumnThreads, kRowThreads);
  bool vectorised = call.n % 8 == 0 && reinterpret_cast<uintptr_t>(call.dy) % 16 == 0;
  int columns_per_block = kColumnThreads * (vectorised ? 8 : 1);
  dim3 grid(static_cast<unsigned>((call.n + columns_per_block - 1) / columns_per_block),
            static_cast<unsigned>(call.num_groups));
  int n = static_cast<int>(call.n);
  if (vectorised) {
    grouped_dbias_kernel<T, OutT, SplitT, 8>
        <<<grid, block, 0, stream>>>(dy, splits, call.num_groups, call.total_rows, n, out);
  } else {
    grouped_dbias_kernel<T, OutT, SplitT, 1>
        <<<grid, block, 0, stream>>>(dy, splits, call.num_groups, call.total_rows, n, out);
  }
  MG_CUDA_RETURN(cudaGetLastError());
  return MG_OK;
}

template <class T, class OutT>
mg_status dispatch_splits(const DbiasCall& call, cudaStream_t stream) {
  return call.splits_dtype == MG_INT32 ? launch<T, OutT, int32_t>(call, stream)
                                       : launch<T, OutT, int64_t>(call, stream);
}

template <class T>
mg_status dispatch_out(const DbiasCall& call, cudaStream_t stream) {
  return call.dbias_dtype == MG_FLOAT32 ? dispatch_splits<T, float>(call, stream)
                                        : dispatch_splits<T, T>(call, stream);
}

}  // namespace

mg_status grouped_dbias(const DbiasCall& call, cudaStream_t stream) {
  return call.dtype == MG_BFLOAT16 ? dispatch_out<__nv_bfloat16>(call, stream)
                                   : dispatch_out<__half>(call, stream);
}

}  // namespace moe_grouped::gemm
