// FP8 1x128 block quantization of activations and gradients: row-wise (the
// fprop/dgrad operands), grouped column-wise (the transposed per-expert copies
// that wgrad reduces over, in the padded layout the FP8 wgrad GEMM reads),
// both from one read of x, and the fused per-expert dbias. Group boundaries
// come from device m_splits; nothing syncs with the host.
#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "core/columnwise_layout.h"
#include "core/device_guard.h"
#include "core/kernel_attributes.h"
#include "core/setup.cuh"
#include "core/workspace.h"
#include "fp8/quantize_common.cuh"

namespace moe_grouped::quantize {
namespace {

// ---- row-wise only ----------------------------------------------------------

// Where output row `row` reads from: x's row itself, or with a gather index
// the row index[row] names; NULL (the row reads as zeros) when that entry
// is outside [0, source_rows).
template <typename T>
__device__ inline const T* source_row(const T* x, int64_t cols, const int32_t* index, int64_t source_rows,
                                      int64_t row) {
  if (index == nullptr) return x + row * cols;
  const int64_t from = index[row];
  return from >= 0 && from < source_rows ? x + from * cols : nullptr;
}

// One warp per (row, 128-column block); each lane owns 4 consecutive columns.
template <typename T, bool kE4M3>
__global__ void __launch_bounds__(kThreads)
    rowwise_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, const int32_t* __restrict__ index,
                   int64_t source_rows, float fp8_max, bool pow2, float epsilon, uint8_t* __restrict__ q,
                   float* __restrict__ scale_inv) {
  const int64_t blocks_per_row = (cols + kBlock - 1) / kBlock;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= rows * blocks_per_row) return;
  const int64_t row = warp / blocks_per_row;
  const int64_t col0 = (warp % blocks_per_row) * kBlock + lane * 4;
  const T* src = source_row(x, cols, index, source_rows, row);
  float v[4];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[i] = (src != nullptr && col0 + i < cols) ? to_float(src[col0 + i]) : 0.f;
    amax = fmaxf(amax, fabsf(v[i]));
  }
  amax = warp_max_xor(amax, 32);
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
template <typename T, bool kE4M3>
__global__ void __launch_bounds__(kThreads)
    rowwise_vec16_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, const int32_t* __restrict__ index,
                         int64_t source_rows, float fp8_max, bool pow2, float epsilon, uint8_t* __restrict__ q,
                         float* __restrict__ scale_inv) {
  constexpr int kLoads = sizeof(T);  // 16-byte loads per 16 elements
  const RowBlockLane lane = row_block_lane(rows, cols);
  const T* src_row = lane.active ? source_row(x, cols, index, source_rows, lane.row) : nullptr;
  float v[16];
  if (lane.in_range && src_row != nullptr) {
    const uint4* src = reinterpret_cast<const uint4*>(src_row + lane.col0);
    uint4 raw[kLoads];
#pragma unroll
    for (int i = 0; i < kLoads; ++i) raw[i] = __ldg(src + i);
    const T* values = reinterpret_cast<const T*>(raw);
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = to_float(values[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = 0.f;
  }
  finish_rowwise_block16<kE4M3>(v, lane.active, lane.in_range, lane.part, fp8_max, pow2, epsilon,
                                q + lane.row * cols + lane.col0, scale_inv + lane.unit);
}

// ---- grouped: column-wise, optionally row-wise and dbias, one read of x ----
//
// A tile is 128 tokens x 128 columns: one 1x128 column-wise block (block j
// of group e, scale row b_e + j, which is simply the global block index)
// and, across it, 128 row-wise blocks. Every row of x lies in
// exactly one tile: tokens past the last group (only when m_splits sums to
// less than rows) form row-wise-only tiles after the groups' blocks, which
// the grid of ceil(rows / 128) + E block rows always has room for.
//
// Thread layout while loading: eight threads per row, 16 consecutive columns
// each, 32 rows per pass, four passes. Row-wise blocks are finished from
// registers. The tile also goes to shared memory, where the column pass reads
// it down the columns: a warp takes four columns, eight lanes per column,
// each lane one 16-token segment, so a warp writes four 128-byte runs of qt.
//
// With the row-wise copy a CTA owns one tile. Column-wise only, it owns
// kColumnTilesPerCta consecutive column tiles of one block, so that the group
// layout (scan_groups), which every CTA derives, is derived once per four
// tiles: with one tile per CTA that scan was a large share of the issued
// instructions, which bound the kernel on the H200. The row-wise variant,
// with more registers, ran slower with four tiles per CTA.
// Measured: docs/kernels.md, "FP8 quantize".

constexpr int kTileRows = kBlock;  // tokens per tile: one column-wise block
constexpr int kTileCols = kBlock;  // columns per tile: one row-wise block
constexpr int kColumnTilesPerCta = 4;

// Consecutive column tiles of one block that a CTA quantizes.
constexpr int tiles_per_cta(bool rowwise) { return rowwise ? 1 : kColumnTilesPerCta; }

// Byte offset of element (r, c) in the shared tile. Rows are 128 * sizeof(T)
// bytes of 16-byte chunks; a row's chunks are XOR-swizzled by its 16-row
// segment, so that the eight lanes reading one column (one lane per segment)
// hit eight different bank groups.
template <typename T>
__device__ inline int tile_offset(int r, int c) {
  constexpr int kPerChunk = 16 / sizeof(T);
  const int chunk = (c / kPerChunk) ^ ((r / kSegment) % 8);
  return r * kTileCols * static_cast<int>(sizeof(T)) + chunk * 16 + (c % kPerChunk) * static_cast<int>(sizeof(T));
}

// ---- the group layout, computed by every CTA -------------------------------
//
// Offsets o_e, padded starts p_e and block starts b_e (see the C ABI header)
// from device m_splits, with the clamping of scan_splits_columnwise. Each CTA
// scans the E counts itself (they stay in L2 after the first CTAs), which
// measured faster than a one-block layout kernel ahead of the quantizer. The
// dbias kernel's CTAs, many and short, do not scan (that was slower): CTA 0
// of the quantizer writes b_e for them.

struct Splits {
  const void* data;
  bool is64;
};

__device__ inline int64_t clamped_split(Splits splits, int g, int64_t rows) {
  return clamp_split(splits.is64 ? static_cast<const int64_t*>(splits.data)[g]
                                 : static_cast<int64_t>(static_cast<const int32_t*>(splits.data)[g]),
                     rows);
}

// offsets[E] and b_E: where the tokens past the last group start, in x and
// in the scale rows.
struct GroupsEnd {
  int64_t row;
  int64_t block;
};

// A group's padded start is 128 times its block start (both round its tokens
// up to 128: core/columnwise_layout.h), so only the blocks are scanned.
static_assert(kColumnwiseAlign == kColumnwiseBlock, "padded starts are derived from block starts");

// Calls visit(g, o_g, m_g, {p_g, b_g}) once for every group, spread over the
// CTA's threads (consecutive groups per thread), m_g the clamped count. All
// kThreads threads must call.
template <typename Visitor>
__device__ GroupsEnd scan_groups(Splits splits, int num_groups, int64_t rows, Visitor visit) {
  using Scan = cub::BlockScan<int64_t, kThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  __shared__ typename Scan::TempStorage row_storage;
  __shared__ typename Scan::TempStorage block_storage;
  const int per_thread = (num_groups + kThreads - 1) / kThreads;
  const int first = min(static_cast<int>(threadIdx.x) * per_thread, num_groups);
  const int last = min(first + per_thread, num_groups);

  int64_t counts = 0;
  for (int g = first; g < last; ++g) counts += clamped_split(splits, g, rows);
  int64_t before = 0;  // clamped counts of the groups before this thread's
  int64_t all_counts = 0;
  Scan(row_storage).ExclusiveSum(counts, before, all_counts);

  int64_t blocks = 0;  // scale blocks of this thread's groups
  int64_t sum = before;
  for (int g = first; g < last; ++g) {
    const int64_t count = clamped_split(splits, g, rows);
    blocks += columnwise_extent(group_rows(sum, count, rows).count).block;
    sum += count;
  }
  int64_t block = 0;
  int64_t all_blocks = 0;
  Scan(block_storage).ExclusiveSum(blocks, block, all_blocks);

  sum = before;
  for (int g = first; g < last; ++g) {
    const int64_t count = clamped_split(splits, g, rows);
    const GroupRows group = group_rows(sum, count, rows);
    visit(g, group.start, group.count, ColumnwiseStart{block * kColumnwiseAlign, block});
    block += columnwise_extent(group.count).block;
    sum += count;
  }
  return {all_counts < rows ? all_counts : rows, all_blocks};
}

// Where scale block `block` lies: block j of group `group`, its tokens from
// row0 on and its first column in qt p_e + 128 j; or, from b_E on, group -1:
// the row-wise-only tokens past the last group. valid_rows <= 0 when the
// block holds none.
struct TileRows {
  int group;
  int valid_rows;
  int64_t row0;
  int64_t qt_column;
};

// `blocks_out`, when not NULL, gets b_0..b_E (for the dbias kernel).
__device__ inline TileRows locate_tile(int64_t block, Splits splits, int num_groups, int64_t rows,
                                       int64_t* blocks_out) {
  __shared__ TileRows found;
  if (threadIdx.x == 0) found.group = -1;
  __syncthreads();  // before any visitor can write `found`
  const GroupsEnd end = scan_groups(splits, num_groups, rows, [&](int g, int64_t start, int64_t count,
                                                                  ColumnwiseStart at) {
    if (blocks_out != nullptr) blocks_out[g] = at.block;
    // Only a non-empty group owns blocks, so exactly one thread matches.
    const int64_t j = block - at.block;
    if (j >= 0 && j * kBlock < count) {
      const int64_t left = count - j * kBlock;
      found = TileRows{g, static_cast<int>(left < kBlock ? left : kBlock), start + j * kBlock, at.padded + j * kBlock};
    }
  });
  if (blocks_out != nullptr && threadIdx.x == 0) blocks_out[num_groups] = end.block;
  __syncthreads();
  TileRows span = found;
  if (span.group < 0) {
    span.row0 = end.row + (block - end.block) * kTileRows;
    const int64_t left = rows - span.row0;
    span.valid_rows = static_cast<int>(left < kTileRows ? left : kTileRows);
  }
  return span;
}

// Unit t of a [block_rows x col_units] grid (a unit: a CTA's column tiles),
// walked in bands of `band` units, block-major inside a band: the units in
// flight together then read a few KB of each row of x and write a few KB of
// each row of qt, where a walk over all the columns would write only 128
// bytes of each qt row.
__device__ inline void tile_coords(int64_t t, int64_t block_rows, int64_t col_units, int64_t band, int64_t* block,
                                   int64_t* col_unit) {
  const int64_t first_col = t / (band * block_rows) * band;
  const int64_t width = col_units - first_col < band ? col_units - first_col : band;
  const int64_t index = t - first_col * block_rows;
  *block = index / width;
  *col_unit = first_col + index % width;
}

struct GroupedArgs {
  int64_t rows;
  int64_t cols;
  int num_groups;
  int64_t col_tiles;    // ceil(cols / 128): also row-wise scales per row
  int64_t padded_rows;  // leading dimension of qt
  int64_t band;         // column units (tiles_per_cta tiles) per band of the tile walk (tile_coords)
  float fp8_max;
  bool pow2;
  float epsilon;
  const int32_t* index;    // gathered: tile row r reads x[index[row0 + r]], or nullptr
  int64_t source_rows;     // rows of x when gathered
  Splits splits;           // m_splits [E] on the device
  int64_t* blocks;         // b_0..b_E, written by CTA 0 for the dbias kernel, or nullptr
  uint8_t* q;              // row-wise [rows, cols] (kRowwise only)
  float* scale_inv;        // row-wise [rows, col_tiles]
  uint8_t* qt;             // column-wise [cols, padded_rows]
  float* scale_inv_t;      // column-wise [scale_rows, cols]
  float* partials;         // [scale_rows, cols] column sums of each block, or nullptr
};

// This thread's 16 columns of every pass of a tile (see load_tile_chunks),
// each row read from where source_row puts it.
template <typename T>
__device__ inline void load_tile_rows(const T* x, const GroupedArgs& a, int64_t row0, int64_t col, int valid_rows,
                                      uint4 (&raw)[kPasses][sizeof(T)]) {
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int r = p * kRowsPerPass + static_cast<int>(threadIdx.x) / 8;
    const T* src = r < valid_rows && col < a.cols ? source_row(x, a.cols, a.index, a.source_rows, row0 + r) : nullptr;
#pragma unroll
    for (int k = 0; k < static_cast<int>(sizeof(T)); ++k) {
      raw[p][k] = src != nullptr ? __ldg(reinterpret_cast<const uint4*>(src + col) + k) : make_uint4(0, 0, 0, 0);
    }
  }
}

// One 1x128 row-wise block of a tile: this thread's 16 values of tile row
// `row` (eight threads per row; `part` says which sixteen columns, from
// `col`), reduced over the row's eight threads, all of which must call.
template <bool kE4M3>
__device__ inline void rowwise_block(const float (&v)[16], const GroupedArgs& a, int64_t row, bool row_valid,
                                     int64_t col, int64_t col_tile, int part, bool vector) {
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(v[i]));
  amax = warp_max_xor(amax, 8);
  const float scale = compute_scale(amax, a.fp8_max, a.pow2, a.epsilon);
  if (!row_valid) return;
  const int64_t count = a.cols - col;
  if (count > 0) {
    store_fp8x16(a.q + row * a.cols + col, pack_fp8x16<kE4M3>(v, scale), count < 16 ? static_cast<int>(count) : 16,
                 vector);
  }
  if (part == 0) a.scale_inv[row * a.col_tiles + col_tile] = 1.f / scale;
}

