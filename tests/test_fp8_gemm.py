"""FP8 block-scaled grouped GEMMs.

The kernels (GPU) against dequantize-then-multiply in float32, over shapes
with N and K not multiples of 128 and the split patterns; the reference
backend (CPU) against the float64 oracle of the dequantized operands. The
operands are built here from the reference quantizers, group by group, so
that these tests do not depend on the quantize kernels.
"""

import pytest
import torch

from moe_grouped import _core
from moe_grouped.fp8 import (
    BlockQuantized,
    dequantize_128x128,
    dequantize_1x128,
    quantize_128x128,
    quantize_1x128,
    quantize_grouped_columnwise,
)
from moe_grouped.fp8 import gemm as fp8_gemm

from cases import SPLIT_PATTERNS, bounds, make_splits, needs_cuda_kernels

kernels = needs_cuda_kernels(_core.CAP_GROUPED_GEMM_FP8_BLOCKWISE, "FP8 grouped GEMMs")

# (E, M, N, K): N and K multiples of 16, some not of 128. The last shape has
# longer odd reductions (fprop 7, dgrad 5, wgrad 5 or 9 K blocks of 128).
SHAPES = [(4, 512, 256, 384), (8, 1000, 272, 400), (3, 129, 128, 144), (16, 2048, 512, 1024), (2, 1100, 640, 896)]


def rand(*shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen)


def quantize_weights(w: torch.Tensor, transpose: bool) -> BlockQuantized:
    """[E, N, K] -> 128x128 blocks of each W_e (or W_e^T), stacked."""
    parts = [quantize_128x128(we.t() if transpose else we, torch.float8_e4m3fn, True) for we in w]
    return BlockQuantized(torch.stack([p.data for p in parts]), torch.stack([p.scale_inv for p in parts]))


def pack_columnwise(x: torch.Tensor, splits: list[int], fp8_dtype) -> BlockQuantized:
    """The grouped column-wise layout, from the reference quantizer."""
    return quantize_grouped_columnwise(x, splits, fp8_dtype, True)


def to(q: BlockQuantized, device) -> BlockQuantized:
    return BlockQuantized(q.data.to(device), q.scale_inv.to(device))


def cuda_wgrad_operands(m: int, n: int, k: int, splits: list[int], seed: int):
    """E4M3 column-wise dy^T [n, .] and x^T [k, .] of random [m, n] and [m, k], on the GPU."""
    dyt = pack_columnwise(rand(m, n, seed=seed), splits, torch.float8_e4m3fn)
    xt = pack_columnwise(rand(m, k, seed=seed + 1), splits, torch.float8_e4m3fn)
    return to(dyt, "cuda"), to(xt, "cuda")


def oracle_rowwise(a: torch.Tensor, b_e: list[torch.Tensor], splits) -> torch.Tensor:
    """float64 ``a[rows of e] @ b_e[e]^T`` (b_e [N, K] per group)."""
    a = a.double()
    out = torch.zeros(a.shape[0], b_e[0].shape[0], dtype=torch.float64)
    for g, (s, t) in enumerate(bounds(splits)):
        out[s:t] = a[s:t] @ b_e[g].double().t()
    return out


def assert_near(actual: torch.Tensor, expected: torch.Tensor, rel: float, case: str) -> None:
    actual = actual.detach().double().cpu()
    assert actual.shape == expected.shape, case
    assert torch.isfinite(actual).all(), f"{case}: non-finite output"
    scale = expected.abs().max().item()
    error = (actual - expected).abs().max().item()
    assert error <= rel * max(scale, 1e-30), f"{case}: max error {error:.3e} vs max |expected| {scale:.3e}"


# ---- reference backend: runs everywhere -----------------------------------


