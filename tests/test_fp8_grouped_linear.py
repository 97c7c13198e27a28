"""GroupedLinear in FP8 block scaling: numerics against bf16, the cuda backend
against the reference, and CUDA-graph replay against eager (GPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import moe_grouped
from moe_grouped import GroupedLinear, fp8
from moe_grouped.graphs import splits as graph_splits
from moe_grouped.graphs import testing

from cases import SPLIT_PATTERNS, calc_diff, make_splits, needs_cuda_kernels

E, K, N, M = 4, 256, 384, 640
RECIPES = {
    "e4m3": fp8.Float8BlockScaling("E4M3"),
    "hybrid": fp8.Float8BlockScaling("HYBRID"),
    "hybrid_no_pow2_eps": fp8.Float8BlockScaling("HYBRID", pow2_scales=False, amax_epsilon=1e-6),
}


def layers(backend: str, device: str, *, single: bool, bias: bool = True, **options):
    """A bf16 layer and an identical one for FP8 (same parameters)."""
    torch.manual_seed(0)
    base = GroupedLinear(E, K, N, bias=bias, single_grouped_weight=single, dtype=torch.bfloat16, device=device,
                         backend=backend, **options)
    twin = GroupedLinear(E, K, N, bias=bias, single_grouped_weight=single, dtype=torch.bfloat16, device=device,
                         backend=backend, **options)
    twin.load_state_dict(base.state_dict())
    return base, twin


def run(layer, x, m_splits, dy, recipe=None, **forward_options):
    x = x.detach().clone().requires_grad_(True)
    with fp8.fp8_autocast(recipe, enabled=recipe is not None):
        y = layer(x, m_splits, **forward_options)
    y.backward(dy)
    if layer.delay_wgrad_compute:
        layer.backward_dw()
    grads = [p.main_grad.clone() if hasattr(p, "main_grad") else p.grad for p in layer.parameters()]
    return y.detach(), x.grad, grads


def microbatches(layer, recipe, device, first_flags):
    """Runs three micro-batches (new x, dy and splits each) with the given
    is_first_microbatch flags; returns each one's (y, dx, parameter grads)."""
    results = []
    for i, flag in enumerate(first_flags):
        gen = torch.Generator().manual_seed(100 + i)
        x = torch.randn(M, K, generator=gen).bfloat16().to(device)
        dy = torch.randn(M, N, generator=gen).bfloat16().to(device)
        splits = make_splits(["balanced", "skewed", "zero_token_experts"][i], E, M, seed=i)
        splits = torch.tensor(splits, device=device) if device == "cuda" else splits
        layer.zero_grad(set_to_none=True)
        y, dx, grads = run(layer, x, splits, dy, recipe, is_first_microbatch=flag)
        results.append((y, dx, [g.clone() for g in grads]))
    return results


def assert_same_results(got, want):
    for step, ((y, dx, grads), (y_want, dx_want, grads_want)) in enumerate(zip(got, want)):
        assert torch.equal(y, y_want) and torch.equal(dx, dx_want), f"micro-batch {step}"
        for i, (a, b) in enumerate(zip(grads, grads_want)):
            assert torch.equal(a, b), f"micro-batch {step}, parameter {i}"


cuda_fp8 = needs_cuda_kernels(moe_grouped._core.CAP_GROUPED_GEMM_FP8_BLOCKWISE, "FP8 grouped GEMMs")


@pytest.mark.parametrize(
    "backend, device",
    [("reference", "cpu"), pytest.param("cuda", "cuda", marks=[pytest.mark.gpu, cuda_fp8])],
    ids=["reference", "cuda"],
)
@pytest.mark.parametrize("single", [True, False], ids=["grouped_weight", "separate_weights"])
def test_fp8_kept_weights_give_the_same_steps(backend, device, single):
    # is_first_microbatch=True then False reuses the FP8 weights of the first
    # micro-batch: bit for bit what quantizing them on every call gives.
    base, twin = layers(backend, device, single=single)
    recipe = RECIPES["hybrid"]
    assert_same_results(microbatches(twin, recipe, device, [True, False, False]),
                        microbatches(base, recipe, device, [None, None, None]))


def test_fp8_kept_weights_are_refused_when_stale():
    layer, _ = layers("reference", "cpu", single=True)
    x, splits = torch.randn(M, K).bfloat16(), make_splits("balanced", E, M)
    recipe = RECIPES["e4m3"]
    with fp8.fp8_autocast(recipe):
        with pytest.raises(RuntimeError, match="no FP8 weights were kept"):
            layer(x, splits, is_first_microbatch=False)
        layer(x, splits, is_first_microbatch=True)
        layer(x, splits, is_first_microbatch=False)
        with torch.no_grad():
            layer.weight.add_(1e-2)  # what an optimizer step does
        with pytest.raises(RuntimeError, match="changed since"):
            layer(x, splits, is_first_microbatch=False)
        layer(x, splits, is_first_microbatch=True)
        layer(x, splits, is_first_microbatch=False)
    with fp8.fp8_autocast(fp8.Float8BlockScaling("E4M3", pow2_scales=False)):
        with pytest.raises(RuntimeError, match="changed since"):
            layer(x, splits, is_first_microbatch=False)
    with pytest.raises(TypeError, match="is_first_microbatch"):
        layer(x, splits, is_first_microbatch=1)
    # Outside fp8_autocast there is nothing to keep: the flag is accepted and ignored.
    assert torch.equal(layer(x, splits, is_first_microbatch=False), layer(x, splits))


