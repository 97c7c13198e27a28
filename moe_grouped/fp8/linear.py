"""GroupedLinear's forward and backward in FP8 block scaling.

Forward: the weights are quantized in 128x128 blocks (with the transposed
copy dgrad reads) and x in one pass into its row-wise 1x128 copy (fprop) and
its grouped column-wise copy (kept for wgrad, half the bytes of x). Backward:
dy in one pass into row-wise (dgrad), column-wise (wgrad) and, with a bias,
its per-expert column sums. Every step reads m_splits on the device only, so
the whole layer can be captured in a CUDA graph.

Backends: ``cuda`` (the core's kernels, sm_90) and ``reference`` (the plain
PyTorch quantizers and dequantize-then-multiply GEMMs: the numerics the
kernels are checked against, on any device, slow and not capturable).

Every quantize and GEMM is a ``torch.library`` custom op, so the layer traces
under torch.compile (``fullgraph=True``); the one exception is the
host-side weight cache of ``is_first_microbatch``, refused there.
"""

from __future__ import annotations

import collections
from typing import Optional

import torch

from .. import _core, backends
from .._tensors import num_groups_of
from . import gemm
from .quantize import quantize_grouped, quantize_weights_128x128
from .quantize_reference import BlockQuantized, GroupedQuantized, WeightQuantized
from .recipe import Float8BlockScaling

# The quantizers keep their per-group offsets here: a slot of their own, so
# that they never share scratch with a GEMM that may run concurrently.
SLOT_QUANTIZE = 3


def check_supported(backend: str, x: torch.Tensor, n: int, k: int) -> None:
    """Raises a clear error when FP8 block scaling cannot run this layer."""
    if backend not in gemm.BACKENDS:
        raise NotImplementedError(
            f"FP8 block scaling runs on the 'cuda' backend (Hopper, sm_90) or emulated on the 'reference' "
            f"backend; this layer resolved to backend {backend!r}. Pass backend='cuda' on an H100/H200, "
            "backend='reference' to emulate, or run outside moe_grouped.fp8.fp8_autocast"
        )
    if x.dtype != torch.bfloat16:
        raise TypeError(f"FP8 GroupedLinear takes bfloat16 input and parameters, got {x.dtype}")
    if backend == "cuda":
        major, minor = _capability(x.device)
        if (major, minor) != (9, 0):
            raise NotImplementedError(
                f"FP8 block-scaled GEMMs need an sm_90 GPU (H100/H200); {x.device} is sm_{major}{minor}"
            )
        if not _core.has(_core.CAP_GROUPED_GEMM_FP8_BLOCKWISE):
            raise RuntimeError("the CUDA core was built without its FP8 block-scaled grouped GEMMs")
        if not gemm.shape_supported(n, k):
            raise ValueError(
                f"FP8 GroupedLinear on the cuda backend needs in_features and out_features that are multiples "
                f"of {gemm.ALIGNMENT}, got in_features={k}, out_features={n}"
            )


@backends.assume_constant_result
def _capability(device: torch.device) -> tuple[int, int]:
    """The device's compute capability: fixed, so torch.compile may fold the host query."""
    return torch.cuda.get_device_capability(device)


def _quantize_tokens(x, m_splits, dtype, recipe: Float8BlockScaling, backend, *, rowwise, dbias) -> GroupedQuantized:
    return quantize_grouped(x, m_splits, dtype, recipe.pow2_scales, recipe.amax_epsilon, rowwise=rowwise,
                            dbias=dbias, workspace_slot=SLOT_QUANTIZE, backend=backend)


def quantize_weights(weights, recipe: Float8BlockScaling, backend, *, transpose, out=None) -> WeightQuantized:
    """A layer's weights in the recipe's 128x128 blocks (with the transposed copy dgrad reads)."""
    return quantize_weights_128x128(weights, recipe.forward_dtype, recipe.pow2_scales, recipe.amax_epsilon,
                                    transpose=transpose, out=out, backend=backend)