@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
def test_reference_gemms_match_float64_of_dequantized_operands(pattern):
    e, m, n, k = 5, 300, 160, 272
    splits = make_splits(pattern, e, m, seed=1)
    x, w, dy = rand(m, k, seed=1), rand(e, n, k, seed=2) * 0.05, rand(m, n, seed=3)
    m_splits = torch.tensor(splits)
    xq, dyq = quantize_1x128(x, torch.float8_e4m3fn, True), quantize_1x128(dy, torch.float8_e5m2, True)
    wq, wtq = quantize_weights(w, False), quantize_weights(w, True)
    w_deq = [dequantize_128x128(BlockQuantized(wq.data[g], wq.scale_inv[g])) for g in range(e)]
    bias = rand(e, n, seed=4)

    y = fp8_gemm.grouped_fprop_fp8(xq, wq, m_splits, bias, backend="reference")
    want = oracle_rowwise(dequantize_1x128(xq), w_deq, splits)
    for g, (s, t) in enumerate(bounds(splits)):
        want[s:t] += bias[g].to(torch.bfloat16).double()
    assert_near(y, want, 1e-2, f"fprop {pattern}")

    dx = fp8_gemm.grouped_dgrad_fp8(dyq, wtq, m_splits, backend="reference")
    want = oracle_rowwise(dequantize_1x128(dyq), [wd.t() for wd in w_deq], splits)
    assert_near(dx, want, 1e-2, f"dgrad {pattern}")

    dyt, xt = pack_columnwise(dy, splits, torch.float8_e5m2), pack_columnwise(x, splits, torch.float8_e4m3fn)
    dw = torch.full((e, n, k), 7.0)
    fp8_gemm.grouped_wgrad_fp8(dyt, xt, m_splits, [dw], total_rows=m, backend="reference")
    for g, (s, t) in enumerate(bounds(splits)):
        dy_g = dequantize_1x128(quantize_1x128(dy[s:t].t(), torch.float8_e5m2, True)) if t > s else None
        x_g = dequantize_1x128(quantize_1x128(x[s:t].t(), torch.float8_e4m3fn, True)) if t > s else None
        want_g = dy_g.double() @ x_g.double().t() if t > s else torch.zeros(n, k, dtype=torch.float64)
        assert_near(dw[g], want_g, 1e-5, f"wgrad group {g} {pattern}")


def test_wgrad_rejects_a_mismatched_columnwise_layout():
    e, m, n, k = 3, 100, 32, 48
    splits = [50, 0, 50]
    dyt = pack_columnwise(rand(m, n, seed=1), splits, torch.float8_e4m3fn)
    xt = pack_columnwise(rand(m, k, seed=2), splits, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="column-wise layout"):  # sized for 228 rows, not 100
        fp8_gemm.grouped_wgrad_fp8(dyt, xt, torch.tensor(splits), [torch.zeros(e, n, k)], total_rows=m + 128,
                                   backend="reference")
    with pytest.raises(TypeError, match="float32 or all bfloat16"):
        fp8_gemm.grouped_wgrad_fp8(dyt, xt, torch.tensor(splits), [torch.zeros(e, n, k, dtype=torch.float16)],
                                   total_rows=m, backend="reference")


def test_fprop_rejects_bad_operands():
    xq = quantize_1x128(rand(64, 128, seed=1), torch.float8_e4m3fn, True)
    wq = quantize_weights(rand(2, 32, 128, seed=2), False)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fp8_gemm.grouped_fprop_fp8(BlockQuantized(xq.data.view(torch.float8_e5m2), xq.scale_inv), wq,
                                   torch.tensor([32, 32]), backend="reference")
    with pytest.raises(ValueError, match="columns"):
        fp8_gemm.grouped_fprop_fp8(xq, quantize_weights(rand(2, 32, 144, seed=3), False), torch.tensor([32, 32]),
                                   backend="reference")
    with pytest.raises(ValueError, match="backend"):
        fp8_gemm.grouped_fprop_fp8(xq, wq, torch.tensor([32, 32]), backend="torch")


# ---- the core's kernels ---------------------------------------------------