// The column-wise blocks of one tile in shared memory (scale block `block`,
// in the group that `span` names; columns col0...). Lane = 8 * (which of the
// warp's four columns) + segment: each lane reads its 16-token segment of one
// column (the swizzle puts the eight segments in eight different bank
// groups). A column's amax and sum reduce over its eight lanes in a fixed
// tree (xor 1, 2, 4), which with the in-order segment sums fixes the dbias
// summation order. kSum: the dbias partials are wanted (written when
// a.partials is set).
template <typename T, bool kE4M3, bool kSum>
__device__ inline void column_pass(const unsigned char* tile, const GroupedArgs& a, const TileRows& span,
                                   int64_t block, int64_t col0, bool vector) {
  constexpr int kLanesPerColumn = kTileRows / kSegment;                   // 8
  constexpr int kColumnsPerRound = kThreads / kLanesPerColumn;           // 32
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int segment = lane % kLanesPerColumn;
  uint8_t* qt_block = a.qt + span.qt_column + segment * kSegment;
#pragma unroll 1
  for (int round = 0; round < kTileCols / kColumnsPerRound; ++round) {
    const int c = round * kColumnsPerRound + warp * (32 / kLanesPerColumn) + lane / kLanesPerColumn;
    float v[kSegment];
    float amax = 0.f, sum = 0.f;
#pragma unroll
    for (int i = 0; i < kSegment; ++i) {
      v[i] = to_float(*reinterpret_cast<const T*>(tile + tile_offset<T>(segment * kSegment + i, c)));
      amax = fmaxf(amax, fabsf(v[i]));
      if constexpr (kSum) sum += v[i];
    }
#pragma unroll
    for (int offset = 1; offset < kLanesPerColumn; offset *= 2) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
      if constexpr (kSum) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    }
    const int64_t col = col0 + c;
    if (col >= a.cols) continue;
    const float scale = compute_scale(amax, a.fp8_max, a.pow2, a.epsilon);
    // The group's last tile is stored whole: its rows past valid_rows are
    // zeros, which land in the group's own padding (it starts on a 128-token
    // boundary), so each column's 128-byte run is written at once (a partly
    // written DRAM sector costs the memory a read-modify-write).
    store_fp8x16(qt_block + col * a.padded_rows, pack_fp8x16<kE4M3>(v, scale), kSegment, vector);
    if (segment == 0) {
      a.scale_inv_t[block * a.cols + col] = 1.f / scale;
      if (kSum && a.partials != nullptr) a.partials[block * a.cols + col] = sum;
    }
  }
}

