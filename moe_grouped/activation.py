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
from torch import nn

from . import _core, backends
from .graphs import nvtx

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
    on_cuda = resolve_backend(backend, h.device) == "cuda"
    if on_cuda and h.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"the cuda SwiGLU kernels take float32, float16 or bfloat16, got {h.dtype}")
    # An empty h has nothing to compute: the composed ops give the (empty, differentiable) result,
    # where the kernel's [-1, width] view of zero elements would be ambiguous.
    if not on_cuda or h.numel() == 0:
        gate, up = h.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up
    flat = h.reshape(-1, h.shape[-1])
    return torch.ops.moe_grouped.swiglu(flat).reshape(*h.shape[:-1], h.shape[-1] // 2)


def _rows_ffn(h: torch.Tensor) -> tuple[int, int]:
    return h.shape[0], h.shape[1] // 2


@torch.library.custom_op("moe_grouped::swiglu", mutates_args=())
def _swiglu_op(h: torch.Tensor) -> torch.Tensor:
    """[rows, 2 * ffn] -> [rows, ffn] with the core's forward kernel."""
    h = h.contiguous()
    rows, ffn = _rows_ffn(h)
    y = h.new_empty(rows, ffn)
    if y.numel() > 0:
        with nvtx.range("moe_grouped.swiglu"):
            _core.check(
                _core.require().mg_swiglu_forward(
                    h.data_ptr(), _core.dtype_code(h.dtype), rows, ffn, y.data_ptr(), _core.stream_handle(h.device)
                )
            )
    return y


@_swiglu_op.register_fake
def _(h):
    return h.new_empty(h.shape[0], h.shape[1] // 2)


@torch.library.custom_op("moe_grouped::swiglu_backward", mutates_args=())
def _swiglu_backward_op(dy: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """[d_gate, d_up] [rows, 2 * ffn] from dy [rows, ffn] with the core's backward kernel."""
    dy, h = dy.contiguous(), h.contiguous()
    rows, ffn = _rows_ffn(h)
    dh = torch.empty_like(h)
    if dh.numel() > 0:
        with nvtx.range("moe_grouped.swiglu_backward"):
            _core.check(
                _core.require().mg_swiglu_backward(
                    dy.data_ptr(), h.data_ptr(), _core.dtype_code(h.dtype), rows, ffn, dh.data_ptr(),
                    _core.stream_handle(h.device),
                )
            )
    return dh


@_swiglu_backward_op.register_fake
def _(dy, h):
    return torch.empty_like(h)


def _setup_context(ctx, inputs, output):
    (h,) = inputs
    ctx.save_for_backward(h)


def _backward(ctx, grad):
    (h,) = ctx.saved_tensors
    return torch.ops.moe_grouped.swiglu_backward(grad, h)


_swiglu_op.register_autograd(_backward, setup_context=_setup_context)


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
    return torch.ops.moe_grouped.swiglu_weighted_backward(dh_u, g, weights, m_splits, name)


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
        or weights.dtype != _accumulation_dtype(g.dtype) or weights.device != g.device
    ):
        raise ValueError(
            f"weights must be a [{g.shape[0]}] {_accumulation_dtype(g.dtype)} tensor on {g.device}, got "
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


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _weighted_backward_composed(dh_u, g, weights, real_rows):
    """The composed torch ops, rounding where the kernel rounds; rows past ``real_rows``
    (an int, or a 0-dim device tensor for no host sync) are zero."""
    dtype, acc = g.dtype, _accumulation_dtype(g.dtype)
    ffn = dh_u.shape[1]
    gate_stored = g[:, :ffn]
    gate, up = gate_stored.to(acc), g[:, ffn:].to(acc)
    a = nn.functional.silu(gate_stored).to(acc)  # rounded like the forward's silu
    h = (a * up).to(dtype).to(acc)  # the forward's stored h
    du = dh_u.to(acc)
    w = weights.to(acc).unsqueeze(-1) if weights is not None else torch.ones((), dtype=acc, device=g.device)
    dprob = (du * h).sum(-1)
    wh = (w * h).to(dtype)
    d = (w * du).to(dtype).to(acc)
    s = torch.sigmoid(gate)
    d_a = (d * up).to(dtype).to(acc)
    dg = torch.cat([(d_a * s * (1 + gate * (1 - s))).to(dtype), (d * a).to(dtype)], dim=-1)
    real = (torch.arange(g.shape[0], device=g.device) < real_rows).unsqueeze(-1)
    return torch.where(real, dg, 0), torch.where(real, wh, 0), torch.where(real.squeeze(-1), dprob, 0)


def _weighted_backward_into(dh_u, g, weights, m_splits, dg, wh, dprob, backend: str) -> None:
    """Writes the three results into ``dg``, ``wh``, ``dprob`` (which may be ``g``, ``dh_u``: in place)."""
    rows, ffn = dh_u.shape
    if backend != "cuda":
        if m_splits is None:
            real_rows = rows
        elif backend == "reference":  # reads the counts on the host, the plain way
            if m_splits.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "the reference backend reads m_splits on the host and cannot run during CUDA graph "
                    "capture; use backend='torch' or backend='cuda'"
                )
            real_rows = min(sum(max(0, min(int(c), rows)) for c in m_splits.tolist()), rows)
        else:  # the clamped sum, on the device
            real_rows = m_splits.to(torch.int64).clamp(0, rows).sum().clamp(max=rows)
        results = _weighted_backward_composed(dh_u, g, weights, real_rows)
        for out, result in zip((dg, wh, dprob), results):
            out.copy_(result)
        return
    if rows == 0:
        return
    with nvtx.range("moe_grouped.swiglu_weighted_backward"):
        _core.check(
            _core.require().mg_swiglu_weighted_backward(
                dh_u.data_ptr(), g.data_ptr(), None if weights is None else weights.data_ptr(),
                None if m_splits is None else m_splits.data_ptr(),
                _core.dtype_code(m_splits.dtype if m_splits is not None else torch.int64),
                0 if m_splits is None else m_splits.shape[0],
                _core.dtype_code(g.dtype), rows, ffn, dg.data_ptr(), wh.data_ptr(), dprob.data_ptr(),
                _core.stream_handle(g.device),
            )
        )


@torch.library.custom_op("moe_grouped::swiglu_weighted_backward", mutates_args=())
def _swiglu_weighted_backward_op(
    dh_u: torch.Tensor, g: torch.Tensor, weights: Optional[torch.Tensor], m_splits: Optional[torch.Tensor], backend: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dg, wh, dprob) in new tensors."""
    dh_u, g = dh_u.contiguous(), g.contiguous()
    weights = None if weights is None else weights.contiguous()
    dg, wh = torch.empty_like(g), torch.empty_like(dh_u)
    dprob = g.new_empty(g.shape[0], dtype=_accumulation_dtype(g.dtype))
    _weighted_backward_into(dh_u, g, weights, m_splits, dg, wh, dprob, backend)
    return dg, wh, dprob


@_swiglu_weighted_backward_op.register_fake
def _(dh_u, g, weights, m_splits, backend):
    return torch.empty_like(g), torch.empty_like(dh_u), g.new_empty(g.shape[0], dtype=_accumulation_dtype(g.dtype))


@torch.library.custom_op("moe_grouped::swiglu_weighted_backward_", mutates_args=("dh_u", "g", "dprob"))
def _swiglu_weighted_backward_inplace_op(
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
    Bumps the version of ``g``, so a second backward through a graph that
    saved ``g`` fails loudly instead of reading dg.
    """
    if not (dh_u.is_contiguous() and g.is_contiguous()):
        raise ValueError("swiglu_weighted_backward_ works in place and needs contiguous dh_u and g")
    weights = None if weights is None else weights.contiguous()
    _weighted_backward_into(dh_u, g, weights, m_splits, g, dh_u, dprob, backend)


@_swiglu_weighted_backward_inplace_op.register_fake
def _(dh_u, g, weights, m_splits, dprob, backend):
    return None
