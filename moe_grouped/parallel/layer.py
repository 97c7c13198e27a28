"""``ExpertParallelMoELayer``: MoELayer with its experts spread over a process group."""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from .._ops import ops
from ..experts import Sinks
from ..mlp import GroupedMLP, SwiGLUMLP
from ..moe_layer import MoELayer, _AttachAuxLoss
from ..permute import _check_dtype, check_drop_options, expert_capacity, resolve_backend
from ..router import Router, RoutingOutput
from .peer import PeerTransport, peer_unavailable_reason
from .plan import RoutePlan, decode_routes, encode_routes, make_plan
from .transport import (
    TRANSPORTS,
    AllToAllTransport,
    CapacityOverflowError,
    CombineFunction,
    DispatchFunction,
    PaddedAllToAllTransport,
    SymmMemTransport,
    Transport,
)


def resolve_transport(name: str, ep_size: int, device: torch.device) -> str:
    """The transport ``name`` stands for. ``auto``: ``local`` for one rank; else ``peer`` where the
    core's kernels run on ``device``; else ``all_to_all``."""
    if name not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {name!r}")
    if name == "local" and ep_size != 1:
        raise ValueError(f"transport='local' serves a group of one rank, got ep_size={ep_size}")
    if ep_size == 1 and name in ("auto", "local"):
        return "local"
    if name != "auto":
        return name
    if peer_unavailable_reason(torch.device(device)) is None:
        return "peer"
    return "all_to_all"


def kept_experts(routing_experts: torch.Tensor, row_id_map: torch.Tensor, m_splits: torch.Tensor,
                 ep_size: int, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts of the copies that travel (-1: dropped) and how many were dropped for lack of room.

    ``row_id_map`` [T * k] and ``m_splits`` [E] from ``permute_index`` over the
    global experts (-1: dropped by the capacity factor). Each destination rank
    takes at most ``budget`` of this rank's copies, the first in (expert,
    token) order; the others are dropped and counted.
    """
    experts = routing_experts.reshape(-1).to(torch.int64)
    counts = m_splits.view(ep_size, -1)
    rank_start = counts.sum(1).cumsum(0) - counts.sum(1)
    owner = experts.div(counts.shape[1], rounding_mode="floor").clamp(0, ep_size - 1)
    routed = row_id_map >= 0
    fits = (row_id_map - rank_start[owner]) < budget
    kept = torch.where(routed & fits, experts, -1)
    return kept.view(routing_experts.shape), (routed & ~fits).sum()


_TRANSPORTS: dict[tuple, Transport] = {}


def shared_transport(name: str, group: dist.ProcessGroup, ep_size: int, segment_rows: int, **options) -> Transport:
    """One transport per (kind, group, sizes): layers of equal sizes share their buffers (safe: each
    call of a transport waits for every rank to have finished the one before)."""
    key = (name, group.group_name if group is not None else None, ep_size, segment_rows,
           tuple(sorted((k, str(v)) for k, v in options.items())))
    transport = _TRANSPORTS.get(key)
    if transport is None:
        if name == "peer":
            transport = PeerTransport(group, ep_size, segment_rows, **options)
        elif name == "symm_mem":
            transport = SymmMemTransport(group, ep_size, segment_rows, **options)
        elif name == "padded_all_to_all":
            transport = PaddedAllToAllTransport(group, ep_size, segment_rows)
        elif name == "all_to_all":
            transport = AllToAllTransport(group, ep_size, segment_rows)
        else:
            raise ValueError(f"no transport named {name!r}")
        _TRANSPORTS[key] = transport
    return transport


def _per_expert(params, rank: int) -> list[torch.Tensor]:
    """One tensor per expert from a GroupedLinear's weights (rank 2) or biases (rank 1), grouped or not."""
    return [t for p in params for t in (p.unbind(0) if p.dim() == rank + 1 else [p])]