def test_grouped_mlp_passes_is_first_microbatch_to_both_layers():
    torch.manual_seed(0)
    mlp = moe_grouped.GroupedMLP(E, K, 128, dtype=torch.bfloat16, backend="reference")
    x, splits = torch.randn(M, K).bfloat16(), make_splits("skewed", E, M)
    with fp8.fp8_autocast(RECIPES["e4m3"]):
        want = mlp(x, splits)
        mlp(x, splits, is_first_microbatch=True)
        with torch.no_grad():
            mlp.fc2.weight0.mul_(2.0)
        with pytest.raises(RuntimeError, match="changed since"):
            mlp(x, splits, is_first_microbatch=False)
        with torch.no_grad():
            mlp.fc2.weight0.mul_(0.5)  # exact: back to the kept values, but the version moved on
        mlp(x, splits, is_first_microbatch=True)
        assert torch.equal(mlp(x, splits, is_first_microbatch=False), want)


# FP8 (3-4 significant bits) against bf16, measured as DeepGEMM's 1 - cos-like
# similarity: random operands give ~1e-4 (E4M3) to ~5e-4 (E5M2 gradients).
FP8_DIFF = {"e4m3": 1e-3, "hybrid": 2e-3, "hybrid_no_pow2_eps": 2e-3}


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("pattern", ["balanced", "zero_token_experts", "all_to_one"])
@pytest.mark.parametrize("single", [True, False], ids=["grouped_weight", "separate_weights"])
def test_reference_fp8_is_close_to_bf16(recipe_name, pattern, single):
    base, twin = layers("reference", "cpu", single=single)
    splits = make_splits(pattern, E, M, seed=3)
    x, dy = torch.randn(M, K).bfloat16(), torch.randn(M, N).bfloat16()
    y16, dx16, g16 = run(base, x, splits, dy)
    y8, dx8, g8 = run(twin, x, splits, dy, RECIPES[recipe_name])
    limit = FP8_DIFF[recipe_name]
    assert calc_diff(y8, y16) < limit
    assert calc_diff(dx8, dx16) < limit
    for a, b in zip(g8, g16):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert calc_diff(a, b) < limit, (calc_diff(a, b), a.shape)
    assert y8.dtype == torch.bfloat16 and not torch.equal(y8, y16)  # it did run in FP8


def test_reference_fp8_fused_main_grad_and_delayed_wgrad():
    base, twin = layers("reference", "cpu", single=True, fuse_wgrad_accumulation=True, delay_wgrad_compute=True)
    for layer in (base, twin):
        for weight in layer.weights():
            weight.main_grad = torch.ones(weight.shape, dtype=torch.float32)
    splits = [300, 0, 200, 140]
    x, dy = torch.randn(M, K).bfloat16(), torch.randn(M, N).bfloat16()
    _, _, g16 = run(base, x, splits, dy)
    _, _, g8 = run(twin, x, splits, dy, RECIPES["hybrid"])
    main16, main8 = g16[0], g8[0]
    assert torch.equal(main8[1], torch.ones(N, K)), "an expert without tokens keeps its main_grad"
    assert calc_diff(main8 - 1, main16 - 1) < 2e-3
    assert twin.weight.grad_added_to_main_grad is True


def test_fp8_refuses_what_it_cannot_run():
    layer = GroupedLinear(2, 128, 128, backend="reference")
    x = torch.randn(4, 128)
    with fp8.fp8_autocast(fp8.Float8BlockScaling()):
        with pytest.raises(TypeError, match="bfloat16"):
            layer(x, [2, 2])  # float32 layer: never silently bf16 or fp32
        with fp8.fp8_autocast(enabled=False):
            assert layer(x, [2, 2]).shape == (4, 128)
    torch_layer = GroupedLinear(2, 128, 128, backend="torch", dtype=torch.bfloat16)
    with fp8.fp8_autocast(fp8.Float8BlockScaling()):
        with pytest.raises(NotImplementedError, match="'cuda' backend"):
            torch_layer(x.bfloat16(), [2, 2])


# ---- cuda backend (H100) --------------------------------------------------

