// Workspace manager: one persistent device allocation per (device, slot).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "moe_grouped/moe_grouped.h"

namespace moe_grouped {

// Alignment of every workspace buffer and of every sub-buffer carved from it.
constexpr size_t kWorkspaceAlignment = 256;

constexpr size_t align_up(size_t bytes, size_t alignment = kWorkspaceAlignment) {
  return (bytes + alignment - 1) / alignment * alignment;
}

// The (device, slot) buffer, at least `bytes` long; see mg_workspace_get.
mg_status workspace_get(int device, int slot, size_t bytes, cudaStream_t stream, void** out);

// Carves consecutive aligned sub-buffers out of one workspace buffer. Used in
// two passes: with base == nullptr it only counts the bytes needed.
class WorkspaceCarver {
 public:
  explicit WorkspaceCarver(void* base) : base_(static_cast<char*>(base)) {}

  template <typename T>
  T* take(size_t count) {
    size_t offset = used_;
    used_ += align_up(count * sizeof(T));
    return base_ ? reinterpret_cast<T*>(base_ + offset) : nullptr;
  }

  size_t bytes_used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

}  // namespace moe_grouped
