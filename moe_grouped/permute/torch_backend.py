"""The ``torch`` permutation backend: stable argsorts and index ops.

Graph-safe: nothing reads the routing on the host and every shape is static.
Copies dropped past an expert's capacity or for an expert index outside
[0, E) (``row_id_map`` -1) are handled
without host sync: their gathers read a valid row with weight 0, their
scatters go to a spare row that is cut off.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._tensors import compute_dtype

SUPPORTED_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _positions(order: torch.Tensor) -> torch.Tensor:
    """The inverse permutation: where each element went in ``order``."""
    ranks = torch.arange(order.shape[0], dtype=torch.int64, device=order.device)
    return torch.empty_like(order).scatter_(0, order, ranks)


def index(
    experts: torch.Tensor,
    probs: Optional[torch.Tensor],
    num_experts: int,
    capacity: int,
    pad_to_capacity: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    flat = experts.reshape(-1).to(torch.int64)
    # An expert index outside [0, E) is a dropped copy: it goes to a spare
    # bucket E, sorted after every expert, never counted or given a row.
    valid = (flat >= 0) & (flat < num_experts)
    flat = torch.where(valid, flat, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    if capacity < 0:
        rows = _positions(torch.argsort(flat, stable=True))  # rows in (expert, copy) order
        return torch.where(valid, rows, -1), counts[:num_experts]
    # Each copy's rank among its expert's copies in the order of priority:
    # copy order, or probability descending (ties: copy order).
    if probs is None:
        order = torch.argsort(flat, stable=True)
    else:
        by_prob = torch.argsort(-probs.reshape(-1), stable=True)
        order = by_prob.index_select(0, torch.argsort(flat.index_select(0, by_prob), stable=True))
    starts = torch.cumsum(counts, 0) - counts
    rank = _positions(order) - starts.index_select(0, flat)
    kept = (rank < capacity) & valid
    # Kept copies in (expert, copy) order first, the dropped ones after them.
    position = _positions(torch.argsort(torch.where(kept, flat, num_experts), stable=True))
    kept_counts = counts[:num_experts].clamp(max=capacity)
    if pad_to_capacity:
        kept_starts = torch.cumsum(kept_counts, 0) - kept_counts
        kept_flat = torch.where(kept, flat, 0)
        rows = kept_flat * capacity + position - kept_starts.index_select(0, kept_flat)
        m_splits = torch.full_like(kept_counts, capacity)
    else:
        rows, m_splits = position, kept_counts
    return torch.where(kept, rows, -1), m_splits


def permute_rows(
    x: torch.Tensor, row_id_map: torch.Tensor, top_k: int, num_rows: int, zero_unmapped: bool
) -> torch.Tensor:
    num_tokens = x.shape[0]
    copies = torch.arange(row_id_map.shape[0], dtype=torch.int64, device=x.device)
    # The token each row copies; num_tokens (a zero row appended to x) for
    # rows no copy maps to. Dropped copies write to a spare last entry. Even
    # dropless (zero_unmapped False) some rows may have no copy: those of
    # copies dropped for an expert index outside [0, E).
    target = torch.where(_mapped(row_id_map, num_rows), row_id_map, num_rows)
    source = torch.full((num_rows + 1,), num_tokens, dtype=torch.int64, device=x.device)
    source = source.scatter_(0, target, copies // top_k)[:num_rows]
    return torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, source)


def _mapped(row_id_map: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Copies with a row in [0, num_rows); the others (-1: dropped; anything else: a bad map) add nothing."""
    return (row_id_map >= 0) & (row_id_map < num_rows)


def _gather_copies(y: torch.Tensor, row_id_map: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T, top_k, H] in the accumulation dtype: each copy's row (row 0 for a dropped copy)."""
    acc = compute_dtype(y.dtype)
    if y.shape[0] == 0:  # every copy dropped (capacity 0)
        return y.new_zeros(row_id_map.shape[0] // top_k, top_k, y.shape[1], dtype=acc)
    rows = torch.where(_mapped(row_id_map, y.shape[0]), row_id_map, 0)
    return y.index_select(0, rows).view(-1, top_k, y.shape[1]).to(acc)


def unpermute_rows(
    y: torch.Tensor, row_id_map: torch.Tensor, weights: Optional[torch.Tensor], top_k: int
) -> torch.Tensor:
    acc = compute_dtype(y.dtype)
    gathered = _gather_copies(y, row_id_map, top_k)
    kept = _mapped(row_id_map, y.shape[0]).view(-1, top_k, 1)
    if weights is None:
        gathered = torch.where(kept, gathered, 0)
    else:  # a dropped copy's weight is 0
        gathered = gathered * torch.where(kept, weights.to(acc).unsqueeze(-1), 0)
    return gathered.sum(dim=1).to(y.dtype)


def unpermute_rows_backward(
    dout: torch.Tensor, y: torch.Tensor, row_id_map: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    acc = compute_dtype(y.dtype)
    top_k = weights.shape[1]
    num_rows = y.shape[0]
    grad = dout.to(acc).unsqueeze(1)  # [T, 1, H]
    per_copy = (weights.to(acc).unsqueeze(-1) * grad).to(y.dtype).view(-1, y.shape[1])
    mapped = _mapped(row_id_map, num_rows)
    target = torch.where(mapped, row_id_map, num_rows)  # dropped copies: the spare row
    dy = y.new_zeros(num_rows + 1, y.shape[1]).index_copy_(0, target, per_copy)[:num_rows]
    kept = mapped.view(-1, top_k)
    dweights = (_gather_copies(y, row_id_map, top_k) * grad).sum(dim=-1)
    return dy, torch.where(kept, dweights, 0).to(weights.dtype)


def source_rows(row_id_map: torch.Tensor, top_k: int, num_rows: int) -> torch.Tensor:
    """[num_rows] int32: the token of the copy at each row, -1 where none is (see moe_grouped.permute.source_rows)."""
    token = torch.arange(row_id_map.shape[0], device=row_id_map.device, dtype=torch.int32) // top_k
    # -1 (dropped) lands on the spare slot num_rows: remainder takes the divisor's sign.
    target = row_id_map.to(torch.int64).remainder(num_rows + 1)
    source = torch.full((num_rows + 1,), -1, dtype=torch.int32, device=row_id_map.device)
    return source.scatter_(0, target, token)[:num_rows]
