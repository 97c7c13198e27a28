"""The FP8 block-scaling recipe (DeepSeek-V3 style) and its autocast context."""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

BLOCK = 128  # activations and gradients: 1 x 128 tiles; weights: 128 x 128

_FORMATS = ("E4M3", "HYBRID")


def check_scale_options(pow2_scales: object, amax_epsilon: object) -> None:
    """TypeError/ValueError naming the scale option that is wrong (the recipe's and every quantizer's)."""
    if not isinstance(pow2_scales, bool):
        raise TypeError(f"pow2_scales must be True or False, got {pow2_scales!r}")
    if (
        not isinstance(amax_epsilon, (int, float))
        or isinstance(amax_epsilon, bool)
        or not math.isfinite(amax_epsilon)
        or amax_epsilon < 0
    ):
        raise ValueError(f"amax_epsilon must be a finite number >= 0, got {amax_epsilon!r}")


@dataclass(frozen=True)
class Float8BlockScaling:
    """How GroupedLinear quantizes to FP8 inside :func:`fp8_autocast`.

    Activations and output gradients get one scale per row per 128 columns
    (1x128), weights one per 128x128 tile. Accumulation is always split
    (full fp32 accumulation, no fast-accum), as TransformerEngine's
    Float8BlockScaling recipe fixes it.

    Args:
        fp8_format: ``"E4M3"`` for everything, or ``"HYBRID"``: E4M3 forward,
            E5M2 for gradients.
        pow2_scales: round every scale down to a power of two (numerical parity
            with split-quantize paths; exact scaling by exponent shifts).
        amax_epsilon: lower bound applied to each block's amax before the
            scale is computed.
    """

    fp8_format: str = "E4M3"
    pow2_scales: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self):
        if self.fp8_format not in _FORMATS:
            raise ValueError(f"fp8_format must be one of {_FORMATS}, got {self.fp8_format!r}")
        check_scale_options(self.pow2_scales, self.amax_epsilon)

    @property
    def forward_dtype(self) -> torch.dtype:
        """FP8 type of activations and weights."""
        return torch.float8_e4m3fn

    @property
    def backward_dtype(self) -> torch.dtype:
        """FP8 type of output gradients."""
        return torch.float8_e5m2 if self.fp8_format == "HYBRID" else torch.float8_e4m3fn


_state = threading.local()


def get_fp8_recipe() -> Optional[Float8BlockScaling]:
    """The recipe of the innermost active :func:`fp8_autocast`, or None."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def fp8_autocast(recipe: Optional[Float8BlockScaling] = None, enabled: bool = True) -> Iterator[None]:
    """Run the GroupedLinear layers called inside in FP8 with ``recipe``.

    ``enabled=False`` turns FP8 off inside an enclosing autocast. The choice is
    made at forward time; backward uses the recipe its forward saw.
    """
    if recipe is None:
        recipe = Float8BlockScaling()
    if not isinstance(recipe, Float8BlockScaling):
        raise TypeError(f"recipe must be a Float8BlockScaling, got {type(recipe).__name__}")
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(recipe if enabled else None)
    try:
        yield
    finally:
        stack.pop()
