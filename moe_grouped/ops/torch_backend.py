"""The ``torch`` backend: ``torch._grouped_mm`` with device offsets.

Graph-safe: the group boundaries are computed on the device from
``m_splits`` and nothing reads them on the host. The separate-weights layout
is stacked into one [E, N, K] tensor per call (a copy), so that layout is
slower here than in the ``cuda`` backend.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .common import end_offsets, expert_matrix, is_grouped_layout, offsets_with_zero, stacked

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


def fprop(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    m_splits: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    w = stacked(weights)
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=_offs(m_splits, x.shape[0], x.dtype))
    if bias is not None:
        y = y + bias.index_select(0, _group_of_rows(m_splits, x.shape[0], x.device))
    return y.to(out_dtype)


def dgrad(
    dy: torch.Tensor, weights: Sequence[torch.Tensor], m_splits: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    dx = torch._grouped_mm(dy, stacked(weights), offs=_offs(m_splits, dy.shape[0], dy.dtype))
    return dx.to(out_dtype)


def wgrad(
    dy: torch.Tensor,
    x: torch.Tensor,
    m_splits: torch.Tensor,
    out: Sequence[torch.Tensor],
    accumulate: bool,
) -> None:
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


__all__ = ["fprop", "dgrad", "wgrad", "dbias", "expert_matrix"]
