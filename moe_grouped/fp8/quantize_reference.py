"""FP8 block quantization in plain PyTorch: the oracle for the core's kernels.

Scales follow TransformerEngine's block-scaling rules: per block,
``amax' = max(amax, amax_epsilon)``; ``scale = fp8_max / amax'`` (1 when
amax' is 0 or infinite; the largest float32 when the quotient overflows);
with pow2 scales the scale is rounded down to a power of two by clearing its
mantissa bits. Values are stored as ``fp8(x * scale)`` and the kernels use
``scale_inv = 1 / scale``. Each 1x128 or 128x128 block is computed
independently, so a group boundary that is not a multiple of 128 simply
starts new blocks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .recipe import BLOCK

_FLOAT32_MAX = torch.finfo(torch.float32).max


class BlockQuantized(NamedTuple):
    """FP8 data and the float32 inverse scales of its blocks."""

    data: torch.Tensor
    scale_inv: torch.Tensor


def compute_scale(amax: torch.Tensor, fp8_dtype: torch.dtype, pow2_scales: bool, amax_epsilon: float) -> torch.Tensor:
    """float32 scales from float32 block amaxes (see the module docstring)."""
    amax = amax.float().clamp(min=amax_epsilon)
    fp8_max = torch.finfo(fp8_dtype).max
    scale = torch.full_like(amax, fp8_max) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, _FLOAT32_MAX), scale)
    scale = torch.where((amax == 0) | torch.isinf(amax) | torch.isnan(scale), torch.ones_like(scale), scale)
    if pow2_scales:
        # Keep sign and exponent bits: the largest power of two <= scale.
        scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
    return scale


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))


def quantize_1x128(x: torch.Tensor, fp8_dtype: torch.dtype, pow2_scales: bool, amax_epsilon: float = 0.0) -> BlockQuantized:
    """Row-wise 1x128 blocks: data [M, K], scale_inv [M, ceil(K / 128)]."""
    m, k = x.shape
    blocks = -(-k // BLOCK)
    tiles = _pad_to(x.float(), m, blocks * BLOCK).view(m, blocks, BLOCK)
    scale = compute_scale(tiles.abs().amax(dim=-1), fp8_dtype, pow2_scales, amax_epsilon)
    data = (tiles * scale.unsqueeze(-1)).view(m, blocks * BLOCK)[:, :k].to(fp8_dtype)
    return BlockQuantized(data, 1.0 / scale)


def quantize_128x128(w: torch.Tensor, fp8_dtype: torch.dtype, pow2_scales: bool, amax_epsilon: float = 0.0) -> BlockQuantized:
    """128x128 tiles: data [N, K], scale_inv [ceil(N / 128), ceil(K / 128)]."""
    n, k = w.shape
    row_blocks, col_blocks = -(-n // BLOCK), -(-k // BLOCK)
    tiles = _pad_to(w.float(), row_blocks * BLOCK, col_blocks * BLOCK)
    tiles = tiles.view(row_blocks, BLOCK, col_blocks, BLOCK).transpose(1, 2)
    scale = compute_scale(tiles.abs().amax(dim=(-1, -2)), fp8_dtype, pow2_scales, amax_epsilon)
    scaled = (tiles * scale[..., None, None]).transpose(1, 2).reshape(row_blocks * BLOCK, col_blocks * BLOCK)
    return BlockQuantized(scaled[:n, :k].to(fp8_dtype), 1.0 / scale)


def dequantize_1x128(q: BlockQuantized) -> torch.Tensor:
    m, k = q.data.shape
    scale_inv = q.scale_inv.repeat_interleave(BLOCK, dim=1)[:, :k]
    return q.data.float() * scale_inv


def dequantize_128x128(q: BlockQuantized) -> torch.Tensor:
    n, k = q.data.shape
    scale_inv = q.scale_inv.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)[:n, :k]
    return q.data.float() * scale_inv


def quantize_grouped_columnwise(
    x: torch.Tensor, splits: list[int], fp8_dtype: torch.dtype, pow2_scales: bool, amax_epsilon: float = 0.0
) -> list[BlockQuantized]:
    """Per group e, the transposed copy X_e^T [K, m_e] quantized 1x128 along m_e.

    This is the operand layout the wgrad GEMM reduces over (the grouped dim);
    blocks restart at each group's first row. Empty groups give empty data.
    """
    out, start = [], 0
    for count in splits:
        group = x[start : start + count].t()
        out.append(quantize_1x128(group, fp8_dtype, pow2_scales, amax_epsilon))
        start += count
    return out
