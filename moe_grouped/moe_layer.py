"""``MoELayer``: router -> permute -> grouped SwiGLU experts -> unpermute (+ shared expert).

No step reads the routing on the host (with the ``torch`` or ``cuda``
backend), so the layer's forward and backward can be captured in a CUDA graph
and replayed while the routing changes every step.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.nn.modules import module as _module  # the global hooks nn.Module.__call__ runs

from . import routed_experts
from .mlp import GroupedMLP, SwiGLUMLP
from .permute import check_drop_options, expert_capacity, index_backend, permuted_rows
from .routed_experts import RoutedExpertsFunction, Route
from .router import Router, RoutingOutput


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out``; backward also sends gradient 1 into ``loss``.

    So the router's weighted losses train the gate without the caller adding
    them to the loss (Megatron's ``MoEAuxLossAutoScaler``).
    """

    @staticmethod
    def forward(ctx, out, loss):
        ctx.loss_shape, ctx.loss_dtype, ctx.loss_device = loss.shape, loss.dtype, loss.device
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones(ctx.loss_shape, dtype=ctx.loss_dtype, device=ctx.loss_device)


def _called_plainly(module: nn.Module, kind: type) -> bool:
    """Whether calling ``module`` would only run ``kind.forward``: no subclass, no hooks on it or on every
    module. The layer may then run that forward inside one of its own ops without calling the module
    (hooks of a user's, or FSDP's, must still see the call)."""
    return type(module) is kind and not (
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
        or module._backward_pre_hooks or _module._global_forward_hooks or _module._global_forward_pre_hooks
        or _module._global_backward_hooks or _module._global_backward_pre_hooks
    )


