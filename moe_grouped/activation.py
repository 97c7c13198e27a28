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
    if resolve_backend(backend, h.device) != "cuda":
        gate, up = h.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up
    if h.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"the cuda SwiGLU kernels take float32, float16 or bfloat16, got {h.dtype}")
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
