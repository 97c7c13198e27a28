"""Moving token rows between the ranks of an expert-parallel group.

Every transport implements the same two collectives over the same layouts,
for ``ep`` ranks holding ``ne`` experts each (rank r owns global experts
``r * ne .. r * ne + ne - 1``):

- ``dispatch(send, in_splits, recv_rows)``: ``send`` [S, H] holds the rows
  this rank sends, rank-major: to rank 0 for its local expert 0, then rank 0
  expert 1, ..., then rank 1 expert 0, ...; ``in_splits`` [ep * ne] int64
  (device) counts them, packed from row 0 (rows past ``in_splits.sum()`` are
  not sent); a transport with ``padded_send`` takes ``ep * budget`` rows
  instead, rank r's from row ``r * budget``. Returns ``(recv, layout)``:
  ``recv`` [recv_rows, H] expert-major
  — local expert 0's rows from rank 0, then from rank 1, ..., then expert 1's
  — so the rows of each local expert are contiguous and the grouped GEMMs
  take them as they are; rows past the received total are zero. ``layout``
  [2, ne * ep] int64 (device): row 0 the received counts in that order,
  row 1 their offsets in ``recv``. The transports here pack the chunks;
  :func:`local_expert_splits` gives the grouped GEMMs' ``m_splits`` (each
  local expert's span of rows) from the layout and would also count a gap
  row between chunks. ``recv_rows`` is :meth:`Transport.recv_rows` of the
  capacity.
- ``combine(y, layout, in_splits, send_rows)``: the reverse. ``y`` [R, H] in
  ``recv``'s layout; returns [send_rows, H] in ``send``'s layout (each row
  back where it left from), rows that carried nothing zero.

The backward of a dispatch is a combine of the gradient and vice versa
(:class:`DispatchFunction`, :class:`CombineFunction`).

Transports:

- ``symm_mem``: PyTorch symmetric memory over NVSHMEM
  (``torch.ops.symm_mem.all_to_all_vdev_2d`` and ``all_to_all_vdev_2d_offset``).
  The counts travel on the device, so dispatch and combine capture in a CUDA
  graph. Its buffers are symmetric allocations made once (collectively, outside
  capture) and sized for the largest send and receive; rows are copied into
  them and out of them (the outputs must outlive the next collective, e.g. as
  tensors saved for backward). torch's kernels take at most 16 ranks and 16
  experts per rank; more local experts travel in bins (:func:`expert_bins`).
  Collectives of one transport must run in
  the same order on every rank, dispatch and combine alternating (as the layer
  does: forward dispatch, combine; backward dispatch, combine): that order is
  what keeps a rank from overwriting a buffer that a peer still reads.
- ``padded_all_to_all``: ``all_to_all_single`` (NCCL or gloo) of fixed size:
  every source sends every rank a chunk of ``budget`` rows (the layer's
  ``capacity // ep``), its real rows first, and the counts travel in a second,
  fixed-size ``all_to_all_single``. No size is read on the host, so NCCL's
  collectives capture in a CUDA graph. It moves ``ep * budget`` rows each way
  however few are real: the default (worst-case) capacity moves ``ep`` times
  the data; a capacity near the expected load moves little more than it.
- ``all_to_all``: ``torch.distributed.all_to_all_single`` (NCCL or gloo) with
  the counts read on the host — not capturable (it raises if called during
  capture). The reference, and the CPU path.
- ``local``: one rank (``ep == 1``): the rows stay where they are; device
  copies only, capturable, on the CPU too.

None of them can write out of bounds: the sender never sends more rows than
the receiver's buffer has room for (the layer clamps each source's rows per
destination to ``capacity // ep``; see
:class:`moe_grouped.parallel.ExpertParallelMoELayer`), and the transports check
the sizes they can see.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

TRANSPORTS = ("auto", "symm_mem", "padded_all_to_all", "all_to_all", "local")
# torch's all_to_all_vdev_2d kernels (nvshmem_extension.cu): one warp-wide scan
# over the ranks, one 32-thread tile per local expert in a 512-thread block;
# the combine swaps the two roles. Seen on torch 2.11: "Number of experts must
# be smaller than NUM_TILES16" for 17 experts per rank.
SYMM_MEM_MAX_RANKS = 16
SYMM_MEM_MAX_LOCAL_EXPERTS = 16


class CapacityOverflowError(RuntimeError):
    """Token copies did not fit a rank's receive buffer and were dropped."""


