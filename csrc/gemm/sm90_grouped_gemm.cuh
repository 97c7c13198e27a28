// SM90 grouped GEMMs on CUTLASS's ptr-array kernels, driven entirely from
// device memory: a one-block setup kernel turns m_splits into per-group
// problem shapes, pointers and strides in the workspace, and the persistent
// GEMM reads them there. The host only knows E, M, N and K.
//
// One GroupedGemm<...> is one compiled kernel: operand and output types, the
// GEMM kind (which fixes the layouts) and a tile configuration. The sm90_*.cu
// translation units instantiate the ones we ship and list them in a table.
// Design notes and measurements: docs/kernels.md.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/device_kernel.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include <type_traits>

#include "core/error.h"
#include "core/kernel_attributes.h"
#include "core/setup.cuh"
#include "core/workspace.h"
#include "gemm/grouped_gemm.h"
#include "gemm/sm90_prebuilt_store_epilogue.cuh"

namespace moe_grouped::gemm::sm90 {

using cute::_0;
using cute::_1;
using cute::_2;
using cute::_64;
using cute::_128;
using cute::_256;

// ---- type maps ---------------------------------------------------------

template <mg_dtype D>
struct ElementOf;
template <>
struct ElementOf<MG_BFLOAT16> { using type = cutlass::bfloat16_t; };
template <>
struct ElementOf<MG_FLOAT16> { using type = cutlass::half_t; };
template <>
struct ElementOf<MG_FLOAT32> { using type = float; };

template <TileConfig C>
struct TileTraits;
// The cooperative ptr-array kernel on a 128x256x64 tile, with a cluster. The
// epilogue stores the tile in pieces of EpilogueTile: CUTLASS's default is
// 128x32 (eight shared-memory round trips per tile); 128x64 halves them, at
// twice the epilogue's shared memory (wgrad, which reads C, then keeps three
// mainloop stages instead of four). heuristic.cpp says where that pays.
template <class ClusterShape, class EpilogueTileShape = cutlass::epilogue::collective::EpilogueTileAuto>
struct Coop128x256Traits {
  using Tile = cute::Shape<_128, _256, _64>;
  using Cluster = ClusterShape;
  using EpilogueTile = EpilogueTileShape;
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
template <>
struct TileTraits<TileConfig::kCoop128x256> : Coop128x256Traits<cute::Shape<_2, _1, _1>> {};
template <>
struct TileTraits<TileConfig::kCoop128x256NoCluster> : Coop128x256Traits<cute::Shape<_1, _1, _1>> {};
template <>
struct TileTraits<TileConfig::kCoop128x256Epi128x64>
    : Coop128x256Traits<cute::Shape<_2, _1, _1>, cute::Shape<_128, _64>> {};

// Layouts, per expert e with m_e tokens at row offset o_e (CUTLASS M x N x K):
//   fprop  M=m_e, N=n, K=k:  A = x[o_e:, :k] row-major, B = W_e^T (W_e [n, k]
//          row-major is a K-major "column-major" B), D = y[o_e:, :n].
//   dgrad  M=m_e, N=k, K=n:  A = dy[o_e:, :n] row-major, B = W_e as [n, k]
//          row-major (N-major B), D = dx[o_e:, :k].
//   wgrad  M=n, N=k, K=m_e:  A = dy_e^T (M-major), B = x_e (N-major),
//          C = D = dW_e [n, k] row-major. Groups with m_e = 0 get M = 0 (no
//          tiles; the kernel would otherwise store uninitialised
//          accumulators) and, without accumulation, a zero fill.
template <mg_gemm_kind Kind>
struct LayoutTraits;
template <>
struct LayoutTraits<MG_GEMM_FPROP> {
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::ColumnMajor;
};
template <>
struct LayoutTraits<MG_GEMM_DGRAD> {
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::RowMajor;
};
template <>
struct LayoutTraits<MG_GEMM_WGRAD> {
  using A = cutlass::layout::ColumnMajor;
  using B = cutlass::layout::RowMajor;
};

// ---- the kernel type ---------------------------------------------------

// The gathering mainloop (sm90_gather_mainloop.cuh, which the gathered
// kernels' translation units include; the others need only its name).
template <class Base>
struct GatherMainloop;

// The SwiGLU-backward dgrad epilogue (sm90_swiglu_backward_epilogue.cuh,
// which its translation unit includes; the others need only its name).
template <class Base, class Element>
struct SwigluBackwardEpilogue;

// Gathered: the mainloop may read A and (wgrad) B through a row index; the
// index pointers come with each call. SwigluBackward (dgrad only): the
// epilogue applies the fused experts path's weighted SwiGLU backward to the
// accumulators instead of storing D (the operands come with each call).
template <mg_gemm_kind Kind, mg_dtype Dtype, mg_dtype OutDtype, TileConfig Config, bool Gathered = false,
          bool SwigluBackward = false>
struct GroupedGemm {
  static_assert(!SwigluBackward || (Kind == MG_GEMM_DGRAD && OutDtype == Dtype && !Gathered),
                "the SwiGLU-backward epilogue is a 16-bit dgrad's, into its operand dtype");
  static constexpr mg_gemm_kind kKind = Kind;
  static constexpr bool kGathered = Gathered;
  static constexpr bool kSwigluBackward = SwigluBackward;
  static constexpr mg_dtype kDtype = Dtype;
  static constexpr mg_dtype kOutDtype = OutDtype;
  static constexpr TileConfig kConfig = Config;

