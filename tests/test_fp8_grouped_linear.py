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

from cases import SPLIT_PATTERNS, calc_diff, make_splits

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


def run(layer, x, m_splits, dy, recipe=None):
    x = x.detach().clone().requires_grad_(True)
    with fp8.fp8_autocast(recipe, enabled=recipe is not None):
        y = layer(x, m_splits)
    y.backward(dy)
    if layer.delay_wgrad_compute:
        layer.backward_dw()
    grads = [p.main_grad.clone() if hasattr(p, "main_grad") else p.grad for p in layer.parameters()]
    return y.detach(), x.grad, grads


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

cuda_fp8 = pytest.mark.skipif(
    not moe_grouped._core.has(moe_grouped._core.CAP_GROUPED_GEMM_FP8_BLOCKWISE), reason="core without FP8 GEMMs"
)


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
