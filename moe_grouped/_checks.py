"""Argument checks shared by the ops and the modules.

Every check raises ValueError or TypeError with the offending values. The
token counts in a device ``m_splits`` are never read on the host unless debug
checks are on (:func:`set_debug_checks`): that read would synchronise and
break CUDA-graph capture.
"""

from __future__ import annotations

import os
from typing import Sequence, Union

import torch

SplitsLike = Union[torch.Tensor, Sequence[int]]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
SPLIT_DTYPES = (torch.int32, torch.int64)

_debug_checks = os.environ.get("MOE_GROUPED_DEBUG_CHECKS", "0") not in ("", "0")


def set_debug_checks(enabled: bool) -> None:
    """Also validate device ``m_splits`` (non-negative, summing to the rows).

    Outside capture this reads the counts on the host (a synchronisation);
    during capture it records a device-side assertion instead. Off by default;
    the environment variable ``MOE_GROUPED_DEBUG_CHECKS=1`` turns it on.
    """
    global _debug_checks
    _debug_checks = bool(enabled)


def debug_checks_enabled() -> bool:
    return _debug_checks


def check_tensor(name: str, tensor: object, *, dim: int, dtypes=FLOAT_DTYPES) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous, got shape {tuple(tensor.shape)} with strides "
            f"{tuple(tensor.stride())}; call .contiguous() first"
        )
    return tensor


def check_out_dtype(out_dtype: object) -> None:
    """``out_dtype`` of the grouped ops: None or a floating-point dtype the ops compute in."""
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        allowed = ", ".join(str(d) for d in FLOAT_DTYPES)
        raise TypeError(f"out_dtype must be None or one of ({allowed}), got {out_dtype!r}")


def check_num_groups(num_groups: object) -> None:
    if not isinstance(num_groups, int) or isinstance(num_groups, bool) or num_groups < 1:
        raise ValueError(f"num_groups must be a positive int (the number of experts), got {num_groups!r}")


def groups_of_splits(m_splits: object) -> int:
    """The number of experts ``m_splits`` holds counts for (its length), with errors naming it."""
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dim() != 1:
            raise ValueError(f"m_splits must be 1-D (one count per expert), got shape {tuple(m_splits.shape)}")
        return m_splits.shape[0]
    if isinstance(m_splits, (list, tuple)):
        return len(m_splits)
    raise TypeError(f"m_splits must be a tensor or a list of ints, got {type(m_splits).__name__}")


def check_same_device(reference_name: str, reference: torch.Tensor, **others) -> None:
    for name, tensor in others.items():
        if tensor is not None and tensor.device != reference.device:
            raise ValueError(
                f"{name} is on {tensor.device} but {reference_name} is on {reference.device}"
            )


def check_weights(weights: Sequence[torch.Tensor]) -> tuple[int, int, int]:
    """Validates the grouped weights and returns (num_groups, n, k).

    ``weights`` is either ``[W]`` with W of shape [E, N, K] or E tensors of
    shape [N, K], all of one dtype and device.
    """
    if isinstance(weights, torch.Tensor) or not isinstance(weights, (list, tuple)):
        raise TypeError(
            "weights must be a list: [W] with W of shape [E, N, K], or E tensors of shape [N, K]; "
            f"got {type(weights).__name__}"
        )
    if len(weights) == 0:
        raise ValueError("weights must not be empty")
    first = weights[0]
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"weights[0] must be a torch.Tensor, got {type(first).__name__}")
    if len(weights) == 1 and first.dim() == 3:
        check_tensor("weights[0]", first, dim=3)
        if first.shape[0] == 0:
            raise ValueError(f"weights[0] must hold at least one expert ([E, N, K] with E >= 1), got shape "
                             f"{tuple(first.shape)}")
        return first.shape[0], first.shape[1], first.shape[2]
    for i, weight in enumerate(weights):
        check_tensor(f"weights[{i}]", weight, dim=2)
        if weight.shape != first.shape or weight.dtype != first.dtype or weight.device != first.device:
            raise ValueError(
                f"weights[{i}] has shape {tuple(weight.shape)}, dtype {weight.dtype} on {weight.device}, "
                f"but weights[0] has shape {tuple(first.shape)}, dtype {first.dtype} on {first.device}"
            )
    return len(weights), first.shape[0], first.shape[1]


