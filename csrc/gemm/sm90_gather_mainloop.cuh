// A grouped-GEMM mainloop that reads an operand's rows through an index: the
// MoE layer's token rows go straight from x [T, H] (or the output gradient)
// into shared memory in expert order, so no permuted [T*k, H] copy is written
// and read back.
//
// It is CUTLASS's ptr-array TMA warp-specialized mainloop (the base class;
// the consumer side is untouched) with its producer's load replaced for a
// gathered operand: two producer warps copy its 16-byte chunks by cp.async to
// where the operand's 128-byte swizzle puts them, so the MMA reads the stage
// as if TMA had filled it. The other operand still comes by TMA (multicast
// included). An index outside [0, source_rows), a row past the group's end and
// columns past the operand's width read zeros (cp.async's zero fill).
// Design notes and measurements: docs/kernels.md, "Gathered mainloop".
#pragma once

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/gemm.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include <cstdint>

#include "gemm/gather_copy.cuh"

namespace moe_grouped::gemm::sm90 {

// What the mainloop reads besides CUTLASS's own arguments. A null index
// leaves that operand to TMA.
struct RowGatherOperand {
  const int32_t* index = nullptr;  // [total rows] of the GEMM
  const void* source = nullptr;    // [source_rows, cols] row-major, 16-bit elements
  int64_t source_rows = 0;
  int64_t cols = 0;
};

struct RowGatherArguments {
  RowGatherOperand a;
  RowGatherOperand b;
  const int64_t* group_offsets = nullptr;  // [E + 1], from the setup kernel
};

// The base mainloop's dispatch policy, marked so that CUTLASS's kernel runs
// its auxiliary-load producer warp (HasAuxiliaryLoad below), the second warp
// that copies gathered rows.
template <class Policy>
struct GatherPolicy : Policy {};

}  // namespace moe_grouped::gemm::sm90

namespace cutlass::gemm::kernel::detail {
template <class Policy>
struct HasAuxiliaryLoad<moe_grouped::gemm::sm90::GatherPolicy<Policy>> : cute::true_type {};
}  // namespace cutlass::gemm::kernel::detail

namespace moe_grouped::gemm::sm90 {

template <class Base>
struct GatherMainloop : Base {
  using typename Base::ElementA;
  using typename Base::ElementB;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::TensorStorage;
  using typename Base::TileShape;
  using DispatchPolicy = GatherPolicy<typename Base::DispatchPolicy>;
  using GatherArguments = RowGatherArguments;

  static_assert(sizeof(ElementA) == 2 && sizeof(ElementB) == 2, "gathered operands are 16-bit");
  static constexpr int kChunkElements = 8;   // 16 bytes, one cp.async
  static constexpr int kSwizzleRowElements = 64;  // 128 bytes, one row of the SW128 atom
  static constexpr bool kAKMajor = !cutlass::gemm::detail::is_major<0, typename Base::StrideA>();
  static constexpr bool kBKMajor = !cutlass::gemm::detail::is_major<0, typename Base::StrideB>();
  // Only wgrad (both operands MN-major) reads B through an index; fprop and
  // dgrad load their weights by TMA, so their kernels leave B's copy out: the
  // producer warps' 40 registers must hold whatever is compiled in, and B's
  // copy, though never run, cost the gathered dgrad a third of its speed.
  static constexpr bool kMayGatherB = !kAKMajor && !kBKMajor;
  static constexpr int kBlockM = cute::size<0>(TileShape{});
  static constexpr int kBlockN = cute::size<1>(TileShape{});
  static constexpr int kBlockK = cute::size<2>(TileShape{});
  static constexpr int kLanes = 32;
  static constexpr uint32_t kBytesA = kBlockM * kBlockK * 2;
  static constexpr uint32_t kBytesB = kBlockN * kBlockK * 2;
  // The chunk placement below assumes the SW128 atoms the builder picks for
  // 16-bit operands with 64-element K (K-major) or MN (MN-major) extents.
  static_assert(kBlockK == kSwizzleRowElements, "a K-major row's k-tile must be one 128-byte swizzle row");
  static_assert(kBlockM % kSwizzleRowElements == 0 && kBlockN % kSwizzleRowElements == 0);
  static_assert(kBlockM % kLanes == 0 && kBlockN % kLanes == 0 && kBlockK % kLanes == 0);