@pytest.mark.gpu
@kernels
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("splits_dtype", [torch.int64, torch.int32], ids=str)
def test_fprop_kernel_matches_reference(shape, pattern, with_bias, splits_dtype):
    e, m, n, k = shape
    splits = make_splits(pattern, e, m, seed=m + n)
    x, w = rand(m, k, seed=1), rand(e, n, k, seed=2) * 0.05
    xq, wq = quantize_1x128(x, torch.float8_e4m3fn, True), quantize_weights(w, False)
    bias = rand(e, n, seed=3).to(torch.bfloat16) if with_bias else None
    m_splits = torch.tensor(splits, dtype=splits_dtype)
    want = fp8_gemm.grouped_fprop_fp8(xq, wq, m_splits, bias, backend="reference")
    got = fp8_gemm.grouped_fprop_fp8(to(xq, "cuda"), to(wq, "cuda"), m_splits.cuda(),
                                     bias.cuda() if bias is not None else None)
    assert_near(got.float(), want.double(), 1e-2, f"fprop {shape} {pattern} bias={with_bias}")


@pytest.mark.gpu
@kernels
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_dgrad_kernel_matches_reference(shape, pattern, fp8_dtype):
    e, m, n, k = shape
    splits = make_splits(pattern, e, m, seed=m + k)
    dy, w = rand(m, n, seed=4), rand(e, n, k, seed=5) * 0.05
    dyq, wtq = quantize_1x128(dy, fp8_dtype, True), quantize_weights(w, True)
    m_splits = torch.tensor(splits)
    want = fp8_gemm.grouped_dgrad_fp8(dyq, wtq, m_splits, backend="reference")
    got = fp8_gemm.grouped_dgrad_fp8(to(dyq, "cuda"), to(wtq, "cuda"), m_splits.cuda())
    assert_near(got.float(), want.double(), 1e-2, f"dgrad {shape} {pattern} {fp8_dtype}")


@pytest.mark.gpu
@kernels
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
def test_dgrad_tiles_give_the_same_bits(shape, pattern, monkeypatch):
    """The E4M3 dgrad has 128x256 and 128x128 kernels (the heuristic picks by N = k, e.g. 128x128 at
    k = 144); each 64x128 half of the wide tile is promoted as the 128x128 kernel promotes its tile."""
    e, m, n, k = shape
    splits = make_splits(pattern, e, m, seed=m + k + 2)
    dyq = to(quantize_1x128(rand(m, n, seed=16), torch.float8_e4m3fn, True), "cuda")
    wtq = to(quantize_weights(rand(e, n, k, seed=17) * 0.05, True), "cuda")
    m_splits = torch.tensor(splits, device="cuda")
    out = {}
    for schedule in ("cooperative", "narrow"):
        monkeypatch.setenv("MOE_GROUPED_FP8_SCHEDULE", schedule)
        out[schedule] = fp8_gemm.grouped_dgrad_fp8(dyq, wtq, m_splits)
    assert torch.equal(out["cooperative"], out["narrow"]), f"{shape} {pattern}"


@pytest.mark.gpu
@kernels
def test_wgrad_zero_fills_empty_groups_past_the_setup_kernels_first_chunk():
    """As the 16-bit wgrad's test: 1100 groups, tokens for four on both sides of the setup kernel's first
    1024-group chunk; the other groups' dW (NaN before) must come back zero."""
    e, n, k = 1100, 128, 128
    splits = [0] * e
    for group, count in ((3, 40), (1023, 24), (1024, 8), (1099, 56)):
        splits[group] = count
    m = sum(splits)
    dyt = pack_columnwise(rand(m, n, seed=12), splits, torch.float8_e4m3fn)
    xt = pack_columnwise(rand(m, k, seed=13), splits, torch.float8_e4m3fn)
    want = torch.zeros(e, n, k)
    fp8_gemm.grouped_wgrad_fp8(dyt, xt, torch.tensor(splits), [want], total_rows=m, backend="reference")
    got = torch.full((e, n, k), float("nan"), device="cuda")
    fp8_gemm.grouped_wgrad_fp8(to(dyt, "cuda"), to(xt, "cuda"), torch.tensor(splits, device="cuda"), [got],
                               total_rows=m)
    for g, count in enumerate(splits):
        if count:
            assert_near(got[g].float(), want[g].double(), 2e-3, f"group {g}")
    empty = torch.tensor([count == 0 for count in splits], device="cuda")
    assert torch.count_nonzero(got[empty]) == 0, "an empty group's dW is not zero"


