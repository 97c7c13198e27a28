"""Token permutation for MoE layers: dispatch (:func:`permute`) and combine (:func:`unpermute`).

Token copy ``i = t * top_k + j`` is token t's j-th routing choice. ``permute``
sorts the ``T * top_k`` copies by expert into a buffer of static size
[T * top_k, H] — rows ordered by (expert, token), a stable and deterministic
order — and returns the tokens per expert as a device tensor, so the expert
GEMMs and everything after them need no host sync. ``unpermute`` sums each
token's copies back, weighted by the routing weights.

Both are differentiable: the gradient of ``permute`` sums each token's copies
(an unweighted unpermute), the gradient of ``unpermute`` scatters the weighted
output gradient back to the copies and gives the weights the dot products of
the copies with it.

Backends: ``reference`` (loops; reads the routing on the host), ``torch``
(stable argsort and index ops; graph-safe), ``cuda`` (the core's kernels;
graph-safe). Default: ``cuda`` on Hopper with the core built with its
permute kernels, ``torch`` on other GPUs, ``reference`` on the CPU.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _checks, _core
from ._permute.library import backend_module  # registers the torch.ops.moe_grouped permute ops

INDEX_DTYPES = (torch.int32, torch.int64)


def cuda_unavailable_reason(device: torch.device) -> Optional[str]:
    """Why the ``cuda`` permute kernels cannot run on ``device``, or None if they can."""
    if device.type != "cuda":
        return f"the cuda backend needs CUDA tensors, got tensors on {device}"
    if not _core.available():
        return _core.unavailable_reason
    if not _core.has(_core.CAP_PERMUTE):
        return "the core was built without its permute kernels (csrc/permute)"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"the core's kernels are built for sm_90a (Hopper), but this GPU is sm_{major}{minor}"
    return None


def resolve_backend(backend: Optional[str], device: torch.device) -> str:
    """The permutation backend to run on ``device``: the one asked for, or the default."""
    if backend not in (None, "reference", "torch", "cuda"):
        raise ValueError(f"backend must be 'reference', 'torch', 'cuda' or None (automatic), got {backend!r}")
    if backend is None:
        if device.type != "cuda":
            return "reference"
        return "cuda" if cuda_unavailable_reason(device) is None else "torch"
    if backend == "cuda":
        reason = cuda_unavailable_reason(device)
        if reason is not None:
            raise RuntimeError(f"backend 'cuda' was requested for permutation but is unavailable: {reason}")
    return backend


def _check_dtype(backend: str, dtype: torch.dtype) -> None:
    supported = backend_module(backend).SUPPORTED_DTYPES
    if dtype not in supported:
        names = ", ".join(str(d) for d in supported)
        raise TypeError(f"backend {backend!r} permutes dtypes ({names}), got {dtype}")


def permute(
    tokens: torch.Tensor, experts: torch.Tensor, num_experts: int, *, backend: Optional[str] = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorts the token copies by expert.

    Args:
        tokens: [T, H] float tensor.
        experts: [T, top_k] int32/int64 expert indices in [0, num_experts)
            (e.g. :attr:`moe_grouped.RoutingOutput.experts`).
        num_experts: E.
        backend: ``"reference"``, ``"torch"``, ``"cuda"`` or None (default).

    Returns:
        ``(permuted, m_splits, row_id_map)``: ``permuted`` [T * top_k, H] with
        expert 0's copies first (in token order), then expert 1's, ...;
        ``m_splits`` [E] int64 copies per expert, on the device;
        ``row_id_map`` [T * top_k] int64, the row of copy ``t * top_k + j`` in
        ``permuted`` (pass it to :func:`unpermute`).
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
    _checks.check_same_device("tokens", tokens, experts=experts)
    name = resolve_backend(backend, tokens.device)
    _check_dtype(name, tokens.dtype)
    experts = experts.contiguous()
    top_k = experts.shape[1]
    row_id_map, m_splits = torch.ops.moe_grouped.permute_index(experts, num_experts, name)
    permuted = torch.ops.moe_grouped.permute_rows(tokens, row_id_map, top_k, name)
    return permuted, m_splits, row_id_map


def unpermute(
    permuted: torch.Tensor,
    row_id_map: torch.Tensor,
    weights: Optional[torch.Tensor] = None,
    *,
    top_k: Optional[int] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Combines the copies back per token: ``out[t] = sum_j weights[t, j] * permuted[row_id_map[t*k + j]]``.

    Args:
        permuted: [T * top_k, H] rows in :func:`permute`'s order (e.g. the
            experts' outputs).
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
    if row_id_map.dtype != torch.int64 or tuple(row_id_map.shape) != (permuted.shape[0],):
        raise ValueError(
            f"row_id_map must be an int64 tensor of shape ({permuted.shape[0]},) (one entry per permuted "
            f"row), got shape {tuple(row_id_map.shape)} and dtype {row_id_map.dtype}"
        )
    if weights is not None:
        _checks.check_tensor("weights", weights, dim=2)
        if weights.dtype not in (torch.float32, permuted.dtype):
            raise TypeError(f"weights must be float32 or permuted's dtype {permuted.dtype}, got {weights.dtype}")
        if top_k is not None and weights.shape[1] != top_k:
            raise ValueError(f"weights have {weights.shape[1]} choices per token but top_k={top_k}")
        top_k = weights.shape[1]
        if weights.shape[0] * top_k != permuted.shape[0]:
            raise ValueError(
                f"weights of shape {tuple(weights.shape)} cover {weights.shape[0] * top_k} copies but "
                f"permuted has {permuted.shape[0]} rows"
            )
    elif not isinstance(top_k, int) or top_k <= 0 or permuted.shape[0] % top_k != 0:
        raise ValueError(
            f"without weights, top_k must be a positive int dividing the {permuted.shape[0]} permuted "
            f"rows, got {top_k!r}"
        )
    _checks.check_same_device("permuted", permuted, row_id_map=row_id_map, weights=weights)
    name = resolve_backend(backend, permuted.device)
    _check_dtype(name, permuted.dtype)
    return torch.ops.moe_grouped.unpermute_rows(permuted, row_id_map, weights, top_k, name)


__all__ = ["permute", "unpermute", "resolve_backend", "cuda_unavailable_reason"]
