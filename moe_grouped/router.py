"""``Router``: the MoE gate that picks ``top_k`` experts per token.

Everything stays on the device: the selection, the routing weights, the
tokens per expert and the auxiliary losses are tensors, nothing is read on
the host, so a router can be captured in a CUDA graph and replayed while its
choices change.

Routing modes (Hugging Face / Megatron semantics):

- ``score_function="softmax"`` (Mixtral, Qwen-MoE): probabilities
  ``softmax(logits)`` over all experts, the ``top_k`` largest selected; with
  ``normalize_topk=True`` the selected probabilities are renormalised to sum
  to one (Mixtral always, Qwen-MoE's ``norm_topk_prob``).
- ``score_function="softmax", topk_before_softmax=True`` (Megatron's default
  ``moe_router_pre_softmax=False``): the ``top_k`` largest logits selected,
  the weights are the softmax over those ``top_k`` logits only.
- ``score_function="sigmoid"`` (DeepSeek-V3): scores ``sigmoid(logits)``,
  weights are the selected scores, normalised when ``normalize_topk``.

``expert_bias=True`` adds a non-learned per-expert bias to the scores used for
*selection only* (DeepSeek-V3's auxiliary-loss-free balancing); the weights
never see it. :meth:`Router.update_bias` moves the bias against the load.
``n_group``/``topk_group`` restrict each token to the ``topk_group`` best of
``n_group`` expert groups (DeepSeek-V3: a group's score is the sum of its two
best selection scores). ``scaling_factor`` multiplies the final weights
(DeepSeek-V3's ``routed_scaling_factor``).

Softmax routers without expert bias or group limit, on bf16 CUDA tokens,
run everything after the gate GEMM (choice, weights, both losses, and their
backward) in two core kernels (:mod:`moe_grouped.routing`); the
others compose torch ops. Both give the same choice, and weights and losses
equal up to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from . import _checks, routing
from .routing import choose_experts, router_logits, tokens_per_expert  # noqa: F401 (tokens_per_expert: public here)

SCORE_FUNCTIONS = ("softmax", "sigmoid")


@dataclass
class RoutingOutput:
    """What :class:`Router` returns for ``T`` tokens, ``E`` experts, ``top_k = k``.

    Attributes:
        weights: [T, k] routing weights of the chosen experts (the combine
            weights of :func:`moe_grouped.unpermute`); float32, float64 for
            float64 input.
        experts: [T, k] int64 chosen expert indices, best first.
        tokens_per_expert: [E] int64 number of token copies routed to each
            expert, on the device (the ``m_splits`` of the expert GEMMs).
        aux_loss: scalar, the Switch/GShard load-balancing loss
            ``E * sum_e f_e * P_e`` (``f_e``: fraction of the ``T * k`` copies
            sent to expert e; ``P_e``: mean router probability of e). 1.0 for
            perfectly uniform routing. Differentiable through ``P_e``.
        z_loss: scalar, ``mean_t(logsumexp(logits_t) ** 2)``.
        logits: [T, E] router logits (float32; float64 for float64 input).
    """

    weights: torch.Tensor
    experts: torch.Tensor
    tokens_per_expert: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    logits: torch.Tensor

    def detached(self) -> "RoutingOutput":
        """A copy whose tensors are detached (to keep for logging without holding the graph)."""
        # Fields spelled out: Dynamo cannot trace vars()/__dict__ of this object.
        return RoutingOutput(
            self.weights.detach(), self.experts.detach(), self.tokens_per_expert.detach(),
            self.aux_loss.detach(), self.z_loss.detach(), self.logits.detach(),
        )


def load_balancing_loss(probs: torch.Tensor, counts: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch/GShard auxiliary loss ``E * sum_e f_e * P_e`` (1.0 when uniform).

    ``probs`` [T, E] are the router probabilities over all experts, ``counts``
    [E] the token copies per expert (``T * top_k`` in all).
    """
    num_tokens, num_experts = probs.shape
    fraction = counts.to(probs.dtype) / max(num_tokens * top_k, 1)
    mean_prob = probs.mean(dim=0) if num_tokens > 0 else probs.sum(dim=0)
    return num_experts * (fraction * mean_prob).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """``mean(logsumexp(logits, -1) ** 2)`` (ST-MoE's router z-loss)."""
    if logits.shape[0] == 0:
        return logits.sum()
    return torch.logsumexp(logits, dim=-1).square().mean()


