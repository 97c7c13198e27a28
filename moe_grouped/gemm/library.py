"""``torch.library`` registration of the grouped ops and backend dispatch.

Each op takes the backend's name as its last argument; the checks live in the
public wrappers (:mod:`moe_grouped.gemm`), so these bodies only dispatch. The fake
implementations give shapes to meta tensors, FakeTensor and torch.compile.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from .._ops import custom_op, ops
from .. import _core
from .._tensors import compute_dtype, gathered_operands, gemm_of_gathered_rows, num_groups_of, offsets_with_zero
# Registers swiglu_weighted_backward_, which grouped_dgrad_swiglu_ runs.
from ..activation import library as _activation_library  # noqa: F401
from ..graphs import nvtx
from . import cuda_backend, reference, torch_backend

# All imported up front (cuda_backend imports without the core and calls it
# only when an op runs): an import inside a compiled region breaks the graph.
_MODULES = {"reference": reference, "torch": torch_backend, "cuda": cuda_backend}


def backend_module(name: str) -> ModuleType:
    """The module implementing ``fprop``/``dgrad``/``wgrad``/``dbias`` and ``zero_rows_past_splits`` for ``name``."""
    if name not in _MODULES:
        raise ValueError(f"unknown backend {name!r}")
    return _MODULES[name]


def check_backend_dtype(backend: str, dtype: torch.dtype) -> None:
    """Raises TypeError when ``backend`` cannot compute in ``dtype``."""
    supported = backend_module(backend).SUPPORTED_DTYPES
    if dtype not in supported:
        names = ", ".join(str(d) for d in supported)
        raise TypeError(f"backend {backend!r} supports dtypes ({names}), got {dtype}")


def _past_splits_zeroed(backend: str, out: torch.Tensor, m_splits: torch.Tensor, zero_tail: bool) -> torch.Tensor:
    """``out`` (a GEMM's [rows, ...] output) with its rows past the sum of ``m_splits`` zeroed the backend's
    way when ``zero_tail``; else as the GEMM left them (not written by the ``cuda`` and ``torch`` backends)."""
    return backend_module(backend).zero_rows_past_splits(out, m_splits) if zero_tail else out


@custom_op("grouped_fprop", mutates_args=())
def grouped_fprop(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    m_splits: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
    backend: str,
    zero_tail: bool,
) -> torch.Tensor:
    """``zero_tail``: the rows past the sum of ``m_splits`` are zeros (False: not written, for callers
    that read only the experts' rows, e.g. the fused experts path with a capacity's worst-case buffer)."""
    with nvtx.range(f"moe_grouped.fprop[{backend}]"):
        y = backend_module(backend).fprop(x, weights, m_splits, bias, out_dtype)
        return _past_splits_zeroed(backend, y, m_splits, zero_tail)


@grouped_fprop.register_fake
def _(x, weights, m_splits, bias, out_dtype, backend, zero_tail):
    return x.new_empty(x.shape[0], weights[0].shape[-2], dtype=out_dtype)


def _fprop_setup_context(ctx, inputs, output):
    x, weights, m_splits, bias, _, backend, _ = inputs
    ctx.save_for_backward(x, m_splits, *weights)
    ctx.has_bias = bias is not None
    ctx.backend, ctx.zero_tail = backend, inputs[6]


def _fprop_backward(ctx, grad_y):
    x, m_splits, *weights = ctx.saved_tensors
    grad_y = grad_y.to(x.dtype).contiguous()
    needs_x, needs_w, _, needs_bias = ctx.needs_input_grad[:4]
    dx = (ops.grouped_dgrad(grad_y, weights, m_splits, x.dtype, ctx.backend, ctx.zero_tail)
          if needs_x else None)
    dw = None
    if needs_w:
        # One [E, N, K] output even for separate weights (see grouped_linear).
        grads = grad_y.new_empty(num_groups_of(weights), weights[0].shape[-2], weights[0].shape[-1])
        ops.grouped_wgrad_(grad_y, x, m_splits, [grads], False, ctx.backend)
        dw = [grads] if len(weights) == 1 and weights[0].dim() == 3 else list(grads.unbind(0))
    db = None
    if ctx.has_bias and needs_bias:
        db = ops.grouped_dbias(
            grad_y, m_splits, num_groups_of(weights), x.dtype, ctx.backend
        )
    return dx, dw, None, db, None, None, None


grouped_fprop.register_autograd(_fprop_backward, setup_context=_fprop_setup_context)


@custom_op("grouped_dgrad", mutates_args=())
def grouped_dgrad(
    dy: torch.Tensor,
    weights: list[torch.Tensor],
    m_splits: torch.Tensor,
    out_dtype: torch.dtype,
    backend: str,
    zero_tail: bool,
) -> torch.Tensor:
    """``zero_tail``: as :func:`grouped_fprop`'s."""
    with nvtx.range(f"moe_grouped.dgrad[{backend}]"):
        dx = backend_module(backend).dgrad(dy, weights, m_splits, out_dtype)
        return _past_splits_zeroed(backend, dx, m_splits, zero_tail)


@grouped_dgrad.register_fake
def _(dy, weights, m_splits, out_dtype, backend, zero_tail):
    return dy.new_empty(dy.shape[0], weights[0].shape[-1], dtype=out_dtype)


@custom_op("grouped_dgrad_swiglu_", mutates_args=("g",))
def grouped_dgrad_swiglu_(
    dy: torch.Tensor,
    weights: list[torch.Tensor],
    m_splits: torch.Tensor,
    g: torch.Tensor,
    routing_weights: Optional[torch.Tensor],
    backend: str,
    activation_backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fc2's dgrad ``dh_u = dy W`` then the weighted SwiGLU backward: ``g`` becomes dg; returns (wh, dprob).

    The fused experts path's backward through fc2 and SwiGLU (see
    ``moe_grouped.activation.swiglu_weighted_backward`` for the three
    results): the dgrad on ``backend`` followed by the pass on
    ``activation_backend``, or, with MOE_GROUPED_DGRAD_SWIGLU=fused on the
    ``cuda`` backends in bf16, one kernel that never stores dh_u
    (``mg_grouped_dgrad_swiglu``; measured slower, see cuda_backend).
    """
    with nvtx.range(f"moe_grouped.dgrad_swiglu[{backend}]"):
        if backend == "cuda" and activation_backend == "cuda" and cuda_backend.dgrad_swiglu_fuses(dy, g):
            return cuda_backend.dgrad_swiglu(dy, weights, m_splits, g, routing_weights)
        # Its tail (past the sum) becomes wh's, which nothing reads: not zeroed.
        dh_u = backend_module(backend).dgrad(dy, weights, m_splits, dy.dtype)
        dprob = g.new_empty(g.shape[0], dtype=compute_dtype(g.dtype))
        ops.swiglu_weighted_backward_(dh_u, g, routing_weights, m_splits, dprob, activation_backend)
        return dh_u, dprob


@grouped_dgrad_swiglu_.register_fake
def _(dy, weights, m_splits, g, routing_weights, backend, activation_backend):
    return dy.new_empty(dy.shape[0], weights[0].shape[-1]), g.new_empty(g.shape[0], dtype=compute_dtype(g.dtype))


@custom_op("grouped_wgrad_", mutates_args=("out",))
def grouped_wgrad_(
    dy: torch.Tensor,
    x: torch.Tensor,
    m_splits: torch.Tensor,
    out: list[torch.Tensor],
    accumulate: bool,
    backend: str,
) -> None:
    with nvtx.range(f"moe_grouped.wgrad[{backend}]"):
        backend_module(backend).wgrad(dy, x, m_splits, out, accumulate)


@grouped_wgrad_.register_fake
def _(dy, x, m_splits, out, accumulate, backend):
    return None


def _gathered(backend: str, name: str):
    """The backend's gathered op, or None when it has none (then the rows are gathered first)."""
    return getattr(backend_module(backend), name, None)


def _gathered_gemm_op(kind: str, width_dim: int):
    """The op ``grouped_<kind>_gathered`` (kind "fprop" or "dgrad"): ``grouped_<kind>`` of
    ``gather_rows(source, index)`` ([len(index), ...] rows) without the copy. A backend without the gathered
    kernel gathers the rows first and zeros the rows past the splits; its output has ``weights[0].shape[width_dim]``
    columns."""

    @custom_op(f"grouped_{kind}_gathered", mutates_args=())
    def op(
        source: torch.Tensor,
        index: torch.Tensor,
        weights: list[torch.Tensor],
        m_splits: torch.Tensor,
        out_dtype: torch.dtype,
        backend: str,
    ) -> torch.Tensor:
        with nvtx.range(f"moe_grouped.{kind}_gathered[{backend}]"):
            gathered = _gathered(backend, f"{kind}_gathered")
            if gathered is not None:
                return gathered(source, index, weights, m_splits, out_dtype)
            return gemm_of_gathered_rows(backend_module(backend), kind, source, index, weights, m_splits, out_dtype)

    @op.register_fake
    def _(source, index, weights, m_splits, out_dtype, backend):
        return source.new_empty(index.shape[0], weights[0].shape[width_dim], dtype=out_dtype)

    return op


grouped_fprop_gathered = _gathered_gemm_op("fprop", -2)
grouped_dgrad_gathered = _gathered_gemm_op("dgrad", -1)


@custom_op("grouped_fprop_swiglu", mutates_args=())
def grouped_fprop_swiglu(
    source: torch.Tensor,
    index: Optional[torch.Tensor],
    weights: list[torch.Tensor],
    m_splits: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cuda backend's fc1 with SwiGLU: ``(g, h)`` (``cuda_backend.fprop_swiglu``; callers check
    ``cuda_backend.fuses_fc1_swiglu`` first)."""
    with nvtx.range("moe_grouped.fprop_swiglu[cuda]"):
        return cuda_backend.fprop_swiglu(source, index, weights, m_splits)


@grouped_fprop_swiglu.register_fake
def _(source, index, weights, m_splits):
    rows = (index if index is not None else source).shape[0]
    n = weights[0].shape[-2]
    return source.new_empty(rows, n), source.new_empty(rows, n // 2)


@custom_op("grouped_wgrad_gathered_", mutates_args=("out",))
def grouped_wgrad_gathered_(
    dy: torch.Tensor,
    dy_index: Optional[torch.Tensor],
    x: torch.Tensor,
    x_index: Optional[torch.Tensor],
    m_splits: torch.Tensor,
    out: list[torch.Tensor],
    accumulate: bool,
    backend: str,
) -> None:
    """``grouped_wgrad_`` where dy (x) is ``gather_rows(dy, dy_index)`` when that index is given."""
    with nvtx.range(f"moe_grouped.wgrad_gathered[{backend}]"):
        op = _gathered(backend, "wgrad_gathered")
        if op is not None:
            op(dy, dy_index, x, x_index, m_splits, out, accumulate)
            return
        backend_module(backend).wgrad(*gathered_operands(dy, dy_index, x, x_index), m_splits, out, accumulate)


@grouped_wgrad_gathered_.register_fake
def _(dy, dy_index, x, x_index, m_splits, out, accumulate, backend):
    return None


@custom_op("grouped_dbias", mutates_args=())
def grouped_dbias(
    dy: torch.Tensor, m_splits: torch.Tensor, num_groups: int, out_dtype: torch.dtype, backend: str
) -> torch.Tensor:
    with nvtx.range(f"moe_grouped.dbias[{backend}]"):
        return backend_module(backend).dbias(dy, m_splits, num_groups, out_dtype)


@grouped_dbias.register_fake
def _(dy, m_splits, num_groups, out_dtype, backend):
    return dy.new_empty(num_groups, dy.shape[1], dtype=out_dtype)


@custom_op("splits_to_offsets", mutates_args=())
def splits_to_offsets(m_splits: torch.Tensor, total_rows: int, backend: str) -> torch.Tensor:
    with nvtx.range(f"moe_grouped.splits_to_offsets[{backend}]"):
        if backend == "cuda":
            return _offsets_from_core(m_splits, total_rows)
        if backend == "reference":
            counts = [max(0, int(c)) for c in m_splits.tolist()]
            bounds, running = [0], 0
            for count in counts:
                running = min(running + count, total_rows)
                bounds.append(running)
            return torch.tensor(bounds, dtype=torch.int64, device=m_splits.device)
        return offsets_with_zero(m_splits, total_rows)


@splits_to_offsets.register_fake
def _(m_splits, total_rows, backend):
    return m_splits.new_empty(m_splits.shape[0] + 1, dtype=torch.int64)


def _offsets_from_core(m_splits: torch.Tensor, total_rows: int) -> torch.Tensor:
    lib = _core.require()
    offsets = torch.empty(m_splits.shape[0] + 1, dtype=torch.int64, device=m_splits.device)
    _core.check(
        lib.mg_grouped_setup(
            m_splits.data_ptr(),
            _core.dtype_code(m_splits.dtype),
            m_splits.shape[0],
            total_rows,
            0,
            0,
            _core.GEMM_FPROP,
            offsets.data_ptr(),
            None,
            _core.stream_handle(m_splits.device),
        )
    )
    return offsets
