"""The fused experts path in FP8 block scaling (moe_grouped.fp8.experts): the gathered quantizer against
gather-then-quantize, the layer against the unfused FP8 path and bf16, weight reuse, deferred and fused
wgrad, and (GPU) the kernels against the reference backend and 1000 replays with new routing."""

import copy

import pytest
import torch
from torch import nn

from moe_grouped import GroupedMLP, MoELayer, _core, fp8
from moe_grouped.activation import swiglu
from moe_grouped._tensors import gather_rows
from moe_grouped.fp8.quantize import quantize_gathered, swiglu_quantize_rowwise

from cases import CAPACITY_OPTIONS, calc_diff, make_splits, peak_step_bytes_per_path, skip_without_cuda_kernels

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = {"E4M3": fp8.Float8BlockScaling(), "HYBRID": fp8.Float8BlockScaling("HYBRID", pow2_scales=False)}
# FP8 against bf16: two chained E4M3 GEMMs give ~2e-3 (tests/test_integrations_transformers.py).
FP8_DIFF = 5e-3


def as_bytes(q):
    return None if q is None else (q.data.view(torch.uint8), q.scale_inv)


def assert_same_quantized(a, b, case):
    for name in ("rowwise", "columnwise"):
        qa, qb = getattr(a, name), getattr(b, name)
        assert (qa is None) == (qb is None), f"{name}: {case}"
        if qa is not None:
            assert torch.equal(qa.data.view(torch.uint8), qb.data.view(torch.uint8)), f"{name} data: {case}"
            assert torch.equal(qa.scale_inv, qb.scale_inv), f"{name} scales: {case}"


