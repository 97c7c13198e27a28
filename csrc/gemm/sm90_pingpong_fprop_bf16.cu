// A persistent ping-pong grouped fprop for bf16 on sm_90a, written with CuTe
// primitives rather than CUTLASS's collectives: y_e = x_e . W_e^T, x read as
// stored (TMA) or through the routing index (cp.async), optionally with
// SwiGLU in the epilogue (the fused experts path's fc1: g and h = silu(gate)
// * up from one kernel).
//
// One producer warpgroup fills a shared stage ring and two consumer
// warpgroups take alternate 64x256 tiles, so one consumer's epilogue overlaps
// the other's MMAs; CUTLASS's cooperative kernel runs its epilogue with no MMA
// beside it. The tile schedule comes from the device m_splits inside the
// kernel, so it needs no workspace. heuristic.cpp says where it runs; design
// notes and measurements: docs/kernels.md, "Ping-pong fprop".
#include <cuda_bf16.h>
#include <cuda_runtime.h>

// cute/tensor.hpp first: the SM90 atoms' headers assume what it declares.
#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/bfloat16.h>

#include <cstdint>

#include "activation/swiglu_backward_math.cuh"
#include "core/error.h"
#include "core/kernel_attributes.h"
#include "core/setup.cuh"
#include "gemm/gather_copy.cuh"
#include "gemm/grouped_gemm.h"

namespace moe_grouped::gemm {
namespace {

using namespace cute;
using bf16 = cutlass::bfloat16_t;

constexpr int kBlockM = 64;    // rows of one consumer's tile
constexpr int kBlockN = 256;
constexpr int kBlockK = 64;    // one 128-byte swizzle row of bf16
constexpr int kStages = 4;     // 40 KB each; a fifth does not fit beside the epilogue buffers
constexpr int kThreads = 384;  // producer warpgroup + two consumer warpgroups
constexpr int kEpilogueRows = 8;
constexpr int kPaddedRow = kBlockN + 8;       // conflict-free bf16-pair writes
constexpr int kPaddedHalfRow = kBlockN / 2 + 8;
constexpr int kProducerRegisters = 40;
constexpr int kConsumerRegisters = 232;

using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bf16>{},
                                           make_shape(Int<kBlockM>{}, Int<kBlockK>{}, Int<kStages>{})));
using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bf16>{},
                                           make_shape(Int<kBlockN>{}, Int<kBlockK>{}, Int<kStages>{})));
// SwiGLU: a B tile is the 128 gate rows of the tile's output columns and the
// 128 matching up rows, ffn rows further on in W, loaded as two halves.
using SmemLayoutBHalf = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bf16>{},
                                               make_shape(Int<kBlockN / 2>{}, Int<kBlockK>{})));

struct alignas(1024) SharedStorage {
  cute::array_aligned<bf16, cosize_v<SmemLayoutA>, 1024> a;
  cute::array_aligned<bf16, cosize_v<SmemLayoutB>, 1024> b;
  cute::array_aligned<bf16, 8 * kEpilogueRows * kPaddedRow, 16> c;      // per consumer warp
  cute::array_aligned<bf16, 8 * kEpilogueRows * kPaddedHalfRow, 16> h;  // SwiGLU's h rows
  uint64_t full[kStages];
  uint64_t empty[kStages];
  uint64_t turn[2];  // consumer c may start its next mainloop
  int row_start[kPingPongMaxGroups + 1];   // group g's rows: [row_start[g], row_start[g + 1])
  int tile_start[kPingPongMaxGroups + 1];  // its tiles: [tile_start[g], tile_start[g + 1])
};

constexpr uint32_t kStageBytesA = kBlockM * kBlockK * sizeof(bf16);
constexpr uint32_t kStageBytesB = kBlockN * kBlockK * sizeof(bf16);

template <class TmaA, class TmaB>
struct Params {
  TmaA tma_a;
  TmaB tma_b;
  bf16* out;                 // y, or g with SwiGLU: [rows, n]
  bf16* h;                   // SwiGLU: [rows, n / 2]
  const void* m_splits;
  int groups, rows, n, k;
  const int32_t* index;      // gathered: row r of A is source[index[r]]; NULL: A by TMA
  const bf16* source;        // gathered A's rows [source_rows, k]
  int64_t source_rows;
};

