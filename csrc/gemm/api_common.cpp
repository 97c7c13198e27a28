// Validation and device helpers shared by the grouped GEMM entry points.
#include "gemm/api_common.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace moe_grouped::gemm {

const char* kind_name(mg_gemm_kind kind) {
  switch (kind) {
    case MG_GEMM_FPROP: return "fprop";
    case MG_GEMM_DGRAD: return "dgrad";
    case MG_GEMM_WGRAD: return "wgrad";
  }
  return "unknown gemm kind";
}

mg_status check_kind(const char* op, mg_gemm_kind kind) {
  if (kind != MG_GEMM_FPROP && kind != MG_GEMM_DGRAD && kind != MG_GEMM_WGRAD) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: unknown gemm kind %d", op, static_cast<int>(kind));
  }
  return ok();
}

std::atomic<int> sm_limits[kMaxDevices];

mg_status sm_count(int device, int* out) {
  static std::once_flag flags[kMaxDevices];
  static int counts[kMaxDevices];
  static cudaError_t errors[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "device must be in [0, %d), got %d", kMaxDevices, device);
  }
  std::call_once(flags[device], [device] {
    errors[device] = cudaDeviceGetAttribute(&counts[device], cudaDevAttrMultiProcessorCount, device);
  });
  if (errors[device] != cudaSuccess) {
    return cuda_fail(errors[device], "cudaDeviceGetAttribute(cudaDevAttrMultiProcessorCount)");
  }
  const int limit = sm_limits[device].load(std::memory_order_relaxed);
  *out = limit > 0 && limit < counts[device] ? limit : counts[device];
  return MG_OK;
}

mg_status check_problem(const mg_grouped_problem* p, const char* op) {
  if (p == nullptr) return fail(MG_ERROR_INVALID_ARGUMENT, "%s: problem must not be NULL", op);
  if (p->num_groups <= 0) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: num_groups must be positive, got %d", op,
                p->num_groups);
  }
  if (p->splits_dtype != MG_INT32 && p->splits_dtype != MG_INT64) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: m_splits must be int32 or int64, got %s", op,
                dtype_name(p->splits_dtype));
  }
  if (p->m_splits == nullptr) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: m_splits must be a device pointer, got NULL", op);
  }
  if (p->dtype != MG_BFLOAT16 && p->dtype != MG_FLOAT16) {
    return fail(MG_ERROR_INVALID_ARGUMENT,
                "%s: the grouped GEMMs take bfloat16 or float16 operands, got %s", op,
                dtype_name(p->dtype));
  }
  if (p->total_rows < 0 || p->total_rows > INT32_MAX) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: total_rows must be in [0, 2^31), got %lld", op,
                static_cast<long long>(p->total_rows));
  }
  return MG_OK;
}

mg_status check_row_multiple(const mg_grouped_problem* p, const char* op, int multiple,
                             const char* rows) {
  if (p->n <= 0 || p->k <= 0 || p->n > INT32_MAX || p->k > INT32_MAX || p->n % multiple != 0 ||
      p->k % multiple != 0) {
    return fail(MG_ERROR_INVALID_ARGUMENT,
                "%s: n and k must be positive multiples of %d below 2^31 (16-byte %s for TMA), "
                "got n=%lld k=%lld",
                op, multiple, rows, static_cast<long long>(p->n), static_cast<long long>(p->k));
  }
  return MG_OK;
}

// TMA reads and writes whole 16-byte rows: n and k must be positive
// multiples of 8 (bf16 / fp16 elements).
mg_status check_gemm_problem(const mg_grouped_problem* p, const char* op) {
  MG_RETURN_IF_ERROR(check_problem(p, op));
  return check_row_multiple(p, op, 8, "rows");
}

mg_status check_aligned(const char* op, const char* name, const void* ptr, bool allow_null) {
  if (ptr == nullptr) {
    if (allow_null) return MG_OK;
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: %s must be a device pointer, got NULL", op, name);
  }
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: %s must be 16-byte aligned, got address %p", op,
                name, ptr);
  }
  return MG_OK;
}

// A grouped operand: base 16-byte aligned with a group stride that keeps
// every group 16-byte aligned, or a device array of pointers (each of which
// the caller guarantees to be 16-byte aligned; the host cannot check them).
mg_status check_operand(const char* op, const char* name, const mg_group_operand& operand,
                        size_t element_bytes) {
  if (operand.base != nullptr) {
    MG_RETURN_IF_ERROR(check_aligned(op, name, operand.base, false));
    if (operand.group_stride < 0 ||
        (operand.group_stride * static_cast<int64_t>(element_bytes)) % 16 != 0) {
      return fail(MG_ERROR_INVALID_ARGUMENT,
                  "%s: %s.group_stride must be a non-negative multiple of %zu elements (16 bytes), "
                  "got %lld",
                  op, name, 16 / element_bytes, static_cast<long long>(operand.group_stride));
    }
    return MG_OK;
  }
  if (operand.ptrs == nullptr) {
    return fail(MG_ERROR_INVALID_ARGUMENT,
                "%s: %s needs a base pointer or a device array of per-group pointers, got neither",
                op, name);
  }
  return check_aligned(op, name, operand.ptrs, false);
}

size_t dtype_bytes(mg_dtype dtype) {
  switch (dtype) {
    case MG_FLOAT32: return 4;
    case MG_FLOAT16:
    case MG_BFLOAT16: return 2;
    default: return 0;
  }
}

// The output dtypes compiled in: the operand dtype or float32.
mg_status check_out_dtype(const char* op, const char* name, mg_dtype dtype, mg_dtype out) {
  if (out != dtype && out != MG_FLOAT32) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: %s must be %s (the operand dtype) or float32, got %s",
                op, name, dtype_name(dtype), dtype_name(out));
  }
  return MG_OK;
}

mg_status env_choice(const char* name, std::initializer_list<const char*> choices, int* index) {
  *index = 0;
  const char* value = std::getenv(name);
  if (value == nullptr || value[0] == '\0') return MG_OK;
  int i = 0;
  for (const char* choice : choices) {
    if (std::strcmp(value, choice) == 0) {
      *index = i;
      return MG_OK;
    }
    ++i;
  }
  char expected[256] = "";
  i = 0;
  for (const char* choice : choices) {
    const char* separator = i == 0 ? "" : i + 1 == static_cast<int>(choices.size()) ? " or " : ", ";
    std::strncat(expected, separator, sizeof(expected) - std::strlen(expected) - 1);
    std::strncat(expected, choice, sizeof(expected) - std::strlen(expected) - 1);
    ++i;
  }
  return fail(MG_ERROR_INVALID_ARGUMENT, "%s=%s: expected %s", name, value, expected);
}

mg_status forced_tile_order(bool heuristic, bool* along_n) {
  int choice = 0;
  MG_RETURN_IF_ERROR(env_choice("MOE_GROUPED_GEMM_RASTER", {"auto", "m", "n"}, &choice));
  *along_n = choice == 0 ? heuristic : choice == 2;
  return MG_OK;
}

}  // namespace moe_grouped::gemm

extern "C" mg_status mg_set_gemm_sm_limit(int device, int sms) {
  using namespace moe_grouped;
  if (device < 0 || device >= gemm::kMaxDevices) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "device must be in [0, %d), got %d", gemm::kMaxDevices, device);
  }
  if (sms < 0) return fail(MG_ERROR_INVALID_ARGUMENT, "sms must be 0 (no limit) or positive, got %d", sms);
  gemm::sm_limits[device].store(sms, std::memory_order_relaxed);
  return ok();
}
