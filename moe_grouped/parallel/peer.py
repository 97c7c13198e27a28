"""The ``peer`` transport: the core's dispatch and combine kernels over symmetric buffers.

Each rank allocates one buffer of torch symmetric memory (collectively, once,
outside capture) and maps the peers' copies into its address space; the
core's kernels (``csrc/ep``) then read the peers' buffers directly over
NVLink. A call publishes what this rank sends into its own buffer (device
copies, stream-ordered), and one kernel crosses a barrier of the group
through flags in the buffers and pulls what this rank receives into a new
tensor: no host sync, no allocation in the buffers, capturable, and
deterministic (combine sums ranks in a fixed order in float32).

Regions of the buffer (the same offsets on every rank):

- ``state`` (this rank's barrier epoch) and ``flags`` (the epochs peers signalled);
- ``counts`` [ep] and ``index`` [ep, S]: the plan's rows for each destination;
- ``rows`` [max_tokens, row_bytes] and ``extra`` [max_tokens, extra_bytes]:
  the tokens (or output gradients) and their routes for a dispatch;
- ``partial`` [ep * S, row_bytes] and ``partial_extra`` [ep * S, extra_cols]
  float32: the rows a combine returns. The experts may write their output
  there directly (:meth:`PeerTransport.partial_buffer`), saving the copy.

Calls must alternate dispatch and combine on every rank (the layer's order):
a rank republishes a region only after the next call's barrier, when no peer
reads it any more. So layers of the same sizes may share one transport.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch
import torch.distributed as dist

from .. import _core
from .plan import RoutePlan
from .transport import Transport, capturing

MAX_RANKS = _core.EP_MAX_RANKS
_ALIGN = 256


def peer_unavailable_reason(device: torch.device) -> Optional[str]:
    """Why the ``peer`` transport cannot run on ``device``, or None if it can."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"it runs on CUDA devices, got {device}"
    if not _core.available():
        return f"the CUDA core is unavailable: {_core.unavailable_reason}"
    if not _core.has(_core.CAP_EP_TRANSPORT):
        return "the CUDA core was built without its expert-parallel kernels (csrc/ep)"
    return None


def _round_up(value: int) -> int:
    return (value + _ALIGN - 1) // _ALIGN * _ALIGN


