"""Token permutation for MoE layers: dispatch (:func:`permute`) and combine (:func:`unpermute`).

Token copy ``i = t * top_k + j`` is token t's j-th routing choice. ``permute``
sorts the ``T * top_k`` copies by expert into a buffer of static size
[T * top_k, H] — rows ordered by (expert, token), a stable and deterministic
order — and returns the tokens per expert as a device tensor, so the expert
GEMMs and everything after them need no host sync. ``unpermute`` sums each
token's copies back, weighted by the routing weights.

With a ``capacity_factor`` (Megatron's token dropping), each expert takes at
most ``capacity = ceil(T * top_k / E * capacity_factor)`` copies; the others
are dropped — their ``row_id_map`` entry is -1 and they add 0 to the combine.
Which copies an expert keeps: those with the highest routing probability
(``drop_policy="probs"``) or the first in token order (``"position"``). The
buffer keeps a static size: ``min(T * top_k, E * capacity)`` rows, or exactly
``E * capacity`` with ``pad_to_capacity=True`` (expert e's rows start at
``e * capacity``, padding rows are zero, ``m_splits`` is ``capacity`` for
every expert). Everything stays on the device and can be captured.

Expert indices outside ``[0, E)``: where the indices can be read on the host
(the ``reference`` backend, or any backend with
:func:`moe_grouped.set_debug_checks` on, outside capture) ``permute`` raises
ValueError naming the first bad index and its token and slot. Elsewhere (the
``torch`` and ``cuda`` backends, capture) nothing reads or writes out of
bounds: such a copy is dropped exactly like one past an expert's capacity
(``row_id_map`` -1, not counted in ``m_splits``, adds 0 to the combine, zero
gradient). Without a capacity the rows those copies leave at the end of the
buffer (past ``sum(m_splits)``) belong to no expert; the ``cuda`` backend
does not zero them.

Both are differentiable: the gradient of ``permute`` sums each token's copies
(an unweighted unpermute), the gradient of ``unpermute`` scatters the weighted
output gradient back to the copies and gives the weights the dot products of
the copies with it. Dropped copies get zero gradient.

Backends: ``reference`` (loops; reads the routing on the host), ``torch``
(stable argsort and index ops; graph-safe), ``cuda`` (the core's kernels;
graph-safe; up to 4096 experts). Default: ``cuda`` on Hopper with the core
built with its permute kernels, ``torch`` on other GPUs, ``reference`` on the
CPU.
"""

from __future__ import annotations

from typing import Optional

import math

import torch

from .._ops import ops
from .. import _checks, _core, backends
from .library import backend_module  # registers the torch.ops.moe_grouped permute ops

INDEX_DTYPES = (torch.int32, torch.int64)
DROP_POLICIES = ("probs", "position")
CUDA_MAX_EXPERTS = 4096  # the cuda index kernels' limit (csrc/permute/permute.cu)


def cuda_unavailable_reason(device: torch.device) -> Optional[str]:
    """Why the ``cuda`` permute kernels cannot run on ``device``, or None if they can."""
    return backends.core_kernels_unavailable_reason(device, _core.CAP_PERMUTE, "permute kernels (csrc/permute)")


def resolve_backend(backend: Optional[str], device: torch.device) -> str:
    """The permutation backend to run on ``device``: the one asked for, or the default."""
    return backends.resolve_kernel_family(backend, device, cuda_unavailable_reason, "permutation")