def _capturing(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def _exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    return counts.cumsum(0) - counts


def _rows(x: torch.Tensor, rows: int, total: torch.Tensor) -> torch.Tensor:
    """``x``'s first ``rows`` rows (zero-padded), rows at or past ``total`` (device) zeroed.

    New memory: the result may be saved for backward while ``x`` (a transport
    buffer) is overwritten by the next collective.
    """
    if x.shape[0] >= rows:
        x = x[:rows]
    else:
        x = torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])])
    past = torch.arange(rows, device=x.device) >= total
    return x.masked_fill(past.unsqueeze(1), 0)


def _layout(splits_expert_major: torch.Tensor) -> torch.Tensor:
    return torch.stack([splits_expert_major, _exclusive_cumsum(splits_expert_major)])


def _all_to_all_equal(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` cut into ``ep`` equal chunks, chunk r sent to rank r; the chunks received, by source.

    Fixed sizes, so NCCL captures it in a CUDA graph.
    """
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


def _gather_rows(x: torch.Tensor, index: torch.Tensor, backend: str) -> torch.Tensor:
    """Row ``index[i]`` of ``x`` for every i, zeros where it is -1: one pass of ``backend``'s kernel."""
    return torch.ops.moe_grouped.unpermute_rows(x, index, None, 1, backend)


def local_expert_splits(layout: torch.Tensor, num_local_experts: int, ep_size: int) -> torch.Tensor:
    """[ne] rows of each local expert in a dispatch's output: from its first chunk to the next expert's.

    Equals the received counts per expert for packed layouts; counts a gap
    row left between chunks.
    """
    counts = layout[0].view(num_local_experts, ep_size)
    offsets = layout[1].view(num_local_experts, ep_size)
    starts = offsets[:, 0]
    end = (offsets[-1, -1] + counts[-1, -1]).view(1)
    return torch.cat([starts[1:], end]) - starts


class Transport:
    """Dispatch and combine over ``ep`` ranks of ``num_local_experts`` experts each.

    Subclasses implement :meth:`dispatch` and :meth:`combine` (see the module
    docstring for the layouts). ``capturable`` says whether they can run during
    CUDA graph capture.
    """

    name = "transport"
    capturable = False
    # True: ``dispatch`` takes ``send`` with ``ep * budget`` rows, rank r's from row r * budget
    # (plan_sends(padded=True)), and ``combine`` returns that layout.
    padded_send = False

    def __init__(self, group: Optional[dist.ProcessGroup], ep_size: int, num_local_experts: int):
        self.group, self.ep_size, self.num_local_experts = group, ep_size, num_local_experts

    def recv_rows(self, capacity: int) -> int:
        """Rows of a dispatch's output for a receive capacity of ``capacity`` token copies."""
        return capacity

    def _exchange_counts(self, in_splits: torch.Tensor) -> torch.Tensor:
        """[ep (source), ne] counts this rank receives, from each rank's in_splits (a collective)."""
        return _all_to_all_equal(in_splits, self.group).view(self.ep_size, self.num_local_experts)

    def dispatch(self, send: torch.Tensor, in_splits: torch.Tensor, recv_rows: int):
        raise NotImplementedError

    def combine(self, y: torch.Tensor, layout: torch.Tensor, in_splits: torch.Tensor, send_rows: int):
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ep_size={self.ep_size}, num_local_experts={self.num_local_experts})"


class LocalTransport(Transport):
    """One rank: dispatch and combine keep the rows in place (device copies; capturable)."""

    name = "local"
    capturable = True

    def __init__(self, group: Optional[dist.ProcessGroup], ep_size: int, num_local_experts: int):
        if ep_size != 1:
            raise ValueError(f"the local transport serves a group of one rank, got ep_size={ep_size}")
        super().__init__(group, ep_size, num_local_experts)

    def dispatch(self, send, in_splits, recv_rows):
        # One source: expert-major and rank-major are the same order.
        return _rows(send, recv_rows, in_splits.sum()), _layout(in_splits)

    def combine(self, y, layout, in_splits, send_rows):
        return _rows(y, send_rows, in_splits.sum())


class AllToAllTransport(Transport):
    """``all_to_all_single`` with the counts read on the host (NCCL or gloo).

    Not capturable: it synchronises to read how many rows go to and come from
    each rank. The reference for the capturable transports, and the CPU path.
    """

    name = "all_to_all"
    capturable = False

    def _refuse_capture(self, x: torch.Tensor) -> None:
        if _capturing(x):
            raise RuntimeError(
                "the all_to_all transport reads the token counts on the host and cannot run during "
                "CUDA graph capture; use transport='symm_mem' (or 'local' for one rank)"
            )

    def dispatch(self, send, in_splits, recv_rows):
        self._refuse_capture(send)
        ep, ne = self.ep_size, self.num_local_experts
        received = self._exchange_counts(in_splits)
        send_sizes = in_splits.view(ep, ne).sum(1).tolist()
        recv_sizes = received.sum(1).tolist()
        if sum(recv_sizes) > recv_rows:
            raise CapacityOverflowError(
                f"{sum(recv_sizes)} rows arrive but the receive buffer has {recv_rows}; the sender "
                "must clamp its rows per destination to capacity // ep_size"
            )
        got = send.new_empty(sum(recv_sizes), send.shape[1])
        dist.all_to_all_single(
            got, send[: sum(send_sizes)].contiguous(), recv_sizes, send_sizes, group=self.group
        )
        # got is source-major (source, expert); reorder to expert-major (expert, source).
        counts = received.tolist()
        starts = _exclusive_cumsum(received.reshape(-1)).view(ep, ne).tolist()
        chunks = [got[starts[s][e] : starts[s][e] + counts[s][e]] for e in range(ne) for s in range(ep)]
        recv = torch.cat(chunks) if chunks else got
        layout = _layout(received.t().reshape(-1).to(in_splits.device))
        return _rows(recv, recv_rows, torch.tensor(recv.shape[0], device=recv.device)), layout

    def combine(self, y, layout, in_splits, send_rows):
        self._refuse_capture(y)
        ep, ne = self.ep_size, self.num_local_experts
        counts = layout[0].view(ne, ep).tolist()
        offsets = layout[1].view(ne, ep).tolist()
        # Back to source-major: the rows each source sent, in the order it sent them.
        chunks = [y[offsets[e][s] : offsets[e][s] + counts[e][s]] for s in range(ep) for e in range(ne)]
        out = torch.cat(chunks) if chunks else y[:0]
        send_sizes = [sum(counts[e][s] for e in range(ne)) for s in range(ep)]
        recv_sizes = in_splits.view(ep, ne).sum(1).tolist()
        back = y.new_empty(sum(recv_sizes), y.shape[1])
        dist.all_to_all_single(back, out.contiguous(), recv_sizes, send_sizes, group=self.group)
        return _rows(back, send_rows, torch.tensor(back.shape[0], device=back.device))


class PaddedAllToAllTransport(Transport):
    """``all_to_all_single`` with every (source, destination) chunk padded to ``budget`` rows.

    Fixed sizes, so nothing is read on the host and NCCL's collectives
    capture in a CUDA graph; gloo runs it on the CPU. ``send`` comes in the
    padded layout (``padded_send``: ``ep * budget`` rows, the rows for rank r
    first in chunk r, as ``plan_sends(padded=True)`` places them) and the
    combine returns it; on the receiving side the rows are gathered into the
    packed expert-major layout and back with ``row_backend``'s
    ``unpermute_rows``. The caller keeps every source's rows per destination
    within ``budget`` (the layer's plan does).
    """

    name = "padded_all_to_all"
    capturable = True
    padded_send = True

    def __init__(self, group, ep_size: int, num_local_experts: int, *, budget: int, row_backend: str = "torch"):
        super().__init__(group, ep_size, num_local_experts)
        if budget < 1:
            raise ValueError(f"budget must be at least 1 row per (source, destination), got {budget}")
        self.budget, self.row_backend = budget, row_backend

    def _source_major(self, counts: torch.Tensor) -> torch.Tensor:
        """[ne, ep] each (expert, source) chunk's first row in the padded source-major layout."""
        per_source = counts.t()  # [ep, ne]: source s's rows for each local expert, in the order it sent them
        within = per_source.cumsum(1) - per_source
        first = torch.arange(self.ep_size, device=counts.device).unsqueeze(1) * self.budget
        return (first + within).t()

    def dispatch(self, send, in_splits, recv_rows):
        ep, budget = self.ep_size, self.budget
        if ep * budget > recv_rows:
            raise ValueError(f"recv_rows {recv_rows} is less than ep_size * budget = {ep * budget}")
        if send.shape[0] != ep * budget:
            raise ValueError(f"send must have ep_size * budget = {ep * budget} rows (padded), got {send.shape[0]}")
        counts = self._exchange_counts(in_splits).t()  # [ne, ep]
        got = _all_to_all_equal(send, self.group)
        packed = _exclusive_cumsum(counts.reshape(-1))
        index = segment_index(recv_rows, packed, counts.reshape(-1), self._source_major(counts).reshape(-1))
        return _gather_rows(got, index, self.row_backend), _layout(counts.reshape(-1))

    def combine(self, y, layout, in_splits, send_rows):
        ep, budget = self.ep_size, self.budget
        if send_rows != ep * budget:
            raise ValueError(f"send_rows must be ep_size * budget = {ep * budget} (padded), got {send_rows}")
        counts = layout[0].view(self.num_local_experts, ep)
        starts = self._source_major(counts).t().reshape(-1)  # source-major: the padded layout's order
        lengths = counts.t().reshape(-1)
        targets = layout[1].view(self.num_local_experts, ep).t().reshape(-1)
        padded = _gather_rows(y, segment_index(ep * budget, starts, lengths, targets), self.row_backend)
        return _all_to_all_equal(padded, self.group)


def expert_bins(num_local_experts: int) -> tuple[int, int]:
    """``(bins, experts_per_bin)``: the local experts in at most 16 bins of consecutive experts.

    torch's dispatch kernel takes at most 16 experts per rank; the symm_mem
    transport sends per (rank, bin) instead and reorders the received rows by
    expert itself (:func:`symm_mem_chunk_starts`).
    """
    per_bin = -(-num_local_experts // SYMM_MEM_MAX_LOCAL_EXPERTS)
    return -(-num_local_experts // per_bin), per_bin


def _bins_of(counts: torch.Tensor, bins: int, per_bin: int):
    """``counts`` [ne, ep] as [bins, per_bin, ep] (padding experts count 0), the (bin, source)
    chunks' rows [bins, ep] and their first rows in the receive buffer [bins, ep]: bin-major,
    then source, and a bin that receives nothing still takes one row (torch's kernel rounds an
    empty bin up to ``major_align``, 1)."""
    ne, ep = counts.shape
    by_bin = counts.new_zeros(bins * per_bin, ep)
    by_bin[:ne] = counts
    by_bin = by_bin.view(bins, per_bin, ep)
    chunk_rows = by_bin.sum(1)
    bin_rows = chunk_rows.sum(1).clamp(min=1)
    chunk_start = _exclusive_cumsum(bin_rows).unsqueeze(1) + chunk_rows.cumsum(1) - chunk_rows
    return by_bin, chunk_rows, chunk_start


def symm_mem_chunk_starts(counts: torch.Tensor, bins: int, per_bin: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each (local expert, source rank) chunk of a dispatch lies, packed and in torch's buffer.

    ``counts`` [ne, ep] rows each source sends each local expert. Returns
    ``(packed, buffered)``, both [ne, ep]: a chunk's first row in the packed
    expert-major layout (the transport's output) and in the receive buffer as
    ``all_to_all_vdev_2d`` fills it, where a (bin, source) chunk holds the
    bin's experts in order.
    """
    ne, ep = counts.shape
    packed = _exclusive_cumsum(counts.reshape(-1)).view(ne, ep)
    by_bin, _, chunk_start = _bins_of(counts, bins, per_bin)
    buffered = chunk_start.unsqueeze(1) + by_bin.cumsum(1) - by_bin
    return packed, buffered.view(bins * per_bin, ep)[:ne]


def segment_index(rows: int, starts: torch.Tensor, lengths: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[rows] for every row r of one layout, the row of another layout it maps to, -1 where none does.

    Segment i covers rows ``starts[i] .. starts[i] + lengths[i] - 1`` and maps
    them, in order, to rows from ``targets[i]``; ``starts`` is non-decreasing
    and the segments do not overlap. On the device, without a host read.
    """
    row = torch.arange(rows, device=starts.device)
    segment = (torch.searchsorted(starts, row, right=True) - 1).clamp(min=0)
    offset = row - starts[segment]
    return torch.where((offset >= 0) & (offset < lengths[segment]), targets[segment] + offset, -1)


def bin_layout(counts: torch.Tensor, bins: int, per_bin: int) -> torch.Tensor:
    """[2, bins * ep] the layout ``all_to_all_vdev_2d`` writes for [ne, ep] received counts:
    each (bin, source) chunk's rows, then its first row in the receive buffer."""
    _, chunk_rows, chunk_start = _bins_of(counts, bins, per_bin)
    return torch.stack([chunk_rows.reshape(-1), chunk_start.reshape(-1)])


def receive_index(counts: torch.Tensor, bins: int, per_bin: int, rows: int) -> torch.Tensor:
    """[rows] the receive-buffer row of each row of the packed expert-major layout (-1 past the total)."""
    packed, buffered = symm_mem_chunk_starts(counts, bins, per_bin)
    return segment_index(rows, packed.reshape(-1), counts.reshape(-1), buffered.reshape(-1))


def buffer_order(ne: int, ep: int, bins: int, per_bin: int) -> torch.Tensor:
    """The (expert, source) chunks, as indices into ``counts.reshape(-1)`` ([ne, ep]), in the order
    the receive buffer holds them: bin, then source, then the bin's experts. On the CPU: fixed by
    the sizes, so it is made once and kept on the device (a boolean mask under capture would sync)."""
    expert = torch.arange(bins * per_bin).view(bins, 1, per_bin)
    order = (expert * ep + torch.arange(ep).view(1, ep, 1)).reshape(-1)
    return order[order < ne * ep]


def return_index(counts: torch.Tensor, bins: int, per_bin: int, rows: int, order: torch.Tensor) -> torch.Tensor:
    """[rows] the packed row that each receive-buffer row holds (-1 where none): :func:`receive_index`
    inverted. ``order`` is :func:`buffer_order` on ``counts``' device."""
    packed, buffered = symm_mem_chunk_starts(counts, bins, per_bin)
    return segment_index(rows, buffered.reshape(-1)[order], counts.reshape(-1)[order], packed.reshape(-1)[order])


class SymmMemTransport(Transport):
    """PyTorch symmetric memory (NVSHMEM): device-side counts, capturable.

    Allocates its symmetric buffers in the constructor — a collective: every
    rank of ``group`` must construct it, outside CUDA graph capture:
    ``max_send_rows`` x ``hidden`` and :meth:`recv_rows` x ``hidden`` rows of
    ``dtype`` plus the count/offset tables. Nothing is allocated afterwards.

    torch's dispatch kernel takes at most 16 experts per rank. With more, the
    local experts travel in 16 or fewer bins of consecutive experts
    (:func:`expert_bins`) and a second, small collective exchanges the
    per-expert counts; either way the received rows are gathered out of the
    receive buffer into the packed expert-major layout (one pass that the
    output needs anyway, since it must outlive the buffer), and the combine
    gathers them back in. The receive buffer has ``capacity`` rows plus one
    per bin, for the row torch's kernel gives a bin that receives nothing.
    ``row_backend`` names the permutation backend that does the gather
    (``"cuda"`` or ``"torch"``).
    """

    name = "symm_mem"
    capturable = True

    def __init__(
        self,
        group: dist.ProcessGroup,
        ep_size: int,
        num_local_experts: int,
        *,
        max_send_rows: int,
        capacity: int,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device,
        row_backend: str = "torch",
    ):
        super().__init__(group, ep_size, num_local_experts)
        if ep_size < 2:
            raise ValueError(
                "the symm_mem transport needs at least 2 ranks (NVSHMEM rendezvous refuses a group of "
                "one); use transport='local' for ep_size 1"
            )
        if ep_size > SYMM_MEM_MAX_RANKS:
            raise ValueError(
                f"torch's all_to_all_vdev_2d kernels take at most {SYMM_MEM_MAX_RANKS} ranks, got "
                f"ep_size={ep_size}; use transport='all_to_all'"
            )
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"the symm_mem transport runs on CUDA devices, got {device}")
        # NVSHMEM's team manager is pinned to the first device index it sees: always name one.
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        if _capturing(torch.empty(0, device=device)):
            raise RuntimeError("symmetric buffers cannot be allocated during CUDA graph capture")
        import torch.distributed._symmetric_memory as symm_mem

        if not symm_mem.is_nvshmem_available():
            raise RuntimeError("the symm_mem transport needs NVSHMEM, which this torch cannot load")
        if symm_mem.get_backend(device) != "NVSHMEM":
            symm_mem.set_backend("NVSHMEM")
        self.group_name, self.row_backend = group.group_name, row_backend
        self.bins, self.per_bin = expert_bins(num_local_experts)
        self.buffer_order = buffer_order(num_local_experts, ep_size, self.bins, self.per_bin).to(device)

        def symmetric(*shape, dtype):
            buffer = symm_mem.empty(*shape, dtype=dtype, device=device)
            symm_mem.rendezvous(buffer, self.group_name)
            return buffer

        with torch.cuda.device(device):
            # Two row buffers suffice because dispatch and combine alternate: a dispatch pulls
            # from peers' token buffers into the local expert buffer, a combine the reverse, and
            # each starts with a barrier that peers reach only after finishing the previous one.
            self.token_buffer = symmetric(max_send_rows, hidden, dtype=dtype)
            self.expert_buffer = symmetric(capacity + self.bins, hidden, dtype=dtype)
            self.dispatch_in = symmetric(ep_size * self.bins, dtype=torch.int64)
            self.dispatch_out = symmetric(2, ep_size * self.bins, dtype=torch.int64)
            self.combine_in = symmetric(2, ep_size * self.bins, dtype=torch.int64)
            self.combine_out = symmetric(2, ep_size * self.bins, dtype=torch.int64)
            if self.per_bin > 1:
                # The per-expert counts: one row of ne counts to each rank, received source-major.
                self.counts_in = symmetric(ep_size, num_local_experts, dtype=torch.int64)
                self.counts_out = symmetric(ep_size, num_local_experts, dtype=torch.int64)
                self.counts_splits = symmetric(ep_size, dtype=torch.int64)
                self.counts_splits.fill_(1)
                self.counts_layout = symmetric(2, ep_size, dtype=torch.int64)

    def _check_rows(self, what: str, x: torch.Tensor, rows: int) -> None:
        buffer = self.token_buffer
        if x.shape[0] > rows or x.shape[1] != buffer.shape[1] or x.dtype != buffer.dtype:
            raise ValueError(
                f"{what} of shape {tuple(x.shape)} and dtype {x.dtype} does not fit the symmetric buffers "
                f"({rows} rows of {buffer.shape[1]} {buffer.dtype}) allocated at construction"
            )

    def _received_counts(self, in_splits: torch.Tensor) -> torch.Tensor:
        """[ne, ep] rows each source sent each local expert (after the dispatch's collective)."""
        ne, ep = self.num_local_experts, self.ep_size
        if self.per_bin == 1:  # bins are experts: the dispatch's own counts, [expert, source]
            return self.dispatch_out[0].view(ne, ep).clone()
        self.counts_in.copy_(in_splits.view(ep, ne))
        torch.ops.symm_mem.all_to_all_vdev_2d(
            self.counts_in, self.counts_out, self.counts_splits, self.counts_layout, self.group_name
        )
        return self.counts_out.t().clone()

    def _bin_splits(self, in_splits: torch.Tensor) -> torch.Tensor:
        if self.per_bin == 1:
            return in_splits
        ep, ne = self.ep_size, self.num_local_experts
        padded = in_splits.new_zeros(ep, self.bins * self.per_bin)
        padded[:, :ne] = in_splits.view(ep, ne)
        return padded.view(ep, self.bins, self.per_bin).sum(2).reshape(-1)

    def dispatch(self, send, in_splits, recv_rows):
        self._check_rows("send", send, self.token_buffer.shape[0])
        if recv_rows != self.expert_buffer.shape[0] - self.bins:
            raise ValueError(f"recv_rows must be {self.expert_buffer.shape[0] - self.bins} (the capacity), got {recv_rows}")
        # Whole buffers go to the collective (never views): peers address them by the same offsets.
        self.token_buffer[: send.shape[0]].copy_(send)
        self.dispatch_in.copy_(self._bin_splits(in_splits))
        torch.ops.symm_mem.all_to_all_vdev_2d(
            self.token_buffer, self.expert_buffer, self.dispatch_in, self.dispatch_out, self.group_name
        )
        counts = self._received_counts(in_splits)
        gather = receive_index(counts, self.bins, self.per_bin, recv_rows)
        recv = _gather_rows(self.expert_buffer, gather, self.row_backend)
        return recv, _layout(counts.reshape(-1))

    def combine(self, y, layout, in_splits, send_rows):
        self._check_rows("y", y, self.expert_buffer.shape[0] - self.bins)
        if send_rows > self.token_buffer.shape[0]:
            raise ValueError(f"send_rows {send_rows} exceeds the token buffer's {self.token_buffer.shape[0]} rows")
        counts = layout[0].view(self.num_local_experts, self.ep_size)
        source = return_index(counts, self.bins, self.per_bin, self.expert_buffer.shape[0], self.buffer_order)
        # Rows no chunk covers are never sent: any row of y will do there.
        torch.index_select(y, 0, source.clamp(min=0, max=y.shape[0] - 1), out=self.expert_buffer)
        self.combine_in.copy_(bin_layout(counts, self.bins, self.per_bin))
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(
            self.expert_buffer, self.token_buffer, self.combine_in, self.combine_out, self.group_name
        )
        return _rows(self.token_buffer, send_rows, in_splits.sum())


def resolve_transport(name: str, ep_size: int, device: torch.device) -> str:
    """The transport ``name`` stands for. ``auto``: ``local`` for one rank; else ``symm_mem``
    on CUDA where NVSHMEM loads and the group has at most 16 ranks; else ``all_to_all``."""
    if name not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {name!r}")
    if name == "local" and ep_size != 1:
        raise ValueError(f"transport='local' serves a group of one rank, got ep_size={ep_size}")
    if name != "auto":
        return name
    if ep_size == 1:
        return "local"
    if ep_size <= SYMM_MEM_MAX_RANKS and torch.device(device).type == "cuda":
        import torch.distributed._symmetric_memory as symm_mem

        if symm_mem.is_nvshmem_available():
            return "symm_mem"
    return "all_to_all"


def make_transport(name: str, group, ep_size: int, num_local_experts: int, **options) -> Transport:
    """A transport by its resolved name; ``options`` are its keyword arguments (sizes, row backend)."""
    if name == "local":
        return LocalTransport(group, ep_size, num_local_experts)
    if name == "all_to_all":
        return AllToAllTransport(group, ep_size, num_local_experts)
    if name == "symm_mem":
        return SymmMemTransport(group, ep_size, num_local_experts, **options)
    if name == "padded_all_to_all":
        return PaddedAllToAllTransport(group, ep_size, num_local_experts, **options)
    raise ValueError(f"no transport named {name!r}; choose from {TRANSPORTS[1:]}")


class DispatchFunction(torch.autograd.Function):
    """``transport.dispatch`` whose backward is the combine of the gradient."""

    @staticmethod
    def forward(ctx, send, in_splits, transport: Transport, recv_rows: int):
        recv, layout = transport.dispatch(send, in_splits, recv_rows)
        ctx.transport, ctx.send_rows = transport, send.shape[0]
        ctx.save_for_backward(in_splits, layout)
        ctx.mark_non_differentiable(layout)
        return recv, layout

    @staticmethod
    def backward(ctx, grad_recv, _grad_layout):
        in_splits, layout = ctx.saved_tensors
        grad = ctx.transport.combine(grad_recv.contiguous(), layout, in_splits, ctx.send_rows)
        return grad, None, None, None


class CombineFunction(torch.autograd.Function):
    """``transport.combine`` whose backward is the dispatch of the gradient."""

    @staticmethod
    def forward(ctx, y, layout, in_splits, transport: Transport, send_rows: int):
        ctx.transport, ctx.recv_rows = transport, y.shape[0]
        ctx.save_for_backward(in_splits)
        return transport.combine(y, layout, in_splits, send_rows)

    @staticmethod
    def backward(ctx, grad_back):
        (in_splits,) = ctx.saved_tensors
        grad, _ = ctx.transport.dispatch(grad_back.contiguous(), in_splits, ctx.recv_rows)
        return grad, None, None, None, None


__all__ = [
    "TRANSPORTS",
    "Transport",
    "LocalTransport",
    "AllToAllTransport",
    "SymmMemTransport",
    "PaddedAllToAllTransport",
    "CapacityOverflowError",
    "DispatchFunction",
    "CombineFunction",
    "resolve_transport",
    "expert_bins",
    "bin_layout",
    "receive_index",
    "return_index",
    "buffer_order",
    "local_expert_splits",
    "make_transport",
]
