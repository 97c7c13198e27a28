// SM90 FP8 grouped GEMMs with block scaling, on CUTLASS's ptr-array
// "FP8 blockwise" mainloop: fp8 wgmma into fp32 registers, promoted with the
// A and B block scales at every 128-deep K block. Like the 16-bit kernels
// (gemm/sm90_grouped_gemm.cuh) they are driven entirely from device memory:
// a one-block setup kernel turns m_splits into per-group shapes, data and
// scale pointers and strides in the workspace. Hopper's fp8 wgmma reads both
// operands K-major, so every operand here is K-major (A row-major, B
// "column-major"), and the quantizers lay the data out that way.
// Design notes and measurements: docs/kernels.md, "FP8 GEMMs".
#pragma once

#include <cutlass/detail/blockwise_scale_layout.hpp>

#include "fp8_gemm/fp8_gemm.h"
#include "fp8_gemm/sm90_fp8_wide_tile_mainloop.cuh"
#include "gemm/sm90_grouped_gemm.cuh"

namespace moe_grouped::fp8_gemm::sm90 {

using cute::_1;
using cute::_2;
using cute::_128;
using gemm::sm90::ElementOf;

template <mg_dtype D>
struct Fp8ElementOf;
template <>
struct Fp8ElementOf<MG_FLOAT8_E4M3> { using type = cutlass::float_e4m3_t; };
template <>
struct Fp8ElementOf<MG_FLOAT8_E5M2> { using type = cutlass::float_e5m2_t; };

// Layouts per expert e with m_e tokens at row offset o_e (CUTLASS M x N x K):
//   fprop  M=m_e, N=n, K=k:  A = xq[o_e:, :k], scales xs[o_e:, :] (1 x 128,
//          K-major, ceil(k/128) per row); B = Wq_e [n, k], scales
//          [ceil(n/128), ceil(k/128)] (128 x 128, K-major).
//   dgrad  M=m_e, N=k, K=n:  A = dyq[o_e:, :n], scales [m, ceil(n/128)];
//          B = WqT_e [k, n], scales [ceil(k/128), ceil(n/128)].
//   wgrad  M=n, N=k, K=m_e:  A = dyT[:, p_e:] [n, m_e] with leading dimension
//          padded_rows, scales [ceil(m_e/128), n] at block row b_e (1 x 128
//          along the tokens, MN-major); B = xT[:, p_e:] [k, m_e], scales
//          [ceil(m_e/128), k] at b_e. p_e and b_e: see scan_splits_columnwise.
// CUTLASS derives each group's scale layout from its problem shape, packed;
// the layouts above are exactly those packed layouts.
//
// Scale granularity (M, N, K) and majorness per kind. fprop and dgrad read
// row-wise activation scales (one per row per 128 columns: K-major) and
// 128x128 weight scales; wgrad reads column-wise scales of both operands
// (one per column per 128 tokens: MN-major). SFA and SFB share a majorness,
// which is what CUTLASS's SM90 shared-memory scale layout assumes.
template <mg_gemm_kind Kind>
struct ScaleTraits {
  static constexpr auto kMajor = cute::GMMA::Major::K;
  using Config = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, kMajor, kMajor>;
};
template <>
struct ScaleTraits<MG_GEMM_WGRAD> {
  static constexpr auto kMajor = cute::GMMA::Major::MN;
  using Config = cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, 128, kMajor, kMajor>;
};

// Cooperative and narrow: two consumer warpgroups share one tile (128x256 and
// 128x128: see kWideTile below).
//
// CUTLASS's mainloop waits for each K block's wgmmas before promoting them
// with the scales. For wgrad that promotion costs real time, but none of the
// ways of hiding it behind tensor-core work that were measured gained
// (docs/kernels.md, "FP8 GEMMs"): its shared-memory loads and FP32 work slow
// the wgmmas running beside them, the warpgroup's own or the other's, about
// as much as they save.
template <Fp8Schedule S>
struct ScheduleTraits;
template <>
struct ScheduleTraits<Fp8Schedule::kCooperative> {
  using Tile = cute::Shape<_128, _128, _128>;
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
template <>
struct ScheduleTraits<Fp8Schedule::kNarrow> : ScheduleTraits<Fp8Schedule::kCooperative> {};

// ---- the kernel type ---------------------------------------------------

template <mg_gemm_kind Kind, mg_dtype ADtype, mg_dtype OutDtype,
          Fp8Schedule Schedule = Fp8Schedule::kCooperative>
struct Fp8GroupedGemm {
  static constexpr mg_gemm_kind kKind = Kind;
  static constexpr mg_dtype kADtype = ADtype;
  static constexpr mg_dtype kOutDtype = OutDtype;
  static constexpr Fp8Schedule kSchedule = Schedule;

