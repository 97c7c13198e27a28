"""The ``torch`` SwiGLU backend: the reference's composed ops, graph-safe.

The same values as the reference; the weighted backward sums ``m_splits`` on
the device instead of reading it on the host, so it can be captured.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import reference


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``[gate, up] = h.chunk(2, dim=-1)`` (the reference's composition)."""
    return reference.swiglu(h)


def weighted_backward_into(
    dh_u: torch.Tensor,
    g: torch.Tensor,
    weights: Optional[torch.Tensor],
    m_splits: Optional[torch.Tensor],
    dg: torch.Tensor,
    wh: torch.Tensor,
    dprob: torch.Tensor,
    zero_tail: bool = True,
) -> None:
    """The weighted SwiGLU backward into ``dg``, ``wh``, ``dprob``; the counts are summed on the device.
    Rows past the counts get zeros whatever ``zero_tail`` says (which lets the core skip them)."""
    rows = dh_u.shape[0]
    real_rows = rows if m_splits is None else m_splits.to(torch.int64).clamp(0, rows).sum().clamp(max=rows)
    reference.write_weighted_backward(dh_u, g, weights, real_rows, dg, wh, dprob)
