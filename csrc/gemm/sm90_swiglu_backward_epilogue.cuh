// fc2's dgrad epilogue for the fused MoE experts path: the weighted SwiGLU
// backward (activation/swiglu_weighted_backward.cu) applied to the dgrad's
// accumulators in registers, so dh_u = dy_u W2 is never stored and read back.
// Per permuted row r (routing weight w_r) and fc2 input feature c < ffn, from
// du = (dy_u W2)[r, c] rounded to the element type (what the plain dgrad
// stores) and fc1's output g = [gate | up] at (r, c), (r, ffn + c):
//   g[r, c], g[r, ffn + c] <- d_gate, d_up   (in place: g becomes dg)
//   wh[r, c]               <- w_r * h        (fc2's wgrad operand)
//   partials[r, tile]      <- sum over the tile's columns of du * h
// with swiglu_backward_math.cuh's roundings, so dg and wh are bitwise those of
// the plain dgrad followed by the standalone pass. Measured slower than those
// two passes, so the experts path runs it only when asked
// (MOE_GROUPED_DGRAD_SWIGLU=fused): docs/kernels.md, "SwiGLU-backward epilogue".
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include <cstdint>

#include "activation/swiglu_backward_math.cuh"
#include "core/elementwise.cuh"

namespace moe_grouped::gemm::sm90 {

// The CUDA type of a CUTLASS 16-bit element (same bits), which the shared
// SwiGLU math takes.
template <class E>
struct ToCuda;
template <>
struct ToCuda<cutlass::bfloat16_t> { using type = __nv_bfloat16; };
template <>
struct ToCuda<cutlass::half_t> { using type = __half; };

template <class Element>
struct SwigluBackwardArguments {
  Element* g = nullptr;             // [rows, 2 * ffn]: gate | up in, dg out
  Element* wh = nullptr;            // [rows, ffn]
  const float* weights = nullptr;   // [rows], or NULL for weight 1
  float* partials = nullptr;        // [rows, partial_cols], or NULL
  int64_t partial_cols = 0;         // column tiles of ffn
  const int64_t* group_offsets = nullptr;  // [E + 1], from the setup kernel
};

template <class Base, class Element>
struct SwigluBackwardEpilogue : Base {
  struct Arguments : Base::Arguments {
    SwigluBackwardArguments<Element> swiglu;
  };
  struct Params : Base::Params {
    SwigluBackwardArguments<Element> swiglu;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    Params params;
    static_cast<typename Base::Params&>(params) = Base::to_underlying_arguments(problem_shape, args, workspace);
    params.swiglu = args.swiglu;
    return params;
  }

  CUTLASS_HOST_DEVICE
  SwigluBackwardEpilogue(Params const& params, typename Base::TensorStorage& shared_tensors)
      : Base(params, shared_tensors), args_(params.swiglu) {}

  // No C: the kernel's epilogue-load warp must not run. CUTLASS's linear
  // combination asks for it even without a C and its store consumes the
  // empty loads; this store does not, so with the warp running the kernel
  // hung (seen on the H100).
  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }

  template <class LoadPipeline, class LoadState, class StorePipeline, class StoreState>
  CUTLASS_DEVICE auto store_tail(LoadPipeline, LoadState load_state, StorePipeline, StoreState store_state) {
    return cute::make_tuple(load_state, store_state);
  }

  // Nothing goes through TMA, so the per-CTA tensor maps are never updated.
  template <bool IsLoad, class... Args>
  CUTLASS_DEVICE void tensormaps_perform_update(Args&&...) {}
  template <bool IsLoad, class... Args>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(Args&&...) {}
  template <bool IsLoad>
  CUTLASS_DEVICE void tensormaps_fence_acquire(cute::TmaDescriptor const*) {}

  // ((2, 2, V), MMA_M, MMA_N) -> ((2, MMA_M), (2, V, MMA_N)): rows, then
  // columns, of a thread's SM90 MMA accumulators (each thread holds two rows,
  // eight apart, per 64-row MMA, and pairs of adjacent columns).
  template <class Layout>
  CUTLASS_DEVICE static auto rows_by_columns(Layout layout) {
    using namespace cute;
    static_assert(rank(Layout{}) == 3 && rank<0>(Layout{}) == 3, "SM90 MMA accumulator layout expected");
    return make_layout(make_layout(get<0, 1>(layout), get<1>(layout)),
                       make_layout(get<0, 0>(layout), get<0, 2>(layout), get<2>(layout)));
  }

