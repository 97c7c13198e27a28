"""The ``cuda`` permutation backend: the core's kernels (csrc/permute/permute.cu).

Graph-safe: the index pass takes its scratch from the persistent
``(device, SLOT_PERMUTE)`` workspace, which grows only outside capture (run
the layer once eagerly before capturing).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _core

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SLOT_PERMUTE = 2  # MG_SLOT_PERMUTE in the C ABI header


def _ptr(tensor: Optional[torch.Tensor]):
    return None if tensor is None else tensor.data_ptr()


def _weights_code(weights: Optional[torch.Tensor], dtype: torch.dtype) -> int:
    return _core.dtype_code(weights.dtype if weights is not None else dtype)


def index(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    lib = _core.require()
    num_tokens, top_k = experts.shape
    row_id_map = torch.empty(num_tokens * top_k, dtype=torch.int64, device=experts.device)
    m_splits = torch.empty(num_experts, dtype=torch.int64, device=experts.device)
    _core.check(
        lib.mg_permute_index(
            experts.data_ptr(), _core.dtype_code(experts.dtype), num_tokens, top_k, num_experts,
            _ptr(row_id_map), _ptr(m_splits), experts.device.index, SLOT_PERMUTE,
            _core.stream_handle(experts.device),
        )
    )
    return row_id_map, m_splits


def permute_rows(x: torch.Tensor, row_id_map: torch.Tensor, top_k: int) -> torch.Tensor:
    lib = _core.require()
    permuted = x.new_zeros(row_id_map.shape[0], x.shape[1])
    _core.check(
        lib.mg_permute_rows(
            _ptr(x), _core.dtype_code(x.dtype), x.shape[0], x.shape[1], top_k, _ptr(row_id_map),
            _ptr(permuted), _core.stream_handle(x.device),
        )
    )
    return permuted


def unpermute_rows(
    y: torch.Tensor, row_id_map: torch.Tensor, weights: Optional[torch.Tensor], top_k: int
) -> torch.Tensor:
    lib = _core.require()
    num_tokens = row_id_map.shape[0] // top_k
    out = y.new_empty(num_tokens, y.shape[1])
    _core.check(
        lib.mg_unpermute_rows(
            _ptr(y), _core.dtype_code(y.dtype), num_tokens, y.shape[1], top_k, _ptr(row_id_map),
            _ptr(weights), _weights_code(weights, y.dtype), _ptr(out), _core.stream_handle(y.device),
        )
    )
    return out


def unpermute_rows_backward(
    dout: torch.Tensor, y: torch.Tensor, row_id_map: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    lib = _core.require()
    num_tokens, top_k = weights.shape
    dy = torch.zeros_like(y)
    dweights = torch.empty_like(weights)
    _core.check(
        lib.mg_unpermute_rows_backward(
            _ptr(dout), _ptr(y), _core.dtype_code(y.dtype), num_tokens, y.shape[1], top_k,
            _ptr(row_id_map), _ptr(weights), _core.dtype_code(weights.dtype), _ptr(dy), _ptr(dweights),
            _core.stream_handle(y.device),
        )
    )
    return dy, dweights
