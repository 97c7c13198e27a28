"""The fused experts op on the ``cuda`` backends as a few core calls.

:class:`moe_grouped.experts.FusedExpertsFunction` runs about four kernels
forward and a dozen backward; from Python each is a call through an op, a
backend function and ctypes, and eager (the GPU faster than the host) those
calls are the step's cost. Where the op's stages are the plain ones of this
module's conditions, the core runs the same kernels in the same order with
the same arguments from one call forward up to fc2 (``mg_experts_forward_fc``;
the combine stays the op's) and two backward (``mg_experts_backward_fc2`` and
``_fc1``, csrc/experts), so outputs and gradients are the Python stages' bit
for bit. Buffers are taken call by call, so they live as long as the separate
calls' would. With an expert-parallel transport's sinks the fc1 phase runs as
two calls around their callback, as the stages do. docs/host-overhead.md has the measurements.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from typing import Optional

import torch

from . import _core, _ops
from .gemm import cuda_backend
from .grouped_linear import grads_as_params

SEQUENCE_DTYPES = (torch.bfloat16, torch.float16)
ENV = "MOE_GROUPED_EXPERTS_SEQUENCE"
# "0": the Python stages run every forward and backward (A/B measurements, tests). Read at import; set
# ``enabled`` to change it later.
enabled = os.environ.get(ENV, "1") != "0"


def gemm_sm_limit(plan, sinks, device: torch.device):
    """Where the fused op runs fc1's weight gradient: on at most ``sinks.gemm_sms`` SMs, so that what
    ``sinks.on_grad_tokens`` started runs beside it (see :class:`moe_grouped.experts.Sinks`)."""
    if sinks is None or not sinks.gemm_sms or plan.gemm_backend != "cuda":
        return contextlib.nullcontext()
    return _core.gemm_sm_limit(device, sinks.gemm_sms)


def sinks_apply(sinks, tokens: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the sequences can write the token gradient where ``sinks`` asks: no sink, or a contiguous
    [T, H] one of the gradient's dtype (else the stages run and refuse it)."""
    sink = None if sinks is None else sinks.grad_tokens
    return sink is None or (sink.shape == tokens.shape and sink.dtype == dtype and sink.is_contiguous()
                            and sink.device == tokens.device)


