"""Moving token rows between the ranks of an expert-parallel group.

Every transport implements the same two collectives for a
:class:`~moe_grouped.parallel.plan.RoutePlan` (``ep`` ranks, ``S`` rows per
(source, destination) pair):

- ``dispatch(rows, extra, plan)``: ``rows`` [T, W] (and optional ``extra``
  [T, X] int32) are this rank's tokens; rank d receives ``[ep * S, W]`` where
  row ``s * S + p`` is source s's p-th token for d (``plan.index[d, p]``) and
  rows past ``counts_s[d]`` are zero. Returns ``(out, out_extra)``.
- ``combine(rows, extra, plan)``: the reverse with a sum: ``rows`` [ep * S, H]
  (float) in dispatch's output layout; each token rank gets
  ``out[t] = sum over d = 0..ep-1 with pos[t, d] >= 0`` of rank d's row
  ``s * S + pos[t, d]``, accumulated in float32 (float64 for float64) in
  that order and rounded once, so every transport gives the same bits.
  ``extra`` [ep * S, X] (:func:`extra_dtype` of the routing weights) is
  summed alike. Returns ``(out, out_extra)``.

The backward of a dispatch is a combine of the gradient and vice versa
(:class:`DispatchFunction`, :class:`CombineFunction`).

Transports:

- ``peer`` (:mod:`.peer`): the core's kernels over peers' symmetric buffers
  within a node (NVLink); no host sync, capturable, the default.
- ``symm_mem``: torch's NVSHMEM ``all_to_all_vdev`` (device-side counts,
  capturable) with the rows packed before and placed after.
- ``padded_all_to_all``: NCCL (or gloo) ``all_to_all_single`` of every
  (source, destination) pair's S rows, padding included: fixed sizes, so
  capturable with NCCL; moves ``ep * S`` rows each way however few are real.
- ``all_to_all``: ``all_to_all_single`` with the counts read on the host; not
  capturable (it raises during capture). The reference, and the CPU path.

``local`` (one rank) is no transport: the layer runs its experts on its own
tokens directly.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .._tensors import gather_rows
from .plan import RoutePlan, extra_dtype

TRANSPORTS = ("auto", "peer", "symm_mem", "padded_all_to_all", "all_to_all", "local")


class CapacityOverflowError(RuntimeError):
    """Token copies did not fit a rank's receive buffers and were dropped."""


