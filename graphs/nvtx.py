"""NVTX ranges for profilers (Nsight Systems): a no-op without the nvtx package.

``range(name)`` works as a context manager and as a decorator. Set
``MOE_GROUPED_NVTX=0`` to turn the ranges off even when nvtx is installed.
"""

from __future__ import annotations

import builtins
import contextlib
import os

try:
    import nvtx as _nvtx
except ImportError:  # the ranges are a profiling aid, never a requirement
    _nvtx = None

_DOMAIN = "moe_grouped"


def enabled() -> bool:
    """True when ranges are being emitted."""
    return _nvtx is not None and os.environ.get("MOE_GROUPED_NVTX", "1") != "0"


class range(contextlib.ContextDecorator):  # noqa: A001 (mirrors nvtx's own name)
    """Marks a named region: ``with range("x"):`` or ``@range("x")``."""

    def __init__(self, name: str):
        if not isinstance(name, str):
            raise TypeError(f"an nvtx range name must be a str, got {builtins.type(name).__name__}")
        self.name = name

    def __enter__(self):
        if enabled():
            _nvtx.push_range(self.name, domain=_DOMAIN)
        return self

    def __exit__(self, *exc):
        if enabled():
            _nvtx.pop_range(domain=_DOMAIN)
        return False


__all__ = ["range", "enabled"]
