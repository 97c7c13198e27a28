"""FP8 block quantization on the GPU through the CUDA core.

Row-wise 1x128 blocks serve the fprop and dgrad operands; the grouped
column-wise copy is the operand layout of the FP8 wgrad GEMM, which reduces
over each expert's tokens (see :func:`quantize_columnwise_grouped`);
:func:`quantize_grouped` makes both, and the fused dbias, from one read of
the tokens; :func:`quantize_weights_128x128` makes the 128x128 weight blocks
and their transposed copy. All read ``m_splits`` only on the device and can
be captured in CUDA graphs (run one eager call first: with dbias it sizes
the workspace). On CPU tensors each runs the reference and copies its result
(zero where the kernels leave padding untouched) into the buffers.

Each quantizer is a ``torch.library`` custom op that writes into buffers
(``torch.ops.moe_grouped.fp8_quantize_*_``, with fake implementations), so
they trace under torch.compile (``fullgraph=True``): the ctypes calls and,
on the reference path, the host read of the splits stay inside the ops.
The wrappers here check arguments and allocate the buffers (or take
``out``).
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence, Union

import torch

from .._ops import custom_op, ops
from .. import _checks, _core
from .._tensors import gather_rows
from ..gemm import cuda_backend  # the GEMMs' grouped operand and its address-array cache
from .quantize_reference import (
    BlockQuantized,
    GroupedQuantized,
    WeightQuantized,
    columnwise_padded_rows,
    columnwise_scale_rows,
    quantize_1x128,
    quantize_grouped_128x128,
    quantize_grouped_1x128,
    quantize_grouped_columnwise,
    check_quantize_options,
)
from .recipe import BLOCK

_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=64)
def _config(fp8_dtype: torch.dtype, pow2_scales: bool, amax_epsilon: float) -> _core.QuantizeConfig:
    # A recipe has a few option sets and a step quantizes a dozen times: the struct is made once per set
    # (the core reads it by value). Wrong options raise here, and exceptions are not cached.
    check_quantize_options(fp8_dtype, pow2_scales, amax_epsilon)
    return _core.QuantizeConfig(_core.dtype_code(fp8_dtype), int(bool(pow2_scales)), float(amax_epsilon))


def _core_function(x: torch.Tensor, name: str):
    """The core's ``name``, or an error saying why it cannot run on ``x``."""
    if not x.is_cuda:
        raise ValueError(f"the CUDA quantizer needs a CUDA tensor, got one on {x.device}")
    library = _core.require()
    if not _core.has(_core.CAP_FP8_QUANTIZE):
        raise RuntimeError("the CUDA core was built without its FP8 quantize kernels")
    function = getattr(library, name, None)
    if function is None:
        raise RuntimeError(f"the CUDA core at {_core.library_path} lacks {name}; rebuild the package")
    return function


