"""The ``cuda`` SwiGLU backend: the core's kernels (csrc/activation/).

One pass forward, one pass backward writing ``[d_gate, d_up]`` in place of a
concatenation; only ``h`` is kept for the backward. The weighted backward of
the fused experts path is one pass too (swiglu_weighted_backward.cu). They
round to the element type exactly where the composed torch ops store a
tensor. Graph-safe: no host reads, no allocations beyond the outputs.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _core
from ..graphs import nvtx

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _rows_ffn(h: torch.Tensor) -> tuple[int, int]:
    return h.shape[0], h.shape[1] // 2


def forward(h: torch.Tensor) -> torch.Tensor:
    """[rows, 2 * ffn] -> [rows, ffn]."""
    h = h.contiguous()
    rows, ffn = _rows_ffn(h)
    y = h.new_empty(rows, ffn)
    if y.numel() > 0:
        with nvtx.range("moe_grouped.swiglu"):
            _core.check(
                _core.require().mg_swiglu_forward(
                    h.data_ptr(), _core.dtype_code(h.dtype), rows, ffn, y.data_ptr(), _core.stream_handle(h.device)
                )
            )
    return y


def backward(dy: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """[d_gate, d_up] [rows, 2 * ffn] from dy [rows, ffn]."""
    dy, h = dy.contiguous(), h.contiguous()
    rows, ffn = _rows_ffn(h)
    dh = torch.empty_like(h)
    if dh.numel() > 0:
        with nvtx.range("moe_grouped.swiglu_backward"):
            _core.check(
                _core.require().mg_swiglu_backward(
                    dy.data_ptr(), h.data_ptr(), _core.dtype_code(h.dtype), rows, ffn, dh.data_ptr(),
                    _core.stream_handle(h.device),
                )
            )
    return dh


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
    """The weighted SwiGLU backward into ``dg``, ``wh``, ``dprob`` (which may be ``g``, ``dh_u``: in place).
    Rows past the sum of ``m_splits``: dprob 0, and dg, wh 0 with ``zero_tail`` (else not written)."""
    rows, ffn = dh_u.shape
    if rows == 0:
        return
    with nvtx.range("moe_grouped.swiglu_weighted_backward"):
        _core.check(
            _core.require().mg_swiglu_weighted_backward(
                dh_u.data_ptr(), g.data_ptr(), None if weights is None else weights.data_ptr(),
                None if m_splits is None else m_splits.data_ptr(),
                _core.dtype_code(m_splits.dtype if m_splits is not None else torch.int64),
                0 if m_splits is None else m_splits.shape[0],
                _core.dtype_code(g.dtype), rows, ffn, dg.data_ptr(), wh.data_ptr(), dprob.data_ptr(),
                int(zero_tail), _core.stream_handle(g.device),
            )
        )