  using ElementA = typename Fp8ElementOf<ADtype>::type;
  using ElementB = cutlass::float_e4m3_t;  // weights and activations are E4M3
  using ElementD = typename ElementOf<OutDtype>::type;
  using ElementBias = cutlass::bfloat16_t;
  using ElementC = std::conditional_t<Kind == MG_GEMM_WGRAD, ElementD, void>;
  using ElementAccumulator = float;
  static constexpr bool kBlockScaled = true;  // per-group scale pointers in the Workspace
  // D through CUTLASS's per-CTA maps, rewritten in the kernel at each change of
  // group: the 16-bit kernels' prebuilt per-group maps
  // (gemm/sm90_prebuilt_store_epilogue.cuh) made the cooperative FP8
  // fprop/dgrad slower (docs/kernels.md, "Store maps").
  static constexpr bool kPrebuiltStore = false;
  static constexpr bool kSwigluBackward = false;  // no SwiGLU-backward epilogue (finish_launch)
  // Cooperative: 128x256 tiles through WideTileMainloop, at least as fast as
  // the 128x128 CUTLASS mainloop where N fills the pairs of 256-column tiles
  // (fp8_gemm_api.cpp). Narrow (wgrad, dgrad): CUTLASS's mainloop on 128x128. docs/kernels.md, "FP8 GEMMs".
  static constexpr bool kWideTile = Schedule == Fp8Schedule::kCooperative;
  using Tile = std::conditional_t<kWideTile, cute::Shape<_128, cute::_256, _128>,
                                  typename ScheduleTraits<Schedule>::Tile>;
  // Pairs sharing the A tile (TMA multicast of A); 2x2 and 2x1 clusters
  // measured no better (docs/kernels.md, "FP8 GEMMs").
  using Cluster = cute::Shape<_1, _2, _1>;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 16;
  static constexpr int kAlignD = 16 / sizeof(ElementD);

  using ScaleConfig = typename ScaleTraits<Kind>::Config;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using UnderlyingShape = typename ProblemShape::UnderlyingProblemShape;

  // fprop: D = acc + bias_e[n] (one bias pointer per group, a NULL array
  // reads as zeros); dgrad, wgrad: D = acc + beta * C.
  using BiasFusion = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::plus, ElementD, float,
                                             cutlass::FloatRoundStyle::round_to_nearest>,
      cutlass::epilogue::fusion::Sm90AccFetch,
      cutlass::epilogue::fusion::Sm90RowBroadcast<0, Tile, ElementBias*, float,
                                                  cute::Stride<cute::_0, _1, int64_t>>>;
  using LinearFusion = cutlass::epilogue::fusion::LinearCombination<
      ElementD, float, std::conditional_t<std::is_void_v<ElementC>, ElementD, ElementC>, float>;
  using Fusion = std::conditional_t<Kind == MG_GEMM_FPROP, BiasFusion, LinearFusion>;