  // Each thread reads and writes the elements whose accumulators it holds
  // (pairs of adjacent columns, 4-byte accesses); an element of g is read and
  // written by the same thread, so the update in place is safe. Rows past the
  // group's count and columns past ffn are left alone: the wrapped epilogue's
  // TMA stores, tensor maps and load warp are not used at all. dprob_r is the
  // sum of row r's partials over the column tiles, which the caller adds in a
  // fixed order: deterministic, though not bitwise the standalone pass's
  // single sum.
  template <class LoadPipeline, class LoadState, class StorePipeline, class StoreState, class ProblemShapeMNKL,
            class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout, class TiledMma,
            class TensorStorage, class TensorMapD>
  CUTLASS_DEVICE auto store(LoadPipeline, LoadState load_state, StorePipeline, StoreState store_state,
                            ProblemShapeMNKL problem_shape, TileShapeMNK, TileCoordMNKL tile_coord,
                            cute::Tensor<AccEngine, AccLayout> accumulators, TiledMma tiled_mma, int thread_idx,
                            TensorStorage&, TensorMapD const&, int = -1) {
    using namespace cute;
    using T = typename ToCuda<Element>::type;
    constexpr int kBlockM = size<0>(TileShapeMNK{});
    constexpr int kBlockN = size<1>(TileShapeMNK{});
    const int rows = static_cast<int>(get<0>(problem_shape));  // the group's m_e
    const int ffn = static_cast<int>(get<1>(problem_shape));
    const int m_tile = static_cast<int>(get<0>(tile_coord));
    const int n_tile = static_cast<int>(get<1>(tile_coord));
    const int group = static_cast<int>(get<3>(tile_coord));
    const int row0 = m_tile * kBlockM;
    const int col0 = n_tile * kBlockN;
    const int64_t first_row = args_.group_offsets[group] + row0;

    Tensor coords = tiled_mma.get_slice(thread_idx).partition_C(make_identity_tensor(make_shape(Int<kBlockM>{},
                                                                                               Int<kBlockN>{})));
    Tensor acc = make_tensor(accumulators.data(), rows_by_columns(accumulators.layout()));
    Tensor crd = make_tensor(coords.data(), rows_by_columns(coords.layout()));
    static_assert(size<1, 0>(decltype(acc.layout()){}) == 2, "adjacent column pairs expected");

    auto* g = reinterpret_cast<T*>(args_.g);
    auto* wh = reinterpret_cast<T*>(args_.wh);
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < size<0>(acc); ++r) {
      const int m = static_cast<int>(get<0>(crd(r, 0)));
      const bool row_ok = row0 + m < rows;
      const int64_t row = first_row + m;
      const float w = row_ok && args_.weights != nullptr ? args_.weights[row] : 1.f;
      T* g_row = g + row * 2 * ffn;
      T* wh_row = wh + row * ffn;
      float dot = 0.f;
      // The row's g pairs a chunk at a time, every load of a chunk before its
      // stores: the stores write g in place, so the compiler cannot hoist a
      // later load above an earlier store, and one load per latency is slow.
      constexpr int kPairs = size<1>(decltype(acc.layout()){}) / 2;
      constexpr int kChunk = kPairs < 16 ? kPairs : 16;
      static_assert(kPairs % kChunk == 0);
      CUTLASS_PRAGMA_UNROLL
      for (int c0 = 0; c0 < kPairs; c0 += kChunk) {
        Pack<T, 2> gate[kChunk], up[kChunk];
        CUTLASS_PRAGMA_UNROLL
        for (int p = 0; p < kChunk; ++p) {
          const int col = col0 + static_cast<int>(get<1>(crd(r, 2 * (c0 + p))));
          if (row_ok && col < ffn) {
            gate[p] = load_pack<T, 2>(g_row + col);
            up[p] = load_pack<T, 2>(g_row + ffn + col);
          }
        }
        CUTLASS_PRAGMA_UNROLL
        for (int p = 0; p < kChunk; ++p) {
          const int c = 2 * (c0 + p);
          const int col = col0 + static_cast<int>(get<1>(crd(r, c)));
          if (row_ok && col < ffn) {  // ffn is a multiple of 8 and col even: col + 1 < ffn too
            Pack<T, 2> d_gate, d_up, weighted;
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < 2; ++j) {
              const float du = round_through<T>(acc(r, c + j));
              dot += swiglu_weighted_backward_element<T>(to_float(gate[p].v[j]), to_float(up[p].v[j]), du, w,
                                                         d_gate.v[j], d_up.v[j], weighted.v[j]);
            }
            store_pack<T, 2>(g_row + col, d_gate);
            store_pack<T, 2>(g_row + ffn + col, d_up);
            store_pack<T, 2>(wh_row + col, weighted);
          }
        }
      }
      // A row's columns of the tile are spread over the four lanes of a quad
      // (lane % 4): a fixed butterfly over them, then one lane writes.
      dot += __shfl_xor_sync(0xffffffffu, dot, 1);
      dot += __shfl_xor_sync(0xffffffffu, dot, 2);
      if (row_ok && args_.partials != nullptr && (threadIdx.x % 4) == 0) {
        args_.partials[row * args_.partial_cols + n_tile] = dot;
      }
    }
    return cute::make_tuple(load_state, store_state);
  }

 private:
  SwigluBackwardArguments<Element> args_;
};

}  // namespace moe_grouped::gemm::sm90
