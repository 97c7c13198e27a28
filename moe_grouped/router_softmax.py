"""The softmax router after its gate GEMM in one core kernel each way.

``Router`` with ``score_function="softmax"``, no expert bias and no group
limit, on bf16 CUDA tokens and gate, runs its choice, weights and losses as
``mg_route_softmax`` (and their backward as ``mg_route_softmax_backward``):
one pass over the fp32 logits each way, in place of some twenty small torch
kernels (full softmax, gather, softmax of the chosen, the two losses'
reductions; in backward the softmax backward, a zero-filled [T, E] scatter and
the bf16 split of the logits' gradient). Same choice as ``choose_experts``
(the logits ranked, which ranks the probabilities alike); weights and losses
equal the torch composition's up to float32 rounding; deterministic.

Weights: the softmax over a token's chosen logits, which is both
``topk_before_softmax`` and softmax followed by ``normalize_topk`` (``p_i /
sum p_j`` over the chosen is that softmax); or, softmax without
``normalize_topk``, the chosen experts' probabilities. Times
``scaling_factor``.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import _core
from .permute import cuda_unavailable_reason
from .router_gemm import gate_grads_from_halves

SOFTMAX_CHOSEN = 0  # MG_ROUTE_SOFTMAX_CHOSEN
SOFTMAX_ALL = 1  # MG_ROUTE_SOFTMAX_ALL
KERNEL_MAX_EXPERTS = 1024
KERNEL_MAX_TOP_K = 32
# A core built before the kernels lacks the symbols (read once: Dynamo traces a bool).
_CORE_HAS_KERNELS = _core.available() and hasattr(_core.lib, "mg_route_softmax")


def applies(x: torch.Tensor, weight: torch.Tensor, top_k: int) -> bool:
    """Whether the kernels take this gate GEMM (the router's own options are the caller's to check)."""
    return (
        _CORE_HAS_KERNELS
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and weight.shape[0] <= KERNEL_MAX_EXPERTS
        and top_k <= KERNEL_MAX_TOP_K
        and cuda_unavailable_reason(x.device) is None
    )


def route(x: torch.Tensor, weight: torch.Tensor, top_k: int, mode: int, scaling: float):
    """(weights [T, k] fp32, experts [T, k] int64, counts [E] int64, aux_loss, z_loss, logits [T, E] fp32).

    Differentiable in x and weight through the weights, both losses and the logits.
    """
    weights, losses, logits, experts, counts = _SoftmaxRoute.apply(x, weight, top_k, mode, float(scaling))
    return weights, experts, counts, losses[0], losses[1], logits


class _SoftmaxRoute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, top_k: int, mode: int, scaling: float):
        logits = torch.mm(x, weight.t(), out_dtype=torch.float32)
        experts, counts, weights, lse, losses = torch.ops.moe_grouped.route_softmax(logits, top_k, mode, scaling)
        ctx.save_for_backward(x, weight, logits, lse, experts, counts)
        ctx.top_k, ctx.mode, ctx.scaling = top_k, mode, scaling
        ctx.mark_non_differentiable(experts, counts)
        ctx.set_materialize_grads(False)  # an output no loss reached reads as NULL, not a zero tensor
        return weights, losses, logits, experts, counts

    @staticmethod
    def backward(ctx, grad_weights, grad_losses, grad_logits, _experts, _counts):
        x, weight, logits, lse, experts, counts = ctx.saved_tensors
        need_x, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_x or need_weight):
            return None, None, None, None, None
        halves = torch.ops.moe_grouped.route_softmax_backward(
            logits, lse, experts, counts, ctx.top_k, ctx.mode, ctx.scaling,
            _contiguous(grad_weights), _contiguous(grad_losses), _contiguous(grad_logits),
        )
        grad_x, grad_weight = gate_grads_from_halves(halves, x, weight, need_x, need_weight)
        return grad_x, grad_weight, None, None, None


def _contiguous(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if tensor is None else tensor.float().contiguous()


def _ptr(tensor: Optional[torch.Tensor]) -> Optional[int]:
    return None if tensor is None else tensor.data_ptr()


def partial_rows(num_tokens: int) -> int:
    rows = ctypes.c_int64()
    _core.check(_core.require().mg_route_softmax_partial_rows(num_tokens, ctypes.byref(rows)))
    return rows.value


@torch.library.custom_op("moe_grouped::route_softmax", mutates_args=())
def route_softmax(
    logits: torch.Tensor, top_k: int, mode: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(experts [T, k] int64, counts [E] int64, weights [T, k], lse [T], losses [2] = (aux, z)) of ``mg_route_softmax``."""
    num_tokens, num_experts = logits.shape
    experts = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    counts = torch.empty(num_experts, dtype=torch.int64, device=logits.device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    lse = torch.empty(num_tokens, dtype=torch.float32, device=logits.device)
    partials = torch.empty(partial_rows(num_tokens), num_experts + 1, dtype=torch.float32, device=logits.device)
    losses = torch.empty(2, dtype=torch.float32, device=logits.device)
    _core.check(
        _core.require().mg_route_softmax(
            logits.data_ptr(), num_tokens, num_experts, top_k, mode, scaling, experts.data_ptr(),
            counts.data_ptr(), weights.data_ptr(), lse.data_ptr(), partials.data_ptr(), losses.data_ptr(),
            _core.stream_handle(logits.device),
        )
    )
    return experts, counts, weights, lse, losses


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


@torch.library.custom_op("moe_grouped::route_softmax_backward", mutates_args=())
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
    num_tokens, num_experts = logits.shape
    halves = torch.empty(num_tokens, 2 * num_experts, dtype=torch.bfloat16, device=logits.device)
    _core.check(
        _core.require().mg_route_softmax_backward(
            logits.data_ptr(), lse.data_ptr(), experts.data_ptr(), counts.data_ptr(), num_tokens, num_experts,
            top_k, mode, scaling, _ptr(grad_weights), _ptr(grad_losses), _ptr(grad_logits),
            _core.dtype_code(torch.bfloat16), halves.data_ptr(), _core.stream_handle(logits.device),
        )
    )
    return halves


@route_softmax_backward.register_fake
def _(logits, lse, experts, counts, top_k, mode, scaling, grad_weights, grad_losses, grad_logits):
    return logits.new_empty(logits.shape[0], 2 * logits.shape[1], dtype=torch.bfloat16)