// Column tile `col_tile` of the block `span` locates; all kThreads threads
// call, the shared tile free.
template <typename T, bool kE4M3, bool kRowwise, bool kDbias, bool kVector>
__device__ inline void quantize_tile(const T* __restrict__ x, const GroupedArgs& a, const TileRows& span,
                                     int64_t block, int64_t col_tile, unsigned char* tile) {
  const int64_t col0 = col_tile * kTileCols;
  const int group = span.group;
  const int64_t row0 = span.row0;
  const int valid_rows = span.valid_rows;

  const int part = threadIdx.x % 8;  // which 16 columns of the row
  const int64_t col = col0 + part * 16;
  float v[16];

  if constexpr (kVector) {
    // cols % 16 == 0: a 16-column chunk is wholly inside or outside x.
    constexpr int kChunks = sizeof(T);  // 16-byte chunks per 16 elements
    uint4 raw[kPasses][kChunks];
    load_tile_rows(x, a, row0, col, valid_rows, raw);
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const int r = p * kRowsPerPass + static_cast<int>(threadIdx.x) / 8;
      // The eight threads of a row store one 16-byte chunk each per step; the
      // rotation puts those eight chunks in eight different bank groups.
      const int rotation = (part * kChunks / 8) % kChunks;
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
        const int which = k ^ rotation;
        uint4 chunk = raw[p][0];
#pragma unroll
        for (int m = 1; m < kChunks; ++m) {
          if (which == m) chunk = raw[p][m];
        }
        *reinterpret_cast<uint4*>(tile + tile_offset<T>(r, part * 16 + which * (16 / sizeof(T)))) = chunk;
      }
      if constexpr (kRowwise) {
        const T* values = reinterpret_cast<const T*>(raw[p]);
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = to_float(values[i]);
        rowwise_block<kE4M3>(v, a, row0 + r, r < valid_rows, col, col_tile, part, true);
      }
    }
  } else {
    // Any cols, any alignment: element loads and byte stores.
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const int r = p * kRowsPerPass + static_cast<int>(threadIdx.x) / 8;
      const T* src = r < valid_rows ? source_row(x, a.cols, a.index, a.source_rows, row0 + r) : nullptr;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        T value = static_cast<T>(0.f);
        if (src != nullptr && col + i < a.cols) value = src[col + i];
        *reinterpret_cast<T*>(tile + tile_offset<T>(r, part * 16 + i)) = value;
        v[i] = to_float(value);
      }
      if constexpr (kRowwise) rowwise_block<kE4M3>(v, a, row0 + r, r < valid_rows, col, col_tile, part, false);
    }
  }
  if (group < 0) return;  // tokens outside every group: row-wise only
  __syncthreads();

  column_pass<T, kE4M3, kDbias>(tile, a, span, block, col0, kVector);
}

