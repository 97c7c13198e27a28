"""The router's expert choice: the ``top_k`` best experts per token and the copies per expert.

One rule everywhere: experts by descending score, equal scores lower expert
first, NaN above everything (as ``torch.topk`` ranks it). On CUDA with float32
scores, at most 1024 experts and ``top_k <= 32`` one core kernel
(``mg_route_topk``, csrc/permute/route_topk.cu) does both; it replaced
``torch.topk`` and a scatter-add of ones that took 138 us of a Qwen3-like step
on an H100 (T=16384, E=128, k=8). Elsewhere a stable descending sort gives
the same choice. No host sync either way.
"""

from __future__ import annotations

import torch

from . import _core
from .permute import cuda_unavailable_reason

KERNEL_MAX_EXPERTS = 1024
KERNEL_MAX_TOP_K = 32
# A core built before the kernel lacks the symbol (read once: Dynamo traces a bool).
_CORE_HAS_KERNEL = _core.available() and hasattr(_core.lib, "mg_route_topk")


def choose_experts(scores: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [T, top_k] int64, best first; counts [E] int64) for ``scores`` [T, E]."""
    return torch.ops.moe_grouped.route_topk(scores.contiguous(), top_k, _kernel_applies(scores, top_k))


def _kernel_applies(scores: torch.Tensor, top_k: int) -> bool:
    return (
        scores.is_cuda
        and scores.dtype == torch.float32
        and scores.shape[1] <= KERNEL_MAX_EXPERTS
        and top_k <= KERNEL_MAX_TOP_K
        and _CORE_HAS_KERNEL
        and cuda_unavailable_reason(scores.device) is None
    )


def tokens_per_expert(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64 counts of the entries of ``experts`` per expert, without a host sync.

    ``torch.bincount`` reads its input's maximum on the host on CUDA; a
    scatter-add of ones into a zero vector of static size does not.
    """
    flat = experts.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))


@torch.library.custom_op("moe_grouped::route_topk", mutates_args=())
def route_topk(scores: torch.Tensor, top_k: int, use_kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts, counts) of :func:`choose_experts`; ``use_kernel``: the core's kernel."""
    num_tokens, num_experts = scores.shape
    if not use_kernel:
        experts = scores.sort(dim=-1, descending=True, stable=True).indices[:, :top_k].contiguous()
        return experts, tokens_per_expert(experts, num_experts)
    experts = torch.empty(num_tokens, top_k, dtype=torch.int64, device=scores.device)
    counts = torch.empty(num_experts, dtype=torch.int64, device=scores.device)
    _core.check(
        _core.require().mg_route_topk(
            scores.data_ptr(), num_tokens, num_experts, top_k, experts.data_ptr(), counts.data_ptr(),
            _core.stream_handle(scores.device),
        )
    )
    return experts, counts


@route_topk.register_fake
def _(scores, top_k, use_kernel):
    return (
        scores.new_empty(scores.shape[0], top_k, dtype=torch.int64),
        scores.new_empty(scores.shape[1], dtype=torch.int64),
    )
