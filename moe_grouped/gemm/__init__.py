"""Grouped (per-expert) linear algebra on token-major data, functional API.

Per expert e with ``m_e`` tokens (``sum(m_e) = M``, rows of each expert
contiguous and in expert order):

- :func:`grouped_fprop`: ``Y_e[m_e, N] = X_e[m_e, K] @ W_e[N, K].T (+ b_e)``
- :func:`grouped_dgrad`: ``dX_e[m_e, K] = dY_e[m_e, N] @ W_e[N, K]``
- :func:`grouped_wgrad`: ``dW_e[N, K] (+)= dY_e.T @ X_e``
- :func:`grouped_dbias`: ``db_e[N] = dY_e.sum(0)``
- :func:`splits_to_offsets`: group boundaries ``[0, m_0, m_0 + m_1, ...]``

``weights`` is a list: ``[W]`` with W of shape [E, N, K] (one grouped
parameter) or E tensors of shape [N, K]. ``m_splits`` is a device tensor
(int32 or int64; graph-safe, never read on the host) or a list of ints
(validated on the host). Each op runs on the backend named by ``backend``
(``"reference"``, ``"torch"`` or ``"cuda"``) or on the device's default.

Rows past the splits: a device ``m_splits`` may sum to fewer than the rows M
(a buffer sized for the worst case, e.g. ``permute`` with a capacity). The
rows at or past the sum belong to no expert: :func:`grouped_fprop` and
:func:`grouped_dgrad` return zeros there (bias or not), and
:func:`grouped_wgrad` and :func:`grouped_dbias` ignore them, so the input
gradient of those rows is zero too. The same on every backend, without a
host read. A list ``m_splits`` must sum to M exactly.

The ops are ``torch.library`` custom ops (``torch.ops.moe_grouped.*``) with
fake implementations, so meta tensors and torch.compile see their shapes.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .._ops import ops
from .. import _checks, backends
from .library import backend_module, check_backend_dtype

SplitsLike = _checks.SplitsLike

SLOT_FPROP_DGRAD = 0
SLOT_WGRAD = 1


def _prepare(
    name: str, tokens: torch.Tensor, weights: Sequence[torch.Tensor], m_splits: SplitsLike, backend
):
    _checks.check_tensor(name, tokens, dim=2)
    num_groups, n, k = _checks.check_weights(weights)
    first = weights[0]
    _checks.check_same_device(name, tokens, weights=first)
    if first.dtype != tokens.dtype:
        raise TypeError(f"{name} has dtype {tokens.dtype} but the weights have {first.dtype}")
    name = backends.resolve(backend, tokens.device)
    splits = _checks.normalize_splits(m_splits, num_groups, tokens.shape[0], tokens.device, backend=name)
    check_backend_dtype(name, tokens.dtype)
    return num_groups, n, k, splits, name


def grouped_fprop(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    m_splits: SplitsLike,
    bias: Optional[torch.Tensor] = None,
    *,
    out_dtype: Optional[torch.dtype] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """``y[M, N]``: each expert's rows of ``x[M, K]`` times its ``W_e.T``, plus ``bias[e]``.

    Differentiable in ``x``, ``weights`` and ``bias``.
    """
    _checks.check_out_dtype(out_dtype)
    num_groups, n, k, splits, name = _prepare("x", x, weights, m_splits, backend)
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features but the weights expect in_features={k}")
    if bias is not None:
        _checks.check_tensor("bias", bias, dim=2)
        _checks.check_same_device("x", x, bias=bias)
        if tuple(bias.shape) != (num_groups, n) or bias.dtype != x.dtype:
            raise ValueError(
                f"bias must have shape ({num_groups}, {n}) and dtype {x.dtype}, "
                f"got shape {tuple(bias.shape)} and dtype {bias.dtype}"
            )
    return ops.grouped_fprop(
        x, list(weights), splits, bias, out_dtype or x.dtype, name, True
    )


def grouped_dgrad(
    dy: torch.Tensor,
    weights: Sequence[torch.Tensor],
    m_splits: SplitsLike,
    *,
    out_dtype: Optional[torch.dtype] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """``dx[M, K]``: each expert's rows of ``dy[M, N]`` times its ``W_e``."""
    _checks.check_out_dtype(out_dtype)
    _, n, _, splits, name = _prepare("dy", dy, weights, m_splits, backend)
    if dy.shape[1] != n:
        raise ValueError(f"dy has {dy.shape[1]} features but the weights have out_features={n}")
    return ops.grouped_dgrad(dy, list(weights), splits, out_dtype or dy.dtype, name, True)