// Four CTAs per SM for 16-bit inputs (64 registers; with the row-wise copy 8
// bytes of spills, which measured faster than three CTAs at 75 registers).
template <typename T, bool kE4M3, bool kRowwise, bool kDbias, bool kVector>
__global__ void __launch_bounds__(kThreads, sizeof(T) == 4 ? 1 : 4)
    grouped_1x128_kernel(const T* __restrict__ x, const GroupedArgs a) {
  extern __shared__ __align__(16) unsigned char tile[];  // [128][128] T, swizzled

  constexpr int kPerCta = tiles_per_cta(kRowwise);
  int64_t block, col_unit;
  tile_coords(blockIdx.x, (a.rows + kBlock - 1) / kBlock + a.num_groups, (a.col_tiles + kPerCta - 1) / kPerCta,
              a.band, &block, &col_unit);
  const TileRows span = locate_tile(block, a.splits, a.num_groups, a.rows, blockIdx.x == 0 ? a.blocks : nullptr);
  if ((span.group < 0 && !kRowwise) || span.valid_rows <= 0) return;
  const int64_t first = col_unit * kPerCta;
  if constexpr (kPerCta == 1) {
    quantize_tile<T, kE4M3, kRowwise, kDbias, kVector>(x, a, span, block, first, tile);
  } else {
    const int64_t end = first + kPerCta < a.col_tiles ? first + kPerCta : a.col_tiles;
#pragma unroll 1
    for (int64_t col_tile = first; col_tile < end; ++col_tile) {
      if (col_tile != first) __syncthreads();  // the last tile's column pass has read the shared tile
      quantize_tile<T, kE4M3, kRowwise, kDbias, kVector>(x, a, span, block, col_tile, tile);
    }
  }
}