  struct Arguments : Base::Arguments {
    RowGatherArguments gather;
  };

  struct Params : Base::Params {
    RowGatherArguments gather;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape problem_shapes, Arguments const& args, void* workspace) {
    Params params{};
    static_cast<typename Base::Params&>(params) = Base::to_underlying_arguments(
        problem_shapes, static_cast<typename Base::Arguments const&>(args), workspace);
    params.gather = args.gather;
    if (!kMayGatherB) params.gather.b = RowGatherOperand{};  // B comes by TMA
    // The full barrier waits for TMA bytes of the operands TMA still loads;
    // the gathered ones complete through cp.async arrivals.
    params.tma_transaction_bytes =
        (params.gather.a.index != nullptr ? 0u : kBytesA) + (params.gather.b.index != nullptr ? 0u : kBytesB);
    return params;
  }

  // The rows of the current group, carried from tensors_perform_update (which
  // sees the group index) to load (which does not).
  struct GroupRows {
    int64_t first = 0;  // the group's first row in the index
    int32_t count = 0;  // m_e
  };

  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_mnkl, Params const& params) const {
    auto base = Base::load_init(problem_shape_mnkl, params);
    return cute::make_tuple(cute::get<0>(base), cute::get<1>(base), GroupRows{});
  }

  template <class InputTensors, class ProblemShape_MNKL>
  CUTLASS_DEVICE InputTensors tensors_perform_update(InputTensors const& inputs, Params const& params,
                                                     ProblemShape_MNKL, int32_t next_batch) {
    GroupRows rows;
    rows.first = params.gather.group_offsets[next_batch];
    rows.count = static_cast<int32_t>(params.gather.group_offsets[next_batch + 1] - rows.first);
    return cute::make_tuple(cute::get<0>(inputs), cute::get<1>(inputs), rows);
  }

  // The source rows of this lane's slots: index[first + start + lane + 32 s],
  // or -1 past the group's end.
  template <int Slots>
  CUTLASS_DEVICE static void load_rows(const RowGatherOperand& op, GroupRows rows, int start, int lane,
                                       int32_t (&source_row)[Slots]) {
    CUTLASS_PRAGMA_UNROLL
    for (int s = 0; s < Slots; ++s) {
      const int row = start + lane + kLanes * s;
      source_row[s] = row < rows.count ? __ldg(op.index + rows.first + row) : -1;
    }
  }

  // Byte addresses of those rows in the source, 0 where there is none (no
  // row, or an index outside [0, source_rows)).
  template <int Slots>
  CUTLASS_DEVICE static void row_addresses(const RowGatherOperand& op, const int32_t (&source_row)[Slots],
                                           uint64_t (&addr)[Slots]) {
    CUTLASS_PRAGMA_UNROLL
    for (int s = 0; s < Slots; ++s) {
      const int64_t row = source_row[s];
      addr[s] = row >= 0 && row < op.source_rows
                    ? reinterpret_cast<uint64_t>(op.source) + static_cast<uint64_t>(row * op.cols * 2)
                    : 0;
    }
  }

  // The stage buffers' 128-byte rows, as the copies below address them: a
  // K-major tile row r at byte r * 128; an MN-major token t's elements
  // [64 j, 64 j + 64) at byte (j * BLK_K + t) * 128 (SW128 atoms of 8 x 64
  // K-major, 64 x 8 MN-major, tiled along M/N, resp. K, first).
  template <class SmemLayout, bool KMajor, int BlockMN>
  static constexpr bool rows_as_addressed() {
    constexpr auto layout = SmemLayout{}.layout_b();
    constexpr int stage = BlockMN * kBlockK;
    if constexpr (KMajor) {
      return int(layout(cute::make_coord(cute::Int<9>{}, cute::Int<0>{}, cute::Int<1>{}))) == 9 * 64 + stage &&
             int(layout(cute::make_coord(cute::Int<BlockMN - 1>{}, cute::Int<0>{}, cute::Int<0>{}))) ==
                 (BlockMN - 1) * 64;
    } else {
      return int(layout(cute::make_coord(cute::Int<64>{}, cute::Int<9>{}, cute::Int<1>{}))) ==
                 (kBlockK + 9) * 64 + stage &&
             int(layout(cute::make_coord(cute::Int<BlockMN - 64>{}, cute::Int<kBlockK - 1>{}, cute::Int<0>{}))) ==
                 ((BlockMN / 64 - 1) * kBlockK + kBlockK - 1) * 64;
    }
  }

