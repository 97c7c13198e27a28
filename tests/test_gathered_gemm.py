"""Gathered grouped GEMMs: token-side operands read through a row index.

``grouped_fprop_gathered(source, index, ...)`` is ``grouped_fprop`` of
``gather_rows(source, index)`` (row ``index[r]`` of ``source``, zeros where
the index is outside [0, rows)) without the copy; likewise dgrad and wgrad.

- Every backend (CPU in CI): the gathered ops equal their plain ops on the
  gathered rows exactly, and ``gather_rows`` follows its rule.
- GPU: the core's gathered kernels equal the plain kernels on the gathered
  rows bitwise (same tiles, same accumulation order; only the loads differ),
  over split patterns, index patterns (routing, unmapped rows, out-of-range
  indices, one repeated row) and shapes off the tile grid; the C entry points
  refuse bad input by name; a captured graph replays with new indices and
  splits bitwise equal to eager.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

import moe_grouped  # noqa: F401  (registers the ops)
from moe_grouped import _core
from moe_grouped._tensors import gather_rows
from moe_grouped.permute import permute, permute_index, source_rows

from cases import SPLIT_PATTERNS, bounds, capture_after_a_step, cuda_kernels_reason, make_splits, needs_cuda_kernels

INDEX_PATTERNS = ("routing", "unmapped_rows", "out_of_range", "one_row")


def make_index(pattern: str, rows: int, source_rows: int, top_k: int, seed: int = 0) -> torch.Tensor:
    """[rows] int32 indices into a source of ``source_rows`` rows."""
    gen = torch.Generator().manual_seed(seed)
    # Routing: each token's top_k copies at rows in expert order (a shuffle).
    index = (torch.arange(rows) // top_k).clamp(max=max(source_rows - 1, 0))
    index = index[torch.randperm(rows, generator=gen)]
    if pattern == "unmapped_rows":  # capacity padding / dropped copies
        index[torch.rand(rows, generator=gen) < 0.15] = -1
    elif pattern == "out_of_range":
        picks = torch.rand(rows, generator=gen)
        index[picks < 0.1] = source_rows
        index[(picks >= 0.1) & (picks < 0.15)] = -7
        index[(picks >= 0.15) & (picks < 0.2)] = 2**31 - 1
    elif pattern == "one_row":
        index[:] = min(3, source_rows - 1)
    elif pattern != "routing":
        raise ValueError(pattern)
    return index.to(torch.int32)


def load_routing(m_splits: torch.Tensor, index: torch.Tensor, tokens: int, top_k: int, seed: int) -> None:
    """New splits and indices in place (a graph's device inputs): the patterns in turn, by seed."""
    rows = index.shape[0]
    m_splits.copy_(torch.tensor(make_splits(SPLIT_PATTERNS[seed % len(SPLIT_PATTERNS)], m_splits.numel(), rows, seed)))
    index.copy_(make_index(INDEX_PATTERNS[seed % len(INDEX_PATTERNS)], rows, tokens, top_k, seed))


# ---- every backend: the op contract ----------------------------------------


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda_kernels(
    _core.CAP_EXPERTS_SEQUENCE, "experts sequence kernels")])])