def token_grads(sinks, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The buffer the token gradient goes to: the sink's, or a new one."""
    if sinks is not None and sinks.grad_tokens is not None:
        return sinks.grad_tokens
    return torch.empty(tokens.shape, dtype=dtype, device=tokens.device)


def grad_tokens_ready(sinks, dx: Optional[torch.Tensor], dprobs: Optional[torch.Tensor]) -> None:
    """Hand dx and dprobs to the sinks' callback, as the stages do once both exist."""
    if sinks is not None and sinks.on_grad_tokens is not None:
        sinks.on_grad_tokens(dx, dprobs)


def applies(plan, sinks, tokens: torch.Tensor, probs: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether :func:`backward` computes the backward of the layer-dtype stages (the caller checks that
    those are the op's): plain eager tensors (the op's :class:`~moe_grouped._ops.DirectCalls` region is
    on), routed, sinks the sequence can write to, no deferred or fused-accumulation weight gradients, all
    on the ``cuda`` backends, 16-bit operands, rows and tokens, and a core with the sequences."""
    fc1, fc2 = plan.fc1, plan.fc2
    return (
        enabled
        and _ops.direct_region()
        and plan.routed
        and sinks_apply(sinks, tokens, g.dtype)
        and plan.gemm_backend == "cuda" and plan.permute_backend == "cuda" and plan.activation_backend == "cuda"
        and not (fc1.fuse_wgrad_accumulation or fc1.delay_wgrad_compute or fc1.has_bias)
        and not (fc2.fuse_wgrad_accumulation or fc2.delay_wgrad_compute or fc2.has_bias)
        and g.dtype in SEQUENCE_DTYPES and tokens.dtype == g.dtype
        and probs.is_floating_point()
        and g.shape[0] > 0 and tokens.shape[0] > 0
        and _core.has(_core.CAP_EXPERTS_SEQUENCE)
        and not cuda_backend.dgrad_swiglu_fuses(g, g)
    )


def forward_applies(plan, tokens: torch.Tensor) -> bool:
    """Whether :func:`forward_fc` computes fc1 and fc2 of the layer-dtype stages where those run fc1 and
    SwiGLU as one op (the caller checks both): plain eager tensors, routed onto rows."""
    return (
        enabled
        and _ops.direct_region()
        and plan.routed
        and plan.num_rows > 0 and tokens.shape[0] > 0
        and _core.has(_core.CAP_EXPERTS_SEQUENCE)
    )


def forward_fc(plan, tokens, row_id_map, m_splits, w1: list, w2: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(g [R, 2I], y [R, H]): fc1 with SwiGLU on the tokens read through the routing index, then fc2."""
    rows, (num_tokens, hidden) = plan.num_rows, tokens.shape
    ffn = w1[0].shape[-2] // 2
    dtype, device = tokens.dtype, tokens.device
    tokens = tokens.contiguous()
    g = torch.empty(rows, 2 * ffn, dtype=dtype, device=device)
    y = torch.empty(rows, hidden, dtype=dtype, device=device)
    scratch = torch.empty(_forward_scratch_bytes(rows, ffn, _core.dtype_code(dtype)), dtype=torch.uint8,
                          device=device)
    args = _core.ExpertsForwardArgs(
        problem=_problem(tokens, m_splits, rows), num_tokens=num_tokens, top_k=plan.top_k, hidden=hidden,
        ffn=ffn, row_id_map=row_id_map.data_ptr(), tokens=tokens.data_ptr(), w1=cuda_backend.group_operand(w1),
        w2=cuda_backend.group_operand(w2), scratch=scratch.data_ptr(), g=g.data_ptr(), y=y.data_ptr(),
    )
    _core.check(_core.require().mg_experts_forward_fc(ctypes.byref(args), _core.stream_handle(device)))
    return g, y


def _problem(tokens: torch.Tensor, m_splits: torch.Tensor, rows: int) -> _core.GroupedProblem:
    """The sequences' problem: E groups over ``rows`` rows in the tokens' dtype (each GEMM sets its n, k and
    slot)."""
    return cuda_backend.grouped_problem(tokens, m_splits, m_splits.shape[0], 0, 0, 0, total_rows=rows)


@functools.lru_cache(maxsize=64)
def _forward_scratch_bytes(rows: int, ffn: int, dtype_code: int) -> int:
    size = ctypes.c_size_t()
    _core.check(_core.require().mg_experts_forward_scratch_bytes(rows, ffn, dtype_code, ctypes.byref(size)))
    return size.value


@functools.lru_cache(maxsize=64)
def _scratch_bytes(phase: int, rows: int, hidden: int, ffn: int, dtype_code: int) -> int:
    size = ctypes.c_size_t()
    _core.check(_core.require().mg_experts_backward_scratch_bytes(phase, rows, hidden, ffn, dtype_code,
                                                                 ctypes.byref(size)))
    return size.value


def _ptr(tensor: Optional[torch.Tensor]) -> Optional[int]:
    return None if tensor is None else tensor.data_ptr()


def backward(plan, sinks, needed: tuple, dout, tokens, probs, row_id_map, m_splits, g, w1: list,
             w2: list) -> tuple:
    """(dx, dprobs, w1 grads, w2 grads) as the Python stages give them, each only where ``needed`` (four
    bools, in that order) says; g becomes dg. With ``sinks``: dx into its buffer, its callback once dx and
    dprobs exist, fc1's weight gradient after it on the SMs it leaves."""
    dx_needed, dprobs_needed, fc1_needed, fc2_needed = needed
    dtype, device = g.dtype, g.device
    rows, num_tokens, top_k = g.shape[0], tokens.shape[0], probs.shape[1]
    hidden, ffn = tokens.shape[1], g.shape[1] // 2
    num_experts = m_splits.shape[0]
    dtype_code = _core.dtype_code(dtype)
    dout = dout.to(dtype).contiguous()
    tokens = tokens.contiguous()
    flat_probs = probs.detach().reshape(-1).to(torch.float32).contiguous()  # the stages' row weights: float32
    stream = _core.stream_handle(device)
    lib = _core.require()
    args = _core.ExpertsBackwardArgs(
        problem=_problem(tokens, m_splits, rows),
        num_tokens=num_tokens, top_k=top_k, hidden=hidden, ffn=ffn, row_id_map=row_id_map.data_ptr(),
        zero_unmapped=int(plan.zero_unmapped), dout=dout.data_ptr(), tokens=tokens.data_ptr(),
        probs=flat_probs.data_ptr(), g=g.data_ptr(), w1=cuda_backend.group_operand(w1),
        w2=cuda_backend.group_operand(w2),
    )
    scratch = torch.empty(_scratch_bytes(2, rows, hidden, ffn, dtype_code), dtype=torch.uint8, device=device)
    dw2 = torch.empty(num_experts, hidden, ffn, dtype=dtype, device=device) if fc2_needed else None
    dprobs = torch.empty(num_tokens * top_k, dtype=torch.float32, device=device) if dprobs_needed else None
    args.scratch, args.dw2, args.dprobs = scratch.data_ptr(), _ptr(dw2), _ptr(dprobs)
    _core.check(lib.mg_experts_backward_fc2(ctypes.byref(args), stream))
    # g is dg now: a second backward through the graph that saved it must fail (as the Python stages' op does).
    torch.autograd.graph.increment_version([g])
    del scratch
    scratch = torch.empty(_scratch_bytes(1, rows, hidden, ffn, dtype_code), dtype=torch.uint8, device=device)
    dx = token_grads(sinks, tokens, dtype) if dx_needed else None
    dprobs = None if dprobs is None else dprobs.view(probs.shape).to(probs.dtype)
    args.scratch, args.dx = scratch.data_ptr(), _ptr(dx)
    if sinks is not None and dx is not None:  # as the stages: dx, the callback, then dw1 on the SMs left
        _core.check(lib.mg_experts_backward_fc1(ctypes.byref(args), stream))
        grad_tokens_ready(sinks, dx, dprobs)
        args.dx = None
    dw1 = torch.empty(num_experts, 2 * ffn, hidden, dtype=dtype, device=device) if fc1_needed else None
    args.dw1 = _ptr(dw1)
    if args.dx is not None or dw1 is not None:
        with gemm_sm_limit(plan, sinks, device):
            _core.check(lib.mg_experts_backward_fc1(ctypes.byref(args), stream))
    return (
        None if dx is None else dx.detach(),
        dprobs,
        as_params(dw1, w1),
        as_params(dw2, w2),
    )


def as_params(grads: Optional[torch.Tensor], weights: list) -> list:
    """One layer's [E, N, K] weight gradient as its parameters hold it (None for each where not computed)."""
    return [None] * len(weights) if grads is None else grads_as_params(grads, weights)
