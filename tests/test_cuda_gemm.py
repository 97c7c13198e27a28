"""The ``cuda`` backend's grouped GEMMs against the float64 oracle, and under
CUDA-graph replay against themselves.

Every kernel is checked with DeepGEMM's similarity metric (``calc_diff``) and
a relative error, over awkward splits (zero-token experts, one token, all
tokens to one expert, E up to 256) and shapes whose N and K are multiples of 8
but not of the 64/128/256-wide tiles.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from moe_grouped import _core

from cases import (
    SPLIT_PATTERNS,
    assert_close_to,
    bounds,
    calc_diff,
    cuda_kernels_reason,
    needs_cuda_kernels,
    make_splits,
    oracle_dbias,
    oracle_dgrad,
    oracle_fprop,
    oracle_wgrad,
)


CUDA_REASON = cuda_kernels_reason()
pytestmark = [pytest.mark.gpu, needs_cuda_kernels()]

if CUDA_REASON is None:
    from moe_grouped.gemm import cuda_backend
else:  # collected but skipped
    cuda_backend = None

# (E, M, K, N): K and N multiples of 8 but not of the tiles; E up to 256.
SHAPES = [(1, 77, 136, 200), (4, 300, 264, 520), (8, 1024, 520, 392), (256, 3000, 128, 64)]
SHAPE_IDS = ["E{}_M{}_K{}_N{}".format(*s) for s in SHAPES]
# bf16 passes 1e-5 easily; fp16's wider mantissa passes it too.
MAX_DIFF = 1e-5


def _problem(shape, dtype, pattern, layout, seed=0):
    num_experts, total, k, n = shape
    gen = torch.Generator().manual_seed(seed)
    splits = make_splits(pattern, num_experts, total, seed)
    x = torch.randn(total, k, generator=gen).to(dtype).cuda()
    stacked = (torch.randn(num_experts, n, k, generator=gen) / k**0.5).to(dtype).cuda()
    weights = [stacked] if layout == "grouped" else [w.clone() for w in stacked.unbind(0)]
    return splits, x, weights


def _check(actual, expected, dtype, case):
    diff = calc_diff(actual, expected)
    assert diff < MAX_DIFF, f"{case}: calc_diff {diff:.3e} >= {MAX_DIFF:.0e}"
    assert_close_to(actual, expected, dtype, case)


@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("layout", ["grouped", "separate"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fprop(dtype, layout, shape, pattern):
    splits, x, weights = _problem(shape, dtype, pattern, layout)
    m_splits = torch.tensor(splits, dtype=torch.int32, device="cuda")
    bias = torch.randn(shape[0], shape[3]).to(dtype).cuda()
    for use_bias in (False, True):
        for out_dtype in (dtype, torch.float32):
            case = f"fprop {dtype=} {layout=} {shape=} {pattern=} {use_bias=} {out_dtype=}"
            b = bias if use_bias else None
            y = cuda_backend.fprop(x, weights, m_splits, b, out_dtype)
            assert y.dtype == out_dtype, case
            _check(y, oracle_fprop(x, weights, splits, b), dtype, case)


@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("layout", ["grouped", "separate"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_dgrad(dtype, layout, shape, pattern):
    splits, _, weights = _problem(shape, dtype, pattern, layout)
    m_splits = torch.tensor(splits, dtype=torch.int64, device="cuda")
    dy = torch.randn(shape[1], shape[3]).to(dtype).cuda()
    expected = oracle_dgrad(dy, weights, splits)
    for out_dtype in (dtype, torch.float32):
        case = f"dgrad {dtype=} {layout=} {shape=} {pattern=} {out_dtype=}"
        dx = cuda_backend.dgrad(dy, weights, m_splits, out_dtype)
        assert dx.dtype == out_dtype, case
        _check(dx, expected, dtype, case)


def _wgrad_out(num_experts, n, k, dtype, layout, fill):
    if fill == "random":
        stacked = torch.randn(num_experts, n, k, device="cuda").to(dtype)
    else:
        stacked = torch.full((num_experts, n, k), fill, dtype=dtype, device="cuda")
    return [stacked] if layout == "grouped" else [w.clone() for w in stacked.unbind(0)]


@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("layout", ["grouped", "separate"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_wgrad(dtype, layout, shape, pattern):
    num_experts, total, k, n = shape
    splits, x, _ = _problem(shape, dtype, pattern, "grouped")
    m_splits = torch.tensor(splits, dtype=torch.int32, device="cuda")
    dy = torch.randn(total, n).to(dtype).cuda()
    expected = oracle_wgrad(dy, x, splits)
    empty = [s == t for s, t in bounds(splits)]

    for out_dtype in (torch.float32, dtype):
        # Overwrite: poisoned with NaN, so an expert the kernels skip shows up.
        case = f"wgrad {dtype=} {layout=} {shape=} {pattern=} {out_dtype=} accumulate=False"
        out = _wgrad_out(num_experts, n, k, out_dtype, layout, float("nan"))
        cuda_backend.wgrad(dy, x, m_splits, out, False)
        got = torch.stack(_experts(out))
        _check(got, expected, dtype, case)
        for e in range(num_experts):
            if empty[e]:
                assert torch.count_nonzero(got[e]) == 0, f"{case}: empty expert {e} is not zero"

    # Accumulate into fp32 main_grad: empty experts stay bitwise untouched.
    case = f"wgrad {dtype=} {layout=} {shape=} {pattern=} accumulate=True"
    out = _wgrad_out(num_experts, n, k, torch.float32, layout, "random")
    before = torch.stack(_experts(out)).clone()
    cuda_backend.wgrad(dy, x, m_splits, out, True)
    got = torch.stack(_experts(out))
    assert_close_to(got, before.double().cpu() + expected, dtype, case)
    for e in range(num_experts):
        if empty[e]:
            assert torch.equal(got[e], before[e]), f"{case}: empty expert {e} was modified"


@pytest.mark.parametrize("layout", ["grouped", "separate"])
def test_wgrad_zero_fills_empty_experts_past_the_setup_kernels_first_chunk(layout):
    """The setup kernel zeroes dW of the experts without tokens as it scans m_splits in chunks of 1024
    groups: with 1100 experts and tokens for four on both sides of the chunk boundary, every other
    expert's dW (NaN before) must come back zero, and the four must match the oracle."""
    num_experts, n, k = 1100, 64, 128
    splits = [0] * num_experts
    for expert, count in ((3, 40), (1023, 24), (1024, 8), (1099, 56)):
        splits[expert] = count
    total = sum(splits)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(total, k, generator=gen).to(torch.bfloat16).cuda()
    dy = torch.randn(total, n, generator=gen).to(torch.bfloat16).cuda()
    out = _wgrad_out(num_experts, n, k, torch.bfloat16, layout, float("nan"))
    cuda_backend.wgrad(dy, x, torch.tensor(splits, dtype=torch.int64, device="cuda"), out, False)
    got = torch.stack(_experts(out))
    full = [e for e, count in enumerate(splits) if count]
    _check(got[full], oracle_wgrad(dy, x, splits)[full], torch.bfloat16, f"wgrad {layout=}, experts with tokens")
    empty = torch.tensor([count == 0 for count in splits], device="cuda")
    assert torch.count_nonzero(got[empty]) == 0, f"{layout=}: an empty expert's dW is not zero"


