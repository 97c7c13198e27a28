// Device-side setup shared by the grouped kernels: m_splits -> offsets.
#pragma once

#include <cub/block/block_scan.cuh>

#include <cstdint>

namespace moe_grouped {

constexpr int kSetupThreads = 1024;

// One block computes offsets[0..num_groups] (exclusive prefix sum of the
// counts, each clamped so that no group passes `total_rows`: a wrong m_splits
// must not make a kernel read past the static buffer) and calls `visit(g, offset, count)` once per group. Must be called
// by all kSetupThreads threads of the block.
template <typename SplitT, typename Visitor>
__device__ void scan_splits(const SplitT* m_splits, int num_groups, int64_t total_rows,
                            int64_t* offsets, Visitor visit) {
  using Scan = cub::BlockScan<int64_t, kSetupThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int64_t carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < num_groups; base += kSetupThreads) {
    int g = base + static_cast<int>(threadIdx.x);
    int64_t raw = 0;
    if (g < num_groups) {
      // Clamp first so that the running sum cannot overflow on garbage input.
      raw = static_cast<int64_t>(m_splits[g]);
      if (raw < 0) raw = 0;
      if (raw > total_rows) raw = total_rows;
    }
    int64_t prefix = 0;
    int64_t chunk_total = 0;
    Scan(scan_storage).ExclusiveSum(raw, prefix, chunk_total);
    int64_t start = carry + prefix;
    if (start > total_rows) start = total_rows;
    int64_t count = raw < total_rows - start ? raw : total_rows - start;
    if (g < num_groups) {
      offsets[g] = start;
      visit(g, start, count);
    }
    __syncthreads();
    if (threadIdx.x == 0) carry += chunk_total;
    __syncthreads();
  }
  if (threadIdx.x == 0) offsets[num_groups] = carry < total_rows ? carry : total_rows;
}

}  // namespace moe_grouped
