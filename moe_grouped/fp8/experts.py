"""The fused experts path's stages in FP8 block scaling (``fp8_autocast``).

The same steps as :class:`moe_grouped.experts.Stages`, each GEMM reading
FP8 operands with the recipe's scales (1x128 activations and gradients,
128x128 weights):

- forward: the token rows are quantized row-wise straight from x [T, H]
  through the routing index (``quantize_gathered``: no bf16 permuted copy),
  fc1 runs in FP8 into g [R, 2I] (bf16, kept for backward as on the bf16
  path), h = swiglu(g) is quantized row-wise for fc2 in the pass that
  computes it (h itself is never stored);
- backward: dout is quantized through the index once, row-wise for fc2's
  dgrad and column-wise for its wgrad; the weighted SwiGLU backward turns g
  into dg in place and gives wh; wh is quantized column-wise (fc2's wgrad),
  dg row-wise (fc1's dgrad) and, after dx, column-wise (fc1's wgrad), after
  which dg's memory is released; the token rows are quantized column-wise
  through the index again (fc1's wgrad);
- weights: both layers' 128x128 copies with their transposes, made once per
  forward, or kept across micro-batches with ``is_first_microbatch``
  (:class:`moe_grouped.fp8.linear.WeightCache`).

Every step reads ``m_splits`` and the index on the device only, so the op
captures in CUDA graphs like the bf16 one. In plain eager code on the
``cuda`` backends the same kernels run from a few core calls
(:mod:`moe_grouped.fp8.sequence`), bitwise these stages. Backends: ``cuda`` and
``reference`` (the quantizers' and GEMMs' plain-PyTorch references).
"""

from __future__ import annotations

from typing import Optional

import torch

from .._ops import ops
from ..activation import swiglu
from ..permute import source_rows
from . import sequence
from .linear import WeightCache, param_grads, quantize_weights
from .quantize import quantize_rows, quantize_rowwise, swiglu_quantize_rows
from .quantize_reference import BlockQuantized, WeightQuantized
from .recipe import Float8BlockScaling


