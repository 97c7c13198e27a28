"""SwiGLU on the fused fc1 output: ``silu(gate) * up`` for ``h = [gate, up]``.

``h`` is split along its last dimension: the first half is the gate, the
second the up projection (Megatron's fused ``linear_fc1`` layout, what
:class:`moe_grouped.GroupedMLP`'s fc1 produces).

Backends:
- ``cuda``: the core's kernels (csrc/activation/swiglu.cu): one pass forward,
  one pass backward writing ``[d_gate, d_up]`` in place of a concatenation;
  only ``h`` is kept for the backward. They round to the element type exactly
  where the composed torch ops store a tensor, so they give torch's values.
- ``torch`` and ``reference``: ``silu(gate) * up`` composed from torch ops.

Default: ``cuda`` on Hopper with the core built with its activation kernels,
else the composed ops.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._ops import ops
from .. import _core, backends
from .._tensors import compute_dtype
from .cuda_backend import SUPPORTED_DTYPES
from .library import backend_module  # registers the torch.ops.moe_grouped SwiGLU ops


def cuda_unavailable_reason(device: torch.device) -> Optional[str]:
    """Why the ``cuda`` SwiGLU kernels cannot run on ``device``, or None if they can."""
    return backends.core_kernels_unavailable_reason(device, _core.CAP_SWIGLU, "SwiGLU kernels (csrc/activation)")


def resolve_backend(backend: Optional[str], device: torch.device) -> str:
    """The backend SwiGLU runs with: the one asked for (or a clear error), else the default."""
    return backends.resolve_kernel_family(backend, device, cuda_unavailable_reason, "SwiGLU")


def swiglu(h: torch.Tensor, *, backend: Optional[str] = None) -> torch.Tensor:
    """``silu(gate) * up`` for ``[gate, up] = h.chunk(2, dim=-1)``; differentiable.

    Args:
        h: [..., 2 * ffn] floating point (``cuda``: float32, float16 or bfloat16).
        backend: ``"reference"``, ``"torch"``, ``"cuda"`` or None (default).

    Returns:
        [..., ffn], ``h``'s dtype.
    """
    if not isinstance(h, torch.Tensor):
        raise TypeError(f"h must be a torch.Tensor, got {type(h).__name__}")
    if not h.is_floating_point():
        raise TypeError(f"h must be a floating-point tensor, got {h.dtype}")
    if h.dim() == 0 or h.shape[-1] % 2 != 0:
        raise ValueError(
            f"h must have an even last dimension ([..., 2 * ffn]: gate and up), got shape {tuple(h.shape)}"
        )
    name = resolve_backend(backend, h.device)
    if name == "cuda":
        if h.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"the cuda SwiGLU kernels take float32, float16 or bfloat16, got {h.dtype}")
        if h.numel() > 0:
            flat = h.reshape(-1, h.shape[-1])
            return ops.swiglu(flat).reshape(*h.shape[:-1], h.shape[-1] // 2)
        # An empty h has nothing to compute: the composed ops give the (empty, differentiable) result,
        # where the kernel's [-1, width] view of zero elements would be ambiguous.
        name = "torch"
    return backend_module(name).swiglu(h)


# ---- the weighted SwiGLU backward of the fused experts path ------------------
#
# One pass per permuted row r with routing weight w (see
# csrc/activation/swiglu_weighted_backward.cu): from dh_u (fc2's dgrad of the
# unweighted output gradient) and g = [gate | up] (fc1's output), with
# h = silu(gate) * up:
#   dg = SwiGLU backward of w * dh_u,   wh = w * h,   dprob = <dh_u, h>.
# Rows at or past the clamped sum of m_splits get zeros.


def weighted_backward_unavailable_reason(device: torch.device) -> Optional[str]:
    """Why the ``cuda`` weighted SwiGLU backward cannot run on ``device``, or None if it can."""
    reason = cuda_unavailable_reason(device)
    if reason is None and not hasattr(_core.lib, "mg_swiglu_weighted_backward"):
        reason = f"the core at {_core.library_path} predates mg_swiglu_weighted_backward; rebuild the package"
    return reason


def resolve_weighted_backward_backend(backend: Optional[str], device: torch.device) -> str:
    """The backend the weighted SwiGLU backward runs with (see :func:`resolve_backend`)."""
    return backends.resolve_kernel_family(
        backend, device, weighted_backward_unavailable_reason, "the weighted SwiGLU backward"
    )


def swiglu_weighted_backward(
    dh_u: torch.Tensor,
    g: torch.Tensor,
    weights: Optional[torch.Tensor] = None,
    m_splits: Optional[torch.Tensor] = None,
    *,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dg, wh, dprob)`` for rows of fc1 outputs ``g`` and unweighted fc2 input gradients ``dh_u``.

    Per row r with weight ``w = weights[r]`` (1 without weights) and
    ``h = silu(gate) * up`` for ``[gate, up] = g[r].chunk(2)``:
    ``dg[r]`` is the SwiGLU backward of ``w * dh_u[r]``, ``wh[r] = w * h`` and
    ``dprob[r] = <dh_u[r], h>`` (the gradient of w when the expert output is
    ``w * fc2(h)``). Rows at or past the sum of ``m_splits`` (a device tensor;
    None: every row) are zero in all three.

    Args:
        dh_u: [rows, ffn]; g: [rows, 2 * ffn], same dtype (``cuda``: bfloat16,
            float16 or float32).
        weights: [rows] float32 (float64 for float64 inputs) or None.
        m_splits: [E] int32/int64 rows per expert, on the device, or None.
        backend: ``"reference"``, ``"torch"``, ``"cuda"`` or None (default).

    Returns:
        ``dg`` [rows, 2 * ffn] and ``wh`` [rows, ffn] in g's dtype, ``dprob``
        [rows] float32 (float64 for float64 inputs), summed in that precision.
    """
    _check_weighted_backward_args(dh_u, g, weights, m_splits)
    name = resolve_weighted_backward_backend(backend, g.device)
    if name == "cuda" and g.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"the cuda weighted SwiGLU backward takes float32, float16 or bfloat16, got {g.dtype}")
    return ops.swiglu_weighted_backward(dh_u, g, weights, m_splits, name)


