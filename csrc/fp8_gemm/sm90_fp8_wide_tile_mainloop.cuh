// The consumer side of CUTLASS's SM90 ptr-array FP8 blockwise mainloop on a
// 128x256 tile, which asks less of shared memory per FLOP than 128x128 (at
// 128x128 shared memory cannot feed the tensor cores: docs/kernels.md, "FP8
// GEMMs"), for both scale layouts of every 128-deep K block:
//   fprop, dgrad: one A scale per row, one B scale per 128x128 block;
//   wgrad: one A scale per row and one B scale per column (both MN-major).
// CUTLASS's own mainloop cannot run the tile: its m64n256 temporary (128
// registers) next to the 128 accumulators does not fit in the consumers' 232,
// so here each warpgroup computes its 64x256 tile as two 64x128 halves through
// one 64-register temporary, each promoted as soon as its wgmmas finish, with
// CUTLASS's expressions (fprop/dgrad: row scale times block scale, then one
// FMA; wgrad: temporary times row scale times column scale, the column scales
// read from shared memory as the FMAs need them): the same bits as CUTLASS's
// 128x128 kernels.
// It also hides load_auxiliary(), the scale producer, to predicate the B
// scales of a tile's second 128 columns correctly (below). Everything else
// (TMA producer, pipeline, shared storage, arguments) is the CUTLASS
// collective's: this type derives from it, and the kernels call these
// functions on the collective they are given. Release order is the base's:
// mma() releases all but the last stage, mma_tail() the last.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/gemm/collective/collective_builder.hpp>

namespace moe_grouped::fp8_gemm::sm90 {

template <class Base>
struct WideTileMainloop : Base {
  using typename Base::ElementBlockScale;
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::SmemLayoutSFA;
  using typename Base::SmemLayoutSFB;
  using typename Base::TensorStorage;
  using typename Base::TileShape;

  static constexpr int kTileM = cute::size<0>(TileShape{});
  static constexpr int kTileN = cute::size<1>(TileShape{});
  static constexpr int kHalfN = kTileN / 2;
  static_assert(kTileM == 128 && kTileN == 256, "written for a 128x256 tile");
  // One B scale per 128 columns (fprop, dgrad) or per column (wgrad).
  static constexpr bool kColumnScales = Base::ScaleNsPerTile == kTileN;
  static_assert(Base::ScaleMsPerTile == kTileM && (Base::ScaleNsPerTile == 2 || kColumnScales),
                "one A scale per row; one B scale per 128 columns or per column");
  static_assert(Base::ScalePromotionInterval == 4, "K scale granularity must be one K tile (128)");

  // The base's two warpgroups along M, each on a 64 x kHalfN half.
  using HalfMma = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<typename Base::ElementA, typename Base::ElementB, ElementBlockScale,
                                 cute::Shape<cute::Int<kTileM>, cute::Int<kHalfN>, cute::_128>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::K>(),
      cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
  static_assert(cute::size(HalfMma{}) == cute::size(typename Base::TiledMma{}), "same warpgroups as the base");

