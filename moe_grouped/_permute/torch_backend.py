"""The ``torch`` permutation backend: a stable argsort and index ops.

Graph-safe: nothing reads the routing on the host and every shape is static.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..ops.common import compute_dtype

SUPPORTED_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def index(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat = experts.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)  # rows in (expert, copy) order
    copies = torch.arange(flat.shape[0], dtype=torch.int64, device=flat.device)
    row_id_map = torch.empty_like(order).scatter_(0, order, copies)
    m_splits = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    m_splits.scatter_add_(0, flat, torch.ones_like(flat))
    return row_id_map, m_splits


def _source_tokens(row_id_map: torch.Tensor, top_k: int) -> torch.Tensor:
    """The token each permuted row copies (the inverse of ``row_id_map``)."""
    copies = torch.arange(row_id_map.shape[0], dtype=torch.int64, device=row_id_map.device)
    return torch.empty_like(row_id_map).scatter_(0, row_id_map, copies // top_k)


def permute_rows(x: torch.Tensor, row_id_map: torch.Tensor, top_k: int) -> torch.Tensor:
    return x.index_select(0, _source_tokens(row_id_map, top_k))


def unpermute_rows(
    y: torch.Tensor, row_id_map: torch.Tensor, weights: Optional[torch.Tensor], top_k: int
) -> torch.Tensor:
    acc = compute_dtype(y.dtype)
    gathered = y.index_select(0, row_id_map).view(-1, top_k, y.shape[1]).to(acc)
    if weights is not None:
        gathered = gathered * weights.to(acc).unsqueeze(-1)
    return gathered.sum(dim=1).to(y.dtype)


def unpermute_rows_backward(
    dout: torch.Tensor, y: torch.Tensor, row_id_map: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    acc = compute_dtype(y.dtype)
    top_k = weights.shape[1]
    grad = dout.to(acc).unsqueeze(1)  # [T, 1, H]
    per_copy = (weights.to(acc).unsqueeze(-1) * grad).to(y.dtype).view(-1, y.shape[1])
    dy = torch.zeros_like(y).index_copy_(0, row_id_map, per_copy)
    gathered = y.index_select(0, row_id_map).view(-1, top_k, y.shape[1]).to(acc)
    dweights = (gathered * grad).sum(dim=-1).to(weights.dtype)
    return dy, dweights