  // Copies this warp's share of one k-tile of a K-major gathered operand
  // into the stage at `stage_addr`; `rows` holds the source addresses of its
  // slots' rows (row_addresses, once per tile: the rows stay over the K
  // loop). Slot s is 32 tile rows; each instruction moves 4 rows' 128 bytes
  // of the k-tile, every lane keeping one 16-byte chunk column. (Addressing
  // these from 32-bit rows, like copy_tokens, measured slower.)
  template <int Slots>
  CUTLASS_DEVICE static void copy_tile(uint32_t stage_addr, const RowGatherOperand& op, const uint64_t (&rows)[Slots],
                                       int first_slot, int lane, int k_tile) {
    constexpr uint32_t kRowBytes = kSwizzleRowElements * 2;  // 128
    constexpr int kChunksPerRow = kSwizzleRowElements / kChunkElements;  // 8
    constexpr int kRowsPerStep = kLanes / kChunksPerRow;  // 4
    const uint64_t fallback = reinterpret_cast<uint64_t>(op.source);  // read by no copy (size 0)
    const int chunk = lane % kChunksPerRow;
    const int sub = lane / kChunksPerRow;
    const int64_t col = static_cast<int64_t>(k_tile) * kBlockK + chunk * kChunkElements;
    const bool col_ok = col < op.cols;
    CUTLASS_PRAGMA_UNROLL
    for (int s = 0; s < Slots; ++s) {
      const uint32_t slot_addr = stage_addr + ((first_slot + s) * kLanes + sub) * kRowBytes;
      CUTLASS_PRAGMA_UNROLL
      for (int step = 0; step < kLanes / kRowsPerStep; ++step) {
        const uint64_t src = __shfl_sync(0xffffffffu, rows[s], step * kRowsPerStep + sub);
        const bool valid = src != 0 && col_ok;
        // The chunk's place in the SW128 row: its index XORed with the row's
        // position in its 1024-byte atom.
        const uint32_t row_addr = slot_addr + step * kRowsPerStep * kRowBytes;
        const uint32_t dst = row_addr + ((chunk ^ ((row_addr >> 7) & 7)) << 4);
        gather_copy16(dst, reinterpret_cast<const void*>(valid ? src + col * 2 : fallback), valid ? 16u : 0u);
      }
    }
  }

