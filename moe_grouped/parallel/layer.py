"""``ExpertParallelMoELayer``: MoELayer with its experts spread over a process group."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..permute import _check_dtype, check_drop_options, expert_capacity, resolve_backend, unpermute
from ..mlp import GroupedMLP, SwiGLUMLP
from ..moe_layer import MoELayer, _AttachAuxLoss
from ..router import Router, RoutingOutput
from .transport import (
    CapacityOverflowError,
    CombineFunction,
    DispatchFunction,
    Transport,
    local_expert_splits,
    make_transport,
    resolve_transport,
)


def plan_sends(
    row_id_map: torch.Tensor,
    experts: torch.Tensor,
    m_splits: torch.Tensor,
    ep_size: int,
    budget: int,
    padded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each token copy goes in the send buffer, on the device.

    ``row_id_map`` [T * k] and ``m_splits`` [E] come from
    ``permute_index`` (copies sorted by global expert, so rank-major since
    rank r owns experts ``r * ne ..``); ``experts`` [T * k] are the copies'
    global experts. Each destination rank takes at most ``budget`` of this
    rank's copies, the first in that order; the others are dropped.

    Returns ``(send_map, in_splits, dropped)``: ``send_map`` [T * k] the row
    of each copy in the send buffer (-1: dropped by the capacity factor or
    past the budget), ``in_splits`` [ep * ne] the rows per (rank, local
    expert), ``dropped`` the number of copies past the budget (0-d). The send
    buffer is packed, or with ``padded`` has ``ep * budget`` rows, the rows
    for rank r from row ``r * budget``.
    """
    counts = m_splits.view(ep_size, -1)
    rank_total = counts.sum(1)
    kept = rank_total.clamp(max=budget)
    rank_start = rank_total.cumsum(0) - rank_total
    if padded:
        send_start = torch.arange(ep_size, device=counts.device) * budget
    else:
        send_start = kept.cumsum(0) - kept
    start_in_rank = counts.cumsum(1) - counts
    in_splits = torch.minimum((budget - start_in_rank).clamp(min=0), counts).reshape(-1)
    rank = experts // counts.shape[1]
    position = row_id_map - rank_start[rank]
    send_map = torch.where((row_id_map >= 0) & (position < budget), send_start[rank] + position, -1)
    return send_map, in_splits, (rank_total - kept).sum()


def _per_expert(params, rank: int) -> list[torch.Tensor]:
    """One tensor per expert from a GroupedLinear's weights (rank 2) or biases (rank 1), grouped or not."""
    return [t for p in params for t in (p.unbind(0) if p.dim() == rank + 1 else [p])]


