"""The ``reference`` routing ops: plain torch on any device and dtype, the oracle of the kernels.

What runs on the CPU and wherever the faster paths do not apply: the gate
GEMM in the accumulation dtype, the expert choice by a stable descending sort
(the ranking rule of :func:`moe_grouped.routing.choose_experts`), the counts
by a scatter-add. No host sync, so all of it can be captured.
"""

from __future__ import annotations

import torch
from torch import nn

from .._tensors import compute_dtype


def logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [T, H] @ weight [E, H]^T`` in the accumulation dtype (float32; float64 for float64 input)."""
    acc = compute_dtype(x.dtype)
    return nn.functional.linear(x.to(acc), weight.to(acc))


def choose_experts(scores: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [T, top_k] int64, best first; counts [E] int64) by a stable descending sort."""
    experts = scores.sort(dim=-1, descending=True, stable=True).indices[:, :top_k].contiguous()
    return experts, tokens_per_expert(experts, scores.shape[1])


def tokens_per_expert(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64 counts of the entries of ``experts`` per expert, without a host sync.

    ``torch.bincount`` reads its input's maximum on the host on CUDA; a
    scatter-add of ones into a zero vector of static size does not.
    """
    flat = experts.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))