class WeightCache:
    """A layer's FP8 weights kept from one micro-batch to the next.

    ``GroupedLinear(..., is_first_microbatch=True)`` quantizes the weights
    (with the transposed copy) and keeps them here; ``False`` reuses them, so
    the micro-batches of a gradient-accumulation step after the first skip the
    weight quantization. Reuse is refused, with an error, when the weights
    were modified in place (their version counters moved: an optimizer step),
    were replaced, or the recipe changed: pass ``True`` again after each
    optimizer step. Writes through ``.data`` bypass the version counter and
    are not detected. On the cuda backend each ``True`` rewrites the same
    buffers, so a CUDA graph captured with ``True`` and one captured with
    ``False`` share them: replaying the first after an optimizer step
    refreshes what the second reads.
    """

    def __init__(self):
        self._stamp: Optional[tuple] = None
        self._weights: Optional[WeightQuantized] = None

    @staticmethod
    def _stamp_of(weights, recipe: Float8BlockScaling, backend: str) -> tuple:
        layout = (recipe.forward_dtype, backend, weights[0].device, tuple(tuple(w.shape) for w in weights))
        contents = (recipe.pow2_scales, recipe.amax_epsilon, tuple((w.data_ptr(), w._version) for w in weights))
        return layout, contents

    def get(self, weights, recipe: Float8BlockScaling, backend: str, is_first_microbatch: Optional[bool]):
        """The FP8 weights for this call, or None to quantize them inside it."""
        if is_first_microbatch is None:
            return None
        if torch.compiler.is_compiling():
            # The cache compares data pointers and version counters on the host between calls.
            raise NotImplementedError(
                "FP8 weight reuse (is_first_microbatch=True/False) cannot run under torch.compile: the FP8 weight "
                "cache is host state checked between calls. Pass is_first_microbatch=None (the weights are "
                "then quantized inside the compiled graph on every call), or run this layer eagerly"
            )
        stamp = self._stamp_of(weights, recipe, backend)
        if is_first_microbatch:
            same_layout = self._stamp is not None and self._stamp[0] == stamp[0]
            out = self._weights if same_layout and backend != "reference" else None
            with torch.no_grad():
                self._weights = quantize_weights(weights, recipe, backend, transpose=True, out=out)
            self._stamp = stamp
        elif self._weights is None:
            raise RuntimeError(
                "is_first_microbatch=False, but no FP8 weights were kept: pass is_first_microbatch=True on the "
                "first micro-batch (inside fp8_autocast) after each optimizer step"
            )
        elif stamp != self._stamp:
            raise RuntimeError(
                "is_first_microbatch=False, but the weights (or the FP8 recipe or backend) changed since "
                "is_first_microbatch=True quantized them: pass is_first_microbatch=True after each optimizer step"
            )
        return self._weights