@pytest.mark.parametrize("capacity_factor", [None, 1.5])
def test_source_rows_inverts_the_routing_index(capacity_factor, device):
    # Experts 0 and 1 take every token: with capacity they drop copies while
    # the others leave padded rows empty.
    tokens, top_k, num_experts = 40, 3, 6
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, 8, generator=gen)
    bias = torch.tensor([2.0, 2.0, 0, 0, 0, 0])
    experts = (torch.rand(tokens, num_experts, generator=gen) + bias).topk(top_k, dim=1).indices
    probs = torch.rand(tokens, top_k, generator=gen)
    pad = capacity_factor is not None
    row_id_map, _, rows = permute_index(x, experts, num_experts, probs=probs, capacity_factor=capacity_factor,
                                        pad_to_capacity=pad, backend="torch")
    index = source_rows(row_id_map.to(device), top_k, rows).cpu()  # on cuda: the core's kernel
    assert index.dtype == torch.int32 and index.shape == (rows,)
    mapped = row_id_map >= 0
    copies = torch.arange(tokens * top_k)[mapped]
    assert torch.equal(index[row_id_map[mapped].long()], (copies // top_k).int())
    unmapped = torch.ones(rows, dtype=torch.bool)
    unmapped[row_id_map[mapped].long()] = False
    assert bool((index[unmapped] == -1).all())
    if pad:
        assert bool(unmapped.any()) and not bool(mapped.all()), "the capacity case should drop and pad"
    permuted, _, _ = permute(x, experts, num_experts, probs=probs, capacity_factor=capacity_factor,
                             pad_to_capacity=pad, backend="torch")
    assert torch.equal(gather_rows(x, index), permuted)


def test_gather_rows_reads_zeros_outside_the_source():
    source = torch.arange(12.0).view(4, 3)
    index = torch.tensor([2, -1, 4, 0, 2**31 - 1, -9, 3], dtype=torch.int32)
    got = gather_rows(source, index)
    expected = torch.stack([source[2], torch.zeros(3), torch.zeros(3), source[0], torch.zeros(3),
                            torch.zeros(3), source[3]])
    assert torch.equal(got, expected)
    assert torch.equal(gather_rows(source[:0], index), torch.zeros(7, 3))


def test_gather_rows_keeps_non_finite_rows_and_zeros_only_the_unmapped():
    source = torch.tensor([[float("nan"), 1.0], [float("inf"), 2.0]])
    got = gather_rows(source, torch.tensor([1, -1, 0]))
    assert torch.isinf(got[0, 0]) and got[0, 1] == 2
    assert torch.equal(got[1], torch.zeros(2))
    assert torch.isnan(got[2, 0])


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("pattern", INDEX_PATTERNS)
def test_gathered_ops_equal_plain_ops_on_gathered_rows(backend, pattern):
    num_experts, tokens, top_k, k, n = 5, 37, 3, 24, 40
    rows = tokens * top_k
    gen = torch.Generator().manual_seed(1)
    splits = make_splits("skewed", num_experts, rows)
    m_splits = torch.tensor(splits)
    index = make_index(pattern, rows, tokens, top_k)
    x = torch.randn(tokens, k, generator=gen)
    dout = torch.randn(tokens, n, generator=gen)
    w = [torch.randn(num_experts, n, k, generator=gen)]
    ops = torch.ops.moe_grouped
    xp, dyp = gather_rows(x, index), gather_rows(dout, index)

    assert torch.equal(ops.grouped_fprop_gathered(x, index, w, m_splits, x.dtype, backend),
                       ops.grouped_fprop(xp, w, m_splits, None, x.dtype, backend, True))
    assert torch.equal(ops.grouped_dgrad_gathered(dout, index, w, m_splits, x.dtype, backend),
                       ops.grouped_dgrad(dyp, w, m_splits, x.dtype, backend, True))
    h = torch.randn(rows, k, generator=gen)
    for dy, dy_index, xx, x_index in ((dout, index, h, None), (dyp, None, x, index), (dout, index, x, index)):
        got = torch.full((num_experts, n, k), float("nan"))
        expected = torch.full_like(got, float("nan"))
        ops.grouped_wgrad_gathered_(dy, dy_index, xx, x_index, m_splits, [got], False, backend)
        ops.grouped_wgrad_(gather_rows(dy, dy_index) if dy_index is not None else dy,
                           gather_rows(xx, x_index) if x_index is not None else xx,
                           m_splits, [expected], False, backend)
        assert torch.equal(got, expected)


# ---- GPU: the core's gathered kernels ---------------------------------------


CUDA_REASON = cuda_kernels_reason(_core.CAP_GATHERED_GEMM, "gathered GEMMs")
needs_kernels = needs_cuda_kernels(_core.CAP_GATHERED_GEMM, "gathered GEMMs")

if CUDA_REASON is None:
    from moe_grouped.gemm import cuda_backend
else:  # collected but skipped
    cuda_backend = None

# (E, T, top_k, K, N): K and N multiples of 8 but not of the 64/128/256 tiles.
SHAPES = [(1, 77, 1, 136, 200), (4, 150, 2, 264, 520), (8, 512, 4, 520, 392), (64, 700, 6, 128, 64)]
SHAPE_IDS = ["E{}_T{}_k{}_K{}_N{}".format(*s) for s in SHAPES]


def _operands(shape, pattern, index_pattern, seed=0):
    num_experts, tokens, top_k, k, n = shape
    rows = tokens * top_k
    gen = torch.Generator().manual_seed(seed)
    m_splits = torch.tensor(make_splits(pattern, num_experts, rows, seed), dtype=torch.int32, device="cuda")
    index = make_index(index_pattern, rows, tokens, top_k, seed).cuda()
    x = torch.randn(tokens, k, generator=gen).bfloat16().cuda()
    dout = torch.randn(tokens, n, generator=gen).bfloat16().cuda()
    w = [(torch.randn(num_experts, n, k, generator=gen) / k**0.5).bfloat16().cuda()]
    return m_splits, index, x, dout, w


def _assert_bitwise(got, expected, case):
    assert got.shape == expected.shape and got.dtype == expected.dtype, case
    assert torch.equal(got, expected), f"{case}: max |diff| {(got.float() - expected.float()).abs().max().item()}"


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("index_pattern", INDEX_PATTERNS)
@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("raster", ["auto", "n"])
def test_cuda_fprop_dgrad_gathered_equal_plain_kernels(raster, shape, pattern, index_pattern, monkeypatch):
    """Also with the tiles walked along N (MOE_GROUPED_GEMM_RASTER=n), as large groups are: the plain
    kernels' order is checked against the oracle in test_cuda_gemm."""
    monkeypatch.setenv("MOE_GROUPED_GEMM_RASTER", raster)
    m_splits, index, x, dout, w = _operands(shape, pattern, index_pattern)
    for out_dtype in (torch.bfloat16, torch.float32):
        case = f"{raster=} {shape=} {pattern=} {index_pattern=} {out_dtype=}"
        _assert_bitwise(cuda_backend.fprop_gathered(x, index, w, m_splits, out_dtype),
                        cuda_backend.fprop(gather_rows(x, index), w, m_splits, None, out_dtype), "fprop " + case)
        _assert_bitwise(cuda_backend.dgrad_gathered(dout, index, w, m_splits, out_dtype),
                        cuda_backend.dgrad(gather_rows(dout, index), w, m_splits, out_dtype), "dgrad " + case)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("index_pattern", INDEX_PATTERNS)
@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_cuda_wgrad_gathered_equals_plain_kernel(shape, pattern, index_pattern):
    num_experts, tokens, top_k, k, n = shape
    m_splits, index, x, dout, _ = _operands(shape, pattern, index_pattern)
    h = torch.randn(tokens * top_k, k, device="cuda").bfloat16()
    dg = torch.randn(tokens * top_k, n, device="cuda").bfloat16()
    # fc2's wgrad reads dy through the index; fc1's reads x through it.
    for name, dy, dy_index, xx, x_index in (("dy", dout, index, h, None), ("x", dg, None, x, index),
                                            ("both", dout, index, x, index)):
        plain_dy = gather_rows(dy, dy_index) if dy_index is not None else dy
        plain_x = gather_rows(xx, x_index) if x_index is not None else xx
        for out_dtype, accumulate in ((torch.float32, False), (torch.bfloat16, False), (torch.float32, True)):
            case = f"wgrad gathered {name} {shape=} {pattern=} {index_pattern=} {out_dtype=} {accumulate=}"
            start = torch.randn(num_experts, n, k, device="cuda").to(out_dtype)
            if not accumulate:
                start.fill_(float("nan"))  # experts the kernel skips show up
            got, expected = start.clone(), start.clone()
            cuda_backend.wgrad_gathered(dy, dy_index, xx, x_index, m_splits, [got], accumulate)
            cuda_backend.wgrad(plain_dy, plain_x, m_splits, [expected], accumulate)
            _assert_bitwise(got, expected, case)


@pytest.mark.gpu
@needs_kernels
def test_cuda_gathered_against_float64():
    # The bitwise tests above lean on the plain kernels; this one does not.
    m_splits, index, x, dout, w = _operands((8, 512, 4, 520, 392), "skewed", "unmapped_rows", seed=3)
    xp = gather_rows(x, index).double()
    y = cuda_backend.fprop_gathered(x, index, w, m_splits, torch.float32).double()
    expected = torch.empty_like(y)
    for e, (s, t) in enumerate(bounds(m_splits.tolist())):
        expected[s:t] = xp[s:t] @ w[0][e].double().t()
    assert (y - expected).abs().max().item() < 2e-2 * expected.abs().max().item()


@pytest.mark.gpu
@needs_kernels
def test_cuda_gathered_falls_back_where_no_kernel_is_built():
    # fp16 has no gathered kernels: the rows are copied and the plain kernel runs.
    m_splits, index, x, _, w = _operands((4, 150, 2, 264, 520), "balanced", "unmapped_rows")
    x16, w16 = x.half(), [w[0].half()]
    _assert_bitwise(cuda_backend.fprop_gathered(x16, index, w16, m_splits, torch.float16),
                    cuda_backend.fprop(gather_rows(x16, index), w16, m_splits, None, torch.float16), "fp16")
    # No source rows (every copy dropped): zeros, as the plain kernel gives.
    empty = x[:0]
    got = cuda_backend.fprop_gathered(empty, torch.full_like(index, -1), w, m_splits, torch.bfloat16)
    assert torch.count_nonzero(got) == 0


@pytest.mark.gpu
@needs_kernels
def test_cuda_gathered_ops_take_an_empty_index():
    # Every copy dropped (capacity_factor 0): no rows to read, and the empty index has no storage.
    num_experts, tokens, k, n = 4, 3, 264, 528
    x = torch.randn(tokens, k, device="cuda").bfloat16()
    dy = torch.randn(tokens, n, device="cuda").bfloat16()
    w = [torch.randn(num_experts, n, k, device="cuda").bfloat16()]
    m_splits = torch.zeros(num_experts, dtype=torch.int32, device="cuda")
    index = torch.empty(0, dtype=torch.int32, device="cuda")
    assert cuda_backend.fprop_gathered(x, index, w, m_splits, torch.bfloat16).shape == (0, n)
    assert cuda_backend.dgrad_gathered(dy, index, w, m_splits, torch.bfloat16).shape == (0, k)
    g, h = cuda_backend.fprop_swiglu(x, index, w, m_splits)
    assert g.shape == (0, n) and h.shape == (0, n // 2)
    dw = torch.full((num_experts, n, k), float("nan"), device="cuda")
    cuda_backend.wgrad_gathered(dy, index, x, index, m_splits, [dw], False)
    assert torch.count_nonzero(dw) == 0  # no tokens: zero gradients, as the plain wgrad gives


@pytest.mark.gpu
@needs_kernels
def test_cuda_gathered_entry_points_refuse_bad_input():
    lib = _core.require()
    m_splits, index, x, _, w = _operands((4, 150, 2, 264, 520), "balanced", "routing")
    y = torch.empty(index.shape[0], 520, dtype=torch.bfloat16, device="cuda")
    problem = cuda_backend.grouped_problem(y, m_splits, 4, 520, 264, cuda_backend.SLOT_FPROP_DGRAD)
    weight = cuda_backend.group_operand(w)

    def call(source, rows, dtype=_core.dtype_code(torch.bfloat16)):
        problem.dtype = dtype
        return lib.mg_grouped_fprop_gathered(ctypes.byref(problem), source.data_ptr(), rows, weight, y.data_ptr(),
                                             dtype, _core.stream_handle(x.device))

    with pytest.raises(ValueError, match="row index must be a device pointer"):
        _core.check(call(x, _core.RowGather(index=None, source_rows=150)))
    with pytest.raises(ValueError, match="source_rows must be in"):
        _core.check(call(x, _core.RowGather(index=index.data_ptr(), source_rows=0)))
    with pytest.raises(ValueError, match="source_rows must be in"):
        _core.check(call(x, _core.RowGather(index=index.data_ptr(), source_rows=2**31)))
    with pytest.raises(ValueError, match="4-byte aligned"):
        _core.check(call(x, _core.RowGather(index=index.data_ptr() + 2, source_rows=150)))
    with pytest.raises(_core.UnsupportedError, match="built for bf16"):
        _core.check(call(x.half(), _core.RowGather(index=index.data_ptr(), source_rows=150),
                         _core.dtype_code(torch.float16)))


@pytest.mark.gpu
@needs_kernels
def test_cuda_gathered_graph_replays_with_new_index_and_splits():
    num_experts, tokens, top_k, k, n = 16, 300, 4, 264, 520
    rows = tokens * top_k
    x = torch.randn(tokens, k, device="cuda").bfloat16()
    dout = torch.randn(tokens, n, device="cuda").bfloat16()
    w = [(torch.randn(num_experts, n, k, device="cuda") / k**0.5).bfloat16()]
    m_splits = torch.empty(num_experts, dtype=torch.int32, device="cuda")
    index = torch.empty(rows, dtype=torch.int32, device="cuda")
    dw = torch.empty(num_experts, n, k, device="cuda")

    def step():
        y = cuda_backend.fprop_gathered(x, index, w, m_splits, torch.bfloat16)
        cuda_backend.wgrad_gathered(dout, index, y[:, :k].contiguous(), None, m_splits, [dw], False)
        return y, dw.clone()

    load_routing(m_splits, index, tokens, top_k, 0)
    graph, (static_y, static_dw) = capture_after_a_step(step)
    for seed in range(1, 41):
        load_routing(m_splits, index, tokens, top_k, seed)
        graph.replay()
        y, expected_dw = step()
        _assert_bitwise(static_y, y, f"replay {seed} y")
        _assert_bitwise(static_dw, expected_dw, f"replay {seed} dw")