  using Element = typename ElementOf<Dtype>::type;
  using ElementA = Element;  // the names the shared Workspace uses
  using ElementB = Element;
  using ElementBias = Element;
  using ElementD = typename ElementOf<OutDtype>::type;
  static constexpr bool kBlockScaled = false;  // no per-group scale pointers
  // Only wgrad reads C (dW itself, when accumulating); the others store only.
  using ElementC = std::conditional_t<Kind == MG_GEMM_WGRAD, ElementD, void>;
  using ElementAccumulator = float;
  using Tiles = TileTraits<Config>;
  using LayoutA = typename LayoutTraits<Kind>::A;
  using LayoutB = typename LayoutTraits<Kind>::B;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 16 / sizeof(Element);
  static constexpr int kAlignD = 16 / sizeof(ElementD);

  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using UnderlyingShape = typename ProblemShape::UnderlyingProblemShape;

  // fprop: D = acc + bias_e[n], the bias read through one pointer per group
  // (a NULL array means no bias). dgrad, wgrad: D = acc + beta * C.
  using BiasFusion = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::plus, ElementD, float,
                                             cutlass::FloatRoundStyle::round_to_nearest>,
      cutlass::epilogue::fusion::Sm90AccFetch,
      cutlass::epilogue::fusion::Sm90RowBroadcast<0, typename Tiles::Tile, Element*, float,
                                                  cute::Stride<_0, _1, int64_t>>>;
  using LinearFusion = cutlass::epilogue::fusion::LinearCombination<
      ElementD, float, std::conditional_t<std::is_void_v<ElementC>, ElementD, ElementC>, float>;
  using Fusion = std::conditional_t<Kind == MG_GEMM_FPROP, BiasFusion, LinearFusion>;

