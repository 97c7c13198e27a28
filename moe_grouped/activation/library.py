"""``torch.library`` registration of the SwiGLU ops and backend dispatch.

The checks live in :mod:`moe_grouped.activation`; these bodies only dispatch.
``swiglu`` and ``swiglu_backward`` are the ``cuda`` kernels (the other
backends compose torch ops, which autograd differentiates); the weighted
backward takes the backend's name as its last argument. Fake implementations
give the shapes to meta tensors, FakeTensor and torch.compile.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from .._ops import custom_op, ops
from .._tensors import compute_dtype
from . import cuda_backend, reference, torch_backend

# All imported up front (cuda_backend imports without the core and calls it
# only when an op runs): an import inside a compiled region breaks the graph.
_MODULES: dict[str, ModuleType] = {"reference": reference, "torch": torch_backend, "cuda": cuda_backend}


def backend_module(name: str) -> ModuleType:
    """The module implementing ``swiglu`` and ``weighted_backward_into`` for backend ``name``."""
    if name not in _MODULES:
        raise ValueError(f"unknown backend {name!r}")
    return _MODULES[name]


@custom_op("swiglu", mutates_args=())
def swiglu(h: torch.Tensor) -> torch.Tensor:
    """[rows, 2 * ffn] -> [rows, ffn] with the core's forward kernel."""
    return cuda_backend.forward(h)


@swiglu.register_fake
def _(h):
    return h.new_empty(h.shape[0], h.shape[1] // 2)


@custom_op("swiglu_backward", mutates_args=())
def swiglu_backward(dy: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """[d_gate, d_up] [rows, 2 * ffn] from dy [rows, ffn] with the core's backward kernel."""
    return cuda_backend.backward(dy, h)


@swiglu_backward.register_fake
def _(dy, h):
    return torch.empty_like(h)


def _setup_context(ctx, inputs, output):
    (h,) = inputs
    ctx.save_for_backward(h)


def _backward(ctx, grad):
    (h,) = ctx.saved_tensors
    return ops.swiglu_backward(grad, h)


swiglu.register_autograd(_backward, setup_context=_setup_context)


@custom_op("swiglu_weighted_backward", mutates_args=())
def swiglu_weighted_backward(
    dh_u: torch.Tensor, g: torch.Tensor, weights: Optional[torch.Tensor], m_splits: Optional[torch.Tensor], backend: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dg, wh, dprob) in new tensors."""
    dh_u, g = dh_u.contiguous(), g.contiguous()
    weights = None if weights is None else weights.contiguous()
    dg, wh = torch.empty_like(g), torch.empty_like(dh_u)
    dprob = g.new_empty(g.shape[0], dtype=compute_dtype(g.dtype))
    backend_module(backend).weighted_backward_into(dh_u, g, weights, m_splits, dg, wh, dprob)
    return dg, wh, dprob


@swiglu_weighted_backward.register_fake
def _(dh_u, g, weights, m_splits, backend):
    return torch.empty_like(g), torch.empty_like(dh_u), g.new_empty(g.shape[0], dtype=compute_dtype(g.dtype))


@custom_op("swiglu_weighted_backward_", mutates_args=("dh_u", "g", "dprob"))
def swiglu_weighted_backward_(
    dh_u: torch.Tensor,
    g: torch.Tensor,
    weights: Optional[torch.Tensor],
    m_splits: Optional[torch.Tensor],
    dprob: torch.Tensor,
    backend: str,
) -> None:
    """In place: ``g`` becomes dg and ``dh_u`` becomes wh (both contiguous); dprob is written.

    The fused experts path uses this so that its backward holds no
    [rows, 2 * ffn] or [rows, ffn] buffer beyond the two it already has.
    Rows past the sum of ``m_splits`` get dprob 0; their g and dh_u may be
    left as they are (nothing reads past the sum; a capacity's tail can be
    most of the buffer).
    Bumps the version of ``g``, so a second backward through a graph that
    saved ``g`` fails loudly instead of reading dg.
    """
    if not (dh_u.is_contiguous() and g.is_contiguous()):
        raise ValueError("swiglu_weighted_backward_ works in place and needs contiguous dh_u and g")
    weights = None if weights is None else weights.contiguous()
    backend_module(backend).weighted_backward_into(dh_u, g, weights, m_splits, g, dh_u, dprob, zero_tail=False)


@swiglu_weighted_backward_.register_fake
def _(dh_u, g, weights, m_splits, dprob, backend):
    return None