def normalize_splits(
    m_splits: SplitsLike, num_groups: int, total_rows: int, device: torch.device, *, backend: str = ""
) -> torch.Tensor:
    """Returns ``m_splits`` as a 1-D int32/int64 tensor on ``device``.

    Host splits (a list or a CPU tensor used with CUDA data) are validated
    fully on the host: non-negative, summing to ``total_rows``. Device splits
    are checked for dtype, shape and device only, unless debug checks are on
    or ``backend`` is ``"reference"`` (which reads the counts on the host
    anyway): then their values too, non-negative and summing to at most
    ``total_rows`` -- a device ``m_splits`` may cover fewer rows than the
    buffer (``permute`` with a capacity: the rows past the sum belong to no
    expert, and the grouped ops give zeros there; see :mod:`moe_grouped.gemm`).
    """
    if device.type == "cuda" and device.index is None:  # device="cuda" names the current GPU (cuda:0 != cuda)
        device = torch.device("cuda", torch.cuda.current_device())
    if isinstance(m_splits, torch.Tensor) and m_splits.device == device:
        _check_split_tensor(m_splits, num_groups)
        if _debug_checks or backend == "reference":
            _check_split_values_on_device(m_splits, total_rows)
        return m_splits
    if isinstance(m_splits, torch.Tensor):
        if m_splits.device.type != "cpu":
            raise ValueError(f"m_splits is on {m_splits.device} but the tokens are on {device}")
        _check_split_tensor(m_splits, num_groups)
        counts = m_splits.tolist()
    elif isinstance(m_splits, (list, tuple)):
        counts = list(m_splits)
        if not all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
            raise TypeError(f"m_splits must hold Python ints, got {counts!r}")
        if len(counts) != num_groups:
            raise ValueError(f"m_splits must have {num_groups} entries (one per expert), got {len(counts)}")
    else:
        raise TypeError(
            f"m_splits must be a tensor or a list of ints, got {type(m_splits).__name__}"
        )
    _check_split_values(counts, total_rows)
    if (
        not torch.compiler.is_compiling()  # a host query Dynamo cannot trace; a compiled graph is captured whole
        and device.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.is_current_stream_capturing()
    ):
        raise RuntimeError(
            "m_splits given as host data while a CUDA graph is being captured: copying it to the "
            "device cannot be captured. Pass m_splits as a device tensor (a static input of the graph)"
        )
    return torch.tensor(counts, dtype=torch.int64, device=device)


def _check_split_tensor(m_splits: torch.Tensor, num_groups: int) -> None:
    if m_splits.dtype not in SPLIT_DTYPES:
        raise TypeError(f"m_splits must be int32 or int64, got {m_splits.dtype}")
    if m_splits.dim() != 1 or m_splits.shape[0] != num_groups:
        raise ValueError(
            f"m_splits must have shape ({num_groups},) (one count per expert), got {tuple(m_splits.shape)}"
        )


def _check_split_values(counts: Sequence[int], total_rows: int, *, exact: bool = True) -> None:
    negative = [(i, c) for i, c in enumerate(counts) if c < 0]
    if negative:
        raise ValueError(f"m_splits must be non-negative, got negative counts at (expert, count) {negative}")
    if exact and sum(counts) != total_rows:
        raise ValueError(
            f"m_splits must sum to the number of rows {total_rows}, got sum {sum(counts)} from {list(counts)}"
        )
    if sum(counts) > total_rows:
        raise ValueError(
            f"m_splits must sum to the number of rows {total_rows} or fewer (rows past the sum belong to no "
            f"expert), got sum {sum(counts)} from {list(counts)}"
        )


def _check_split_values_on_device(m_splits: torch.Tensor, total_rows: int) -> None:
    counts = m_splits.to(torch.int64)  # an int32 sum could wrap
    valid = (counts >= 0).all() & (counts.sum() <= total_rows)
    # A compiled graph cannot read the values on the host either: assert on the device.
    if torch.compiler.is_compiling() or (m_splits.is_cuda and torch.cuda.is_current_stream_capturing()):
        torch._assert_async(valid, "moe_grouped debug check: m_splits negative or summing past the rows")
        return
    if not bool(valid):
        _check_split_values(m_splits.tolist(), total_rows, exact=False)
