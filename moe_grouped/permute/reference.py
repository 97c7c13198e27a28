"""The ``reference`` permutation backend: plain loops, the test oracle.

Reads the expert indices on the host (a synchronisation), so it cannot run
during CUDA graph capture.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._tensors import compute_dtype

SUPPORTED_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _refuse_capture(tensor: torch.Tensor) -> None:
    if tensor.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "the reference backend reads the routing on the host and cannot run during CUDA graph "
            "capture; use backend='torch' or backend='cuda'"
        )


def index(
    experts: torch.Tensor,
    probs: Optional[torch.Tensor],
    num_experts: int,
    capacity: int,
    pad_to_capacity: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    _refuse_capture(experts)
    buckets: list[list[int]] = [[] for _ in range(num_experts)]
    for copy, expert in enumerate(experts.reshape(-1).tolist()):
        if 0 <= expert < num_experts:  # permute() refuses the others; called directly, they are dropped
            buckets[expert].append(copy)  # copies in increasing order: a stable sort
    if capacity >= 0:
        if probs is not None:  # keep the most probable copies, ties to the lower copy
            p = probs.reshape(-1).tolist()
            kept = [set(sorted(bucket, key=lambda c: (-p[c], c))[:capacity]) for bucket in buckets]
            buckets = [[c for c in bucket if c in keep] for bucket, keep in zip(buckets, kept)]
        else:  # keep the first copies
            buckets = [bucket[:capacity] for bucket in buckets]
    row_id_map = [-1] * experts.numel()
    row = 0
    for expert, bucket in enumerate(buckets):
        if pad_to_capacity:
            row = expert * capacity
        for copy in bucket:
            row_id_map[copy] = row
            row += 1
    counts = [capacity if pad_to_capacity else len(b) for b in buckets]
    device = experts.device
    return (
        torch.tensor(row_id_map, dtype=torch.int64, device=device),
        torch.tensor(counts, dtype=torch.int64, device=device),
    )


def permute_rows(
    x: torch.Tensor, row_id_map: torch.Tensor, top_k: int, num_rows: int, zero_unmapped: bool
) -> torch.Tensor:
    _refuse_capture(x)
    permuted = x.new_zeros(num_rows, x.shape[1])
    for j in range(top_k):
        rows = row_id_map[j::top_k]
        kept = rows >= 0
        permuted[rows[kept]] = x[kept]
    return permuted


def unpermute_rows(
    y: torch.Tensor, row_id_map: torch.Tensor, weights: Optional[torch.Tensor], top_k: int
) -> torch.Tensor:
    _refuse_capture(y)
    acc = compute_dtype(y.dtype)
    out = torch.zeros(row_id_map.shape[0] // top_k, y.shape[1], dtype=acc, device=y.device)
    for j in range(top_k):
        rows = row_id_map[j::top_k]
        kept = rows >= 0
        contribution = y[rows[kept]].to(acc)
        if weights is not None:
            contribution = weights[kept, j : j + 1].to(acc) * contribution
        out[kept] += contribution
    return out.to(y.dtype)


def unpermute_rows_backward(
    dout: torch.Tensor, y: torch.Tensor, row_id_map: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    _refuse_capture(dout)
    acc = compute_dtype(y.dtype)
    top_k = weights.shape[1]
    dy = torch.zeros_like(y)
    dweights = torch.zeros_like(weights)
    for j in range(top_k):
        rows = row_id_map[j::top_k]
        kept = rows >= 0
        grad = dout[kept].to(acc)
        dy[rows[kept]] = (weights[kept, j : j + 1].to(acc) * grad).to(y.dtype)
        dweights[kept, j] = (grad * y[rows[kept]].to(acc)).sum(-1).to(weights.dtype)
    return dy, dweights
