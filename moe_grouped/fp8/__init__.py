"""FP8 block scaling (1x128 activations and gradients, 128x128 weights).

This module holds the recipe, the autocast context and the plain-PyTorch
quantizers that define the numerics. The grouped FP8 kernels of the CUDA
core are checked against these quantizers bit for bit.
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
]
