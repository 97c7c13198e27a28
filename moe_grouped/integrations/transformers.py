"""moe_grouped as a Hugging Face transformers experts implementation.

transformers 5.x sends the forward of every MoE experts module decorated with
``@use_experts_implementation`` (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3, ...)
through ``transformers.integrations.moe.ExpertsInterface``, picked by the
config's ``_experts_implementation`` (``experts_implementation=`` at load, or
``model.set_experts_implementation(...)``). :func:`register` adds ours::

    from moe_grouped.integrations import transformers as mg_transformers

    name = mg_transformers.register()  # "moe_grouped"
    model = AutoModelForCausalLM.from_config(config, experts_implementation=name)
    model.set_experts_implementation(name)  # or switch a loaded model

The forward is :class:`moe_grouped.GroupedMLP`'s over the experts' weights
(``gate_up_proj`` [E, 2I, H] as fc1, ``down_proj`` [E, H, I] as fc2): on the
``cuda`` backend in bf16/fp16 its fused experts path (dispatch, both GEMMs,
SwiGLU and the weighted combine in one autograd op, as in ``MoELayer``),
elsewhere :func:`moe_grouped.permute` -> grouped GEMM -> SwiGLU -> grouped
GEMM -> :func:`moe_grouped.unpermute` weighted by the routing weights. The
tokens per expert stay on the device, so it runs under
CUDA graph capture (on the ``cuda`` and ``torch`` backends); inside
:func:`moe_grouped.fp8.fp8_autocast` both GEMMs run in FP8 block scaling. The
experts' own parameters are used in place (no copies): checkpoints, optimizers
and the other implementations see the same tensors.

What it runs is transformers' default gated layout: ``gate_up_proj`` holding
every expert's gate rows and then its up rows (concatenated, gate first, as
``gate, up = h.chunk(2, -1)`` reads them), weights [E, out, in] (not
transposed), no biases, SiLU gate, no custom ``_apply_gate``, no norm after
the experts, no expert parallelism. Anything else is refused with an error
naming what and pointing to ``experts_implementation="grouped_mm"``: it never
falls back behind the caller's back to other numerics.

Backends: ``register(backend=None)`` uses each op's default -- the CUDA core
on Hopper, ``torch`` on other GPUs, ``reference`` on the CPU; name one to
force it (e.g. ``backend="torch"`` for float32 experts on a GPU).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import nn

from .. import backends
from ..fp8 import get_fp8_recipe
from ..gemm import check_backend_dtype
from ..mlp import GroupedMLP

DEFAULT_NAME = "moe_grouped"
_INSTALL = 'pip install "moe_grouped[transformers]"'
_USE_INSTEAD = 'use experts_implementation="grouped_mm" (or "eager") for this model'


def _transformers_moe():
    """transformers' experts interface module, imported on first use."""
    try:
        from transformers.integrations import moe
    except ImportError as error:
        raise ImportError(
            "moe_grouped.integrations.transformers needs transformers>=5 (its experts interface, "
            f"transformers.integrations.moe.ExpertsInterface): {_INSTALL}"
        ) from error
    if not hasattr(moe, "ExpertsInterface"):
        raise ImportError(
            "this transformers has no transformers.integrations.moe.ExpertsInterface (added in transformers 5); "
            f"{_INSTALL}"
        )
    return moe


