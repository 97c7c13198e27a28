#include "workspace.h"

#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "device_guard.h"
#include "error.h"

namespace moe_grouped {
namespace {

struct Entry {
  void* buffer = nullptr;
  size_t capacity = 0;
  size_t high_water = 0;
  uint64_t grow_count = 0;
  // Buffers replaced by a larger one. A graph captured earlier may still read
  // them at replay, so they live until an explicit release.
  std::vector<std::pair<void*, size_t>> retired;
};

std::mutex registry_mutex;
std::map<std::pair<int, int>, Entry> registry;

mg_status check_key(int device, int slot) {
  if (slot < 0 || slot >= MG_MAX_SLOTS) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "workspace slot must be in [0, %d), got %d",
                MG_MAX_SLOTS, slot);
  }
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) return cuda_fail(err, "cudaGetDeviceCount");
  if (device < 0 || device >= count) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "device %d does not exist (%d CUDA devices visible)",
                device, count);
  }
  return MG_OK;
}

bool is_capture_error(cudaError_t err) {
  return err == cudaErrorStreamCaptureUnsupported || err == cudaErrorStreamCaptureInvalidated ||
         err == cudaErrorStreamCaptureImplicit || err == cudaErrorStreamCaptureWrongThread;
}

// Grows `entry` to hold `bytes`. Caller holds registry_mutex.
mg_status grow(Entry& entry, int device, int slot, size_t bytes) {
  // Grow geometrically so that a sequence of slightly larger requests does not
  // leave a trail of retired buffers.
  size_t target = align_up(bytes > entry.capacity + entry.capacity / 2 ? bytes
                                                                       : entry.capacity + entry.capacity / 2);
  DeviceGuard guard;
  MG_RETURN_IF_ERROR(guard.enter(device));
  void* fresh = nullptr;
  cudaError_t err = cudaMalloc(&fresh, target);
  if (is_capture_error(err)) {
    cudaGetLastError();
    return fail(MG_ERROR_CAPTURE,
                "workspace (device %d, slot %d) must grow to %zu bytes, but a CUDA graph capture "
                "is in progress; call moe_grouped.workspace.reserve(%d, %d, %zu) or run the op "
                "once eagerly before capturing",
                device, slot, bytes, device, slot, bytes);
  }
  if (err != cudaSuccess) return cuda_fail(err, "cudaMalloc for the workspace");
  if (entry.buffer != nullptr) entry.retired.emplace_back(entry.buffer, entry.capacity);
  entry.buffer = fresh;
  entry.capacity = target;
  entry.grow_count += 1;
  return MG_OK;
}

}  // namespace

mg_status workspace_get(int device, int slot, size_t bytes, cudaStream_t stream, void** out) {
  if (out == nullptr) return fail(MG_ERROR_INVALID_ARGUMENT, "out_ptr must not be NULL");
  MG_RETURN_IF_ERROR(check_key(device, slot));
  std::lock_guard<std::mutex> lock(registry_mutex);
  Entry& entry = registry[{device, slot}];
  if (bytes > entry.high_water) entry.high_water = bytes;
  if (bytes > entry.capacity || entry.buffer == nullptr) {
    if (is_capturing(stream)) {
      return fail(MG_ERROR_CAPTURE,
                  "workspace (device %d, slot %d) holds %zu bytes but this op needs %zu while a "
                  "CUDA graph is being captured; call moe_grouped.workspace.reserve(%d, %d, %zu) "
                  "or run the op once eagerly before capturing",
                  device, slot, entry.capacity, bytes, device, slot, bytes);
    }
    MG_RETURN_IF_ERROR(grow(entry, device, slot, bytes == 0 ? 1 : bytes));
  }
  *out = entry.buffer;
  return ok();
}

}  // namespace moe_grouped

using namespace moe_grouped;

extern "C" {

mg_status mg_workspace_reserve(int device, int slot, size_t bytes) {
  MG_RETURN_IF_ERROR(check_key(device, slot));
  std::lock_guard<std::mutex> lock(registry_mutex);
  Entry& entry = registry[{device, slot}];
  if (bytes > entry.high_water) entry.high_water = bytes;
  if (bytes > entry.capacity || entry.buffer == nullptr) {
    MG_RETURN_IF_ERROR(grow(entry, device, slot, bytes == 0 ? 1 : bytes));
  }
  return ok();
}

mg_status mg_workspace_get(int device, int slot, size_t bytes, void* stream, void** out_ptr) {
  return workspace_get(device, slot, bytes, static_cast<cudaStream_t>(stream), out_ptr);
}

mg_status mg_workspace_stats_get(int device, int slot, mg_workspace_stats* out) {
  if (out == nullptr) return fail(MG_ERROR_INVALID_ARGUMENT, "out must not be NULL");
  MG_RETURN_IF_ERROR(check_key(device, slot));
  std::lock_guard<std::mutex> lock(registry_mutex);
  *out = mg_workspace_stats{};
  auto it = registry.find({device, slot});
  if (it == registry.end()) return ok();
  const Entry& entry = it->second;
  out->capacity = entry.capacity;
  out->high_water = entry.high_water;
  out->grow_count = entry.grow_count;
  for (const auto& block : entry.retired) out->retired_bytes += block.second;
  return ok();
}

mg_status mg_workspace_release(int device, int slot) {
  if (slot < -1 || slot >= MG_MAX_SLOTS) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "workspace slot must be -1 or in [0, %d), got %d",
                MG_MAX_SLOTS, slot);
  }
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (auto it = registry.begin(); it != registry.end();) {
    bool match = (device == -1 || it->first.first == device) && (slot == -1 || it->first.second == slot);
    if (!match) {
      ++it;
      continue;
    }
    Entry& entry = it->second;
    DeviceGuard guard;
    MG_RETURN_IF_ERROR(guard.enter(it->first.first));
    // The caller promised no graph using these buffers replays again; wait
    // for eager work still reading them.
    MG_CUDA_RETURN(cudaDeviceSynchronize());
    if (entry.buffer != nullptr) MG_CUDA_RETURN(cudaFree(entry.buffer));
    for (const auto& block : entry.retired) MG_CUDA_RETURN(cudaFree(block.first));
    it = registry.erase(it);
  }
  return ok();
}

}  // extern "C"
