"""moe_grouped: graph-safe grouped GEMMs and MoE layers for PyTorch.

Everything downstream of the router takes the tokens per expert
(``m_splits``) as a device tensor and never reads it on the host, so whole
MoE training steps can be captured in CUDA graphs once and replayed while the
routing changes every step.
"""

from __future__ import annotations

from . import graphs  # noqa: F401  (capture/replay helpers, usable on any module)
from . import backends, fp8, gemm, workspace
from ._checks import debug_checks_enabled, set_debug_checks
from ._core import CaptureError, CoreError, UnsupportedError
from .activation import swiglu
from .grouped_linear import GroupedLinear
from .mlp import GroupedMLP, SwiGLUMLP
from .moe_layer import MoELayer
from .permute import permute, permute_index, unpermute
from .router import Router, RoutingOutput
from .gemm import grouped_dbias, grouped_dgrad, grouped_fprop, grouped_wgrad, splits_to_offsets

__version__ = "0.1.0"

__all__ = [
    "GroupedLinear",
    "GroupedMLP",
    "SwiGLUMLP",
    "MoELayer",
    "Router",
    "RoutingOutput",
    "permute",
    "permute_index",
    "unpermute",
    "swiglu",
    "grouped_fprop",
    "grouped_dgrad",
    "grouped_wgrad",
    "grouped_dbias",
    "splits_to_offsets",
    "set_debug_checks",
    "debug_checks_enabled",
    "backends",
    "gemm",
    "fp8",
    "workspace",
    "graphs",
    "CoreError",
    "CaptureError",
    "UnsupportedError",
]
