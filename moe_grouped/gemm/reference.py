"""The ``reference`` backend: plain per-expert PyTorch loops.

Runs on any device. It reads the token counts on the host, so it synchronises
and cannot be captured in a CUDA graph; it is the oracle the other backends
are tested against.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .._tensors import compute_dtype, expert_matrix, num_groups_of, offsets_with_zero

SUPPORTED_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _host_bounds(m_splits: torch.Tensor, total_rows: int) -> list[tuple[int, int]]:
    if m_splits.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "the reference backend reads m_splits on the host and cannot run during CUDA graph "
            "capture; use backend='torch' or backend='cuda'"
        )
    bounds = offsets_with_zero(m_splits, total_rows).tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _per_expert(a: torch.Tensor, m_splits: torch.Tensor, cols: int, out_dtype: torch.dtype, rows_of) -> torch.Tensor:
    """[rows of ``a``, ``cols``] zeros in ``out_dtype`` where each expert e's rows are ``rows_of(e, its rows of
    ``a`` in the compute dtype)``: the rows past the splits stay zeros."""
    acc = compute_dtype(a.dtype)
    out = torch.zeros(a.shape[0], cols, dtype=out_dtype, device=a.device)
    for e, (start, end) in enumerate(_host_bounds(m_splits, a.shape[0])):
        out[start:end] = rows_of(e, a[start:end].to(acc)).to(out_dtype)
    return out


def zero_rows_past_splits(out: torch.Tensor, m_splits: torch.Tensor) -> torch.Tensor:
    """``out`` itself: :func:`fprop` and :func:`dgrad` start from zeros, so their rows past the splits are."""
    return out


def fprop(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    m_splits: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    def rows_of(e: int, rows: torch.Tensor) -> torch.Tensor:
        y = rows @ expert_matrix(weights, e).to(rows.dtype).t()
        return y if bias is None else y + bias[e].to(rows.dtype)

    return _per_expert(x, m_splits, expert_matrix(weights, 0).shape[0], out_dtype, rows_of)


def dgrad(
    dy: torch.Tensor, weights: Sequence[torch.Tensor], m_splits: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    return _per_expert(dy, m_splits, expert_matrix(weights, 0).shape[1], out_dtype,
                       lambda e, rows: rows @ expert_matrix(weights, e).to(rows.dtype))


def wgrad(
    dy: torch.Tensor,
    x: torch.Tensor,
    m_splits: torch.Tensor,
    out: Sequence[torch.Tensor],
    accumulate: bool,
) -> None:
    acc = compute_dtype(dy.dtype)
    for e, (start, end) in enumerate(_host_bounds(m_splits, dy.shape[0])):
        target = expert_matrix(out, e)
        if start == end:
            if not accumulate:
                target.zero_()
            continue
        grad = dy[start:end].to(acc).t() @ x[start:end].to(acc)
        if accumulate:
            target.add_(grad.to(target.dtype))
        else:
            target.copy_(grad)


def dbias(dy: torch.Tensor, m_splits: torch.Tensor, num_groups: int, out_dtype: torch.dtype) -> torch.Tensor:
    acc = compute_dtype(dy.dtype)
    out = torch.zeros(num_groups, dy.shape[1], dtype=out_dtype, device=dy.device)
    for e, (start, end) in enumerate(_host_bounds(m_splits, dy.shape[0])):
        if end > start:
            out[e] = dy[start:end].to(acc).sum(dim=0).to(out_dtype)
    return out


__all__ = ["fprop", "dgrad", "wgrad", "dbias", "zero_rows_past_splits", "num_groups_of"]
