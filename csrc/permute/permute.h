// The permute pass's entry inside the core, for sequences that run it among
// other kernels (csrc/experts): mg_permute_rows without the device guard
// (the caller's entry point made the device current), and optionally moving
// a float32 value per copy in the same launch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moe_grouped/moe_grouped.h"

namespace moe_grouped {

// permuted[row_id_map[t * top_k + j]] = x[t] for every kept copy (as
// mg_permute_rows); with copy_values (else NULL), also
// row_values[row_id_map[i]] = copy_values[i].
mg_status permute_rows_and_values(const void* x, mg_dtype dtype, int64_t num_tokens, int64_t hidden, int top_k,
                                  const int64_t* row_id_map, void* permuted, const float* copy_values,
                                  float* row_values, cudaStream_t stream);

}  // namespace moe_grouped
