"""``torch.library`` registration of the permutation ops and backend dispatch.

The checks live in :mod:`moe_grouped.permute`; these bodies only dispatch.
Fake implementations give the (static) shapes to meta tensors, FakeTensor
and torch.compile.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from .._ops import custom_op, ops
from ..graphs import nvtx
from . import cuda_backend, reference, torch_backend

# All imported up front (cuda_backend imports without the core and calls it
# only when an op runs): an import inside a compiled region breaks the graph.
_MODULES: dict[str, ModuleType] = {"reference": reference, "torch": torch_backend, "cuda": cuda_backend}


def backend_module(name: str) -> ModuleType:
    """The module implementing the permutation ops for backend ``name``."""
    if name not in _MODULES:
        raise ValueError(f"unknown backend {name!r}")
    return _MODULES[name]


@custom_op("permute_index", mutates_args=())
def permute_index(
    experts: torch.Tensor,
    probs: Optional[torch.Tensor],
    num_experts: int,
    capacity: int,
    pad_to_capacity: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_id_map [T * top_k], m_splits [E]). ``capacity`` -1: no dropping;
    ``probs`` None: drop by position, else by these float32 probabilities."""
    with nvtx.range(f"moe_grouped.permute_index[{backend}]"):
        return backend_module(backend).index(experts, probs, num_experts, capacity, pad_to_capacity)


@permute_index.register_fake
def _(experts, probs, num_experts, capacity, pad_to_capacity, backend):
    return (
        experts.new_empty(experts.numel(), dtype=torch.int64),
        experts.new_empty(num_experts, dtype=torch.int64),
    )


@custom_op("source_rows", mutates_args=())
def source_rows(row_id_map: torch.Tensor, top_k: int, num_rows: int) -> torch.Tensor:
    """[num_rows] int32: the token of the copy at each row, -1 where none is; the core's kernel where it has one."""
    if row_id_map.is_cuda and cuda_backend.has_source_rows():
        return cuda_backend.source_rows(row_id_map.to(torch.int64).contiguous(), top_k, num_rows)
    return torch_backend.source_rows(row_id_map, top_k, num_rows)


@source_rows.register_fake
def _(row_id_map, top_k, num_rows):
    return row_id_map.new_empty(num_rows, dtype=torch.int32)


@custom_op("permute_rows", mutates_args=())
def permute_rows(
    x: torch.Tensor, row_id_map: torch.Tensor, top_k: int, num_rows: int, zero_unmapped: bool, backend: str
) -> torch.Tensor:
    """[num_rows, H]: x's token t at the row of each of its copies.

    ``zero_unmapped``: zero the rows no copy maps to. False only when every
    row has a copy (dropless permute), which saves a pass over the buffer.
    """
    with nvtx.range(f"moe_grouped.permute_rows[{backend}]"):
        return backend_module(backend).permute_rows(x, row_id_map, top_k, num_rows, zero_unmapped)


@permute_rows.register_fake
def _(x, row_id_map, top_k, num_rows, zero_unmapped, backend):
    return x.new_empty(num_rows, x.shape[1])


def _permute_rows_setup_context(ctx, inputs, output):
    _, row_id_map, top_k, _, _, backend = inputs
    ctx.save_for_backward(row_id_map)
    ctx.top_k, ctx.backend = top_k, backend


def _permute_rows_backward(ctx, grad):
    (row_id_map,) = ctx.saved_tensors
    # Each token's gradient is the sum over its top_k copies: an unweighted unpermute.
    dx = ops.unpermute_rows(grad.contiguous(), row_id_map, None, ctx.top_k, ctx.backend)
    return dx, None, None, None, None, None


permute_rows.register_autograd(_permute_rows_backward, setup_context=_permute_rows_setup_context)


@custom_op("unpermute_rows", mutates_args=())
def unpermute_rows(
    y: torch.Tensor, row_id_map: torch.Tensor, weights: Optional[torch.Tensor], top_k: int, backend: str
) -> torch.Tensor:
    with nvtx.range(f"moe_grouped.unpermute_rows[{backend}]"):
        return backend_module(backend).unpermute_rows(y, row_id_map, weights, top_k)


@unpermute_rows.register_fake
def _(y, row_id_map, weights, top_k, backend):
    return y.new_empty(row_id_map.shape[0] // top_k, y.shape[1])


def _unpermute_rows_setup_context(ctx, inputs, output):
    y, row_id_map, weights, top_k, backend = inputs
    ctx.has_weights = weights is not None
    ctx.save_for_backward(y if ctx.has_weights else None, row_id_map, weights)
    ctx.top_k, ctx.num_rows, ctx.backend = top_k, y.shape[0], backend


def _unpermute_rows_backward(ctx, grad):
    y, row_id_map, weights = ctx.saved_tensors
    grad = grad.contiguous()
    if not ctx.has_weights:
        dy = ops.permute_rows(grad, row_id_map, ctx.top_k, ctx.num_rows, True, ctx.backend)
        return dy, None, None, None, None
    dy, dweights = ops.unpermute_rows_backward(grad, y, row_id_map, weights, ctx.backend)
    return dy, None, dweights if ctx.needs_input_grad[2] else None, None, None


unpermute_rows.register_autograd(_unpermute_rows_backward, setup_context=_unpermute_rows_setup_context)


@custom_op("unpermute_rows_into_", mutates_args=("out",))
def unpermute_rows_into_(
    y: torch.Tensor, row_id_map: torch.Tensor, weights: Optional[torch.Tensor], top_k: int, backend: str,
    out: torch.Tensor,
) -> None:
    """``unpermute_rows`` written into ``out`` (e.g. a transport's buffer, which then needs no copy).
    Not differentiable: for the fused experts op, whose backward is its own."""
    with nvtx.range(f"moe_grouped.unpermute_rows_into_[{backend}]"):
        module = backend_module(backend)
        if hasattr(module, "unpermute_rows_into"):
            module.unpermute_rows_into(y, row_id_map, weights, top_k, out)
        else:
            out.copy_(module.unpermute_rows(y, row_id_map, weights, top_k))


@unpermute_rows_into_.register_fake
def _(y, row_id_map, weights, top_k, backend, out):
    return None


@custom_op("unpermute_rows_backward", mutates_args=())
def unpermute_rows_backward(
    dout: torch.Tensor, y: torch.Tensor, row_id_map: torch.Tensor, weights: torch.Tensor, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    with nvtx.range(f"moe_grouped.unpermute_rows_backward[{backend}]"):
        return backend_module(backend).unpermute_rows_backward(dout, y, row_id_map, weights)


@unpermute_rows_backward.register_fake
def _(dout, y, row_id_map, weights, backend):
    return torch.empty_like(y), torch.empty_like(weights)
