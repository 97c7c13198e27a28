// The ptr-array epilogue with its D tensor maps built before the GEMM, one per
// group, instead of rewritten inside the kernel at every change of group.
//
// CUTLASS's ptr-array epilogue keeps one D tensor map per CTA (per consumer
// warpgroup) in global memory. When a CTA's next tile belongs to another
// group, the consumer warpgroup first waits for every TMA store of the
// previous tile (the map it is about to overwrite is still in use), then
// rewrites and fences the map, and only then starts the next tile's MMAs;
// with fine-grained experts that happens at almost every tile. With one
// read-only map per group, written by the setup kernel before the GEMM, the
// stores of one tile overlap the next tile's MMAs as in a plain GEMM; the
// results are bitwise the same. Everything else (C loads for wgrad's
// accumulation, the fusion callbacks, the store itself) is the wrapped
// epilogue's. Measurements: docs/kernels.md, "Store maps".
#pragma once

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

namespace moe_grouped::gemm::sm90 {

template <class Base>
struct PrebuiltStoreEpilogue : Base {
  // store_descriptors[g]: group g's D map, from build_store_descriptor.
  struct Arguments : Base::Arguments {
    cute::TmaDescriptor const* store_descriptors = nullptr;
  };
  struct Params : Base::Params {
    cute::TmaDescriptor const* store_descriptors = nullptr;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    Params params;
    static_cast<typename Base::Params&>(params) = Base::to_underlying_arguments(problem_shape, args, workspace);
    params.store_descriptors = args.store_descriptors;
    return params;
  }

  CUTLASS_HOST_DEVICE
  PrebuiltStoreEpilogue(Params const& params, typename Base::TensorStorage& shared_tensors)
      : Base(params, shared_tensors), descriptors_(params.store_descriptors) {}

  // With the maps, the kernel's per-CTA D map is never rewritten or fenced
  // (C's, IsLoad, still is). Without them (store_descriptors NULL, kept for
  // A/B measurements) every call goes to CUTLASS's epilogue as it is.
  template <bool IsLoad, class... Args>
  CUTLASS_DEVICE void tensormaps_perform_update(Args&&... args) {
    if (IsLoad || descriptors_ == nullptr) {
      Base::template tensormaps_perform_update<IsLoad>(static_cast<Args&&>(args)...);
    }
  }
  template <bool IsLoad, class... Args>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(Args&&... args) {
    if (IsLoad || descriptors_ == nullptr) {
      Base::template tensormaps_cp_fence_release<IsLoad>(static_cast<Args&&>(args)...);
    }
  }
  template <bool IsLoad>
  CUTLASS_DEVICE void tensormaps_fence_acquire(cute::TmaDescriptor const* tensormap) {
    if (IsLoad || descriptors_ == nullptr) Base::template tensormaps_fence_acquire<IsLoad>(tensormap);
  }

  // Stores through the tile's group's map (the tile coordinate's L is the group).
  template <class LoadPipeline, class LoadState, class StorePipeline, class StoreState, class ProblemShapeMNKL,
            class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout, class TiledMma,
            class TensorStorage, class TensorMapD>
  CUTLASS_DEVICE auto store(LoadPipeline load_pipeline, LoadState load_state, StorePipeline store_pipeline,
                            StoreState store_state, ProblemShapeMNKL problem_shape, TileShapeMNK tile_shape,
                            TileCoordMNKL tile_coord, cute::Tensor<AccEngine, AccLayout> accumulators,
                            TiledMma tiled_mma, int thread_idx, TensorStorage& shared_tensors,
                            TensorMapD const& cta_map, int subtile_idx = -1) {
    if (descriptors_ == nullptr) {
      return Base::store(load_pipeline, load_state, store_pipeline, store_state, problem_shape, tile_shape,
                         tile_coord, accumulators, tiled_mma, thread_idx, shared_tensors, cta_map, subtile_idx);
    }
    const int group = static_cast<int>(cute::get<3>(tile_coord));
    cute::TmaDescriptor const* descriptor = descriptors_ + group;
    // The maps were written through the generic proxy by the setup kernel.
    if (group != acquired_group_) {
      cute::tma_descriptor_fence_acquire(descriptor);
      acquired_group_ = group;
    }
    return Base::store(load_pipeline, load_state, store_pipeline, store_state, problem_shape, tile_shape, tile_coord,
                       accumulators, tiled_mma, thread_idx, shared_tensors, descriptor, subtile_idx);
  }

 private:
  cute::TmaDescriptor const* descriptors_;
  int acquired_group_ = -1;
};

// Group g's D map, built by one warp (lane 0 computes, the whole warp
// copies): the epilogue's template D map (from its params) with the group's
// address, shape (M_g, N) and strides -- the fields CUTLASS's in-kernel
// update replaces, computed the same way. Groups without rows get a one-row
// shape: no tile reads their map. `staged` is this warp's 128-byte-aligned
// shared slot; the setup kernel calls this once the groups' shapes, D
// pointers and strides are in global memory.
template <class Epilogue, class ProblemShapeMNK>
CUTLASS_DEVICE void build_store_descriptor(typename Epilogue::Params const& params, ProblemShapeMNK const* shapes,
                                           int g, cute::TmaDescriptor* descriptors, cute::TmaDescriptor& staged,
                                           int lane) {
  using ElementD = typename Epilogue::ElementD;
  if (lane == 0) {
    staged = *params.tma_store_d.get_tma_descriptor();
    const uint32_t m = static_cast<uint32_t>(cute::get<0>(shapes[g]));
    const uint32_t n = static_cast<uint32_t>(cute::get<1>(shapes[g]));
    cute::array<uint32_t, 5> dims = {1, 1, 1, 1, 1};
    cute::array<uint64_t, 5> strides = {0, 0, 0, 0, 0};
    auto d = cute::make_tensor(static_cast<ElementD const*>(nullptr),
                               cute::make_layout(cute::make_shape(m > 0 ? m : 1u, n, cute::Int<1>{}),
                                                 params.dD[g]));
    cute::detail::fill_tma_gmem_shape_stride(params.tma_store_d, d, dims, strides);
    for (uint64_t& stride : strides) stride = stride * cute::sizeof_bits_v<ElementD> / 8;
    cute::tma_descriptor_replace_addr_in_shared_mem(staged, params.ptr_D[g]);
    cute::tma_descriptor_replace_dims_strides_in_shared_mem(staged, dims, strides);
  }
  __syncwarp();
  cute::tma_descriptor_cp_fence_release(descriptors + g, staged);  // the whole warp
  __syncwarp();
}

}  // namespace moe_grouped::gemm::sm90
