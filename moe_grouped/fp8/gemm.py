"""FP8 block-scaled grouped GEMMs: the core's CUTLASS SM90 kernels, and a
reference that dequantizes and multiplies in float32.

The operands are the quantizers' outputs (see :mod:`moe_grouped.fp8.quantize`):

- fprop ``y = x . W^T``: ``x`` row-wise 1x128 [M, K]; ``w`` 128x128 [E, N, K].
- dgrad ``dx = dy . W``: ``dy`` row-wise 1x128 [M, N]; ``wt`` the 128x128
  transposed weights [E, K, N].
- wgrad ``dW_e = dy_e^T . x_e``: ``dyt`` and ``xt`` in the grouped column-wise
  layout (data [N or K, padded rows], scales [scale rows, N or K]).

Products accumulate in float32 and are promoted with both block scales at
every 128-deep block of the reduction, so the reference (exact float32 dot
products of the dequantized operands) differs from the kernels only by
float32 summation order. Everything reads ``m_splits`` on the device only
and can be captured in CUDA graphs (the reference cannot: it reads the splits
on the host).

The GEMMs are ``torch.library`` custom ops (``torch.ops.moe_grouped.fp8_grouped_*``,
with fake implementations): the wrappers here check shapes, the ops hold the
ctypes calls and the reference's host reads, so they trace under
torch.compile with ``fullgraph=True``.
"""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import torch

from .._ops import custom_op, ops
from .. import _core
from ..gemm import cuda_backend
from .quantize_reference import (
    BlockQuantized,
    columnwise_groups,
    columnwise_padded_rows,
    columnwise_scale_rows,
    dequantize_128x128,
    dequantize_1x128,
)
from .recipe import BLOCK

BACKENDS = ("cuda", "reference")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# n and k must be multiples of this (16-byte fp8 rows for TMA).
ALIGNMENT = 16


def shape_supported(n: int, k: int) -> bool:
    """Whether the FP8 kernels take ``out_features=n`` and ``in_features=k``."""
    return n > 0 and k > 0 and n % ALIGNMENT == 0 and k % ALIGNMENT == 0


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"FP8 grouped GEMM backend must be one of {BACKENDS}, got {backend!r}")


def _check_fp8(name: str, q, dim: int, dtypes=(torch.float8_e4m3fn,)) -> None:
    if q.data.dtype not in dtypes:
        raise TypeError(f"{name} must hold {' or '.join(map(str, dtypes))} data, got {q.data.dtype}")
    if q.data.dim() != dim:
        raise ValueError(f"{name}.data must have {dim} dimensions, got shape {tuple(q.data.shape)}")
    if q.scale_inv.dtype != torch.float32:
        raise TypeError(f"{name}.scale_inv must be float32, got {q.scale_inv.dtype}")


def _check_scales(name: str, scale_inv: torch.Tensor, shape: tuple) -> None:
    if tuple(scale_inv.shape) != tuple(shape):
        raise ValueError(f"{name}.scale_inv must have shape {tuple(shape)}, got {tuple(scale_inv.shape)}")


def host_splits(m_splits: torch.Tensor) -> list[int]:
    """The counts on the host (a sync): for the reference path only."""
    return [int(c) for c in m_splits.tolist()]


def _core_operand(q) -> _core.Fp8Operand:
    for name, tensor in (("data", q.data), ("scale_inv", q.scale_inv)):
        if not tensor.is_contiguous():
            raise ValueError(f"the FP8 kernels need contiguous {name}, got strides {tuple(tensor.stride())}")
    return _core.Fp8Operand(q.data.data_ptr(), q.scale_inv.data_ptr(), _core.dtype_code(q.data.dtype))