// One tensor map per operand for the whole call: x [M, K] is offset by the
// group's first row (domain_offset), W [E, N, K] is indexed by expert, so
// nothing is rewritten per group. Rows a tile covers past its group's end
// belong to the next group: they are loaded (harmless) but never stored.
template <bool kSwiglu>
auto make_params(const GroupedGemmCall& call) {
  const auto* a = static_cast<const bf16*>(call.tokens);
  const auto* b = static_cast<const bf16*>(call.weight.base);
  const int rows = static_cast<int>(call.total_rows), n = static_cast<int>(call.n), k = static_cast<int>(call.k);
  // Gathered calls copy A themselves; the map (over the source) is then unused.
  const int a_rows = call.gather_a.index != nullptr ? static_cast<int>(call.gather_a.source_rows) : rows;
  Tensor ga = make_tensor(make_gmem_ptr(a), make_shape(a_rows, k), make_stride(int64_t(k), _1{}));
  Tensor gb = make_tensor(make_gmem_ptr(b), make_shape(n, k, call.num_groups),
                          make_stride(int64_t(k), _1{}, call.weight.group_stride));
  auto tma_a = make_tma_copy(SM90_TMA_LOAD{}, ga, SmemLayoutA{}(_, _, 0), make_shape(Int<kBlockM>{}, Int<kBlockK>{}), _1{});
  auto tma_b = [&] {
    if constexpr (kSwiglu) {
      return make_tma_copy(SM90_TMA_LOAD{}, gb, SmemLayoutBHalf{}, make_shape(Int<kBlockN / 2>{}, Int<kBlockK>{}), _1{});
    } else {
      return make_tma_copy(SM90_TMA_LOAD{}, gb, SmemLayoutB{}(_, _, 0), make_shape(Int<kBlockN>{}, Int<kBlockK>{}), _1{});
    }
  }();
  return Params<decltype(tma_a), decltype(tma_b)>{
      tma_a, tma_b, static_cast<bf16*>(call.out), static_cast<bf16*>(call.swiglu_h), call.m_splits,
      call.num_groups, rows, n, k, call.gather_a.index, a, call.gather_a.source_rows};
}

// Inclusive prefix sum of v over the lanes of the warp.
template <typename T>
__device__ __forceinline__ T warp_inclusive_sum(T v, int lane) {
  CUTE_UNROLL
  for (int offset = 1; offset < 32; offset *= 2) {
    const T up = __shfl_up_sync(0xffffffffu, v, offset);
    if (lane >= offset) v += up;
  }
  return v;
}

// Warp 0: the groups' first rows and first tiles into shared memory, from the
// counts clamped as every reader of m_splits clamps them (core/setup.cuh), so
// that a wrong m_splits can neither overflow the sums nor send a tile past
// the buffer.
template <typename SplitT>
__device__ void scan_splits_to_smem(SharedStorage& s, const SplitT* m_splits, int groups, int rows, int n_tiles) {
  const int lane = threadIdx.x % 32;
  int64_t rows_before = 0;
  int tiles_before = 0;
  if (lane == 0) {
    s.row_start[0] = 0;
    s.tile_start[0] = 0;
  }
  for (int base = 0; base < groups; base += 32) {
    const int g = base + lane;
    const int64_t count = g < groups ? clamp_split(static_cast<int64_t>(m_splits[g]), rows) : 0;
    const int64_t before = rows_before + warp_inclusive_sum(count, lane) - count;  // exclusive
    const GroupRows at = group_rows(before, count, rows);
    const int tiles_incl = warp_inclusive_sum(static_cast<int>((at.count + kBlockM - 1) / kBlockM) * n_tiles, lane);
    if (g < groups) {
      s.row_start[g + 1] = static_cast<int>(at.start + at.count);
      s.tile_start[g + 1] = tiles_before + tiles_incl;
    }
    rows_before = __shfl_sync(0xffffffffu, before + count, 31);
    tiles_before += __shfl_sync(0xffffffffu, tiles_incl, 31);
  }
}

