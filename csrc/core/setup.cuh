// Device-side setup shared by the grouped kernels: m_splits -> offsets.
#pragma once

#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "core/columnwise_layout.h"

namespace moe_grouped {

constexpr int kSetupThreads = 1024;

// A count from m_splits clamped to [0, total_rows], before any running sum:
// a wrong m_splits must neither overflow the sum nor make a kernel read past
// the static buffer. Every reader of m_splits clamps this way.
__host__ __device__ inline int64_t clamp_split(int64_t raw, int64_t total_rows) {
  return raw < 0 ? 0 : raw > total_rows ? total_rows : raw;
}

// Rows [start, start + count) of a group in a buffer of `total_rows`, given
// its clamped count and the sum of the clamped counts before it: the group is
// cut where the buffer ends.
struct GroupRows {
  int64_t start;
  int64_t count;
};

__host__ __device__ inline GroupRows group_rows(int64_t before, int64_t count, int64_t total_rows) {
  const int64_t start = before < total_rows ? before : total_rows;
  return {start, count < total_rows - start ? count : total_rows - start};
}

// One block walks the groups in chunks of kSetupThreads, computes
// offsets[0..num_groups] (exclusive prefix sum of the counts, each clamped so
// that no group passes `total_rows`: a wrong m_splits must not make a kernel
// read past the static buffer) and calls `visit(g, valid, offset, count)` on
// every thread of the block once per chunk (valid: g < num_groups), so that
// the visitor may itself run block-wide collectives. Must be called by all
// kSetupThreads threads of the block. `offsets` may be NULL (a block that
// only needs the visits: another block of the kernel writes them).
template <typename SplitT, typename ChunkVisitor>
__device__ void scan_split_chunks(const SplitT* m_splits, int num_groups, int64_t total_rows,
                                  int64_t* offsets, ChunkVisitor visit) {
  using Scan = cub::BlockScan<int64_t, kSetupThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int64_t carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < num_groups; base += kSetupThreads) {
    int g = base + static_cast<int>(threadIdx.x);
    const int64_t raw = g < num_groups ? clamp_split(static_cast<int64_t>(m_splits[g]), total_rows) : 0;
    int64_t prefix = 0;
    int64_t chunk_total = 0;
    Scan(scan_storage).ExclusiveSum(raw, prefix, chunk_total);
    const GroupRows at = group_rows(carry + prefix, raw, total_rows);
    if (offsets != nullptr && g < num_groups) offsets[g] = at.start;
    visit(g, g < num_groups, at.start, g < num_groups ? at.count : int64_t{0});
    __syncthreads();
    if (threadIdx.x == 0) carry += chunk_total;
    __syncthreads();
  }
  if (offsets != nullptr && threadIdx.x == 0) offsets[num_groups] = carry < total_rows ? carry : total_rows;
}

// As scan_split_chunks, calling `visit(g, offset, count)` once per group.
template <typename SplitT, typename Visitor>
__device__ void scan_splits(const SplitT* m_splits, int num_groups, int64_t total_rows,
                            int64_t* offsets, Visitor visit) {
  scan_split_chunks(m_splits, num_groups, total_rows, offsets,
                    [&](int g, bool valid, int64_t start, int64_t count) {
                      if (valid) visit(g, start, count);
                    });
}

// Where a group starts in the column-wise FP8 layout (see
// mg_quantize_columnwise_grouped_1x128 and core/columnwise_layout.h): its
// first padded column p_e = sum_{j<e} round_up(m_j, 128) and its first
// 128-token scale block
// b_e = sum_{j<e} ceil(m_j / 128), over the clamped counts, so that both stay
// inside buffers sized from `total_rows` and `num_groups`.
struct ColumnwiseStart {
  int64_t padded;
  int64_t block;
};

struct ColumnwiseStartSum {
  __device__ ColumnwiseStart operator()(const ColumnwiseStart& a, const ColumnwiseStart& b) const {
    return {a.padded + b.padded, a.block + b.block};
  }
};

// What a group of `count` tokens takes in that layout: round_up(count, 128)
// columns and ceil(count / 128) scale blocks.
__device__ inline ColumnwiseStart columnwise_extent(int64_t count) {
  return {columnwise_round_up(count), (count + kColumnwiseBlock - 1) / kColumnwiseBlock};
}

// As scan_splits, calling `visit(g, offset, count, columnwise_start)`.
template <typename SplitT, typename Visitor>
__device__ void scan_splits_columnwise(const SplitT* m_splits, int num_groups, int64_t total_rows,
                                       int64_t* offsets, Visitor visit) {
  using Scan = cub::BlockScan<ColumnwiseStart, kSetupThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ ColumnwiseStart carry;
  if (threadIdx.x == 0) carry = {0, 0};
  __syncthreads();
  scan_split_chunks(m_splits, num_groups, total_rows, offsets,
                    [&](int g, bool valid, int64_t start, int64_t count) {
                      const ColumnwiseStart extent = columnwise_extent(count);
                      ColumnwiseStart prefix{0, 0};
                      ColumnwiseStart total{0, 0};
                      Scan(scan_storage)
                          .ExclusiveScan(extent, prefix, ColumnwiseStart{0, 0},
                                         ColumnwiseStartSum{}, total);
                      if (valid) {
                        visit(g, start, count,
                              ColumnwiseStart{carry.padded + prefix.padded,
                                              carry.block + prefix.block});
                      }
                      __syncthreads();
                      if (threadIdx.x == 0) carry = ColumnwiseStartSum{}(carry, total);
                    });
}

}  // namespace moe_grouped
