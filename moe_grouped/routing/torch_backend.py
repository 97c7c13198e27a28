"""The ``torch`` routing backend: the gate GEMM ``x W^T`` in float32 on tensor cores, for bf16 CUDA inputs.

The router wants float32 logits (top-k ties and softmax are sensitive to
rounding), and ``linear(x.float(), W.float())`` gives them but runs three
float32 GEMMs on CUDA cores (forward, dx, dW), a visible part of a layer
step (docs/routing.md). With bf16 ``x`` and ``W`` the tensor cores do the
same work with the same accuracy:

- forward: ``mm(x, W^T, out_dtype=float32)``. bf16 times bf16 is exact in
  float32 and the products are summed in float32, which is what the float32
  GEMM of the converted operands computes (up to summation order).
- backward: the logits' gradient ``d`` is float32. It is split as
  ``d = hi + lo`` with ``hi = bf16(d)`` and ``lo = bf16(d - hi)`` (16
  significant bits, relative error below 2^-16), and the two halves go
  through one bf16 GEMM each way with float32 accumulation:
  ``dx = [hi | lo] [W; W]`` and ``dW = [hi | lo]^T x`` (the two [E, H]
  halves added in float32). ``dx`` and ``dW`` are bf16, 8 significant bits,
  so what the split drops is 256 times below their own rounding.

Other dtypes (float16, whose range the split could underflow; float32;
float64) and CPU tensors use the reference's ``linear`` in the accumulation
dtype.
"""

from __future__ import annotations

import torch


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the tensor-core gate GEMM takes these inputs (bf16, on CUDA)."""
    return x.is_cuda and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16


def logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [T, H] @ weight [E, H]^T`` as float32 logits [T, E]; differentiable (bf16 ``x`` and ``weight``)."""
    return _BF16GateLogits.apply(x, weight)


def _split_bf16(d: torch.Tensor) -> torch.Tensor:
    """[T, E] float32 -> [T, 2E] bf16 ``[hi | lo]`` with ``hi + lo`` = ``d`` to 16 bits."""
    hi = d.to(torch.bfloat16)
    lo = (d - hi.float()).to(torch.bfloat16)
    return torch.cat([hi, lo], dim=1)


class _BF16GateLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return torch.mm(x, weight.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_logits: torch.Tensor):
        x, weight = ctx.saved_tensors
        halves = _split_bf16(grad_logits.contiguous())
        return gate_grads_from_halves(halves, x, weight, ctx.needs_input_grad[0], ctx.needs_input_grad[1])


def gate_grads_from_halves(halves: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, need_x: bool,
                           need_weight: bool):
    """(dx, dW) of ``logits = x W^T`` (None where not needed) from the logits'
    gradient as the bf16 halves ``[hi | lo]`` [T, 2E] of :func:`_split_bf16`."""
    grad_x = grad_weight = None
    if need_x:
        grad_x = torch.mm(halves, torch.cat([weight, weight], dim=0))
    if need_weight:
        both = torch.mm(halves.t(), x, out_dtype=torch.float32)
        num_experts = weight.shape[0]
        # The sum in float32, rounded once as it is stored: one kernel for the add and the cast.
        grad_weight = torch.empty_like(weight)
        torch.add(both[:num_experts], both[num_experts:], out=grad_weight)
    return grad_x, grad_weight