@pytest.mark.gpu
@kernels
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("out_dtype,accumulate", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)],
                         ids=str)
def test_wgrad_kernel_matches_reference(shape, pattern, fp8_dtype, out_dtype, accumulate):
    e, m, n, k = shape
    splits = make_splits(pattern, e, m, seed=n + k)
    dy, x = rand(m, n, seed=6), rand(m, k, seed=7)
    dyt, xt = pack_columnwise(dy, splits, fp8_dtype), pack_columnwise(x, splits, torch.float8_e4m3fn)
    m_splits = torch.tensor(splits)
    start = rand(e, n, k, seed=8).to(out_dtype)
    want = start.clone()
    fp8_gemm.grouped_wgrad_fp8(dyt, xt, m_splits, [want], total_rows=m, accumulate=accumulate, backend="reference")
    got = start.cuda()
    fp8_gemm.grouped_wgrad_fp8(to(dyt, "cuda"), to(xt, "cuda"), m_splits.cuda(), [got], total_rows=m,
                               accumulate=accumulate)
    case = f"wgrad {shape} {pattern} {fp8_dtype} {out_dtype} accumulate={accumulate}"
    for g, count in enumerate(splits):
        if count == 0:
            expected_empty = start[g] if accumulate else torch.zeros(n, k, dtype=out_dtype)
            assert torch.equal(got[g].cpu(), expected_empty), f"{case}: empty group {g}"
        else:
            assert_near(got[g].float(), want[g].double(), 2e-3 if out_dtype == torch.float32 else 1e-2,
                        f"{case}: group {g}")


@pytest.mark.gpu
@kernels
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
@pytest.mark.parametrize("schedule", ["cooperative", "narrow"])
def test_wgrad_schedules_into_fp32_match_reference(shape, pattern, schedule, monkeypatch):
    """E4M3 wgrad into fp32 has cooperative 128x256 and 128x128 kernels (the heuristic picks by N);
    MOE_GROUPED_FP8_SCHEDULE forces each, and each must match the reference."""
    monkeypatch.setenv("MOE_GROUPED_FP8_SCHEDULE", schedule)
    e, m, n, k = shape
    splits = make_splits(pattern, e, m, seed=n + k + 1)
    dyt = pack_columnwise(rand(m, n, seed=9), splits, torch.float8_e4m3fn)
    xt = pack_columnwise(rand(m, k, seed=10), splits, torch.float8_e4m3fn)
    m_splits = torch.tensor(splits)
    start = rand(e, n, k, seed=11)
    want = start.clone()
    fp8_gemm.grouped_wgrad_fp8(dyt, xt, m_splits, [want], total_rows=m, accumulate=True, backend="reference")
    got = start.cuda()
    fp8_gemm.grouped_wgrad_fp8(to(dyt, "cuda"), to(xt, "cuda"), m_splits.cuda(), [got], total_rows=m,
                               accumulate=True)
    for g in range(e):
        assert_near(got[g].float(), want[g].double(), 2e-3, f"wgrad {schedule} {shape} {pattern}: group {g}")


@pytest.mark.gpu
@kernels
@pytest.mark.parametrize("value", ["auto", "pingpong", "Narrow"])
def test_schedule_env_takes_auto_or_a_built_schedule(value, monkeypatch):
    """MOE_GROUPED_FP8_SCHEDULE forces measurements: a value naming no schedule (ping-pong is no longer
    built) fails the call rather than quietly running the heuristic's kernel; auto is the heuristic."""
    monkeypatch.setenv("MOE_GROUPED_FP8_SCHEDULE", value)
    e, m, n, k = SHAPES[0]
    splits = make_splits("balanced", e, m)
    dyt, xt = cuda_wgrad_operands(m, n, k, splits, seed=14)
    out = torch.zeros(e, n, k, device="cuda")
    call = lambda: fp8_gemm.grouped_wgrad_fp8(dyt, xt, torch.tensor(splits, device="cuda"), [out],  # noqa: E731
                                              total_rows=m)
    if value == "auto":
        call()
        assert torch.isfinite(out).all() and out.abs().sum() > 0
    else:
        with pytest.raises(ValueError, match=f"MOE_GROUPED_FP8_SCHEDULE={value}: expected auto, cooperative or"):
            call()


