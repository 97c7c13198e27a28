"""NVTX ranges for profilers (Nsight Systems): a no-op without the nvtx package.

``range(name)`` works as a context manager and as a decorator. Ranges are
emitted when a tool listens: Nsight Systems and Nsight Compute set
``NVTX_INJECTION64_PATH`` in the processes they launch, and without an
injected tool every NVTX call is a no-op anyway, so the ranges cost nothing
then. ``MOE_GROUPED_NVTX=0`` turns them off, ``=1`` on whatever the
environment; both are read at import (a range per op would otherwise read the
environment on every call): call :func:`set_enabled` to change it later.
"""

from __future__ import annotations

import builtins
import contextlib
import os
from typing import Optional

try:
    import nvtx as _nvtx
except ImportError:  # the ranges are a profiling aid, never a requirement
    _nvtx = None

_DOMAIN = "moe_grouped"
ENV = "MOE_GROUPED_NVTX"
INJECTION_ENV = "NVTX_INJECTION64_PATH"


def _from_environment() -> bool:
    setting = os.environ.get(ENV, "")
    if _nvtx is None or setting == "0":
        return False
    return setting == "1" or bool(os.environ.get(INJECTION_ENV))


_enabled = _from_environment()


def enabled() -> bool:
    """True when ranges are being emitted."""
    return _enabled


def set_enabled(on: Optional[bool] = None) -> None:
    """Turns the ranges on or off (never on without the nvtx package); None: as the environment says now."""
    global _enabled
    _enabled = _from_environment() if on is None else bool(on) and _nvtx is not None


class range(contextlib.ContextDecorator):  # noqa: A001 (mirrors nvtx's own name)
    """Marks a named region: ``with range("x"):`` or ``@range("x")``."""

    def __init__(self, name: str):
        if not isinstance(name, str):
            raise TypeError(f"an nvtx range name must be a str, got {builtins.type(name).__name__}")
        self.name = name
        self._pushed = False

    def _recreate_cm(self):  # as a decorator: a range per call, so that nested calls keep their own _pushed
        return type(self)(self.name)

    def __enter__(self):
        # Remembered per range, so that set_enabled between enter and exit cannot unbalance the stack.
        self._pushed = _enabled
        if self._pushed:
            _nvtx.push_range(self.name, domain=_DOMAIN)
        return self

    def __exit__(self, *exc):
        if self._pushed:
            _nvtx.pop_range(domain=_DOMAIN)
        return False


__all__ = ["range", "enabled", "set_enabled"]