@pytest.mark.gpu
@cuda_fp8
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
@pytest.mark.parametrize("single", [True, False], ids=["grouped_weight", "separate_weights"])
def test_cuda_fp8_matches_reference_fp8(recipe_name, pattern, single):
    torch.manual_seed(0)
    cuda_layer = GroupedLinear(E, K, N, single_grouped_weight=single, dtype=torch.bfloat16, device="cuda", backend="cuda")
    ref_layer = GroupedLinear(E, K, N, single_grouped_weight=single, dtype=torch.bfloat16, device="cuda",
                              backend="reference")
    ref_layer.load_state_dict(cuda_layer.state_dict())
    splits = make_splits(pattern, E, M, seed=5)
    x, dy = torch.randn(M, K, device="cuda").bfloat16(), torch.randn(M, N, device="cuda").bfloat16()
    recipe = RECIPES[recipe_name]
    got = run(cuda_layer, x, torch.tensor(splits, device="cuda"), dy, recipe)
    want = run(ref_layer, x, splits, dy, recipe)
    # Same quantized operands bit for bit; the GEMMs differ in float32 summation order only.
    for name, a, b in [("y", got[0], want[0]), ("dx", got[1], want[1])] + [
        (f"param{i}", a, b) for i, (a, b) in enumerate(zip(got[2], want[2]))
    ]:
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert calc_diff(a, b) < 1e-5, (name, calc_diff(a, b))


class _Fp8Region(nn.Module):
    """Runs the layer inside fp8_autocast, so that a graph captures FP8 kernels."""

    def __init__(self, layer: GroupedLinear, recipe):
        super().__init__()
        self.layer, self.recipe = layer, recipe

    def forward(self, x, m_splits):
        with fp8.fp8_autocast(self.recipe):
            return self.layer(x, m_splits)


@pytest.mark.gpu
@cuda_fp8
@pytest.mark.parametrize("fuse", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("single", [True, False], ids=["grouped_weight", "separate_weights"])
def test_cuda_fp8_graph_500_replays_match_eager_bitwise(fuse, single):
    torch.manual_seed(0)
    layer = GroupedLinear(8, 256, 512, single_grouped_weight=single, fuse_wgrad_accumulation=fuse,
                          dtype=torch.bfloat16, device="cuda", backend="cuda")
    if fuse:
        for weight in layer.weights():
            weight.main_grad = torch.randn(weight.shape, dtype=torch.float32, device="cuda")
    module = _Fp8Region(layer, RECIPES["hybrid"])
    x = torch.randn(2048, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    sample = (x, graph_splits.make_splits("balanced", 8, 2048, device="cuda"))
    report = testing.check_replay(module, sample, num_replays=500, captures=1, timeout_s=60)
    print(f"\n[fp8 graphs] fuse={fuse} single={single}: {report.replays} replays, {report.tensors_compared} tensors "
          f"compared, {report.mismatches} mismatches, patterns {report.patterns}")
    assert report.replays == 500 and report.mismatches == 0
    assert set(report.patterns) == set(graph_splits.PATTERNS)


@pytest.mark.gpu
@cuda_fp8
def test_cuda_fp8_graphs_of_first_and_later_microbatches_follow_weight_updates():
    # Graph A captures a first micro-batch (quantizes the weights into the kept
    # buffers), graph B a later one (reads them). After each in-place weight
    # update, replaying A then B must match eager FP8 with fresh quantization.
    base, layer = layers("cuda", "cuda", single=True)
    recipe = RECIPES["e4m3"]
    x = torch.randn(M, K, device="cuda").bfloat16()
    splits = torch.tensor(make_splits("balanced", E, M), device="cuda")
    with torch.no_grad(), fp8.fp8_autocast(recipe):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: the kept buffers and pointer caches exist before capture
            layer(x, splits, is_first_microbatch=True)
            layer(x, splits, is_first_microbatch=False)
        torch.cuda.current_stream().wait_stream(side)
        first, later = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(first):
            y_first = layer(x, splits, is_first_microbatch=True)
        with torch.cuda.graph(later):
            y_later = layer(x, splits, is_first_microbatch=False)
        for step in range(20):
            gen = torch.Generator(device="cuda").manual_seed(step)
            update = torch.randn(layer.weight.shape, device="cuda", generator=gen).bfloat16() * 1e-2
            layer.weight.add_(update)
            base.weight.add_(update)
            x.copy_(torch.randn(M, K, device="cuda", generator=gen))
            splits.copy_(torch.tensor(make_splits(["balanced", "skewed", "all_to_one"][step % 3], E, M, seed=step)))
            first.replay()
            want_first = base(x, splits)
            assert torch.equal(y_first, want_first), f"step {step}: first micro-batch"
            x.copy_(torch.randn(M, K, device="cuda", generator=gen))
            later.replay()
            assert torch.equal(y_later, base(x, splits)), f"step {step}: later micro-batch"