def _check_dtype(backend: str, dtype: torch.dtype) -> None:
    supported = backend_module(backend).SUPPORTED_DTYPES
    if dtype not in supported:
        names = ", ".join(str(d) for d in supported)
        raise TypeError(f"backend {backend!r} permutes dtypes ({names}), got {dtype}")


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Copies one expert may take: ``ceil(num_tokens * top_k / num_experts * capacity_factor)``.

    Megatron's ``get_capacity`` with ``num_tokens * top_k`` token copies (the
    same float arithmetic, so the same capacity).
    """
    for name, value in (("num_tokens", num_tokens), ("top_k", top_k), ("num_experts", num_experts)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if num_experts == 0:
        raise ValueError("num_experts must be positive, got 0")
    _check_capacity_factor(capacity_factor)
    return math.ceil(num_tokens * top_k / num_experts * capacity_factor)


def check_drop_options(capacity_factor: Optional[float], drop_policy: str, pad_to_capacity: bool) -> None:
    """The token-dropping options of :func:`permute` (and MoELayer), checked before anything runs."""
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
    if capacity_factor is not None:
        _check_capacity_factor(capacity_factor)
    elif pad_to_capacity:
        raise ValueError("pad_to_capacity=True needs a capacity_factor")


def _check_capacity_factor(capacity_factor) -> None:
    if (
        not isinstance(capacity_factor, (int, float))
        or isinstance(capacity_factor, bool)
        or not math.isfinite(capacity_factor)
        or capacity_factor < 0
    ):
        raise ValueError(f"capacity_factor must be a finite number >= 0 or None, got {capacity_factor!r}")


def _check_experts_in_range(experts: torch.Tensor, num_experts: int) -> None:
    """ValueError naming the first expert index outside [0, num_experts); reads them on the host.

    Skipped during capture (the read cannot be captured): the kernels drop such copies.
    Under torch.compile, where the read cannot be traced either, an assert on the device.
    """
    if torch.compiler.is_compiling():
        valid = ((experts >= 0) & (experts < num_experts)).all()
        torch._assert_async(valid, f"moe_grouped: an expert index is outside [0, {num_experts})")
        return
    if experts.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    bad = ((experts < 0) | (experts >= num_experts)).nonzero()
    if bad.shape[0]:
        t, j = bad[0].tolist()
        raise ValueError(
            f"experts[{t}, {j}] = {int(experts[t, j])} is outside [0, {num_experts}) "
            f"(num_experts={num_experts}); {bad.shape[0]} expert index(es) out of range"
        )


def _check_rows_in_range(row_id_map: torch.Tensor, num_rows: int) -> None:
    """ValueError naming the first row_id_map entry outside [-1, num_rows); reads it on the host
    (under torch.compile, which cannot trace the read, an assert on the device)."""
    if torch.compiler.is_compiling():
        valid = ((row_id_map >= -1) & (row_id_map < num_rows)).all()
        torch._assert_async(valid, f"moe_grouped: a row_id_map entry is outside [-1, {num_rows})")
        return
    if row_id_map.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    bad = ((row_id_map < -1) | (row_id_map >= num_rows)).nonzero()
    if bad.shape[0]:
        i = int(bad[0, 0])
        raise ValueError(
            f"row_id_map[{i}] = {int(row_id_map[i])} is outside [-1, {num_rows}) (permuted has {num_rows} "
            "rows); pass the row_id_map permute returned with these rows"
        )


def permuted_rows(
    num_tokens: int, top_k: int, num_experts: int, capacity: Optional[int], pad_to_capacity: bool = False
) -> int:
    """Rows of :func:`permute`'s buffer: static, known from the shapes alone."""
    copies = num_tokens * top_k
    if capacity is None:
        return copies
    return num_experts * capacity if pad_to_capacity else min(copies, num_experts * capacity)