def _recomputing() -> bool:
    """True while autograd runs a backward, where a forward runs only to be
    recomputed (activation checkpointing): its tokens were counted already.
    Compiled graphs apply buffer updates once, recomputed or not."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class Router(nn.Module):
    """Linear gate + top-k selection over ``num_experts`` experts.

    ``forward(x)`` takes ``x`` of shape [T, hidden] and returns a
    :class:`RoutingOutput`. Logits are computed in float32 (float64 for
    float64 input), whatever the gate's dtype (bf16 on CUDA: on tensor cores
    with float32 accumulation, see :mod:`moe_grouped.routing.torch_backend`).

    Args:
        hidden: input features.
        num_experts: E.
        top_k: experts per token (1 <= top_k <= E).
        score_function: ``"softmax"`` or ``"sigmoid"``.
        topk_before_softmax: softmax only: select on the logits, then softmax
            over the ``top_k`` selected logits (the weights then sum to one).
        normalize_topk: divide the selected weights by their sum (Mixtral:
            True; Qwen-MoE: its ``norm_topk_prob``; DeepSeek-V3: True).
            Ignored with ``topk_before_softmax`` (already normalised).
        scaling_factor: multiplies the final weights (DeepSeek-V3's
            ``routed_scaling_factor``).
        expert_bias: keep a non-learned float32 buffer ``expert_bias`` [E]
            added to the scores for selection only; see :meth:`update_bias`.
        n_group, topk_group: group-limited routing: experts form ``n_group``
            equal groups and each token chooses among the experts of its
            ``topk_group`` best groups only. Both or neither.
        dtype, device: of the gate weight [E, hidden].
    """

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        *,
        score_function: str = "softmax",
        topk_before_softmax: bool = False,
        normalize_topk: bool = True,
        scaling_factor: float = 1.0,
        expert_bias: bool = False,
        n_group: Optional[int] = None,
        topk_group: Optional[int] = None,
        dtype: Optional[torch.dtype] = None,
        device=None,
    ):
        super().__init__()
        _check_positive_int("hidden", hidden)
        _check_positive_int("num_experts", num_experts)
        _check_positive_int("top_k", top_k)
        if top_k > num_experts:
            raise ValueError(f"top_k must be at most num_experts={num_experts}, got {top_k}")
        if score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}")
        if topk_before_softmax and score_function != "softmax":
            raise ValueError("topk_before_softmax=True needs score_function='softmax', got 'sigmoid'")
        if (n_group is None) != (topk_group is None):
            raise ValueError(f"n_group and topk_group go together, got n_group={n_group}, topk_group={topk_group}")
        if n_group is not None:
            _check_positive_int("n_group", n_group)
            _check_positive_int("topk_group", topk_group)
            if num_experts % n_group != 0:
                raise ValueError(f"num_experts={num_experts} must be divisible by n_group={n_group}")
            if topk_group > n_group:
                raise ValueError(f"topk_group must be at most n_group={n_group}, got {topk_group}")
            if topk_group * (num_experts // n_group) < top_k:
                raise ValueError(
                    f"top_k={top_k} experts cannot be chosen from topk_group={topk_group} groups of "
                    f"{num_experts // n_group} experts"
                )
        self.hidden = hidden
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_function = score_function
        self.topk_before_softmax = topk_before_softmax
        self.normalize_topk = normalize_topk
        self.scaling_factor = float(scaling_factor)
        self.n_group = n_group
        self.topk_group = topk_group
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype, device=device))
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device))
            self.register_buffer(
                "tokens_since_update", torch.zeros(num_experts, dtype=torch.int64, device=device)
            )
        else:
            self.expert_bias = None
            self.tokens_since_update = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Linear's initialisation of the gate; zero expert bias."""
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)
        if self.expert_bias is not None:
            self.expert_bias.zero_()
            self.tokens_since_update.zero_()

    def forward(self, x: torch.Tensor) -> RoutingOutput:
        self.check_input(x)
        mode = self.fused_mode(x)
        if mode is not None:
            weights, experts, counts, aux_loss, z_loss_, logits = routing.softmax_route(
                x, self.weight, self.top_k, mode, self.scaling_factor
            )
            return RoutingOutput(weights, experts, counts, aux_loss, z_loss_, logits)
        logits = router_logits(x, self.weight)
        weights, experts, counts, probs = self._select(logits)
        if self.tokens_since_update is not None and self.training and not _recomputing():
            with torch.no_grad():
                self.tokens_since_update.add_(counts)
        return RoutingOutput(
            weights=weights,
            experts=experts,
            tokens_per_expert=counts,
            aux_loss=load_balancing_loss(probs, counts, self.top_k),
            z_loss=z_loss(logits),
            logits=logits,
        )

    def check_input(self, x: torch.Tensor) -> None:
        """Raise unless ``x`` is [tokens, hidden] on the gate weight's device."""
        _checks.check_tensor("x", x, dim=2)
        if x.shape[1] != self.hidden:
            raise ValueError(f"x must have shape [tokens, {self.hidden}] (hidden), got {tuple(x.shape)}")
        _checks.check_same_device("the router's weight", self.weight, x=x)

    def fused_mode(self, x: torch.Tensor) -> Optional[int]:
        """The softmax route kernels' weights mode for this router on ``x``, None where they do not apply."""
        if self.score_function != "softmax" or self.expert_bias is not None or self.n_group is not None:
            return None
        if not routing.softmax_route_applies(x, self.weight, self.top_k):
            return None
        chosen = self.topk_before_softmax or self.normalize_topk
        return routing.SOFTMAX_CHOSEN if chosen else routing.SOFTMAX_ALL

    def _select(self, logits: torch.Tensor):
        """(weights [T, k], experts [T, k], copies per expert [E], probabilities over all experts [T, E])."""
        if self.score_function == "sigmoid":
            scores = torch.sigmoid(logits)
            probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            probs = torch.softmax(logits, dim=-1)
            scores = logits if self.topk_before_softmax else probs
        choice = scores.detach()
        if self.expert_bias is not None:
            choice = choice + self.expert_bias
        if self.n_group is not None:
            choice = self._limit_to_groups(choice)
        experts, counts = choose_experts(choice, self.top_k)
        selected = scores.gather(1, experts)
        if self.topk_before_softmax:
            weights = torch.softmax(selected, dim=-1)
        elif self.normalize_topk:
            weights = selected / (selected.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            weights = selected
        if self.scaling_factor != 1.0:
            weights = weights * self.scaling_factor
        return weights, experts, counts, probs

    def _limit_to_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` with the experts outside each token's best groups set to -inf."""
        tokens = choice.shape[0]
        grouped = choice.view(tokens, self.n_group, self.num_experts // self.n_group)
        best = min(2, grouped.shape[-1])
        group_scores = grouped.topk(best, dim=-1).values.sum(dim=-1)
        groups = group_scores.topk(self.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, self.num_experts)

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: Optional[torch.Tensor] = None, rate: float = 1e-3) -> None:
        """DeepSeek-V3 balancing: ``bias_e += rate * sign(mean load - load_e)``.

        Overloaded experts become less likely to be chosen, underloaded ones
        more. ``tokens_per_expert`` [E] defaults to the counts accumulated by
        training-mode forwards since the last update (which this then
        resets). A device op with no host sync: call it after the optimizer
        step, inside or outside a captured step.
        """
        if self.expert_bias is None:
            raise RuntimeError("update_bias() needs a Router built with expert_bias=True")
        if tokens_per_expert is None:
            load = self.tokens_since_update.to(torch.float32)
            self.tokens_since_update.zero_()
        else:
            if not isinstance(tokens_per_expert, torch.Tensor) or tuple(tokens_per_expert.shape) != (self.num_experts,):
                raise ValueError(
                    f"tokens_per_expert must be a tensor of shape ({self.num_experts},), got "
                    f"{getattr(tokens_per_expert, 'shape', type(tokens_per_expert).__name__)}"
                )
            load = tokens_per_expert.to(device=self.expert_bias.device, dtype=torch.float32)
        self.expert_bias.add_(torch.sign(load.mean() - load) * rate)

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"score_function={self.score_function!r}, topk_before_softmax={self.topk_before_softmax}, "
            f"normalize_topk={self.normalize_topk}, scaling_factor={self.scaling_factor}, "
            f"expert_bias={self.expert_bias is not None}, n_group={self.n_group}, topk_group={self.topk_group}"
        )