  using BuiltEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Tiles::Tile,
      typename Tiles::Cluster, typename Tiles::EpilogueTile,
      ElementAccumulator, float, ElementC, LayoutD*, kAlignD, ElementD, LayoutD*, kAlignD,
      typename Tiles::Epilogue, Fusion>::CollectiveOp;
  // D through one prebuilt tensor map per group (sm90_prebuilt_store_epilogue.cuh),
  // unless the SwiGLU backward stores everything itself.
  static constexpr bool kPrebuiltStore = !SwigluBackward;
  using CollectiveEpilogue = std::conditional_t<SwigluBackward, SwigluBackwardEpilogue<BuiltEpilogue, Element>,
                                                PrebuiltStoreEpilogue<BuiltEpilogue>>;

  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlignAB, Element,
      LayoutB*, kAlignAB, ElementAccumulator, typename Tiles::Tile, typename Tiles::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Tiles::Mainloop>::CollectiveOp;
  using CollectiveMainloop = std::conditional_t<Gathered, GatherMainloop<BuiltMainloop>, BuiltMainloop>;

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

// ---- workspace layout ----------------------------------------------------

// The per-group argument arrays followed by CUTLASS's own workspace; carved
// the same way for sizing (base == nullptr) and for use. Shared with the FP8
// block-scaled kernels (fp8_gemm/sm90_fp8_grouped_gemm.cuh), which also keep
// per-group scale pointers (G::kBlockScaled).
template <class G>
struct Workspace {
  int64_t* offsets = nullptr;  // [E + 1]
  typename G::UnderlyingShape* shapes = nullptr;
  const typename G::ElementA** ptr_a = nullptr;
  const typename G::ElementB** ptr_b = nullptr;
  const float** ptr_sfa = nullptr;  // block-scaled only
  const float** ptr_sfb = nullptr;  // block-scaled only
  typename G::ElementD** ptr_d = nullptr;  // also C for wgrad
  const typename G::ElementBias** ptr_bias = nullptr;
  typename G::StrideA* stride_a = nullptr;
  typename G::StrideB* stride_b = nullptr;
  typename G::StrideD* stride_d = nullptr;  // also C for wgrad
  cute::TmaDescriptor* store_descriptors = nullptr;  // [E], G::kPrebuiltStore only
  void* gemm = nullptr;
  size_t bytes = 0;
};

template <class G>
typename G::Gemm::Arguments sizing_arguments(int num_groups, int sm_count) {
  typename G::Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {num_groups, nullptr, nullptr};
  args.hw_info.sm_count = sm_count;
  return args;
}

template <class G>
Workspace<G> carve_workspace(void* base, int num_groups, int sm_count) {
  WorkspaceCarver carver(base);
  Workspace<G> w;
  w.offsets = carver.take<int64_t>(num_groups + 1);
  w.shapes = carver.take<typename G::UnderlyingShape>(num_groups);
  w.ptr_a = carver.take<const typename G::ElementA*>(num_groups);
  w.ptr_b = carver.take<const typename G::ElementB*>(num_groups);
  if constexpr (G::kBlockScaled) {
    w.ptr_sfa = carver.take<const float*>(num_groups);
    w.ptr_sfb = carver.take<const float*>(num_groups);
  }
  w.ptr_d = carver.take<typename G::ElementD*>(num_groups);
  if (G::kKind == MG_GEMM_FPROP) w.ptr_bias = carver.take<const typename G::ElementBias*>(num_groups);
  w.stride_a = carver.take<typename G::StrideA>(num_groups);
  w.stride_b = carver.take<typename G::StrideB>(num_groups);
  w.stride_d = carver.take<typename G::StrideD>(num_groups);
  if constexpr (G::kPrebuiltStore) w.store_descriptors = carver.take<cute::TmaDescriptor>(num_groups);
  w.gemm = carver.take<char>(G::Gemm::get_workspace_size(sizing_arguments<G>(num_groups, sm_count)));
  w.bytes = carver.bytes_used();
  return w;
}

template <class G>
size_t workspace_bytes(int num_groups, int sm_count) {
  return carve_workspace<G>(nullptr, num_groups, sm_count).bytes;
}

// ---- setup kernel --------------------------------------------------------
//
// One launch before the GEMM prepares everything it reads: block (0, 0)
// writes the groups' shapes, pointers and strides (the family's writer) and
// then, for G::kPrebuiltStore, each group's D map; for a wgrad that does not
// accumulate, every block also zeroes its share of dW_e for the groups
// without rows. (These were three launches: on an eager step each launch is
// host time, docs/host-overhead.md.)

// dW_e = base + e * stride_bytes, or ptrs[e].
struct GroupOutputs {
  const char* base;
  int64_t stride_bytes;
  const void* const* ptrs;

