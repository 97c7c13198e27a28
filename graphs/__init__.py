"""Capture and replay helpers for CUDA graphs, usable on any torch module.

Shipped as ``moe_grouped.graphs``; it never imports ``moe_grouped``.

- :func:`make_graphed_callables`: forward/backward (and delayed-wgrad) graphs
  of modules or functions in one memory pool, in a given schedule, with
  static input buffers (``m_splits`` included) refreshed by copy.
- :func:`capture_step`: a whole training step (forward, backward, optimizer).
- :mod:`.inspect`: a captured graph's nodes via cuda-python;
  :func:`assert_graph_safe`.
- :mod:`.splits`: token-split generators; :mod:`.testing`: the replay harness.
- :mod:`.nvtx`: profiler ranges, a no-op without the nvtx package.

``inspect`` and ``testing`` load lazily (``graphs.inspect``, ``graphs.testing``).
"""

from . import nvtx, splits
from .callables import GraphedCallable, ReplayOrderError, Schedule, make_graphed_callables
from .step import StepGraph, capture_step, check_optimizers


def __getattr__(name):
    if name in ("inspect", "testing"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    if name in ("assert_graph_safe", "graph_nodes", "GraphSafetyError"):
        from . import inspect

        return getattr(inspect, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "make_graphed_callables",
    "GraphedCallable",
    "Schedule",
    "ReplayOrderError",
    "capture_step",
    "StepGraph",
    "check_optimizers",
    "assert_graph_safe",
    "graph_nodes",
    "GraphSafetyError",
    "inspect",
    "testing",
    "splits",
    "nvtx",
]
