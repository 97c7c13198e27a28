"""The ``reference`` SwiGLU backend: composed torch ops, the test oracle.

The weighted backward rounds to the element type exactly where the ``cuda``
kernel stores a value, so the two agree; it reads ``m_splits`` on the host
(a synchronisation), so it cannot run during CUDA graph capture.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .._tensors import compute_dtype


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``[gate, up] = h.chunk(2, dim=-1)``, differentiated by autograd."""
    gate, up = h.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


def weighted_backward(dh_u, g, weights, real_rows):
    """(dg, wh, dprob) composed from torch ops, rounding where the kernel rounds; rows past ``real_rows``
    (an int, or a 0-dim device tensor for no host sync) are zero."""
    dtype, acc = g.dtype, compute_dtype(g.dtype)
    ffn = dh_u.shape[1]
    gate_stored = g[:, :ffn]
    gate, up = gate_stored.to(acc), g[:, ffn:].to(acc)
    a = nn.functional.silu(gate_stored).to(acc)  # rounded like the forward's silu
    h = (a * up).to(dtype).to(acc)  # the forward's stored h
    du = dh_u.to(acc)
    w = weights.to(acc).unsqueeze(-1) if weights is not None else torch.ones((), dtype=acc, device=g.device)
    dprob = (du * h).sum(-1)
    wh = (w * h).to(dtype)
    d = (w * du).to(dtype).to(acc)
    s = torch.sigmoid(gate)
    d_a = (d * up).to(dtype).to(acc)
    dg = torch.cat([(d_a * s * (1 + gate * (1 - s))).to(dtype), (d * a).to(dtype)], dim=-1)
    real = (torch.arange(g.shape[0], device=g.device) < real_rows).unsqueeze(-1)
    return torch.where(real, dg, 0), torch.where(real, wh, 0), torch.where(real.squeeze(-1), dprob, 0)


def composed_backward_into(real_rows_of):
    """The ``weighted_backward_into`` of a backend that composes :func:`weighted_backward`, given how it
    finds the rows the counts cover: ``real_rows_of(m_splits, rows)``."""

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
        """The weighted SwiGLU backward into ``dg``, ``wh``, ``dprob`` (which may be ``g``, ``dh_u``).
        Rows past the counts get zeros whatever ``zero_tail`` says (which lets the core skip them)."""
        rows = dh_u.shape[0]
        real_rows = rows if m_splits is None else real_rows_of(m_splits, rows)
        for out, result in zip((dg, wh, dprob), weighted_backward(dh_u, g, weights, real_rows)):
            out.copy_(result)

    return weighted_backward_into


def _real_rows_read_on_the_host(m_splits: torch.Tensor, rows: int) -> int:
    """The plain way: the counts read on the host (a synchronisation)."""
    if m_splits.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "the reference backend reads m_splits on the host and cannot run during CUDA graph "
            "capture; use backend='torch' or backend='cuda'"
        )
    return min(sum(max(0, min(int(c), rows)) for c in m_splits.tolist()), rows)


weighted_backward_into = composed_backward_into(_real_rows_read_on_the_host)
