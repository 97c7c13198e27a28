"""Where this rank's tokens go in an expert-parallel step: computed once per forward, on the device.

A token travels once to every rank that owns at least one of its (kept)
experts, however many of its copies that rank holds; the rank that receives
it applies its local experts to it and sends back one row, the weighted sum
of those copies' outputs (see :mod:`moe_grouped.parallel.transport`). So
each (source, destination) pair moves at most ``num_tokens`` rows, in token
order:

- ``pos`` [T, ep] int32: token t's row among those sent to rank d (-1: none);
- ``index`` [ep, S] int32: the token of each row sent to rank d (-1 past the count);
- ``counts`` [ep] int32: the rows sent to each rank.

``S`` (``segment_rows``) bounds every destination's rows; the layer keeps
each destination within it. :func:`make_plan` computes the three with the
core's kernels (``mg_ep_plan``) where they run, else with torch ops; both give the
same tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .. import _core


@dataclass
class RoutePlan:
    """One forward's token routes (see the module docstring); reused by its backward."""

    pos: torch.Tensor
    index: torch.Tensor
    counts: torch.Tensor
    segment_rows: int
    # What a transport learns in its first dispatch and needs again (e.g. the
    # rows each source sent here); keyed by the transport.
    cache: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.pos.shape[0]

    @property
    def ep_size(self) -> int:
        return self.pos.shape[1]


def plan_kernel_unavailable_reason(device: torch.device) -> Optional[str]:
    """Why :func:`make_plan` cannot use the core's kernel on ``device``, or None."""
    if device.type != "cuda":
        return "not a CUDA device"
    if not _core.available():
        return f"the CUDA core is unavailable: {_core.unavailable_reason}"
    if not _core.has(_core.CAP_EP_TRANSPORT):
        return "the core was built without csrc/ep"
    return None


def make_plan(experts: torch.Tensor, experts_per_rank: int, ep_size: int, segment_rows: int) -> RoutePlan:
    """The routes of tokens whose chosen experts are ``experts`` [T, k] (global; -1: a dropped copy)."""
    if experts.dim() != 2:
        raise ValueError(f"experts must have shape [tokens, top_k], got {tuple(experts.shape)}")
    if plan_kernel_unavailable_reason(experts.device) is None:
        return _plan_cuda(experts.to(torch.int64).contiguous(), experts_per_rank, ep_size, segment_rows)
    return plan_torch(experts, experts_per_rank, ep_size, segment_rows)


def plan_torch(experts: torch.Tensor, experts_per_rank: int, ep_size: int, segment_rows: int) -> RoutePlan:
    """:func:`make_plan` with torch ops (any device; the reference for the core's kernel)."""
    num_tokens = experts.shape[0]
    device = experts.device
    experts = experts.to(torch.int64)
    valid = (experts >= 0) & (experts < experts_per_rank * ep_size)
    owner = torch.where(valid, experts.div(experts_per_rank, rounding_mode="floor"), ep_size)
    goes = torch.zeros(num_tokens, ep_size + 1, dtype=torch.bool, device=device)
    goes.scatter_(1, owner, True)
    goes = goes[:, :ep_size]
    before = torch.cumsum(goes.to(torch.int32), 0, dtype=torch.int32) - goes.to(torch.int32)
    sent = goes & (before < segment_rows)
    pos = torch.where(sent, before, -1).to(torch.int32)
    counts = sent.sum(0, dtype=torch.int32)
    # index[d, pos[t, d]] = t: one scatter into a spare slot for the tokens not sent.
    slot = torch.where(sent, torch.arange(ep_size, device=device) * segment_rows + before, ep_size * segment_rows)
    index = torch.full((ep_size * segment_rows + 1,), -1, dtype=torch.int32, device=device)
    token = torch.arange(num_tokens, dtype=torch.int32, device=device).unsqueeze(1).expand(-1, ep_size)
    index.scatter_(0, slot.reshape(-1), token.reshape(-1))
    return RoutePlan(pos, index[:-1].view(ep_size, segment_rows), counts, segment_rows)


def _plan_cuda(experts: torch.Tensor, experts_per_rank: int, ep_size: int, segment_rows: int) -> RoutePlan:
    num_tokens, top_k = experts.shape
    device = experts.device
    pos = torch.empty(num_tokens, ep_size, dtype=torch.int32, device=device)
    index = torch.empty(ep_size, segment_rows, dtype=torch.int32, device=device)
    counts = torch.empty(ep_size, dtype=torch.int32, device=device)
    # Used between the call's two kernels only, so a per-call tensor is safe in a captured graph.
    scratch = torch.empty(_core.lib.mg_ep_plan_scratch_bytes(num_tokens, ep_size) // 4, dtype=torch.int32,
                          device=device)
    with torch.cuda.device(device):
        _core.check(
            _core.lib.mg_ep_plan(
                experts.data_ptr(), num_tokens, top_k, experts_per_rank, ep_size, segment_rows,
                pos.data_ptr(), index.data_ptr(), counts.data_ptr(), scratch.data_ptr(), _core.stream_handle(device),
            )
        )
    return RoutePlan(pos, index, counts, segment_rows)


def extra_dtype(weights_dtype: torch.dtype) -> torch.dtype:
    """The dtype routing weights travel in (and their gradients come back in): float64 for float64
    weights, else float32, which holds bf16 and fp16 exactly."""
    return torch.float64 if weights_dtype == torch.float64 else torch.float32


def encode_routes(experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[T, k + k * w] int32 that travels with each token: its experts plus one (0: no copy) and the
    bits of its routing weights in their travel dtype (``extra_dtype``: float32, or float64 for
    float64 weights, w = 2). Zero rows (nothing received) decode to no copies."""
    shifted = torch.where(experts >= 0, experts + 1, 0).to(torch.int32)
    bits = weights.detach().to(extra_dtype(weights.dtype)).contiguous().view(torch.int32)
    return torch.cat([shifted, bits], dim=1)


def decode_routes(routes: torch.Tensor, top_k: int, first_expert: int, num_local_experts: int, dtype: torch.dtype):
    """``(local_experts [R, k] int64, weights [R, k] dtype)`` of received rows: each copy's expert
    among this rank's (-1: a copy for another rank, or none), and the token's routing weights."""
    expert = routes[:, :top_k].to(torch.int64) - 1 - first_expert
    local = torch.where((expert >= 0) & (expert < num_local_experts), expert, -1)
    weights = routes[:, top_k:].contiguous().view(extra_dtype(dtype)).to(dtype)
    return local, weights
