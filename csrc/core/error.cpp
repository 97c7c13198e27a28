#include "error.h"

#include <cstdio>

namespace moe_grouped {
namespace {
thread_local std::string last_error;
}  // namespace

mg_status fail(mg_status status, const char* format, ...) {
  char buffer[1024];
  va_list args;
  va_start(args, format);
  std::vsnprintf(buffer, sizeof(buffer), format, args);
  va_end(args);
  last_error = buffer;
  return status;
}

mg_status ok() {
  last_error.clear();
  return MG_OK;
}

mg_status cuda_fail(cudaError_t err, const char* what) {
  // Clear the sticky-free error so later calls on this thread start clean.
  cudaGetLastError();
  mg_status status = (err == cudaErrorMemoryAllocation) ? MG_ERROR_OUT_OF_MEMORY : MG_ERROR_CUDA;
  return fail(status, "%s failed: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err));
}

bool is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return status != cudaStreamCaptureStatusNone;
}

const char* dtype_name(mg_dtype dtype) {
  switch (dtype) {
    case MG_FLOAT32: return "float32";
    case MG_FLOAT16: return "float16";
    case MG_BFLOAT16: return "bfloat16";
    case MG_INT32: return "int32";
    case MG_INT64: return "int64";
    case MG_FLOAT8_E4M3: return "float8_e4m3fn";
    case MG_FLOAT8_E5M2: return "float8_e5m2";
  }
  return "unknown dtype";
}

}  // namespace moe_grouped

extern "C" const char* mg_last_error(void) { return moe_grouped::last_error.c_str(); }