class MoELayer(nn.Module):
    """A Mixture-of-Experts SwiGLU feed-forward layer.

    ``forward(x)`` takes [T, hidden] or [B, S, hidden] and returns the same
    shape. Each token goes to ``top_k`` of ``num_experts`` experts chosen by
    :attr:`router`; the expert outputs are summed with the routing weights;
    the shared expert's output (if any) is added.

    Auxiliary losses: in training mode with ``aux_loss_coeff`` or
    ``z_loss_coeff`` non-zero, backward adds the gradient of
    ``aux_loss_coeff * aux_loss + z_loss_coeff * z_loss`` to the router, as
    if that term were added to the loss backward starts from — the caller
    does nothing. :attr:`last_routing` holds the last forward's
    :class:`RoutingOutput` (detached) to log the losses and the load.

    Args:
        hidden, ffn_hidden: model and per-expert FFN widths.
        num_experts, top_k: E and the experts per token.
        router_options: keyword arguments of :class:`Router` (e.g.
            ``score_function``, ``normalize_topk``, ``expert_bias``, ``n_group``).
        shared_expert_ffn_hidden: width of a dense SwiGLU shared expert, or None.
        aux_loss_coeff, z_loss_coeff: weights of the router losses.
        capacity_factor: None (default): every copy reaches its expert
            (dropless). A number >= 0: token dropping as in Megatron, each
            expert takes at most ``ceil(T * top_k / E * capacity_factor)``
            copies per forward; dropped copies add 0 to the output (the
            shared expert and the residual still see the token). See
            :func:`moe_grouped.permute`.
        drop_policy: which copies an over-full expert keeps: ``"probs"``
            (highest routing weight) or ``"position"`` (first in token order).
        pad_to_capacity: pad every expert to exactly ``capacity`` rows, so
            the expert GEMMs see the fixed split ``[capacity] * E``.
        single_grouped_weight: True (default): one [E, N, K] weight per
            projection; False: E weights ``weight0 ..`` as TransformerEngine
            holds them. Either loads the other's state dict. Eager, each
            parameter is a node of the autograd engine: at E=64 the
            per-expert layout costs about 1.5 ms more host time per step
            (docs/host-overhead.md).
        bias, fuse_wgrad_accumulation, delay_wgrad_compute, dtype, device:
            passed to :class:`GroupedMLP`.
        backend: for the expert GEMMs and the permutation: ``"cuda"``,
            ``"torch"``, ``"reference"`` or None (each op's default).
        experts_path: ``"unfused"``: permute, :class:`GroupedMLP` and the
            weighted unpermute as separate autograd ops; ``"fused"``: one op
            (:mod:`moe_grouped.experts`) that keeps only the tokens, fc1's
            output and the routing weights for backward; None (default): fused
            where :attr:`GroupedMLP.experts_path` None would fuse (the ``cuda``
            backend in bfloat16/float16, no biases; inside ``fp8_autocast``
            the fused op runs in FP8). Fused, with a router the softmax route
            kernels take (bf16), the router runs in the same autograd op
            (:mod:`moe_grouped.routed_experts`; the same results).
    """

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        num_experts: int,
        top_k: int,
        *,
        router_options: Optional[dict[str, Any]] = None,
        shared_expert_ffn_hidden: Optional[int] = None,
        aux_loss_coeff: float = 0.0,
        z_loss_coeff: float = 0.0,
        capacity_factor: Optional[float] = None,
        drop_policy: str = "probs",
        pad_to_capacity: bool = False,
        bias: bool = False,
        single_grouped_weight: bool = True,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        dtype: Optional[torch.dtype] = None,
        device=None,
        backend: Optional[str] = None,
        experts_path: Optional[str] = None,
    ):
        super().__init__()
        for name, value in (("aux_loss_coeff", aux_loss_coeff), ("z_loss_coeff", z_loss_coeff)):
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a non-negative number, got {value!r}")
        check_drop_options(capacity_factor, drop_policy, pad_to_capacity)
        self.hidden, self.num_experts, self.top_k = hidden, num_experts, top_k
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.pad_to_capacity = bool(pad_to_capacity)
        self.aux_loss_coeff, self.z_loss_coeff = float(aux_loss_coeff), float(z_loss_coeff)
        self.backend = backend
        self.router = Router(hidden, num_experts, top_k, dtype=dtype, device=device, **(router_options or {}))
        self.experts = GroupedMLP(
            num_experts, hidden, ffn_hidden, bias=bias, single_grouped_weight=single_grouped_weight,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation, delay_wgrad_compute=delay_wgrad_compute,
            dtype=dtype, device=device, backend=backend, experts_path=experts_path,
        )
        self.shared_expert = (
            SwiGLUMLP(hidden, shared_expert_ffn_hidden, dtype=dtype, device=device)
            if shared_expert_ffn_hidden else None
        )
        self.last_routing: Optional[RoutingOutput] = None

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """The layer on x [tokens, hidden] or [batch, seq, hidden].

        ``is_first_microbatch``: the experts' FP8 weight reuse across the
        micro-batches of a gradient-accumulation step (see
        :meth:`GroupedLinear.forward`).
        """
        if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or x.shape[-1] != self.hidden:
            raise ValueError(
                f"x must have shape [tokens, {self.hidden}] or [batch, seq, {self.hidden}], got "
                f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
            )
        # 2-D input as it is: a reshape would add a view node to every backward.
        tokens = x.contiguous() if x.dim() == 2 else x.reshape(-1, self.hidden).contiguous()
        out, routing = self._routed_experts(tokens, is_first_microbatch)
        if out is None:
            routing = self.router(tokens)
            out = self.experts.forward_tokens(
                tokens, routing.experts, routing.weights, backend=self.backend,
                is_first_microbatch=is_first_microbatch, probs=routing.weights.detach(),
                capacity_factor=self.capacity_factor, drop_policy=self.drop_policy,
                pad_to_capacity=self.pad_to_capacity,
            )
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        if self.training and torch.is_grad_enabled() and (self.aux_loss_coeff or self.z_loss_coeff):
            loss = self.aux_loss_coeff * routing.aux_loss + self.z_loss_coeff * routing.z_loss
            out = _AttachAuxLoss.apply(out, loss)
        # Not a parameter, buffer or module: nn.Module.__setattr__'s checks would only cost time.
        object.__setattr__(self, "last_routing", routing.detached())
        return out if x.dim() == 2 else out.view(x.shape)

    def _routed_experts(self, tokens: torch.Tensor, is_first_microbatch: Optional[bool]):
        """``(out, routing)`` from the router and the experts as one autograd op
        (:mod:`moe_grouped.routed_experts`), or ``(None, None)`` where the two ops must run."""
        if not (routed_experts.enabled and _called_plainly(self.router, Router)
                and type(self.experts).forward_tokens is GroupedMLP.forward_tokens):
            return None, None
        self.router.check_input(tokens)
        mode = self.router.fused_mode(tokens)
        if mode is None or not self.experts.uses_fused_path(tokens):
            return None, None
        num_tokens, top_k, num_experts = tokens.shape[0], self.top_k, self.num_experts
        capacity = None
        if self.capacity_factor is not None:
            capacity = expert_capacity(num_tokens, top_k, num_experts, self.capacity_factor)
        permute_backend = index_backend(self.backend, tokens, num_experts)
        plan = self.experts.routed_plan(
            tokens, top_k, permuted_rows(num_tokens, top_k, num_experts, capacity, self.pad_to_capacity),
            capacity is not None, permute_backend,
        )
        route = Route(
            top_k, mode, self.router.scaling_factor, num_experts, -1 if capacity is None else capacity,
            self.pad_to_capacity, capacity is not None and self.drop_policy == "probs",
        )
        stages = self.experts.fused_stages(tokens, plan.gemm_backend, is_first_microbatch)
        experts = self.experts
        out, weights, losses, logits, chosen, counts = RoutedExpertsFunction.apply(
            tokens, self.router.weight, route, plan, stages, experts.fc1._delayed, experts.fc2._delayed,
            *experts.fused_weights(),
        )
        aux_loss, z_loss = losses.unbind()  # one view op for both
        return out, RoutingOutput(weights, chosen, counts, aux_loss, z_loss, logits)

    def backward_dw(self) -> None:
        """The experts' deferred weight gradients (``delay_wgrad_compute=True``)."""
        self.experts.backward_dw()

    def extra_repr(self) -> str:
        capacity = (
            f", capacity_factor={self.capacity_factor}, drop_policy={self.drop_policy!r}, "
            f"pad_to_capacity={self.pad_to_capacity}" if self.capacity_factor is not None else ""
        )
        return (
            f"aux_loss_coeff={self.aux_loss_coeff}, z_loss_coeff={self.z_loss_coeff}{capacity}, "
            f"backend={self.backend}, experts_path={self.experts.experts_path}"
        )