def columnwise_owned(q, splits, rows):
    """The parts of a grouped column-wise copy the layout defines (data of each group's tokens, their scales)."""
    parts = []
    for count, (padded, block) in zip(splits, fp8.columnwise_group_starts(splits)):
        parts += [q.data.view(torch.uint8)[:, padded : padded + count], q.scale_inv[block : block + -(-count // 128)]]
    return parts


def random_index(rows, source_rows, seed):
    g = torch.Generator().manual_seed(seed)
    index = torch.randint(0, source_rows, (rows,), generator=g, dtype=torch.int32)
    holes = torch.rand(rows, generator=g) < 0.2
    index[holes] = torch.tensor([-1, source_rows, 2 ** 30], dtype=torch.int32)[torch.arange(int(holes.sum())) % 3]
    return index


# ---- the gathered quantizer (reference backend) --------------------------------------------------


@pytest.mark.parametrize("with_splits", [False, True])
def test_reference_gathered_quantizer_is_gather_then_quantize(with_splits):
    torch.manual_seed(1)
    x = torch.randn(37, 256, dtype=torch.bfloat16)
    index = random_index(60, 37, seed=2)
    rows = gather_rows(x, index)
    if with_splits:
        splits = torch.tensor(make_splits("skewed", 5, 60, seed=3))
        got = quantize_gathered(x, index, E5M2, False, 1e-4, m_splits=splits, backend="reference")
        expected = fp8.quantize_grouped(rows, splits, E5M2, False, 1e-4, backend="reference")
    else:
        got = quantize_gathered(x, index, E5M2, False, 1e-4, backend="reference")
        expected = fp8.GroupedQuantized(fp8.quantize_1x128(rows, E5M2, False, 1e-4), None, None)
    assert_same_quantized(got, expected, f"{with_splits=}")


def test_gathered_quantizer_checks_its_arguments():
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="index must be 1-D int32"):
        quantize_gathered(x, torch.tensor([0, 1]), E4M3)
    with pytest.raises(ValueError, match="only the row-wise copy"):
        quantize_gathered(x, torch.tensor([0, 1], dtype=torch.int32), E4M3, rowwise=False)
    with pytest.raises(TypeError):
        quantize_gathered(x.long(), torch.tensor([0], dtype=torch.int32), E4M3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_reference_swiglu_quantizer_is_swiglu_then_quantize(dtype):
    torch.manual_seed(3)
    g = (torch.randn(33, 2 * 272) * 4).to(dtype)
    got = swiglu_quantize_rowwise(g, E4M3, backend="reference")
    expected = fp8.quantize_1x128(swiglu(g, backend="reference"), E4M3, True)
    assert torch.equal(got.data.view(torch.uint8), expected.data.view(torch.uint8))
    assert torch.equal(got.scale_inv, expected.scale_inv)
    with pytest.raises(ValueError, match="even number of columns"):
        swiglu_quantize_rowwise(g[:, 1:].contiguous(), E4M3)


# ---- the layer (reference backend: the FP8 arithmetic emulated) -----------------------------------

H, I, E, TOP_K = 256, 128, 4, 2


def run_layer(layer, x, dout, recipe):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    with fp8.fp8_autocast(recipe, enabled=recipe is not None):
        out = layer(x)
    out.backward(dout)
    return [out.detach(), x.grad, *[p.grad for p in layer.parameters()]]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("capacity", [None, 0.5])
def test_fp8_fused_forward_is_the_unfused_fp8_forward_and_close_to_bf16(recipe, capacity):
    """The forward quantizes the same rows at the same points as the unfused FP8 path, so it is bitwise the
    same; backward quantizes dout unweighted (the weights go into wh), so gradients differ by FP8 rounding."""
    torch.manual_seed(4)
    unfused = MoELayer(H, I, E, TOP_K, capacity_factor=capacity, dtype=torch.bfloat16, backend="reference",
                       experts_path="unfused")
    fused = copy.deepcopy(unfused)
    fused.experts.experts_path = "fused"
    x, dout = torch.randn(2, 24, H, dtype=torch.bfloat16), torch.randn(2, 24, H, dtype=torch.bfloat16)
    got = run_layer(fused, x, dout, RECIPES[recipe])
    unfused_fp8 = run_layer(unfused, x, dout, RECIPES[recipe])
    bf16 = run_layer(unfused, x, dout, None)
    assert torch.equal(got[0], unfused_fp8[0])
    assert not torch.equal(got[0], bf16[0]), "fp8_autocast changed nothing"
    names = ["out", "dx", *[n for n, _ in unfused.named_parameters()]]
    for name, a, u, b in zip(names, got, unfused_fp8, bf16):
        case = f"{name}: {recipe=} {capacity=}"
        assert torch.isfinite(a).all(), case
        assert calc_diff(a, b) < FP8_DIFF, (case, calc_diff(a, b))
        assert calc_diff(a, u) < FP8_DIFF, (case, calc_diff(a, u))


@pytest.mark.parametrize("tokens, top_k, capacity", [(0, 2, None), (1, 2, None), (5, 1, None), (7, 2, 0.0)],
                         ids=["no-tokens", "one-token", "top-1", "every-copy-dropped"])
def test_fp8_fused_edge_cases_match_the_unfused_fp8_forward(tokens, top_k, capacity):
    torch.manual_seed(tokens)
    unfused = MoELayer(H, I, E, top_k, capacity_factor=capacity, dtype=torch.bfloat16, backend="reference",
                       experts_path="unfused")
    fused = copy.deepcopy(unfused)
    fused.experts.experts_path = "fused"
    x, dout = torch.randn(tokens, H, dtype=torch.bfloat16), torch.randn(tokens, H, dtype=torch.bfloat16)
    got, want = run_layer(fused, x, dout, RECIPES["E4M3"]), run_layer(unfused, x, dout, RECIPES["E4M3"])
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1:], want[1:]):
        assert (a is None) == (b is None)
        if a is None or a.numel() == 0:
            continue
        assert torch.isfinite(a).all()
        if b.abs().max() < 1e-6:  # zero but for rounding (top-1: the router's weight is 1 whatever its logit)
            assert a.abs().max() < 1e-6
        else:
            assert calc_diff(a, b) < FP8_DIFF


def test_fp8_fused_grouped_mlp_on_permuted_rows():
    torch.manual_seed(5)
    splits = make_splits("zero_token_experts", E, 40, seed=5)
    fused = GroupedMLP(E, H, I, dtype=torch.bfloat16, backend="reference", experts_path="fused")
    unfused = copy.deepcopy(fused)
    unfused.experts_path = "unfused"
    x, dout = torch.randn(40, H, dtype=torch.bfloat16), torch.randn(40, H, dtype=torch.bfloat16)
    results = []
    for mlp in (fused, unfused):
        xx = x.clone().requires_grad_(True)
        with fp8.fp8_autocast():
            out = mlp(xx, splits)
        out.backward(dout)
        results.append([out.detach(), xx.grad, *[p.grad for p in mlp.parameters()]])
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(*results):
        assert calc_diff(a, b) < FP8_DIFF


def test_fp8_fused_with_another_activation_backend_composes_the_same_bits(monkeypatch):
    """Where the SwiGLU passes run on another backend than the GEMMs (a core without the weighted SwiGLU
    backward), fc1's h is SwiGLU then the quantizer: the same bits as the one-pass quantizer."""
    import moe_grouped.fp8.experts as fp8_experts
    import moe_grouped.mlp as mlp

    torch.manual_seed(8)
    x, dout = torch.randn(30, H, dtype=torch.bfloat16), torch.randn(30, H, dtype=torch.bfloat16)
    layer = MoELayer(H, I, E, TOP_K, dtype=torch.bfloat16, backend="reference", experts_path="fused")
    expected = run_layer(layer, x, dout, RECIPES["E4M3"])
    composed = copy.deepcopy(layer)
    composed.experts.__dict__.pop("_plans", None)  # plans are cached per module: make them anew
    monkeypatch.setattr(mlp, "resolve_weighted_backward_backend", lambda backend, device: "torch")
    calls = []
    quantize = fp8_experts.quantize_rowwise
    monkeypatch.setattr(fp8_experts, "quantize_rowwise", lambda *a, **k: calls.append(1) or quantize(*a, **k))
    got = run_layer(composed, x, dout, RECIPES["E4M3"])
    assert calls == [1], "fc1's h did not take the composed path"
    assert torch.equal(got[0], expected[0])
    for a, e in zip(got[1:], expected[1:]):
        assert calc_diff(a, e) < 1e-5  # the torch and reference SwiGLU backwards round alike up to fp32 order


def test_fp8_fused_deferred_and_fused_wgrad_give_the_same_bits():
    torch.manual_seed(6)
    plain = MoELayer(H, I, E, TOP_K, dtype=torch.bfloat16, backend="reference", experts_path="fused")
    deferred = copy.deepcopy(plain)
    for linear in (deferred.experts.fc1, deferred.experts.fc2):
        linear.fuse_wgrad_accumulation = linear.delay_wgrad_compute = True
        for w in linear.weights():
            w.main_grad = torch.zeros_like(w, dtype=torch.float32)
    x, dout = torch.randn(30, H, dtype=torch.bfloat16), torch.randn(30, H, dtype=torch.bfloat16)
    expected = run_layer(plain, x, dout, RECIPES["HYBRID"])
    got = run_layer(deferred, x, dout, RECIPES["HYBRID"])
    weights = [w for linear in (deferred.experts.fc1, deferred.experts.fc2) for w in linear.weights()]
    assert all(w.main_grad.abs().sum() == 0 for w in weights), "the weight gradients were not deferred"
    deferred.experts.backward_dw()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    expert_grads = expected[-len(weights):]
    for w, e in zip(weights, expert_grads):
        # main_grad holds the float32 result, the plain gradient that rounded to bf16.
        assert torch.equal(w.main_grad.to(e.dtype), e), "fused accumulation differs from the plain weight gradient"


def test_fp8_fused_makes_the_routing_index_once_per_step(monkeypatch):
    """The forward's index (each permuted row's token) serves the backward's two gathered quantizations; the
    results are those of an index made at each use."""
    from moe_grouped.fp8 import experts as fp8_experts

    torch.manual_seed(8)
    layer = MoELayer(H, I, E, TOP_K, capacity_factor=0.5, dtype=torch.bfloat16, backend="reference",
                     experts_path="fused")
    x, dout = torch.randn(30, H, dtype=torch.bfloat16), torch.randn(30, H, dtype=torch.bfloat16)
    made = []

    def counted(*args, **kwargs):
        made.append(args)
        return source_rows(*args, **kwargs)

    source_rows = fp8_experts.source_rows
    monkeypatch.setattr(fp8_experts, "source_rows", counted)
    kept = run_layer(layer, x, dout, RECIPES["E4M3"])
    assert len(made) == 1, f"the routing index was made {len(made)} times in one step"
    # An index that is never kept: made at each use, as before.
    monkeypatch.setattr(fp8_experts.Fp8Stages, "_kept_index", property(lambda self: None, lambda self, value: None),
                        raising=False)
    made.clear()
    remade = run_layer(layer, x, dout, RECIPES["E4M3"])
    assert len(made) == 3
    for a, b in zip(kept, remade):
        assert torch.equal(a, b)


def test_fp8_fused_weight_reuse_across_micro_batches():
    torch.manual_seed(7)
    layer = MoELayer(H, I, E, TOP_K, dtype=torch.bfloat16, backend="reference", experts_path="fused")
    x = torch.randn(20, H, dtype=torch.bfloat16)
    with fp8.fp8_autocast():
        fresh = layer(x)
        first = layer(x, is_first_microbatch=True)
        again = layer(x, is_first_microbatch=False)
    assert torch.equal(fresh, first) and torch.equal(fresh, again)
    with torch.no_grad():
        layer.experts.fc1.weight.mul_(2)  # an optimizer step
    with fp8.fp8_autocast(), pytest.raises(RuntimeError, match="pass is_first_microbatch=True"):
        layer(x, is_first_microbatch=False)


def test_fp8_experts_path_choice():
    x = torch.randn(6, H, dtype=torch.bfloat16)
    with fp8.fp8_autocast():
        # The default fuses only on the cuda backend; "fused" runs FP8 on the reference backend.
        assert not GroupedMLP(2, H, I, dtype=torch.bfloat16, backend="reference").uses_fused_path(x)
        assert GroupedMLP(2, H, I, dtype=torch.bfloat16, backend="reference", experts_path="fused").uses_fused_path(x)
        with pytest.raises(ValueError, match="cannot run in FP8 here: FP8 GroupedLinear takes bfloat16"):
            GroupedMLP(2, H, I, backend="reference", experts_path="fused").uses_fused_path(x.float())
        with pytest.raises(ValueError, match="cannot run in FP8 here: FP8 block scaling runs on the 'cuda'"):
            GroupedMLP(2, H, I, dtype=torch.bfloat16, backend="torch", experts_path="fused").uses_fused_path(x)


# ---- GPU ------------------------------------------------------------------------------------------


def require_fp8_fused_cuda():
    skip_without_cuda_kernels(_core.CAP_FP8_QUANTIZE, "FP8 quantize kernels", entry="mg_quantize_gathered_1x128")
    skip_without_cuda_kernels(_core.CAP_GROUPED_GEMM_FP8_BLOCKWISE, "FP8 grouped GEMMs")
    skip_without_cuda_kernels(_core.CAP_SWIGLU, "SwiGLU kernels", entry="mg_swiglu_weighted_backward")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("cols", [256, 2048, 200, 72])
@pytest.mark.parametrize("mode", ["rowwise", "both", "columnwise"])
@pytest.mark.parametrize("pattern", ["skewed", "zero_token_experts", "all_to_one"])
def test_gpu_gathered_quantizer_is_bitwise_the_reference(dtype, cols, mode, pattern):
    require_fp8_fused_cuda()
    torch.manual_seed(cols)
    source_rows, rows, groups = 300, 777, 6
    x = (torch.randn(source_rows, cols) * torch.rand(source_rows, 1) * 10).to(dtype)
    index = random_index(rows, source_rows, seed=cols)
    splits = make_splits(pattern, groups, rows - 23, seed=1)  # 23 rows past the groups
    for fp8_dtype, pow2 in ((E4M3, True), (E5M2, False)):
        case = f"{dtype=} {cols=} {mode=} {pattern=} {fp8_dtype=}"
        options = dict(m_splits=None if mode == "rowwise" else torch.tensor(splits), rowwise=mode != "columnwise")
        expected = quantize_gathered(x, index, fp8_dtype, pow2, 0.0, backend="reference", **options)
        if options["m_splits"] is not None:
            options["m_splits"] = options["m_splits"].cuda()
        got = quantize_gathered(x.cuda(), index.cuda(), fp8_dtype, pow2, 0.0, backend="cuda", **options)
        if expected.rowwise is not None:
            assert torch.equal(got.rowwise.data.view(torch.uint8).cpu(), expected.rowwise.data.view(torch.uint8)), case
            assert torch.equal(got.rowwise.scale_inv.cpu(), expected.rowwise.scale_inv), case
        if expected.columnwise is not None:
            got_parts = columnwise_owned(got.columnwise, splits, rows)
            for a, e in zip(got_parts, columnwise_owned(expected.columnwise, splits, rows)):
                assert torch.equal(a.cpu(), e), case


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("rows, ffn", [(1, 16), (300, 768), (77, 1408), (5, 80)])
def test_gpu_swiglu_quantizer_is_the_two_cuda_passes_bitwise(dtype, rows, ffn):
    require_fp8_fused_cuda()
    torch.manual_seed(rows)
    g = (torch.randn(rows, 2 * ffn, device="cuda") * 4).to(dtype)
    for fp8_dtype, pow2 in ((E4M3, True), (E5M2, False)):
        got = swiglu_quantize_rowwise(g, fp8_dtype, pow2)
        expected = fp8.quantize_rowwise(swiglu(g, backend="cuda"), fp8_dtype, pow2)
        assert torch.equal(got.data.view(torch.uint8), expected.data.view(torch.uint8)), (dtype, rows, ffn)
        assert torch.equal(got.scale_inv, expected.scale_inv), (dtype, rows, ffn)
    with pytest.raises(ValueError, match="multiple of 16"):
        swiglu_quantize_rowwise(g[:, : 2 * 8].contiguous(), E4M3)


@pytest.mark.gpu
def test_gpu_gathered_quantizer_handles_no_rows_and_no_source():
    require_fp8_fused_cuda()
    x = torch.randn(0, 256, dtype=torch.bfloat16, device="cuda")
    index = torch.full((40,), -1, dtype=torch.int32, device="cuda")
    splits = torch.tensor([30, 10], device="cuda")
    q = quantize_gathered(x, index, E4M3, m_splits=splits)
    assert torch.all(q.rowwise.data.view(torch.uint8) == 0) and torch.all(q.rowwise.scale_inv == 1)
    empty = quantize_gathered(torch.randn(5, 256, device="cuda", dtype=torch.bfloat16), index[:0], E4M3)
    assert empty.rowwise.data.shape == (0, 256)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("capacity", sorted(CAPACITY_OPTIONS))
def test_gpu_fp8_fused_layer_matches_the_reference_backend_and_bf16(recipe, capacity):
    require_fp8_fused_cuda()
    torch.manual_seed(8)
    cuda = MoELayer(256, 384, 8, 4, shared_expert_ffn_hidden=128, dtype=torch.bfloat16, device="cuda",
                    backend="cuda", **CAPACITY_OPTIONS[capacity])
    x = torch.randn(300, 256, dtype=torch.bfloat16, device="cuda")
    with fp8.fp8_autocast():
        assert cuda.experts.uses_fused_path(x), "the cuda default must fuse in FP8"
    reference = copy.deepcopy(cuda)
    reference.experts.fc1.backend = reference.experts.fc2.backend = "reference"
    reference.experts.experts_path = "fused"
    dout = torch.randn_like(x)
    got = run_layer(cuda, x, dout, RECIPES[recipe])
    emulated = run_layer(reference, x, dout, RECIPES[recipe])
    bf16 = run_layer(cuda, x, dout, None)
    names = ["out", "dx", *[n for n, _ in cuda.named_parameters()]]
    for name, a, r, b in zip(names, got, emulated, bf16):
        case = f"{name}: {recipe=} {capacity=}"
        # The kernels and the reference differ in float32 summation order; a last-bit difference
        # in a bf16 tensor that is quantized again (dh_u -> dg) can move a value one FP8 step.
        assert calc_diff(a, r) < 1e-4, (case, calc_diff(a, r))
        assert calc_diff(a, b) < FP8_DIFF, (case, calc_diff(a, b))
    rerun = run_layer(cuda, x, dout, RECIPES[recipe])
    assert all(torch.equal(a, b) for a, b in zip(got, rerun)), "not deterministic"


@pytest.mark.gpu
def test_gpu_fp8_fused_capture_replays_new_routing_bitwise_1000_times():
    require_fp8_fused_cuda()
    from graphs import testing
    from test_experts_path import SplitRoutedMoE

    class Fp8Routed(nn.Module):
        def __init__(self, **sizes):
            super().__init__()
            self.inner = SplitRoutedMoE(**sizes)

        def forward(self, x, splits):
            with fp8.fp8_autocast():
                return self.inner(x, splits)

    torch.manual_seed(9)
    sizes = dict(tokens=512, hidden=256, ffn=128, num_experts=32, top_k=8)  # fine-grained, Qwen3-like
    module = Fp8Routed(**sizes)
    splits = torch.tensor(make_splits("balanced", 32, 512 * 8), device="cuda")
    x = torch.randn(512, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    report = testing.check_replay(module, (x, splits), num_replays=1000, captures=1, exact=True, timeout_s=120)
    assert len(report.patterns) > 1, report


@pytest.mark.gpu
def test_gpu_fp8_fused_keeps_fewer_bytes_than_fp8_unfused_and_bf16():
    """In FP8 too the fused op keeps x and g only (the unfused path keeps the FP8 copies of xp and h and
    the bf16 y); the layer's FP8 weights are kept across steps (is_first_microbatch) on both paths."""
    require_fp8_fused_cuda()
    torch.manual_seed(10)
    base = MoELayer(512, 256, 32, 8, dtype=torch.bfloat16, device="cuda", backend="cuda")
    x = torch.randn(4096, 512, dtype=torch.bfloat16, device="cuda", requires_grad=True)

    def forward(layer, x):
        with fp8.fp8_autocast():
            return layer(x, is_first_microbatch=True)

    dout = torch.randn_like(x)
    peaks = peak_step_bytes_per_path(base, x, dout, forward)
    assert peaks["fused"] <= 0.8 * peaks["unfused"], peaks
    # And no more than the bf16 fused step: the backward frees dg once its FP8 copy exists.
    bf16 = peak_step_bytes_per_path(base, x, dout)
    assert peaks["fused"] <= bf16["fused"], (peaks, bf16)