def permute(
    tokens: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    *,
    probs: Optional[torch.Tensor] = None,
    capacity_factor: Optional[float] = None,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorts the token copies by expert, optionally dropping those past each expert's capacity.

    :func:`permute_index` followed by the gather of the rows.

    Args:
        tokens: [T, H] float tensor.
        experts: [T, top_k] int32/int64 expert indices in [0, num_experts)
            (e.g. :attr:`moe_grouped.RoutingOutput.experts`). An index
            outside it raises ValueError where the indices are read on the
            host (``reference`` backend, debug checks outside capture), and
            is a dropped copy elsewhere (see the module docstring).
        num_experts: E.
        probs: [T, top_k] routing probabilities of the chosen experts (e.g.
            :attr:`moe_grouped.RoutingOutput.weights`); needed only to drop by
            probability. Not differentiated through.
        capacity_factor: None (default): no dropping. A number >= 0: each
            expert keeps at most :func:`expert_capacity` copies.
        drop_policy: with a capacity: ``"probs"`` keeps each expert's copies
            with the highest ``probs`` (ties: lower token first), ``"position"``
            its first copies in token order.
        pad_to_capacity: with a capacity: give every expert exactly
            ``capacity`` rows (zero padding), so the buffer has
            ``E * capacity`` rows and ``m_splits`` is ``capacity`` everywhere.
        backend: ``"reference"``, ``"torch"``, ``"cuda"`` or None (default).

    Returns:
        ``(permuted, m_splits, row_id_map)``: ``permuted`` [R, H] with expert
        0's copies first (in token order), then expert 1's, ..., where
        R = :func:`permuted_rows` (T * top_k without a capacity); rows no copy
        maps to are zero. ``m_splits`` [E] int64 rows per expert, on the
        device (without padding they sum to the kept copies, which may be
        fewer than R: the rows past them belong to no expert).
        ``row_id_map`` [T * top_k] int64, the row of copy ``t * top_k + j``
        in ``permuted``, -1 if it was dropped (pass it to :func:`unpermute`).
    """
    row_id_map, m_splits, rows = permute_index(
        tokens, experts, num_experts, probs=probs, capacity_factor=capacity_factor, drop_policy=drop_policy,
        pad_to_capacity=pad_to_capacity, backend=backend,
    )
    name = resolve_backend(backend, tokens.device)
    # Dropless, row_id_map is a permutation: every row gets a copy, none needs zeroing.
    permuted = ops.permute_rows(
        tokens, row_id_map, experts.shape[1], rows, capacity_factor is not None, name
    )
    return permuted, m_splits, row_id_map


def permute_index(
    tokens: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    *,
    probs: Optional[torch.Tensor] = None,
    capacity_factor: Optional[float] = None,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """:func:`permute`'s routing index without moving any row (e.g. for the fused experts path).

    Takes :func:`permute`'s arguments (``tokens`` only for its shape, dtype
    and device) and returns ``(row_id_map, m_splits, rows)``: the first two
    as :func:`permute` returns them, ``rows`` the static row count of its
    buffer (:func:`permuted_rows`).
    """
    _checks.check_tensor("tokens", tokens, dim=2)
    if not isinstance(experts, torch.Tensor):
        raise TypeError(f"experts must be a torch.Tensor, got {type(experts).__name__}")
    if experts.dtype not in INDEX_DTYPES or experts.dim() != 2 or experts.shape[0] != tokens.shape[0]:
        raise ValueError(
            f"experts must be an int32/int64 tensor of shape [{tokens.shape[0]}, top_k] (one row per "
            f"token), got shape {tuple(experts.shape)} and dtype {experts.dtype}"
        )
    if experts.shape[1] == 0:
        raise ValueError("experts must hold at least one choice per token (top_k >= 1), got top_k=0")
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts <= 0:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    check_drop_options(capacity_factor, drop_policy, pad_to_capacity)
    num_tokens, top_k = experts.shape
    capacity = None
    if capacity_factor is not None:
        capacity = expert_capacity(num_tokens, top_k, num_experts, capacity_factor)
        if drop_policy == "probs":
            if probs is None:
                raise ValueError(
                    "drop_policy='probs' needs probs, the [tokens, top_k] routing probabilities of the "
                    "chosen experts (RoutingOutput.weights); pass them or use drop_policy='position'"
                )
            _checks.check_tensor("probs", probs, dim=2)
            if tuple(probs.shape) != tuple(experts.shape):
                raise ValueError(
                    f"probs must have experts' shape {tuple(experts.shape)}, got {tuple(probs.shape)}"
                )
    _checks.check_same_device("tokens", tokens, experts=experts, probs=probs)
    name = index_backend(backend, tokens, num_experts)
    if name == "reference" or _checks.debug_checks_enabled():
        _check_experts_in_range(experts, num_experts)
    experts = experts.contiguous()
    by_probs = capacity is not None and drop_policy == "probs"
    priority = probs.detach().to(torch.float32).contiguous() if by_probs else None
    row_id_map, m_splits = ops.permute_index(
        experts, priority, num_experts, -1 if capacity is None else capacity, bool(pad_to_capacity), name
    )
    return row_id_map, m_splits, permuted_rows(num_tokens, top_k, num_experts, capacity, pad_to_capacity)


def index_backend(backend: Optional[str], tokens: torch.Tensor, num_experts: int) -> str:
    """The backend :func:`permute_index` runs for these tokens and experts, checked to take them."""
    name = resolve_backend(backend, tokens.device)
    _check_dtype(name, tokens.dtype)
    if name == "cuda" and num_experts > CUDA_MAX_EXPERTS:
        raise ValueError(
            f"the cuda permute kernels handle at most {CUDA_MAX_EXPERTS} experts, got num_experts="
            f"{num_experts}; use backend='torch'"
        )
    return name


def source_rows(row_id_map: torch.Tensor, top_k: int, num_rows: int) -> torch.Tensor:
    """[num_rows] int32: the token whose copy sits at each permuted row, -1 where none does.

    The inverse of ``row_id_map`` (copy ``t * top_k + j`` -> its permuted row,
    -1 when dropped), as :func:`permute_index` returns it with ``num_rows``:
    the index through which the gathered GEMMs (``torch.ops.moe_grouped.
    grouped_fprop_gathered`` and friends) read token rows in place of a
    permuted copy. No host sync (graph-safe); deterministic, since each kept
    row has one copy. One core call on CUDA (``mg_permute_source_rows``),
    torch ops elsewhere.
    """
    return ops.source_rows(row_id_map, top_k, num_rows)


def unpermute(
    permuted: torch.Tensor,
    row_id_map: torch.Tensor,
    weights: Optional[torch.Tensor] = None,
    *,
    top_k: Optional[int] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Combines the copies back per token: ``out[t] = sum_j weights[t, j] * permuted[row_id_map[t*k + j]]``.

    Copies with ``row_id_map`` -1 (dropped) add nothing. An entry outside
    ``[-1, R)`` raises ValueError where it is read on the host (``reference``
    backend, debug checks outside capture); the ``torch`` backend treats it as
    dropped; the ``cuda`` kernels trust it (pass the map ``permute`` returned).

    Args:
        permuted: [R, H] rows in :func:`permute`'s order (e.g. the experts'
            outputs).
        row_id_map: [T * top_k] int64 from :func:`permute`.
        weights: [T, top_k] routing weights, float32 or ``permuted``'s dtype;
            None sums the copies unweighted (then ``top_k`` is required).
        top_k: copies per token; taken from ``weights`` when given.
        backend: ``"reference"``, ``"torch"``, ``"cuda"`` or None (default).

    Returns:
        [T, H] in ``permuted``'s dtype, accumulated in float32 (float64 for
        float64 input).
    """
    _checks.check_tensor("permuted", permuted, dim=2)
    if not isinstance(row_id_map, torch.Tensor):
        raise TypeError(f"row_id_map must be a torch.Tensor, got {type(row_id_map).__name__}")
    if row_id_map.dtype != torch.int64 or row_id_map.dim() != 1:
        raise ValueError(
            "row_id_map must be a 1-D int64 tensor (one entry per token copy, from permute), got shape "
            f"{tuple(row_id_map.shape)} and dtype {row_id_map.dtype}"
        )
    if weights is not None:
        _checks.check_tensor("weights", weights, dim=2)
        if weights.dtype not in (torch.float32, permuted.dtype):
            raise TypeError(f"weights must be float32 or permuted's dtype {permuted.dtype}, got {weights.dtype}")
        if top_k is not None and weights.shape[1] != top_k:
            raise ValueError(f"weights have {weights.shape[1]} choices per token but top_k={top_k}")
        top_k = weights.shape[1]
        copies = weights.shape[0] * top_k
        if row_id_map.shape[0] != copies:
            raise ValueError(
                f"weights of shape {tuple(weights.shape)} cover {copies} copies but row_id_map has shape "
                f"{tuple(row_id_map.shape)}; pass permute's row_id_map, of shape ({copies},)"
            )
    elif not isinstance(top_k, int) or isinstance(top_k, bool) or top_k <= 0 or row_id_map.shape[0] % top_k:
        raise ValueError(
            f"without weights, top_k must be a positive int dividing the {row_id_map.shape[0]} entries of "
            f"row_id_map, got {top_k!r}"
        )
    _checks.check_same_device("permuted", permuted, row_id_map=row_id_map, weights=weights)
    name = resolve_backend(backend, permuted.device)
    _check_dtype(name, permuted.dtype)
    if name == "reference" or _checks.debug_checks_enabled():
        _check_rows_in_range(row_id_map, permuted.shape[0])
    return ops.unpermute_rows(permuted, row_id_map.contiguous(), weights, top_k, name)


__all__ = [
    "permute",
    "permute_index",
    "source_rows",
    "unpermute",
    "expert_capacity",
    "permuted_rows",
    "index_backend",
    "resolve_backend",
    "cuda_unavailable_reason",
]