// dbias[e, c] from the per-block column sums of group e: warp w adds blocks
// w, w + 8, ... in order, then the eight warp sums are added in warp order.
constexpr int kDbiasCols = 32;

__global__ void __launch_bounds__(kThreads)
    grouped_dbias_kernel(const float* __restrict__ partials, const int64_t* __restrict__ blocks, int64_t cols,
                         int64_t col_tiles, float* __restrict__ dbias) {
  __shared__ float warp_sums[kThreads / 32][kDbiasCols];
  const int64_t group = static_cast<int64_t>(blockIdx.x) / col_tiles;
  const int64_t c = static_cast<int64_t>(blockIdx.x) % col_tiles * kDbiasCols + threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int64_t first = blocks[group];
  const int64_t count = blocks[group + 1] - first;
  float sum = 0.f;
  if (c < cols) {
#pragma unroll 4
    for (int64_t j = warp; j < count; j += kThreads / 32) sum += partials[(first + j) * cols + c];
  }
  warp_sums[warp][threadIdx.x % 32] = sum;
  __syncthreads();
  if (warp == 0 && c < cols) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w][threadIdx.x];
    dbias[group * cols + c] = total;
  }
}

mg_status check_quantize_args(const void* x, mg_dtype x_dtype, int64_t rows, int64_t cols,
                              const mg_quantize_config& config, float* fp8_max) {
  MG_RETURN_IF_ERROR(check_float_dtype("x", x_dtype));
  MG_RETURN_IF_ERROR(check_fp8_config(config, fp8_max));
  if (rows < 0 || cols < 0 || rows > INT32_MAX || cols > INT32_MAX) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "rows and cols must be in [0, 2^31), got %lld x %lld",
                static_cast<long long>(rows), static_cast<long long>(cols));
  }
  if (x == nullptr && rows * cols > 0) return fail(MG_ERROR_INVALID_ARGUMENT, "x must not be NULL");
  return MG_OK;
}