class PeerTransport(Transport):
    """Dispatch and combine by the core's kernels over peers' symmetric buffers (one node).

    A collective to construct (every rank of ``group``, outside capture).
    ``max_tokens`` bounds the tokens of a call, ``hidden`` and ``dtype`` the
    rows, ``top_k`` the routes (2k int32 out, k float32 back).
    ``num_sms``: CTAs of a call, one per SM (default: every SM: the calls the
    layer does not overlap have the GPU to themselves); ``overlap_sms``: CTAs
    of the combine that runs beside the experts' weight gradient, whose GEMM
    then takes the other SMs (default 0: the layer does not overlap it).
    """

    name = "peer"
    capturable = True

    def __init__(self, group: dist.ProcessGroup, ep_size: int, segment_rows: int, *, max_tokens: int,
                 hidden: int, dtype: torch.dtype, top_k: int, device, num_sms: Optional[int] = None,
                 overlap_sms: int = 0):
        super().__init__(group, ep_size, segment_rows)
        device = torch.device(device)
        reason = peer_unavailable_reason(device)
        if reason is not None:
            raise RuntimeError(f"the peer transport cannot run: {reason}")
        if not 1 <= ep_size <= MAX_RANKS:
            raise ValueError(f"the peer transport takes 1 to {MAX_RANKS} ranks, got {ep_size}")
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        if capturing(torch.empty(0, device=self.device)):
            raise RuntimeError("symmetric buffers cannot be allocated during CUDA graph capture")
        self.hidden, self.dtype, self.top_k, self.max_tokens = hidden, dtype, top_k, max_tokens
        self.row_bytes = hidden * dtype.itemsize
        if self.row_bytes % 16:
            raise ValueError(f"the peer transport moves rows of a multiple of 16 bytes, got hidden={hidden} of {dtype}")
        self.device_sms = sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.num_sms = sms if num_sms is None else num_sms
        self.overlap_sms = overlap_sms
        if not 1 <= self.num_sms <= sms:
            raise ValueError(f"num_sms must be in [1, {sms}] (the device's SMs), got {self.num_sms}")
        if not 0 <= self.overlap_sms < sms:
            raise ValueError(f"overlap_sms must be in [0, {sms}) (0: no overlap), got {self.overlap_sms}")
        self.extra_bytes = 2 * top_k * 4
        S = segment_rows
        sizes = [
            ("state", 64),
            ("flags", 8 * ep_size),
            ("counts", 4 * ep_size),
            ("index", 4 * ep_size * S),
            ("rows", max_tokens * self.row_bytes),
            ("extra", max_tokens * self.extra_bytes),
            ("partial", ep_size * S * self.row_bytes),
            ("partial_extra", ep_size * S * top_k * 4),
        ]
        self._side: Optional[torch.cuda.Stream] = None
        self._beside = None  # the result of a combine running beside the caller's stream, until joined
        self.offsets, total = {}, 0
        for name, size in sizes:
            self.offsets[name] = total
            total += _round_up(max(size, 1))
        self._allocate(total)

    def _allocate(self, total: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        with torch.cuda.device(self.device):
            self.buffer = symm_mem.empty(total, dtype=torch.uint8, device=self.device)
            self.buffer[: self.offsets["counts"]].zero_()  # state and flags
            handle = symm_mem.rendezvous(self.buffer, self.group.group_name)
            rank = dist.get_rank(self.group)
            if handle.world_size != self.ep_size or handle.rank != rank:
                raise RuntimeError(
                    f"symmetric memory rendezvous gave rank {handle.rank} of {handle.world_size}, expected "
                    f"{rank} of {self.ep_size}"
                )
            bases = list(handle.buffer_ptrs)
            # The tensor may sit at an offset in its allocation: the same on every rank, or peers'
            # addresses would be wrong.
            offset = self.buffer.data_ptr() - bases[rank]
            offsets = torch.tensor([offset, -offset], dtype=torch.int64, device=self.device)
            dist.all_reduce(offsets, op=dist.ReduceOp.MAX, group=self.group)
            if int(offsets[0]) != offset or int(offsets[1]) != -offset:
                raise RuntimeError("symmetric buffers sit at different offsets of their allocations on the ranks")
            if any(b == 0 for b in bases):
                raise RuntimeError("a peer's symmetric buffer is not mapped here (no peer access between the GPUs?)")
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)  # every rank's flags are zero before any call
        self._handle = handle
        self.rank = rank
        self._group = _core.EpGroup(rank, self.ep_size, self.num_sms)
        for r, base in enumerate(bases):
            self._group.base[r] = base + offset
        self._group.flags_offset = self.offsets["flags"]
        self._group.state_offset = self.offsets["state"]

    # ------------------------------------------------------------ regions
    def _region(self, name: str, rows: int, width_bytes: int, dtype: torch.dtype) -> torch.Tensor:
        start = self.offsets[name]
        flat = self.buffer[start : start + rows * width_bytes]
        return flat.view(dtype).view(rows, width_bytes // dtype.itemsize)

    def partial_buffer(self) -> torch.Tensor:
        """[ep * S, hidden] view of this rank's ``partial`` region: what a combine returns to the token
        ranks. Writing the rows there before :meth:`combine` saves the copy into it."""
        return self._region("partial", self.ep_size * self.segment_rows, self.row_bytes, self.dtype)

    def _publish(self, name: str, x: torch.Tensor) -> None:
        target = self._region(name, x.shape[0], x.shape[1] * x.element_size(), x.dtype)
        if target.data_ptr() != x.data_ptr():
            target.copy_(x)

    def _follow_beside(self) -> None:
        """A call of this transport comes after the combine running beside (its barrier epochs are in
        order): the caller's stream waits for the side stream."""
        if self._beside is not None and torch.cuda.current_stream(self.device) != self._side:
            torch.cuda.current_stream(self.device).wait_stream(self._side)
            self._beside = None

    def _call(self, function: str, args, num_blocks: int) -> None:
        self._group.num_blocks = num_blocks
        with torch.cuda.device(self.device):
            _core.check(getattr(_core.lib, function)(ctypes.byref(self._group), ctypes.byref(args),
                                                     _core.stream_handle(self.device)))

    # ------------------------------------------------------------ collectives
    def dispatch(self, rows, extra, plan: RoutePlan):
        self._check_plan(plan)
        self._follow_beside()
        if rows.shape[0] > self.max_tokens or rows.dtype != self.dtype or rows.shape[1] != self.hidden:
            raise ValueError(
                f"the peer transport was sized for up to {self.max_tokens} rows of {self.hidden} {self.dtype}, "
                f"got {tuple(rows.shape)} {rows.dtype}"
            )
        S = self.segment_rows
        self._publish("rows", rows.contiguous())
        self._publish("counts", plan.counts.view(1, -1))
        self._publish("index", plan.index)
        out = torch.empty(self.ep_size * S, self.hidden, dtype=rows.dtype, device=rows.device)
        out_extra = None
        args = _core.EpDispatchArgs(S, self.offsets["counts"], self.offsets["index"], self.offsets["rows"], self.row_bytes,
                             self.offsets["extra"], 0, out.data_ptr(), None)
        if extra is not None:
            if extra.dtype != torch.int32 or extra.shape[1] * 4 != self.extra_bytes:
                raise ValueError(f"routes must be [tokens, {self.extra_bytes // 4}] int32, got {tuple(extra.shape)}")
            self._publish("extra", extra.contiguous())
            out_extra = torch.empty(self.ep_size * S, extra.shape[1], dtype=torch.int32, device=rows.device)
            args.extra_bytes, args.out_extra = self.extra_bytes, out_extra.data_ptr()
        self._call("mg_ep_dispatch", args, self.num_sms)
        return out, out_extra

    def combine(self, rows, extra, plan: RoutePlan, *, num_blocks: Optional[int] = None, out=None, out_extra=None):
        self._check_plan(plan)
        self._follow_beside()
        S = self.segment_rows
        if rows.shape != (self.ep_size * S, self.hidden) or rows.dtype != self.dtype:
            raise ValueError(
                f"combine takes [{self.ep_size * S}, {self.hidden}] {self.dtype}, got {tuple(rows.shape)} {rows.dtype}"
            )
        self._publish("partial", rows.contiguous())
        num_tokens = plan.num_tokens
        if out is None:
            out = torch.empty(num_tokens, self.hidden, dtype=rows.dtype, device=rows.device)
        args = _core.EpCombineArgs(S, num_tokens, plan.pos.data_ptr(), self.offsets["partial"], self.hidden,
                            _core.dtype_code(rows.dtype), out.data_ptr(), self.offsets["partial_extra"], 0, None)
        if extra is not None:
            if extra.shape != (self.ep_size * S, self.top_k):
                raise ValueError(f"combine's extra must be [{self.ep_size * S}, {self.top_k}], got {tuple(extra.shape)}")
            self._publish("partial_extra", extra.to(torch.float32).contiguous())
            if out_extra is None:
                out_extra = torch.empty(num_tokens, self.top_k, dtype=torch.float32, device=rows.device)
            args.extra_cols, args.out_extra = self.top_k, out_extra.data_ptr()
        self._call("mg_ep_combine", args, num_blocks or self.num_sms)
        return out, (out_extra if extra is not None else None)

    def combine_beside(self, rows, extra, plan: RoutePlan):
        """Starts :meth:`combine` on a side stream with ``overlap_sms`` CTAs, so that the work the
        caller issues next on its stream (the experts' weight gradients) runs beside it. Returns a
        function that joins the side stream and gives the combine's result; call it before the
        next call of this transport. Everything the side stream touches is allocated or kept by
        the caller's stream until the join."""
        self._follow_beside()
        main = torch.cuda.current_stream(self.device)
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        side = self._side
        out = torch.empty(plan.num_tokens, self.hidden, dtype=rows.dtype, device=rows.device)
        out_extra = None
        if extra is not None:
            extra = extra.to(torch.float32).contiguous()
            out_extra = torch.empty(plan.num_tokens, self.top_k, dtype=torch.float32, device=rows.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            result = self.combine(rows, extra, plan, num_blocks=self.overlap_sms, out=out, out_extra=out_extra)
        self._beside = result

        def join():
            main.wait_stream(side)
            if self._beside is result:
                self._beside = None
            del rows_kept[:]
            return result

        rows_kept = [rows, extra]  # alive until the side stream is joined
        return join

    def __repr__(self) -> str:
        return (f"PeerTransport(ep_size={self.ep_size}, segment_rows={self.segment_rows}, hidden={self.hidden}, "
                f"num_sms={self.num_sms}, overlap_sms={self.overlap_sms}, "
                f"buffer={self.buffer.numel() / 2**20:.0f} MiB)")