def _check_weighted_backward_args(dh_u, g, weights, m_splits) -> None:
    for what, tensor in (("dh_u", dh_u), ("g", g)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 or not tensor.is_floating_point():
            raise ValueError(f"{what} must be a 2-D floating-point tensor, got {_describe(tensor)}")
    if g.shape != (dh_u.shape[0], 2 * dh_u.shape[1]) or g.dtype != dh_u.dtype or g.device != dh_u.device:
        raise ValueError(
            f"g must have shape [rows, 2 * ffn] = {(dh_u.shape[0], 2 * dh_u.shape[1])} and dh_u's dtype "
            f"{dh_u.dtype} on {dh_u.device}, got {_describe(g)}"
        )
    if weights is not None and (
        not isinstance(weights, torch.Tensor) or weights.shape != (g.shape[0],)
        or weights.dtype != compute_dtype(g.dtype) or weights.device != g.device
    ):
        raise ValueError(
            f"weights must be a [{g.shape[0]}] {compute_dtype(g.dtype)} tensor on {g.device}, got "
            f"{_describe(weights)}"
        )
    if m_splits is not None and (
        not isinstance(m_splits, torch.Tensor) or m_splits.dim() != 1 or m_splits.numel() == 0
        or m_splits.dtype not in (torch.int32, torch.int64) or m_splits.device != g.device
    ):
        raise ValueError(f"m_splits must be a non-empty 1-D int32/int64 tensor on {g.device}, got {_describe(m_splits)}")


def _describe(tensor) -> str:
    if not isinstance(tensor, torch.Tensor):
        return type(tensor).__name__
    return f"shape {tuple(tensor.shape)}, dtype {tensor.dtype} on {tensor.device}"


__all__ = [
    "swiglu",
    "swiglu_weighted_backward",
    "resolve_backend",
    "resolve_weighted_backward_backend",
    "cuda_unavailable_reason",
    "weighted_backward_unavailable_reason",
    "backend_module",
]