  __device__ void* of(int g) const {
    return const_cast<void*>(base != nullptr ? static_cast<const void*>(base + g * stride_bytes) : ptrs[g]);
  }
};

// The setup kernel's work after the groups' arguments.
template <class G>
struct SetupTail {
  // G::kPrebuiltStore: the GEMM's epilogue params (their template D map) and
  // where each group's map goes; descriptors NULL: no maps.
  std::conditional_t<G::kPrebuiltStore, typename G::CollectiveEpilogue::Params, char> epilogue;
  cute::TmaDescriptor* descriptors;
  // zero_vectors > 0: zero that many 16-byte vectors of each empty group's dW.
  GroupOutputs dw;
  int64_t zero_vectors;
};

// The setup kernel's grid: one block, or for the zero fill of a wgrad's
// empty groups (row y of blocks takes groups y, y + rows, ...; the blocks of
// a row split a group's dW) up to 16 x 8 blocks.
inline dim3 setup_grid(int64_t zero_vectors, int num_groups) {
  if (zero_vectors <= 0) return dim3(1, 1, 1);
  constexpr int64_t kBlocksPerGroup = 16, kGroupRows = 8;
  const int64_t blocks = (zero_vectors + kSetupThreads - 1) / kSetupThreads;
  return dim3(static_cast<unsigned>(blocks < kBlocksPerGroup ? blocks : kBlocksPerGroup),
              static_cast<unsigned>(num_groups < kGroupRows ? num_groups : kGroupRows), 1);
}

__device__ inline bool first_setup_block() { return blockIdx.x == 0 && blockIdx.y == 0; }

// Block (0, 0), after its writer: each group's D map, one warp per group.
template <class G>
__device__ void build_store_maps(const SetupTail<G>& tail, const typename G::UnderlyingShape* shapes,
                                 int num_groups) {
  if constexpr (G::kPrebuiltStore) {
    if (tail.descriptors == nullptr) return;
    constexpr int kWarps = kSetupThreads / 32;
    __shared__ alignas(128) cute::TmaDescriptor staged[kWarps];
    __syncthreads();  // the writer's shapes, D pointers and strides are in global memory
    const int warp = static_cast<int>(threadIdx.x) / 32;
    const int lane = static_cast<int>(threadIdx.x) % 32;
    for (int g = warp; g < num_groups; g += kWarps) {
      build_store_descriptor<typename G::CollectiveEpilogue>(tail.epilogue, shapes, g, tail.descriptors,
                                                             staged[warp], lane);
    }
  }
}

// Every block: zeroes its share of dW_e for the groups without rows (their
// GEMM has no tiles: M = 0). Each block scans m_splits itself, as the
// setup's writer does (the same clamped counts), so no block waits for
// another.
template <class SplitT, class G>
__device__ void zero_empty_groups(const SplitT* splits, int num_groups, int64_t total_rows, const SetupTail<G>& tail) {
  if (tail.zero_vectors <= 0) return;
  __shared__ int empty[kSetupThreads];
  __shared__ int num_empty;
  scan_split_chunks(splits, num_groups, total_rows, /*offsets=*/nullptr,
                    [&](int g, bool valid, int64_t, int64_t count) {
                      if (threadIdx.x == 0) num_empty = 0;
                      __syncthreads();
                      if (valid && count == 0 && g % static_cast<int>(gridDim.y) == static_cast<int>(blockIdx.y)) {
                        empty[atomicAdd(&num_empty, 1)] = g;
                      }
                      __syncthreads();
                      for (int i = 0; i < num_empty; ++i) {
                        auto* out = static_cast<uint4*>(tail.dw.of(empty[i]));
                        for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
                             v < tail.zero_vectors; v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
                          out[v] = make_uint4(0, 0, 0, 0);
                        }
                      }
                      __syncthreads();  // num_empty is read until here
                    });
}

template <class G>
struct SetupParams {
  const void* m_splits;
  int num_groups;
  int64_t total_rows;
  int n;
  int k;
  const typename G::Element* tokens;
  const typename G::Element* tokens_b;
  const char* weight_base;  // bytes; the element type is Element, or ElementD for wgrad
  int64_t weight_stride_bytes;
  const void* const* weight_ptrs;
  const typename G::Element* bias;
  typename G::ElementD* out;
  // A gathered operand's pointers name its source's first row: the mainloop
  // reads it through the index, not through these (they only fill the unused
  // tensor map, which must still hold an address inside the allocation).
  bool gather_a;
  bool gather_b;
  Workspace<G> w;
  SetupTail<G> tail;
};

// Block (0, 0): each group's shape, A, B and D pointers and strides.
template <class G, class SplitT>
__device__ void write_groups(const SetupParams<G>& p, const SplitT* splits) {
  using Element = typename G::Element;
  using ElementD = typename G::ElementD;
  scan_splits(splits, p.num_groups, p.total_rows, p.w.offsets, [&](int g, int64_t start, int64_t count) {
    const int m = static_cast<int>(count);
    const int n = p.n;
    const int k = p.k;
    const void* weight = p.weight_base != nullptr
                             ? static_cast<const void*>(p.weight_base + g * p.weight_stride_bytes)
                             : p.weight_ptrs[g];
    const int64_t a_start = p.gather_a ? 0 : start;
    const int64_t b_start = p.gather_b ? 0 : start;
    if constexpr (G::kKind == MG_GEMM_FPROP) {
      p.w.shapes[g] = {m, n, k};
      p.w.ptr_a[g] = p.tokens + a_start * k;
      p.w.ptr_b[g] = static_cast<const Element*>(weight);
      p.w.ptr_d[g] = p.out + start * n;
      if (p.bias != nullptr) p.w.ptr_bias[g] = p.bias + static_cast<int64_t>(g) * n;
      p.w.stride_a[g] = cutlass::make_cute_packed_stride(typename G::StrideA{}, {m, k, 1});
      p.w.stride_b[g] = cutlass::make_cute_packed_stride(typename G::StrideB{}, {n, k, 1});
      p.w.stride_d[g] = cutlass::make_cute_packed_stride(typename G::StrideD{}, {m, n, 1});
    } else if constexpr (G::kKind == MG_GEMM_DGRAD) {
      p.w.shapes[g] = {m, k, n};
      p.w.ptr_a[g] = p.tokens + a_start * n;
      p.w.ptr_b[g] = static_cast<const Element*>(weight);
      p.w.ptr_d[g] = p.out + start * k;
      p.w.stride_a[g] = cutlass::make_cute_packed_stride(typename G::StrideA{}, {m, n, 1});
      p.w.stride_b[g] = cutlass::make_cute_packed_stride(typename G::StrideB{}, {k, n, 1});
      p.w.stride_d[g] = cutlass::make_cute_packed_stride(typename G::StrideD{}, {m, k, 1});
    } else {
      // An empty reduction gets no tiles at all (M = 0); see LayoutTraits.
      p.w.shapes[g] = {m > 0 ? n : 0, k, m};
      p.w.ptr_a[g] = p.tokens + a_start * n;
      p.w.ptr_b[g] = p.tokens_b + b_start * k;
      p.w.ptr_d[g] = static_cast<ElementD*>(const_cast<void*>(weight));
      p.w.stride_a[g] = cutlass::make_cute_packed_stride(typename G::StrideA{}, {n, m, 1});
      p.w.stride_b[g] = cutlass::make_cute_packed_stride(typename G::StrideB{}, {k, m, 1});
      p.w.stride_d[g] = cutlass::make_cute_packed_stride(typename G::StrideD{}, {n, k, 1});
    }
  });
}

template <class G, class SplitT>
__global__ void __launch_bounds__(kSetupThreads) grouped_gemm_setup(const __grid_constant__ SetupParams<G> p) {
  const auto* splits = static_cast<const SplitT*>(p.m_splits);
  if (first_setup_block()) {
    write_groups<G>(p, splits);
    build_store_maps<G>(p.tail, p.w.shapes, p.num_groups);
  }
  zero_empty_groups(splits, p.num_groups, p.total_rows, p.tail);
}

// ---- launch --------------------------------------------------------------

// The GEMM kernel's shared memory limit, raised once per device.
template <class G>
mg_status prepare_kernel(int device) {
  return raise_shared_memory_once<cutlass::device_kernel<typename G::Kernel>>(
      device, static_cast<int>(G::Kernel::SharedStorageSize));
}

// Launches the GEMM kernel as CUTLASS's GemmUniversalAdapter::run does
// (grid, block, shared memory, and the cluster shape as a launch attribute),
// without the cudaFuncSetAttribute its cluster launcher repeats on every
// launch: prepare_kernel set the shared memory limit once, and clusters of at
// most 8 CTAs need no other attribute.
template <class G>
cudaError_t launch_kernel(typename G::Kernel::Params& params, cudaStream_t stream) {
  using Kernel = typename G::Kernel;
  using Cluster = typename Kernel::DispatchPolicy::ClusterShape;
  static_assert(cute::size(Cluster{}) <= 8, "a cluster of more than 8 CTAs needs the non-portable size attribute");
  const dim3 grid = G::Gemm::get_grid_shape(params);
  const dim3 block = Kernel::get_block_shape();
  const int smem = static_cast<int>(Kernel::SharedStorageSize);
  if constexpr (cute::size(Cluster{}) == 1) {
    cutlass::device_kernel<Kernel><<<grid, block, smem, stream>>>(params);
    return cudaGetLastError();
  } else {
    cudaLaunchAttribute cluster{};
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = cute::size<0>(Cluster{});
    cluster.val.clusterDim.y = cute::size<1>(Cluster{});
    cluster.val.clusterDim.z = cute::size<2>(Cluster{});
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = &cluster;
    config.numAttrs = 1;
    return cudaLaunchKernelEx(&config, cutlass::device_kernel<Kernel>, params);
  }
}

// Everything after the family's setup parameters, for the 16-bit and FP8
// kernels alike (`call`: a GroupedGemmCall or an Fp8GemmCall; `args` has the
// mainloop's arguments): the epilogue (fprop: D = acc + the group's bias, a
// NULL pointer array reading as zeros; dgrad: D = acc; wgrad: D = acc +
// beta * C with C = D = dW), CUTLASS's checks and params, then two launches:
// `launch_setup(tail, grid)` (the family's setup kernel with the D maps and
// the zero fill of the empty groups' dW, for a wgrad that does not
// accumulate) and the GEMM.
template <class G, class Call, class LaunchSetup>
mg_status finish_launch(typename G::Gemm::Arguments& args, const Workspace<G>& w, const Call& call, int device,
                        cudaStream_t stream, LaunchSetup&& launch_setup) {
  using ElementD = typename G::ElementD;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {call.num_groups, w.shapes, nullptr};
  args.epilogue.ptr_D = w.ptr_d;
  args.epilogue.dD = w.stride_d;
  if constexpr (G::kPrebuiltStore) {
    args.epilogue.store_descriptors = call.in_kernel_store_maps ? nullptr : w.store_descriptors;
  }
  if constexpr (G::kSwigluBackward) {
    using Element = typename G::Element;
    args.epilogue.swiglu = {static_cast<Element*>(call.swiglu.g), static_cast<Element*>(call.out),
                            call.swiglu.weights, call.swiglu.partials, call.swiglu.partial_cols, w.offsets};
  }
  if constexpr (G::kKind == MG_GEMM_FPROP) {
    using ElementBias = typename G::ElementBias;
    args.epilogue.thread = {{}, {call.bias != nullptr ? w.ptr_bias : nullptr, ElementBias(0), {}}, {}};
  } else {
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = (G::kKind == MG_GEMM_WGRAD && call.accumulate) ? 1.0f : 0.0f;
    if constexpr (G::kKind == MG_GEMM_WGRAD) {
      args.epilogue.ptr_C = const_cast<const ElementD**>(w.ptr_d);
      args.epilogue.dC = w.stride_d;
    }
  }
  // The tiles are walked along M, CUTLASS's default order for grouped
  // problems (no swizzle: the shapes are on the device), or along N where
  // heuristic.cpp's raster_along_n says the group's rows would otherwise be
  // read once per N tile. (wgrad along the shorter side of dW measured within
  // noise: docs/kernels.md, "Tile order".)
  if (call.raster_along_n) {
    using RasterOrder = decltype(args.scheduler.raster_order);
    args.scheduler.raster_order = RasterOrder::AlongN;
  }
  args.hw_info.device_id = device;
  args.hw_info.sm_count = call.sm_count;

  if (G::Gemm::can_implement(args) != cutlass::Status::kSuccess) {
    return fail(MG_ERROR_INTERNAL, "CUTLASS rejected the grouped GEMM arguments (E=%d, n=%lld, k=%lld)",
                call.num_groups, static_cast<long long>(call.n), static_cast<long long>(call.k));
  }
  cutlass::Status status = G::Kernel::initialize_workspace(args, w.gemm, stream);
  if (status != cutlass::Status::kSuccess) {
    return fail(MG_ERROR_INTERNAL, "CUTLASS could not initialise its grouped GEMM workspace: %s",
                cutlassGetStatusString(status));
  }
  typename G::Kernel::Params params = G::Kernel::to_underlying_arguments(args, w.gemm);

  SetupTail<G> tail{};
  if constexpr (G::kPrebuiltStore) {
    if (args.epilogue.store_descriptors != nullptr) {
      tail.epilogue = params.epilogue;
      tail.descriptors = w.store_descriptors;
    }
  }
  if (G::kKind == MG_GEMM_WGRAD && !call.accumulate) {
    tail.zero_vectors = call.n * call.k * static_cast<int64_t>(sizeof(ElementD)) / 16;
  }
  MG_RETURN_IF_ERROR(launch_setup(tail, setup_grid(tail.zero_vectors, call.num_groups)));
  MG_CUDA_RETURN(cudaGetLastError());
  MG_CUDA_RETURN(launch_kernel<G>(params, stream));
  return MG_OK;
}

template <class G>
mg_status run(const GroupedGemmCall& call, cudaStream_t stream) {
  using Element = typename G::Element;
  using ElementD = typename G::ElementD;
  int device = 0;
  MG_CUDA_RETURN(cudaGetDevice(&device));
  MG_RETURN_IF_ERROR(prepare_kernel<G>(device));

  Workspace<G> w = carve_workspace<G>(call.workspace, call.num_groups, call.sm_count);

  SetupParams<G> setup{};
  setup.m_splits = call.m_splits;
  setup.num_groups = call.num_groups;
  setup.total_rows = call.total_rows;
  setup.n = static_cast<int>(call.n);
  setup.k = static_cast<int>(call.k);
  setup.tokens = static_cast<const Element*>(call.tokens);
  setup.tokens_b = static_cast<const Element*>(call.tokens_b);
  setup.weight_base = static_cast<const char*>(call.weight.base);
  const size_t weight_elem = G::kKind == MG_GEMM_WGRAD ? sizeof(ElementD) : sizeof(Element);
  setup.weight_stride_bytes = call.weight.group_stride * static_cast<int64_t>(weight_elem);
  setup.weight_ptrs = reinterpret_cast<const void* const*>(call.weight.ptrs);
  setup.bias = static_cast<const Element*>(call.bias);
  setup.out = static_cast<ElementD*>(call.out);
  setup.gather_a = call.gather_a.index != nullptr;
  setup.gather_b = call.gather_b.index != nullptr;
  setup.w = w;

  typename G::Gemm::Arguments args{};
  if constexpr (G::kGathered) {
    typename G::CollectiveMainloop::GatherArguments gather;
    gather.a = {call.gather_a.index, call.tokens, call.gather_a.source_rows, call.gather_a.cols};
    gather.b = {call.gather_b.index, call.tokens_b, call.gather_b.source_rows, call.gather_b.cols};
    gather.group_offsets = w.offsets;
    args.mainloop = {{w.ptr_a, w.stride_a, w.ptr_b, w.stride_b}, gather};
  } else {
    args.mainloop = {w.ptr_a, w.stride_a, w.ptr_b, w.stride_b};
  }
  return finish_launch<G>(args, w, call, device, stream, [&](const SetupTail<G>& tail, dim3 grid) {
    setup.tail = tail;
    // wgrad's dW is the "weight" operand (see the setup's writer).
    setup.tail.dw = {setup.weight_base, setup.weight_stride_bytes, setup.weight_ptrs};
    if (call.splits_dtype == MG_INT32) {
      grouped_gemm_setup<G, int32_t><<<grid, kSetupThreads, 0, stream>>>(setup);
    } else {
      grouped_gemm_setup<G, int64_t><<<grid, kSetupThreads, 0, stream>>>(setup);
    }
    return MG_OK;
  });
}

template <class G>
constexpr KernelEntry entry() {
  return KernelEntry{G::kKind,     G::kDtype,          G::kOutDtype,        G::kConfig,
                     G::kGathered, G::kSwigluBackward, &workspace_bytes<G>, &run<G>};
}

}  // namespace moe_grouped::gemm::sm90
