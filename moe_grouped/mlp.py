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

from . import _checks, backends
from .activation import resolve_weighted_backward_backend, swiglu, weighted_backward_unavailable_reason
from .experts import STAGES, FusedExpertsFunction, Plan, Sinks, check_experts_path
from .fp8 import experts as fp8_experts
from .fp8 import get_fp8_recipe
from .fp8 import linear as fp8_linear
from .grouped_linear import GroupedLinear
from .gemm import check_backend_dtype
from .permute import permute, permute_index, resolve_backend, unpermute

# Element types the fused path is chosen for by default (experts_path=None).
FUSED_DEFAULT_DTYPES = (torch.bfloat16, torch.float16)


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

    ``experts_path``: ``"unfused"`` runs fc1, SwiGLU and fc2 as three
    autograd ops (each keeps its input for backward); ``"fused"`` runs them as
    one op that keeps x and fc1's output but not the SwiGLU output (see
    :mod:`moe_grouped.experts`; in :class:`MoELayer` it also fuses the
    dispatch and the weighted combine). None (default): fused with the
    ``cuda`` backend in bfloat16/float16 on a core with the weighted SwiGLU
    backward, where it keeps less memory than the unfused path at about its
    speed (docs/experts-path.md); unfused otherwise. Inside FP8 autocast
    the fused op runs its GEMMs in FP8 (:mod:`moe_grouped.fp8.experts`).
    Never fused (``"fused"`` raises): with ``bias=True``, or in FP8 where the
    FP8 kernels cannot take the layer.
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
        experts_path: Optional[str] = None,
    ):
        super().__init__()
        self.experts_path = check_experts_path(experts_path)
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
        # Checked before the path choice, which reads x's device and dtype.
        _checks.check_tensor("x", x, dim=2)
        if self.uses_fused_path(x):
            if x.shape[1] != self.hidden:
                raise ValueError(f"x must have shape [tokens, {self.hidden}] (hidden), got {tuple(x.shape)}")
            # With the backend, so that the reference backend validates device splits as GroupedLinear does.
            splits = _checks.normalize_splits(
                m_splits, self.num_experts, x.shape[0], x.device, backend=backends.resolve(self.fc1.backend, x.device)
            )
            return self._fused(x, None, None, splits, self._plan(x, routed=False), None, is_first_microbatch)
        hidden = self.fc1(x, m_splits, is_first_microbatch)
        return self.fc2(swiglu(hidden, backend=self.fc1.backend), m_splits, is_first_microbatch)

    def fused_path_unavailable_reason(self, x: torch.Tensor) -> Optional[str]:
        """Why the fused path cannot run on input like ``x``, or None if it can."""
        if self.fc1.use_bias:
            return "the layers have biases (bias=True)"
        if get_fp8_recipe() is not None:
            backend = backends.resolve(self.fc1.backend, x.device)
            try:
                for layer in (self.fc1, self.fc2):
                    fp8_linear.check_supported(backend, x, layer.out_features, layer.in_features)
            except (NotImplementedError, TypeError, ValueError, RuntimeError) as error:
                return f"in FP8 here: {error}"
        return None

    def uses_fused_path(self, x: torch.Tensor) -> bool:
        """Whether ``forward`` on input like ``x`` takes the fused path (see ``experts_path``)."""
        if self.experts_path == "unfused":
            return False
        reason = self.fused_path_unavailable_reason(x)
        if self.experts_path == "fused":
            if reason is not None:
                raise ValueError(f"experts_path='fused' cannot run {reason}; use experts_path=None or 'unfused'")
            return True
        return (
            reason is None
            and backends.resolve(self.fc1.backend, x.device) == "cuda"
            and x.dtype in FUSED_DEFAULT_DTYPES
            and weighted_backward_unavailable_reason(x.device) is None
        )

    def forward_routed(
        self,
        tokens: torch.Tensor,
        probs: torch.Tensor,
        row_id_map: torch.Tensor,
        m_splits: torch.Tensor,
        num_rows: int,
        *,
        zero_unmapped: bool,
        permute_backend: str,
        sinks: Optional[Sinks] = None,
        is_first_microbatch: Optional[bool] = None,
    ) -> torch.Tensor:
        """The fused path with dispatch and combine: ``unpermute(self(permute(tokens)), probs)``.

        ``row_id_map``, ``m_splits`` and ``num_rows`` are
        :func:`moe_grouped.permute_index`'s; ``zero_unmapped``: the buffer has
        rows no copy maps to (a capacity was given); ``permute_backend`` runs
        the gathers and the combine. Returns [T, hidden]; differentiable in
        ``tokens``, ``probs`` and the weights. The caller checks
        :meth:`uses_fused_path` first. ``sinks``: where the expert-parallel
        layer wants the output and the token gradient (:class:`moe_grouped.experts.Sinks`).
        ``is_first_microbatch``: FP8 weight reuse, as in :meth:`forward`.
        """
        plan = self.routed_plan(tokens, probs.shape[1], num_rows, zero_unmapped, permute_backend)
        return self._fused(tokens, probs, row_id_map, m_splits, plan, sinks, is_first_microbatch)

    def routed_plan(self, tokens: torch.Tensor, top_k: int, num_rows: int, zero_unmapped: bool,
                    permute_backend: str) -> Plan:
        """The fused op's :class:`~moe_grouped.experts.Plan` for routed ``tokens`` (see :meth:`forward_routed`)."""
        return self._plan(tokens, routed=True, top_k=top_k, num_rows=num_rows, zero_unmapped=zero_unmapped,
                          permute_backend=permute_backend)

    def forward_tokens(
        self,
        tokens: torch.Tensor,
        experts: torch.Tensor,
        weights: torch.Tensor,
        *,
        backend: Optional[str] = None,
        is_first_microbatch: Optional[bool] = None,
        **drop_options,
    ) -> torch.Tensor:
        """The experts on routed tokens: ``unpermute(self(permute(tokens, experts)), weights)`` [T, hidden].

        ``experts`` and ``weights`` [T, top_k]: each token's chosen experts and
        their routing weights (differentiable); ``backend`` runs the dispatch
        and the combine; ``drop_options``: :func:`moe_grouped.permute`'s
        ``probs``, ``capacity_factor``, ``drop_policy``, ``pad_to_capacity``.
        One autograd op (:meth:`forward_routed`) where :meth:`uses_fused_path`
        says so, else the three ops.
        """
        if self.uses_fused_path(tokens):
            row_id_map, m_splits, rows = permute_index(
                tokens, experts, self.num_experts, backend=backend, **drop_options
            )
            return self.forward_routed(
                tokens, weights, row_id_map, m_splits, rows,
                zero_unmapped=drop_options.get("capacity_factor") is not None,
                permute_backend=resolve_backend(backend, tokens.device), is_first_microbatch=is_first_microbatch,
            )
        permuted, m_splits, row_id_map = permute(tokens, experts, self.num_experts, backend=backend, **drop_options)
        return unpermute(self(permuted, m_splits, is_first_microbatch), row_id_map, weights, backend=backend)

    def _plan(self, x: torch.Tensor, *, routed: bool, permute_backend: str = "", **static) -> Plan:
        # A Plan is a function of this key only (the backends resolve the same for a device and dtype
        # in one process); built on every call it costs more host time than some of the kernels it runs.
        if torch.compiler.is_compiling():  # traced once; the cache would be a side effect to trace
            return self._new_plan(x, routed=routed, permute_backend=permute_backend, **static)
        key = (x.device, x.dtype, routed, permute_backend, tuple(sorted(static.items())), self.fc1._spec_key(),
               self.fc2._spec_key())
        plans = self.__dict__.setdefault("_plans", {})
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = self._new_plan(x, routed=routed, permute_backend=permute_backend, **static)
        return plan

    def _new_plan(self, x: torch.Tensor, *, routed: bool, permute_backend: str, **static) -> Plan:
        gemm = backends.resolve(self.fc1.backend, x.device)
        check_backend_dtype(gemm, x.dtype)
        return Plan(
            gemm_backend=gemm,
            permute_backend=permute_backend,
            activation_backend=resolve_weighted_backward_backend(gemm, x.device),
            fc1=self.fc1._spec(gemm),
            fc2=self.fc2._spec(gemm),
            routed=routed,
            **static,
        )

    def _fused(self, tokens, probs, row_id_map, m_splits, plan: Plan, sinks: Optional[Sinks] = None,
               is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        stages = self.fused_stages(tokens, plan.gemm_backend, is_first_microbatch)
        return FusedExpertsFunction.apply(
            tokens, probs, row_id_map, m_splits, plan, sinks, stages, self.fc1._delayed, self.fc2._delayed,
            *self.fused_weights(),
        )

    def fused_stages(self, tokens: torch.Tensor, gemm_backend: str, is_first_microbatch: Optional[bool] = None):
        """The fused op's stages for ``tokens``: the layer dtype's, or FP8's on ``gemm_backend`` inside
        ``fp8_autocast``. Checks that the parameters match the tokens first, and marks the weights whose
        gradient backward adds into ``main_grad``."""
        weight = self.fc1.weights()[0]
        if tokens.dtype != weight.dtype:
            raise TypeError(f"x has dtype {tokens.dtype} but the layer's parameters are {weight.dtype}")
        _checks.check_same_device("the layer's parameters", weight, x=tokens)
        if torch.is_grad_enabled():
            for layer in (self.fc1, self.fc2):
                if layer.fuse_wgrad_accumulation:
                    for w in layer.weights():
                        w.grad_added_to_main_grad = True  # backward adds into main_grad, as Megatron expects
        recipe = get_fp8_recipe()
        if recipe is None:
            return STAGES
        return fp8_experts.stages_for(
            recipe, gemm_backend, (self.fc1.weights(), self.fc2.weights()),
            (self.fc1._fp8_weights, self.fc2._fp8_weights), is_first_microbatch,
        )

    def fused_weights(self) -> list:
        """The fused op's weight inputs: fc1's, then fc2's."""
        return self.fc1.weights() + self.fc2.weights()

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