struct Tile {
  int group, row0, row_end, n_tile;
};

// A place in the ring of kStages shared stages, and the parity of the ring's
// current pass (what a stage's barrier phase is compared with).
struct StageRing {
  int stage = 0, phase = 0;

  __device__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }

  __device__ void skip(int n) {  // n stages on: the other consumer's k-tiles
    stage += n;
    phase ^= (stage / kStages) & 1;
    stage %= kStages;
  }
};

// Tile t of the schedule: the last group whose first tile is at or before t
// (an empty group's range is empty, so it is never the answer), then along M,
// so that the CTAs running together share an expert's weight tiles in L2.
__device__ Tile decode_tile(const SharedStorage& s, int groups, int n_tiles, int t) {
  int lo = 0, hi = groups;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (s.tile_start[mid] <= t) lo = mid; else hi = mid;
  }
  const int local = t - s.tile_start[lo];
  const int m_tiles = (s.row_start[lo + 1] - s.row_start[lo] + kBlockM - 1) / kBlockM;
  return {lo, s.row_start[lo] + (local % m_tiles) * kBlockM, s.row_start[lo + 1], local / m_tiles};
}

// Thread 0 of the producer warpgroup: B's k-tile `kt` of this tile into `stage`
// by TMA (SwiGLU: the gate half, then the up half `ffn` rows on).
template <bool kSwiglu, class P>
__device__ __forceinline__ void load_b(const P& p, SharedStorage& s, const Tile& tile, int kt, int stage) {
  Tensor mB = p.tma_b.get_tma_tensor(make_shape(p.n, p.k, p.groups));
  auto tb = p.tma_b.get_slice(0);
  if constexpr (kSwiglu) {
    auto half = Shape<Int<kBlockN / 2>, Int<kBlockK>>{};
    const int ffn_tiles = p.n / 2 / (kBlockN / 2);
    Tensor gate = tb.partition_S(local_tile(mB(_, _, tile.group), half, make_coord(tile.n_tile, _)));
    Tensor up = tb.partition_S(local_tile(mB(_, _, tile.group), half, make_coord(ffn_tiles + tile.n_tile, _)));
    bf16* stage_b = s.b.data() + stage * kBlockN * kBlockK;
    copy(p.tma_b.with(s.full[stage]), gate(_, _, _, kt),
         tb.partition_D(make_tensor(make_smem_ptr(stage_b), SmemLayoutBHalf{})));
    copy(p.tma_b.with(s.full[stage]), up(_, _, _, kt),
         tb.partition_D(make_tensor(make_smem_ptr(stage_b + kBlockN / 2 * kBlockK), SmemLayoutBHalf{})));
  } else {
    Tensor gB = tb.partition_S(local_tile(mB(_, _, tile.group), Shape<Int<kBlockN>, Int<kBlockK>>{},
                                          make_coord(tile.n_tile, _)));
    Tensor sB = tb.partition_D(make_tensor(make_smem_ptr(s.b.data()), SmemLayoutB{}));
    copy(p.tma_b.with(s.full[stage]), gB(_, _, _, kt), sB(_, _, _, stage));
  }
}

// The producer warpgroup when A is read as stored: thread 0 loads both
// operands of every k-tile by TMA.
template <bool kSwiglu, class P>
__device__ void produce_stored(const P& p, SharedStorage& s, int total, int n_tiles, int k_tiles) {
  if (threadIdx.x != 0) return;
  Tensor mA = p.tma_a.get_tma_tensor(make_shape(p.rows, p.k));
  auto ta = p.tma_a.get_slice(0);
  Tensor sA = ta.partition_D(make_tensor(make_smem_ptr(s.a.data()), SmemLayoutA{}));
  StageRing ring;
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    const Tile tile = decode_tile(s, p.groups, n_tiles, t);
    Tensor gA = ta.partition_S(local_tile(domain_offset(make_coord(tile.row0, 0), mA),
                                          Shape<Int<kBlockM>, Int<kBlockK>>{}, make_coord(0, _)));
    for (int kt = 0; kt < k_tiles; ++kt) {
      cutlass::arch::ClusterBarrier::wait(&s.empty[ring.stage], ring.phase ^ 1);
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&s.full[ring.stage],
                                                                    kStageBytesA + kStageBytesB);
      copy(p.tma_a.with(s.full[ring.stage]), gA(_, _, _, kt), sA(_, _, _, ring.stage));
      load_b<kSwiglu>(p, s, tile, kt, ring.stage);
      ring.advance();
    }
  }
}