# The 128x256 tile without a cluster (fprop/dgrad into 16 bits), with a 2x1
# cluster (fp32 outputs, wgrad, and the fallback where a configuration is not
# built), and with a 2x1 cluster storing the tile in 128x64 pieces (bf16 wgrad
# into bf16 with at most 3072 output and at least 2048 input features).
# MOE_GROUPED_GEMM_TILE forces one; only the cluster and how the tile is
# stored differ, so the results are bitwise equal.
TILE_ENV = "MOE_GROUPED_GEMM_TILE"
TILE_CONFIGS = ("coop_128x256x64_c2x1", "coop_128x256x64_c1x1", "coop_128x256x64_c2x1_e128x64")


def _variant_operands(shape, dtype, pattern):
    """splits, x, stacked weights, device m_splits, bias and dy of one case of the kernel-variant tests."""
    splits, x, weights = _problem(shape, dtype, pattern, "grouped")
    m_splits = torch.tensor(splits, dtype=torch.int32, device="cuda")
    bias = torch.randn(shape[0], shape[3]).to(dtype).cuda()
    dy = torch.randn(shape[1], shape[3]).to(dtype).cuda()
    return splits, x, weights, m_splits, bias, dy


def _assert_bitwise_equal(results: dict, case: str):
    """Every variant's outputs (variant -> {op: tensor}) equal the first variant's, bit for bit."""
    (first, expected), *others = results.items()
    for variant, got in others:
        for name, tensor in got.items():
            assert torch.equal(tensor, expected[name]), f"{name} {case}: {variant} differs from {first}"