// Both grouped entry points: column-wise always, row-wise when q != nullptr.
// Gathered (index != nullptr): x has source_rows rows and the quantized
// matrix's row r is x[index[r]]; dbias is not taken then.
mg_status quantize_grouped(const void* x, mg_dtype x_dtype, int64_t rows, int64_t cols, const void* m_splits,
                           mg_dtype splits_dtype, int num_groups, const mg_quantize_config& config, void* q,
                           float* scale_inv, void* qt, float* scale_inv_t, float* dbias, int device,
                           int workspace_slot, void* stream, const int32_t* index = nullptr,
                           int64_t source_rows = 0) {
  float fp8_max = 0.f;
  MG_RETURN_IF_ERROR(check_quantize_args(x, x_dtype, index != nullptr ? source_rows : rows, cols, config, &fp8_max));
  if (rows < 0 || rows > INT32_MAX) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "rows must be in [0, 2^31), got %lld", static_cast<long long>(rows));
  }
  if (splits_dtype != MG_INT32 && splits_dtype != MG_INT64) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "m_splits must be int32 or int64, got %s", dtype_name(splits_dtype));
  }
  if (num_groups <= 0 || m_splits == nullptr) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "need num_groups > 0 and device m_splits, got %d groups", num_groups);
  }
  const bool rowwise = q != nullptr;
  if (rows > 0 && cols > 0 && (qt == nullptr || scale_inv_t == nullptr || (rowwise && scale_inv == nullptr))) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "qt and scale_inv_t%s must not be NULL",
                rowwise ? " (and scale_inv, with q)" : "");
  }
  const int64_t scale_rows = (rows + kBlock - 1) / kBlock + num_groups;
  const int64_t col_tiles = (cols + kTileCols - 1) / kTileCols;
  if (scale_rows * col_tiles > INT32_MAX) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "x is too large for the grouped quantizer: %lld x %lld with %d groups",
                static_cast<long long>(rows), static_cast<long long>(cols), num_groups);
  }
  const bool need_partials = dbias != nullptr && rows > 0 && cols > 0;
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  // Scratch memory only for dbias: the per-block column sums and the block
  // starts b_e, which the quantize kernel's CTA 0 writes for the dbias kernel
  // (every CTA derives the group layout from m_splits itself).
  float* partials = nullptr;
  int64_t* blocks = nullptr;
  if (need_partials) {
    WorkspaceCarver plan(nullptr);
    plan.take<int64_t>(num_groups + 1);
    plan.take<float>(static_cast<size_t>(scale_rows * cols));
    void* base = nullptr;
    MG_RETURN_IF_ERROR(workspace_get(device, workspace_slot, plan.bytes_used(), cuda_stream, &base));
    WorkspaceCarver carve(base);
    blocks = carve.take<int64_t>(num_groups + 1);
    partials = carve.take<float>(static_cast<size_t>(scale_rows * cols));
  }

  if (rows > 0 && cols > 0) {
    GroupedArgs args{};
    args.rows = rows;
    args.cols = cols;
    args.num_groups = num_groups;
    args.index = index;
    args.source_rows = source_rows;
    args.col_tiles = col_tiles;
    args.padded_rows = columnwise_padded_rows(rows, num_groups);
    // Column-wise only: bands of one unit (four column tiles). With the
    // row-wise copy as well, the walk over all columns (the row-wise writes
    // want whole rows). Measured: docs/kernels.md, "FP8 quantize".
    const int64_t col_units = (col_tiles + tiles_per_cta(rowwise) - 1) / tiles_per_cta(rowwise);
    args.band = rowwise ? col_units : 1;
    args.fp8_max = fp8_max;
    args.pow2 = config.pow2_scales != 0;
    args.epsilon = config.amax_epsilon;
    args.splits = Splits{m_splits, splits_dtype == MG_INT64};
    args.blocks = blocks;
    args.q = static_cast<uint8_t*>(q);
    args.scale_inv = scale_inv;
    args.qt = static_cast<uint8_t*>(qt);
    args.scale_inv_t = scale_inv_t;
    args.partials = partials;
    const bool vector = cols % 16 == 0 && aligned16(x) && aligned16(qt) && (!rowwise || aligned16(q));
    const dim3 grid(static_cast<unsigned>(scale_rows * col_units));
    mg_status prepared = MG_OK;
    dispatch_types(x_dtype, config.fp8_dtype, [&](auto tag, auto e4m3) {
      using T = typename decltype(tag)::type;
      dispatch_bool(rowwise, [&](auto with_rowwise) {
        dispatch_bool(need_partials, [&](auto with_dbias) {
          dispatch_bool(vector, [&](auto with_vector) {
            constexpr auto kernel = grouped_1x128_kernel<T, decltype(e4m3)::value, decltype(with_rowwise)::value,
                                                         decltype(with_dbias)::value, decltype(with_vector)::value>;
            constexpr int smem = kTileRows * kTileCols * static_cast<int>(sizeof(T));
            prepared = raise_shared_memory_once<kernel>(device, smem);
            if (prepared != MG_OK) return;
            kernel<<<grid, kThreads, smem, cuda_stream>>>(static_cast<const T*>(x), args);
          });
        });
      });
    });
    MG_RETURN_IF_ERROR(prepared);
    MG_CUDA_RETURN(cudaGetLastError());
  }

  if (dbias != nullptr && cols > 0 && !need_partials) {
    // No tokens: every group's column sums are zero.
    MG_CUDA_RETURN(cudaMemsetAsync(dbias, 0, sizeof(float) * static_cast<size_t>(num_groups) * cols, cuda_stream));
  } else if (need_partials) {
    const int64_t dbias_tiles = (cols + kDbiasCols - 1) / kDbiasCols;
    if (dbias_tiles * num_groups > INT32_MAX) {
      return fail(MG_ERROR_INVALID_ARGUMENT, "dbias [%d, %lld] is too large", num_groups,
                  static_cast<long long>(cols));
    }
    grouped_dbias_kernel<<<static_cast<unsigned>(dbias_tiles * num_groups), kThreads, 0, cuda_stream>>>(
        partials, blocks, cols, dbias_tiles, dbias);
    MG_CUDA_RETURN(cudaGetLastError());
  }
  return ok();
}

