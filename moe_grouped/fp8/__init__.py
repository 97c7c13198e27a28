"""FP8 block scaling (1x128 activations and gradients, 128x128 weights).

This module holds the recipe, the autocast context and the plain-PyTorch
quantizers that define the numerics, and the CUDA core's grouped 1x128
quantize kernels, checked against those quantizers bit for bit.
"""

from .quantize_reference import (
    BlockQuantized,
    compute_scale,
    dequantize_128x128,
    dequantize_1x128,
    quantize_128x128,
    quantize_1x128,
    quantize_grouped_columnwise,
)
from .quantize import columnwise_scale_columns, quantize_columnwise_grouped, quantize_rowwise
from .recipe import BLOCK, Float8BlockScaling, fp8_autocast, get_fp8_recipe

__all__ = [
    "BLOCK",
    "BlockQuantized",
    "Float8BlockScaling",
    "compute_scale",
    "dequantize_128x128",
    "dequantize_1x128",
    "fp8_autocast",
    "get_fp8_recipe",
    "quantize_128x128",
    "quantize_1x128",
    "quantize_grouped_columnwise",
    "quantize_rowwise",
    "quantize_columnwise_grouped",
    "columnwise_scale_columns",
]