class ExpertsForward:
    """What transformers calls in place of an experts module's forward.

    ``fn(experts, hidden_states, top_k_index, top_k_weights)`` with the
    experts module first (see :func:`experts_forward`); it carries the
    backend it was registered with.
    """

    # How register() recognises ours, also across a reload of this module (a new class).
    moe_grouped_experts_forward = True

    def __init__(self, backend: Optional[str] = None):
        self.backend = backends.check_name(backend)

    def __call__(self, experts: nn.Module, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        return experts_forward(experts, hidden_states, top_k_index, top_k_weights, backend=self.backend)

    def __repr__(self) -> str:
        return f"moe_grouped.integrations.transformers.ExpertsForward(backend={self.backend!r})"


def register(name: str = DEFAULT_NAME, *, backend: Optional[str] = None) -> str:
    """Registers moe_grouped's experts forward with transformers under ``name``; returns ``name``.

    Idempotent: registering the same name again (e.g. from every process or
    notebook cell) keeps one entry; with another ``backend`` it replaces ours.
    A name that holds one of transformers' own implementations (``"eager"``,
    ``"grouped_mm"``, ...) or anyone else's is refused.

    Args:
        name: the name to pass as ``experts_implementation``.
        backend: ``"cuda"``, ``"torch"``, ``"reference"`` or None (each op's
            default on the tensors' device).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    backends.check_name(backend)
    moe = _transformers_moe()
    existing = moe.ALL_EXPERTS_FUNCTIONS.get(name)
    ours = getattr(existing, "moe_grouped_experts_forward", False) is True
    if name == "eager" or (existing is not None and not ours):
        owner = "transformers' eager forward" if name == "eager" else getattr(existing, "__qualname__", repr(existing))
        raise ValueError(
            f"experts implementation {name!r} is already taken by {owner} (transformers' own or another "
            "package's); register moe_grouped under another name"
        )
    if not (ours and existing.backend == backend):
        moe.ExpertsInterface.register(name, ExpertsForward(backend))
    return name


def _is_silu(act) -> bool:
    if isinstance(act, nn.SiLU) or act is nn.functional.silu:
        return True
    from transformers import activations

    silu = getattr(activations, "SiLUActivation", None)
    return silu is not None and isinstance(act, silu)


def unsupported_reasons(experts: nn.Module) -> list[str]:
    """What in ``experts`` (a transformers experts module) this implementation cannot run; empty if nothing."""
    moe = _transformers_moe()
    reasons = []
    if not getattr(experts, "has_gate", True):
        reasons.append("experts without a gate (has_gate=False: up_proj only)")
    if getattr(experts, "has_bias", False):
        reasons.append("expert biases (has_bias=True)")
    if not getattr(experts, "is_concatenated", True):
        reasons.append("interleaved gate/up rows (is_concatenated=False)")
    if getattr(experts, "is_transposed", False):
        reasons.append("transposed expert weights (is_transposed=True: [E, in, out])")
    if getattr(experts, "has_post_expert_norm", False):
        reasons.append("a norm after each expert (has_post_expert_norm=True)")
    if getattr(experts, "_is_expert_parallel", False):
        reasons.append("expert parallelism (experts sharded across ranks)")
    default_gate = getattr(moe, "_default_apply_gate", None)
    gate = getattr(type(experts), "_apply_gate", default_gate)
    if default_gate is not None and gate is not default_gate:
        reasons.append(f"a custom gate ({type(experts).__name__}._apply_gate)")
    act = getattr(experts, "act_fn", None)
    if not _is_silu(act):
        reasons.append(f"the activation {act!r} (SwiGLU needs SiLU)")
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        reasons.append("experts without gate_up_proj and down_proj tensors")
    elif (
        gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] % 2
        or tuple(down.shape) != (gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2)
    ):
        reasons.append(
            f"weights of shapes gate_up_proj {tuple(gate_up.shape)}, down_proj {tuple(down.shape)} "
            "(expected [E, 2I, H] and [E, H, I])"
        )
    elif gate_up.dtype != down.dtype:
        reasons.append(f"gate_up_proj in {gate_up.dtype} but down_proj in {down.dtype}")
    return reasons


def _check_module(experts: nn.Module, backend: Optional[str]) -> None:
    """Raises when this implementation cannot run ``experts`` (the module, not the inputs)."""
    reasons = unsupported_reasons(experts)
    if reasons:
        raise NotImplementedError(
            f"moe_grouped's experts implementation cannot run {type(experts).__name__}: {'; '.join(reasons)}. "
            f"{_USE_INSTEAD}"
        )


def _check_inputs(gate_up: torch.Tensor, hidden_states, top_k_index, top_k_weights, backend: Optional[str]) -> None:
    hidden = gate_up.shape[2]
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2 or hidden_states.shape[1] != hidden:
        raise ValueError(
            f"hidden_states must have shape [tokens, {hidden}], got "
            f"{tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__}"
        )
    shape = (hidden_states.shape[0], top_k_index.shape[-1] if top_k_index.dim() else 0)
    if top_k_index.dim() != 2 or tuple(top_k_index.shape) != shape or tuple(top_k_weights.shape) != shape:
        raise ValueError(
            f"top_k_index and top_k_weights must both have shape [tokens, top_k] = {shape}, got "
            f"{tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}"
        )
    if get_fp8_recipe() is None:
        # Inside fp8_autocast GroupedLinear says itself what FP8 runs on.
        name = backends.resolve(backend, gate_up.device)
        try:
            check_backend_dtype(name, gate_up.dtype)
        except TypeError as error:
            raise TypeError(
                f"moe_grouped's experts implementation cannot run {gate_up.dtype} experts on backend {name!r}: "
                f"{error}. Use bfloat16 experts, register(name, backend='torch') for float32 on a GPU, or "
                f"{_USE_INSTEAD}"
            ) from None


class _Views:
    """A parameterless :class:`GroupedMLP` over an experts module's own weights.

    Its ``fc1`` and ``fc2`` (GroupedLinear, where the bf16-or-FP8 choice and
    the backward live) point at ``gate_up_proj`` and ``down_proj`` with no
    copy; the same layout as ours (gate rows first, weights [E, out, in]).
    When the experts' tensors are replaced (``to_empty``, FSDP swapping
    sharded and full parameters) the views follow them, and the module is
    checked again.
    """

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, backend: Optional[str]):
        num_experts, double_ffn, hidden = gate_up.shape
        self.mlp = GroupedMLP(
            num_experts, hidden, double_ffn // 2, single_grouped_weight=True, dtype=gate_up.dtype, device="meta",
            backend=backend,
        )
        self.backend = backend
        self.point_at(gate_up, down)

    def fits(self, gate_up: torch.Tensor, down: torch.Tensor, backend: Optional[str]) -> bool:
        """Whether these views stand for exactly these tensors (the module was checked with them)."""
        return self.backend == backend and self.mlp.fc1.weight is gate_up and self.mlp.fc2.weight is down

    def same_layout(self, gate_up: torch.Tensor, down: torch.Tensor, backend: Optional[str]) -> bool:
        """Whether these views can point at tensors of these shapes and dtype (the module's dtypes agree)."""
        fc1, fc2 = self.mlp.fc1.weight, self.mlp.fc2.weight
        return (self.backend == backend and fc1.shape == gate_up.shape and fc2.shape == down.shape
                and fc1.dtype == gate_up.dtype)

    def point_at(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        for linear, weight in ((self.mlp.fc1, gate_up), (self.mlp.fc2, down)):
            if linear.weight is not weight:
                del linear.weight  # a Parameter (or plain tensor) of its own, or the experts' previous one
                linear.weight = weight


# Keyed by the experts module; the views keep its weights, never the module, alive.
_VIEWS: "weakref.WeakKeyDictionary[nn.Module, _Views]" = weakref.WeakKeyDictionary()


def _views_of(experts: nn.Module, backend: Optional[str]) -> _Views:
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    views = _VIEWS.get(experts)
    if views is not None and views.fits(gate_up, down, backend):
        return views
    _check_module(experts, backend)
    if views is None or not views.same_layout(gate_up, down, backend):
        views = _VIEWS[experts] = _Views(gate_up, down, backend)
    else:
        views.point_at(gate_up, down)
    return views


def experts_forward(
    experts: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """A transformers experts module's forward with moe_grouped's ops.

    Where :class:`moe_grouped.GroupedMLP` would take its fused experts path
    (the ``cuda`` backend in bf16/fp16, outside FP8 autocast), this is that
    path: one autograd op for the dispatch, both GEMMs, SwiGLU and the
    weighted combine, as in :class:`moe_grouped.MoELayer`. Elsewhere it is
    :func:`moe_grouped.permute`, the two grouped GEMMs with SwiGLU between,
    and :func:`moe_grouped.unpermute`.

    Args:
        experts: the experts module (``gate_up_proj`` [E, 2I, H],
            ``down_proj`` [E, H, I]; see the module docstring for the layouts).
        hidden_states: [T, H] tokens.
        top_k_index: [T, k] int32/int64 chosen experts, in [0, E).
        top_k_weights: [T, k] their routing weights.
        backend: ``"cuda"``, ``"torch"``, ``"reference"`` or None (default).

    Returns:
        [T, H] in ``hidden_states``' dtype: ``sum_j top_k_weights[t, j] *
        expert_{top_k_index[t, j]}(hidden_states[t])``, differentiable in
        ``hidden_states``, ``top_k_weights`` and both weights.
    """
    views = _views_of(experts, backend)
    gate_up = experts.gate_up_proj
    _check_inputs(gate_up, hidden_states, top_k_index, top_k_weights, backend)
    mlp = views.mlp
    # Like transformers' grouped_mm: under torch.autocast the tokens may arrive in float32.
    tokens = hidden_states.to(gate_up.dtype).contiguous()
    weights = top_k_weights if top_k_weights.dtype in (torch.float32, tokens.dtype) else top_k_weights.float()
    weights = weights.contiguous()
    return mlp.forward_tokens(tokens, top_k_index, weights, backend=backend).to(hidden_states.dtype)


__all__ = ["register", "experts_forward", "unsupported_reasons", "ExpertsForward", "DEFAULT_NAME"]
