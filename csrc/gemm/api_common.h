// Validation and device helpers shared by the C entry points of the grouped
// GEMMs (16-bit in grouped_gemm_api.cpp, FP8 in fp8_gemm/fp8_gemm_api.cpp).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <initializer_list>

#include "core/device_guard.h"
#include "core/error.h"
#include "moe_grouped/moe_grouped.h"

namespace moe_grouped::gemm {

constexpr int kMaxDevices = 64;

const char* kind_name(mg_gemm_kind kind);
// MG_ERROR_INVALID_ARGUMENT unless kind is fprop, dgrad or wgrad.
mg_status check_kind(const char* op, mg_gemm_kind kind);
// Multiprocessor count, queried once per device: the persistent grid size.
mg_status sm_count(int device, int* out);

// The choice an environment switch names, for switches that force a kernel
// or an order (measurement and tests): *index = the position of NAME's value
// in `choices`, 0 (the first choice: the default, e.g. "auto") where NAME is
// unset or empty. Any other value fails with "NAME=value: expected a, b or c",
// so that a forced measurement never silently runs the default.
mg_status env_choice(const char* name, std::initializer_list<const char*> choices, int* index);

// The tile order: `heuristic` (true: along N), unless MOE_GROUPED_GEMM_RASTER
// ("m" or "n"; "auto" or unset: the heuristic) forces one (measurement and
// tests; the 16-bit and FP8 GEMMs alike).
mg_status forced_tile_order(bool heuristic, bool* along_n);

// The fields every grouped problem needs: groups, m_splits, dtype, rows.
mg_status check_problem(const mg_grouped_problem* p, const char* op);
// n and k positive, below 2^31 and multiples of `multiple` (elements per
// 16-byte row); `rows` names those rows in the error.
mg_status check_row_multiple(const mg_grouped_problem* p, const char* op, int multiple,
                             const char* rows);
// check_problem plus n and k positive multiples of 8 (16-byte 16-bit rows).
mg_status check_gemm_problem(const mg_grouped_problem* p, const char* op);
// A 16-byte aligned device pointer (NULL allowed when allow_null).
mg_status check_aligned(const char* op, const char* name, const void* ptr, bool allow_null);
// A grouped operand whose every group is 16-byte aligned.
mg_status check_operand(const char* op, const char* name, const mg_group_operand& operand,
                        size_t element_bytes);
// Bytes per element of fp32/fp16/bf16; 0 for other dtypes.
size_t dtype_bytes(mg_dtype dtype);
// The output dtypes compiled in: the operand dtype or float32.
mg_status check_out_dtype(const char* op, const char* name, mg_dtype dtype, mg_dtype out);

// Copies the problem's shape, its device m_splits and the launch resources
// into a kernel call (GroupedGemmCall or fp8_gemm::Fp8GemmCall).
template <class Call>
void set_problem(Call& call, const mg_grouped_problem* p, int sms, void* workspace) {
  call.num_groups = p->num_groups;
  call.total_rows = p->total_rows;
  call.n = p->n;
  call.k = p->k;
  call.m_splits = p->m_splits;
  call.splits_dtype = p->splits_dtype;
  call.sm_count = sms;
  call.workspace = workspace;
}

}  // namespace moe_grouped::gemm