  // The scale producer warp: each K block's A and B scales of the tile into
  // the stage's shared memory (cp.async), as CUTLASS's load_auxiliary, except
  // for the bounds check and the lanes that store B block scales (below).
  // CUTLASS drops the stride-0 modes (the 128 rows or columns one block scale
  // covers) from the scales but not from their coordinates, so it checks the
  // wrong coordinate from the second scale of a thread on: with two B blocks
  // per 256-column tile, a tile whose second 128 columns lie past N read the
  // next group's scales, and the last group's read past the end of the scale
  // tensor (compute-sanitizer memcheck). Here the coordinates drop the same
  // modes as the scales.
  template <class TensorA, class TensorB, class TensorSFA, class TensorSFB, class KTileIterator,
            class BlockCoord>
  CUTLASS_DEVICE void load_auxiliary(Params const&, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                                     cute::tuple<TensorA, TensorB, TensorSFA, TensorSFB> const& load_inputs,
                                     BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                                     int lane, uint32_t, TensorStorage& shared_tensors) {
    using namespace cute;
    using X = Underscore;
    const auto m_coord = get<0>(blk_coord), n_coord = get<1>(blk_coord), l_coord = get<3>(blk_coord);
    // The warp's 32 lanes along the tile's M or N extent, one scale per copy.
    const auto scale_copy = make_tiled_copy(typename Base::CopyAtomSFA{}, Layout<Shape<_32>>{}, Layout<Shape<_1>>{});
    // (scales, their coordinates, shared memory) of this thread, per K block;
    // `step` picks the tile's M or N extent.
    auto partition = [&](auto const& scales, auto* smem, auto smem_layout, auto step, int tile) {
      Tensor coords = make_identity_tensor(shape(scales.layout()));
      auto copy = scale_copy.get_slice(lane);
      return make_tuple(
          copy.partition_S(local_tile(scales, TileShape{}, make_coord(_, _, _), step)(_, _, tile, _, l_coord)),
          copy.partition_S(local_tile(coords, TileShape{}, make_coord(_, _, _), step)(_, _, tile, _, l_coord)),
          copy.partition_D(make_tensor(make_smem_ptr(smem), smem_layout)));  // (CPY,CPY_MN,CPY_K,k|PIPE)
    };
    auto a = partition(get<2>(load_inputs), shared_tensors.smem_SFA.data(), SmemLayoutSFA{},
                       Step<_1, X, _1>{}, m_coord);
    auto b = partition(get<3>(load_inputs), shared_tensors.smem_SFB.data(), SmemLayoutSFB{},
                       Step<X, _1, _1>{}, n_coord);
    auto copy_scales = [&](auto const& part, auto const& bounds, bool loads, int k_tile, int stage) {
      Tensor g = get<0>(part)(_, _, _, k_tile);
      Tensor c = get<1>(part)(_, _, _, k_tile);
      Tensor scales = filter_zeros(g);
      Tensor coords = make_tensor(c.data(), filter_zeros(c.layout(), g.stride()));
      Tensor in_bounds = make_tensor<bool>(shape(scales));
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(scales); ++i) in_bounds(i) = loads && elem_less(coords(i), bounds);
      copy_if(scale_copy, in_bounds, scales, filter_zeros(get<2>(part)(_, _, _, stage)));
    };
    const auto bounds_a = shape(get<2>(load_inputs).layout());
    const auto bounds_b = shape(get<3>(load_inputs).layout());
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      copy_scales(a, bounds_a, lane < Base::ScaleMsPerTile, *k_tile_iter, stage);
      // Per-column B scales are spread over the lanes; each lane's share of
      // block scales holds both of the tile's, so one lane copies them (CUTLASS
      // has two lanes store the same two values, which racecheck reports).
      copy_scales(b, bounds_b, lane < (kColumnScales ? Base::ScaleNsPerTile : 1), *k_tile_iter, stage);
      pipeline.producer_commit(smem_pipe_write, cutlass::arch::cpasync_barrier_arrive_noinc);
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors, Params const&) {
    using namespace cute;
    static_assert(is_rmem<FrgTensorC>::value, "the accumulators must be in registers");

    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});  // (BLK_M,BLK_K,PIPE)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});  // (BLK_N,BLK_K,PIPE)
    Tensor sB_halves = flat_divide(sB, Shape<Int<kHalfN>, Int<size<1>(SmemLayoutB{})>>{});  // (HALF,BLK_K,2,1,PIPE)
    Tensor sSFA = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFA.data()),
        make_layout(make_shape(shape<0>(SmemLayoutSFA{}), Int<kHalfN>{},
                               make_shape(shape<1>(SmemLayoutSFA{}), shape<2>(SmemLayoutSFA{}))),
                    make_stride(stride<0>(SmemLayoutSFA{}), _0{},
                                make_stride(stride<1>(SmemLayoutSFA{}), stride<2>(SmemLayoutSFA{})))));
    const ElementBlockScale* sfb = shared_tensors.smem_SFB.data();

    constexpr int kWarpGroups = size(HalfMma{}) / cutlass::NumThreadsPerWarpGroup;
    const Layout warp_group_layout = make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
    const int warp_group = __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    [[maybe_unused]] const uint32_t barrier_id = cutlass::canonical_warp_group_idx();

    HalfMma half_mma;
    auto thread_mma = half_mma.get_slice(warp_group_layout(warp_group));
    Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // (MMA,MMA_M,MMA_K,PIPE)
    Tensor tCrB0 = thread_mma.make_fragment_B(thread_mma.partition_B(sB_halves(_, _, _0{}, _0{}, _)));
    Tensor tCrB1 = thread_mma.make_fragment_B(thread_mma.partition_B(sB_halves(_, _, _1{}, _0{}, _)));
    Tensor tCsSFA = half_mma.get_slice(thread_idx).partition_C(sSFA);  // (MMA,MMA_M,MMA_N,(MMA_K,PIPE))
    Tensor tCrSFA = make_tensor_like<ElementBlockScale>(tCsSFA(_, _, _, _0{}));
    Tensor tCrScale = make_tensor_like<ElementBlockScale>(tCsSFA(_, _, _, _0{}));
    // wgrad: this thread's column scales of each half, (MMA,MMA_M,MMA_N,(BLK_K,PIPE)) like tCsSFA.
    auto column_scales = [&]() {
      if constexpr (kColumnScales) {
        Tensor sSFB = make_tensor(
            make_smem_ptr(sfb),
            make_layout(make_shape(Int<kTileM>{}, shape<0>(SmemLayoutSFB{}),
                                   make_shape(shape<1>(SmemLayoutSFB{}), shape<2>(SmemLayoutSFB{}))),
                        make_stride(_0{}, stride<0>(SmemLayoutSFB{}),
                                    make_stride(stride<1>(SmemLayoutSFB{}), stride<2>(SmemLayoutSFB{})))));
        Tensor halves = flat_divide(sSFB, Shape<Int<kTileM>, Int<kHalfN>>{});  // (BLK_M,HALF,1,2,(BLK_K,PIPE))
        auto thread = half_mma.get_slice(thread_idx);
        return make_tuple(thread.partition_C(halves(_, _, _0{}, _0{}, _)),
                          thread.partition_C(halves(_, _, _0{}, _1{}, _)));
      } else {
        return make_tuple(0, 0);  // fprop/dgrad: one scale per half, read in half_step
      }
    }();

    Tensor part = partition_fragment_C(half_mma, Shape<Int<kTileM>, Int<kHalfN>>{});
    static_assert(decltype(size(part))::value * 2 == decltype(size(accum))::value, "two halves make the tile");

    auto half_step = [&](auto half, auto const& tCrB, auto const& tCsSFB, ElementBlockScale scale_b,
                         int stage) __attribute__((always_inline)) {
      half_mma.accumulate_ = GMMA::ScaleOut::Zero;
      warpgroup_fence_operand(part);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
        cute::gemm(half_mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), part);
        half_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      constexpr int kOffset = decltype(half)::value * decltype(size(part))::value;
      // The promotion in CUTLASS's expressions, so that results are the same
      // bits as its 128x128 kernels: wgrad, temporary * row scale * column
      // scale; fprop/dgrad, temporary * (row scale * the half's B scale), the
      // product formed while the wgmmas run.
      if constexpr (!kColumnScales) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(filter_zeros(tCrSFA)); ++i) {
          filter_zeros(tCrScale)(i) = filter_zeros(tCrSFA)(i) * scale_b;
        }
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(part);
      warpgroup_fence_operand(accum);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(part); ++i) {
        if constexpr (kColumnScales) {
          accum(kOffset + i) += part(i) * tCrSFA(i) * tCsSFB(_, _, _, make_coord(_0{}, stage))(i);
        } else {
          accum(kOffset + i) += part(i) * tCrScale(i);
        }
      }
      warpgroup_fence_operand(accum);
    };

    clear(accum);
    PipelineState smem_pipe_release = smem_pipe_read;
    CUTLASS_PRAGMA_NO_UNROLL
    for (int k = 0; k < k_tile_count; ++k) {
      pipeline.consumer_wait(smem_pipe_read);
      const int stage = smem_pipe_read.index();
      ++smem_pipe_read;
      // fprop/dgrad: every scale of the stage into registers before the first
      // wgmma is issued, so that no warp reads the stage after its wgmmas.
      copy(tCsSFA(_, _, _, make_coord(_0{}, stage)), tCrSFA);
      ElementBlockScale scale_b0 = 0, scale_b1 = 0;
      if constexpr (!kColumnScales) {
        scale_b0 = sfb[SmemLayoutSFB{}(0, 0, stage)];
        scale_b1 = sfb[SmemLayoutSFB{}(Int<kHalfN>{}, 0, stage)];
      }
      half_step(_0{}, tCrB0, get<0>(column_scales), scale_b0, stage);
      half_step(_1{}, tCrB1, get<1>(column_scales), scale_b1, stage);
      // Only a few threads signal the producers. As in CUTLASS's mainloop,
      // each warp reads the stage's scales before its wgmmas, and the
      // warpgroup's second wgmmas finish only once all four warps issued them.
      // wgrad reads its column scales later, as the FMAs use them, so there
      // all four warps meet before any release, mma_tail()'s included.
      if constexpr (kColumnScales) {
        cutlass::arch::NamedBarrier::arrive_and_wait(cutlass::NumThreadsPerWarpGroup, barrier_id);
      }
      if (k + 1 < k_tile_count) {
        pipeline.consumer_release(smem_pipe_release);
        ++smem_pipe_release;
      }
    }
  }
};

}  // namespace moe_grouped::fp8_gemm::sm90