@pytest.mark.gpu
@kernels
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_wgrad_tiles_give_the_same_bits(shape, out_dtype, monkeypatch):
    """The 128x256 wgrad tile promotes each 64x128 half as the 128x128 kernel promotes its tile."""
    e, m, n, k = shape
    splits = make_splits("skewed", e, m, seed=n + k)
    dyt, xt = cuda_wgrad_operands(m, n, k, splits, seed=12)
    out = {}
    for schedule in ("cooperative", "narrow"):
        monkeypatch.setenv("MOE_GROUPED_FP8_SCHEDULE", schedule)
        out[schedule] = torch.full((e, n, k), float("nan"), device="cuda", dtype=out_dtype)
        fp8_gemm.grouped_wgrad_fp8(dyt, xt, torch.tensor(splits, device="cuda"), [out[schedule]], total_rows=m)
    assert torch.equal(out["cooperative"], out["narrow"]), shape


@pytest.mark.gpu
@kernels
@pytest.mark.parametrize("raster", ["m", "n"])
def test_wgrad_tile_order_gives_the_same_bits(raster, monkeypatch):
    """MOE_GROUPED_GEMM_RASTER forces the FP8 kernels' tile order too; only the order changes."""
    e, m, n, k = 8, 1000, 272, 400
    splits = make_splits("skewed", e, m, seed=3)
    dyt, xt = cuda_wgrad_operands(m, n, k, splits, seed=14)
    out = {}
    for order in ("auto", raster):
        monkeypatch.setenv("MOE_GROUPED_GEMM_RASTER", order)
        out[order] = torch.full((e, n, k), float("nan"), device="cuda", dtype=torch.bfloat16)
        fp8_gemm.grouped_wgrad_fp8(dyt, xt, torch.tensor(splits, device="cuda"), [out[order]], total_rows=m)
    assert torch.equal(out["auto"], out[raster])
    monkeypatch.setenv("MOE_GROUPED_GEMM_RASTER", "diagonal")
    with pytest.raises(ValueError, match="MOE_GROUPED_GEMM_RASTER=diagonal: expected auto, m or n"):
        fp8_gemm.grouped_wgrad_fp8(dyt, xt, torch.tensor(splits, device="cuda"), [out[raster]], total_rows=m)


@pytest.mark.gpu
@kernels
def test_wgrad_kernel_into_separate_main_grads():
    e, m, n, k = 4, 600, 128, 256
    splits = [100, 0, 372, 128]
    dy, x = rand(m, n, seed=9), rand(m, k, seed=10)
    dyt, xt = pack_columnwise(dy, splits, torch.float8_e4m3fn), pack_columnwise(x, splits, torch.float8_e4m3fn)
    grads = [torch.ones(n, k, device="cuda") for _ in range(e)]
    want = [torch.ones(n, k) for _ in range(e)]
    fp8_gemm.grouped_wgrad_fp8(dyt, xt, torch.tensor(splits), want, total_rows=m, accumulate=True, backend="reference")
    fp8_gemm.grouped_wgrad_fp8(to(dyt, "cuda"), to(xt, "cuda"), torch.tensor(splits, device="cuda"), grads,
                               total_rows=m, accumulate=True)
    for g in range(e):
        assert_near(grads[g], want[g].double(), 2e-3, f"group {g}")


@pytest.mark.gpu
@kernels
def test_kernels_reject_shapes_tma_cannot_read():
    xq = to(quantize_1x128(rand(64, 136, seed=1), torch.float8_e4m3fn, True), "cuda")
    wq = to(quantize_weights(rand(2, 32, 136, seed=2), False), "cuda")
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_gemm.grouped_fprop_fp8(xq, wq, torch.tensor([32, 32], device="cuda"))