def capturing(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def sum_by_rank(parts: torch.Tensor, pos: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Each token's rows summed over ranks: ``parts`` [ep, S, W] (rank d's rows for this rank),
    ``pos`` [T, ep]; float32 in rank order, rounded once (the bits every transport gives)."""
    acc_dtype = torch.float64 if parts.dtype == torch.float64 else torch.float32
    acc = torch.zeros(pos.shape[0], parts.shape[2], dtype=acc_dtype, device=parts.device)
    for d in range(parts.shape[0]):
        acc = acc + gather_rows(parts[d], pos[:, d]).to(acc_dtype)
    return acc.to(out_dtype)


class Transport:
    """Dispatch and combine over ``ep_size`` ranks (see the module docstring).

    ``capturable``: whether both can run during CUDA graph capture.
    """

    name = "transport"
    capturable = False

    def __init__(self, group: Optional[dist.ProcessGroup], ep_size: int, segment_rows: int):
        self.group, self.ep_size, self.segment_rows = group, ep_size, segment_rows

    def dispatch(self, rows: torch.Tensor, extra: Optional[torch.Tensor], plan: RoutePlan):
        raise NotImplementedError

    def combine(self, rows: torch.Tensor, extra: Optional[torch.Tensor], plan: RoutePlan):
        raise NotImplementedError

    def _check_plan(self, plan: RoutePlan) -> None:
        if plan.segment_rows != self.segment_rows or plan.ep_size != self.ep_size:
            raise ValueError(
                f"the plan has {plan.ep_size} ranks and {plan.segment_rows} rows a segment; this transport "
                f"{self.ep_size} and {self.segment_rows}"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ep_size={self.ep_size}, segment_rows={self.segment_rows})"


def _all_to_all_equal(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` cut into ``ep`` equal chunks, chunk r to rank r; the chunks received, by source."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


class PaddedAllToAllTransport(Transport):
    """``all_to_all_single`` of every pair's ``S`` rows, padding included (NCCL or gloo).

    The sent chunk for rank d is ``rows[plan.index[d]]`` (zero rows past the
    count), which is exactly the receiver's layout, so dispatch is one gather
    and one fixed-size collective; combine is the collective back and the sum.
    Nothing is read on the host, so NCCL captures it.
    """

    name = "padded_all_to_all"
    capturable = True

    def dispatch(self, rows, extra, plan):
        self._check_plan(plan)
        index = plan.index.reshape(-1)
        out = _all_to_all_equal(gather_rows(rows, index), self.group)
        out_extra = None if extra is None else _all_to_all_equal(gather_rows(extra, index), self.group)
        return out, out_extra

    def combine(self, rows, extra, plan):
        self._check_plan(plan)
        ep, S = self.ep_size, self.segment_rows
        back = _all_to_all_equal(rows, self.group).view(ep, S, -1)
        out = sum_by_rank(back, plan.pos, rows.dtype)
        out_extra = None
        if extra is not None:
            out_extra = sum_by_rank(_all_to_all_equal(extra, self.group).view(ep, S, -1), plan.pos, extra.dtype)
        return out, out_extra


class AllToAllTransport(Transport):
    """``all_to_all_single`` with the counts read on the host (NCCL or gloo): only real rows move.

    Not capturable: it synchronises to size the collectives. The reference
    for the capturable transports, and the CPU path.
    """

    name = "all_to_all"
    capturable = False

    def _refuse_capture(self, x: torch.Tensor) -> None:
        if capturing(x):
            raise RuntimeError(
                "the all_to_all transport reads the token counts on the host and cannot run during CUDA graph "
                "capture; use transport='peer', 'symm_mem' or 'padded_all_to_all'"
            )

    def _received(self, plan: RoutePlan) -> list[int]:
        """Rows each source sends this rank (exchanged once per plan)."""
        key = ("received", id(self))
        if key not in plan.cache:
            plan.cache[key] = _all_to_all_equal(plan.counts, self.group).tolist()
        return plan.cache[key]

    def _move(self, x: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
        got = x.new_empty(sum(recv_sizes), *x.shape[1:])
        dist.all_to_all_single(got, x.contiguous(), recv_sizes, send_sizes, group=self.group)
        return got

    def _place(self, got: torch.Tensor, recv_sizes: list[int]) -> torch.Tensor:
        """Packed rows by source into the [ep * S] layout, zeros past each source's count."""
        S = self.segment_rows
        out = got.new_zeros(self.ep_size * S, *got.shape[1:])
        start = 0
        for s, n in enumerate(recv_sizes):
            out[s * S : s * S + n] = got[start : start + n]
            start += n
        return out

    def dispatch(self, rows, extra, plan):
        self._check_plan(plan)
        self._refuse_capture(rows)
        send_sizes = plan.counts.tolist()
        recv_sizes = self._received(plan)
        sent = torch.cat([plan.index[d, :n] for d, n in enumerate(send_sizes)])
        out = self._place(self._move(rows[sent.to(torch.int64)], send_sizes, recv_sizes), recv_sizes)
        out_extra = None
        if extra is not None:
            out_extra = self._place(self._move(extra[sent.to(torch.int64)], send_sizes, recv_sizes), recv_sizes)
        return out, out_extra

    def _back(self, x: torch.Tensor, plan: RoutePlan) -> torch.Tensor:
        """Each source's rows returned to it; here, rank d's rows for this rank as [ep, S, W]."""
        S = self.segment_rows
        recv_sizes = self._received(plan)  # what each source sent here: what goes back to it
        send_sizes = plan.counts.tolist()  # what this rank sent each rank: what comes back
        packed = torch.cat([x[s * S : s * S + n] for s, n in enumerate(recv_sizes)])
        got = self._move(packed, recv_sizes, send_sizes)
        return self._place(got, send_sizes).view(self.ep_size, S, -1)

    def combine(self, rows, extra, plan):
        self._check_plan(plan)
        self._refuse_capture(rows)
        out = sum_by_rank(self._back(rows, plan), plan.pos, rows.dtype)
        out_extra = None if extra is None else sum_by_rank(self._back(extra, plan), plan.pos, extra.dtype)
        return out, out_extra


class SymmMemTransport(Transport):
    """torch's NVSHMEM ``all_to_all_vdev``: the counts stay on the device, capturable.

    Symmetric buffers are allocated in the constructor, a collective (every
    rank of ``group``, outside capture), sized for ``max_tokens`` rows out and
    ``ep * S`` rows in, of ``row_bytes + extra_bytes`` bytes: a token's row
    and its routes (or a returned row and its weight gradients) travel in one
    call as bytes. Rows are packed by destination before the call and placed
    into the [ep * S] layout after it (two gathers). Dispatch and combine use
    separate buffers and alternate on every rank (the layer's order); each
    call starts with a barrier of the group, so a peer writes a buffer again
    only after this rank has read it.
    """

    name = "symm_mem"
    capturable = True

    def __init__(self, group, ep_size: int, segment_rows: int, *, max_tokens: int, row_bytes: int,
                 extra_bytes: int, device: torch.device):
        super().__init__(group, ep_size, segment_rows)
        if ep_size < 2:
            raise ValueError("the symm_mem transport needs at least 2 ranks; one rank runs its experts locally")
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"the symm_mem transport runs on CUDA devices, got {device}")
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        if capturing(torch.empty(0, device=device)):
            raise RuntimeError("symmetric buffers cannot be allocated during CUDA graph capture")
        import torch.distributed._symmetric_memory as symm_mem

        if not symm_mem.is_nvshmem_available():
            raise RuntimeError("the symm_mem transport needs NVSHMEM, which this torch cannot load")
        if symm_mem.get_backend(device) != "NVSHMEM":
            symm_mem.set_backend("NVSHMEM")
        self.group_name = group.group_name
        rows = max(max_tokens, ep_size * segment_rows)
        self.width = row_bytes + extra_bytes

        def symmetric(*shape, dtype):
            buffer = symm_mem.empty(*shape, dtype=dtype, device=device)
            symm_mem.rendezvous(buffer, self.group_name)
            return buffer

        with torch.cuda.device(device):
            self.buffers = {
                kind: (symmetric(rows, self.width, dtype=torch.uint8), symmetric(rows, self.width, dtype=torch.uint8),
                       symmetric(ep_size, dtype=torch.int64), symmetric(2, ep_size, dtype=torch.int64))
                for kind in ("dispatch", "combine")
            }

    def _exchange(self, kind: str, parts: list, send_index: torch.Tensor, splits: torch.Tensor, S: int) -> list:
        """``parts``' rows ``send_index`` (packed by destination, ``splits`` each) to their ranks, as one
        row of bytes each; returns the parts received, in the [ep * S] layout (zeros past each count)."""
        send, recv, in_splits, out_splits = self.buffers[kind]
        rows, column, views = send_index.shape[0], 0, []
        for part in parts:
            as_bytes = part.contiguous().view(torch.uint8).view(part.shape[0], -1)
            width = as_bytes.shape[1]
            if column + width > self.width:
                raise ValueError(f"rows of {column + width} bytes exceed the symmetric buffers' {self.width}")
            send[:rows, column : column + width].copy_(gather_rows(as_bytes, send_index))
            views.append((column, width, part))
            column += width
        in_splits.copy_(splits)
        torch.ops.symm_mem.all_to_all_vdev(send, recv, in_splits, out_splits, self.group_name)
        p = torch.arange(S, device=recv.device)
        src = torch.where(p < out_splits[0].unsqueeze(1), out_splits[1].unsqueeze(1) + p, -1).reshape(-1)
        placed = gather_rows(recv[:, :column], src)
        if kind == "dispatch":
            self.received = out_splits[0].clone()  # rows each source sent here: what goes back to it
        return [placed[:, c : c + w].contiguous().view(part.dtype).view(-1, *part.shape[1:]) for c, w, part in views]

    def _packed_index(self, sizes: torch.Tensor, rows: int) -> torch.Tensor:
        """[rows]: for each row packed by rank (``sizes`` each), its row in the [ep * S] layout (-1 past them)."""
        ends = torch.cumsum(sizes, 0)
        r = torch.arange(rows, device=sizes.device)
        rank = torch.searchsorted(ends, r, right=True).clamp(max=self.ep_size - 1)
        inside = r - (ends - sizes)[rank]
        return torch.where(inside < sizes[rank], rank * self.segment_rows + inside, -1)

    def dispatch(self, rows, extra, plan):
        self._check_plan(plan)
        ep, S = self.ep_size, self.segment_rows
        counts = plan.counts.to(torch.int64)
        flat = self._packed_index(counts, ep * S)  # packed row -> row of plan.index
        send_index = torch.where(flat >= 0, gather_rows(plan.index.reshape(-1, 1), flat).view(-1), -1)
        parts = [rows] if extra is None else [rows, extra]
        got = self._exchange("dispatch", parts, send_index, counts, S)
        plan.cache[("received", id(self))] = self.received
        return got[0], (got[1] if extra is not None else None)

    def combine(self, rows, extra, plan):
        self._check_plan(plan)
        key = ("received", id(self))
        if key not in plan.cache:
            raise RuntimeError("symm_mem: combine needs the plan's dispatch first (it learns the received counts)")
        ep, S = self.ep_size, self.segment_rows
        from_source = plan.cache[key]
        parts = [rows] if extra is None else [rows, extra]
        back = self._exchange("combine", parts, self._packed_index(from_source, ep * S), from_source, S)
        out = sum_by_rank(back[0].view(ep, S, -1), plan.pos, rows.dtype)
        out_extra = None if extra is None else sum_by_rank(back[1].view(ep, S, -1), plan.pos, extra.dtype)
        return out, out_extra