class Fp8Stages:
    """One forward's FP8 state: the recipe and the quantized weights.

    Made per call by :func:`stages_for`; the autograd op keeps it for backward.
    The stages call the quantizers and GEMMs past their public checks: every
    operand here is made by the op or checked by the layer and the recipe.
    """

    def __init__(self, recipe: Float8BlockScaling, backend: str, w1: WeightQuantized, w2: WeightQuantized):
        self.recipe = recipe
        self.backend = backend
        self.w1, self.w2 = w1, w2
        # (row_id_map, its index) from the forward, which its backward reads again (same map, same index).
        self._kept_index: Optional[tuple] = None

    def _quantize(self, x, index, dtype, m_splits=None, *, rowwise=True):
        recipe = self.recipe
        return quantize_rows(x, index, dtype, recipe.pow2_scales, float(recipe.amax_epsilon), m_splits, rowwise,
                             self.backend)

    def index(self, plan, row_id_map) -> Optional[torch.Tensor]:
        """Each permuted row's token (routed), None for permuted input.

        Made in forward and kept for backward in eager code. Under torch.compile
        made again where needed: a tensor set on this object in forward would be
        a side effect the compiler refuses.
        """
        if not plan.routed:
            return None
        kept = self._kept_index
        if kept is not None and kept[0] is row_id_map:
            return kept[1]
        index = source_rows(row_id_map, plan.top_k, plan.num_rows)
        if not torch.compiler.is_compiling():
            self.keep_index(row_id_map, index)
        return index

    def keep_index(self, row_id_map: torch.Tensor, index: torch.Tensor) -> None:
        """Keep ``index``, made from ``row_id_map``, for the backward (eager code only)."""
        self._kept_index = (row_id_map, index)

    def sequence_forward(self, plan, tokens, row_id_map, m_splits, w1, w2) -> Optional[tuple]:
        """(g, y) of :meth:`fc1_swiglu` and :meth:`fc2` from a few core calls where those apply
        (:mod:`moe_grouped.fp8.sequence`; bitwise the same), else None."""
        if not sequence.applies(plan, self, tokens):
            return None
        return sequence.forward_fc(plan, self, tokens, row_id_map, m_splits)

    def sequence_backward(self, plan, sinks, needed, dout, tokens, probs, row_id_map, m_splits, g, w1,
                          w2) -> Optional[tuple]:
        """The op's backward (see :func:`moe_grouped.experts.backward`) from a few core calls where those
        apply, else None."""
        if not sequence.backward_applies(plan, sinks, self, tokens, probs, (*w1, *w2)):
            return None
        return sequence.backward(plan, self, sinks, needed, dout, tokens, probs, row_id_map, m_splits, g, w1, w2)

    def _fprop(self, xq: BlockQuantized, w: BlockQuantized, m_splits) -> torch.Tensor:
        return ops.fp8_grouped_fprop(xq.data, xq.scale_inv, w.data, w.scale_inv, m_splits, None, self.backend)

    def _dgrad(self, dyq: BlockQuantized, wt: BlockQuantized, m_splits) -> torch.Tensor:
        return ops.fp8_grouped_dgrad(dyq.data, dyq.scale_inv, wt.data, wt.scale_inv, m_splits, self.backend)

    def fc1_swiglu(self, plan, tokens, row_id_map, m_splits, w1):
        xq = self._quantize(tokens, self.index(plan, row_id_map), self.recipe.forward_dtype).rowwise
        g = self._fprop(xq, self.w1.w, m_splits)
        del xq
        recipe = self.recipe
        if plan.activation_backend == self.backend:  # cuda with cuda, or the references
            return g, swiglu_quantize_rows(g, recipe.forward_dtype, recipe.pow2_scales, float(recipe.amax_epsilon),
                                           self.backend)
        h = swiglu(g, backend=plan.activation_backend)
        return g, quantize_rowwise(h, recipe.forward_dtype, recipe.pow2_scales, recipe.amax_epsilon)

    def fc2(self, plan, h, m_splits, w2) -> torch.Tensor:
        return self._fprop(h, self.w2.w, m_splits)

    def dgrad_swiglu_(self, plan, dout, row_id_map, m_splits, g, w, w2):
        index = self.index(plan, row_id_map)
        dyq = self._quantize(dout.to(g.dtype).contiguous(), index, self.recipe.backward_dtype, m_splits)
        dh_u = self._dgrad(dyq.rowwise, self.w2.wt, m_splits)
        dyt = dyq.columnwise
        del dyq  # the row-wise copy, before the pass below
        dprob = g.new_empty(g.shape[0], dtype=torch.float32)
        ops.swiglu_weighted_backward_(dh_u, g, w, m_splits, dprob, plan.activation_backend)
        return dyt, dh_u, dprob  # dh_u now holds wh

    def wgrad_input(self, plan, rows, m_splits):
        return self._quantize(rows, None, self.recipe.forward_dtype, m_splits, rowwise=False).columnwise

    def wgrad_grad(self, plan, rows, m_splits):
        dgt = self._quantize(rows, None, self.recipe.backward_dtype, m_splits, rowwise=False).columnwise
        # rows is dg, in the storage of the g that autograd keeps until backward returns; nothing reads it
        # after this copy (a second backward is refused by g's version counter), so its memory goes now:
        # beside its FP8 copy it would be the step's peak. Not while tracing, where storage is not ours.
        if not torch.compiler.is_compiling():
            rows.untyped_storage().resize_(0)
        return dgt

    def fc1_dgrad(self, plan, dg, m_splits, w1) -> torch.Tensor:
        # Only the row-wise copy here; the column-wise one comes after dx (wgrad_grad): with
        # both alive beside dg and dxp this point would hold more than the bf16 path's peak.
        dgq = self._quantize(dg, None, self.recipe.backward_dtype).rowwise
        return self._dgrad(dgq, self.w1.wt, m_splits)

    def gathered_tokens(self, plan, tokens, row_id_map, m_splits):
        index = self.index(plan, row_id_map)
        return self._quantize(tokens, index, self.recipe.forward_dtype, m_splits, rowwise=False).columnwise

    def param_grads(self, spec, dyt, xt, m_splits, rows, weights, main_grads) -> list:
        return param_grads(spec, weights, [], main_grads, dyt, xt, None, m_splits, rows)


def stages_for(recipe: Float8BlockScaling, backend: str, weights: tuple, caches: tuple[WeightCache, WeightCache],
               is_first_microbatch: Optional[bool]) -> Fp8Stages:
    """The FP8 stages of one forward: fc1's and fc2's weights (lists) quantized now, or taken from the caches."""
    quantized = []
    for layer_weights, cache in zip(weights, caches):
        kept = cache.get(layer_weights, recipe, backend, is_first_microbatch)
        if kept is None:
            with torch.no_grad():
                kept = quantize_weights(layer_weights, recipe, backend, transpose=True)
        quantized.append(kept)
    return Fp8Stages(recipe, backend, *quantized)