def _experts(out):
    return list(out[0].unbind(0)) if len(out) == 1 and out[0].dim() == 3 else list(out)


# D is stored through per-group tensor maps built before the GEMM ("prebuilt",
# the default) or through CUTLASS's per-CTA maps rewritten inside the kernel
# ("in_kernel"); MOE_GROUPED_GEMM_STORE_MAPS picks one. Only where the tile is
# written differs, so the results must be bitwise equal.
STORE_MAPS_ENV = "MOE_GROUPED_GEMM_STORE_MAPS"
STORE_MAPS = ("prebuilt", "in_kernel")


def _all_kinds(x, weights, m_splits, bias, dy, dtype):
    """fprop (with and without bias), dgrad, and wgrad overwriting (fp32, dtype) and accumulating."""
    num_experts, n, k = weights[0].shape
    results = {
        "fprop": cuda_backend.fprop(x, weights, m_splits, None, dtype),
        "fprop+bias": cuda_backend.fprop(x, weights, m_splits, bias, dtype),
        "dgrad": cuda_backend.dgrad(dy, weights, m_splits, dtype),
    }
    for out_dtype in (torch.float32, dtype):
        out = torch.full((num_experts, n, k), float("nan"), dtype=out_dtype, device="cuda")
        cuda_backend.wgrad(dy, x, m_splits, [out], False)
        results[f"wgrad->{out_dtype}"] = out
    main_grad = torch.linspace(-1, 1, num_experts * n * k, device="cuda").view(num_experts, n, k)
    cuda_backend.wgrad(dy, x, m_splits, [main_grad], True)
    results["wgrad+=fp32"] = main_grad
    return results


# The tiles are walked along M or along N (heuristic.cpp's raster_along_n picks
# along N for fprop/dgrad with large groups); MOE_GROUPED_GEMM_RASTER forces
# one. Only the order in which tiles run differs: bitwise equal results.
RASTER_ENV = "MOE_GROUPED_GEMM_RASTER"
RASTERS = ("m", "n", "auto")

# A bf16 fprop into bf16 runs on the core's ping-pong kernel where it takes the
# problem (K a multiple of 64: the E=256 shape here) and the heuristic prefers it;
# MOE_GROUPED_GEMM_FPROP forces it or the cooperative kernel. Same wgmma
# instructions over the same k-tiles in the same order: bitwise equal results
# (tests/test_pingpong_fprop.py covers its own shapes and the gathered kernel).
FPROP_ENV = "MOE_GROUPED_GEMM_FPROP"
FPROP_KERNELS = ("pingpong", "cutlass", "auto")

# environment variable and its values; every value must give _all_kinds' results bit for bit
KERNEL_VARIANTS = {
    "tile": (TILE_ENV, TILE_CONFIGS),
    "store_maps": (STORE_MAPS_ENV, STORE_MAPS),
    "raster": (RASTER_ENV, RASTERS),
    "fprop": (FPROP_ENV, FPROP_KERNELS),
}


