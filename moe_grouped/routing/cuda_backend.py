"""The ``cuda`` routing backend: the core's expert-choice and softmax-route kernels (csrc/permute/).

``mg_route_topk`` (route_topk.cu) chooses the ``top_k`` best experts per
token and counts the copies per expert in one kernel, for float32 CUDA
scores, at most 1024 experts and ``top_k <= 32``.

``Router`` with ``score_function="softmax"``, no expert bias and no group
limit, on bf16 CUDA tokens and gate, runs its choice, weights and losses as
``mg_route_softmax`` (and their backward as ``mg_route_softmax_backward``):
one pass over the fp32 logits each way, where the torch composition takes
some twenty small kernels. Same choice as ``choose_experts`` (the logits
ranked, which ranks the probabilities alike); weights and losses equal the
torch composition's up to float32 rounding; deterministic. Design and
measurements: docs/routing.md.

Weights: the softmax over a token's chosen logits, which is both
``topk_before_softmax`` and softmax followed by ``normalize_topk`` (``p_i /
sum p_j`` over the chosen is that softmax); or, softmax without
``normalize_topk``, the chosen experts' probabilities. Times
``scaling_factor``.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch

from .. import _core
from ..permute import cuda_unavailable_reason

SOFTMAX_CHOSEN = 0  # MG_ROUTE_SOFTMAX_CHOSEN
SOFTMAX_ALL = 1  # MG_ROUTE_SOFTMAX_ALL
KERNEL_MAX_EXPERTS = 1024  # both kernels
KERNEL_MAX_TOP_K = 32
# A core built before the kernels lacks the symbols (read once: Dynamo traces a bool).
_CORE_HAS_TOPK = _core.available() and hasattr(_core.lib, "mg_route_topk")
_CORE_HAS_SOFTMAX = _core.available() and hasattr(_core.lib, "mg_route_softmax")


def topk_applies(scores: torch.Tensor, top_k: int) -> bool:
    """Whether ``mg_route_topk`` takes these scores."""
    return (
        scores.is_cuda
        and scores.dtype == torch.float32
        and scores.shape[1] <= KERNEL_MAX_EXPERTS
        and top_k <= KERNEL_MAX_TOP_K
        and _CORE_HAS_TOPK
        and cuda_unavailable_reason(scores.device) is None
    )


def softmax_applies(x: torch.Tensor, weight: torch.Tensor, top_k: int) -> bool:
    """Whether the softmax route kernels take this gate GEMM (the router's own options are the caller's to check)."""
    return (
        _CORE_HAS_SOFTMAX
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and weight.shape[0] <= KERNEL_MAX_EXPERTS
        and top_k <= KERNEL_MAX_TOP_K
        and cuda_unavailable_reason(x.device) is None
    )


def choose_experts(scores: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [T, top_k] int64, best first; counts [E] int64) of ``mg_route_topk``."""
    num_tokens, num_experts = scores.shape
    experts = torch.empty(num_tokens, top_k, dtype=torch.int64, device=scores.device)
    counts = torch.empty(num_experts, dtype=torch.int64, device=scores.device)
    _core.check(
        _core.require().mg_route_topk(
            scores.data_ptr(), num_tokens, num_experts, top_k, experts.data_ptr(), counts.data_ptr(),
            _core.stream_handle(scores.device),
        )
    )
    return experts, counts


def _ptr(tensor: Optional[torch.Tensor]) -> Optional[int]:
    return None if tensor is None else tensor.data_ptr()


@functools.lru_cache(maxsize=64)
def partial_rows(num_tokens: int) -> int:
    """Rows of ``mg_route_softmax``'s scratch for ``num_tokens`` (a function of it alone: asked once per size)."""
    rows = ctypes.c_int64()
    _core.check(_core.require().mg_route_softmax_partial_rows(num_tokens, ctypes.byref(rows)))
    return rows.value


def route_softmax(logits: torch.Tensor, top_k: int, mode: int, scaling: float):
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


def route_softmax_backward(
    logits, lse, experts, counts, top_k, mode, scaling, grad_weights, grad_losses, grad_logits
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
