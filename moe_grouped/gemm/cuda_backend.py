"""The ``cuda`` backend: the core's CUTLASS SM90 grouped GEMMs.

Graph-safe: ``m_splits`` stays on the device (a setup kernel turns it into
per-expert shapes and pointers inside a persistent workspace), nothing is
allocated in the core during capture, and every call goes to the current
torch stream.

Rules the core enforces (it raises ``ValueError`` otherwise):

- operands are bfloat16 or float16; outputs are the operand dtype or float32;
- ``N`` and ``K`` are multiples of 8 (TMA moves 16-byte rows), see
  :func:`shape_supported`;
- every tensor is contiguous and 16-byte aligned (fresh torch allocations
  are); the separate-weights layout passes the experts' addresses as a device
  array of pointers, built outside capture and cached by address: run one
  eager step before capturing, as for the workspaces.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Optional, Sequence

import torch

from .. import _core
from .._tensors import gathered_operands, gemm_of_gathered_rows, is_grouped_layout, zero_rows_past_splits_

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
OUTPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# N and K must be multiples of this many elements.
ALIGNMENT = 8

SLOT_FPROP_DGRAD = _core.SLOT_FPROP_DGRAD
SLOT_WGRAD = _core.SLOT_WGRAD


def shape_supported(n: int, k: int) -> bool:
    """Whether the kernels take ``out_features=n`` and ``in_features=k``."""
    return n > 0 and k > 0 and n % ALIGNMENT == 0 and k % ALIGNMENT == 0


def grouped_problem(
    tokens: torch.Tensor, m_splits: torch.Tensor, num_groups: int, n: int, k: int, slot: int,
    total_rows: Optional[int] = None, dtype: Optional[torch.dtype] = None,
) -> _core.GroupedProblem:
    """The problem of ``tokens``' rows (or ``total_rows`` of them) in ``tokens``' dtype (or ``dtype``)."""
    return _core.GroupedProblem(
        num_groups=num_groups,
        total_rows=tokens.shape[0] if total_rows is None else total_rows,
        n=n,
        k=k,
        m_splits=m_splits.data_ptr(),
        splits_dtype=_core.dtype_code(m_splits.dtype),
        dtype=_core.dtype_code(tokens.dtype if dtype is None else dtype),
        device=_core.device_index(tokens.device),
        workspace_slot=slot,
    )


# Device arrays of expert addresses for the separate-weights layout, keyed by
# (device, addresses). Built only outside capture; the cache keeps them alive
# for the graphs that read them.
_POINTER_ARRAYS: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}


def _pointer_array(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    device = tensors[0].device
    key = (_core.device_index(device), tuple(map(torch.Tensor.data_ptr, tensors)))
    array = _POINTER_ARRAYS.get(key)
    if array is not None:
        return array
    for e, w in enumerate(tensors):
        if w.data_ptr() % 16 != 0:
            raise ValueError(
                f"the cuda backend needs 16-byte aligned expert matrices; expert {e}'s starts at "
                f"address {w.data_ptr():#x}"
            )
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "the cuda backend needs a device array of the experts' weight (or gradient) addresses, "
            "and these addresses were not seen before the CUDA graph capture began; building the "
            "array would copy from the host, which cannot be captured. Run one eager step with the "
            "same tensors before capturing, or use one grouped [E, N, K] tensor"
        )
    array = torch.tensor(key[1], dtype=torch.int64).to(device)
    _POINTER_ARRAYS[key] = array
    return array


def clear_pointer_cache() -> None:
    """Drops the cached address arrays (graphs that used them must not replay)."""
    _POINTER_ARRAYS.clear()


def group_operand(tensors: Sequence[torch.Tensor]) -> _core.GroupOperand:
    """``mg_group_operand`` for ``[W]`` (W of shape [E, N, K]) or E tensors [N, K] (contiguous; the address
    arrays of the latter cached by address)."""
    if is_grouped_layout(tensors):
        w = tensors[0]
        _require_contiguous("the grouped weight", w)
        return _core.GroupOperand(base=w.data_ptr(), group_stride=w.stride(0), ptrs=None)
    if not all(map(torch.Tensor.is_contiguous, tensors)):
        for e, w in enumerate(tensors):
            _require_contiguous(f"expert {e}'s matrix", w)
    # Alignment is checked when an address array is built (the cache is keyed by the addresses).
    return _core.GroupOperand(base=None, group_stride=0, ptrs=_pointer_array(tensors).data_ptr())


def _require_contiguous(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"the cuda backend needs {name} contiguous, got strides {tensor.stride()}")


def _matrix_shape(tensors: Sequence[torch.Tensor]) -> tuple[int, int, int]:
    if is_grouped_layout(tensors):
        e, n, k = tensors[0].shape
        return e, n, k
    n, k = tensors[0].shape
    return len(tensors), n, k


def _check_out_dtype(out_dtype: torch.dtype, dtype: torch.dtype) -> None:
    if out_dtype not in (dtype, torch.float32):
        raise TypeError(
            f"the cuda backend writes {dtype} or torch.float32 outputs for {dtype} operands, "
            f"got {out_dtype}"
        )


def workspace_size(
    kind: int, num_groups: int, total_rows: int, n: int, k: int, dtype: torch.dtype, device
) -> int:
    """Bytes of workspace one GEMM of ``kind`` (``_core.GEMM_*``) takes; reserve before capture."""
    lib = _core.require()
    device = torch.device(device)
    index = _core.device_index(device)
    problem = _core.GroupedProblem(
        num_groups=num_groups,
        total_rows=total_rows,
        n=n,
        k=k,
        m_splits=1,  # only checked for NULL
        splits_dtype=_core.dtype_code(torch.int64),
        dtype=_core.dtype_code(dtype),
        device=index,
        workspace_slot=SLOT_WGRAD if kind == _core.GEMM_WGRAD else SLOT_FPROP_DGRAD,
    )
    size = ctypes.c_size_t()
    _core.check(lib.mg_grouped_gemm_workspace_size(ctypes.byref(problem), kind, ctypes.byref(size)))
    return size.value


def zero_rows_past_splits(out: torch.Tensor, m_splits: torch.Tensor) -> torch.Tensor:
    """``out`` with its rows past the sum of ``m_splits`` zeroed by the core, which writes those
    rows only (a core built before ``mg_zero_rows_past_splits``: a masked pass over ``out``)."""
    lib = _core.require()
    if not hasattr(lib, "mg_zero_rows_past_splits"):
        return zero_rows_past_splits_(out, m_splits)
    _core.check(
        lib.mg_zero_rows_past_splits(
            m_splits.data_ptr(), _core.dtype_code(m_splits.dtype), m_splits.shape[0], out.shape[0],
            out.data_ptr(), out.stride(0) * out.element_size(), _core.device_index(out.device),
            _core.stream_handle(out.device),
        )
    )
    return out


def fprop(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    m_splits: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    lib = _core.require()
    _check_out_dtype(out_dtype, x.dtype)
    num_groups, n, k = _matrix_shape(weights)
    x = x.contiguous()
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    y = torch.empty(x.shape[0], n, dtype=out_dtype, device=x.device)
    problem = grouped_problem(x, m_splits, num_groups, n, k, SLOT_FPROP_DGRAD)
    _core.check(
        lib.mg_grouped_fprop(
            ctypes.byref(problem),
            x.data_ptr(),
            group_operand(weights),
            bias.data_ptr() if bias is not None else None,
            y.data_ptr(),
            _core.dtype_code(out_dtype),
            _core.stream_handle(x.device),
        )
    )
    return y


def dgrad(
    dy: torch.Tensor, weights: Sequence[torch.Tensor], m_splits: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    lib = _core.require()
    _check_out_dtype(out_dtype, dy.dtype)
    num_groups, n, k = _matrix_shape(weights)
    dy = dy.contiguous()
    dx = torch.empty(dy.shape[0], k, dtype=out_dtype, device=dy.device)
    problem = grouped_problem(dy, m_splits, num_groups, n, k, SLOT_FPROP_DGRAD)
    _core.check(
        lib.mg_grouped_dgrad(
            ctypes.byref(problem),
            dy.data_ptr(),
            group_operand(weights),
            dx.data_ptr(),
            _core.dtype_code(out_dtype),
            _core.stream_handle(dy.device),
        )
    )
    return dx


def wgrad(
    dy: torch.Tensor,
    x: torch.Tensor,
    m_splits: torch.Tensor,
    out: Sequence[torch.Tensor],
    accumulate: bool,
) -> None:
    lib = _core.require()
    out_dtype = out[0].dtype
    _check_out_dtype(out_dtype, dy.dtype)
    num_groups, n, k = _matrix_shape(out)
    dy = dy.contiguous()
    x = x.contiguous()
    problem = grouped_problem(dy, m_splits, num_groups, n, k, SLOT_WGRAD)
    _core.check(
        lib.mg_grouped_wgrad(
            ctypes.byref(problem),
            dy.data_ptr(),
            x.data_ptr(),
            group_operand(out),
            _core.dtype_code(out_dtype),
            1 if accumulate else 0,
            _core.stream_handle(dy.device),
        )
    )


# ---- fc2's dgrad with the weighted SwiGLU backward in its epilogue ----------

# "fused" runs fc2's dgrad and the weighted SwiGLU backward as one kernel;
# the default, "unfused", runs the plain dgrad and the standalone pass, which
# measured 1.6-1.9x as fast on the H100 (docs/kernels.md, "SwiGLU-backward
# epilogue").
# Same dg and wh either way, bitwise.
DGRAD_SWIGLU_ENV = "MOE_GROUPED_DGRAD_SWIGLU"


def dgrad_swiglu_fuses(dy: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether the op runs :func:`dgrad_swiglu` here (asked for, bf16, a core that has it)."""
    setting = os.environ.get(DGRAD_SWIGLU_ENV, "unfused")
    if setting not in ("fused", "unfused"):
        raise ValueError(f"{DGRAD_SWIGLU_ENV}={setting!r}: expected 'fused' or 'unfused'")
    return (
        setting == "fused" and dy.dtype == torch.bfloat16 and g.dtype == torch.bfloat16
        and _core.has(_core.CAP_DGRAD_SWIGLU)
    )


