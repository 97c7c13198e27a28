// The current device for the scope of a C entry point.
//
// Kernels, memsets and event records go to the current device, and CUDA
// refuses a stream of another device. torch's own ops make their tensors'
// device current; the core's entry points do the same, so that a layer
// whose tensors live on a GPU other than the caller's current one runs
// there. The caller's current device is restored on the way out.
#pragma once

#include <cuda_runtime.h>

#include <initializer_list>

#include "core/error.h"

namespace moe_grouped {

class DeviceGuard {
 public:
  DeviceGuard() = default;
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

  mg_status enter(int device) {
    MG_CUDA_RETURN(cudaGetDevice(&previous_));
    if (previous_ != device) {
      MG_CUDA_RETURN(cudaSetDevice(device));
      restore_ = true;
    }
    return MG_OK;
  }

  // The device whose memory the first non-NULL of `pointers` is. The
  // stream cannot say: torch's default stream is the NULL stream, which
  // means the current device's (and CUDA refuses cudaStreamGetDevice during
  // capture). NULL pointers only, or host memory: the current device stays.
  mg_status enter_device_of(std::initializer_list<const void*> pointers) {
    for (const void* p : pointers) {
      if (p == nullptr) continue;
      cudaPointerAttributes attributes{};
      // Relaxed capture mode for the query: a capture in progress on this
      // thread (global or thread-local mode) must not refuse it.
      cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
      cudaThreadExchangeStreamCaptureMode(&mode);
      const cudaError_t queried = cudaPointerGetAttributes(&attributes, p);
      cudaThreadExchangeStreamCaptureMode(&mode);
      if (queried != cudaSuccess) {
        // Not a pointer CUDA knows (or no GPU): the current device stays, and
        // the entry point's own checks and launches report what is wrong.
        cudaGetLastError();
        return MG_OK;
      }
      return attributes.type == cudaMemoryTypeDevice ? enter(attributes.device) : MG_OK;
    }
    return MG_OK;
  }

  ~DeviceGuard() {
    if (restore_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool restore_ = false;
};

}  // namespace moe_grouped

// Makes `device` current until the enclosing entry point returns.
#define MG_ENTER_DEVICE(device)              \
  ::moe_grouped::DeviceGuard mg_entry_device_; \
  MG_RETURN_IF_ERROR(mg_entry_device_.enter(device))

// Makes the device of the first non-NULL of the pointers current until the
// enclosing entry point returns (its outputs: where its kernels run).
#define MG_ENTER_DEVICE_OF(...)              \
  ::moe_grouped::DeviceGuard mg_entry_device_; \
  MG_RETURN_IF_ERROR(mg_entry_device_.enter_device_of({__VA_ARGS__}))
