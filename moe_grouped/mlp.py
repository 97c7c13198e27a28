"""SwiGLU MLPs: ``GroupedMLP`` (one per expert, over permuted tokens) and a dense one.

SwiGLU: ``fc2(silu(gate) * up)`` with ``[gate, up] = fc1(x)``: fc1 has
``2 * ffn_hidden`` outputs, the first ``ffn_hidden`` are the gate and the
next ``ffn_hidden`` the up projection (Megatron's fused ``linear_fc1``
layout).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from . import _checks
from .activation import swiglu
from .grouped_linear import GroupedLinear


class GroupedMLP(nn.Module):
    """``num_experts`` SwiGLU MLPs over token-major input grouped by expert.

    ``forward(x, m_splits)``: ``x`` [M, hidden] with each expert's rows
    contiguous and in expert order (what :func:`moe_grouped.permute` gives),
    ``m_splits`` [E] tokens per expert (device tensor: graph-safe). Returns
    [M, hidden].

    ``fc1`` is a :class:`GroupedLinear` with ``2 * ffn_hidden`` outputs (gate
    and up fused), ``fc2`` one with ``hidden`` outputs. ``bias``,
    ``single_grouped_weight``, ``fuse_wgrad_accumulation``,
    ``delay_wgrad_compute``, ``dtype``, ``device`` and ``backend`` are passed
    to both (see :class:`GroupedLinear`).
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        ffn_hidden: int,
        *,
        bias: bool = False,
        single_grouped_weight: bool = False,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        dtype: Optional[torch.dtype] = None,
        device=None,
        backend: Optional[str] = None,
    ):
        super().__init__()
        options = dict(
            bias=bias,
            single_grouped_weight=single_grouped_weight,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            delay_wgrad_compute=delay_wgrad_compute,
            dtype=dtype,
            device=device,
            backend=backend,
        )
        self.num_experts, self.hidden, self.ffn_hidden = num_experts, hidden, ffn_hidden
        self.fc1 = GroupedLinear(num_experts, hidden, 2 * ffn_hidden, **options)
        self.fc2 = GroupedLinear(num_experts, ffn_hidden, hidden, **options)

    def forward(
        self, x: torch.Tensor, m_splits: _checks.SplitsLike, is_first_microbatch: Optional[bool] = None
    ) -> torch.Tensor:
        """``is_first_microbatch``: see :meth:`GroupedLinear.forward` (FP8 weight reuse)."""
        hidden = self.fc1(x, m_splits, is_first_microbatch)
        return self.fc2(swiglu(hidden, backend=self.fc1.backend), m_splits, is_first_microbatch)

    def backward_dw(self) -> None:
        """The deferred weight gradients of both layers (``delay_wgrad_compute=True``)."""
        self.fc2.backward_dw()
        self.fc1.backward_dw()


class SwiGLUMLP(nn.Module):
    """A dense SwiGLU MLP (e.g. a shared expert): ``fc2(swiglu(fc1(x)))``."""

    def __init__(self, hidden: int, ffn_hidden: int, *, bias: bool = False, dtype=None, device=None):
        super().__init__()
        self.fc1 = nn.Linear(hidden, 2 * ffn_hidden, bias=bias, dtype=dtype, device=device)
        self.fc2 = nn.Linear(ffn_hidden, hidden, bias=bias, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(swiglu(self.fc1(x)))