class ExpertParallelMoELayer(nn.Module):
    """A :class:`moe_grouped.MoELayer` whose experts are spread over an expert-parallel group.

    Rank r of ``group`` (``ep_size`` ranks) holds experts ``r * ne`` to
    ``r * ne + ne - 1`` (``ne = num_experts // ep_size``) as a
    :class:`GroupedMLP`. ``forward(x)`` routes this rank's tokens, sends each
    token copy to the rank owning its expert (dispatch), runs the local
    experts on the rows that arrived, sends the results back (combine) and sums
    them with the routing weights. Every rank must call ``forward`` (and
    backward) the same number of times in the same order.

    The router and the shared expert are replicated: construct them with the
    same weights on every rank (e.g. with :meth:`load_from` or a broadcast),
    and all-reduce their gradients over the data-parallel ranks as usual —
    this layer does not. The expert weights' gradients are complete on their
    owner (they sum the copies of every rank). Each rank's output equals
    :class:`MoELayer` holding all experts run on that rank's tokens; with a
    ``capacity_factor`` each rank drops per expert among its own tokens, and
    the router losses are those of the rank's own tokens.

    Transports (see :mod:`moe_grouped.parallel.transport`):
    ``"symm_mem"`` (NVSHMEM symmetric memory; CUDA; capturable),
    ``"padded_all_to_all"`` (fixed-size chunks of ``capacity // ep_size``
    rows; NCCL or gloo; capturable with NCCL; moves ``capacity`` rows each
    way, so give it a capacity near the expected load),
    ``"all_to_all"`` (host-read counts; NCCL or gloo; not capturable),
    ``"local"`` (one rank; capturable), ``"auto"`` (``local`` for one rank,
    else ``symm_mem`` where NVSHMEM loads and the group fits its kernels —
    at most 16 ranks — else ``all_to_all``).

    Capacity: each rank receives into a buffer of ``capacity`` rows; each
    source rank sends at most ``capacity // ep_size`` copies to one rank per
    forward, the first ones in (expert, token) order. Copies past that are
    dropped like capacity-factor drops (they add 0 to the output) and counted
    on the device; :meth:`check_overflow` raises
    :class:`CapacityOverflowError` if any were, and every eager forward
    checks the previous ones when a capacity was set. The default capacity is
    the worst case, ``ep_size * max_tokens * top_k`` (every copy of every
    rank to one rank), which never drops. Buffers are sized once, on the first
    forward (outside capture), from ``max_tokens`` or that forward's tokens,
    the largest over the group (the ranks agree on it, and ``capacity`` must
    be the same on every rank); a later forward with more tokens is refused.
    The received rows, and so the experts' activations, are sized by the
    capacity: the default holds ``ep_size`` times the average load, so a
    smaller capacity trades memory (and, with ``symm_mem``, symmetric memory
    per layer) for a risk of drops.

    Args:
        hidden, ffn_hidden, num_experts, top_k: as :class:`MoELayer`;
            ``num_experts`` must be a multiple of the group's size.
        group: the expert-parallel process group (default: the world).
        transport: ``"auto"``, ``"symm_mem"``, ``"padded_all_to_all"``, ``"all_to_all"`` or ``"local"``.
        capacity: rows of each rank's receive buffer (see above), >= ep_size;
            the same on every rank.
        max_tokens: the most tokens one forward takes on this rank (sizes
            the buffers); default: the first forward's; the group's largest.
        router_options, shared_expert_ffn_hidden, aux_loss_coeff,
            z_loss_coeff, capacity_factor, drop_policy, bias,
            single_grouped_weight, fuse_wgrad_accumulation,
            delay_wgrad_compute, dtype, device, backend: as
            :class:`MoELayer`. FP8 experts: run under
            :func:`moe_grouped.fp8.fp8_autocast`.
        pad_to_capacity: refused (the received rows per expert vary by
            source, so they cannot be padded to a fixed split).
    """

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        num_experts: int,
        top_k: int,
        *,
        group: Optional[dist.ProcessGroup] = None,
        transport: str = "auto",
        capacity: Optional[int] = None,
        max_tokens: Optional[int] = None,
        router_options: Optional[dict[str, Any]] = None,
        shared_expert_ffn_hidden: Optional[int] = None,
        aux_loss_coeff: float = 0.0,
        z_loss_coeff: float = 0.0,
        capacity_factor: Optional[float] = None,
        drop_policy: str = "probs",
        pad_to_capacity: bool = False,
        bias: bool = False,
        single_grouped_weight: bool = False,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        dtype: Optional[torch.dtype] = None,
        device=None,
        backend: Optional[str] = None,
    ):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                "ExpertParallelMoELayer needs torch.distributed initialised (init_process_group) "
                "and a process group of the expert-parallel ranks"
            )
        if pad_to_capacity:
            raise ValueError(
                "pad_to_capacity is not supported under expert parallelism: the rows an expert "
                "receives come from every rank, so they cannot be padded to a fixed split; use "
                "capacity_factor without padding"
            )
        for name, value in (("aux_loss_coeff", aux_loss_coeff), ("z_loss_coeff", z_loss_coeff)):
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a non-negative number, got {value!r}")
        check_drop_options(capacity_factor, drop_policy, False)
        self.group = group if group is not None else dist.group.WORLD
        self.ep_size, self.ep_rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if not isinstance(num_experts, int) or num_experts <= 0 or num_experts % self.ep_size:
            raise ValueError(
                f"num_experts must be a positive multiple of the group's {self.ep_size} ranks, got {num_experts!r}"
            )
        for name, value in (("capacity", capacity), ("max_tokens", max_tokens)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if capacity is not None and capacity < self.ep_size:
            raise ValueError(
                f"capacity must be at least ep_size={self.ep_size} (each source gets capacity // ep_size "
                f"rows), got {capacity}"
            )
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.hidden, self.num_experts, self.top_k = hidden, num_experts, top_k
        self.num_local_experts = num_experts // self.ep_size
        self.transport_name = resolve_transport(transport, self.ep_size, self.device)
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.aux_loss_coeff, self.z_loss_coeff = float(aux_loss_coeff), float(z_loss_coeff)
        self.backend = backend
        self.user_capacity, self.max_tokens = capacity, max_tokens
        self.router = Router(hidden, num_experts, top_k, dtype=dtype, device=device, **(router_options or {}))
        self.experts = GroupedMLP(
            self.num_local_experts, hidden, ffn_hidden, bias=bias, single_grouped_weight=single_grouped_weight,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation, delay_wgrad_compute=delay_wgrad_compute,
            dtype=dtype, device=device, backend=backend,
        )
        self.shared_expert = (
            SwiGLUMLP(hidden, shared_expert_ffn_hidden, dtype=dtype, device=device)
            if shared_expert_ffn_hidden else None
        )
        self.register_buffer("overflow_count", torch.zeros((), dtype=torch.int64, device=device), persistent=False)
        self.transport: Optional[Transport] = None
        self.capacity: Optional[int] = None
        self.recv_rows: Optional[int] = None
        self.last_routing: Optional[RoutingOutput] = None

    # ------------------------------------------------------------------ set-up
    @property
    def first_expert(self) -> int:
        """The global index of this rank's first expert."""
        return self.ep_rank * self.num_local_experts

    @torch.no_grad()
    def load_from(self, layer: MoELayer) -> "ExpertParallelMoELayer":
        """Copies a :class:`MoELayer`'s router, shared expert and this rank's experts into this layer."""
        if not isinstance(layer, MoELayer) or layer.num_experts != self.num_experts:
            raise ValueError(f"load_from needs a MoELayer with {self.num_experts} experts, got {layer!r}")
        self.router.load_state_dict(layer.router.state_dict())
        if (self.shared_expert is None) != (layer.shared_expert is None):
            raise ValueError("load_from needs a MoELayer with a shared expert exactly when this layer has one")
        if self.shared_expert is not None:
            self.shared_expert.load_state_dict(layer.shared_expert.state_dict())
        lo, hi = self.first_expert, self.first_expert + self.num_local_experts
        for name in ("fc1", "fc2"):
            source, target = getattr(layer.experts, name), getattr(self.experts, name)
            for kind, rank in (("weights", 2), ("biases", 1)):
                src = _per_expert(getattr(source, kind)(), rank)
                dst = _per_expert(getattr(target, kind)(), rank)
                if len(src) != (self.num_experts if dst else 0) or len(dst) != (hi - lo if src else 0):
                    raise ValueError(
                        f"load_from: the MoELayer's experts.{name} has {len(src)} expert {kind}, this "
                        f"layer's {len(dst)} (it must have {self.num_experts} and this rank {hi - lo})"
                    )
                for d, s in zip(dst, src[lo:hi]):
                    d.copy_(s)
        return self

    def _ensure_transport(self, tokens: torch.Tensor) -> None:
        num_tokens = tokens.shape[0]
        if self.transport is not None:
            if num_tokens > self.max_tokens:
                raise ValueError(
                    f"this forward has {num_tokens} tokens but the layer's buffers were sized for "
                    f"max_tokens={self.max_tokens}; pass max_tokens= at construction"
                )
            return
        if tokens.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the expert-parallel transport is set up on the first forward, which must run eagerly "
                "before capture (capture helpers' warm-up steps do)"
            )
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "the expert-parallel transport is set up on the first forward, which must run eagerly: "
                "call the layer once before torch.compile traces it"
            )
        if self.max_tokens is None:
            self.max_tokens = num_tokens
        elif num_tokens > self.max_tokens:
            raise ValueError(f"this forward has {num_tokens} tokens, more than max_tokens={self.max_tokens}")
        self._agree_on_sizes(tokens.device)
        send_rows = self.max_tokens * self.top_k
        self.capacity = self.user_capacity or self.ep_size * send_rows
        row_backend = resolve_backend(self.backend, tokens.device)
        options = {
            "symm_mem": dict(max_send_rows=send_rows, capacity=self.capacity, hidden=self.hidden,
                             dtype=tokens.dtype, device=tokens.device, row_backend=row_backend),
            "padded_all_to_all": dict(budget=self.capacity // self.ep_size, row_backend=row_backend),
        }.get(self.transport_name, {})
        self.transport = make_transport(
            self.transport_name, self.group, self.ep_size, self.num_local_experts, **options
        )
        self.recv_rows = self.transport.recv_rows(self.capacity)

    def _agree_on_sizes(self, device: torch.device) -> None:
        """Every rank sizes its buffers alike: the group's largest ``max_tokens``, and one capacity.

        A sender's budget per destination is its ``capacity // ep_size``, and
        the receiver's buffer holds its own ``capacity``: with different
        capacities a rank could receive more than it has room for.
        """
        if self.ep_size == 1:
            return
        capacity = self.user_capacity or 0
        sizes = torch.tensor([self.max_tokens, capacity, -capacity], dtype=torch.int64, device=device)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=self.group)
        largest_tokens, largest_capacity, smallest_capacity = (int(v) for v in sizes.tolist())
        if largest_capacity != -smallest_capacity:
            raise ValueError(
                f"capacity must be the same on every rank of the group, got values from {-smallest_capacity} "
                f"to {largest_capacity} (0: not given)"
            )
        self.max_tokens = largest_tokens

    @property
    def budget(self) -> int:
        """Copies one rank may send to one rank per forward: ``capacity // ep_size``."""
        return self.capacity // self.ep_size

    def check_overflow(self) -> None:
        """Raises :class:`CapacityOverflowError` on every rank if any rank dropped copies for lack of room.

        A collective (an all-reduce of the ranks' device counters, then a
        host read): call it on every rank, outside capture. Resets the counters.
        """
        if self.overflow_count.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("check_overflow reads a device counter and cannot run during CUDA graph capture")
        total = self.overflow_count.clone()
        if self.ep_size > 1:
            dist.all_reduce(total, group=self.group)
        dropped = int(total.item())
        if dropped:
            self.overflow_count.zero_()
            raise CapacityOverflowError(
                f"{dropped} token copies did not fit the receive buffers (capacity={self.capacity} rows "
                f"per rank, {self.budget} per source rank) since the last check and were dropped; raise "
                "capacity (the default, ep_size * max_tokens * top_k, never drops)"
            )

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """The layer on this rank's x [tokens, hidden] or [batch, seq, hidden]."""
        if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or x.shape[-1] != self.hidden:
            raise ValueError(
                f"x must have shape [tokens, {self.hidden}] or [batch, seq, {self.hidden}], got "
                f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
            )
        tokens = x.reshape(-1, self.hidden).contiguous()
        self._ensure_transport(tokens)
        if self.transport_name == "all_to_all" and torch.compiler.is_compiling():
            # Its collectives read the counts on the host to size their buffers.
            raise NotImplementedError(
                "ExpertParallelMoELayer(transport='all_to_all') cannot run under torch.compile: it reads the "
                "per-rank counts on the host. Use transport='local' (one rank) or 'symm_mem', or run eagerly"
            )
        # Under capture or compile the overflow check (a host read) is left to check_overflow().
        capturing = torch.compiler.is_compiling() or (tokens.is_cuda and torch.cuda.is_current_stream_capturing())
        if self.user_capacity is not None and not capturing:
            self.check_overflow()
        routing = self.router(tokens)
        backend = resolve_backend(self.backend, tokens.device)
        _check_dtype(backend, tokens.dtype)
        num_tokens, top_k = routing.experts.shape
        per_expert = -1
        priority = None
        if self.capacity_factor is not None:
            per_expert = expert_capacity(num_tokens, top_k, self.num_experts, self.capacity_factor)
            if self.drop_policy == "probs":
                priority = routing.weights.detach().to(torch.float32).contiguous()
        experts = routing.experts.contiguous()
        row_id_map, m_splits = torch.ops.moe_grouped.permute_index(
            experts, priority, self.num_experts, per_expert, False, backend
        )
        send, send_map, in_splits = self.send_buffer(tokens, routing, row_id_map, m_splits, backend)
        recv, layout = DispatchFunction.apply(send, in_splits, self.transport, self.recv_rows)
        local_splits = local_expert_splits(layout, self.num_local_experts, self.ep_size)
        expert_out = self.experts(recv, local_splits, is_first_microbatch)
        back = CombineFunction.apply(expert_out, layout, in_splits, self.transport, send.shape[0])
        out = unpermute(back, send_map, routing.weights, backend=self.backend)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        if self.training and torch.is_grad_enabled() and (self.aux_loss_coeff or self.z_loss_coeff):
            loss = self.aux_loss_coeff * routing.aux_loss + self.z_loss_coeff * routing.z_loss
            out = _AttachAuxLoss.apply(out, loss)
        self.last_routing = routing.detached()
        return out.view(x.shape)

    def send_buffer(self, tokens, routing, row_id_map, m_splits, backend):
        """``(send, send_map, in_splits)``: this rank's token copies laid out for the transport
        (see :func:`plan_sends`; padded for ``padded_all_to_all``); counts the copies past the budget."""
        padded = self.transport.padded_send
        send_map, in_splits, dropped = plan_sends(
            row_id_map, routing.experts.reshape(-1), m_splits, self.ep_size, self.budget, padded
        )
        self.overflow_count.add_(dropped)
        top_k = routing.experts.shape[1]
        rows = self.ep_size * self.budget if padded else tokens.shape[0] * top_k
        # Padding rows are never read by the receiver, so they need no zeros.
        send = torch.ops.moe_grouped.permute_rows(tokens, send_map, top_k, rows, not padded, backend)
        return send, send_map, in_splits

    def backward_dw(self) -> None:
        """The local experts' deferred weight gradients (``delay_wgrad_compute=True``)."""
        self.experts.backward_dw()

    def extra_repr(self) -> str:
        drop = (
            f", capacity_factor={self.capacity_factor}, drop_policy={self.drop_policy!r}"
            if self.capacity_factor is not None else ""
        )
        return (
            f"ep_size={self.ep_size}, ep_rank={self.ep_rank}, transport={self.transport_name!r}, "
            f"local_experts={self.num_local_experts}, capacity={self.user_capacity or 'worst case'}{drop}, "
            f"backend={self.backend}"
        )
