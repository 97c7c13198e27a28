"""The ``torch`` backend: ``torch._grouped_mm`` with device offsets.

Graph-safe: the group boundaries are computed on the device from
``m_splits`` and nothing reads them on the host. The separate-weights layout
is stacked into one [E, N, K] tensor per call (a copy), so that layout is
slower here than in the ``cuda`` backend. ``torch._grouped_mm`` leaves the
rows past the last group unwritten; :func:`zero_rows_past_splits` (a masked
pass over the output) zeros them where the grouped ops ask for it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .._tensors import (
    end_offsets,
    expert_matrix,
    is_grouped_layout,
    offsets_with_zero,
    stacked,
    zero_rows_past_splits_,
)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_row_bytes(dtype: torch.dtype, **features: int) -> None:
    """torch._grouped_mm needs 16-byte row strides; say which feature count breaks that."""
    size = torch.empty(0, dtype=dtype).element_size()
    bad = {name: value for name, value in features.items() if (value * size) % 16}
    if bad:
        listed = ", ".join(f"{name}={value}" for name, value in bad.items())
        raise ValueError(
            f"backend 'torch' (torch._grouped_mm) needs rows of a multiple of 16 bytes: {listed} "
            f"{dtype} elements is not; use feature counts that are multiples of {16 // size}, or "
            "backend='reference'"
        )


# torch._grouped_mm on CUDA launches one thread per group in a single block and refuses 1024 or more.
MAX_CUDA_GROUPS = 1023


def _check_group_count(m_splits: torch.Tensor) -> None:
    """Refused with or without rows, so a layer does not start failing when tokens arrive."""
    if m_splits.is_cuda and m_splits.shape[0] > MAX_CUDA_GROUPS:
        raise ValueError(
            f"backend 'torch' (torch._grouped_mm) takes at most {MAX_CUDA_GROUPS} experts on CUDA; m_splits "
            f"holds {m_splits.shape[0]} counts: use backend='cuda'"
        )


def _offs(m_splits: torch.Tensor, total_rows: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    if dtype == torch.float32 and m_splits.is_cuda and torch.cuda.is_current_stream_capturing():
        # torch._grouped_mm's float32 path copies the offsets to the host.
        raise RuntimeError(
            "backend 'torch' cannot be captured in float32 (torch._grouped_mm reads the offsets on "
            "the host there); use bfloat16/float16 or backend='cuda'"
        )
    return end_offsets(m_splits, total_rows).to(torch.int32)


def _group_of_rows(m_splits: torch.Tensor, total_rows: int, device: torch.device) -> torch.Tensor:
    """Expert index of each of the ``total_rows`` rows (rows past the splits go to the last)."""
    rows = torch.arange(total_rows, device=device, dtype=torch.int64)
    groups = torch.searchsorted(end_offsets(m_splits, total_rows), rows, right=True)
    return groups.clamp_(max=m_splits.shape[0] - 1)


zero_rows_past_splits = zero_rows_past_splits_


def fprop(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    m_splits: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    _check_group_count(m_splits)
    w = stacked(weights)
    _check_row_bytes(x.dtype, out_features=w.shape[1], in_features=w.shape[2])
    if x.shape[0] == 0:  # torch._grouped_mm refuses an empty operand; the row count is static
        return x.new_zeros(0, w.shape[1], dtype=out_dtype)
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=_offs(m_splits, x.shape[0], x.dtype))
    if bias is not None:
        y = y + bias.index_select(0, _group_of_rows(m_splits, x.shape[0], x.device))
    return y.to(out_dtype)


def dgrad(
    dy: torch.Tensor, weights: Sequence[torch.Tensor], m_splits: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    _check_group_count(m_splits)
    _check_row_bytes(dy.dtype, out_features=dy.shape[1], in_features=stacked(weights).shape[2])
    if dy.shape[0] == 0:  # torch._grouped_mm refuses an empty operand
        return dy.new_zeros(0, stacked(weights).shape[2], dtype=out_dtype)
    dx = torch._grouped_mm(dy, stacked(weights), offs=_offs(m_splits, dy.shape[0], dy.dtype))
    return dx.to(out_dtype)


def wgrad(
    dy: torch.Tensor,
    x: torch.Tensor,
    m_splits: torch.Tensor,
    out: Sequence[torch.Tensor],
    accumulate: bool,
) -> None:
    _check_group_count(m_splits)
    _check_row_bytes(dy.dtype, out_features=dy.shape[1], in_features=x.shape[1])
    if dy.shape[0] == 0:  # no rows: every expert's gradient is zero (torch._grouped_mm refuses them)
        grads = dy.new_zeros(m_splits.shape[0], dy.shape[1], x.shape[1])
    else:
        grads = torch._grouped_mm(dy.t(), x, offs=_offs(m_splits, dy.shape[0], dy.dtype))
    # An expert with no tokens has a zero gradient; do not rely on the kernel
    # writing it (the reduction over its rows is empty).
    empty = (m_splits <= 0).view(-1, 1, 1)
    grads = grads.masked_fill(empty, 0)
    if is_grouped_layout(out):
        if accumulate:
            out[0].add_(grads.to(out[0].dtype))
        else:
            out[0].copy_(grads)
        return
    per_expert = [g.to(out[0].dtype) for g in grads.unbind(0)]
    if accumulate:
        torch._foreach_add_(list(out), per_expert)
    else:
        torch._foreach_copy_(list(out), per_expert)


def dbias(dy: torch.Tensor, m_splits: torch.Tensor, num_groups: int, out_dtype: torch.dtype) -> torch.Tensor:
    bounds = offsets_with_zero(m_splits, dy.shape[0])
    lengths = bounds[1:] - bounds[:-1]
    sums = torch.segment_reduce(dy.float(), "sum", lengths=lengths, axis=0, unsafe=True)
    return sums.to(out_dtype)


__all__ = ["fprop", "dgrad", "wgrad", "dbias", "zero_rows_past_splits", "expert_matrix"]
