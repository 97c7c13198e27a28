"""The router's ops: the gate's logits, the expert choice, and the fused softmax route.

:class:`moe_grouped.Router` composes them (its options and losses live in
:mod:`moe_grouped.router`). Everything stays on the device: no host sync.

- :func:`router_logits`: ``x W^T`` as float32 logits.
- :func:`choose_experts`: the ``top_k`` best experts per token and the copies
  per expert. One rule everywhere: experts by descending score, equal scores
  lower expert first, NaN above everything (as ``torch.topk`` ranks it).
- :func:`softmax_route`: the softmax router after its gate GEMM (choice,
  weights and both losses, and their backward) in one core kernel each way,
  where :func:`softmax_route_applies`.

The backend follows from the inputs, not from a name: the ``cuda`` kernels
(``mg_route_topk``, ``mg_route_softmax``) where they apply; ``torch``'s
tensor-core gate GEMM for other bf16 CUDA inputs; the ``reference`` ops
(accumulation-dtype GEMM, stable sort) everywhere else.
"""

from __future__ import annotations

import torch

from .._ops import ops
from . import cuda_backend, reference, torch_backend
from .cuda_backend import SOFTMAX_ALL, SOFTMAX_CHOSEN
from .library import SoftmaxRoute  # also registers the torch.ops.moe_grouped routing ops
from .reference import tokens_per_expert


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [T, H] @ weight [E, H]^T`` as float32 logits [T, E] (float64 for float64 input)."""
    if torch_backend.applies(x, weight):
        return torch_backend.logits(x, weight)
    return reference.logits(x, weight)


def choose_experts(scores: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [T, top_k] int64, best first; counts [E] int64) for ``scores`` [T, E]."""
    return ops.route_topk(scores.contiguous(), top_k, cuda_backend.topk_applies(scores, top_k))


def softmax_route_applies(x: torch.Tensor, weight: torch.Tensor, top_k: int) -> bool:
    """Whether the softmax route kernels take this gate GEMM (the router's own options are the caller's to check)."""
    return cuda_backend.softmax_applies(x, weight, top_k)


def softmax_route(x: torch.Tensor, weight: torch.Tensor, top_k: int, mode: int, scaling: float):
    """(weights [T, k] fp32, experts [T, k] int64, counts [E] int64, aux_loss, z_loss, logits [T, E] fp32).

    ``mode``: :data:`SOFTMAX_CHOSEN` or :data:`SOFTMAX_ALL` (see
    :mod:`moe_grouped.routing.cuda_backend`). Differentiable in x and weight
    through the weights, both losses and the logits.
    """
    weights, losses, logits, experts, counts = SoftmaxRoute.apply(x, weight, top_k, mode, float(scaling))
    return weights, experts, counts, losses[0], losses[1], logits


__all__ = [
    "router_logits",
    "choose_experts",
    "tokens_per_expert",
    "softmax_route",
    "softmax_route_applies",
    "SOFTMAX_CHOSEN",
    "SOFTMAX_ALL",
]
