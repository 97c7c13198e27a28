"""``GroupedLinear``: one linear layer per expert, applied to token-major input.

Conventions follow Megatron/TransformerEngine so that their users feel at
home: ``m_splits`` (tokens per expert), ``fuse_wgrad_accumulation`` into
``param.main_grad``, ``delay_wgrad_compute`` with :meth:`GroupedLinear.backward_dw`,
``single_grouped_weight``.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ._ops import ops
from . import _checks, backends
from .fp8 import get_fp8_recipe
from .fp8 import linear as fp8_linear
from ._tensors import num_groups_of
from .gemm import check_backend_dtype


@dataclass(frozen=True)
class _Spec:
    """What the autograd function needs to know about the layer."""

    backend: str
    num_weights: int
    has_bias: bool
    fuse_wgrad_accumulation: bool
    delay_wgrad_compute: bool

    @property
    def num_params(self) -> int:
        """Weights, then as many biases (one [E, N] for one [E, N, K] weight, else one per expert)."""
        return self.num_weights * (2 if self.has_bias else 1)


class _GroupedLinearFunction(torch.autograd.Function):
    """``tensors``: the parameters, then (fused accumulation) the weights' ``main_grad``s.

    The ``main_grad`` buffers come in as inputs rather than being looked up on
    the parameters in backward, so torch.compile traces the accumulation as a
    mutation of a graph input.
    """

    @staticmethod
    def forward(ctx, x, m_splits, spec: _Spec, delayed: collections.deque, *tensors):
        params, main_grads = tensors[: spec.num_params], tensors[spec.num_params :]
        weights, biases = list(params[: spec.num_weights]), params[spec.num_weights :]
        bias = _stack_biases(biases) if spec.has_bias else None
        y = ops.grouped_fprop(x, weights, m_splits, bias, x.dtype, spec.backend, True)
        ctx.save_for_backward(x, m_splits, *params)
        # Not saved tensors: other micro-batches accumulate into them before
        # this backward runs, which the saved-tensor version check would refuse.
        ctx.main_grads = main_grads
        ctx.spec = spec
        ctx.delayed = delayed
        return y

    @staticmethod
    def backward(ctx, dy):
        x, m_splits, *params = ctx.saved_tensors
        spec: _Spec = ctx.spec
        main_grads = ctx.main_grads
        weights, biases = params[: spec.num_weights], params[spec.num_weights :]
        dy = dy.contiguous()
        dx = None
        if ctx.needs_input_grad[0]:
            dx = ops.grouped_dgrad(dy, list(weights), m_splits, x.dtype, spec.backend, True)
        param_grads = [None] * len(params)
        if any(ctx.needs_input_grad[4 : 4 + spec.num_params]):
            if spec.delay_wgrad_compute:
                ctx.delayed.append(
                    ([*weights, *biases], lambda: _param_grads(spec, dy, x, m_splits, weights, biases, main_grads))
                )
            else:
                param_grads = _param_grads(spec, dy, x, m_splits, weights, biases, main_grads)
        return (dx, None, None, None, *param_grads, *([None] * len(main_grads)))


_EXPERT_NAMES: dict[tuple[str, int], tuple[str, ...]] = {}


def _expert_names(prefix: str, num_experts: int) -> tuple[str, ...]:
    """("weight0", ..., f"weight{E-1}") for prefix "weight": the per-expert parameter names."""
    names = _EXPERT_NAMES.get((prefix, num_experts))
    if names is None:
        names = _EXPERT_NAMES[(prefix, num_experts)] = tuple(f"{prefix}{e}" for e in range(num_experts))
    return names


def _convert_layout(state_dict: dict, prefix: str, name: str, num_experts: int, single: bool) -> None:
    """Rewrites ``state_dict``'s ``name`` entries in place into the module's layout.

    ``single``: E per-expert entries ``{name}0 ..`` become one stacked ``{name}``;
    else a stacked ``{name}`` with E rows becomes the E entries. A state dict
    already in the module's layout, or in neither, is left for nn.Module's
    checks to report.
    """
    stacked = prefix + name
    per_expert = [prefix + n for n in _expert_names(name, num_experts)]
    if single and stacked not in state_dict and all(k in state_dict for k in per_expert):
        state_dict[stacked] = torch.stack([state_dict.pop(k) for k in per_expert])
    elif not single and stacked in state_dict and not any(k in state_dict for k in per_expert):
        value = state_dict[stacked]
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == num_experts:
            del state_dict[stacked]
            state_dict.update(zip(per_expert, value.unbind(0)))


def _stack_biases(biases) -> torch.Tensor:
    return biases[0] if len(biases) == 1 and biases[0].dim() == 2 else torch.stack(list(biases))


def _main_grads(weights) -> list[torch.Tensor]:
    grads = []
    for weight in weights:
        main_grad = getattr(weight, "main_grad", None)
        if not isinstance(main_grad, torch.Tensor) or main_grad.shape != weight.shape or main_grad.device != weight.device:
            raise RuntimeError(
                "fuse_wgrad_accumulation=True needs every weight to carry a `main_grad` tensor of its "
                f"shape {tuple(weight.shape)} on {weight.device} (Megatron allocates these); got "
                f"{None if main_grad is None else (tuple(main_grad.shape), main_grad.device)}. "
                "Allocate them, e.g. `w.main_grad = torch.zeros_like(w, dtype=torch.float32)`"
            )
        grads.append(main_grad)
    return grads


def _grouped_wgrad_into_fresh(dy, x, m_splits, weights, backend: str) -> list[torch.Tensor]:
    """Weight gradients in new memory, one tensor per weight parameter.

    Always computed into one [E, N, K] tensor: per-expert outputs would need a
    device array of their addresses, and fresh addresses cannot get one during
    capture. The separate layout gets per-expert views of it.
    """
    w = weights[0]
    grads = torch.empty(len(weights) if w.dim() == 2 else w.shape[0], *w.shape[-2:], dtype=w.dtype, device=w.device)
    ops.grouped_wgrad_(dy, x, m_splits, [grads], False, backend)
    return grads_as_params(grads, weights)


def grads_as_params(grads: torch.Tensor, weights) -> list[torch.Tensor]:
    """One [E, N, K] gradient as the weight parameters hold it: itself for one grouped weight, else a view
    per expert."""
    return [grads] if weights[0].dim() == 3 else list(grads.unbind(0))


def _param_grads(spec: _Spec, dy, x, m_splits, weights, biases, main_grads) -> list[Optional[torch.Tensor]]:
    """Weight and bias gradients, in parameter order.

    With fused accumulation the weight gradients go into ``main_grads`` and
    autograd gets None for them (the forward set ``grad_added_to_main_grad``,
    as Megatron expects).
    """
    if spec.fuse_wgrad_accumulation:
        ops.grouped_wgrad_(dy, x, m_splits, list(main_grads), True, spec.backend)
        weight_grads = [None] * len(weights)
    else:
        weight_grads = _grouped_wgrad_into_fresh(dy, x, m_splits, weights, spec.backend)
    bias_grads = []
    if spec.has_bias:
        dbias = ops.grouped_dbias(dy, m_splits, num_groups_of(weights), dy.dtype, spec.backend)
        bias_grads = [dbias] if len(biases) == 1 and biases[0].dim() == 2 else list(dbias.unbind(0))
    return [*weight_grads, *bias_grads]


class GroupedLinear(nn.Module):
    """``num_experts`` independent linear layers over token-major input.

    ``forward(x, m_splits)`` takes ``x`` of shape [M, in_features] whose rows
    are grouped by expert (expert 0's ``m_splits[0]`` rows first, and so on)
    and returns [M, out_features].

    Args:
        num_experts: E, the number of experts.
        in_features, out_features: K and N of each expert's weight [N, K].
        bias: add a learned per-expert bias.
        single_grouped_weight: hold the weights as one [E, N, K] parameter
            ``weight`` (and one [E, N] ``bias``) instead of E parameters
            ``weight0 .. weight{E-1}`` (and ``bias0 ..``), as
            TransformerEngine's GroupedLinear does. ``load_state_dict``
            takes a state dict in either layout.
        fuse_wgrad_accumulation: accumulate weight gradients into the fp32
            ``main_grad`` tensor each weight carries (Megatron's convention)
            instead of producing ``.grad``.
        delay_wgrad_compute: backward computes the input gradient only; call
            :meth:`backward_dw` afterwards for the parameter gradients.
        dtype, device: of the parameters.
        backend: ``"cuda"``, ``"torch"``, ``"reference"`` or None (the device's
            default, resolved at each call).

    ``m_splits`` is a device tensor of E int32/int64 counts (graph-safe; never
    read on the host) or a list of ints (validated on the host). A device
    ``m_splits`` may sum to fewer than the M rows: the rows past the sum
    belong to no expert, their output and input gradient are zeros and they
    add nothing to the parameter gradients (on every backend). A list must
    sum to M.
    """

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        single_grouped_weight: bool = False,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        dtype: Optional[torch.dtype] = None,
        device=None,
        backend: Optional[str] = None,
    ):
        super().__init__()
        for name, value in (("num_experts", num_experts), ("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_experts = num_experts
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = bias
        self.single_grouped_weight = single_grouped_weight
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.delay_wgrad_compute = delay_wgrad_compute
        self.backend = backends.check_name(backend)
        self._delayed: collections.deque = collections.deque()
        self._fp8_weights = fp8_linear.WeightCache()  # is_first_microbatch
        factory = {"dtype": dtype, "device": device}
        if single_grouped_weight:
            self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, **factory))
            self.bias = nn.Parameter(torch.empty(num_experts, out_features, **factory)) if bias else None
        else:
            for e in range(num_experts):
                self.register_parameter(f"weight{e}", nn.Parameter(torch.empty(out_features, in_features, **factory)))
                if bias:
                    self.register_parameter(f"bias{e}", nn.Parameter(torch.empty(out_features, **factory)))
        self.reset_parameters()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Either layout loads into either: checkpoints outlive the choice of single_grouped_weight.
        for name in ("weight", "bias"):
            _convert_layout(state_dict, prefix, name, self.num_experts, self.single_grouped_weight)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def weights(self) -> list[torch.Tensor]:
        """The weight parameters: ``[weight]`` or ``[weight0, ..., weight{E-1}]``."""
        if self.single_grouped_weight:
            return [self.weight]
        return self._per_expert("weight")

    def biases(self) -> list[torch.Tensor]:
        if not self.use_bias:
            return []
        if self.single_grouped_weight:
            return [self.bias]
        return self._per_expert("bias")

    def _per_expert(self, prefix: str) -> list[torch.Tensor]:
        # Read from _parameters (what nn.Module's attribute lookup finds first) without a
        # __getattr__ per expert; an expert whose parameter was replaced by a plain tensor
        # attribute is looked up the usual way.
        params = self._parameters
        return [params[name] if name in params else getattr(self, name)
                for name in _expert_names(prefix, self.num_experts)]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Linear's initialisation, independently for each expert."""
        bound = 1.0 / math.sqrt(self.in_features)
        for e in range(self.num_experts):
            weight = self.weight[e] if self.single_grouped_weight else getattr(self, f"weight{e}")
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        for bias in self.biases():
            nn.init.uniform_(bias, -bound, bound)

    def forward(
        self, x: torch.Tensor, m_splits: _checks.SplitsLike, is_first_microbatch: Optional[bool] = None
    ) -> torch.Tensor:
        """y = x W_e^T (+ b_e) for each expert's rows of x.

        ``is_first_microbatch`` (FP8 only; ignored otherwise): None quantizes
        the weights on every call; True quantizes them and keeps the FP8 copy;
        False reuses the copy kept by the last True, so the later
        micro-batches of a gradient-accumulation step skip the weight
        quantization. False raises if the weights changed since (an optimizer
        step: pass True after each one) or if nothing was kept.
        """
        if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
            raise TypeError(f"is_first_microbatch must be None, True or False, got {is_first_microbatch!r}")
        _checks.check_tensor("x", x, dim=2)
        weights = self.weights()
        first = weights[0]
        if x.shape[1] != self.in_features:
            raise ValueError(
                f"x must have shape [tokens, {self.in_features}] (in_features), got {tuple(x.shape)}"
            )
        if x.dtype != first.dtype:
            raise TypeError(f"x has dtype {x.dtype} but the layer's parameters are {first.dtype}")
        _checks.check_same_device("the layer's parameters", first, x=x)
        backend = backends.resolve(self.backend, x.device)
        splits = _checks.normalize_splits(m_splits, self.num_experts, x.shape[0], x.device, backend=backend)
        recipe = get_fp8_recipe()
        if recipe is None:
            check_backend_dtype(backend, x.dtype)
        else:
            # Never fall back to bf16 silently inside an FP8 region.
            fp8_linear.check_supported(backend, x, self.out_features, self.in_features)
        if self.delay_wgrad_compute and torch.compiler.is_compiling():
            # backward_dw() runs work that backward queued on the module, which a
            # compiled graph cannot hold; refuse rather than drop the gradients.
            raise NotImplementedError(
                "GroupedLinear(delay_wgrad_compute=True) cannot run under torch.compile: the deferred weight "
                "gradients are Python closures kept for backward_dw(). Compile a layer built with "
                "delay_wgrad_compute=False, or run this one eagerly (or captured with moe_grouped.graphs)"
            )
        spec = self._spec(backend)
        params = (*weights, *self.biases())
        main_grads = []
        if self.fuse_wgrad_accumulation and torch.is_grad_enabled() and any(w.requires_grad for w in weights):
            main_grads = _main_grads(weights)
            for weight in weights:
                weight.grad_added_to_main_grad = True
        if recipe is None:
            return _GroupedLinearFunction.apply(x, splits, spec, self._delayed, *params, *main_grads)
        cached = self._fp8_weights.get(weights, recipe, backend, is_first_microbatch)
        return fp8_linear.Fp8GroupedLinearFunction.apply(
            x, splits, spec, recipe, self._delayed, cached, *params, *main_grads
        )

    def _spec_key(self) -> tuple:
        """What :meth:`_spec` (with the backend resolved) depends on."""
        return (self.backend, self.single_grouped_weight, self.num_experts, self.use_bias,
                self.fuse_wgrad_accumulation, self.delay_wgrad_compute)

    def _spec(self, backend: str) -> _Spec:
        """What an autograd function running this layer on ``backend`` needs to know of it."""
        return _Spec(
            backend=backend,
            num_weights=1 if self.single_grouped_weight else self.num_experts,
            has_bias=self.use_bias,
            fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
            delay_wgrad_compute=self.delay_wgrad_compute,
        )

    def backward_dw(self) -> None:
        """Computes the parameter gradients that backward deferred.

        With ``delay_wgrad_compute=True``, each backward pass leaves one entry;
        this consumes the oldest. Gradients go to ``main_grad`` (fused
        accumulation) or are added to ``.grad``.
        """
        if not self.delay_wgrad_compute:
            raise RuntimeError("backward_dw() is only for layers built with delay_wgrad_compute=True")
        if not self._delayed:
            raise RuntimeError("backward_dw() called with no deferred weight gradient; run backward first")
        params, compute = self._delayed.popleft()
        for param, grad in zip(params, compute()):
            if grad is None:
                continue
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.use_bias}, "
            f"single_grouped_weight={self.single_grouped_weight}, backend={self.backend}"
        )
