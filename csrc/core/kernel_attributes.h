// Kernel attributes set once per device.
#pragma once

#include <cuda_runtime.h>

#include <mutex>

#include "core/error.h"

namespace moe_grouped {

// Raises `kernel`'s dynamic shared memory limit to `bytes` on `device`
// (current) the first time it is asked there. The attribute belongs to the
// device's context; setting it on every launch would cost a runtime call per
// launch (legal during capture, but captures then hold more than launches).
// Keyed by the kernel itself: two kernels of one signature keep separate
// flags.
template <auto kernel>
mg_status raise_shared_memory_once(int device, int bytes) {
  constexpr int kMaxDevices = 64;
  static std::once_flag raised[kMaxDevices];
  static cudaError_t results[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "device %d is out of range [0, %d)", device, kMaxDevices);
  }
  if (bytes < (48 << 10)) return MG_OK;  // within every kernel's default limit
  std::call_once(raised[device], [&] {
    results[device] = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  });
  if (results[device] != cudaSuccess) {
    return cuda_fail(results[device], "cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize)");
  }
  return MG_OK;
}

}  // namespace moe_grouped