// The producer warpgroup when A's rows come through the index: all 128
// threads copy A by cp.async, eight lanes per 128-byte row line (a 16-byte
// chunk each, to where the 128-byte swizzle puts it), warp w owning tile rows
// [16 w, 16 w + 16); an index outside [0, source_rows) or a row past the
// call's rows reads zeros. Each thread's arrival on the stage's full barrier
// is pending until its copies land (the barrier expects 128 of them besides
// thread 0's, which also expects B's TMA bytes). The next tile's indices are
// read while this tile's copies go out.
template <bool kSwiglu, class P>
__device__ void produce_gathered(const P& p, SharedStorage& s, int total, int n_tiles, int k_tiles) {
  constexpr int kRowsPerWarp = kBlockM / 4;
  constexpr int kSteps = kRowsPerWarp / 4;  // 4 rows per instruction
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int chunk = lane % 8, sub = lane / 8;
  const uint32_t a_base = cute::cast_smem_ptr_to_uint(s.a.data());
  uint32_t dst[kSteps];
  CUTE_UNROLL
  for (int st = 0; st < kSteps; ++st) {
    const int r = warp * kRowsPerWarp + st * 4 + sub;
    dst[st] = r * 128 + ((chunk ^ (r & 7)) << 4);  // stages are 1024-byte aligned
  }
  // Decodes tile t into `next` and reads its rows' indices.
  int idx[kSteps];
  Tile next{};
  auto read_index = [&](int t) {
    next = decode_tile(s, p.groups, n_tiles, t);
    CUTE_UNROLL
    for (int st = 0; st < kSteps; ++st) {
      const int row = next.row0 + warp * kRowsPerWarp + st * 4 + sub;
      idx[st] = row < p.rows ? __ldg(p.index + row) : -1;
    }
  };
  if (static_cast<int>(blockIdx.x) < total) read_index(blockIdx.x);
  StageRing ring;
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    const Tile tile = next;
    const char* src[kSteps];
    uint32_t src_bytes[kSteps];
    CUTE_UNROLL
    for (int st = 0; st < kSteps; ++st) {
      const bool valid = idx[st] >= 0 && idx[st] < p.source_rows;
      src[st] = reinterpret_cast<const char*>(p.source + (valid ? int64_t(idx[st]) * p.k : 0)) + chunk * 16;
      src_bytes[st] = valid ? 16 : 0;
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
      cutlass::arch::ClusterBarrier::wait(&s.empty[ring.stage], ring.phase ^ 1);
      const uint32_t stage_a = a_base + ring.stage * kStageBytesA;
      CUTE_UNROLL
      for (int st = 0; st < kSteps; ++st) {
        gather_copy16(stage_a + dst[st], src[st] + int64_t(kt) * kBlockK * sizeof(bf16), src_bytes[st]);
      }
      cutlass::arch::cpasync_barrier_arrive_noinc(&s.full[ring.stage]);
      if (tid == 0) {
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&s.full[ring.stage], kStageBytesB);
        load_b<kSwiglu>(p, s, tile, kt, ring.stage);
      }
      if (kt == 0 && t + static_cast<int>(gridDim.x) < total) read_index(t + gridDim.x);
      ring.advance();
    }
  }
}

