"""Grouped FP8 1x128 quantization on the GPU through the CUDA core.

Row-wise blocks serve the fprop and dgrad operands; the grouped column-wise
copy is the operand layout of a wgrad GEMM that reduces over each expert's
tokens (see :func:`quantize_columnwise_grouped`). Both read ``m_splits`` only
on the device and can be captured in CUDA graphs.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _checks, _core
from .quantize_reference import BlockQuantized, quantize_1x128
from .recipe import BLOCK

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _config(fp8_dtype: torch.dtype, pow2_scales: bool, amax_epsilon: float) -> _core.QuantizeConfig:
    if fp8_dtype not in _FP8_DTYPES:
        raise TypeError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")
    return _core.QuantizeConfig(_core.dtype_code(fp8_dtype), int(bool(pow2_scales)), float(amax_epsilon))


def _require_core(x: torch.Tensor) -> None:
    if not x.is_cuda:
        raise ValueError(f"the CUDA quantizer needs a CUDA tensor, got one on {x.device}")
    _core.require()
    if not _core.has(_core.CAP_FP8_QUANTIZE):
        raise RuntimeError("the CUDA core was built without its FP8 quantize kernels")


def quantize_rowwise(
    x: torch.Tensor, fp8_dtype: torch.dtype, pow2_scales: bool = True, amax_epsilon: float = 0.0
) -> BlockQuantized:
    """``x[M, K]`` -> fp8 data [M, K] and scale_inv [M, ceil(K / 128)].

    On CUDA tensors this runs the core's kernel; elsewhere the reference.
    """
    _checks.check_tensor("x", x, dim=2, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    if not x.is_cuda:
        return quantize_1x128(x, fp8_dtype, pow2_scales, amax_epsilon)
    _require_core(x)
    config = _config(fp8_dtype, pow2_scales, amax_epsilon)
    rows, cols = x.shape
    data = torch.empty(rows, cols, dtype=fp8_dtype, device=x.device)
    scale_inv = torch.empty(rows, -(-cols // BLOCK), dtype=torch.float32, device=x.device)
    _core.check(
        _core.lib.mg_quantize_rowwise_1x128(
            x.data_ptr(), _core.dtype_code(x.dtype), rows, cols, config,
            data.data_ptr(), scale_inv.data_ptr(), _core.stream_handle(x.device),
        )
    )
    return BlockQuantized(data, scale_inv)


def columnwise_scale_columns(rows: int, num_groups: int) -> int:
    """Width of the column-wise scale tensor: room for every group's blocks."""
    return -(-rows // BLOCK) + num_groups


def quantize_columnwise_grouped(
    x: torch.Tensor,
    m_splits: torch.Tensor,
    fp8_dtype: torch.dtype,
    pow2_scales: bool = True,
    amax_epsilon: float = 0.0,
    *,
    workspace_slot: int = _core.SLOT_WGRAD,
    out: Optional[BlockQuantized] = None,
) -> BlockQuantized:
    """Per expert e, ``X_e^T`` quantized in 1x128 blocks along its tokens.

    Returns data [K, M] (expert e in columns [o_e, o_e + m_e)) and scale_inv
    [K, ceil(M / 128) + E] (expert e's blocks in columns [b_e, b_e +
    ceil(m_e / 128)) with b_e = sum of ceil(m_j / 128) over j < e; columns past
    the last block are not written). ``out`` reuses buffers of those shapes.
    """
    _checks.check_tensor("x", x, dim=2, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    _require_core(x)
    rows, cols = x.shape
    num_groups = m_splits.shape[0] if isinstance(m_splits, torch.Tensor) else len(m_splits)
    splits = _checks.normalize_splits(m_splits, num_groups, rows, x.device)
    config = _config(fp8_dtype, pow2_scales, amax_epsilon)
    shapes = ((cols, rows), (cols, columnwise_scale_columns(rows, num_groups)))
    if out is None:
        out = BlockQuantized(
            torch.empty(shapes[0], dtype=fp8_dtype, device=x.device),
            torch.empty(shapes[1], dtype=torch.float32, device=x.device),
        )
    elif tuple(out.data.shape) != shapes[0] or tuple(out.scale_inv.shape) != shapes[1] or out.data.dtype != fp8_dtype:
        raise ValueError(
            f"out must hold data {shapes[0]} of {fp8_dtype} and scale_inv {shapes[1]}, got "
            f"{tuple(out.data.shape)} of {out.data.dtype} and {tuple(out.scale_inv.shape)}"
        )
    _core.check(
        _core.lib.mg_quantize_columnwise_grouped_1x128(
            x.data_ptr(), _core.dtype_code(x.dtype), rows, cols, splits.data_ptr(),
            _core.dtype_code(splits.dtype), num_groups, config, out.data.data_ptr(),
            out.scale_inv.data_ptr(), x.device.index, workspace_slot, _core.stream_handle(x.device),
        )
    )
    return out