// Row-wise, every row of x, or (index != nullptr) row r of the result from
// x[index[r]] with x holding source_rows rows.
mg_status quantize_rowwise(const void* x, mg_dtype x_dtype, int64_t rows, int64_t cols, const int32_t* index,
                           int64_t source_rows, const mg_quantize_config& config, void* q, float* scale_inv,
                           void* stream) {
  float fp8_max = 0.f;
  MG_RETURN_IF_ERROR(check_quantize_args(x, x_dtype, index != nullptr ? source_rows : rows, cols, config, &fp8_max));
  if (rows < 0 || rows > INT32_MAX) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "rows must be in [0, 2^31), got %lld", static_cast<long long>(rows));
  }
  if (rows == 0 || cols == 0) return ok();
  if (q == nullptr || scale_inv == nullptr) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "q and scale_inv must not be NULL");
  }
  const int64_t units = rows * ((cols + kBlock - 1) / kBlock);  // (row, 128-column block) pairs
  // 16 elements per lane wants 16-byte aligned rows of whole 16-element chunks.
  const bool vectorised = cols % 16 == 0 && aligned16(x) && aligned16(q);
  const int64_t threads = units * (vectorised ? 8 : 32);
  const int64_t grid = (threads + kThreads - 1) / kThreads;
  if (grid > INT32_MAX) return fail(MG_ERROR_INVALID_ARGUMENT, "x is too large: %lld blocks", static_cast<long long>(grid));
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  const dim3 blocks(static_cast<unsigned>(grid));
  const bool pow2 = config.pow2_scales != 0;
  dispatch_types(x_dtype, config.fp8_dtype, [&](auto tag, auto e4m3) {
    using T = typename decltype(tag)::type;
    constexpr bool kE4M3 = decltype(e4m3)::value;
    if (vectorised) {
      rowwise_vec16_kernel<T, kE4M3><<<blocks, kThreads, 0, cuda_stream>>>(
          static_cast<const T*>(x), rows, cols, index, source_rows, fp8_max, pow2, config.amax_epsilon,
          static_cast<uint8_t*>(q), scale_inv);
    } else {
      rowwise_kernel<T, kE4M3><<<blocks, kThreads, 0, cuda_stream>>>(
          static_cast<const T*>(x), rows, cols, index, source_rows, fp8_max, pow2, config.amax_epsilon,
          static_cast<uint8_t*>(q), scale_inv);
    }
  });
  MG_CUDA_RETURN(cudaGetLastError());
  return ok();
}

}  // namespace
}  // namespace moe_grouped::quantize

