"""Loads the CUDA core (``libmoe_grouped_core.so``) with ctypes.

The library is optional: when it is missing or cannot load, :data:`lib` is
``None`` and :data:`unavailable_reason` says why. Every C call returns an
``mg_status``; :func:`check` turns a failure into a Python exception carrying
the core's own message.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
from typing import Optional

import torch

ABI_VERSION = 3
LIBRARY_ENV = "MOE_GROUPED_CORE_LIB"

# mg_status
OK = 0
ERROR_INVALID_ARGUMENT = 1
ERROR_CAPTURE = 2
ERROR_CUDA = 3
ERROR_UNSUPPORTED = 4
ERROR_OUT_OF_MEMORY = 5
ERROR_INTERNAL = 6

# mg_capabilities bits
CAP_SETUP = 1
CAP_GROUPED_GEMM_16BIT = 2
CAP_GROUPED_GEMM_FP8_BLOCKWISE = 4
CAP_PERMUTE = 8
CAP_FP8_QUANTIZE = 16
CAP_SWIGLU = 32
CAP_GATHERED_GEMM = 64
CAP_DGRAD_SWIGLU = 128
CAP_FPROP_SWIGLU = 256
CAP_EP_TRANSPORT = 512
CAP_EXPERTS_SEQUENCE = 1024
CAP_EXPERTS_SEQUENCE_FP8 = 2048

# mg_gemm_kind
GEMM_FPROP = 0
GEMM_DGRAD = 1
GEMM_WGRAD = 2

# Workspace slots: fprop/dgrad share one, wgrad has its own (they can sit in
# one backward graph, and a GEMM may keep state in its workspace).
SLOT_FPROP_DGRAD = 0
SLOT_WGRAD = 1
MAX_SLOTS = 8

_DTYPE_CODES = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.int32: 3,
    torch.int64: 4,
    torch.float8_e4m3fn: 5,
    torch.float8_e5m2: 6,
}


class CoreError(RuntimeError):
    """A call into the CUDA core failed; the message is the core's."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class CaptureError(CoreError):
    """The core would have to allocate while a CUDA graph is being captured."""


class UnsupportedError(CoreError):
    """The core does not support this on this build or device."""


class WorkspaceStats(ctypes.Structure):
    _fields_ = [
        ("capacity", ctypes.c_size_t),
        ("high_water", ctypes.c_size_t),
        ("retired_bytes", ctypes.c_size_t),
        ("grow_count", ctypes.c_uint64),
    ]


class GroupOperand(ctypes.Structure):
    """``mg_group_operand``: one [E, rows, cols] tensor or E pointers."""

    _fields_ = [
        ("base", ctypes.c_void_p),
        ("group_stride", ctypes.c_int64),
        ("ptrs", ctypes.c_void_p),
    ]