def _problem(device: torch.device, m_splits, num_groups, total_rows, n, k, slot) -> _core.GroupedProblem:
    return _core.GroupedProblem(
        num_groups=num_groups,
        total_rows=total_rows,
        n=n,
        k=k,
        m_splits=m_splits.data_ptr(),
        splits_dtype=_core.dtype_code(m_splits.dtype),
        dtype=_core.dtype_code(torch.bfloat16),
        device=_core.device_index(device),
        workspace_slot=slot,
    )


def _require_core() -> ctypes.CDLL:
    lib = _core.require()
    if not _core.has(_core.CAP_GROUPED_GEMM_FP8_BLOCKWISE):
        raise RuntimeError("the CUDA core was built without its FP8 block-scaled grouped GEMMs")
    return lib


def workspace_size(kind: int, num_groups: int, n: int, k: int, device) -> int:
    """Bytes of workspace one FP8 GEMM of ``kind`` takes; reserve before capture."""
    lib = _require_core()
    device = torch.device(device)
    problem = _problem(device, torch.empty(0, dtype=torch.int64), num_groups, 0, n, k,
                       _core.SLOT_WGRAD if kind == _core.GEMM_WGRAD else _core.SLOT_FPROP_DGRAD)
    problem.m_splits = 1  # only checked for NULL
    size = ctypes.c_size_t()
    _core.check(lib.mg_grouped_fp8_workspace_size(ctypes.byref(problem), kind, ctypes.byref(size)))
    return size.value