// A consumer warp's staged SwiGLU rows out by bulk copies (the TMA unit's
// cp.async.bulk), one lane per 256-byte segment: a row's gate and up columns of
// g and its h columns, instead of every lane storing twelve 16-byte chunks per
// part. Fewer epilogue instructions, and where rows are gathered the
// load/store unit is left to the producer's cp.async copies (a likely reason,
// not established by a profile). The plain fprop keeps its 16-byte stores,
// which bulk copies did not beat there (docs/kernels.md).
template <class P>
__device__ __forceinline__ void bulk_store_swiglu_rows(const P& p, int first_row, int row_end, int n0,
                                                       const bf16* c_buf, const bf16* h_buf, int lane) {
  constexpr int kSegments = 3;  // gate, up, h
  constexpr int kSegmentCols = kBlockN / 2;
  static_assert(kEpilogueRows * kSegments <= 32);
  cutlass::arch::fence_view_async_shared();  // the warp's shared-memory writes, visible to the copies
  __syncwarp();
  const int r = lane / kSegments, segment = lane % kSegments;
  const int row = first_row + r;
  if (lane < kEpilogueRows * kSegments && row < row_end) {
    const int ffn = p.n / 2;
    const bf16* from = segment == 2 ? h_buf + r * kPaddedHalfRow : c_buf + r * kPaddedRow + segment * kSegmentCols;
    bf16* to = segment == 2 ? p.h + int64_t(row) * ffn + n0 : p.out + int64_t(row) * p.n + segment * ffn + n0;
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(to),
                 "r"(cute::cast_smem_ptr_to_uint(from)), "r"(kSegmentCols * 2)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
  }
}

// The warp's earlier bulk copies have read (kRead) or written their buffers.
template <bool kRead>
__device__ __forceinline__ void bulk_store_wait() {
  if constexpr (kRead) {
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
  } else {
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  }
}

// One consumer warp's share of a finished tile: its accumulator fragments
// through shared memory, kEpilogueRows rows at a time, to the rows inside the
// tile's group (SwiGLU: g's gate and up columns, and h, by bulk copies;
// otherwise by 16-byte stores).
//
// In the m64nNk16 accumulator a thread holds two rows of its warp's 16, lane
// / 4 and lane / 4 + 8 (values i with (i / 2) % 2 == 1 are the second), in
// columns (lane % 4) * 2 + 8 * (i / 4) + i % 2. With eight rows per part,
// part p is every thread's row p, so each part touches exactly its values,
// chosen at compile time: testing each value's row at run time instead made
// the unrolled epilogue twice the code. Fragments go to shared memory as bf16
// pairs: single bf16 writes made ptxas serialise the wgmma (warning C7514).
template <bool kSwiglu, class P, class Accum, class Coords>
__device__ __forceinline__ void store_tile(const P& p, const Tile& tile, const Accum& accum, const Coords& coords,
                                           bf16* c_buf, bf16* h_buf, int warp, int lane) {
  static_assert(kEpilogueRows == 8, "a part is one of the two accumulator rows of each thread");
  constexpr int kParts = 16 / kEpilogueRows;  // per warp's 16 rows
  const int row_end = min(tile.row_end, p.rows);
  const int n0 = tile.n_tile * (kSwiglu ? kBlockN / 2 : kBlockN);
  CUTE_UNROLL
  for (int part = 0; part < kParts; ++part) {
    const int first_row = warp * 16 + part * kEpilogueRows;
    const int part_row = get<0>(coords(2 * part)) - first_row;  // lane / 4
    if constexpr (kSwiglu) bulk_store_wait</*kRead=*/true>();  // the buffers are free again
    __syncwarp();
    CUTE_UNROLL
    for (int i = 2 * part; i < size(accum); i += 4) {
      const int c = get<1>(coords(i));
      *reinterpret_cast<__nv_bfloat162*>(c_buf + part_row * kPaddedRow + c) =
          __floats2bfloat162_rn(accum(i), accum(i + 1));
      if constexpr (kSwiglu) {
        // Columns below N/2 are gate; a thread's up partner (column c + N/2)
        // is N/4 values further on.
        constexpr int kUp = kBlockN / 4;
        if (i / 4 < kBlockN / 16) {
          float out[2];
          CUTE_UNROLL
          for (int v = 0; v < 2; ++v) {
            out[v] = swiglu_forward_element<__nv_bfloat16>(round_through<__nv_bfloat16>(accum(i + v)),
                                                           round_through<__nv_bfloat16>(accum(i + kUp + v)));
          }
          *reinterpret_cast<__nv_bfloat162*>(h_buf + part_row * kPaddedHalfRow + c) =
              __floats2bfloat162_rn(out[0], out[1]);
        }
      }
    }
    if constexpr (kSwiglu) {
      bulk_store_swiglu_rows(p, tile.row0 + first_row, row_end, n0, c_buf, h_buf, lane);
    } else {
      constexpr int kChunksPerRow = kBlockN / 8;  // 16-byte stores per row
      __syncwarp();
      CUTE_UNROLL
      for (int it = 0; it < kEpilogueRows * kChunksPerRow / 32; ++it) {
        const int idx = it * 32 + lane, r = idx / kChunksPerRow, chunk = idx % kChunksPerRow;
        const int row = tile.row0 + first_row + r;
        const int col = n0 + chunk * 8;
        if (row < row_end && col < p.n) {
          *reinterpret_cast<uint4*>(p.out + int64_t(row) * p.n + col) =
              *reinterpret_cast<const uint4*>(c_buf + r * kPaddedRow + chunk * 8);
        }
      }
    }
  }
}