  // fprop and dgrad store their 128x256 tile as four 128x64 pieces through two
  // buffers rather than CUTLASS's default eight 128x32 pieces, fewer of which
  // wait for an earlier piece's store to drain: part of what every tile costs
  // whatever its K, which counts most at a short K. wgrad keeps the default:
  // with its C buffers growing with the pieces it measured no faster into
  // bf16, and into fp32 it would lose two mainloop stages. docs/kernels.md, "FP8 GEMMs".
  using EpilogueTile = std::conditional_t<kWideTile && Kind != MG_GEMM_WGRAD, cute::Shape<_128, cute::_64>,
                                          cutlass::epilogue::collective::EpilogueTileAuto>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      EpilogueTile, ElementAccumulator, float, ElementC,
      LayoutD*, kAlignD, ElementD, LayoutD*, kAlignD,
      typename ScheduleTraits<Schedule>::Epilogue, Fusion>::CollectiveOp;

  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA,
      cute::tuple<LayoutA*, LayoutSFA*>, kAlignAB, ElementB, cute::tuple<LayoutB*, LayoutSFB*>,
      kAlignAB, ElementAccumulator, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename ScheduleTraits<Schedule>::Mainloop>::CollectiveOp;
  using CollectiveMainloop = std::conditional_t<kWideTile, WideTileMainloop<BuiltMainloop>, BuiltMainloop>;

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

// ---- workspace layout: gemm/sm90_grouped_gemm.cuh's, with the scale pointers

using gemm::sm90::carve_workspace;
using gemm::sm90::Workspace;
using gemm::sm90::workspace_bytes;

// ---- setup kernel --------------------------------------------------------

template <class G>
struct SetupParams {
  const void* m_splits;
  int num_groups;
  int64_t total_rows;
  int64_t padded_rows;  // wgrad: leading dimension of the column-wise operands
  int n;
  int k;
  const typename G::ElementA* a;
  const float* a_scale;
  const typename G::ElementB* b;
  const float* b_scale;
  const char* dw_base;  // wgrad: dW_e = dw_base + e * dw_stride_bytes, or dw_ptrs[e]
  int64_t dw_stride_bytes;
  const void* const* dw_ptrs;
  const typename G::ElementBias* bias;
  typename G::ElementD* out;
  Workspace<G> w;
  gemm::sm90::SetupTail<G> tail;
};

template <class G>
__device__ void write_row_major_group(const SetupParams<G>& p, int g, int64_t start, int m) {
  // fprop: (M, N, K) = (m, n, k) reading x; dgrad: (m, k, n) reading dy.
  const bool fprop = G::kKind == MG_GEMM_FPROP;
  const int gemm_n = fprop ? p.n : p.k;
  const int gemm_k = fprop ? p.k : p.n;
  const int64_t scale_cols = (gemm_k + 127) / 128;
  const int64_t b_scale_rows = (gemm_n + 127) / 128;
  p.w.shapes[g] = {m, gemm_n, gemm_k};
  p.w.ptr_a[g] = p.a + start * gemm_k;
  p.w.ptr_sfa[g] = p.a_scale + start * scale_cols;
  p.w.ptr_b[g] = p.b + static_cast<int64_t>(g) * gemm_n * gemm_k;
  p.w.ptr_sfb[g] = p.b_scale + static_cast<int64_t>(g) * b_scale_rows * scale_cols;
  p.w.ptr_d[g] = p.out + start * gemm_n;
  if constexpr (G::kKind == MG_GEMM_FPROP) {
    if (p.bias != nullptr) p.w.ptr_bias[g] = p.bias + static_cast<int64_t>(g) * p.n;
  }
  p.w.stride_a[g] = cutlass::make_cute_packed_stride(typename G::StrideA{}, {m, gemm_k, 1});
  p.w.stride_b[g] = cutlass::make_cute_packed_stride(typename G::StrideB{}, {gemm_n, gemm_k, 1});
  p.w.stride_d[g] = cutlass::make_cute_packed_stride(typename G::StrideD{}, {m, gemm_n, 1});
}

// Block (0, 0): each group's shape, pointers (scales too) and strides.
template <class G, class SplitT>
__device__ void write_groups(const SetupParams<G>& p, const SplitT* splits) {
  if constexpr (G::kKind != MG_GEMM_WGRAD) {
    scan_splits(splits, p.num_groups, p.total_rows, p.w.offsets,
                [&](int g, int64_t start, int64_t count) {
                  write_row_major_group(p, g, start, static_cast<int>(count));
                });
  } else {
    scan_splits_columnwise(
        splits, p.num_groups, p.total_rows, p.w.offsets,
        [&](int g, int64_t, int64_t count, ColumnwiseStart at) {
          const int m = static_cast<int>(count);
          // An empty reduction gets no tiles at all (M = 0): the kernel would
          // otherwise store uninitialised accumulators.
          p.w.shapes[g] = {m > 0 ? p.n : 0, p.k, m};
          p.w.ptr_a[g] = p.a + at.padded;
          p.w.ptr_b[g] = p.b + at.padded;
          p.w.ptr_sfa[g] = p.a_scale + at.block * p.n;
          p.w.ptr_sfb[g] = p.b_scale + at.block * p.k;
          p.w.ptr_d[g] = static_cast<typename G::ElementD*>(const_cast<void*>(
              p.dw_base != nullptr
                  ? static_cast<const void*>(p.dw_base + g * p.dw_stride_bytes)
                  : p.dw_ptrs[g]));
          // Row-major A [n, m] and K-major B [k, m], both with leading
          // dimension padded_rows (not m: the groups share one buffer).
          typename G::StrideA stride_a{};
          cute::get<0>(stride_a) = p.padded_rows;
          p.w.stride_a[g] = stride_a;
          typename G::StrideB stride_b{};
          cute::get<0>(stride_b) = p.padded_rows;
          p.w.stride_b[g] = stride_b;
          p.w.stride_d[g] =
              cutlass::make_cute_packed_stride(typename G::StrideD{}, {p.n, p.k, 1});
        });
  }
}

// One launch before the GEMM (gemm/sm90_grouped_gemm.cuh's setup kernel, with
// this family's writer; no prebuilt D maps here).
template <class G, class SplitT>
__global__ void __launch_bounds__(kSetupThreads) fp8_gemm_setup(const __grid_constant__ SetupParams<G> p) {
  const auto* splits = static_cast<const SplitT*>(p.m_splits);
  if (gemm::sm90::first_setup_block()) write_groups<G>(p, splits);
  gemm::sm90::zero_empty_groups(splits, p.num_groups, p.total_rows, p.tail);
}

// ---- launch --------------------------------------------------------------

template <class G>
mg_status run(const Fp8GemmCall& call, cudaStream_t stream) {
  using ElementD = typename G::ElementD;
  int device = 0;
  MG_CUDA_RETURN(cudaGetDevice(&device));
  MG_RETURN_IF_ERROR(gemm::sm90::prepare_kernel<G>(device));

  Workspace<G> w = carve_workspace<G>(call.workspace, call.num_groups, call.sm_count);

  SetupParams<G> setup{};
  setup.m_splits = call.m_splits;
  setup.num_groups = call.num_groups;
  setup.total_rows = call.total_rows;
  setup.padded_rows = columnwise_padded_rows(call.total_rows, call.num_groups);
  setup.n = static_cast<int>(call.n);
  setup.k = static_cast<int>(call.k);
  setup.a = static_cast<const typename G::ElementA*>(call.a.data);
  setup.a_scale = call.a.scale_inv;
  setup.b = static_cast<const typename G::ElementB*>(call.b.data);
  setup.b_scale = call.b.scale_inv;
  setup.dw_base = static_cast<const char*>(call.dw.base);
  setup.dw_stride_bytes = call.dw.group_stride * static_cast<int64_t>(sizeof(ElementD));
  setup.dw_ptrs = reinterpret_cast<const void* const*>(call.dw.ptrs);
  setup.bias = static_cast<const typename G::ElementBias*>(call.bias);
  setup.out = static_cast<ElementD*>(call.out);
  setup.w = w;

  typename G::Gemm::Arguments args{};
  // The per-group scale layouts are derived from the problem shapes inside
  // the kernel; the layout arrays are not read.
  args.mainloop = {w.ptr_a, w.stride_a, w.ptr_b, w.stride_b, w.ptr_sfa, nullptr, w.ptr_sfb, nullptr};
  return gemm::sm90::finish_launch<G>(
      args, w, call, device, stream, [&](const gemm::sm90::SetupTail<G>& tail, dim3 grid) {
        setup.tail = tail;
        setup.tail.dw = {setup.dw_base, setup.dw_stride_bytes, setup.dw_ptrs};
        if (call.splits_dtype == MG_INT32) {
          fp8_gemm_setup<G, int32_t><<<grid, kSetupThreads, 0, stream>>>(setup);
        } else {
          fp8_gemm_setup<G, int64_t><<<grid, kSetupThreads, 0, stream>>>(setup);
        }
        return MG_OK;
      });
}

template <class G>
constexpr Fp8KernelEntry entry() {
  return Fp8KernelEntry{G::kKind,          G::kADtype, G::kOutDtype,
                        G::kSchedule,      &workspace_bytes<G>, &run<G>};
}

}  // namespace moe_grouped::fp8_gemm::sm90
