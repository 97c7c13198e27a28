"""Toy grouped ops for the graph tests: one correct, two deliberately broken.

``ToyGroupedScale`` computes ``y[r] = x[r] * scale[expert(r)]`` where rows are
grouped by expert (``m_splits`` tokens each, a device tensor). Like a grouped
GEMM it writes per-row metadata (row -> expert) with a "setup kernel" and
reads it in "consumer kernels": forward, dgrad and wgrad.

- ``scratch="persistent", wgrad_slot="separate"``: correct. Metadata lives in
  persistent buffers owned by the op, one slot per role (fprop, dgrad, wgrad),
  like moe_grouped's workspace manager.
- ``scratch="per_call"``: the TE PR 3038/3171 bug. The forward's metadata is a
  per-call ``torch.empty``; the backward reads it through a raw pointer (as a
  C++ op holding the ``void*`` would) after the Python reference died. In a
  graph pool shared by the forward and backward graphs, the backward's own
  per-call scratch gets the same block, so wgrad reads dgrad's metadata.
- ``wgrad_slot="shared"``: dgrad and wgrad share one persistent workspace.
  The backward enqueues both setups first, then both consumers (a batched
  setup launch), so the wgrad setup overwrites the dgrad metadata before the
  dgrad consumer reads it.

The dgrad metadata uses the reversed expert numbering (``E - 1 - e`` with
``scale.flip(0)``), so reading the wrong metadata gives wrong numbers.
Every kernel is deterministic (no atomics), so correct runs are bitwise equal.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn


class _RawPointer:
    """A non-owning view of a CUDA int64 tensor: what a C++ op keeps as a ``void*``."""

    def __init__(self, tensor: torch.Tensor):
        self.__cuda_array_interface__ = {
            "shape": tuple(tensor.shape),
            "typestr": "<i8",
            "data": (tensor.data_ptr(), False),
            "version": 3,
            "strides": None,
        }


def _row_experts(m_splits: torch.Tensor, rows: int, reverse: bool = False) -> torch.Tensor:
    """Row -> expert index (or ``E - 1 - expert`` when ``reverse``), without a host read."""
    num_experts = m_splits.numel()
    ids = torch.arange(num_experts, device=m_splits.device)
    if reverse:
        ids = num_experts - 1 - ids
    return torch.repeat_interleave(ids, m_splits.long(), output_size=rows)


class _ToyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, m_splits, scale, op):
        rows = x.shape[0]
        if op.scratch == "per_call":
            meta = _row_experts(m_splits, rows)  # per-call scratch: freed when forward returns
            ctx.meta = torch.as_tensor(_RawPointer(meta), device=x.device)  # non-owning
        else:
            meta = op.workspace("fprop", rows)
            meta.copy_(_row_experts(m_splits, rows))
            ctx.meta = meta
        ctx.op = op
        ctx.save_for_backward(x, m_splits, scale)
        return x * scale[meta]

    @staticmethod
    def backward(ctx, dy):
        x, m_splits, scale = ctx.saved_tensors
        op, rows = ctx.op, x.shape[0]
        num_experts = scale.shape[0]
        if op.scratch == "per_call":
            dgrad_meta = _row_experts(m_splits, rows, reverse=True)  # per-call again
            wgrad_meta = ctx.meta
        else:
            dgrad_meta = op.workspace("dgrad", rows)
            wgrad_meta = op.workspace("dgrad" if op.wgrad_slot == "shared" else "wgrad", rows)
            # Batched setup: both setup kernels first, then both consumers.
            dgrad_meta.copy_(_row_experts(m_splits, rows, reverse=True))
            wgrad_meta.copy_(_row_experts(m_splits, rows))
        dx = dy * scale.flip(0)[dgrad_meta]
        onehot = torch.zeros(rows, num_experts, dtype=torch.float32, device=x.device)
        onehot.scatter_(1, wgrad_meta.unsqueeze(1), 1.0)
        dscale = (onehot.t() @ (dy.float() * x.float())).to(scale.dtype)
        return dx, None, dscale, None


class ToyGroupedScale(nn.Module):
    """``y = x * scale[expert(row)]``; see the module docstring for the variants."""

    def __init__(self, num_experts: int, features: int, max_tokens: int, *, scratch: str = "persistent",
                 wgrad_slot: str = "separate", device="cuda", dtype=torch.float32):
        super().__init__()
        if scratch not in ("persistent", "per_call") or wgrad_slot not in ("separate", "shared"):
            raise ValueError(f"unknown variant scratch={scratch!r}, wgrad_slot={wgrad_slot!r}")
        self.scratch, self.wgrad_slot, self.max_tokens = scratch, wgrad_slot, max_tokens
        self.scale = nn.Parameter(torch.randn(num_experts, features, device=device, dtype=dtype))
        self._workspaces = {
            role: torch.zeros(max_tokens, dtype=torch.int64, device=device) for role in ("fprop", "dgrad", "wgrad")
        }

    def workspace(self, role: str, rows: int) -> torch.Tensor:
        if rows > self.max_tokens:
            raise RuntimeError(f"workspace {role!r} holds {self.max_tokens} rows, {rows} needed")
        return self._workspaces[role][:rows]

    def forward(self, x: torch.Tensor, m_splits: torch.Tensor) -> torch.Tensor:
        return _ToyFunction.apply(x, m_splits, self.scale, self)


def twin(module: ToyGroupedScale, **variant) -> ToyGroupedScale:
    """A copy of ``module`` (same parameter values) in another variant."""
    kwargs = {"scratch": module.scratch, "wgrad_slot": module.wgrad_slot, **variant}
    out = ToyGroupedScale(module.scale.shape[0], module.scale.shape[1], module.max_tokens,
                          device=module.scale.device, dtype=module.scale.dtype, **kwargs)
    out.load_state_dict(module.state_dict())
    return out


@pytest.mark.gpu
def test_correct_toy_op_matches_a_float64_loop_eagerly():
    torch.manual_seed(0)
    op = ToyGroupedScale(4, 8, 64)
    splits = [5, 0, 20, 7]
    x = torch.randn(32, 8, device="cuda", requires_grad=True)
    dy = torch.randn(32, 8, device="cuda")
    y = op(x, torch.tensor(splits, device="cuda"))
    y.backward(dy)
    start, want_y, want_dx, want_ds = 0, [], [], torch.zeros(4, 8, dtype=torch.float64)
    for e, count in enumerate(splits):
        rows = slice(start, start + count)
        want_y.append(x[rows].double() * op.scale[e].double())
        want_dx.append(dy[rows].double() * op.scale[e].double())
        want_ds[e] = (dy[rows].double() * x[rows].double()).sum(0).cpu()
        start += count
    torch.testing.assert_close(y.double(), torch.cat(want_y))
    torch.testing.assert_close(x.grad.double(), torch.cat(want_dx))
    torch.testing.assert_close(op.scale.grad.double().cpu(), want_ds)


def test_toy_variants_are_checked():
    with pytest.raises(ValueError, match="unknown variant"):
        ToyGroupedScale(2, 2, 4, scratch="stack", device="cpu")
