"""The FP8 fused experts op's stages as a few core calls.

:class:`moe_grouped.fp8.experts.Fp8Stages` runs some two dozen ops a step
(quantizations, FP8 GEMMs, permutes), each a call through an op, a library
body and ctypes, with its own allocations: eager, with the GPU faster than
the host, those calls are the step's cost. Where the stages are the plain
ones (:func:`applies`), ``mg_experts_fp8_stage`` (csrc/experts) runs the
same kernels in the same order with the same arguments, ten calls a step,
so outputs and gradients are the Python stages' bit for bit. The calls are
cut where the stages allocate, and the buffers are taken here in the
stages' order, so every buffer lives as long as it does there (the same
peak memory). docs/host-overhead.md has the measurements.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Optional

import torch

from .. import _core, _ops, experts_sequence
from ..gemm import cuda_backend
from .gemm import _core_operand
from .quantize import _config, new_block
from .quantize_reference import columnwise_padded_rows, columnwise_scale_rows

ENV = "MOE_GROUPED_EXPERTS_SEQUENCE_FP8"
# "0": the Python stages run every step (A/B measurements, tests). Read at import; set ``enabled`` later.
enabled = os.environ.get(ENV, "1") != "0"


def applies(plan, stages, tokens: torch.Tensor) -> bool:
    """Whether the forward's stages can run as core calls: plain eager tensors (the op's
    :class:`~moe_grouped._ops.DirectCalls` region), routed onto rows, bf16 tokens, every backend cuda, and a
    core with the FP8 stages."""
    return (
        enabled
        and _ops.direct_region()
        and plan.routed
        and stages.backend == "cuda" and plan.activation_backend == "cuda" and plan.permute_backend == "cuda"
        and plan.num_rows > 0 and tokens.shape[0] > 0
        and tokens.dtype == torch.bfloat16
        and _core.has(_core.CAP_EXPERTS_SEQUENCE_FP8)
    )


def backward_applies(plan, sinks, stages, tokens: torch.Tensor, probs: torch.Tensor, weights) -> bool:
    """:func:`applies`, and the backward's conditions: sinks it can write to, no deferred or
    fused-accumulation weight gradients, no bias, bf16 weights (their gradients' dtype)."""
    fc1, fc2 = plan.fc1, plan.fc2
    return (
        applies(plan, stages, tokens)  # routed: probs are a tensor
        and experts_sequence.sinks_apply(sinks, tokens, torch.bfloat16)
        and not (fc1.fuse_wgrad_accumulation or fc1.delay_wgrad_compute or fc1.has_bias)
        and not (fc2.fuse_wgrad_accumulation or fc2.delay_wgrad_compute or fc2.has_bias)
        and probs.is_floating_point()
        and all(w.dtype == torch.bfloat16 for w in weights)
    )


def _args(plan, stages, tokens, row_id_map, m_splits, g, index) -> _core.ExpertsFp8Args:
    recipe = stages.recipe
    pow2, eps = recipe.pow2_scales, float(recipe.amax_epsilon)
    return _core.ExpertsFp8Args(
        problem=cuda_backend.grouped_problem(tokens, m_splits, m_splits.shape[0], 0, 0, 0, total_rows=plan.num_rows),
        num_tokens=tokens.shape[0], top_k=plan.top_k, hidden=tokens.shape[1], ffn=g.shape[1] // 2,
        row_id_map=row_id_map.data_ptr(),
        forward=_config(recipe.forward_dtype, pow2, eps), backward=_config(recipe.backward_dtype, pow2, eps),
        w1=_core_operand(stages.w1.w), w1_t=_core_operand(stages.w1.wt),
        w2=_core_operand(stages.w2.w), w2_t=_core_operand(stages.w2.wt),
        tokens=tokens.data_ptr(), index=index.data_ptr(), g=g.data_ptr(),
    )


@functools.lru_cache(maxsize=256)
def _scratch_bytes(stage: int, rows: int, hidden: int, ffn: int, num_groups: int) -> int:
    size = ctypes.c_size_t()
    _core.check(_core.require().mg_experts_fp8_scratch_bytes(stage, rows, hidden, ffn, num_groups,
                                                             ctypes.byref(size)))
    return size.value


def _run(args: _core.ExpertsFp8Args, stage: int, scratch: Optional[torch.Tensor], stream) -> None:
    args.scratch = None if scratch is None else scratch.data_ptr()
    _core.check(_core.require().mg_experts_fp8_stage(ctypes.byref(args), stage, stream))


def _scratch(stage: int, args: _core.ExpertsFp8Args, device) -> torch.Tensor:
    size = _scratch_bytes(stage, args.problem.total_rows, args.hidden, args.ffn, args.problem.num_groups)
    return torch.empty(size, dtype=torch.uint8, device=device)


def forward_fc(plan, stages, tokens, row_id_map, m_splits) -> tuple[torch.Tensor, torch.Tensor]:
    """(g [R, 2I], y [R, H]) as :meth:`Fp8Stages.fc1_swiglu` and :meth:`Fp8Stages.fc2` give them; the routing
    index is kept on ``stages`` for the backward, as theirs is."""
    rows, hidden = plan.num_rows, tokens.shape[1]
    ffn = stages.w1.w.data.shape[1] // 2
    device = tokens.device
    tokens = tokens.contiguous()
    stream = _core.stream_handle(device)
    index = torch.empty(rows, dtype=torch.int32, device=device)
    scratch = torch.empty(_scratch_bytes(_core.FP8_FORWARD_FC1, rows, hidden, ffn, m_splits.shape[0]),
                          dtype=torch.uint8, device=device)
    g = torch.empty(rows, 2 * ffn, dtype=torch.bfloat16, device=device)
    args = _args(plan, stages, tokens, row_id_map, m_splits, g, index)
    _run(args, _core.FP8_FORWARD_FC1, scratch, stream)
    stages.keep_index(row_id_map, index)
    del scratch  # x's FP8 rows, before h's are taken
    scratch = _scratch(_core.FP8_FORWARD_FC2, args, device)
    y = torch.empty(rows, hidden, dtype=torch.bfloat16, device=device)
    args.y = y.data_ptr()
    _run(args, _core.FP8_FORWARD_FC2, scratch, stream)
    return g, y


def backward(plan, stages, sinks, needed: tuple, dout, tokens, probs, row_id_map, m_splits, g, w1: list,
             w2: list) -> tuple:
    """(dx, dprobs, w1 grads, w2 grads) as the Python stages give them, each only where ``needed`` (four
    bools, in that order) says; g becomes dg, and its memory is released after its column-wise copy (as
    :meth:`Fp8Stages.wgrad_grad` does). With ``sinks``: dx into its buffer, its callback once dx and dprobs
    exist, fc1's weight gradient after it on the SMs it leaves."""
    dx_needed, dprobs_needed, fc1_needed, fc2_needed = needed
    device = g.device
    rows, (num_tokens, hidden), top_k = g.shape[0], tokens.shape, probs.shape[1]
    ffn, num_groups = g.shape[1] // 2, m_splits.shape[0]
    recipe = stages.recipe
    tokens = tokens.contiguous()
    dout = dout.to(torch.bfloat16).contiguous()
    flat_probs = probs.detach().reshape(-1).to(torch.float32).contiguous()  # the stages' row weights: float32
    stream = _core.stream_handle(device)
    args = _args(plan, stages, tokens, row_id_map, m_splits, g, stages.index(plan, row_id_map))
    args.dout, args.probs = dout.data_ptr(), flat_probs.data_ptr()
    f32 = dict(dtype=torch.float32, device=device)

    padded, scale_rows = columnwise_padded_rows(rows, num_groups), columnwise_scale_rows(rows, num_groups)

    # fc2's dgrad: the row weights, dout's two copies, dh.
    row_weights = torch.empty(rows, **f32)
    scratch = _scratch(_core.FP8_BACKWARD_FC2_DGRAD, args, device)  # dout's row-wise copy
    dout_t = new_block((hidden, padded), (scale_rows, hidden), recipe.backward_dtype, device)
    dh = torch.empty(rows, ffn, dtype=torch.bfloat16, device=device)
    args.row_weights, args.dh = row_weights.data_ptr(), dh.data_ptr()
    args.dout_t, args.dout_t_scale_inv = dout_t.data.data_ptr(), dout_t.scale_inv.data_ptr()
    _run(args, _core.FP8_BACKWARD_FC2_DGRAD, scratch, stream)
    del scratch  # dout's row-wise copy

    # The weighted SwiGLU backward (g becomes dg, dh wh), wh's column-wise copy, fc2's wgrad, dprobs.
    dprob = torch.empty(rows, **f32)
    wh_t = new_block((ffn, padded), (scale_rows, ffn), recipe.forward_dtype, device) if fc2_needed else None
    args.dprob = dprob.data_ptr()
    args.wh_t, args.wh_t_scale_inv = (None, None) if wh_t is None else (wh_t.data.data_ptr(),
                                                                         wh_t.scale_inv.data_ptr())
    _run(args, _core.FP8_BACKWARD_SWIGLU, None, stream)
    # g is dg now: a second backward through the graph that saved it must fail (as the stages' op does).
    torch.autograd.graph.increment_version([g])
    del dh  # wh: its column-wise copy is what fc2's wgrad reads
    dw2 = None
    if fc2_needed:
        dw2 = torch.empty(num_groups, hidden, ffn, dtype=torch.bfloat16, device=device)
        args.dw2 = dw2.data_ptr()
        _run(args, _core.FP8_BACKWARD_FC2_WGRAD, None, stream)
    del dout_t, wh_t
    dprobs = None
    if dprobs_needed:
        dprobs = torch.empty(num_tokens * top_k, **f32)
        args.dprobs = dprobs.data_ptr()
        _run(args, _core.FP8_BACKWARD_DPROBS, None, stream)
        dprobs = dprobs.view(probs.shape).to(probs.dtype)

    dx = dw1 = None
    if dx_needed:
        scratch = _scratch(_core.FP8_BACKWARD_FC1_DGRAD, args, device)  # dg's row-wise copy
        dxp = torch.empty(rows, hidden, dtype=torch.bfloat16, device=device)
        args.dxp = dxp.data_ptr()
        _run(args, _core.FP8_BACKWARD_FC1_DGRAD, scratch, stream)
        del scratch
        dx = experts_sequence.token_grads(sinks, tokens, torch.bfloat16)
        args.dx = dx.data_ptr()
        _run(args, _core.FP8_BACKWARD_DX, None, stream)
        del dxp
        experts_sequence.grad_tokens_ready(sinks, dx, dprobs)
    if fc1_needed:
        dg_t = new_block((2 * ffn, padded), (scale_rows, 2 * ffn), recipe.backward_dtype, device)
        args.dg_t, args.dg_t_scale_inv = dg_t.data.data_ptr(), dg_t.scale_inv.data_ptr()
        _run(args, _core.FP8_BACKWARD_DG_COLUMNWISE, None, stream)
        g.untyped_storage().resize_(0)  # dg: nothing reads it after its copy (see Fp8Stages.wgrad_grad)
        with experts_sequence.gemm_sm_limit(plan, sinks, device):
            scratch = _scratch(_core.FP8_BACKWARD_FC1_WGRAD, args, device)
            dw1 = torch.empty(num_groups, 2 * ffn, hidden, dtype=torch.bfloat16, device=device)
            args.dw1 = dw1.data_ptr()
            _run(args, _core.FP8_BACKWARD_FC1_WGRAD, scratch, stream)
        del scratch, dg_t
    return (
        None if dx is None else dx.detach(),
        dprobs,
        experts_sequence.as_params(dw1, w1),
        experts_sequence.as_params(dw2, w2),
    )