template <bool kSwiglu, typename SplitT, class P>
__global__ void __launch_bounds__(kThreads, 1) pingpong_fprop_kernel(CUTE_GRID_CONSTANT P const p) {
  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& s = *reinterpret_cast<SharedStorage*>(smem_raw);
  const int warp_group = threadIdx.x / 128;
  const int n_tiles = kSwiglu ? p.n / kBlockN : (p.n + kBlockN - 1) / kBlockN;
  const int k_tiles = p.k / kBlockK;

  if (threadIdx.x < 32) scan_splits_to_smem(s, static_cast<const SplitT*>(p.m_splits), p.groups, p.rows, n_tiles);
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      cutlass::arch::ClusterBarrier::init(&s.full[i], p.index != nullptr ? 129 : 1);
      cutlass::arch::ClusterBarrier::init(&s.empty[i], 128);
    }
    cutlass::arch::ClusterBarrier::init(&s.turn[0], 128);
    cutlass::arch::ClusterBarrier::init(&s.turn[1], 128);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  const int total = s.tile_start[p.groups];

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    if (p.index != nullptr) {
      produce_gathered<kSwiglu>(p, s, total, n_tiles, k_tiles);
    } else {
      produce_stored<kSwiglu>(p, s, total, n_tiles, k_tiles);
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
  const int consumer = warp_group - 1;
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  Tensor sA = make_tensor(make_smem_ptr(s.a.data()), SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(s.b.data()), SmemLayoutB{});
  auto tiled_mma = make_tiled_mma(
      decltype(GMMA::ss_op_selector<bf16, bf16, float, Shape<Int<kBlockM>, Int<kBlockN>, Int<16>>,
                                    GMMA::Major::K, GMMA::Major::K>()){});
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  Tensor tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA));
  Tensor tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB));
  Tensor coords = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  bf16* c_buf = s.c.data() + (consumer * 4 + warp) * kEpilogueRows * kPaddedRow;
  bf16* h_buf = s.h.data() + (consumer * 4 + warp) * kEpilogueRows * kPaddedHalfRow;

  // Where this consumer is in the shared ring: it skips the other's k-tiles.
  StageRing ring;
  int turn_phase = 0;
  if (consumer == 1) ring.skip(k_tiles);
  int j = 0;
  for (int t = blockIdx.x + consumer * gridDim.x; t < total; t += 2 * gridDim.x, ++j) {
    const Tile tile = decode_tile(s, p.groups, n_tiles, t);
    Tensor accum = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    // The consumers' mainloops alternate strictly: both wait on the same stage
    // ring, and a consumer that started early could see an earlier fill of the
    // same parity (without the turns the kernel hung or faulted once K
    // exceeded the ring).
    if (j > 0 || consumer == 1) {
      cutlass::arch::ClusterBarrier::wait(&s.turn[consumer], turn_phase);
      turn_phase ^= 1;
    }
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    warpgroup_fence_operand(accum);
    StageRing release = ring;  // the stage the MMAs in flight read, freed one k-tile behind
    cutlass::arch::ClusterBarrier::wait(&s.full[ring.stage], ring.phase);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tCrA); ++kb) {
      cute::gemm(tiled_mma, tCrA(_, _, kb, ring.stage), tCrB(_, _, kb, ring.stage), accum);
      tiled_mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    ring.advance();
    warpgroup_fence_operand(accum);
    for (int kt = 1; kt < k_tiles; ++kt) {
      cutlass::arch::ClusterBarrier::wait(&s.full[ring.stage], ring.phase);
      warpgroup_fence_operand(accum);
      warpgroup_arrive();
      cute::gemm(tiled_mma, tCrA(_, _, _, ring.stage), tCrB(_, _, _, ring.stage), accum);
      warpgroup_commit_batch();
      warpgroup_wait<1>();  // the previous k-tile's MMAs are done with their stage
      warpgroup_fence_operand(accum);
      cutlass::arch::ClusterBarrier::arrive(&s.empty[release.stage]);
      release.advance();
      ring.advance();
    }
    warpgroup_fence_operand(accum);
    cutlass::arch::ClusterBarrier::arrive(&s.turn[consumer ^ 1]);
    warpgroup_wait<0>();
    cutlass::arch::ClusterBarrier::arrive(&s.empty[release.stage]);
    warpgroup_fence_operand(accum);
    ring.skip(k_tiles);
    store_tile<kSwiglu>(p, tile, accum, coords, c_buf, h_buf, warp, lane);
  }
  if constexpr (kSwiglu) bulk_store_wait</*kRead=*/false>();
}

