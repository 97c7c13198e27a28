"""Persistent GEMM workspaces, one per (device, slot).

Captured kernels read their per-group arguments (offsets, shapes, pointers)
from these buffers at replay, so the buffers must outlive every graph that
uses them and must never be handed back to a memory pool. Each (device, slot)
holds one allocation that grows only outside capture; run one eager step (or
call :func:`reserve`) before capturing.

Slot 0 serves fprop and dgrad, slot 1 wgrad: two GEMMs that can be in one
graph never share a workspace.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Union

import torch

from . import _core

SLOT_FPROP_DGRAD = _core.SLOT_FPROP_DGRAD
SLOT_WGRAD = _core.SLOT_WGRAD

DeviceLike = Union[int, str, torch.device]


@dataclass(frozen=True)
class WorkspaceStats:
    """What one (device, slot) holds."""

    capacity: int
    high_water: int
    retired_bytes: int
    grow_count: int


def _device_index(device: DeviceLike) -> int:
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"workspaces live on CUDA devices, got device {device}")
    return _core.device_index(device)


def reserve(device: DeviceLike, slot: int, nbytes: int) -> None:
    """Grows (device, slot) to at least ``nbytes``. Must not run during capture."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be non-negative, got {nbytes}")
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "moe_grouped.workspace.reserve() was called while a CUDA graph is being captured; "
            "reserve workspaces before the capture starts"
        )
    lib = _core.require()
    _core.check(lib.mg_workspace_reserve(_device_index(device), slot, nbytes))


def get(device: DeviceLike, slot: int, nbytes: int) -> int:
    """Address of the (device, slot) buffer, at least ``nbytes`` long.

    Grows the buffer when called outside capture; raises
    :class:`moe_grouped.CaptureError` naming the bytes to reserve when it is
    too small during capture.
    """
    lib = _core.require()
    index = _device_index(device)
    pointer = ctypes.c_void_p()
    stream = _core.stream_handle(torch.device("cuda", index))
    _core.check(lib.mg_workspace_get(index, slot, nbytes, stream, ctypes.byref(pointer)))
    return pointer.value


def stats(device: DeviceLike, slot: int) -> WorkspaceStats:
    """Capacity, largest request and allocation count of (device, slot)."""
    lib = _core.require()
    raw = _core.WorkspaceStats()
    _core.check(lib.mg_workspace_stats_get(_device_index(device), slot, ctypes.byref(raw)))
    return WorkspaceStats(raw.capacity, raw.high_water, raw.retired_bytes, raw.grow_count)


def release(device: Union[DeviceLike, None] = None, slot: int = -1) -> None:
    """Frees workspaces (all of them by default).

    .. warning:: Graphs captured with these workspaces must not be replayed
       afterwards: they would read freed memory.
    """
    lib = _core.require()
    index = -1 if device is None else _device_index(device)
    _core.check(lib.mg_workspace_release(index, slot))