class DispatchFunction(torch.autograd.Function):
    """``transport.dispatch`` of tokens and their routing weights; the backward is the combine.

    ``apply(tokens, weights, routes, plan, transport, decode)``: ``routes``
    [T, 2k] int32 travels as the dispatch's extra; ``decode(received_routes)``
    gives ``(local_experts, received_weights)``. Returns ``(received_tokens,
    received_weights, local_experts)``, differentiable in the first two.
    """

    @staticmethod
    def forward(ctx, tokens, weights, routes, plan: RoutePlan, transport: Transport, decode):
        received, received_routes = transport.dispatch(tokens, routes, plan)
        local_experts, received_weights = decode(received_routes)
        ctx.plan, ctx.transport, ctx.weights_dtype = plan, transport, weights.dtype
        ctx.mark_non_differentiable(local_experts)
        if not ctx.needs_input_grad[0]:  # the experts then skip the tokens' gradient (fc1's dgrad);
            ctx.mark_non_differentiable(received)  # backward gets zeros for it, combined for the weights
        return received, received_weights, local_experts

    @staticmethod
    def backward(ctx, grad_tokens, grad_weights, _):
        pending = ctx.plan.cache.pop("pending_combine", None)
        if pending is not None:  # started early, beside the experts' weight gradients
            dx, dw = pending()
        else:
            extra = None if grad_weights is None else grad_weights.to(extra_dtype(ctx.weights_dtype)).contiguous()
            dx, dw = ctx.transport.combine(grad_tokens.contiguous(), extra, ctx.plan)
        if not ctx.needs_input_grad[0]:
            dx = None
        return dx, (None if dw is None else dw.to(ctx.weights_dtype)), None, None, None, None


class CombineFunction(torch.autograd.Function):
    """``transport.combine`` of the experts' weighted outputs; the backward is the dispatch."""

    @staticmethod
    def forward(ctx, partial, plan: RoutePlan, transport: Transport):
        ctx.plan, ctx.transport = plan, transport
        out, _ = transport.combine(partial, None, plan)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad, _ = ctx.transport.dispatch(grad_out.contiguous(), None, ctx.plan)
        return grad, None, None


__all__ = [
    "TRANSPORTS",
    "Transport",
    "PaddedAllToAllTransport",
    "AllToAllTransport",
    "SymmMemTransport",
    "CapacityOverflowError",
    "DispatchFunction",
    "CombineFunction",
    "sum_by_rank",
]
