"""Backend names and the choice of a default.

- ``cuda``: the CUDA core (CUTLASS SM90 grouped GEMMs). Default on sm_90 when
  the core is built with its grouped GEMMs.
- ``torch``: ``torch._grouped_mm`` with device offsets; graph-safe; the default
  on other GPUs and the fallback where the core is missing.
- ``reference``: per-expert PyTorch loops; runs anywhere, reads the token
  counts on the host (so it cannot be captured); the test oracle and the
  default on machines without a GPU.

A backend named explicitly is used or fails loudly; it is never swapped for
another behind the caller's back.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from . import _core

BACKENDS = ("reference", "torch", "cuda")


def check_name(backend: Optional[str]) -> Optional[str]:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None (automatic), got {backend!r}")
    return backend


def assume_constant_result(fn: Callable) -> Callable:
    """``torch.compiler.assume_constant_result`` without importing Dynamo.

    torch's decorator imports ``torch._dynamo`` (about 2 s) just to set the
    attribute Dynamo reads when it traces a call to ``fn``; setting it here
    keeps that import out of ``import moe_grouped``
    (tests/test_import.py checks both).
    """
    fn._dynamo_marked_constant = True
    return fn


# Per GPU index: why the core's kernels cannot run on its architecture (None: they can).
_ARCH_REASONS: dict[int, Optional[str]] = {}


# A constant for the process (the core loaded at import, the GPU's
# architecture): torch.compile evaluates it once while tracing instead of
# tracing the device queries.
@assume_constant_result
def core_kernels_unavailable_reason(device: torch.device, capability: int, kernels: str) -> Optional[str]:
    """Why the core's ``kernels`` (the family behind ``capability``, a
    ``_core.CAP_*`` bit) cannot run on ``device``, or None if they can."""
    if device.type != "cuda":
        return f"the cuda backend needs CUDA tensors, got tensors on {device}"
    if not _core.available():
        return _core.unavailable_reason
    if not _core.has(capability):
        return f"the core was built without its {kernels}"
    index = _core.device_index(device)
    if index not in _ARCH_REASONS:  # asked for every op of every call: the device query once per GPU
        major, minor = torch.cuda.get_device_capability(index)
        _ARCH_REASONS[index] = None if (major, minor) == (9, 0) else (
            f"the core's kernels are built for sm_90a (Hopper), but {torch.cuda.get_device_name(index)} "
            f"is sm_{major}{minor}"
        )
    return _ARCH_REASONS[index]


def cuda_unavailable_reason(device: torch.device) -> Optional[str]:
    """Why the ``cuda`` backend cannot run on ``device``, or None if it can."""
    return core_kernels_unavailable_reason(device, _core.CAP_GROUPED_GEMM_16BIT, "grouped GEMM kernels")


def resolve_kernel_family(
    backend: Optional[str], device: torch.device, cuda_unavailable: Callable[[torch.device], Optional[str]], ops: str
) -> str:
    """The backend for ops whose ``cuda`` backend is one family of the core's
    kernels (``cuda_unavailable(device)`` says why it cannot run, or None):
    the one asked for, or a RuntimeError naming ``ops`` when that is ``cuda``
    and it cannot run; by default ``cuda`` where it runs, ``torch`` on other
    GPUs and ``reference`` on the CPU."""
    check_name(backend)
    if backend is None:
        if device.type != "cuda":
            return "reference"
        return "cuda" if cuda_unavailable(device) is None else "torch"
    if backend == "cuda":
        reason = cuda_unavailable(device)
        if reason is not None:
            raise RuntimeError(f"backend 'cuda' was requested for {ops} but is unavailable: {reason}")
    return backend


def torch_unavailable_reason(device: torch.device) -> Optional[str]:
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    return None


def default_backend(device: torch.device) -> str:
    if device.type != "cuda":
        return "reference"
    if cuda_unavailable_reason(device) is None:
        return "cuda"
    return "torch"


def resolve(backend: Optional[str], device: torch.device) -> str:
    """The backend to run on ``device``: the one asked for, or the default."""
    check_name(backend)
    if backend is None:
        return default_backend(device)
    reason = None
    if backend == "cuda":
        reason = cuda_unavailable_reason(device)
    elif backend == "torch":
        reason = torch_unavailable_reason(device)
    if reason is not None:
        raise RuntimeError(f"backend {backend!r} was requested but is unavailable: {reason}")
    return backend


def available_backends(device: torch.device) -> list[str]:
    names = ["reference"]
    if torch_unavailable_reason(device) is None:
        names.append("torch")
    if cuda_unavailable_reason(device) is None:
        names.append("cuda")
    return names
