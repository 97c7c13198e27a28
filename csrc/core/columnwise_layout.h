// Sizes of the grouped column-wise FP8 layout, the FP8 wgrad's operand layout
// (mg_quantize_columnwise_grouped_1x128 in the C ABI header), shared by the
// quantizers, the GEMMs and the experts sequence. Every group starts on a
// 128-token boundary and buffers have a multiple of 128 columns, so each
// 128-token block of a group is one aligned 128-byte run of every row, which
// is what the wgrad's TMA boxes read: with 16-token starts they straddled
// lines and the wgrad ran 5-20% slower (docs/kernels.md, "FP8 GEMMs").
#pragma once

#include <cstdint>

namespace moe_grouped {

constexpr int64_t kColumnwiseAlign = 128;  // tokens (fp8 bytes) per group start
constexpr int64_t kColumnwiseBlock = 128;  // tokens per column-wise scale

constexpr int64_t columnwise_round_up(int64_t tokens) {
  return (tokens + kColumnwiseAlign - 1) / kColumnwiseAlign * kColumnwiseAlign;
}

// Columns of the data: room for every group's rounded-up tokens.
constexpr int64_t columnwise_padded_rows(int64_t rows, int num_groups) {
  return columnwise_round_up(rows) + kColumnwiseAlign * static_cast<int64_t>(num_groups);
}

// Rows of the scale tensor: every group's 128-token blocks.
constexpr int64_t columnwise_scale_rows(int64_t rows, int num_groups) {
  return (rows + kColumnwiseBlock - 1) / kColumnwiseBlock + num_groups;
}

}  // namespace moe_grouped