template <bool kSwiglu, typename SplitT>
mg_status launch(const GroupedGemmCall& call, cudaStream_t stream) {
  auto params = make_params<kSwiglu>(call);
  constexpr auto kernel = pingpong_fprop_kernel<kSwiglu, SplitT, decltype(params)>;
  constexpr int kSmem = sizeof(SharedStorage);
  int device = 0;
  MG_CUDA_RETURN(cudaGetDevice(&device));
  MG_RETURN_IF_ERROR(raise_shared_memory_once<kernel>(device, kSmem));
  kernel<<<call.sm_count, kThreads, kSmem, stream>>>(params);
  MG_CUDA_RETURN(cudaGetLastError());
  return MG_OK;
}

}  // namespace

bool pingpong_fprop_fits(const GroupedGemmCall& call) {
  const bool swiglu = call.swiglu_h != nullptr;
  if (call.kind != MG_GEMM_FPROP || call.bias != nullptr) return false;
  if (call.num_groups < 1 || call.num_groups > kPingPongMaxGroups) return false;
  if (call.k < kBlockK || call.k % kBlockK != 0 || call.k > INT32_MAX) return false;
  if (call.n < 8 || call.n % (swiglu ? kBlockN : 8) != 0 || call.n > INT32_MAX) return false;
  if (call.weight.base == nullptr || call.weight.group_stride % 8 != 0) return false;  // TMA: 16-byte strides
  const RowGather& gather = call.gather_a;
  if (gather.index != nullptr && (gather.source_rows < 1 || gather.source_rows > INT32_MAX)) return false;
  // Rows, tiles and row coordinates (a tile may start up to kBlockM - 1 rows
  // before the end) are 32-bit in the kernel.
  const int64_t n_tiles = (call.n + kBlockN - 1) / kBlockN;
  const int64_t max_tiles = (call.total_rows / kBlockM + call.num_groups) * n_tiles;
  return call.total_rows > 0 && call.total_rows <= INT32_MAX - kBlockM && max_tiles <= INT32_MAX;
}

mg_status pingpong_fprop_bf16(const GroupedGemmCall& call, cudaStream_t stream) {
  const bool int64_splits = call.splits_dtype == MG_INT64;
  if (call.swiglu_h != nullptr) return int64_splits ? launch<true, int64_t>(call, stream) : launch<true, int32_t>(call, stream);
  return int64_splits ? launch<false, int64_t>(call, stream) : launch<false, int32_t>(call, stream);
}

}  // namespace moe_grouped::gemm
