"""The ``reference`` permutation backend: plain loops, the test oracle.

Reads the expert indices on the host (a synchronisation), so it cannot run
during CUDA graph capture.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..ops.common import compute_dtype

SUPPORTED_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _refuse_capture(tensor: torch.Tensor) -> None:
    if tensor.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "the reference backend reads the routing on the host and cannot run during CUDA graph "
            "capture; use backend='torch' or backend='cuda'"
        )


def index(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    _refuse_capture(experts)
    buckets: list[list[int]] = [[] for _ in range(num_experts)]
    for copy, expert in enumerate(experts.reshape(-1).tolist()):
        buckets[expert].append(copy)  # copies in increasing order: a stable sort
    row_id_map = [0] * experts.numel()
    row = 0
    for bucket in buckets:
        for copy in bucket:
            row_id_map[copy] = row
            row += 1
    device = experts.device
    return (
        torch.tensor(row_id_map, dtype=torch.int64, device=device),
        torch.tensor([len(b) for b in buckets], dtype=torch.int64, device=device),
    )


def permute_rows(x: torch.Tensor, row_id_map: torch.Tensor, top_k: int) -> torch.Tensor:
    _refuse_capture(x)
    permuted = x.new_zeros(row_id_map.shape[0], x.shape[1])
    for j in range(top_k):
        permuted[row_id_map[j::top_k]] = x
    return permuted


def unpermute_rows(
    y: torch.Tensor, row_id_map: torch.Tensor, weights: Optional[torch.Tensor], top_k: int
) -> torch.Tensor:
    _refuse_capture(y)
    acc = compute_dtype(y.dtype)
    out = torch.zeros(row_id_map.shape[0] // top_k, y.shape[1], dtype=acc, device=y.device)
    for j in range(top_k):
        rows = y[row_id_map[j::top_k]].to(acc)
        out += rows if weights is None else weights[:, j : j + 1].to(acc) * rows
    return out.to(y.dtype)


def unpermute_rows_backward(
    dout: torch.Tensor, y: torch.Tensor, row_id_map: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    _refuse_capture(dout)
    acc = compute_dtype(y.dtype)
    top_k = weights.shape[1]
    dy = torch.zeros_like(y)
    dweights = torch.empty_like(weights)
    for j in range(top_k):
        rows = row_id_map[j::top_k]
        dy[rows] = (weights[:, j : j + 1].to(acc) * dout.to(acc)).to(y.dtype)
        dweights[:, j] = (dout.to(acc) * y[rows].to(acc)).sum(-1).to(weights.dtype)
    return dy, dweights