def grouped_fprop_fp8(
    x: BlockQuantized,
    w: BlockQuantized,
    m_splits: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    backend: str = "cuda",
) -> torch.Tensor:
    """``y[M, N] = x . W_e^T (+ bias_e)`` per expert, in bfloat16."""
    _check_backend(backend)
    _check_fp8("x", x, 2)
    _check_fp8("w", w, 3)
    (m, k), (e, n, wk) = x.data.shape, w.data.shape
    if wk != k:
        raise ValueError(f"x has {k} columns but the weights are [E, N, K] = {tuple(w.data.shape)}")
    _check_scales("x", x.scale_inv, (m, -(-k // BLOCK)))
    _check_scales("w", w.scale_inv, (e, -(-n // BLOCK), -(-k // BLOCK)))
    if bias is not None and tuple(bias.shape) != (e, n):
        raise ValueError(f"bias must have shape {(e, n)}, got {tuple(bias.shape)}")
    return ops.fp8_grouped_fprop(x.data, x.scale_inv, w.data, w.scale_inv, m_splits, bias, backend)


@custom_op("fp8_grouped_fprop", mutates_args=())
def _fprop_op(
    x_data: torch.Tensor,
    x_scale_inv: torch.Tensor,
    w_data: torch.Tensor,
    w_scale_inv: torch.Tensor,
    m_splits: torch.Tensor,
    bias: Optional[torch.Tensor],
    backend: str,
) -> torch.Tensor:
    x, w = BlockQuantized(x_data, x_scale_inv), BlockQuantized(w_data, w_scale_inv)
    (m, k), (e, n, _) = x.data.shape, w.data.shape
    if backend == "reference":
        weights = torch.stack([dequantize_128x128(BlockQuantized(w.data[g], w.scale_inv[g])) for g in range(e)])
        y = _reference_rowwise(dequantize_1x128(x), weights.transpose(1, 2), host_splits(m_splits), n)
        if bias is not None:
            y += torch.repeat_interleave(bias.float(), m_splits.to(bias.device), dim=0, output_size=m)
        return y.to(torch.bfloat16)
    lib = _require_core()
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.data.device)
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    problem = _problem(x.data.device, m_splits, e, m, n, k, _core.SLOT_FPROP_DGRAD)
    _core.check(
        lib.mg_grouped_fp8_fprop(
            ctypes.byref(problem), _core_operand(x), _core_operand(w),
            bias.data_ptr() if bias is not None else None, y.data_ptr(), _core.stream_handle(y.device),
        )
    )
    return y


@_fprop_op.register_fake
def _(x_data, x_scale_inv, w_data, w_scale_inv, m_splits, bias, backend):
    return x_data.new_empty(x_data.shape[0], w_data.shape[1], dtype=torch.bfloat16)


def grouped_dgrad_fp8(
    dy: BlockQuantized, wt: BlockQuantized, m_splits: torch.Tensor, *, backend: str = "cuda"
) -> torch.Tensor:
    """``dx[M, K] = dy . W_e`` per expert, in bfloat16, from the transposed weights."""
    _check_backend(backend)
    _check_fp8("dy", dy, 2, FP8_DTYPES)
    _check_fp8("wt", wt, 3)
    (m, n), (e, k, wn) = dy.data.shape, wt.data.shape
    if wn != n:
        raise ValueError(f"dy has {n} columns but the transposed weights are [E, K, N] = {tuple(wt.data.shape)}")
    _check_scales("dy", dy.scale_inv, (m, -(-n // BLOCK)))
    _check_scales("wt", wt.scale_inv, (e, -(-k // BLOCK), -(-n // BLOCK)))
    return ops.fp8_grouped_dgrad(dy.data, dy.scale_inv, wt.data, wt.scale_inv, m_splits, backend)


@custom_op("fp8_grouped_dgrad", mutates_args=())
def _dgrad_op(
    dy_data: torch.Tensor,
    dy_scale_inv: torch.Tensor,
    wt_data: torch.Tensor,
    wt_scale_inv: torch.Tensor,
    m_splits: torch.Tensor,
    backend: str,
) -> torch.Tensor:
    dy, wt = BlockQuantized(dy_data, dy_scale_inv), BlockQuantized(wt_data, wt_scale_inv)
    (m, n), (e, k, _) = dy.data.shape, wt.data.shape
    if backend == "reference":
        weights = torch.stack([dequantize_128x128(BlockQuantized(wt.data[g], wt.scale_inv[g])) for g in range(e)])
        return _reference_rowwise(dequantize_1x128(dy), weights.transpose(1, 2), host_splits(m_splits), k).to(
            torch.bfloat16
        )
    lib = _require_core()
    dx = torch.empty(m, k, dtype=torch.bfloat16, device=dy.data.device)
    problem = _problem(dy.data.device, m_splits, e, m, n, k, _core.SLOT_FPROP_DGRAD)
    _core.check(
        lib.mg_grouped_fp8_dgrad(
            ctypes.byref(problem), _core_operand(dy), _core_operand(wt), dx.data_ptr(), _core.stream_handle(dx.device)
        )
    )
    return dx


@_dgrad_op.register_fake
def _(dy_data, dy_scale_inv, wt_data, wt_scale_inv, m_splits, backend):
    return dy_data.new_empty(dy_data.shape[0], wt_data.shape[1], dtype=torch.bfloat16)


def grouped_wgrad_fp8(
    dyt: BlockQuantized,
    xt: BlockQuantized,
    m_splits: torch.Tensor,
    out: Sequence[torch.Tensor],
    *,
    total_rows: int,
    accumulate: bool = False,
    backend: str = "cuda",
) -> None:
    """``dW_e = dy_e^T . x_e`` into ``out`` (``[dW]`` of shape [E, N, K], or E
    tensors [N, K]), float32 or bfloat16; ``+=`` with ``accumulate``.

    ``dyt`` and ``xt`` are grouped column-wise operands of the same
    ``m_splits`` over ``total_rows`` tokens. A group without tokens gets
    zeros, or is left untouched when accumulating.
    """
    _check_backend(backend)
    _check_fp8("dyt", dyt, 2, FP8_DTYPES)
    _check_fp8("xt", xt, 2)
    n, k = dyt.data.shape[0], xt.data.shape[0]
    num_groups = int(m_splits.shape[0])
    padded, scale_rows = columnwise_padded_rows(total_rows, num_groups), columnwise_scale_rows(total_rows, num_groups)
    for name, q, cols in (("dyt", dyt, n), ("xt", xt, k)):
        if tuple(q.data.shape) != (cols, padded):
            raise ValueError(
                f"{name}.data must have shape {(cols, padded)} (column-wise layout of {total_rows} rows "
                f"in {num_groups} groups), got {tuple(q.data.shape)}"
            )
        _check_scales(name, q.scale_inv, (scale_rows, cols))
    targets = list(out)
    grouped = len(targets) == 1 and targets[0].dim() == 3
    shape = (num_groups, n, k) if grouped else (n, k)
    if (len(targets) != (1 if grouped else num_groups)) or any(tuple(t.shape) != shape for t in targets):
        raise ValueError(f"out must be [dW] of shape {(num_groups, n, k)} or {num_groups} tensors of shape {(n, k)}")
    out_dtype = targets[0].dtype
    if out_dtype not in (torch.float32, torch.bfloat16) or any(t.dtype != out_dtype for t in targets):
        raise TypeError(f"wgrad outputs must all be float32 or all bfloat16, got {[t.dtype for t in targets]}")
    ops.fp8_grouped_wgrad_(
        dyt.data, dyt.scale_inv, xt.data, xt.scale_inv, m_splits, targets, total_rows, accumulate, backend
    )


@custom_op("fp8_grouped_wgrad_", mutates_args=("out",))
def _wgrad_op(
    dyt_data: torch.Tensor,
    dyt_scale_inv: torch.Tensor,
    xt_data: torch.Tensor,
    xt_scale_inv: torch.Tensor,
    m_splits: torch.Tensor,
    out: list[torch.Tensor],
    total_rows: int,
    accumulate: bool,
    backend: str,
) -> None:
    dyt, xt = BlockQuantized(dyt_data, dyt_scale_inv), BlockQuantized(xt_data, xt_scale_inv)
    grouped = len(out) == 1 and out[0].dim() == 3
    if backend == "reference":
        _reference_wgrad(dyt, xt, host_splits(m_splits), out, grouped, accumulate)
        return
    lib = _require_core()
    n, k, num_groups = dyt.data.shape[0], xt.data.shape[0], m_splits.shape[0]
    problem = _problem(dyt.data.device, m_splits, num_groups, total_rows, n, k, _core.SLOT_WGRAD)
    _core.check(
        lib.mg_grouped_fp8_wgrad(
            ctypes.byref(problem), _core_operand(dyt), _core_operand(xt),
            cuda_backend.group_operand(out), _core.dtype_code(out[0].dtype), int(bool(accumulate)),
            _core.stream_handle(out[0].device),
        )
    )


@_wgrad_op.register_fake
def _(dyt_data, dyt_scale_inv, xt_data, xt_scale_inv, m_splits, out, total_rows, accumulate, backend):
    return None


def _reference_rowwise(a: torch.Tensor, b_kn: torch.Tensor, splits: list[int], n: int) -> torch.Tensor:
    """Per group, float32 ``a[rows of e] @ b_kn[e]``."""
    out = torch.zeros(a.shape[0], n, dtype=torch.float32, device=a.device)
    start = 0
    for g, count in enumerate(splits):
        if count:
            out[start : start + count] = a[start : start + count] @ b_kn[g]
        start += count
    return out


def _reference_wgrad(dyt, xt, splits, targets, grouped: bool, accumulate: bool) -> None:
    for g, (dy_g, x_g) in enumerate(zip(columnwise_groups(dyt, splits), columnwise_groups(xt, splits))):
        target = targets[0][g] if grouped else targets[g]
        if splits[g] == 0:
            if not accumulate:
                target.zero_()
            continue
        grad = dequantize_1x128(dy_g) @ dequantize_1x128(x_g).t()
        if accumulate:
            target.copy_((target.float() + grad).to(target.dtype))
        else:
            target.copy_(grad.to(target.dtype))
