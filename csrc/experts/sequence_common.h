// What the experts sequences (experts_sequence.cu, experts_sequence_fp8.cu) share: scratch carving and
// the per-GEMM problem.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "moe_grouped/moe_grouped.h"

namespace moe_grouped {
namespace sequence {

// Every buffer carved from a scratch starts on this boundary.
constexpr size_t kAlign = 256;

inline size_t aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// The buffers are carved from the scratch at kAlign offsets.
inline mg_status check_scratch_aligned(const void* scratch, const char* op) {
  if (reinterpret_cast<uintptr_t>(scratch) % kAlign != 0) {
    return fail(MG_ERROR_INVALID_ARGUMENT, "%s: scratch must be %zu-byte aligned", op, kAlign);
  }
  return MG_OK;
}

// The sizes every sequence takes (its args have these fields): all positive.
template <class Args>
mg_status check_sizes(const Args* a, const char* op) {
  if (a->problem.total_rows <= 0 || a->num_tokens <= 0 || a->top_k <= 0 || a->hidden <= 0 || a->ffn <= 0) {
    return fail(MG_ERROR_INVALID_ARGUMENT,
                "%s: rows, tokens, top_k, hidden and ffn must be positive, got %lld, %lld, %d, %lld, %lld", op,
                static_cast<long long>(a->problem.total_rows), static_cast<long long>(a->num_tokens), a->top_k,
                static_cast<long long>(a->hidden), static_cast<long long>(a->ffn));
  }
  return MG_OK;
}

// The problem of one GEMM of a sequence: n x k matrices, on a slot.
inline mg_grouped_problem gemm_problem(const mg_grouped_problem& base, int64_t n, int64_t k, int slot) {
  mg_grouped_problem p = base;
  p.n = n;
  p.k = k;
  p.workspace_slot = slot;
  return p;
}

}  // namespace sequence
}  // namespace moe_grouped
