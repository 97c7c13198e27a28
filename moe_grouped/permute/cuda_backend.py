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


def index(
    experts: torch.Tensor,
    probs: Optional[torch.Tensor],
    num_experts: int,
    capacity: int,
    pad_to_capacity: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    lib = _core.require()
    num_tokens, top_k = experts.shape
    row_id_map = torch.empty(num_tokens * top_k, dtype=torch.int64, device=experts.device)
    m_splits = torch.empty(num_experts, dtype=torch.int64, device=experts.device)
    common = (experts.data_ptr(), _core.dtype_code(experts.dtype), num_tokens, top_k, num_experts)
    tail = (_ptr(row_id_map), _ptr(m_splits), experts.device.index, SLOT_PERMUTE, _core.stream_handle(experts.device))
    if capacity < 0:
        _core.check(lib.mg_permute_index(*common, *tail))
        return row_id_map, m_splits
    if not hasattr(lib, "mg_permute_index_capacity"):
        raise RuntimeError(
            f"the moe_grouped core at {_core.library_path} predates token dropping (no "
            "mg_permute_index_capacity); rebuild the package"
        )
    _core.check(lib.mg_permute_index_capacity(*common, _ptr(probs), capacity, int(pad_to_capacity), *tail))
    return row_id_map, m_splits


def permute_rows(
    x: torch.Tensor, row_id_map: torch.Tensor, top_k: int, num_rows: int, zero_unmapped: bool
) -> torch.Tensor:
    lib = _core.require()
    permuted = x.new_zeros(num_rows, x.shape[1]) if zero_unmapped else x.new_empty(num_rows, x.shape[1])
    if num_rows == 0:  # nothing to write (and an empty tensor has no address)
        return permuted
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
    out = y.new_empty(row_id_map.shape[0] // top_k, y.shape[1])
    unpermute_rows_into(y, row_id_map, weights, top_k, out)
    return out


def unpermute_rows_into(
    y: torch.Tensor, row_id_map: torch.Tensor, weights: Optional[torch.Tensor], top_k: int, out: torch.Tensor
) -> None:
    lib = _core.require()
    num_tokens = row_id_map.shape[0] // top_k
    if out.shape != (num_tokens, y.shape[1]) or out.dtype != y.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{num_tokens}, {y.shape[1]}] {y.dtype} tensor, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if y.shape[0] == 0:  # every copy dropped (capacity 0)
        out.zero_()
        return
    _core.check(
        lib.mg_unpermute_rows(
            _ptr(y), _core.dtype_code(y.dtype), num_tokens, y.shape[1], top_k, _ptr(row_id_map),
            _ptr(weights), _weights_code(weights, y.dtype), _ptr(out), _core.stream_handle(y.device),
        )
    )


def unpermute_rows_backward(
    dout: torch.Tensor, y: torch.Tensor, row_id_map: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    lib = _core.require()
    num_tokens, top_k = weights.shape
    dy = torch.zeros_like(y)
    if y.shape[0] == 0:  # every copy dropped (capacity 0)
        return dy, torch.zeros_like(weights)
    dweights = torch.empty_like(weights)
    _core.check(
        lib.mg_unpermute_rows_backward(
            _ptr(dout), _ptr(y), _core.dtype_code(y.dtype), num_tokens, y.shape[1], top_k,
            _ptr(row_id_map), _ptr(weights), _core.dtype_code(weights.dtype), _ptr(dy), _ptr(dweights),
            _core.stream_handle(y.device),
        )
    )
    return dy, dweights


def has_source_rows() -> bool:
    """Whether the loaded core has ``mg_permute_source_rows`` (MG_CAP_EXPERTS_SEQUENCE)."""
    return _core.has(_core.CAP_EXPERTS_SEQUENCE)


def source_rows(row_id_map: torch.Tensor, top_k: int, num_rows: int) -> torch.Tensor:
    """``mg_permute_source_rows``: [num_rows] int32, the token of the copy at each row, -1 where none is."""
    source = torch.empty(num_rows, dtype=torch.int32, device=row_id_map.device)
    _core.check(
        _core.require().mg_permute_source_rows(
            row_id_map.data_ptr(), row_id_map.shape[0], top_k, num_rows, source.data_ptr(),
            _core.stream_handle(row_id_map.device),
        )
    )
    return source