@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("variants", list(KERNEL_VARIANTS))
def test_kernel_variants_match_reference_and_each_other_bitwise(variants, dtype, shape, pattern, monkeypatch):
    """Variants run the same tiles in the same K order: bitwise equal results, each against the oracle."""
    env, values = KERNEL_VARIANTS[variants]
    splits, x, weights, m_splits, bias, dy = _variant_operands(shape, dtype, pattern)
    results = {}
    for value in values:
        monkeypatch.setenv(env, value)
        results[value] = got = _all_kinds(x, weights, m_splits, bias, dy, dtype)
        case = f"{env}={value} {dtype=} {shape=} {pattern=}"
        _check(got["fprop"], oracle_fprop(x, weights, splits, None), dtype, f"fprop {case}")
        _check(got["fprop+bias"], oracle_fprop(x, weights, splits, bias), dtype, f"fprop+bias {case}")
        _check(got["dgrad"], oracle_dgrad(dy, weights, splits), dtype, f"dgrad {case}")
    _assert_bitwise_equal(results, f"{dtype=} {shape=} {pattern=}")


def test_large_groups_tile_order_matches_along_m_bitwise(monkeypatch):
    """Groups holding 32 MiB of rows each, where the core's rule walks fprop/dgrad along N: same bits as along M."""
    num_experts, total, k, n = 2, 32768, 1024, 1024  # 16384 rows x 1024 bf16 = 32 MiB per group, 2 MiB weights
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(total, k, generator=gen).bfloat16().cuda()
    dy = torch.randn(total, n, generator=gen).bfloat16().cuda()
    w = (torch.randn(num_experts, n, k, generator=gen) / k**0.5).bfloat16().cuda()
    splits = [total // 2 - 301, total // 2 + 301]
    m_splits = torch.tensor(splits, dtype=torch.int32, device="cuda")
    results = {}
    for value in ("auto", "m"):
        monkeypatch.setenv(RASTER_ENV, value)
        results[value] = {"fprop": cuda_backend.fprop(x, [w], m_splits, None, torch.bfloat16),
                          "dgrad": cuda_backend.dgrad(dy, [w], m_splits, torch.bfloat16)}
    _assert_bitwise_equal(results, "large groups")
    got = results["auto"]
    for e, (start, stop) in enumerate(((0, splits[0]), (splits[0], total))):
        fprop_ref = (x[start:stop].float() @ w[e].float().t()).double().cpu()
        dgrad_ref = (dy[start:stop].float() @ w[e].float()).double().cpu()
        _check(got["fprop"][start:stop], fprop_ref, torch.bfloat16, f"fprop expert {e}")
        _check(got["dgrad"][start:stop], dgrad_ref, torch.bfloat16, f"dgrad expert {e}")


def test_prebuilt_store_maps_replay_with_new_splits(monkeypatch):
    """Maps are rebuilt from the device splits at every replay: 100 replays equal CUTLASS's own maps, eager."""
    num_experts, total, k, n = 64, 3000, 136, 264
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(total, k, generator=gen).bfloat16().cuda()
    dy = torch.randn(total, n, generator=gen).bfloat16().cuda()
    weights = [(torch.randn(num_experts, n, k, generator=gen) / k**0.5).bfloat16().cuda()]
    m_splits = _random_splits(gen, num_experts, total).cuda()
    dw = torch.zeros(num_experts, n, k, device="cuda")

    def step(out):
        y = cuda_backend.fprop(x, weights, m_splits, None, torch.bfloat16)
        dx = cuda_backend.dgrad(dy, weights, m_splits, torch.bfloat16)
        cuda_backend.wgrad(dy, x, m_splits, [out], False)
        return y, dx

    monkeypatch.setenv(STORE_MAPS_ENV, "prebuilt")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(dw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static, dx_static = step(dw)
    monkeypatch.setenv(STORE_MAPS_ENV, "in_kernel")
    eager_dw = torch.empty_like(dw)
    for replay in range(100):
        m_splits.copy_(_random_splits(gen, num_experts, total))
        graph.replay()
        y, dx = step(eager_dw)
        case = f"replay {replay} splits={m_splits.tolist()}"
        assert torch.equal(y_static, y), f"fprop {case}"
        assert torch.equal(dx_static, dx), f"dgrad {case}"
        assert torch.equal(dw, eager_dw), f"wgrad {case}"


@pytest.mark.parametrize("env, value, message", [
    (TILE_ENV, "coop_1x1x1_c9x9", "MOE_GROUPED_GEMM_TILE=coop_1x1x1_c9x9 names no tile configuration"),
    (STORE_MAPS_ENV, "sometimes", "MOE_GROUPED_GEMM_STORE_MAPS=sometimes: expected prebuilt or in_kernel"),
    (RASTER_ENV, "diagonal", "MOE_GROUPED_GEMM_RASTER=diagonal: expected auto, m or n"),
    (FPROP_ENV, "fastest", "MOE_GROUPED_GEMM_FPROP=fastest: expected auto, pingpong or cutlass"),
])
def test_unknown_kernel_variant_is_refused(env, value, message, monkeypatch):
    monkeypatch.setenv(env, value)
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1, 64, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=message):
        cuda_backend.fprop(x, [w], torch.tensor([8], dtype=torch.int32, device="cuda"), None, torch.bfloat16)


@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
@pytest.mark.parametrize("shape", [(1, 77, 8, 200), (8, 1000, 8, 4104), (256, 3000, 8, 36)],
                         ids=["E1_N200", "E8_N4104", "E256_N36"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_dbias(dtype, shape, pattern):
    num_experts, total, _, n = shape
    splits = make_splits(pattern, num_experts, total)
    m_splits = torch.tensor(splits, device="cuda")
    dy = torch.randn(total, n).to(dtype).cuda()
    expected = oracle_dbias(dy, splits)
    for out_dtype in (torch.float32, dtype):
        case = f"dbias {dtype=} {shape=} {pattern=} {out_dtype=}"
        got = cuda_backend.dbias(dy, m_splits, num_experts, out_dtype)
        assert got.dtype == out_dtype and got.shape == (num_experts, n), case
        assert_close_to(got, expected, torch.float32 if out_dtype == torch.float32 else dtype, case)
        for e, (s, t) in enumerate(bounds(splits)):
            if s == t:
                assert torch.count_nonzero(got[e]) == 0, f"{case}: empty expert {e} is not zero"


def test_no_tokens():
    weights = [torch.randn(4, 64, 32, device="cuda").bfloat16()]
    x = torch.empty(0, 32, device="cuda", dtype=torch.bfloat16)
    m_splits = torch.zeros(4, dtype=torch.int32, device="cuda")
    assert cuda_backend.fprop(x, weights, m_splits, None, torch.bfloat16).shape == (0, 64)
    dy = torch.empty(0, 64, device="cuda", dtype=torch.bfloat16)
    assert cuda_backend.dgrad(dy, weights, m_splits, torch.bfloat16).shape == (0, 32)
    out = [torch.full((4, 64, 32), float("nan"), device="cuda")]
    cuda_backend.wgrad(dy, x, m_splits, out, False)
    assert torch.count_nonzero(out[0]) == 0
    assert torch.count_nonzero(cuda_backend.dbias(dy, m_splits, 4, torch.float32)) == 0


@pytest.mark.parametrize("n, k", [(100, 64), (64, 100), (4, 64)])
def test_misaligned_shapes_are_refused(n, k):
    assert not cuda_backend.shape_supported(n, k)
    x = torch.randn(16, k, device="cuda").bfloat16()
    weights = [torch.randn(2, n, k, device="cuda").bfloat16()]
    m_splits = torch.tensor([8, 8], device="cuda")
    with pytest.raises(ValueError, match=f"n={n} k={k}"):
        cuda_backend.fprop(x, weights, m_splits, None, torch.bfloat16)


def test_output_dtype_is_checked():
    x = torch.randn(16, 64, device="cuda").bfloat16()
    weights = [torch.randn(2, 64, 64, device="cuda").bfloat16()]
    m_splits = torch.tensor([8, 8], device="cuda")
    with pytest.raises(TypeError, match="float16"):
        cuda_backend.fprop(x, weights, m_splits, None, torch.float16)


@pytest.mark.parametrize("kernel", ["cutlass", "pingpong"])
def test_workspace_size_is_what_a_call_requests(kernel, monkeypatch):
    """The size Python reserves before capture equals the cooperative kernel's request; the ping-pong
    kernel (csrc/gemm/sm90_pingpong_fprop_bf16.cu) builds its schedule in shared memory and requests none."""
    monkeypatch.setenv(FPROP_ENV, kernel)
    lib = _core.require()
    device, slot = torch.cuda.current_device(), 6
    num_experts, total, k, n = 24, 500, 64, 128
    x = torch.randn(total, k, device="cuda").bfloat16()
    w = torch.randn(num_experts, n, k, device="cuda").bfloat16()
    y = torch.empty(total, n, device="cuda").bfloat16()
    m_splits = torch.tensor(make_splits("skewed", num_experts, total), device="cuda")
    _core.check(lib.mg_workspace_release(device, slot))
    problem = _core.GroupedProblem(num_experts, total, n, k, m_splits.data_ptr(), _core.dtype_code(torch.int64),
                                   _core.dtype_code(torch.bfloat16), device, slot)
    operand = _core.GroupOperand(w.data_ptr(), w.stride(0), None)
    stream = torch.cuda.current_stream().cuda_stream
    _core.check(lib.mg_grouped_fprop(ctypes.byref(problem), x.data_ptr(), operand, None, y.data_ptr(),
                                     _core.dtype_code(torch.bfloat16), stream))
    stats = _core.WorkspaceStats()
    _core.check(lib.mg_workspace_stats_get(device, slot, ctypes.byref(stats)))
    reserved = cuda_backend.workspace_size(_core.GEMM_FPROP, num_experts, total, n, k, torch.bfloat16, "cuda")
    assert stats.high_water == (reserved if kernel == "cutlass" else 0) and reserved > 0
    _core.check(lib.mg_workspace_release(device, slot))


def test_separate_weights_first_seen_during_capture_raise():
    weights = [torch.randn(64, 32, device="cuda").bfloat16() for _ in range(3)]
    x = torch.randn(30, 32, device="cuda").bfloat16()
    m_splits = torch.tensor([10, 10, 10], device="cuda")
    cuda_backend.fprop(x, [torch.stack(weights)], m_splits, None, torch.bfloat16)  # warm the workspace
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="eager step"):
        with torch.cuda.graph(graph):
            cuda_backend.fprop(x, weights, m_splits, None, torch.bfloat16)


def _random_splits(gen, num_experts, total):
    """Random counts summing to ``total``, often with empty experts."""
    active = int(torch.randint(1, num_experts + 1, (1,), generator=gen))
    experts = torch.randperm(num_experts, generator=gen)[:active]
    choice = experts[torch.randint(active, (total,), generator=gen)]
    return torch.bincount(choice, minlength=num_experts).to(torch.int32)


def test_graph_replay_is_bitwise_eager():
    """fprop in one graph, dgrad + wgrad (slots 0 and 1) in another, 200 replays."""
    num_experts, total, k, n = 8, 2048, 256, 512
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(total, k, generator=gen).bfloat16().cuda()
    dy = torch.randn(total, n, generator=gen).bfloat16().cuda()
    weights = [(torch.randn(num_experts, n, k, generator=gen) / k**0.5).bfloat16().cuda()]
    main_grad = torch.zeros(num_experts, n, k, device="cuda")
    m_splits = _random_splits(gen, num_experts, total).cuda()

    def forward():
        return cuda_backend.fprop(x, weights, m_splits, None, torch.bfloat16)

    def backward(out):
        dx = cuda_backend.dgrad(dy, weights, m_splits, torch.bfloat16)
        cuda_backend.wgrad(dy, x, m_splits, [out], False)
        return dx

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: workspaces grow here, not in capture
        forward()
        backward(main_grad)
    torch.cuda.current_stream().wait_stream(side)
    fwd_graph, bwd_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(fwd_graph):
        y_static = forward()
    with torch.cuda.graph(bwd_graph, pool=fwd_graph.pool()):
        dx_static = backward(main_grad)

    eager_dw = torch.empty_like(main_grad)
    for step in range(200):
        m_splits.copy_(_random_splits(gen, num_experts, total))
        fwd_graph.replay()
        bwd_graph.replay()
        y, dx = forward(), backward(eager_dw)
        case = f"replay {step} splits={m_splits.tolist()}"
        assert torch.equal(y_static, y), f"fprop {case}"
        assert torch.equal(dx_static, dx), f"dgrad {case}"
        assert torch.equal(main_grad, eager_dw), f"wgrad {case}"