class ExpertParallelMoELayer(nn.Module):
    """A :class:`moe_grouped.MoELayer` whose experts are spread over an expert-parallel group.

    Rank r of ``group`` (``ep_size`` ranks) holds experts ``r * ne`` to
    ``r * ne + ne - 1`` (``ne = num_experts // ep_size``) as a
    :class:`GroupedMLP`. ``forward(x)`` routes this rank's tokens and sends
    each token once to every rank that owns one of its experts, with its
    routing (dispatch); each rank runs its experts on the tokens it received
    and sends back, for each, the sum of its copies' outputs weighted by the
    routing weights (one row however many of the token's experts it holds);
    the token's rank adds the rows up in float32 in rank order (combine).
    Every rank must call ``forward`` (and backward) the same number of times
    in the same order.

    The router and the shared expert are replicated: construct them with the
    same weights on every rank (e.g. with :meth:`load_from` or a broadcast),
    and all-reduce their gradients over the data-parallel ranks as usual —
    this layer does not. The expert weights' gradients are complete on their
    owner. Each rank's output equals :class:`MoELayer` holding all experts run
    on that rank's tokens, up to rounding: each rank's weighted sum is
    rounded to the layer's dtype once before the ranks' sums are added.

    Transports (see :mod:`moe_grouped.parallel.transport`): ``"peer"`` (the
    core's kernels over symmetric memory within a node; capturable; the
    default where it runs), ``"symm_mem"`` (torch's NVSHMEM all-to-all;
    capturable), ``"padded_all_to_all"`` (fixed-size NCCL chunks;
    capturable), ``"all_to_all"`` (host-read counts; NCCL or gloo; not
    capturable), ``"local"`` (one rank), ``"auto"``.

    Capacity: each rank's experts take at most ``capacity`` token copies per
    forward (their activations are sized by it); each source rank sends one
    rank at most ``capacity // ep_size`` copies, the first ones in (expert,
    token) order. Copies past that are dropped like capacity-factor drops
    (they add 0 to the output), counted on the device, and reported by
    :meth:`check_overflow` (:class:`CapacityOverflowError`), which every
    eager forward runs when a capacity was set. The default,
    ``ep_size * max_tokens * top_k`` (every copy of every rank to one rank),
    never drops. Buffers are sized once, on the first forward (outside
    capture), from ``max_tokens`` or that forward's tokens, the largest over
    the group (``capacity`` must be the same on every rank); a later forward
    with more tokens is refused.

    Overlap (``peer``, ``overlap_sms`` > 0): in backward, the combine of the
    input gradient runs on a side stream with ``overlap_sms`` CTAs beside the
    experts' fc1 weight gradient, whose GEMM then takes the device's other SMs.

    Args:
        hidden, ffn_hidden, num_experts, top_k: as :class:`MoELayer`;
            ``num_experts`` must be a multiple of the group's size.
        group: the expert-parallel process group (default: the world).
        transport: ``"auto"``, ``"peer"``, ``"symm_mem"``, ``"padded_all_to_all"``,
            ``"all_to_all"`` or ``"local"``.
        capacity: token copies each rank's experts take per forward (see
            above), >= ep_size; the same on every rank.
        max_tokens: the most tokens one forward takes on this rank (sizes
            the buffers); default: the first forward's; the group's largest.
        num_sms, overlap_sms: CTAs of the ``peer`` transport's calls (default:
            all SMs) and of the backward's combine when it runs beside fc1's
            weight gradient (default 0: it does not; measured slower at ep 2,
            docs/expert-parallel.md).
        router_options, shared_expert_ffn_hidden, aux_loss_coeff,
            z_loss_coeff, capacity_factor, drop_policy, bias,
            single_grouped_weight, fuse_wgrad_accumulation,
            delay_wgrad_compute, dtype, device, backend: as
            :class:`MoELayer`. FP8 experts: run under
            :func:`moe_grouped.fp8.fp8_autocast`.
        pad_to_capacity: refused (the rows an expert receives come from
            every rank, so they cannot be padded to a fixed split).
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
        num_sms: Optional[int] = None,
        overlap_sms: int = 0,
        router_options: Optional[dict[str, Any]] = None,
        shared_expert_ffn_hidden: Optional[int] = None,
        aux_loss_coeff: float = 0.0,
        z_loss_coeff: float = 0.0,
        capacity_factor: Optional[float] = None,
        drop_policy: str = "probs",
        pad_to_capacity: bool = False,
        bias: bool = False,
        single_grouped_weight: bool = True,
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
        if not isinstance(top_k, int) or not 1 <= top_k <= min(num_experts, 32):
            raise ValueError(f"top_k must be an int in [1, min(num_experts, 32)], got {top_k!r}")
        for name, value in (("capacity", capacity), ("max_tokens", max_tokens), ("num_sms", num_sms)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if not isinstance(overlap_sms, int) or isinstance(overlap_sms, bool) or overlap_sms < 0:
            raise ValueError(f"overlap_sms must be a non-negative int (0: no overlap), got {overlap_sms!r}")
        if capacity is not None and capacity < self.ep_size:
            raise ValueError(
                f"capacity must be at least ep_size={self.ep_size} (each source gets capacity // ep_size "
                f"copies), got {capacity}"
            )
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.hidden, self.num_experts, self.top_k = hidden, num_experts, top_k
        self.num_local_experts = num_experts // self.ep_size
        self.transport_name = resolve_transport(transport, self.ep_size, self.device)
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.aux_loss_coeff, self.z_loss_coeff = float(aux_loss_coeff), float(z_loss_coeff)
        self.backend = backend
        self.user_capacity, self.max_tokens = capacity, max_tokens
        self.num_sms, self.overlap_sms = num_sms, overlap_sms
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
        self.segment_rows: Optional[int] = None
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
        if self.capacity is not None:
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
        capacity = self.user_capacity or self.ep_size * self.max_tokens * self.top_k
        # A source sends a rank at most `budget` copies, so at most that many tokens.
        self.segment_rows = min(self.max_tokens, capacity // self.ep_size)
        if self.transport_name != "local":  # one rank may still name a transport: its calls then run on itself
            options = {
                "peer": dict(max_tokens=self.max_tokens, hidden=self.hidden, dtype=tokens.dtype, top_k=self.top_k,
                             device=tokens.device, num_sms=self.num_sms, overlap_sms=self.overlap_sms),
                "symm_mem": dict(max_tokens=self.max_tokens, row_bytes=self.hidden * tokens.element_size(),
                                 extra_bytes=8 * self.top_k, device=tokens.device),
            }.get(self.transport_name, {})
            self.transport = shared_transport(
                self.transport_name, self.group, self.ep_size, self.segment_rows, **options
            )
        self.capacity = capacity

    def _agree_on_sizes(self, device: torch.device) -> None:
        """Every rank sizes its buffers alike: the group's largest ``max_tokens``, and one capacity.

        A sender's budget per destination is its ``capacity // ep_size``, and
        the receiver's experts take its own ``capacity``: with different
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
            raise NotImplementedError(
                "ExpertParallelMoELayer(transport='all_to_all') cannot run under torch.compile: it reads the "
                "per-rank counts on the host. Use transport='local' (one rank), or run eagerly"
            )
        # Under capture or compile the overflow check (a host read) is left to check_overflow().
        capturing = torch.compiler.is_compiling() or (tokens.is_cuda and torch.cuda.is_current_stream_capturing())
        if self.user_capacity is not None and not capturing:
            self.check_overflow()
        routing = self.router(tokens)
        backend = resolve_backend(self.backend, tokens.device)
        _check_dtype(backend, tokens.dtype)
        experts = self._experts_that_travel(routing, backend)
        if self.transport is None:  # one rank
            out = self._run_experts(tokens, routing.weights, experts, backend, is_first_microbatch)
        else:
            plan = make_plan(experts, self.num_local_experts, self.ep_size, self.segment_rows)
            routes = encode_routes(experts, routing.weights)
            decode = functools.partial(
                decode_routes, top_k=self.top_k, first_expert=self.first_expert,
                num_local_experts=self.num_local_experts, dtype=routing.weights.dtype,
            )
            received, weights, local = DispatchFunction.apply(
                tokens, routing.weights, routes, plan, self.transport, decode
            )
            partial = self._run_experts(received, weights, local, backend, is_first_microbatch, plan)
            out = CombineFunction.apply(partial, plan, self.transport)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        if self.training and torch.is_grad_enabled() and (self.aux_loss_coeff or self.z_loss_coeff):
            loss = self.aux_loss_coeff * routing.aux_loss + self.z_loss_coeff * routing.z_loss
            out = _AttachAuxLoss.apply(out, loss)
        self.last_routing = routing.detached()
        return out.view(x.shape)

    def _experts_that_travel(self, routing: RoutingOutput, backend: str) -> torch.Tensor:
        """[T, k] global experts of the copies that travel, -1 for those dropped (capacity factor, or
        past a destination's budget: counted in ``overflow_count``)."""
        num_tokens, top_k = routing.experts.shape
        budget_binds = self.budget < num_tokens * top_k
        if self.capacity_factor is None and not budget_binds:
            return routing.experts
        per_expert, priority = -1, None
        if self.capacity_factor is not None:
            per_expert = expert_capacity(num_tokens, top_k, self.num_experts, self.capacity_factor)
            if self.drop_policy == "probs":
                priority = routing.weights.detach().to(torch.float32).contiguous()
        row_id_map, m_splits = ops.permute_index(
            routing.experts.contiguous(), priority, self.num_experts, per_expert, False, backend
        )
        kept, dropped = kept_experts(routing.experts, row_id_map, m_splits, self.ep_size, self.budget)
        self.overflow_count.add_(dropped)
        return kept

    def _run_experts(self, tokens, weights, experts, backend, is_first_microbatch, plan: Optional[RoutePlan] = None):
        """Each token's local copies through the experts, summed with ``weights``: [rows, hidden].

        ``experts`` [rows, k] this rank's expert of each copy (-1: none). With
        the ``peer`` transport the fused path writes its output straight into
        the transport's buffer and starts the input gradient's combine beside
        the fc1 weight gradient.
        """
        row_id_map, m_splits = ops.permute_index(
            experts.contiguous(), None, self.num_local_experts, -1, False, backend
        )
        if self.experts.uses_fused_path(tokens):
            sinks = self._sinks(plan) if isinstance(self.transport, PeerTransport) else None
            # The buffer's rows past the copies (the capacity is a worst case) belong to no expert and
            # nothing reads them, so they are not zeroed: that would be a pass over capacity rows.
            return self.experts.forward_routed(
                tokens, weights, row_id_map, m_splits, self.capacity, zero_unmapped=False, permute_backend=backend,
                sinks=sinks, is_first_microbatch=is_first_microbatch,
            )
        permuted = ops.permute_rows(tokens, row_id_map, self.top_k, self.capacity, True, backend)
        expert_out = self.experts(permuted, m_splits, is_first_microbatch)
        return ops.unpermute_rows(expert_out, row_id_map, weights, self.top_k, backend)

    def _sinks(self, plan: RoutePlan) -> Sinks:
        transport: PeerTransport = self.transport  # type: ignore[assignment]
        buffer = transport.partial_buffer()
        if not transport.overlap_sms:
            return Sinks(out=buffer, grad_tokens=buffer)

        def start_combine(grad_tokens, grad_weights):
            plan.cache["pending_combine"] = transport.combine_beside(grad_tokens, grad_weights, plan)

        return Sinks(out=buffer, grad_tokens=buffer, on_grad_tokens=start_combine,
                     gemm_sms=transport.device_sms - transport.overlap_sms)

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


__all__ = ["ExpertParallelMoELayer", "CapacityOverflowError", "resolve_transport", "kept_experts", "shared_transport"]
