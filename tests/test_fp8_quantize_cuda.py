"""The core's FP8 1x128 quantize kernels against the reference, bit for bit (GPU)."""

import pytest
import torch

from moe_grouped import _core, fp8

from cases import SPLIT_PATTERNS, make_splits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _core.has(_core.CAP_FP8_QUANTIZE), reason="core without FP8 quantize kernels"),
]

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


def random_input(rows, cols, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-4, 4, rows).unsqueeze(1)
    if rows > 3:
        x[3] = 0  # an all-zero row: scale 1
    return x.to(dtype).cuda()


@pytest.mark.parametrize("cols", [7, 128, 200, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("fp8_dtype", FP8, ids=str)
@pytest.mark.parametrize("pow2,epsilon", [(True, 0.0), (False, 0.0), (True, 1e-2)])
def test_rowwise_matches_reference_bitwise(cols, dtype, fp8_dtype, pow2, epsilon):
    x = random_input(37, cols, dtype, seed=cols)
    got = fp8.quantize_rowwise(x, fp8_dtype, pow2, epsilon)
    want = fp8.quantize_1x128(x.cpu(), fp8_dtype, pow2, epsilon)
    case = f"{cols=} {dtype=} {fp8_dtype=} {pow2=} {epsilon=}"
    assert torch.equal(got.scale_inv.cpu(), want.scale_inv), case
    assert same_bits(got.data, want.data), case


@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
@pytest.mark.parametrize("num_groups,rows,cols", [(1, 300, 64), (4, 517, 200), (32, 4096, 128), (256, 2000, 96)])
@pytest.mark.parametrize("fp8_dtype", FP8, ids=str)
@pytest.mark.parametrize("splits_dtype", [torch.int32, torch.int64], ids=str)
def test_columnwise_grouped_matches_reference_bitwise(pattern, num_groups, rows, cols, fp8_dtype, splits_dtype):
    splits = make_splits(pattern, num_groups, rows, seed=num_groups)
    x = random_input(rows, cols, torch.bfloat16, seed=rows)
    out = fp8.quantize_columnwise_grouped(x, torch.tensor(splits, dtype=splits_dtype, device="cuda"), fp8_dtype, True)
    want = fp8.quantize_grouped_columnwise(x.cpu(), splits, fp8_dtype, True)
    assert out.data.shape == (cols, rows)
    assert out.scale_inv.shape == (cols, fp8.columnwise_scale_columns(rows, num_groups))
    start, block = 0, 0
    for e, (count, group) in enumerate(zip(splits, want)):
        case = f"{pattern=} {num_groups=} {rows=} {cols=} expert {e} of {splits}"
        blocks = -(-count // 128)
        assert same_bits(out.data[:, start : start + count], group.data), case
        assert torch.equal(out.scale_inv[:, block : block + blocks].cpu(), group.scale_inv), case
        start, block = start + count, block + blocks


def test_columnwise_replays_under_capture_with_new_splits():
    num_groups, rows, cols = 8, 1024, 256
    static_x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    static_splits = torch.tensor(make_splits("balanced", num_groups, rows), device="cuda")
    out = fp8.quantize_columnwise_grouped(static_x, static_splits, torch.float8_e4m3fn)  # warm-up: workspace
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8.quantize_columnwise_grouped(static_x, static_splits, torch.float8_e4m3fn, out=out)
    for replay in range(50):
        splits = make_splits(SPLIT_PATTERNS[replay % len(SPLIT_PATTERNS)], num_groups, rows, seed=replay)
        static_x.copy_(torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16))
        static_splits.copy_(torch.tensor(splits))
        graph.replay()
        eager = fp8.quantize_columnwise_grouped(static_x, torch.tensor(splits, device="cuda"), torch.float8_e4m3fn)
        blocks = sum(-(-c // 128) for c in splits)
        assert same_bits(out.data, eager.data), f"{replay=} {splits=}"
        assert torch.equal(out.scale_inv[:, :blocks], eager.scale_inv[:, :blocks]), f"{replay=} {splits=}"


def test_bad_arguments_are_value_errors():
    x = torch.randn(4, 128, device="cuda")
    with pytest.raises(TypeError, match="fp8_dtype"):
        fp8.quantize_rowwise(x, torch.bfloat16)
    with pytest.raises(ValueError, match="amax_epsilon must be non-negative"):
        fp8.quantize_rowwise(x, torch.float8_e4m3fn, True, -1.0)
    with pytest.raises(ValueError, match="out must hold"):
        bad = fp8.BlockQuantized(torch.empty(1, 1, device="cuda", dtype=torch.float8_e4m3fn), torch.empty(1, 1, device="cuda"))
        fp8.quantize_columnwise_grouped(x, torch.tensor([4], device="cuda"), torch.float8_e4m3fn, out=bad)
