"""Tensor helpers shared by the op families: weight layouts, group offsets, accumulation dtype, row gathers."""

from __future__ import annotations

from typing import Sequence

import torch


def is_grouped_layout(weights: Sequence[torch.Tensor]) -> bool:
    """True for ``[W]`` with W of shape [E, N, K]; False for E tensors [N, K]."""
    return len(weights) == 1 and weights[0].dim() == 3


def num_groups_of(weights: Sequence[torch.Tensor]) -> int:
    return weights[0].shape[0] if is_grouped_layout(weights) else len(weights)


def expert_matrix(weights: Sequence[torch.Tensor], expert: int) -> torch.Tensor:
    return weights[0][expert] if is_grouped_layout(weights) else weights[expert]


def stacked(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """The weights as one [E, N, K] tensor (a copy for the separate layout)."""
    return weights[0] if is_grouped_layout(weights) else torch.stack(list(weights))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation precision: float64 stays float64, the rest use float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def end_offsets(m_splits: torch.Tensor, total_rows: int) -> torch.Tensor:
    """Inclusive prefix sums of the counts, clamped like the core's setup kernel.

    Negative counts count as zero and no group extends past ``total_rows``, so a
    wrong ``m_splits`` never makes a kernel read past the buffers. No host sync.
    """
    counts = m_splits.to(torch.int64).clamp(min=0, max=total_rows)
    return torch.cumsum(counts, dim=0).clamp(max=total_rows)


def offsets_with_zero(m_splits: torch.Tensor, total_rows: int) -> torch.Tensor:
    """``[0, end_0, end_1, ...]``: the E + 1 group boundaries as int64."""
    ends = end_offsets(m_splits, total_rows)
    return torch.cat([ends.new_zeros(1), ends])


def zero_rows_past_splits_(out: torch.Tensor, m_splits: torch.Tensor) -> torch.Tensor:
    """Zeros the rows of ``out`` at or past the sum of ``m_splits`` (clamped as in
    :func:`end_offsets`), in place, with device ops only (no host sync; capturable)."""
    rows = out.shape[0]
    if rows == 0 or out.numel() == 0:
        return out
    end = end_offsets(m_splits, rows)[-1]
    past = torch.arange(rows, device=out.device) >= end
    return out.masked_fill_(past.view(-1, *([1] * (out.dim() - 1))), 0)


def gather_rows(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Row ``index[r]`` of ``source`` for every r, zeros where the index is outside [0, rows).

    What the gathered GEMMs read (``grouped_fprop_gathered`` and friends), made
    into a tensor: backends without gathered kernels run their plain GEMM on it.
    """
    rows = source.shape[0]
    if rows == 0:
        return source.new_zeros(index.shape[0], *source.shape[1:])
    valid = (index >= 0) & (index < rows)
    picked = source.index_select(0, index.clamp(0, rows - 1).to(torch.int64))
    return torch.where(valid.view(-1, *([1] * (source.dim() - 1))), picked, picked.new_zeros(()))


def gathered_operands(dy, dy_index, x, x_index) -> tuple[torch.Tensor, torch.Tensor]:
    """A gathered wgrad's operands made into tensors: each one's rows gathered where it has an index."""
    return (
        dy if dy_index is None else gather_rows(dy, dy_index),
        x if x_index is None else gather_rows(x, x_index),
    )


def gemm_of_gathered_rows(backend, kind: str, source, index, weights, m_splits, out_dtype) -> torch.Tensor:
    """A gathered fprop (``kind`` "fprop") or dgrad ("dgrad") where ``backend`` (a GEMM backend module) has no
    gathered kernel: the rows gathered into a copy, the plain GEMM, and the rows past the splits zeroed, as
    the gathered kernels leave them."""
    rows = gather_rows(source, index)
    if kind == "fprop":
        out = backend.fprop(rows, weights, m_splits, None, out_dtype)
    else:
        out = backend.dgrad(rows, weights, m_splits, out_dtype)
    return backend.zero_rows_past_splits(out, m_splits)