class GroupedProblem(ctypes.Structure):
    """``mg_grouped_problem``."""

    _fields_ = [
        ("num_groups", ctypes.c_int),
        ("total_rows", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("m_splits", ctypes.c_void_p),
        ("splits_dtype", ctypes.c_int),
        ("dtype", ctypes.c_int),
        ("device", ctypes.c_int),
        ("workspace_slot", ctypes.c_int),
    ]


class RowGather(ctypes.Structure):
    """``mg_row_gather``: an operand's rows read through an int32 device index."""

    _fields_ = [
        ("index", ctypes.c_void_p),
        ("source_rows", ctypes.c_int64),
    ]


class QuantizeConfig(ctypes.Structure):
    """``mg_quantize_config``."""

    _fields_ = [
        ("fp8_dtype", ctypes.c_int),
        ("pow2_scales", ctypes.c_int),
        ("amax_epsilon", ctypes.c_float),
    ]


class Fp8Operand(ctypes.Structure):
    """``mg_fp8_operand``: fp8 data, its float32 block scales, its fp8 dtype."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("scale_inv", ctypes.c_void_p),
        ("dtype", ctypes.c_int),
    ]


EP_MAX_RANKS = 16  # MG_EP_MAX_RANKS


class EpGroup(ctypes.Structure):
    """``mg_ep_group``."""

    _fields_ = [
        ("rank", ctypes.c_int),
        ("world_size", ctypes.c_int),
        ("num_blocks", ctypes.c_int),
        ("base", ctypes.c_void_p * EP_MAX_RANKS),
        ("flags_offset", ctypes.c_int64),
        ("state_offset", ctypes.c_int64),
    ]


class EpDispatchArgs(ctypes.Structure):
    """``mg_ep_dispatch_args``."""

    _fields_ = [
        ("segment_rows", ctypes.c_int64),
        ("counts_offset", ctypes.c_int64),
        ("index_offset", ctypes.c_int64),
        ("rows_offset", ctypes.c_int64),
        ("row_bytes", ctypes.c_int64),
        ("extra_offset", ctypes.c_int64),
        ("extra_bytes", ctypes.c_int64),
        ("out_rows", ctypes.c_void_p),
        ("out_extra", ctypes.c_void_p),
    ]


class EpCombineArgs(ctypes.Structure):
    """``mg_ep_combine_args``."""

    _fields_ = [
        ("segment_rows", ctypes.c_int64),
        ("num_tokens", ctypes.c_int64),
        ("pos", ctypes.c_void_p),
        ("partial_offset", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("dtype", ctypes.c_int),
        ("out", ctypes.c_void_p),
        ("extra_offset", ctypes.c_int64),
        ("extra_cols", ctypes.c_int64),
        ("out_extra", ctypes.c_void_p),
    ]


# The fields both experts-sequence argument structs open with, in the header's order.
_EXPERTS_ARGS_HEAD = [
    ("problem", GroupedProblem),
    ("num_tokens", ctypes.c_int64),
    ("top_k", ctypes.c_int),
    ("hidden", ctypes.c_int64),
    ("ffn", ctypes.c_int64),
    ("row_id_map", ctypes.c_void_p),
]


class ExpertsForwardArgs(ctypes.Structure):
    """``mg_experts_forward_args``."""

    _fields_ = _EXPERTS_ARGS_HEAD + [
        ("tokens", ctypes.c_void_p),
        ("w1", GroupOperand),
        ("w2", GroupOperand),
        ("scratch", ctypes.c_void_p),
        ("g", ctypes.c_void_p),
        ("y", ctypes.c_void_p),
    ]


class ExpertsBackwardArgs(ctypes.Structure):
    """``mg_experts_backward_args``."""

    _fields_ = _EXPERTS_ARGS_HEAD + [
        ("zero_unmapped", ctypes.c_int),
        ("dout", ctypes.c_void_p),
        ("tokens", ctypes.c_void_p),
        ("probs", ctypes.c_void_p),
        ("g", ctypes.c_void_p),
        ("w1", GroupOperand),
        ("w2", GroupOperand),
        ("scratch", ctypes.c_void_p),
        ("dw2", ctypes.c_void_p),
        ("dprobs", ctypes.c_void_p),
        ("dx", ctypes.c_void_p),
        ("dw1", ctypes.c_void_p),
    ]


# mg_experts_fp8_stage's stages, in the order a step runs them
FP8_FORWARD_FC1 = 0
FP8_FORWARD_FC2 = 1
FP8_BACKWARD_FC2_DGRAD = 2
FP8_BACKWARD_SWIGLU = 3
FP8_BACKWARD_FC2_WGRAD = 4
FP8_BACKWARD_DPROBS = 5
FP8_BACKWARD_FC1_DGRAD = 6
FP8_BACKWARD_DX = 7
FP8_BACKWARD_DG_COLUMNWISE = 8
FP8_BACKWARD_FC1_WGRAD = 9


class ExpertsFp8Args(ctypes.Structure):
    """``mg_experts_fp8_args``."""

    _fields_ = _EXPERTS_ARGS_HEAD + [
        ("forward", QuantizeConfig),
        ("backward", QuantizeConfig),
        ("w1", Fp8Operand),
        ("w1_t", Fp8Operand),
        ("w2", Fp8Operand),
        ("w2_t", Fp8Operand),
        ("tokens", ctypes.c_void_p),
        ("index", ctypes.c_void_p),
        ("g", ctypes.c_void_p),
        ("scratch", ctypes.c_void_p),
        ("y", ctypes.c_void_p),
        ("dout", ctypes.c_void_p),
        ("probs", ctypes.c_void_p),
        ("row_weights", ctypes.c_void_p),
        ("dh", ctypes.c_void_p),
        ("dout_t", ctypes.c_void_p),
        ("dout_t_scale_inv", ctypes.c_void_p),
        ("wh_t", ctypes.c_void_p),
        ("wh_t_scale_inv", ctypes.c_void_p),
        ("dprob", ctypes.c_void_p),
        ("dprobs", ctypes.c_void_p),
        ("dw2", ctypes.c_void_p),
        ("dxp", ctypes.c_void_p),
        ("dx", ctypes.c_void_p),
        ("dg_t", ctypes.c_void_p),
        ("dg_t_scale_inv", ctypes.c_void_p),
        ("dw1", ctypes.c_void_p),
    ]


_vp = ctypes.c_void_p
_PROTOTYPES = {
    "mg_last_error": (ctypes.c_char_p, []),
    "mg_abi_version": (ctypes.c_int, []),
    "mg_build_info": (ctypes.c_char_p, []),
    "mg_capabilities": (ctypes.c_uint32, []),
    "mg_workspace_reserve": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_size_t]),
    "mg_workspace_get": (
        ctypes.c_int,
        [ctypes.c_int, ctypes.c_int, ctypes.c_size_t, _vp, ctypes.POINTER(ctypes.c_void_p)],
    ),
    "mg_workspace_stats_get": (
        ctypes.c_int,
        [ctypes.c_int, ctypes.c_int, ctypes.POINTER(WorkspaceStats)],
    ),
    "mg_workspace_release": (ctypes.c_int, [ctypes.c_int, ctypes.c_int]),
    "mg_grouped_setup": (
        ctypes.c_int,
        [_vp, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
         ctypes.c_int, _vp, _vp, _vp],
    ),
    "mg_zero_rows_past_splits": (
        ctypes.c_int,
        [_vp, ctypes.c_int, ctypes.c_int, ctypes.c_int64, _vp, ctypes.c_int64, ctypes.c_int, _vp],
    ),
    # Grouped GEMMs: present only when the core was built with them.
    "mg_grouped_gemm_workspace_size": (
        ctypes.c_int,
        [ctypes.POINTER(GroupedProblem), ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)],
    ),
    "mg_grouped_fprop": (
        ctypes.c_int,
        [ctypes.POINTER(GroupedProblem), _vp, GroupOperand, _vp, _vp, ctypes.c_int, _vp],
    ),
    "mg_grouped_dgrad": (
        ctypes.c_int,
        [ctypes.POINTER(GroupedProblem), _vp, GroupOperand, _vp, ctypes.c_int, _vp],
    ),
    "mg_grouped_wgrad": (
        ctypes.c_int,
        [ctypes.POINTER(GroupedProblem), _vp, _vp, GroupOperand, ctypes.c_int, ctypes.c_int, _vp],
    ),
    "mg_grouped_fprop_gathered": (
        ctypes.c_int,
        [ctypes.POINTER(GroupedProblem), _vp, RowGather, GroupOperand, _vp, ctypes.c_int, _vp],
    ),
    "mg_grouped_fprop_swiglu": (
        ctypes.c_int,
        [ctypes.POINTER(GroupedProblem), _vp, ctypes.POINTER(RowGather), GroupOperand, _vp, _vp, _vp],
    ),
    "mg_grouped_dgrad_swiglu": (
        ctypes.c_int,
        [ctypes.POINTER(GroupedProblem), _vp, GroupOperand, _vp, _vp, _vp, _vp, ctypes.c_int64, _vp],
    ),
    "mg_grouped_dgrad_swiglu_partial_cols": (ctypes.c_int, [ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]),
    "mg_grouped_dgrad_gathered": (
        ctypes.c_int,
        [ctypes.POINTER(GroupedProblem), _vp, RowGather, GroupOperand, _vp, ctypes.c_int, _vp],
    ),
    "mg_grouped_wgrad_gathered": (
        ctypes.c_int,
        [ctypes.POINTER(GroupedProblem), _vp, ctypes.POINTER(RowGather), _vp, ctypes.POINTER(RowGather),
         GroupOperand, ctypes.c_int, ctypes.c_int, _vp],
    ),
    "mg_grouped_dbias": (
        ctypes.c_int,
        [ctypes.POINTER(GroupedProblem), _vp, _vp, ctypes.c_int, _vp],
    ),
    "mg_quantize_rowwise_1x128": (
        ctypes.c_int,
        [_vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, QuantizeConfig, _vp, _vp, _vp],
    ),
    "mg_quantize_columnwise_grouped_1x128": (
        ctypes.c_int,
        [_vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, _vp, ctypes.c_int, ctypes.c_int,
         QuantizeConfig, _vp, _vp, _vp, ctypes.c_int, ctypes.c_int, _vp],
    ),
    "mg_quantize_rowwise_columnwise_grouped_1x128": (
        ctypes.c_int,
        [_vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, _vp, ctypes.c_int, ctypes.c_int,
         QuantizeConfig, _vp, _vp, _vp, _vp, _vp, ctypes.c_int, ctypes.c_int, _vp],
    ),
    "mg_quantize_gathered_1x128": (
        ctypes.c_int,
        [_vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, _vp, ctypes.c_int64, _vp, ctypes.c_int, ctypes.c_int,
         QuantizeConfig, _vp, _vp, _vp, _vp, ctypes.c_int, ctypes.c_int, _vp],
    ),
    "mg_swiglu_quantize_rowwise_1x128": (
        ctypes.c_int,
        [_vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, QuantizeConfig, _vp, _vp, _vp],
    ),
    "mg_quantize_weight_128x128": (
        ctypes.c_int,
        [GroupOperand, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, QuantizeConfig,
         _vp, _vp, _vp, _vp, _vp],
    ),
    # FP8 block-scaled grouped GEMMs: present only when built with csrc/fp8_gemm.
    "mg_grouped_fp8_workspace_size": (
        ctypes.c_int,
        [ctypes.POINTER(GroupedProblem), ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)],
    ),
    "mg_grouped_fp8_fprop": (
        ctypes.c_int,
        [ctypes.POINTER(GroupedProblem), Fp8Operand, Fp8Operand, _vp, _vp, _vp],
    ),
    "mg_grouped_fp8_dgrad": (
        ctypes.c_int,
        [ctypes.POINTER(GroupedProblem), Fp8Operand, Fp8Operand, _vp, _vp],
    ),
    "mg_grouped_fp8_wgrad": (
        ctypes.c_int,
        [ctypes.POINTER(GroupedProblem), Fp8Operand, Fp8Operand, GroupOperand, ctypes.c_int,
         ctypes.c_int, _vp],
    ),
    # Token permutation: present only when the core was built with csrc/permute.
    "mg_permute_index": (
        ctypes.c_int,
        [_vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_int, _vp, _vp, ctypes.c_int,
         ctypes.c_int, _vp],
    ),
    "mg_permute_index_capacity": (
        ctypes.c_int,
        [_vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_int, _vp, ctypes.c_int64, ctypes.c_int,
         _vp, _vp, ctypes.c_int, ctypes.c_int, _vp],
    ),
    "mg_route_topk": (
        ctypes.c_int,
        [_vp, ctypes.c_int64, ctypes.c_int, ctypes.c_int, _vp, _vp, _vp],
    ),
    "mg_route_softmax_partial_rows": (ctypes.c_int, [ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]),
    "mg_route_softmax": (
        ctypes.c_int,
        [_vp, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float, _vp, _vp, _vp, _vp,
         _vp, _vp, _vp],
    ),
    "mg_route_softmax_backward": (
        ctypes.c_int,
        [_vp, _vp, _vp, _vp, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float, _vp, _vp,
         _vp, ctypes.c_int, _vp, _vp],
    ),
    "mg_permute_rows": (
        ctypes.c_int,
        [_vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, _vp, _vp, _vp],
    ),
    "mg_unpermute_rows": (
        ctypes.c_int,
        [_vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, _vp, _vp, ctypes.c_int,
         _vp, _vp],
    ),
    "mg_unpermute_rows_backward": (
        ctypes.c_int,
        [_vp, _vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, _vp, _vp,
         ctypes.c_int, _vp, _vp, _vp],
    ),
    # SwiGLU: present only when the core was built with csrc/activation.
    "mg_swiglu_forward": (ctypes.c_int, [_vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, _vp, _vp]),
    "mg_swiglu_backward": (ctypes.c_int, [_vp, _vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, _vp, _vp]),
    "mg_set_gemm_sm_limit": (ctypes.c_int, [ctypes.c_int, ctypes.c_int]),
    # Expert-parallel dispatch and combine: present only when built with csrc/ep.
    "mg_ep_dispatch": (ctypes.c_int, [ctypes.POINTER(EpGroup), ctypes.POINTER(EpDispatchArgs), _vp]),
    "mg_ep_combine": (ctypes.c_int, [ctypes.POINTER(EpGroup), ctypes.POINTER(EpCombineArgs), _vp]),
    "mg_ep_plan_scratch_bytes": (ctypes.c_size_t, [ctypes.c_int64, ctypes.c_int]),
    "mg_ep_plan": (
        ctypes.c_int,
        [_vp, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64, _vp, _vp, _vp, _vp, _vp],
    ),
    # The fused experts path's sequences (csrc/experts).
    "mg_permute_source_rows": (ctypes.c_int, [_vp, ctypes.c_int64, ctypes.c_int, ctypes.c_int64, _vp, _vp]),
    "mg_experts_forward_scratch_bytes": (
        ctypes.c_int, [ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)],
    ),
    "mg_experts_forward_fc": (ctypes.c_int, [ctypes.POINTER(ExpertsForwardArgs), _vp]),
    "mg_experts_backward_scratch_bytes": (
        ctypes.c_int,
        [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)],
    ),
    "mg_experts_backward_fc2": (ctypes.c_int, [ctypes.POINTER(ExpertsBackwardArgs), _vp]),
    "mg_experts_backward_fc1": (ctypes.c_int, [ctypes.POINTER(ExpertsBackwardArgs), _vp]),
    "mg_experts_fp8_scratch_bytes": (
        ctypes.c_int,
        [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)],
    ),
    "mg_experts_fp8_stage": (ctypes.c_int, [ctypes.POINTER(ExpertsFp8Args), ctypes.c_int, _vp]),
    "mg_swiglu_weighted_backward": (
        ctypes.c_int,
        [_vp, _vp, _vp, _vp, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, _vp, _vp,
         _vp, ctypes.c_int, _vp],
    ),
}
_REQUIRED = ("mg_last_error", "mg_abi_version", "mg_build_info", "mg_capabilities")


def _library_path() -> Optional[str]:
    override = os.environ.get(LIBRARY_ENV)
    if override:
        return override
    # find_spec resolves the file in an installed wheel and in an editable
    # install alike, without importing it (it is not a Python module).
    spec = importlib.util.find_spec(f"{__package__}.libmoe_grouped_core")
    return spec.origin if spec is not None else None


def _build_reason() -> str:
    try:
        from . import _core_status
    except ImportError:
        return "the package was not installed through its build (no _core_status module)"
    return _core_status.REASON


def _load() -> tuple[Optional[ctypes.CDLL], str]:
    path = _library_path()
    if path is None:
        return None, f"core not built: {_build_reason()}"
    try:
        library = ctypes.CDLL(path)
    except OSError as exc:
        return None, f"core at {path} failed to load: {exc}"
    for name, (restype, argtypes) in _PROTOTYPES.items():
        function = getattr(library, name, None)
        if function is None:
            if name in _REQUIRED:
                return None, f"core at {path} lacks {name}; rebuild the package"
            continue
        function.restype = restype
        function.argtypes = argtypes
    version = library.mg_abi_version()
    if version != ABI_VERSION:
        return None, (
            f"core at {path} has ABI version {version}, this package expects {ABI_VERSION}; "
            "rebuild the package"
        )
    return library, ""


lib, unavailable_reason = _load()
library_path: Optional[str] = _library_path() if lib is not None else None
# Read once: fixed for the loaded library, and a ctypes call cannot be traced
# by torch.compile (backend resolution consults it inside compiled code).
_capabilities: int = lib.mg_capabilities() if lib is not None else 0


def available() -> bool:
    return lib is not None


def capabilities() -> int:
    return _capabilities


def has(capability: int) -> bool:
    return bool(capabilities() & capability)


def require() -> ctypes.CDLL:
    """The loaded library, or a RuntimeError saying why there is none."""
    if lib is None:
        raise RuntimeError(f"the moe_grouped CUDA core is unavailable: {unavailable_reason}")
    return lib


# CUDA runtime errors that mean this machine has no GPU the core can use.
_NO_GPU_ERRORS = {
    "cudaErrorNoDevice": "no CUDA GPU is visible",
    "cudaErrorInsufficientDriver": "no usable NVIDIA driver (none installed, or older than the core's CUDA runtime)",
}


def check(status: int) -> None:
    """Raises the exception matching a non-zero ``mg_status``."""
    if status == OK:
        return
    message = lib.mg_last_error().decode(errors="replace") or f"core call failed with status {status}"
    if status == ERROR_CUDA:
        for name, what in _NO_GPU_ERRORS.items():
            if f"({name})" in message:
                raise CoreError(
                    status,
                    f"no GPU: {what}, and the moe_grouped CUDA core needs one; on the CPU use the "
                    f"'reference' or 'torch' backend (the CUDA runtime said: {message})",
                )
    if status == ERROR_CAPTURE:
        raise CaptureError(status, message)
    if status == ERROR_UNSUPPORTED:
        raise UnsupportedError(status, message)
    if status == ERROR_INVALID_ARGUMENT:
        raise ValueError(message)
    if status == ERROR_OUT_OF_MEMORY:
        raise torch.OutOfMemoryError(message)
    raise CoreError(status, message)


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return _DTYPE_CODES[dtype]
    except KeyError:
        raise TypeError(f"the CUDA core has no code for dtype {dtype}") from None


def device_index(device: torch.device) -> int:
    """The CUDA device ordinal the core takes: ``device``'s, or the current device's for plain "cuda"."""
    return device.index if device.index is not None else torch.cuda.current_device()


# torch's C accessor of the current stream's handle (CUDA builds): no Stream object is built per call.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream_handle(device: torch.device) -> int:
    """The raw cudaStream_t of the current torch stream on ``device``."""
    if _raw_stream is not None:
        return _raw_stream(device_index(device))
    return torch.cuda.current_stream(device).cuda_stream


@contextlib.contextmanager
def gemm_sm_limit(device: torch.device, sms: int):
    """The core's GEMMs launched inside use at most ``sms`` SMs of ``device`` (``mg_set_gemm_sm_limit``),
    leaving the others to a kernel running beside them; the limit is lifted on exit."""
    index = device_index(device)
    check(lib.mg_set_gemm_sm_limit(index, sms))
    try:
        yield
    finally:
        check(lib.mg_set_gemm_sm_limit(index, 0))