class Fp8GroupedLinearFunction(torch.autograd.Function):
    """y = x W_e^T (+ b_e) per expert in FP8; see the module docstring.

    ``spec`` is GroupedLinear's ``_Spec``; ``delayed`` its queue of deferred
    weight gradients; ``cached``: the weights already quantized
    (WeightCache), or None. ``tensors``: the parameters, then (fused
    accumulation) the weights' ``main_grad``s, passed as inputs (not saved:
    other micro-batches accumulate into them first) so that torch.compile
    traces the accumulation as a mutation of a graph input.
    """

    @staticmethod
    def forward(ctx, x, m_splits, spec, recipe: Float8BlockScaling, delayed: collections.deque,
                cached: Optional[WeightQuantized], *tensors):
        params, main_grads = tensors[: spec.num_params], tensors[spec.num_params :]
        weights, biases = list(params[: spec.num_weights]), params[spec.num_weights :]
        bias = None
        if spec.has_bias:
            bias = biases[0] if len(biases) == 1 and biases[0].dim() == 2 else torch.stack(list(biases))
        need_dgrad = ctx.needs_input_grad[0]
        need_wgrad = any(ctx.needs_input_grad[_PARAMS : _PARAMS + spec.num_weights])
        wq = cached if cached is not None else quantize_weights(weights, recipe, spec.backend, transpose=need_dgrad)
        xq = _quantize_tokens(x, m_splits, recipe.forward_dtype, recipe, spec.backend, rowwise=True, dbias=False)
        y = gemm.grouped_fprop_fp8(xq.rowwise, wq.w, m_splits, bias, backend=spec.backend)
        saved = [m_splits]
        saved += [wq.wt.data, wq.wt.scale_inv] if need_dgrad else [None, None]
        saved += [xq.columnwise.data, xq.columnwise.scale_inv] if need_wgrad else [None, None]
        ctx.save_for_backward(*saved, *params)
        ctx.main_grads = main_grads
        ctx.spec, ctx.recipe, ctx.delayed = spec, recipe, delayed
        ctx.total_rows = x.shape[0]
        return y

    @staticmethod
    def backward(ctx, dy):
        m_splits, wt_data, wt_scale, xt_data, xt_scale, *params = ctx.saved_tensors
        spec, recipe, main_grads = ctx.spec, ctx.recipe, ctx.main_grads
        weights, biases = params[: spec.num_weights], params[spec.num_weights :]
        need_params = ctx.needs_input_grad[_PARAMS : _PARAMS + spec.num_params]
        need_weights, need_biases = any(need_params[: spec.num_weights]), any(need_params[spec.num_weights :])
        dyq = _quantize_tokens(
            dy.contiguous(), m_splits, recipe.backward_dtype, recipe, spec.backend,
            rowwise=ctx.needs_input_grad[0], dbias=spec.has_bias and need_biases,
        )
        dx = None
        if ctx.needs_input_grad[0]:
            dx = gemm.grouped_dgrad_fp8(dyq.rowwise, BlockQuantized(wt_data, wt_scale), m_splits, backend=spec.backend)
        grads = [None] * len(params)
        if need_weights or need_biases:
            xt = BlockQuantized(xt_data, xt_scale) if need_weights else None
            job = (spec, weights, biases, main_grads, dyq.columnwise, xt, dyq.dbias, m_splits, ctx.total_rows)
            if spec.delay_wgrad_compute:
                ctx.delayed.append((list(params), lambda: param_grads(*job)))
            else:
                grads = param_grads(*job)
        return (dx, *([None] * (_PARAMS - 1)), *grads, *([None] * len(main_grads)))


# Fp8GroupedLinearFunction's inputs before the parameters.
_PARAMS = 6


def param_grads(spec, weights, biases, main_grads, dyt, xt, dbias, m_splits, total_rows: int) -> list:
    """Parameter gradients in parameter order (None for weights when ``xt`` is None).

    With fused accumulation the weight gradients go into ``main_grads`` and
    autograd gets None for them (GroupedLinear's forward set
    ``grad_added_to_main_grad``, as Megatron expects).
    """
    weight_grads = [None] * len(weights)
    if xt is not None and spec.fuse_wgrad_accumulation:
        wgrad_into(dyt, xt, m_splits, total_rows, list(main_grads), accumulate=True, backend=spec.backend)
    elif xt is not None:
        w = weights[0]
        grads = torch.empty(num_groups_of(weights), *w.shape[-2:], dtype=w.dtype, device=w.device)
        wgrad_into(dyt, xt, m_splits, total_rows, [grads], accumulate=False, backend=spec.backend)
        weight_grads = [grads] if w.dim() == 3 else list(grads.unbind(0))
    return [*weight_grads, *bias_grads(dbias, biases)]


def wgrad_into(dyt, xt, m_splits, total_rows: int, out: list, *, accumulate: bool, backend: str) -> None:
    """The FP8 weight gradient of one layer into ``out`` (see gemm.grouped_wgrad_fp8)."""
    gemm.grouped_wgrad_fp8(dyt, xt, m_splits, out, total_rows=total_rows, accumulate=accumulate, backend=backend)


def bias_grads(dbias: Optional[torch.Tensor], biases) -> list:
    """The fused dbias (float32 [E, N]) as the bias parameters' gradients."""
    if dbias is None:
        return []
    if len(biases) == 1 and biases[0].dim() == 2:
        return [dbias.to(biases[0].dtype)]
    return list(dbias.to(biases[0].dtype).unbind(0))
