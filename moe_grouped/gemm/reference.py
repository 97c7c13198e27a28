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


def fprop(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    m_splits: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
    *,
    zero_tail: bool = True,
) -> torch.Tensor:
    """Rows past the splits are zeros whatever ``zero_tail`` says (it lets other backends skip them)."""
    acc = compute_dtype(x.dtype)
    n = expert_matrix(weights, 0).shape[0]
    y = torch.zeros(x.shape[0], n, dtype=out_dtype, device=x.device)  # rows past the splits stay 0
    for e, (start, end) in enumerate(_host_bounds(m_splits, x.shape[0])):
        rows = x[start:end].to(acc) @ expert_matrix(weights, e).to(acc).t()
        if bias is not None:
            rows = rows + bias[e].to(acc)
        y[start:end] = rows.to(out_dtype)
    return y


def dgrad(
    dy: torch.Tensor, weights: Sequence[torch.Tensor], m_splits: torch.Tensor, out_dtype: torch.dtype, *,
    zero_tail: bool = True,
) -> torch.Tensor:
    """Rows past the splits are zeros whatever ``zero_tail`` says."""
    acc = compute_dtype(dy.dtype)
    k = expert_matrix(weights, 0).shape[1]
    dx = torch.zeros(dy.shape[0], k, dtype=out_dtype, device=dy.device)  # rows past the splits stay 0
    for e, (start, end) in enumerate(_host_bounds(m_splits, dy.shape[0])):
        dx[start:end] = (dy[start:end].to(acc) @ expert_matrix(weights, e).to(acc)).to(out_dtype)
    return dx


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


__all__ = ["fprop", "dgrad", "wgrad", "dbias", "num_groups_of"]
