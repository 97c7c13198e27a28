"""``torch.library`` registration of the routing ops, their fakes, and the softmax route's autograd.

The checks live in :mod:`moe_grouped.routing` and the router; these bodies
only dispatch. Fake implementations give the shapes to meta tensors,
FakeTensor and torch.compile.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._ops import custom_op, ops
from . import cuda_backend, reference
from .torch_backend import gate_grads_from_halves


@custom_op("route_topk", mutates_args=())
def route_topk(scores: torch.Tensor, top_k: int, use_kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts, counts) of :func:`moe_grouped.routing.choose_experts`; ``use_kernel``: the core's kernel."""
    if not use_kernel:
        return reference.choose_experts(scores, top_k)
    return cuda_backend.choose_experts(scores, top_k)


@route_topk.register_fake
def _(scores, top_k, use_kernel):
    return (
        scores.new_empty(scores.shape[0], top_k, dtype=torch.int64),
        scores.new_empty(scores.shape[1], dtype=torch.int64),
    )


@custom_op("route_softmax", mutates_args=())
def route_softmax(
    logits: torch.Tensor, top_k: int, mode: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(experts [T, k] int64, counts [E] int64, weights [T, k], lse [T], losses [2] = (aux, z)) of ``mg_route_softmax``."""
    return cuda_backend.route_softmax(logits, top_k, mode, scaling)


@route_softmax.register_fake
def _(logits, top_k, mode, scaling):
    num_tokens, num_experts = logits.shape
    return (
        logits.new_empty(num_tokens, top_k, dtype=torch.int64),
        logits.new_empty(num_experts, dtype=torch.int64),
        logits.new_empty(num_tokens, top_k),
        logits.new_empty(num_tokens),
        logits.new_empty(2),
    )


@custom_op("route_softmax_backward", mutates_args=())
def route_softmax_backward(
    logits: torch.Tensor,
    lse: torch.Tensor,
    experts: torch.Tensor,
    counts: torch.Tensor,
    top_k: int,
    mode: int,
    scaling: float,
    grad_weights: Optional[torch.Tensor],
    grad_losses: Optional[torch.Tensor],
    grad_logits: Optional[torch.Tensor],
) -> torch.Tensor:
    """The logits' gradient as bf16 halves [T, 2E] ``[hi | lo]`` (``mg_route_softmax_backward``)."""
    return cuda_backend.route_softmax_backward(
        logits, lse, experts, counts, top_k, mode, scaling, grad_weights, grad_losses, grad_logits
    )


@route_softmax_backward.register_fake
def _(logits, lse, experts, counts, top_k, mode, scaling, grad_weights, grad_losses, grad_logits):
    return logits.new_empty(logits.shape[0], 2 * logits.shape[1], dtype=torch.bfloat16)


def route_forward(x, weight, top_k: int, mode: int, scaling: float) -> tuple:
    """The gate GEMM (float32 logits on tensor cores), then ``route_softmax``:
    ``(logits, experts, counts, weights, lse, losses)``."""
    logits = torch.mm(x, weight.t(), out_dtype=torch.float32)
    experts, counts, weights, lse, losses = ops.route_softmax(logits, top_k, mode, scaling)
    return logits, experts, counts, weights, lse, losses


def route_backward(saved: tuple, top_k: int, mode: int, scaling: float, grads: tuple, need_x: bool,
                   need_weight: bool) -> tuple:
    """``(grad_x, grad_weight)`` (None where not needed) of :func:`route_forward`.

    ``saved``: ``(x, weight, logits, lse, experts, counts)``; ``grads``: the
    gradients of the routing weights, the losses and the logits, each None
    where no loss reached it.
    """
    x, weight, logits, lse, experts, counts = saved
    halves = ops.route_softmax_backward(
        logits, lse, experts, counts, top_k, mode, scaling, *(_contiguous(grad) for grad in grads)
    )
    return gate_grads_from_halves(halves, x, weight, need_x, need_weight)


class SoftmaxRoute(torch.autograd.Function):
    """:func:`route_forward` as an autograd op, backward through :func:`route_backward`
    (``route_softmax_backward`` and the gate GEMM's two bf16 GEMMs)."""

    @staticmethod
    def forward(ctx, x, weight, top_k: int, mode: int, scaling: float):
        logits, experts, counts, weights, lse, losses = route_forward(x, weight, top_k, mode, scaling)
        ctx.save_for_backward(x, weight, logits, lse, experts, counts)
        ctx.top_k, ctx.mode, ctx.scaling = top_k, mode, scaling
        ctx.mark_non_differentiable(experts, counts)
        ctx.set_materialize_grads(False)  # an output no loss reached reads as NULL, not a zero tensor
        return weights, losses, logits, experts, counts

    @staticmethod
    def backward(ctx, grad_weights, grad_losses, grad_logits, _experts, _counts):
        need_x, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_x or need_weight):
            return None, None, None, None, None
        grad_x, grad_weight = route_backward(
            ctx.saved_tensors, ctx.top_k, ctx.mode, ctx.scaling, (grad_weights, grad_losses, grad_logits), need_x,
            need_weight,
        )
        return grad_x, grad_weight, None, None, None


def _contiguous(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if tensor is None else tensor.float().contiguous()
