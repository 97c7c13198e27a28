// The setup kernel behind mg_grouped_setup: offsets and per-group problem
// shapes from device m_splits, with no host synchronisation.
#include "error.h"
#include "setup.cuh"

namespace moe_grouped {
namespace {

template <typename SplitT>
__global__ void __launch_bounds__(kSetupThreads)
    grouped_setup_kernel(const SplitT* m_splits, int num_groups, int64_t total_rows, int32_t n,
                         int32_t k, mg_gemm_kind kind, int64_t* offsets, int32_t* shapes) {
  scan_splits(m_splits, num_groups, total_rows, offsets, [&](int g, int64_t, int64_t count) {
    if (shapes == nullptr) return;
    int32_t m = static_cast<int32_t>(count);
    int32_t* shape = shapes + 3 * g;
    switch (kind) {
      case MG_GEMM_FPROP: shape[0] = m; shape[1] = n; shape[2] = k; break;
      case MG_GEMM_DGRAD: shape[0] = m; shape[1] = k; shape[2] = n; break;
      case MG_GEMM_WGRAD: shape[0] = n; shape[1] = k; shape[2] = m; break;
    }
  });
}

}  // namespace

mg_status check_splits_dtype(mg_dtype dtype) {
  if (dtype != MG_INT32 && dtype != MG_INT64) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "m_splits must be int32 or int64, got %s",
                dtype_name(dtype));
  }
  return MG_OK;
}

}  // namespace moe_grouped

using namespace moe_grouped;

extern "C" mg_status mg_grouped_setup(const void* m_splits, mg_dtype splits_dtype, int num_groups,
                                      int64_t total_rows, int64_t n, int64_t k, mg_gemm_kind kind,
                                      int64_t* offsets, int32_t* problem_shapes, void* stream) {
  MG_RETURN_IF_ERROR(check_splits_dtype(splits_dtype));
  if (num_groups <= 0) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "num_groups must be positive, got %d", num_groups);
  }
  if (m_splits == nullptr || offsets == nullptr) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "m_splits and offsets must be device pointers, got NULL");
  }
  if (total_rows < 0 || n < 0 || k < 0 || n > INT32_MAX || k > INT32_MAX || total_rows > INT32_MAX) {
    return fail(MG_ERROR_INVALID_ARGUMENT,
                "total_rows, n and k must be in [0, 2^31), got total_rows=%lld n=%lld k=%lld",
                static_cast<long long>(total_rows), static_cast<long long>(n),
                static_cast<long long>(k));
  }
  if (kind != MG_GEMM_FPROP && kind != MG_GEMM_DGRAD && kind != MG_GEMM_WGRAD) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "unknown gemm kind %d", static_cast<int>(kind));
  }
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  if (splits_dtype == MG_INT32) {
    grouped_setup_kernel<<<1, kSetupThreads, 0, cuda_stream>>>(
        static_cast<const int32_t*>(m_splits), num_groups, total_rows, static_cast<int32_t>(n),
        static_cast<int32_t>(k), kind, offsets, problem_shapes);
  } else {
    grouped_setup_kernel<<<1, kSetupThreads, 0, cuda_stream>>>(
        static_cast<const int64_t*>(m_splits), num_groups, total_rows, static_cast<int32_t>(n),
        static_cast<int32_t>(k), kind, offsets, problem_shapes);
  }
  MG_CUDA_RETURN(cudaGetLastError());
  return ok();
}