def grouped_wgrad(
    dy: torch.Tensor,
    x: torch.Tensor,
    m_splits: SplitsLike,
    *,
    out: Optional[Sequence[torch.Tensor]] = None,
    accumulate: bool = False,
    num_groups: Optional[int] = None,
    out_dtype: Optional[torch.dtype] = None,
    backend: Optional[str] = None,
) -> list[torch.Tensor]:
    """Per-expert ``dy_e.T @ x_e``, written into (or added to) ``out``.

    ``out`` has the weights' layout: ``[dW]`` with dW of shape [E, N, K], or E
    tensors [N, K] (e.g. fp32 ``main_grad`` buffers with ``accumulate=True``).
    Without ``out``, a new [E, N, K] tensor of ``out_dtype`` (default: dy's) is
    returned in a one-element list, and ``num_groups`` is required. Experts
    with no tokens get zeros, or are left untouched when accumulating.
    """
    _checks.check_tensor("dy", dy, dim=2)
    _checks.check_tensor("x", x, dim=2)
    _checks.check_same_device("dy", dy, x=x)
    _checks.check_out_dtype(out_dtype)
    if num_groups is not None:
        _checks.check_num_groups(num_groups)
    if not isinstance(accumulate, bool):
        raise TypeError(f"accumulate must be True or False, got {accumulate!r}")
    if dy.shape[0] != x.shape[0] or dy.dtype != x.dtype:
        raise ValueError(
            f"dy and x must have the same rows and dtype, got dy {tuple(dy.shape)} {dy.dtype} "
            f"and x {tuple(x.shape)} {x.dtype}"
        )
    if out is None:
        if num_groups is None:
            raise ValueError("grouped_wgrad needs num_groups when out is not given")
        if accumulate:
            raise ValueError("accumulate=True needs the tensors to accumulate into (out=...)")
        out = [dy.new_empty(num_groups, dy.shape[1], x.shape[1], dtype=out_dtype or dy.dtype)]
    out = list(out)
    groups, n, k = _checks.check_weights(out)
    _checks.check_same_device("dy", dy, out=out[0])
    if num_groups is not None and num_groups != groups:
        raise ValueError(f"num_groups={num_groups} but out holds {groups} experts")
    if (n, k) != (dy.shape[1], x.shape[1]):
        raise ValueError(
            f"out must hold [N, K] = [{dy.shape[1]}, {x.shape[1]}] per expert, got [{n}, {k}]"
        )
    name = backends.resolve(backend, dy.device)
    splits = _checks.normalize_splits(m_splits, groups, dy.shape[0], dy.device, backend=name)
    check_backend_dtype(name, dy.dtype)
    ops.grouped_wgrad_(dy, x, splits, out, accumulate, name)
    return out


def grouped_dbias(
    dy: torch.Tensor,
    m_splits: SplitsLike,
    *,
    num_groups: Optional[int] = None,
    out_dtype: Optional[torch.dtype] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """``[E, N]`` per-expert column sums of ``dy[M, N]`` (zeros for empty experts)."""
    _checks.check_tensor("dy", dy, dim=2)
    _checks.check_out_dtype(out_dtype)
    if num_groups is None:
        num_groups = _checks.groups_of_splits(m_splits)
    _checks.check_num_groups(num_groups)
    name = backends.resolve(backend, dy.device)
    splits = _checks.normalize_splits(m_splits, num_groups, dy.shape[0], dy.device, backend=name)
    check_backend_dtype(name, dy.dtype)
    return ops.grouped_dbias(dy, splits, num_groups, out_dtype or dy.dtype, name)


def splits_to_offsets(
    m_splits: SplitsLike, total_rows: int, *, device=None, backend: Optional[str] = None
) -> torch.Tensor:
    """Group boundaries ``[0, m_0, m_0 + m_1, ..., M]`` as int64, computed on the device.

    Counts are clamped like every kernel clamps them (negative as zero, none
    past ``total_rows``), so the result is safe to index with even when
    ``m_splits`` is wrong; it is exact when ``m_splits`` is valid.
    """
    if not isinstance(total_rows, int) or isinstance(total_rows, bool) or total_rows < 0:
        raise ValueError(f"total_rows must be a non-negative int, got {total_rows!r}")
    num_groups = _checks.groups_of_splits(m_splits)
    if device is None:
        device = m_splits.device if isinstance(m_splits, torch.Tensor) else torch.device("cpu")
    device = torch.device(device)
    if num_groups == 0:
        raise ValueError("m_splits must hold at least one expert's count")
    name = backends.resolve(backend, device)
    # Not backend=name: a same-device tensor is clamped, not refused, on every backend alike.
    splits = _checks.normalize_splits(m_splits, num_groups, total_rows, device)
    return ops.splits_to_offsets(splits, total_rows, name)


__all__ = [
    "grouped_fprop",
    "grouped_dgrad",
    "grouped_wgrad",
    "grouped_dbias",
    "splits_to_offsets",
    "backend_module",
]