def _check_buffer(name: str, tensor: torch.Tensor, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    if (
        not isinstance(tensor, torch.Tensor)
        or tuple(tensor.shape) != tuple(shape)
        or tensor.dtype != dtype
        or tensor.device != device
        or not tensor.is_contiguous()
    ):
        got = (
            f"{tuple(tensor.shape)} of {tensor.dtype} on {tensor.device}"
            if isinstance(tensor, torch.Tensor)
            else type(tensor).__name__
        )
        raise ValueError(f"out must hold {name} {tuple(shape)} of {dtype} on {device} (contiguous), got {got}")


def new_block(data_shape: tuple, scale_shape: tuple, fp8_dtype: torch.dtype, device) -> BlockQuantized:
    """Empty FP8 data and its float32 scale_inv."""
    return BlockQuantized(
        torch.empty(data_shape, dtype=fp8_dtype, device=device),
        torch.empty(scale_shape, dtype=torch.float32, device=device),
    )


def _block_buffers(
    name: str, out: Optional[BlockQuantized], data_shape: tuple, scale_shape: tuple, fp8_dtype, device
) -> BlockQuantized:
    if out is None:
        return new_block(data_shape, scale_shape, fp8_dtype, device)
    _check_buffer(f"{name} data", out.data, data_shape, fp8_dtype, device)
    _check_buffer(f"{name} scale_inv", out.scale_inv, scale_shape, torch.float32, device)
    return out


def quantize_rowwise(
    x: torch.Tensor, fp8_dtype: torch.dtype, pow2_scales: bool = True, amax_epsilon: float = 0.0
) -> BlockQuantized:
    """``x[M, K]`` -> fp8 data [M, K] and scale_inv [M, ceil(K / 128)].

    On CUDA tensors this runs the core's kernel; elsewhere the reference.
    """
    _checks.check_tensor("x", x, dim=2, dtypes=_INPUT_DTYPES)
    check_quantize_options(fp8_dtype, pow2_scales, amax_epsilon)
    return quantize_rows(x, None, fp8_dtype, pow2_scales, float(amax_epsilon), None, True, _backend_of(x)).rowwise


def _backend_of(x: torch.Tensor, backend: Optional[str] = None) -> str:
    if backend is None:
        return "cuda" if x.is_cuda else "reference"
    if backend not in ("cuda", "reference"):
        raise ValueError(f"the FP8 quantizers' backend must be 'cuda', 'reference' or None, got {backend!r}")
    return backend


@custom_op("fp8_quantize_rowwise_", mutates_args=("data", "scale_inv"))
def _quantize_rowwise_op(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    pow2_scales: bool,
    amax_epsilon: float,
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    backend: str,
    swiglu: bool = False,
) -> None:
    """``swiglu``: x is g [rows, 2 * ffn] and swiglu(g) is quantized (:func:`swiglu_quantize_rowwise`)."""
    if backend == "reference":
        if swiglu:
            gate, up = x.chunk(2, dim=1)
            x = torch.nn.functional.silu(gate) * up
        q = quantize_1x128(x, fp8_dtype, pow2_scales, amax_epsilon)
        data.copy_(q.data)
        scale_inv.copy_(q.scale_inv)
        return
    # Both kernels take (x, dtype, rows, cols of the result, config, q, scale_inv, stream).
    function = _core_function(x, "mg_swiglu_quantize_rowwise_1x128" if swiglu else "mg_quantize_rowwise_1x128")
    rows, cols = x.shape
    _core.check(
        function(
            x.data_ptr(), _core.dtype_code(x.dtype), rows, cols // 2 if swiglu else cols,
            _config(fp8_dtype, pow2_scales, amax_epsilon), data.data_ptr(), scale_inv.data_ptr(),
            _core.stream_handle(x.device),
        )
    )


@_quantize_rowwise_op.register_fake
def _(x, fp8_dtype, pow2_scales, amax_epsilon, data, scale_inv, backend, swiglu=False):
    return None


def quantize_columnwise_grouped(
    x: torch.Tensor,
    m_splits: _checks.SplitsLike,
    fp8_dtype: torch.dtype,
    pow2_scales: bool = True,
    amax_epsilon: float = 0.0,
    *,
    workspace_slot: int = _core.SLOT_WGRAD,
    out: Optional[BlockQuantized] = None,
) -> BlockQuantized:
    """Per expert e, ``X_e^T`` quantized in 1x128 blocks along its tokens.

    For x [M, K] and E experts, returns data [K, columnwise_padded_rows(M, E)]
    (expert e's m_e tokens in columns [p_e, p_e + m_e), p_e = sum over j < e
    of round_up(m_j, 128), then zeros up to p_e + round_up(m_e, 128)) and
    scale_inv [columnwise_scale_rows(M, E), K] (expert e's 128-token blocks
    in rows [b_e, b_e + ceil(m_e / 128)), b_e = sum over j < e of
    ceil(m_j / 128)). Positions no expert owns are not written. ``out``
    reuses buffers of those shapes.
    """
    return quantize_grouped(
        x, m_splits, fp8_dtype, pow2_scales, amax_epsilon, rowwise=False, dbias=False,
        workspace_slot=workspace_slot,
        out=None if out is None else GroupedQuantized(None, out, None),
    ).columnwise


def quantize_grouped(
    x: torch.Tensor,
    m_splits: _checks.SplitsLike,
    fp8_dtype: torch.dtype,
    pow2_scales: bool = True,
    amax_epsilon: float = 0.0,
    *,
    rowwise: bool = True,
    dbias: bool = False,
    workspace_slot: int = _core.SLOT_WGRAD,
    out: Optional[GroupedQuantized] = None,
    backend: Optional[str] = None,
) -> GroupedQuantized:
    """One pass over x [M, K]: the grouped column-wise copy, and optionally the
    row-wise copy and the per-expert column sums (dbias, float32 [E, K]).

    The layouts are those of :func:`quantize_rowwise` and
    :func:`quantize_columnwise_grouped`, bit for bit; dbias is summed in a
    fixed order (see :func:`grouped_column_sums`), so it is deterministic.
    ``out`` reuses buffers; its fields must match ``rowwise`` and ``dbias``.
    Only dbias uses the workspace slot: per-block column sums and block
    starts (4 * K * (ceil(M / 128) + E) + 8 * (E + 1) bytes). ``backend``:
    ``"cuda"`` or ``"reference"`` (any device); None picks by ``x``'s device.
    """
    _checks.check_tensor("x", x, dim=2, dtypes=_INPUT_DTYPES)
    rows, cols = x.shape
    if isinstance(m_splits, torch.Tensor):
        num_groups = m_splits.shape[0] if m_splits.dim() == 1 else -1
    elif isinstance(m_splits, (list, tuple)):
        num_groups = len(m_splits)
    else:
        raise TypeError(f"m_splits must be a tensor or a list of ints, got {type(m_splits).__name__}")
    if num_groups < 1:
        raise ValueError(f"m_splits must be 1-D with one count per expert, got {m_splits!r}")
    check_quantize_options(fp8_dtype, pow2_scales, amax_epsilon)
    backend = _backend_of(x, backend)
    # The reference reads the splits on the host (inside the op), so they must cover every row.
    splits = _checks.normalize_splits(m_splits, num_groups, rows, x.device, backend=backend)
    if out is not None and ((out.rowwise is None) == rowwise or (out.dbias is None) == dbias):
        raise ValueError(
            f"out must have rowwise {'set' if rowwise else 'None'} and dbias {'set' if dbias else 'None'} "
            f"to match rowwise={rowwise} and dbias={dbias}"
        )
    columnwise = _block_buffers(
        "columnwise", None if out is None else out.columnwise,
        (cols, columnwise_padded_rows(rows, num_groups)), (columnwise_scale_rows(rows, num_groups), cols),
        fp8_dtype, x.device,
    )
    row_buffers = None
    if rowwise:
        row_buffers = _block_buffers(
            "rowwise", None if out is None else out.rowwise, (rows, cols), (rows, -(-cols // BLOCK)),
            fp8_dtype, x.device,
        )
    sums = None
    if dbias:
        sums = out.dbias if out is not None else torch.empty(num_groups, cols, dtype=torch.float32, device=x.device)
        _check_buffer("dbias", sums, (num_groups, cols), torch.float32, x.device)
    ops.fp8_quantize_grouped_(
        x, splits, fp8_dtype, pow2_scales, float(amax_epsilon), workspace_slot,
        None if row_buffers is None else row_buffers.data, None if row_buffers is None else row_buffers.scale_inv,
        columnwise.data, columnwise.scale_inv, sums, backend,
    )
    return GroupedQuantized(row_buffers, columnwise, sums)


@custom_op("fp8_quantize_grouped_", mutates_args=("row_data", "row_scale_inv", "data", "scale_inv", "dbias"))
def _quantize_grouped_op(
    x: torch.Tensor,
    m_splits: torch.Tensor,
    fp8_dtype: torch.dtype,
    pow2_scales: bool,
    amax_epsilon: float,
    workspace_slot: int,
    row_data: Optional[torch.Tensor],
    row_scale_inv: Optional[torch.Tensor],
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    dbias: Optional[torch.Tensor],
    backend: str,
) -> None:
    rowwise = row_data is not None
    if backend == "reference":
        counts = [int(c) for c in m_splits.tolist()]
        _checks._check_split_values(counts, x.shape[0])
        q = quantize_grouped_1x128(
            x, counts, fp8_dtype, pow2_scales, amax_epsilon, rowwise=rowwise, dbias=dbias is not None
        )
        for buffer, value in ((data, q.columnwise.data), (scale_inv, q.columnwise.scale_inv), (dbias, q.dbias)):
            if buffer is not None:
                buffer.copy_(value)
        if rowwise:
            row_data.copy_(q.rowwise.data)
            row_scale_inv.copy_(q.rowwise.scale_inv)
        return
    name = "mg_quantize_rowwise_columnwise_grouped_1x128" if rowwise else "mg_quantize_columnwise_grouped_1x128"
    function = _core_function(x, name)
    rows, cols = x.shape
    head = (x.data_ptr(), _core.dtype_code(x.dtype), rows, cols, m_splits.data_ptr(),
            _core.dtype_code(m_splits.dtype), m_splits.shape[0], _config(fp8_dtype, pow2_scales, amax_epsilon))
    rowwise_args = (row_data.data_ptr(), row_scale_inv.data_ptr()) if rowwise else ()
    tail = (data.data_ptr(), scale_inv.data_ptr(), None if dbias is None else dbias.data_ptr(),
            _core.device_index(x.device), workspace_slot, _core.stream_handle(x.device))
    _core.check(function(*head, *rowwise_args, *tail))


@_quantize_grouped_op.register_fake
def _(x, m_splits, fp8_dtype, pow2_scales, amax_epsilon, workspace_slot, row_data, row_scale_inv, data, scale_inv,
      dbias, backend):
    return None


def quantize_weights_128x128(
    weights: Union[torch.Tensor, Sequence[torch.Tensor]],
    fp8_dtype: torch.dtype,
    pow2_scales: bool = True,
    amax_epsilon: float = 0.0,
    *,
    transpose: bool = True,
    out: Optional[WeightQuantized] = None,
    backend: Optional[str] = None,
) -> WeightQuantized:
    """Grouped weights in 128x128 blocks: one [E, N, K] tensor (or ``[W]``),
    or E tensors [N, K] of one dtype.

    Returns ``w``: data [E, N, K], scale_inv [E, ceil(N / 128), ceil(K / 128)]
    and, with ``transpose``, ``wt``: data [E, K, N] (the same fp8 values
    transposed, for dgrad) and scale_inv [E, ceil(K / 128), ceil(N / 128)].
    Separate expert tensors are passed to the core as a device array of their
    addresses, cached by address: under CUDA graphs, quantize them eagerly once
    before capturing (or use one [E, N, K] tensor). ``backend``: as in
    :func:`quantize_grouped`.
    """
    experts = [weights] if isinstance(weights, torch.Tensor) else list(weights)
    if isinstance(weights, torch.Tensor) and weights.dim() != 3:
        raise ValueError(f"weights must be [E, N, K] or a list of E tensors [N, K], got shape {tuple(weights.shape)}")
    num_groups, n, k = _checks.check_weights(experts)
    if experts[0].dtype not in _INPUT_DTYPES:
        raise TypeError(f"weights must be float32, float16 or bfloat16, got {experts[0].dtype}")
    check_quantize_options(fp8_dtype, pow2_scales, amax_epsilon)
    device = experts[0].device
    if out is not None and (out.wt is None) == transpose:
        raise ValueError(f"out.wt must be {'set' if transpose else 'None'} to match transpose={transpose}")
    row_tiles, col_tiles = -(-n // BLOCK), -(-k // BLOCK)
    w = _block_buffers("w", None if out is None else out.w, (num_groups, n, k), (num_groups, row_tiles, col_tiles),
                       fp8_dtype, device)
    wt = None
    if transpose:
        wt = _block_buffers("wt", None if out is None else out.wt, (num_groups, k, n),
                            (num_groups, col_tiles, row_tiles), fp8_dtype, device)
    ops.fp8_quantize_weights_(
        experts, fp8_dtype, pow2_scales, float(amax_epsilon), w.data, w.scale_inv,
        None if wt is None else wt.data, None if wt is None else wt.scale_inv, _backend_of(experts[0], backend),
    )
    return WeightQuantized(w, wt)


@custom_op("fp8_quantize_weights_", mutates_args=("data", "scale_inv", "t_data", "t_scale_inv"))
def _quantize_weights_op(
    weights: list[torch.Tensor],
    fp8_dtype: torch.dtype,
    pow2_scales: bool,
    amax_epsilon: float,
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    t_data: Optional[torch.Tensor],
    t_scale_inv: Optional[torch.Tensor],
    backend: str,
) -> None:
    transpose = t_data is not None
    if backend == "reference":
        q = quantize_grouped_128x128(weights, fp8_dtype, pow2_scales, amax_epsilon, transpose=transpose)
        data.copy_(q.w.data)
        scale_inv.copy_(q.w.scale_inv)
        if transpose:
            t_data.copy_(q.wt.data)
            t_scale_inv.copy_(q.wt.scale_inv)
        return
    function = _core_function(weights[0], "mg_quantize_weight_128x128")
    num_groups, n, k = data.shape
    _core.check(
        function(
            cuda_backend.group_operand(weights), _core.dtype_code(weights[0].dtype), num_groups, n, k,
            _config(fp8_dtype, pow2_scales, amax_epsilon), data.data_ptr(), scale_inv.data_ptr(),
            t_data.data_ptr() if transpose else None, t_scale_inv.data_ptr() if transpose else None,
            _core.stream_handle(data.device),
        )
    )


@_quantize_weights_op.register_fake
def _(weights, fp8_dtype, pow2_scales, amax_epsilon, data, scale_inv, t_data, t_scale_inv, backend):
    return None


def quantize_gathered(
    x: torch.Tensor,
    index: Optional[torch.Tensor],
    fp8_dtype: torch.dtype,
    pow2_scales: bool = True,
    amax_epsilon: float = 0.0,
    *,
    m_splits: Optional[torch.Tensor] = None,
    rowwise: bool = True,
    backend: Optional[str] = None,
) -> GroupedQuantized:
    """The 1x128 copies of the rows ``x[index[r]]``, without writing the gathered rows.

    ``x`` [T, K]; ``index`` [R] int32 on x's device, an entry outside
    ``[0, T)`` standing for a row of zeros (``permute.source_rows`` gives
    -1 for rows no copy maps to); None: x's own rows. Bit for bit what
    gathering (:func:`moe_grouped._tensors.gather_rows`) and then
    :func:`quantize_rowwise` / :func:`quantize_grouped` give. Without
    ``m_splits`` only the row-wise copy is made; with it the grouped
    column-wise copy too, and the row-wise one when ``rowwise``.
    Reads ``index`` and ``m_splits`` on the device only on the ``cuda``
    backend (graph-safe); ``reference`` reads them on the host.
    """
    _checks.check_tensor("x", x, dim=2, dtypes=_INPUT_DTYPES)
    check_quantize_options(fp8_dtype, pow2_scales, amax_epsilon)
    backend = _backend_of(x, backend)
    if m_splits is None and not rowwise:
        raise ValueError("without m_splits only the row-wise copy can be made: pass rowwise=True")
    if index is None:
        if m_splits is None:
            return GroupedQuantized(quantize_rowwise(x, fp8_dtype, pow2_scales, amax_epsilon), None, None)
        return quantize_grouped(x, m_splits, fp8_dtype, pow2_scales, amax_epsilon, rowwise=rowwise, backend=backend)
    if index.dtype != torch.int32 or index.dim() != 1 or index.device != x.device:
        raise ValueError(
            f"index must be 1-D int32 on {x.device}, got {index.dtype} {tuple(index.shape)} on {index.device}"
        )
    return quantize_rows(x, index, fp8_dtype, pow2_scales, float(amax_epsilon), m_splits, rowwise, backend)


def quantize_rows(
    x: torch.Tensor,
    index: Optional[torch.Tensor],
    fp8_dtype: torch.dtype,
    pow2_scales: bool,
    amax_epsilon: float,
    m_splits: Optional[torch.Tensor],
    rowwise: bool,
    backend: str,
) -> GroupedQuantized:
    """:func:`quantize_gathered` (``index`` None: x's own rows) without its argument checks.

    For the package's FP8 stages, whose arguments were checked where they
    were made: x by the layer (or made by the stages), the options by the
    recipe, ``index`` by ``source_rows``, ``m_splits`` by the router or the
    layer. The same ops with the same arguments as the checked entries.
    """
    rows, cols = (x.shape[0] if index is None else index.shape[0]), x.shape[1]
    row_buffers = columnwise = None
    if rowwise:
        row_buffers = new_block((rows, cols), (rows, -(-cols // BLOCK)), fp8_dtype, x.device)
    if m_splits is not None:
        num_groups = m_splits.shape[0]
        columnwise = new_block(
            (cols, columnwise_padded_rows(rows, num_groups)), (columnwise_scale_rows(rows, num_groups), cols),
            fp8_dtype, x.device,
        )
    row_data, row_scale_inv = (None, None) if row_buffers is None else row_buffers
    if index is None and columnwise is None:
        ops.fp8_quantize_rowwise_(x, fp8_dtype, pow2_scales, amax_epsilon, row_data, row_scale_inv, backend)
    elif index is None:
        ops.fp8_quantize_grouped_(
            x, m_splits, fp8_dtype, pow2_scales, amax_epsilon, _core.SLOT_WGRAD, row_data, row_scale_inv,
            columnwise.data, columnwise.scale_inv, None, backend,
        )
    else:
        ops.fp8_quantize_gathered_(
            x, index, m_splits, fp8_dtype, pow2_scales, amax_epsilon, row_data, row_scale_inv,
            None if columnwise is None else columnwise.data, None if columnwise is None else columnwise.scale_inv,
            backend,
        )
    return GroupedQuantized(row_buffers, columnwise, None)


def _address(tensor: Optional[torch.Tensor]) -> Optional[int]:
    return None if tensor is None else tensor.data_ptr()


@custom_op("fp8_quantize_gathered_", mutates_args=("row_data", "row_scale_inv", "data", "scale_inv"))
def _quantize_gathered_op(
    x: torch.Tensor,
    index: torch.Tensor,
    m_splits: Optional[torch.Tensor],
    fp8_dtype: torch.dtype,
    pow2_scales: bool,
    amax_epsilon: float,
    row_data: Optional[torch.Tensor],
    row_scale_inv: Optional[torch.Tensor],
    data: Optional[torch.Tensor],
    scale_inv: Optional[torch.Tensor],
    backend: str,
) -> None:
    if backend == "reference":
        rows = gather_rows(x, index)
        if row_data is not None:
            q = quantize_1x128(rows, fp8_dtype, pow2_scales, amax_epsilon)
            row_data.copy_(q.data)
            row_scale_inv.copy_(q.scale_inv)
        if m_splits is None:
            return
        counts = [int(c) for c in m_splits.tolist()]
        _checks._check_split_values(counts, rows.shape[0], exact=False)
        # Rows past the groups (a capacity's tail) are in no group: the layout of the groups'
        # rows alone is the prefix of the buffers', which are sized for every row.
        q = quantize_grouped_columnwise(rows[: sum(counts)], counts, fp8_dtype, pow2_scales, amax_epsilon)
        data[:, : q.data.shape[1]].copy_(q.data)
        scale_inv[: q.scale_inv.shape[0]].copy_(q.scale_inv)
        return
    function = _core_function(x, "mg_quantize_gathered_1x128")
    source_rows, cols = x.shape
    splits_ptr, splits_dtype, num_groups = None, _core.dtype_code(torch.int64), 0
    if m_splits is not None:
        splits_ptr, splits_dtype, num_groups = m_splits.data_ptr(), _core.dtype_code(m_splits.dtype), m_splits.shape[0]
    _core.check(
        function(
            x.data_ptr(), _core.dtype_code(x.dtype), source_rows, cols, index.data_ptr(), index.shape[0],
            splits_ptr, splits_dtype, num_groups, _config(fp8_dtype, pow2_scales, amax_epsilon),
            _address(row_data), _address(row_scale_inv), _address(data), _address(scale_inv),
            _core.device_index(x.device), _core.SLOT_WGRAD, _core.stream_handle(x.device),
        )
    )


@_quantize_gathered_op.register_fake
def _(x, index, m_splits, fp8_dtype, pow2_scales, amax_epsilon, row_data, row_scale_inv, data, scale_inv, backend):
    return None


def swiglu_quantize_rowwise(
    g: torch.Tensor,
    fp8_dtype: torch.dtype,
    pow2_scales: bool = True,
    amax_epsilon: float = 0.0,
    *,
    backend: Optional[str] = None,
) -> BlockQuantized:
    """``h = swiglu(g)`` ([rows, ffn] from g [rows, 2 * ffn], gate then up) quantized row-wise in 1x128 blocks.

    Bitwise ``quantize_rowwise(swiglu(g))`` with h rounded to g's dtype as
    :func:`moe_grouped.activation.swiglu` stores it; on the ``cuda`` backend one
    kernel that never stores h (ffn a multiple of 16).
    """
    _checks.check_tensor("g", g, dim=2, dtypes=_INPUT_DTYPES)
    check_quantize_options(fp8_dtype, pow2_scales, amax_epsilon)
    rows, width = g.shape
    if width % 2:
        raise ValueError(f"g must have an even number of columns [rows, 2 * ffn], got {tuple(g.shape)}")
    ffn = width // 2
    backend = _backend_of(g, backend)
    if backend == "cuda" and ffn % 16:
        raise ValueError(f"the cuda kernel needs ffn to be a multiple of 16, got {ffn}")
    return swiglu_quantize_rows(g, fp8_dtype, pow2_scales, float(amax_epsilon), backend)


def swiglu_quantize_rows(
    g: torch.Tensor, fp8_dtype: torch.dtype, pow2_scales: bool, amax_epsilon: float, backend: str
) -> BlockQuantized:
    """:func:`swiglu_quantize_rowwise` without its argument checks (for the FP8 stages, as
    :func:`quantize_rows`; the core still refuses an ffn that is not a multiple of 16)."""
    rows, ffn = g.shape[0], g.shape[1] // 2
    out = new_block((rows, ffn), (rows, -(-ffn // BLOCK)), fp8_dtype, g.device)
    ops.fp8_quantize_rowwise_(g, fp8_dtype, pow2_scales, amax_epsilon, out.data, out.scale_inv, backend, True)
    return out
