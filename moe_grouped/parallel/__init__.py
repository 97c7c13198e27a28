"""Expert parallelism: an MoE layer whose experts are spread over a process group.

:class:`ExpertParallelMoELayer` sends each token once to every rank that
owns one of its experts (dispatch), runs the local experts on what arrived,
and brings back each rank's weighted sum of the token's copies (combine).
The routes stay on the device with every transport but ``all_to_all``, so
the whole layer step can be captured in a CUDA graph; ``peer``, the core's
kernels over symmetric memory within a node, is the default on GPUs that
run it. See :mod:`.transport` and :mod:`.peer`.
"""

from __future__ import annotations

from .layer import ExpertParallelMoELayer, resolve_transport
from .peer import PeerTransport, peer_unavailable_reason
from .plan import RoutePlan, make_plan
from .transport import (
    TRANSPORTS,
    AllToAllTransport,
    CapacityOverflowError,
    PaddedAllToAllTransport,
    SymmMemTransport,
    Transport,
)

__all__ = [
    "ExpertParallelMoELayer",
    "Transport",
    "PeerTransport",
    "SymmMemTransport",
    "PaddedAllToAllTransport",
    "AllToAllTransport",
    "RoutePlan",
    "make_plan",
    "resolve_transport",
    "peer_unavailable_reason",
    "TRANSPORTS",
    "CapacityOverflowError",
]