using namespace moe_grouped;
using namespace moe_grouped::quantize;

extern "C" mg_status mg_quantize_rowwise_1x128(const void* x, mg_dtype x_dtype, int64_t rows,
                                               int64_t cols, mg_quantize_config config, void* q,
                                               float* scale_inv, void* stream) {
  MG_ENTER_DEVICE_OF(q);
  return quantize_rowwise(x, x_dtype, rows, cols, nullptr, 0, config, q, scale_inv, stream);
}

extern "C" mg_status mg_quantize_gathered_1x128(const void* x, mg_dtype x_dtype, int64_t source_rows,
                                                int64_t cols, const int32_t* index, int64_t rows,
                                                const void* m_splits, mg_dtype splits_dtype, int num_groups,
                                                mg_quantize_config config, void* q, float* scale_inv, void* qt,
                                                float* scale_inv_t, int device, int workspace_slot,
                                                void* stream) {
  MG_ENTER_DEVICE(device);
  if (index == nullptr && rows > 0) return fail(MG_ERROR_INVALID_ARGUMENT, "index must not be NULL");
  if (source_rows < 0) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "source_rows must be >= 0, got %lld", static_cast<long long>(source_rows));
  }
  if (m_splits == nullptr) {
    if (qt != nullptr || scale_inv_t != nullptr) {
      return fail(MG_ERROR_INVALID_ARGUMENT, "the column-wise copy needs m_splits");
    }
    return quantize_rowwise(x, x_dtype, rows, cols, index, source_rows, config, q, scale_inv, stream);
  }
  if (q == nullptr && scale_inv != nullptr) return fail(MG_ERROR_INVALID_ARGUMENT, "scale_inv given without q");
  return quantize_grouped(x, x_dtype, rows, cols, m_splits, splits_dtype, num_groups, config, q, scale_inv, qt,
                          scale_inv_t, nullptr, device, workspace_slot, stream, index, source_rows);
}

extern "C" mg_status mg_quantize_columnwise_grouped_1x128(
    const void* x, mg_dtype x_dtype, int64_t rows, int64_t cols, const void* m_splits,
    mg_dtype splits_dtype, int num_groups, mg_quantize_config config, void* qt, float* scale_inv_t,
    float* dbias, int device, int workspace_slot, void* stream) {
  MG_ENTER_DEVICE(device);
  return quantize_grouped(x, x_dtype, rows, cols, m_splits, splits_dtype, num_groups, config, nullptr, nullptr,
                          qt, scale_inv_t, dbias, device, workspace_slot, stream);
}

extern "C" mg_status mg_quantize_rowwise_columnwise_grouped_1x128(
    const void* x, mg_dtype x_dtype, int64_t rows, int64_t cols, const void* m_splits,
    mg_dtype splits_dtype, int num_groups, mg_quantize_config config, void* q, float* scale_inv,
    void* qt, float* scale_inv_t, float* dbias, int device, int workspace_slot, void* stream) {
  MG_ENTER_DEVICE(device);
  if (q == nullptr && rows > 0 && cols > 0) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "q must not be NULL (use mg_quantize_columnwise_grouped_1x128 "
                                           "for the column-wise copy alone)");
  }
  return quantize_grouped(x, x_dtype, rows, cols, m_splits, splits_dtype, num_groups, config, q, scale_inv, qt,
                          scale_inv_t, dbias, device, workspace_slot, stream);
}
