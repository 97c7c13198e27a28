// Error reporting shared by every translation unit of the core: a status code
// returned through the C ABI plus a thread-local sentence for mg_last_error().
#pragma once

#include <cuda_runtime.h>

#include <cstdarg>
#include <string>

#include "moe_grouped/moe_grouped.h"

namespace moe_grouped {

// Records the message for mg_last_error() and returns `status`.
mg_status fail(mg_status status, const char* format, ...)
    __attribute__((format(printf, 2, 3)));

// Clears the thread's message; returns MG_OK.
mg_status ok();

// Maps a CUDA runtime error to MG_ERROR_CUDA (or MG_ERROR_OUT_OF_MEMORY) with
// `what` and the runtime's own description in the message.
mg_status cuda_fail(cudaError_t err, const char* what);

bool is_capturing(cudaStream_t stream);

const char* dtype_name(mg_dtype dtype);

}  // namespace moe_grouped

// Returns from the enclosing function when a CUDA call fails.
#define MG_CUDA_RETURN(call)                                        \
  do {                                                              \
    cudaError_t mg_err_ = (call);                                   \
    if (mg_err_ != cudaSuccess) return ::moe_grouped::cuda_fail(mg_err_, #call); \
  } while (0)

// Returns from the enclosing function when a core call fails.
#define MG_RETURN_IF_ERROR(call)        \
  do {                                  \
    mg_status mg_st_ = (call);          \
    if (mg_st_ != MG_OK) return mg_st_; \
  } while (0)
