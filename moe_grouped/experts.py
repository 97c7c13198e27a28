"""The fused experts path: dispatch, SwiGLU experts and weighted combine as one autograd op.

The unfused path (``permute`` -> ``GroupedMLP`` -> ``unpermute``) keeps, for
backward, the permuted tokens xp [R, H], fc1's output g [R, 2I], h [R, I]
and the expert output y [R, H] (for the routing weights' gradient). This one
keeps the tokens x [T, H] (the router keeps them anyway), g and the routing
weights (on the ``cuda`` backend its fc1 reads x through the routing index,
so the forward writes no permuted copy at all), and recomputes the rest in
backward from these identities (per copy of token t at row r with weight w,
dout the layer's output gradient, dy_u = dout_t gathered unweighted):

- ``out_t = sum_r w * y_r`` with ``y = h W2^T``, so
  ``d w = <dout_t, y_r> = <dy_u W2, h> = <dh_u, h>``: no y needed;
- ``dh = w * dh_u``, ``dg = swiglu_backward(dh, g)``, and
  ``dW2 = dy_u^T (w * h)``: one pass (:func:`moe_grouped.activation.swiglu_weighted_backward`)
  gives dg (in place of g), w * h and d w from dh_u and g
  (``torch.ops.moe_grouped.grouped_dgrad_swiglu_``; it runs the pass in
  fc2's dgrad epilogue only with ``MOE_GROUPED_DGRAD_SWIGLU=fused``);
- ``dW1 = xp^T dg`` with xp gathered again from x; ``dx`` sums
  ``dg W1^T`` over each token's copies.

Graph-safe like the unfused path (device ``m_splits`` and ``row_id_map``
only) and deterministic. Without routing (``GroupedMLP`` on permuted input)
the same op keeps x and g but not h. The GEMMs run in the layer's dtype
(:class:`Stages`) or in FP8 block scaling (:class:`moe_grouped.fp8.experts.Fp8Stages`,
inside ``fp8_autocast``); the steps above are the same. In plain eager code on
the ``cuda`` backends the layer-dtype backward runs as two core calls
(:mod:`moe_grouped.experts_sequence`: the same kernels, a fraction of the
host time; the forward's fc1 and fc2 as one), and the FP8 stages as ten
(:mod:`moe_grouped.fp8.sequence`). Not supported here
(the unfused path handles them): biases, and a second backward through the
same graph (``retain_graph=True``): backward turns the kept g into dg in
place, and autograd's version check then refuses the second backward.
Design notes and the measurements behind the kernel choices:
docs/experts-path.md.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ._ops import direct_calls, ops
from . import experts_sequence
from .activation import swiglu
from .gemm import cuda_backend
from .grouped_linear import _main_grads, _param_grads, _Spec
from .permute import source_rows

EXPERTS_PATHS = (None, "fused", "unfused")


@dataclass(frozen=True)
class Plan:
    """What the fused op needs besides tensors: backends, layer specs and static sizes."""

    gemm_backend: str
    permute_backend: str
    activation_backend: str
    fc1: _Spec
    fc2: _Spec
    # Routed (MoELayer): tokens [T, H] in, combined [T, H] out. Else (GroupedMLP):
    # permuted rows in and out, and the fields below are unused.
    routed: bool
    top_k: int = 1
    num_rows: int = 0  # R, rows of the permuted buffer (static)
    zero_unmapped: bool = False  # rows no copy maps to exist (capacity): zero them

    @property
    def num_fc1_weights(self) -> int:
        """How many of the op's weight inputs are fc1's (the rest are fc2's)."""
        return self.fc1.num_weights


@dataclass(frozen=True)
class Sinks:
    """Where the fused op puts what an expert-parallel transport sends on (default: new tensors).

    ``out``: the forward's combined rows are written here (e.g. a transport's
    buffer, saving the copy into it) and returned. ``grad_tokens``: the
    backward's token gradient is written here. ``on_grad_tokens(grad_tokens,
    grad_probs)``: called as soon as both exist, before fc1's weight
    gradient, which then runs on at most ``gemm_sms`` SMs (0: all) so that
    what the callback started runs beside it.
    """

    out: Optional[torch.Tensor] = None
    grad_tokens: Optional[torch.Tensor] = None
    on_grad_tokens: Optional[Callable] = None
    gemm_sms: int = 0


def check_experts_path(experts_path) -> Optional[str]:
    if experts_path not in EXPERTS_PATHS:
        raise ValueError(f"experts_path must be one of {EXPERTS_PATHS}, got {experts_path!r}")
    return experts_path


def _gather(plan: Plan, tokens: torch.Tensor, row_id_map: Optional[torch.Tensor]) -> torch.Tensor:
    """Each copy's token row at its permuted row ([R, H]); the input itself when not routed."""
    if not plan.routed:
        return tokens
    return ops.permute_rows(
        tokens, row_id_map, plan.top_k, plan.num_rows, plan.zero_unmapped, plan.permute_backend
    )


def _fc1(plan: Plan, tokens: torch.Tensor, row_id_map: Optional[torch.Tensor], m_splits: torch.Tensor,
         w1: list) -> torch.Tensor:
    """fc1's output g [R, 2I] for each copy's token row.

    With the core's gathered kernel (bf16 on the ``cuda`` backend), the GEMM
    reads the token rows through the routing index, so no permuted [R, H]
    copy is written and read back; rows no copy maps to read zeros, as the
    copy would hold, so g is bitwise what the copy gives. Elsewhere: the
    permuted copy (``permute_rows``; the input itself when not routed), then
    the plain kernel. The choice does not depend on the layer's sizes
    (docs/experts-path.md#fc1-gathered).
    """
    dtype, gemm = tokens.dtype, plan.gemm_backend
    if plan.routed and gemm == "cuda" and cuda_backend.gathers(tokens, dtype):
        index = source_rows(row_id_map, plan.top_k, plan.num_rows)
        return ops.grouped_fprop_gathered(tokens, index, w1, m_splits, dtype, gemm)
    xp = _gather(plan, tokens, row_id_map)
    return ops.grouped_fprop(xp, w1, m_splits, None, dtype, gemm, False)


def fc1_swiglu_in_one_op(plan: Plan, tokens: torch.Tensor, w1: list) -> bool:
    """Whether :func:`_fc1_swiglu` runs fc1 and SwiGLU as one op (see there)."""
    return (plan.gemm_backend == "cuda" and plan.activation_backend == "cuda"
            and cuda_backend.fuses_fc1_swiglu(tokens, plan.routed, w1))


def _fc1_swiglu(plan: Plan, tokens: torch.Tensor, row_id_map: Optional[torch.Tensor], m_splits: torch.Tensor,
                w1: list) -> tuple[torch.Tensor, torch.Tensor]:
    """fc1's output g [R, 2I] and h = swiglu(g) [R, I].

    On the ``cuda`` backends (GEMM and activation) with bf16 operands, one op:
    the core computes h in fc1's epilogue where its ping-pong fprop takes the
    problem and is preferred (csrc/gemm/heuristic.cpp: K <= 2048), and runs
    the GEMM and the SwiGLU pass otherwise; either way g and h are bitwise
    the GEMM followed by the pass. The one kernel saves the pass's read of g
    and measures at parity with the two or a little faster
    (docs/experts-path.md#fc1-and-swiglu-in-one-kernel). Elsewhere
    :func:`_fc1`, then :func:`moe_grouped.activation.swiglu`.
    """
    if fc1_swiglu_in_one_op(plan, tokens, w1):
        index = source_rows(row_id_map, plan.top_k, plan.num_rows) if plan.routed else None
        return ops.grouped_fprop_swiglu(tokens, index, w1, m_splits)
    g = _fc1(plan, tokens, row_id_map, m_splits, w1)
    return g, swiglu(g, backend=plan.activation_backend)


def _permuted_weights(plan: Plan, probs: torch.Tensor, row_id_map: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[R] routing weight of each permuted row (0 for rows no copy maps to).

    The permute kernel moves each copy's weight as a one-column row (top_k 1:
    copy i is "token" i), so this is deterministic on every backend.
    """
    flat = probs.detach().reshape(-1, 1).to(dtype)
    return ops.permute_rows(flat, row_id_map, 1, plan.num_rows, True, plan.permute_backend).view(-1)


def _copy_values(plan: Plan, per_row: torch.Tensor, row_id_map: torch.Tensor) -> torch.Tensor:
    """[T * top_k]: the value of each copy's row, 0 for dropped copies (the inverse of _permuted_weights)."""
    return ops.unpermute_rows(
        per_row.view(-1, 1), row_id_map, None, 1, plan.permute_backend
    ).view(-1)


def _weight_grads(stages, spec: _Spec, delayed: collections.deque, needed: bool, dy, x_fn, m_splits, rows: int,
                  weights) -> list:
    """Weight gradients in parameter order (None where deferred or fused into main_grad).

    ``dy`` and ``x_fn()`` are the wgrad's operands as ``stages`` makes them;
    with ``delay_wgrad_compute`` ``x_fn`` runs at ``backward_dw()`` time, so
    a re-gathered operand is not held until then.
    """
    if not needed:
        return [None] * len(weights)
    # grad_added_to_main_grad was set in forward (GroupedMLP._fused): an attribute
    # written in backward is a side effect torch.compile cannot trace.
    main_grads = _main_grads(weights) if spec.fuse_wgrad_accumulation else []
    if spec.delay_wgrad_compute:
        delayed.append(
            (list(weights), lambda: stages.param_grads(spec, dy, x_fn(), m_splits, rows, weights, main_grads))
        )
        return [None] * len(weights)
    return stages.param_grads(spec, dy, x_fn(), m_splits, rows, weights, main_grads)


class Stages:
    """The fused op's GEMM stages in the layer's own dtype; FP8 has its own (see the module docstring).

    Each stage takes and returns the operands in the form its GEMMs read
    (here plain tensors), so :class:`FusedExpertsFunction` is written once.
    """

    def sequence_forward(self, plan: Plan, tokens, row_id_map, m_splits, w1, w2) -> Optional[tuple]:
        """(g, y) of :meth:`fc1_swiglu` and :meth:`fc2` from one core call where that applies
        (:mod:`moe_grouped.experts_sequence`), else None."""
        # The cheap conditions first: off the sequence, fc1_swiglu asks fc1_swiglu_in_one_op itself.
        if experts_sequence.forward_applies(plan, tokens) and fc1_swiglu_in_one_op(plan, tokens, w1):
            return experts_sequence.forward_fc(plan, tokens, row_id_map, m_splits, w1, w2)
        return None

    def sequence_backward(self, plan: Plan, sinks, needed, dout, tokens, probs, row_id_map, m_splits, g, w1,
                          w2) -> Optional[tuple]:
        """The op's backward (:func:`backward`) from two core calls where those apply, else None."""
        if experts_sequence.applies(plan, sinks, tokens, probs, g):
            return experts_sequence.backward(plan, sinks, needed, dout, tokens, probs, row_id_map, m_splits, g, w1,
                                             w2)
        return None

    def fc1_swiglu(self, plan: Plan, tokens, row_id_map, m_splits, w1):
        """(g, fc2's input h) for each copy's token row."""
        return _fc1_swiglu(plan, tokens, row_id_map, m_splits, w1)

    def fc2(self, plan: Plan, h, m_splits, w2) -> torch.Tensor:
        # Rows past the experts' (a capacity's tail) are read by nothing here: not zeroed.
        return ops.grouped_fprop(h, w2, m_splits, None, h.dtype, plan.gemm_backend, False)

    def dgrad_swiglu_(self, plan: Plan, dout, row_id_map, m_splits, g, w, w2):
        """fc2's dgrad and the weighted SwiGLU backward, g becoming dg in place: (dy_u for fc2's wgrad, wh, dprob)."""
        dy_u = _gather(plan, dout.to(g.dtype).contiguous(), row_id_map)
        wh, dprob = ops.grouped_dgrad_swiglu_(dy_u, w2, m_splits, g, w, plan.gemm_backend, plan.activation_backend)
        return dy_u, wh, dprob

    def wgrad_input(self, plan: Plan, rows, m_splits):
        """Rows of a layer's input (wh) as its wgrad reads them (delayed wgrad holds what this returns)."""
        return rows

    def wgrad_grad(self, plan: Plan, rows, m_splits):
        """Rows of a layer's output gradient (dg) as its wgrad reads them."""
        return rows

    def fc1_dgrad(self, plan: Plan, dg, m_splits, w1) -> torch.Tensor:
        return ops.grouped_dgrad(dg, w1, m_splits, dg.dtype, plan.gemm_backend, False)

    def gathered_tokens(self, plan: Plan, tokens, row_id_map, m_splits):
        """fc1's wgrad operand: each copy's token row."""
        return _gather(plan, tokens, row_id_map)

    def param_grads(self, spec: _Spec, dy, x, m_splits, rows: int, weights, main_grads) -> list:
        """Weight gradients from the operands this class makes, over ``rows`` permuted rows."""
        return _param_grads(spec, dy, x, m_splits, weights, [], main_grads)


STAGES = Stages()


def _unpermute(plan: Plan, y, row_id_map, probs, sink: Optional[torch.Tensor]) -> torch.Tensor:
    """The weighted (or plain) sum of each token's copies: a new tensor, or written into ``sink``."""
    if sink is None:
        return ops.unpermute_rows(y, row_id_map, probs, plan.top_k, plan.permute_backend)
    ops.unpermute_rows_into_(y, row_id_map, probs, plan.top_k, plan.permute_backend, sink)
    return sink.detach()  # a plain tensor to autograd, not a view of the sink's buffer


def _sink_tensors(sinks: Optional[Sinks]) -> tuple:
    return () if sinks is None else (sinks.out, sinks.grad_tokens)


def forward(plan: Plan, sinks: Optional[Sinks], stages, tokens, probs, row_id_map, m_splits, weights):
    """The fused op's forward on its inputs: ``(out, g)``, g being what backward keeps of fc1 (see the module
    docstring). ``weights``: fc1's then fc2's. Shared by :class:`FusedExpertsFunction` and the layer's op
    with the router (:mod:`moe_grouped.routed_experts`)."""
    w1, w2 = list(weights[: plan.num_fc1_weights]), list(weights[plan.num_fc1_weights :])
    # The same kernels as the two stages from a few core calls where those apply (bitwise the same g and y).
    sequenced = stages.sequence_forward(plan, tokens, row_id_map, m_splits, w1, w2)
    if sequenced is not None:
        g, y = sequenced
    else:
        g, h = stages.fc1_swiglu(plan, tokens, row_id_map, m_splits, w1)
        y = stages.fc2(plan, h, m_splits, w2)
        del h
    if plan.routed:
        y = _unpermute(plan, y, row_id_map, probs, sinks.out if sinks is not None else None)
    return y, g


def weight_grads_needed(plan: Plan, needs: tuple, first_weight: int) -> tuple[bool, bool]:
    """Whether fc1's and fc2's weight gradients are wanted, from an op's ``needs_input_grad`` whose weight
    inputs (fc1's, then fc2's) start at ``first_weight``."""
    fc2_first = first_weight + plan.num_fc1_weights
    return any(needs[first_weight:fc2_first]), any(needs[fc2_first:])


def backward(plan: Plan, sinks: Optional[Sinks], stages, delayed: tuple, needed: tuple, dout, tokens, probs,
             row_id_map, m_splits, g, weights) -> tuple:
    """The fused op's backward: ``(dx, dprobs, fc1's weight gradients, fc2's)``, None where not needed.

    ``delayed``: fc1's and fc2's deferred-wgrad queues; ``needed``: whether
    the tokens', the routing weights', fc1's and fc2's gradients are wanted;
    ``g``: what :func:`forward` returned, which becomes dg in place.
    """
    need_x, need_probs, fc1_needed, fc2_needed = needed
    w1, w2 = weights[: plan.num_fc1_weights], weights[plan.num_fc1_weights :]
    # The same kernels as the stages below from a few core calls where those apply (bitwise the same gradients).
    sequenced = stages.sequence_backward(plan, sinks, needed, dout, tokens, probs, row_id_map, m_splits, g, w1, w2)
    if sequenced is not None:
        return sequenced
    fc1_delayed, fc2_delayed = delayed
    acc = torch.float64 if tokens.dtype == torch.float64 else torch.float32
    w = _permuted_weights(plan, probs, row_id_map, acc) if plan.routed else None
    # fc2's dgrad and the weighted SwiGLU backward: g becomes dg in place;
    # wh = w * h is fc2's wgrad operand.
    rows = g.shape[0]  # R, the permuted rows every GEMM here runs over
    dy_u, wh, dprob = stages.dgrad_swiglu_(plan, dout, row_id_map, m_splits, g, w, w2)
    dg = g
    del g
    wh = stages.wgrad_input(plan, wh, m_splits) if fc2_needed else None
    w2_grads = _weight_grads(stages, plan.fc2, fc2_delayed, fc2_needed, dy_u, lambda wh=wh: wh, m_splits, rows, w2)
    del dy_u, wh
    dprobs = None
    if plan.routed and need_probs:
        dprobs = _copy_values(plan, dprob, row_id_map).view(probs.shape).to(probs.dtype)
    dx = None
    if need_x:
        dxp = stages.fc1_dgrad(plan, dg, m_splits, w1)
        if plan.routed:
            dx = _unpermute(plan, dxp, row_id_map, None, sinks.grad_tokens if sinks is not None else None)
        else:
            dx = dxp
        del dxp
        experts_sequence.grad_tokens_ready(sinks, dx, dprobs)
    dg = stages.wgrad_grad(plan, dg, m_splits) if fc1_needed else None
    with experts_sequence.gemm_sm_limit(plan, sinks, tokens.device):
        w1_grads = _weight_grads(
            stages, plan.fc1, fc1_delayed, fc1_needed, dg,
            lambda: stages.gathered_tokens(plan, tokens, row_id_map, m_splits), m_splits, rows, w1,
        )
    return dx, dprobs, w1_grads, w2_grads


class FusedExpertsFunction(torch.autograd.Function):
    """``apply(tokens, probs, row_id_map, m_splits, plan, sinks, stages, fc1_delayed, fc2_delayed, *fc1_weights,
    *fc2_weights)``.

    Routed: tokens [T, H], probs [T, top_k] (differentiable), row_id_map
    [T * top_k] from the permute index; returns the combined [T, H]. Not
    routed: tokens are the permuted rows, probs and row_id_map None; returns
    the experts' outputs [R, H]. ``sinks``: a :class:`Sinks` (routed only) or
    None. ``stages``: :data:`STAGES` or an FP8 :class:`~moe_grouped.fp8.experts.Fp8Stages`.
    """

    @staticmethod
    def forward(ctx, tokens, probs, row_id_map, m_splits, plan: Plan, sinks, stages, fc1_delayed, fc2_delayed,
                *weights):
        with direct_calls((tokens, probs, row_id_map, m_splits, *_sink_tensors(sinks), *weights)):
            y, g = forward(plan, sinks, stages, tokens, probs, row_id_map, m_splits, weights)
        ctx.save_for_backward(tokens, probs, row_id_map, m_splits, g, *weights)
        ctx.plan, ctx.sinks, ctx.stages = plan, sinks, stages
        ctx.delayed = (fc1_delayed, fc2_delayed)
        return y

    @staticmethod
    def backward(ctx, dout):
        tokens, probs, row_id_map, m_splits, g, *weights = saved = ctx.saved_tensors
        plan: Plan = ctx.plan
        needs = ctx.needs_input_grad
        # The weights follow tokens, probs, row_id_map, m_splits, plan, sinks, stages, fc1_delayed, fc2_delayed.
        needed = (needs[0], needs[1], *weight_grads_needed(plan, needs, 9))
        with direct_calls((dout, *saved, *_sink_tensors(ctx.sinks))):
            dx, dprobs, w1_grads, w2_grads = backward(
                plan, ctx.sinks, ctx.stages, ctx.delayed, needed, dout, tokens, probs, row_id_map, m_splits, g,
                weights,
            )
        return (dx, dprobs, None, None, None, None, None, None, None, *w1_grads, *w2_grads)
