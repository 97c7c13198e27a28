"""FP8 block scaling (1x128 activations and gradients, 128x128 weights).

This module holds the recipe, the autocast context and the plain-PyTorch
quantizers that define the numerics, and the CUDA core's quantize kernels
(row-wise, grouped column-wise, both in one pass with the fused dbias, and
128x128 weights), checked against those quantizers bit for bit.
"""

from .quantize_reference import (
    COLUMNWISE_ALIGN,
    BlockQuantized,
    GroupedQuantized,
    WeightQuantized,
    columnwise_group_starts,
    columnwise_groups,
    columnwise_padded_rows,
    columnwise_scale_rows,
    compute_scale,
    dequantize_128x128,
    dequantize_1x128,
    grouped_column_sums,
    quantize_128x128,
    quantize_1x128,
    quantize_grouped_128x128,
    quantize_grouped_1x128,
    quantize_grouped_columnwise,
)
from .quantize import (
    quantize_columnwise_grouped,
    quantize_grouped,
    quantize_rowwise,
    quantize_weights_128x128,
)
from .recipe import BLOCK, Float8BlockScaling, fp8_autocast, get_fp8_recipe

__all__ = [
    "BLOCK",
    "COLUMNWISE_ALIGN",
    "BlockQuantized",
    "GroupedQuantized",
    "WeightQuantized",
    "Float8BlockScaling",
    "compute_scale",
    "dequantize_128x128",
    "dequantize_1x128",
    "fp8_autocast",
    "get_fp8_recipe",
    # reference quantizers (plain PyTorch, any device)
    "quantize_128x128",
    "quantize_1x128",
    "quantize_grouped_128x128",
    "quantize_grouped_1x128",
    "quantize_grouped_columnwise",
    "grouped_column_sums",
    # the grouped column-wise layout
    "columnwise_padded_rows",
    "columnwise_scale_rows",
    "columnwise_group_starts",
    "columnwise_groups",
    # the CUDA core's quantizers (reference fallback on CPU tensors)
    "quantize_rowwise",
    "quantize_columnwise_grouped",
    "quantize_grouped",
    "quantize_weights_128x128",
]