def dgrad_swiglu(
    dy: torch.Tensor,
    weights: Sequence[torch.Tensor],
    m_splits: torch.Tensor,
    g: torch.Tensor,
    routing_weights: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One kernel: ``dh_u = dy W`` (not stored), then g -> dg in place; returns ``(wh, dprob)``.

    See ``mg_grouped_dgrad_swiglu``: dg and wh are bitwise the plain dgrad
    followed by the weighted SwiGLU backward; dprob sums the same products
    per 256-column tile, then over the tiles. Rows past the sum of m_splits:
    dprob 0, g and wh not written.
    """
    lib = _core.require()
    num_groups, n, k = _matrix_shape(weights)
    dy = dy.contiguous()
    _require_contiguous("g", g)
    rows = dy.shape[0]
    wh = torch.empty(rows, k, dtype=dy.dtype, device=dy.device)
    cols = ctypes.c_int64()
    _core.check(lib.mg_grouped_dgrad_swiglu_partial_cols(k, ctypes.byref(cols)))
    partials = torch.zeros(rows, cols.value, dtype=torch.float32, device=dy.device)
    if routing_weights is not None:
        routing_weights = routing_weights.contiguous()
    problem = grouped_problem(dy, m_splits, num_groups, n, k, SLOT_FPROP_DGRAD)
    _core.check(
        lib.mg_grouped_dgrad_swiglu(
            ctypes.byref(problem),
            dy.data_ptr(),
            group_operand(weights),
            g.data_ptr(),
            routing_weights.data_ptr() if routing_weights is not None else None,
            wh.data_ptr(),
            partials.data_ptr(),
            cols.value,
            _core.stream_handle(dy.device),
        )
    )
    return wh, partials.sum(dim=1)


# ---- gathered GEMMs: token rows read through the routing index -------------


def gathers(source: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> bool:
    """Whether the core's gathered kernels take this source (bf16, 1 .. 2^31 - 1 rows).

    ``out_dtype``: fprop's and dgrad's output, built for bf16 only (wgrad
    writes bf16 or an fp32 main_grad). Elsewhere the gathered ops copy the
    rows first (``gather_rows``) and run the plain kernels: same result, one
    more pass.
    """
    return (
        source.dtype == torch.bfloat16
        and out_dtype in (None, torch.bfloat16)
        and 0 < source.shape[0] < 2**31
        and _core.has(_core.CAP_GATHERED_GEMM)
    )


def _row_gather(source: torch.Tensor, index: torch.Tensor) -> tuple[_core.RowGather, torch.Tensor]:
    """``mg_row_gather`` for ``source`` and the int32 index it points at (kept alive by the caller)."""
    index = index.to(device=source.device, dtype=torch.int32).contiguous()
    return _core.RowGather(index=index.data_ptr(), source_rows=source.shape[0]), index


def _gathered(kind: str, source, index, weights, m_splits, out_dtype) -> torch.Tensor:
    """fprop (``kind`` "fprop": [rows, N]) or dgrad ("dgrad": [rows, K]) of ``source[index]``."""
    if not gathers(source, out_dtype):
        this_backend = sys.modules[__name__]  # the helper takes a backend module: this one's plain kernels
        return gemm_of_gathered_rows(this_backend, kind, source, index, weights, m_splits, out_dtype)
    lib = _core.require()
    _check_out_dtype(out_dtype, source.dtype)
    num_groups, n, k = _matrix_shape(weights)
    source = source.contiguous()
    rows, index = _row_gather(source, index)
    out = torch.empty(index.shape[0], n if kind == "fprop" else k, dtype=out_dtype, device=source.device)
    problem = grouped_problem(out, m_splits, num_groups, n, k, SLOT_FPROP_DGRAD, dtype=source.dtype)
    entry = lib.mg_grouped_fprop_gathered if kind == "fprop" else lib.mg_grouped_dgrad_gathered
    _core.check(entry(ctypes.byref(problem), source.data_ptr(), rows, group_operand(weights), out.data_ptr(),
                      _core.dtype_code(out_dtype), _core.stream_handle(source.device)))
    return out


def fprop_gathered(
    source: torch.Tensor, index: torch.Tensor, weights: Sequence[torch.Tensor], m_splits: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return _gathered("fprop", source, index, weights, m_splits, out_dtype)


def dgrad_gathered(
    source: torch.Tensor, index: torch.Tensor, weights: Sequence[torch.Tensor], m_splits: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return _gathered("dgrad", source, index, weights, m_splits, out_dtype)


def wgrad_gathered(
    dy: torch.Tensor,
    dy_index: Optional[torch.Tensor],
    x: torch.Tensor,
    x_index: Optional[torch.Tensor],
    m_splits: torch.Tensor,
    out: Sequence[torch.Tensor],
    accumulate: bool,
) -> None:
    if not all(gathers(t) for t, i in ((dy, dy_index), (x, x_index)) if i is not None):
        wgrad(*gathered_operands(dy, dy_index, x, x_index), m_splits, out, accumulate)
        return
    lib = _core.require()
    out_dtype = out[0].dtype
    _check_out_dtype(out_dtype, dy.dtype)
    num_groups, n, k = _matrix_shape(out)
    dy, x = dy.contiguous(), x.contiguous()
    dy_rows = x_rows = None
    if dy_index is not None:
        dy_rows, dy_index = _row_gather(dy, dy_index)
    if x_index is not None:
        x_rows, x_index = _row_gather(x, x_index)
    total_rows = (dy_index if dy_index is not None else dy).shape[0]
    problem = grouped_problem(dy, m_splits, num_groups, n, k, SLOT_WGRAD, total_rows=total_rows)
    _core.check(
        lib.mg_grouped_wgrad_gathered(
            ctypes.byref(problem),
            dy.data_ptr(),
            ctypes.byref(dy_rows) if dy_rows is not None else None,
            x.data_ptr(),
            ctypes.byref(x_rows) if x_rows is not None else None,
            group_operand(out),
            _core.dtype_code(out_dtype),
            1 if accumulate else 0,
            _core.stream_handle(dy.device),
        )
    )


# ---- fc1 with SwiGLU ----------------------------------------------------------


def fuses_fc1_swiglu(source: torch.Tensor, gathered: bool, weights: Sequence[torch.Tensor]) -> bool:
    """Whether :func:`fprop_swiglu` takes these operands (bf16, 2 * ffn a multiple of 16, a core that has it).

    ``gathered``: ``source`` is to be read through an index, as :func:`gathers` allows.
    """
    return (
        source.dtype == torch.bfloat16
        and all(w.dtype == torch.bfloat16 for w in weights)
        and weights[0].shape[-2] % 16 == 0
        and (not gathered or gathers(source))
        and _core.has(_core.CAP_FPROP_SWIGLU)
    )


def fprop_swiglu(
    source: torch.Tensor, index: Optional[torch.Tensor], weights: Sequence[torch.Tensor], m_splits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fc1 and SwiGLU: ``(g, h)``, g = rows . W^T ([rows, 2 * ffn], gate | up), h = silu(gate) * up.

    The rows are ``source`` or, with ``index``, ``source[index]`` read in the
    GEMM. See ``mg_grouped_fprop_swiglu``: bitwise :func:`fprop` (or
    :func:`fprop_gathered`) followed by the cuda SwiGLU pass, in one kernel
    where the core's ping-pong fprop takes the problem. Rows past the sum of
    m_splits are not specified.
    """
    lib = _core.require()
    num_groups, n, k = _matrix_shape(weights)
    source = source.contiguous()
    rows = None
    if index is not None:
        rows, index = _row_gather(source, index)
    total_rows = (index if index is not None else source).shape[0]
    g = torch.empty(total_rows, n, dtype=source.dtype, device=source.device)
    h = torch.empty(total_rows, n // 2, dtype=source.dtype, device=source.device)
    problem = grouped_problem(g, m_splits, num_groups, n, k, SLOT_FPROP_DGRAD, dtype=source.dtype)
    _core.check(
        lib.mg_grouped_fprop_swiglu(
            ctypes.byref(problem),
            source.data_ptr(),
            ctypes.byref(rows) if rows is not None else None,
            group_operand(weights),
            g.data_ptr(),
            h.data_ptr(),
            _core.stream_handle(source.device),
        )
    )
    return g, h


def dbias(dy: torch.Tensor, m_splits: torch.Tensor, num_groups: int, out_dtype: torch.dtype) -> torch.Tensor:
    lib = _core.require()
    _check_out_dtype(out_dtype, dy.dtype)
    dy = dy.contiguous()
    out = torch.empty(num_groups, dy.shape[1], dtype=out_dtype, device=dy.device)
    problem = grouped_problem(dy, m_splits, num_groups, dy.shape[1], 0, SLOT_FPROP_DGRAD)
    _core.check(
        lib.mg_grouped_dbias(
            ctypes.byref(problem), dy.data_ptr(), out.data_ptr(), _core.dtype_code(out_dtype),
            _core.stream_handle(dy.device),
        )
    )
    return out


__all__ = [
    "fprop", "dgrad", "wgrad", "dbias", "fprop_gathered", "dgrad_gathered", "wgrad_gathered", "gathers",
    "fprop_swiglu", "fuses_fc1_swiglu",
    "shape_supported", "workspace_size", "zero_rows_past_splits",
]
