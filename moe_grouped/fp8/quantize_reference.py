"""FP8 block quantization in plain PyTorch: the oracle for the core's kernels.

Scales follow TransformerEngine's block-scaling rules: per block,
``amax' = max(amax, amax_epsilon)``; ``scale = fp8_max / amax'`` (1 when
amax' is 0 or infinite; the largest float32 when the quotient overflows);
with pow2 scales the scale is rounded down to a power of two by clearing its
mantissa bits. Values are stored as ``fp8(x * scale)`` and the kernels use
``scale_inv = 1 / scale``. Each 1x128 or 128x128 block is computed
independently, so a group boundary that is not a multiple of 128 simply
starts new blocks.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Union

import torch

from .recipe import BLOCK, check_scale_options

_FLOAT32_MAX = torch.finfo(torch.float32).max
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_quantize_options(fp8_dtype: object, pow2_scales: object, amax_epsilon: object) -> None:
    """TypeError/ValueError naming the quantizer option that is wrong (shared by every quantizer)."""
    if fp8_dtype not in FP8_DTYPES:
        raise TypeError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}")
    check_scale_options(pow2_scales, amax_epsilon)


class BlockQuantized(NamedTuple):
    """FP8 data and the float32 inverse scales of its blocks."""

    data: torch.Tensor
    scale_inv: torch.Tensor


class GroupedQuantized(NamedTuple):
    """One grouped quantize pass over tokens x[M, K] with E groups.

    ``rowwise``: data [M, K], scale_inv [M, ceil(K / 128)] (None if not asked);
    ``columnwise``: the grouped column-wise layout (see
    :func:`quantize_grouped_columnwise`): data [K, columnwise_padded_rows(M, E)],
    scale_inv [columnwise_scale_rows(M, E), K];
    ``dbias``: float32 [E, K] column sums of each group (None if not asked).
    """

    rowwise: Optional[BlockQuantized]
    columnwise: BlockQuantized
    dbias: Optional[torch.Tensor]


class WeightQuantized(NamedTuple):
    """Grouped weights [E, N, K] in 128x128 blocks.

    ``w``: data [E, N, K], scale_inv [E, ceil(N / 128), ceil(K / 128)];
    ``wt``: the transpose, data [E, K, N] (``wt.data[e, c, r] == w.data[e, r, c]``)
    and scale_inv [E, ceil(K / 128), ceil(N / 128)], or None.
    """

    w: BlockQuantized
    wt: Optional[BlockQuantized]


def compute_scale(amax: torch.Tensor, fp8_dtype: torch.dtype, pow2_scales: bool, amax_epsilon: float) -> torch.Tensor:
    """float32 scales from float32 block amaxes (see the module docstring)."""
    check_quantize_options(fp8_dtype, pow2_scales, amax_epsilon)
    amax = amax.float().clamp(min=amax_epsilon)
    fp8_max = torch.finfo(fp8_dtype).max
    scale = torch.full_like(amax, fp8_max) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, _FLOAT32_MAX), scale)
    scale = torch.where((amax == 0) | torch.isinf(amax) | torch.isnan(scale), torch.ones_like(scale), scale)
    if pow2_scales:
        # Keep sign and exponent bits: the largest power of two <= scale.
        scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
    return scale


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))


def quantize_1x128(x: torch.Tensor, fp8_dtype: torch.dtype, pow2_scales: bool, amax_epsilon: float = 0.0) -> BlockQuantized:
    """Row-wise 1x128 blocks: data [M, K], scale_inv [M, ceil(K / 128)]."""
    m, k = x.shape
    blocks = -(-k // BLOCK)
    tiles = _pad_to(x.float(), m, blocks * BLOCK).view(m, blocks, BLOCK)
    scale = compute_scale(tiles.abs().amax(dim=-1), fp8_dtype, pow2_scales, amax_epsilon)
    data = (tiles * scale.unsqueeze(-1)).view(m, blocks * BLOCK)[:, :k].to(fp8_dtype)
    return BlockQuantized(data, 1.0 / scale)


def quantize_128x128(w: torch.Tensor, fp8_dtype: torch.dtype, pow2_scales: bool, amax_epsilon: float = 0.0) -> BlockQuantized:
    """128x128 tiles: data [N, K], scale_inv [ceil(N / 128), ceil(K / 128)]."""
    n, k = w.shape
    row_blocks, col_blocks = -(-n // BLOCK), -(-k // BLOCK)
    tiles = _pad_to(w.float(), row_blocks * BLOCK, col_blocks * BLOCK)
    tiles = tiles.view(row_blocks, BLOCK, col_blocks, BLOCK).transpose(1, 2)
    scale = compute_scale(tiles.abs().amax(dim=(-1, -2)), fp8_dtype, pow2_scales, amax_epsilon)
    scaled = (tiles * scale[..., None, None]).transpose(1, 2).reshape(row_blocks * BLOCK, col_blocks * BLOCK)
    return BlockQuantized(scaled[:n, :k].to(fp8_dtype), 1.0 / scale)


def dequantize_1x128(q: BlockQuantized) -> torch.Tensor:
    m, k = q.data.shape
    scale_inv = q.scale_inv.repeat_interleave(BLOCK, dim=1)[:, :k]
    return q.data.float() * scale_inv


def dequantize_128x128(q: BlockQuantized) -> torch.Tensor:
    n, k = q.data.shape
    scale_inv = q.scale_inv.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)[:n, :k]
    return q.data.float() * scale_inv


# ---- grouped column-wise layout (the FP8 wgrad operands) --------------------
#
# Group e (tokens [o_e, o_e + m_e)) starts at column p_e = sum_{j<e}
# round_up(m_j, 128) of the data (128-byte aligned: the wgrad's TMA boxes
# then read whole lines) and at scale row b_e = sum_{j<e} ceil(m_j / 128).
# Sizes depend only on (M, E), so buffers are static under CUDA graphs while
# the split changes.

COLUMNWISE_ALIGN = 128  # tokens: every group's first column is a multiple of this


def columnwise_padded_rows(rows: int, num_groups: int) -> int:
    """Columns of the column-wise data: room for every group, 128-aligned."""
    return -(-rows // COLUMNWISE_ALIGN) * COLUMNWISE_ALIGN + COLUMNWISE_ALIGN * num_groups


def columnwise_scale_rows(rows: int, num_groups: int) -> int:
    """Rows of the column-wise scales: room for every group's 128-token blocks."""
    return -(-rows // BLOCK) + num_groups


def columnwise_group_starts(splits: Sequence[int]) -> list[tuple[int, int]]:
    """(p_e, b_e) per group: its first data column and its first scale row."""
    starts, padded, block = [], 0, 0
    for count in splits:
        starts.append((padded, block))
        padded += -(-count // COLUMNWISE_ALIGN) * COLUMNWISE_ALIGN
        block += -(-count // BLOCK)
    return starts


def _as_list(splits: Union[torch.Tensor, Sequence[int]]) -> list[int]:
    counts = splits.tolist() if isinstance(splits, torch.Tensor) else list(splits)
    if any(c < 0 for c in counts):
        raise ValueError(f"splits must be non-negative, got {counts}")
    return counts


def quantize_grouped_columnwise(
    x: torch.Tensor, splits: Sequence[int], fp8_dtype: torch.dtype, pow2_scales: bool, amax_epsilon: float = 0.0
) -> BlockQuantized:
    """Per group e, X_e^T [K, m_e] quantized 1x128 along its tokens, packed.

    Returns data [K, columnwise_padded_rows(M, E)] with
    ``data[:, p_e : p_e + m_e] = fp8(X_e^T)`` and scale_inv
    [columnwise_scale_rows(M, E), K] with group e's blocks in rows
    [b_e, b_e + ceil(m_e / 128)) (one row per 128-token block: per group a
    packed [blocks, K] matrix). Blocks restart at each group's first token.
    Every other position is zero here; the CUDA kernels write the zeros of
    each group's own padding, up to p_e + round_up(m_e, 128), and leave the
    positions no group owns untouched. ``splits`` must sum to M.
    """
    check_quantize_options(fp8_dtype, pow2_scales, amax_epsilon)
    counts = _as_list(splits)
    rows, cols = x.shape
    if sum(counts) != rows:
        raise ValueError(f"splits must sum to the {rows} rows of x, got {counts}")
    data = torch.zeros(cols, columnwise_padded_rows(rows, len(counts)), dtype=fp8_dtype, device=x.device)
    scale_inv = torch.zeros(columnwise_scale_rows(rows, len(counts)), cols, dtype=torch.float32, device=x.device)
    start = 0
    for count, (padded, block) in zip(counts, columnwise_group_starts(counts)):
        if count:
            group = quantize_1x128(x[start : start + count].t(), fp8_dtype, pow2_scales, amax_epsilon)
            data[:, padded : padded + count] = group.data
            scale_inv[block : block + group.scale_inv.shape[1]] = group.scale_inv.t()
        start += count
    return BlockQuantized(data, scale_inv)


def columnwise_groups(q: BlockQuantized, splits: Sequence[int]) -> list[BlockQuantized]:
    """Views of each group in the column-wise layout, as :func:`quantize_1x128`
    lays out X_e^T: data [K, m_e] and scale_inv [K, ceil(m_e / 128)]."""
    counts = _as_list(splits)
    out = []
    for count, (padded, block) in zip(counts, columnwise_group_starts(counts)):
        blocks = -(-count // BLOCK)
        out.append(BlockQuantized(q.data[:, padded : padded + count], q.scale_inv[block : block + blocks].t()))
    return out


_SEGMENT = 16  # tokens summed in order before the fixed tree (see grouped_column_sums)
_LANES = 8  # running sums over a group's blocks


def grouped_column_sums(x: torch.Tensor, splits: Sequence[int]) -> torch.Tensor:
    """float32 [E, K] column sums of each group (the fused dbias), in the CUDA
    kernel's order, so that the two agree bit for bit.

    Per 128-token block (zero-padded), each 16-token segment is summed in token
    order; the eight segment sums are added pairwise ((s0 + s1) + (s2 + s3)) +
    ((s4 + s5) + (s6 + s7)); the block sums j = w, w + 8, ... are added in order
    into eight running sums w = 0..7, which are then added in order. Adding a
    zero pad never changes a float32 sum that starts at +0.
    """
    counts = _as_list(splits)
    rows, cols = x.shape
    xf = x.float()
    out = torch.zeros(len(counts), cols, dtype=torch.float32, device=x.device)
    start = 0
    for e, count in enumerate(counts):
        blocks = -(-count // BLOCK)
        if blocks:
            tiles = torch.zeros(blocks * BLOCK, cols, dtype=torch.float32, device=x.device)
            tiles[:count] = xf[start : start + count]
            tiles = tiles.view(blocks, BLOCK // _SEGMENT, _SEGMENT, cols)
            segments = torch.zeros(blocks, BLOCK // _SEGMENT, cols, dtype=torch.float32, device=x.device)
            for i in range(_SEGMENT):
                segments = segments + tiles[:, :, i]
            while segments.shape[1] > 1:  # xor-shuffle tree: neighbours, then pairs, then halves
                segments = segments[:, 0::2] + segments[:, 1::2]
            partial = torch.zeros(-(-blocks // _LANES) * _LANES, cols, dtype=torch.float32, device=x.device)
            partial[:blocks] = segments[:, 0]
            lanes = torch.zeros(_LANES, cols, dtype=torch.float32, device=x.device)
            for chunk in partial.view(-1, _LANES, cols):
                lanes = lanes + chunk
            total = torch.zeros(cols, dtype=torch.float32, device=x.device)
            for lane in lanes:
                total = total + lane
            out[e] = total
        start += count
    return out


def quantize_grouped_1x128(
    x: torch.Tensor,
    splits: Sequence[int],
    fp8_dtype: torch.dtype,
    pow2_scales: bool,
    amax_epsilon: float = 0.0,
    *,
    rowwise: bool = True,
    dbias: bool = False,
) -> GroupedQuantized:
    """The reference of one grouped quantize pass: row-wise 1x128 (optional),
    the grouped column-wise layout and the fused dbias (optional)."""
    check_quantize_options(fp8_dtype, pow2_scales, amax_epsilon)
    return GroupedQuantized(
        quantize_1x128(x, fp8_dtype, pow2_scales, amax_epsilon) if rowwise else None,
        quantize_grouped_columnwise(x, splits, fp8_dtype, pow2_scales, amax_epsilon),
        grouped_column_sums(x, splits) if dbias else None,
    )


def quantize_grouped_128x128(
    weights: Union[torch.Tensor, Sequence[torch.Tensor]],
    fp8_dtype: torch.dtype,
    pow2_scales: bool,
    amax_epsilon: float = 0.0,
    *,
    transpose: bool = True,
) -> WeightQuantized:
    """Grouped weights ([E, N, K], or E tensors [N, K]) in 128x128 blocks, and
    with ``transpose`` the transposed copy the dgrad GEMM reads."""
    check_quantize_options(fp8_dtype, pow2_scales, amax_epsilon)
    experts = list(weights.unbind(0)) if isinstance(weights, torch.Tensor) else list(weights)
    if len(experts) == 1 and experts[0].dim() == 3:
        experts = list(experts[0].unbind(0))
    blocks = [quantize_128x128(w, fp8_dtype, pow2_scales, amax_epsilon) for w in experts]
    w = BlockQuantized(torch.stack([b.data for b in blocks]), torch.stack([b.scale_inv for b in blocks]))
    wt = None
    if transpose:
        wt = BlockQuantized(w.data.transpose(1, 2).contiguous(), w.scale_inv.transpose(1, 2).contiguous())
    return WeightQuantized(w, wt)
