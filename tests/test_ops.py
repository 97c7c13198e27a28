"""Every grouped op on every backend against the float64 oracle."""

import pytest
import torch

from moe_grouped import gemm

from cases import (
    backends_for,
    SPLIT_PATTERNS,
    assert_close_to,
    make_splits,
    oracle_dbias,
    oracle_dgrad,
    oracle_fprop,
    oracle_wgrad,
)

# (E, M, K, N): a single expert, few experts, many experts with few tokens.
SHAPES = [(1, 24, 16, 24), (4, 96, 32, 48), (8, 40, 64, 40), (16, 256, 24, 16)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def devices():
    params = [pytest.param("cpu", id="cpu")]
    params.append(pytest.param("cuda", id="cuda", marks=pytest.mark.gpu))
    return params


def make_problem(shape, dtype, device, pattern, layout, seed=0):
    num_experts, total, k, n = shape
    gen = torch.Generator().manual_seed(seed)
    splits = make_splits(pattern, num_experts, total, seed)
    x = torch.randn(total, k, generator=gen).to(dtype).to(device)
    stacked = (torch.randn(num_experts, n, k, generator=gen) / k**0.5).to(dtype).to(device)
    weights = [stacked] if layout == "grouped" else [w.clone() for w in stacked.unbind(0)]
    return splits, x, weights


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}_M{}_K{}_N{}".format(*s))
def test_fprop_dgrad_wgrad_dbias(device, pattern, dtype, shape):
    for backend in backends_for(device, dtype):
        for layout in ("grouped", "separate"):
            case = f"{backend=} {layout=} {device=} {pattern=} {dtype=} {shape=}"
            splits, x, weights = make_problem(shape, dtype, device, pattern, layout)
            m_splits = torch.tensor(splits, device=device)
            num_experts, total, k, n = shape
            bias = torch.randn(num_experts, n).to(dtype).to(device)

            y = gemm.grouped_fprop(x, weights, m_splits, bias, backend=backend)
            assert y.dtype == dtype
            assert_close_to(y, oracle_fprop(x, weights, splits, bias), dtype, "fprop " + case)

            dy = torch.randn(total, n).to(dtype).to(device)
            dx = gemm.grouped_dgrad(dy, weights, m_splits, backend=backend)
            assert_close_to(dx, oracle_dgrad(dy, weights, splits), dtype, "dgrad " + case)

            dw = gemm.grouped_wgrad(dy, x, m_splits, num_groups=num_experts, backend=backend)
            assert_close_to(dw[0], oracle_wgrad(dy, x, splits), dtype, "wgrad " + case)

            db = gemm.grouped_dbias(dy, m_splits, backend=backend)
            assert_close_to(db, oracle_dbias(dy, splits), dtype, "dbias " + case)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("layout", ["grouped", "separate"])
@pytest.mark.parametrize("pattern", ["skewed", "zero_token_experts"])
def test_wgrad_accumulates_into_fp32_and_leaves_empty_experts(device, layout, pattern):
    shape = (6, 64, 32, 24)
    for backend in backends_for(device):
        splits, x, weights = make_problem(shape, torch.bfloat16, device, pattern, layout, seed=3)
        dy = torch.randn(shape[1], shape[3]).to(torch.bfloat16).to(device)
        start = torch.randn(shape[0], shape[3], shape[2], dtype=torch.float32)
        out = [start.clone().to(device)] if layout == "grouped" else [s.clone().to(device) for s in start]
        gemm.grouped_wgrad(dy, x, torch.tensor(splits, device=device), out=out, accumulate=True, backend=backend)
        result = out[0] if layout == "grouped" else torch.stack(out)
        expected = start.double() + oracle_wgrad(dy, x, splits)
        case = f"{backend=} {layout=} {pattern=}"
        assert_close_to(result, expected, torch.bfloat16, case)
        for e, count in enumerate(splits):
            if count == 0:
                assert torch.equal(result[e].cpu(), start[e]), f"{case}: empty expert {e} was modified"


@pytest.mark.parametrize("device", devices())
def test_wgrad_zeroes_empty_experts_over_garbage(device):
    shape = (4, 32, 16, 16)
    splits = [0, 20, 0, 12]
    for backend in backends_for(device, torch.float32):
        _, x, _ = make_problem(shape, torch.float32, device, "balanced", "grouped")
        dy = torch.randn(32, 16, device=device)
        out = [torch.full((4, 16, 16), float("nan"), device=device)]
        gemm.grouped_wgrad(dy, x, torch.tensor(splits, device=device), out=out, backend=backend)
        assert torch.equal(out[0][0].cpu(), torch.zeros(16, 16)), backend
        assert torch.equal(out[0][2].cpu(), torch.zeros(16, 16)), backend
        assert_close_to(out[0], oracle_wgrad(dy, x, splits), torch.float32, backend)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("splits_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
def test_splits_to_offsets(device, splits_dtype, pattern):
    splits = make_splits(pattern, 7, 50, seed=1)
    expected = [0]
    for count in splits:
        expected.append(expected[-1] + count)
    backends = backends_for(device)
    for backend in backends:
        offsets = gemm.splits_to_offsets(torch.tensor(splits, dtype=splits_dtype, device=device), 50, backend=backend)
        assert offsets.dtype == torch.int64 and offsets.device.type == device
        assert offsets.tolist() == expected, backend


@pytest.mark.parametrize("device", devices())
def test_offsets_clamp_invalid_splits_identically_on_every_backend(device):
    # A wrong m_splits never reaches the host (no sync), so every backend must
    # clamp it the same safe way: negatives count as zero, nothing past M.
    splits = torch.tensor([5, -3, 40, 7], device=device)
    for backend in backends_for(device):
        offsets = gemm.splits_to_offsets(splits, 30, backend=backend)
        assert offsets.tolist() == [0, 5, 5, 30, 30], backend


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_out_dtype_float32(backend):
    splits, x, weights = make_problem((3, 30, 16, 8), torch.bfloat16, "cpu", "skewed", "grouped")
    y = gemm.grouped_fprop(x, weights, splits, out_dtype=torch.float32, backend=backend)
    assert y.dtype == torch.float32
    assert_close_to(y, oracle_fprop(x, weights, splits), torch.bfloat16, backend)


def test_list_splits_are_accepted_and_match_tensor_splits():
    splits, x, weights = make_problem((4, 40, 16, 8), torch.float32, "cpu", "skewed", "grouped")
    from_list = gemm.grouped_fprop(x, weights, splits, backend="torch")
    from_tensor = gemm.grouped_fprop(x, weights, torch.tensor(splits, dtype=torch.int32), backend="torch")
    assert torch.equal(from_list, from_tensor)