  // Copies this warp's tokens of one k-tile of an MN-major gathered operand
  // into the stage at `stage_addr`: BLK_MN columns from mn_start of each,
  // 128-byte line j of token t to buffer row j * BLK_K + t. `token_row` is
  // the source row of this lane's token, first_token + lane (or -1).
  //
  // Eight lanes take one line (a 16-byte chunk each), so an instruction
  // covers one line of four tokens, and where a lane's chunk lands in its
  // 128-byte row (the chunk index XORed with the row's place in its 8-row
  // swizzle atom) depends only on the instruction's parity. The addresses
  // are then a few registers plus constants, and one shuffle serves four
  // tokens' lines. (Broadcasting each token's 64-bit address to the warp, as
  // copy_tile does, took about 14 instructions per copy here: more than the
  // two producer warps can issue while the MMA drains a stage.)
  template <int BlockMN, bool FullWidth>
  CUTLASS_DEVICE static void copy_tokens(uint32_t stage_addr, const RowGatherOperand& op, int32_t token_row,
                                         int first_token, int lane, int mn_start) {
    constexpr uint32_t kRowBytes = kSwizzleRowElements * 2;               // 128
    constexpr int kChunksPerRow = kSwizzleRowElements / kChunkElements;   // 8
    constexpr int kTokensPerCopy = kLanes / kChunksPerRow;                // 4
    constexpr int kLines = BlockMN / kSwizzleRowElements;                 // per token
    constexpr uint32_t kLineStride = kBlockK * kRowBytes;
    const int token = lane / kChunksPerRow;  // this lane's token within a copy
    const int chunk = lane % kChunksPerRow;
    // first_token is a multiple of 8, so copy c's tokens sit at rows
    // 4 (c % 2) + token of their swizzle atom.
    uint32_t lane_dst[2];
    CUTLASS_PRAGMA_UNROLL
    for (int parity = 0; parity < 2; ++parity) {
      const int atom_row = parity * kTokensPerCopy + token;
      lane_dst[parity] = stage_addr + (first_token + token) * kRowBytes + ((chunk ^ atom_row) << 4);
    }
    const uint64_t source = reinterpret_cast<uint64_t>(op.source);
    const int64_t lane_col = static_cast<int64_t>(mn_start) + chunk * kChunkElements;
    const uint64_t lane_src = source + lane_col * 2;
    const uint64_t row_bytes = static_cast<uint64_t>(op.cols) * 2;
    const uint32_t row_limit = static_cast<uint32_t>(op.source_rows < INT32_MAX ? op.source_rows : INT32_MAX);
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < kLanes / kTokensPerCopy; ++c) {
      const int32_t row = __shfl_sync(0xffffffffu, token_row, c * kTokensPerCopy + token);
      const bool row_ok = static_cast<uint32_t>(row) < row_limit;  // -1 wraps past it
      const uint64_t src = lane_src + (row_ok ? static_cast<uint32_t>(row) : 0u) * row_bytes;
      const uint32_t dst = lane_dst[c % 2] + c * kTokensPerCopy * kRowBytes;
      CUTLASS_PRAGMA_UNROLL
      for (int line = 0; line < kLines; ++line) {
        const bool col_ok = FullWidth || lane_col + line * kSwizzleRowElements < op.cols;
        // A column past the row's end may be past the source's end: such a
        // copy (size 0, reads nothing) points at the source's start.
        const uint64_t from = FullWidth || col_ok ? src + line * kRowBytes : source;
        gather_copy16(dst + line * kLineStride, reinterpret_cast<const void*>(from), row_ok && col_ok ? 16u : 0u);
      }
    }
  }

  // One k-tile of a gathered operand into `stage`. The operand's layout says
  // which dimension the index runs along:
  //   K-major (fprop/dgrad A, x [M, K]): the index picks the tile's M rows,
  //     whose addresses `rows` holds; each k-tile copies 128 bytes of every
  //     row (4 rows per instruction).
  //   MN-major (wgrad A = dy^T, B = x; K = the group's tokens): the index
  //     picks the k-tile's 64 token rows (this lane's in token_row); each
  //     copies BLK_MN columns of its row from mn_start. The full-width copy
  //     skips the column checks.
  template <class SmemLayout, bool KMajor, int BlockMN, class Element, int Slots>
  CUTLASS_DEVICE static void copy_operand(Element* smem, const RowGatherOperand& op, const uint64_t (&rows)[Slots],
                                          int32_t token_row, int first_slot, int lane, int stage, int mn_start,
                                          int k_tile) {
    static_assert(rows_as_addressed<SmemLayout, KMajor, BlockMN>(), "unexpected shared-memory layout");
    const uint32_t stage_addr = cute::cast_smem_ptr_to_uint(smem) + stage * BlockMN * kBlockK * 2;
    if constexpr (KMajor) {
      copy_tile(stage_addr, op, rows, first_slot, lane, k_tile);
    } else if (mn_start + BlockMN <= op.cols) {
      copy_tokens<BlockMN, true>(stage_addr, op, token_row, first_slot * kLanes, lane, mn_start);
    } else {
      copy_tokens<BlockMN, false>(stage_addr, op, token_row, first_slot * kLanes, lane, mn_start);
    }
  }

  // Two producer warps share the gathered chunks: the mainloop warp (load,
  // part 0) and the auxiliary-load warp (load_auxiliary, part 1), which
  // CUTLASS's kernel runs over the same tiles and pipeline stages when the
  // dispatch policy asks for it (GatherPolicy). Each takes half the slots.
  static constexpr int kParts = 2;
  static constexpr int kSlotsA = (kAKMajor ? kBlockM : kBlockK) / kLanes / kParts;
  static constexpr int kSlotsB = (kBKMajor ? kBlockN : kBlockK) / kLanes / kParts;
  static_assert(kSlotsA >= 1 && kSlotsB >= 1);
  // An MN-major operand's k-tile is one token per lane of each warp.
  static_assert((kAKMajor || kSlotsA == 1) && (kBKMajor || kSlotsB == 1));
  // The two warps meet here each k-tile (64 threads), so that both warps'
  // pending cp.async arrivals are on the barrier before the leader arrives.
  static constexpr uint32_t kGatherBarrier = 7;  // a user named barrier (hardware id 15)

  // Completion of a stage: every lane of both warps arrives on its full
  // barrier with cp.async.mbarrier.arrive (pending until its copies land); the
  // warps then meet at kGatherBarrier, and only then does the leader arrive
  // with arrive_and_expect_tx, whose byte count covers only the TMA operand
  // (Params::tma_transaction_bytes, which the kernel gives the pipeline).
  template <class TensorA, class TensorB, class TensorMapA, class TensorMapB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void produce(int part, Params const& params, MainloopPipeline& pipeline, PipelineState smem_pipe_write,
                              cute::tuple<TensorA, TensorB, GroupRows> const& load_inputs,
                              cute::tuple<TensorMapA, TensorMapB> const* input_tensormaps, BlockCoord const& blk_coord,
                              KTileIterator k_tile_iter, int k_tile_count, uint32_t block_rank_in_cluster,
                              TensorStorage& shared_tensors) {
    using namespace cute;
    const int lane = static_cast<int>(threadIdx.x % kLanes);
    const bool leader = part == 0 && lane == 0;  // the pipeline's leader thread, which arrives with the TMA bytes
    const RowGatherOperand& gather_a = params.gather.a;
    const RowGatherOperand& gather_b = params.gather.b;
    const bool gathers_a = gather_a.index != nullptr;
    const bool gathers_b = kMayGatherB && gather_b.index != nullptr;
    const bool gathers = gathers_a || gathers_b;
    if (part != 0 && !gathers) return;  // nothing for the auxiliary warp

    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    constexpr uint32_t cluster_x = get<0>(typename DispatchPolicy::ClusterShape());
    const uint2 cluster_block = {block_rank_in_cluster % cluster_x, block_rank_in_cluster / cluster_x};
    auto block_tma_a = params.tma_load_a.get_slice(cluster_block.y);
    auto block_tma_b = params.tma_load_b.get_slice(cluster_block.x);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    Tensor tAgA = block_tma_a.partition_S(get<0>(load_inputs)(_, _, m_coord, _, l_coord));
    Tensor tAsA = block_tma_a.partition_D(sA);
    Tensor tBgB = block_tma_b.partition_S(get<1>(load_inputs)(_, _, n_coord, _, l_coord));
    Tensor tBsB = block_tma_b.partition_D(sB);

    // The base's multicast masks: A along the cluster's N, B along its M.
    uint16_t mcast_a = 0, mcast_b = 0;
    auto block_layout = Layout<typename DispatchPolicy::ClusterShape>{};
    if constexpr (is_same_v<typename Base::GmemTiledCopyA, SM90_TMA_LOAD_MULTICAST>) {
      for (int n = 0; n < size<1>(block_layout); ++n) mcast_a |= uint16_t(1) << block_layout(cluster_block.x, n, Int<0>{});
    }
    if constexpr (is_same_v<typename Base::GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>) {
      for (int m = 0; m < size<0>(block_layout); ++m) mcast_b |= uint16_t(1) << block_layout(m, cluster_block.y, Int<0>{});
    }

    const GroupRows rows = get<2>(load_inputs);
    const int m_start = static_cast<int>(m_coord) * kBlockM;
    const int n_start = static_cast<int>(n_coord) * kBlockN;
    const int first_a = part * kSlotsA, first_b = part * kSlotsB;
    // K-major operands keep their rows over the K loop: their addresses are
    // worked out once. MN-major ones take a new token per lane every k-tile,
    // whose index is loaded a k-tile ahead.
    int32_t rows_a[kSlotsA];
    int32_t rows_b[kSlotsB];
    uint64_t source_a[kSlotsA] = {};
    uint64_t source_b[kSlotsB] = {};
    const int first_k_tile = k_tile_count > 0 ? static_cast<int>(*k_tile_iter) : 0;
    if (gathers_a) {
      load_rows(gather_a, rows, (kAKMajor ? m_start : first_k_tile * kBlockK) + first_a * kLanes, lane, rows_a);
      if constexpr (kAKMajor) row_addresses(gather_a, rows_a, source_a);
    }
    if (gathers_b) {
      load_rows(gather_b, rows, (kBKMajor ? n_start : first_k_tile * kBlockK) + first_b * kLanes, lane, rows_b);
      if constexpr (kBKMajor) row_addresses(gather_b, rows_b, source_b);
    }

    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      const int k_tile = static_cast<int>(*k_tile_iter);
      int32_t token_a = -1, token_b = -1;  // MN-major: this lane's token row in this k-tile
      if constexpr (!kAKMajor) {
        if (gathers_a) {
          token_a = rows_a[0];
          load_rows(gather_a, rows, (k_tile + 1) * kBlockK + first_a * kLanes, lane, rows_a);
        }
      }
      if constexpr (!kBKMajor) {
        if (gathers_b) {
          token_b = rows_b[0];
          load_rows(gather_b, rows, (k_tile + 1) * kBlockK + first_b * kLanes, lane, rows_b);
        }
      }
      // Every lane waits for the stage to be free, without arriving yet.
      auto token = pipeline.producer_try_acquire(smem_pipe_write);
      while (token != cutlass::BarrierStatus::WaitDone) token = pipeline.producer_try_acquire(smem_pipe_write);
      auto* barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      if (gathers_a) {
        copy_operand<SmemLayoutA, kAKMajor, kBlockM>(shared_tensors.smem_A.data(), gather_a, source_a, token_a,
                                                     first_a, lane, stage, m_start, k_tile);
      }
      if (gathers_b) {
        copy_operand<SmemLayoutB, kBKMajor, kBlockN>(shared_tensors.smem_B.data(), gather_b, source_b, token_b,
                                                     first_b, lane, stage, n_start, k_tile);
      }
      if (gathers) {
        cutlass::arch::cpasync_barrier_arrive(barrier);
        cutlass::arch::NamedBarrier::sync(kParts * kLanes, kGatherBarrier);
      }
      if (part == 0) {
        pipeline.producer_acquire(smem_pipe_write, token);  // the leader arrives, expecting the TMA bytes
        if (leader && !gathers_a) {
          copy(params.tma_load_a.with(get<0>(*input_tensormaps), *barrier, mcast_a), tAgA(_, _, _, *k_tile_iter),
               tAsA(_, _, _, stage));
        }
        if (leader && !gathers_b) {
          copy(params.tma_load_b.with(get<1>(*input_tensormaps), *barrier, mcast_b), tBgB(_, _, _, *k_tile_iter),
               tBsB(_, _, _, stage));
        }
      }
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }

  template <class TensorA, class TensorB, class TensorMapA, class TensorMapB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB, GroupRows> const& load_inputs,
                           cute::tuple<TensorMapA, TensorMapB> const& input_tensormaps, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int, uint32_t block_rank_in_cluster,
                           TensorStorage& shared_tensors) {
    produce(0, params, pipeline, smem_pipe_write, load_inputs, &input_tensormaps, blk_coord, k_tile_iter,
            k_tile_count, block_rank_in_cluster, shared_tensors);
  }

  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load_auxiliary(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                                     cute::tuple<TensorA, TensorB, GroupRows> const& load_inputs,
                                     BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count, int,
                                     uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    using NoTensorMaps = cute::tuple<cute::TmaDescriptor*, cute::TmaDescriptor*>;
    produce(1, params, pipeline, smem_pipe_write, load_inputs, static_cast<NoTensorMaps const*>(nullptr),
            blk_coord, k_tile_iter, k_tile_count, block_rank_in_cluster, shared_tensors);
  }
};

}  // namespace moe_grouped::gemm::sm90
