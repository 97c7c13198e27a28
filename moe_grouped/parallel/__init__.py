"""Expert parallelism: an MoE layer whose experts are spread over a process group.

:class:`ExpertParallelMoELayer` sends each token copy to the rank that owns
its expert (dispatch), runs the local experts' grouped GEMMs on what arrived,
and sends the results back (combine). The tokens per (rank, expert) stay on
the device with the ``symm_mem`` and ``local`` transports, so the whole layer
step can be captured in a CUDA graph; ``all_to_all`` is the host-split
reference (CPU/gloo and NCCL, not capturable). See :mod:`.transport`.
"""

from __future__ import annotations

from .layer import ExpertParallelMoELayer
from .transport import (
    TRANSPORTS,
    AllToAllTransport,
    CapacityOverflowError,
    LocalTransport,
    SymmMemTransport,
    Transport,
    make_transport,
)

__all__ = [
    "ExpertParallelMoELayer",
    "Transport",
    "AllToAllTransport",
    "SymmMemTransport",
    "LocalTransport",
    "make_transport",
    "TRANSPORTS",
    "CapacityOverflowError",
]
