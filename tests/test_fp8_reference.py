"""The FP8 block-scaling recipe and the reference quantizers (CPU)."""

import pytest
import torch

from moe_grouped import fp8
from moe_grouped.fp8 import BLOCK

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FLOAT32_MAX = torch.finfo(torch.float32).max


def test_scale_rules_match_transformer_engine():
    amax = torch.tensor([0.0, float("inf"), float("nan"), 1e-40, 4.0, 448.0, 3.0])
    scale = fp8.compute_scale(amax, E4M3, pow2_scales=False, amax_epsilon=0.0)
    assert scale[:3].tolist() == [1.0, 1.0, 1.0]  # zero, inf and NaN amax keep scale 1
    assert scale[3].item() == FLOAT32_MAX  # 448 / 1e-40 overflows float32
    assert scale[4:].tolist() == [112.0, 1.0, pytest.approx(448 / 3)]
    pow2 = fp8.compute_scale(amax, E4M3, pow2_scales=True, amax_epsilon=0.0)
    assert pow2[4:].tolist() == [64.0, 1.0, 128.0]  # rounded down to powers of two
    eps = fp8.compute_scale(torch.tensor([0.0, 1e-6]), E4M3, pow2_scales=False, amax_epsilon=1e-3)
    assert eps.tolist() == [pytest.approx(448e3), pytest.approx(448e3)]


def test_hand_computed_row():
    x = torch.zeros(1, BLOCK)
    x[0, :3] = torch.tensor([1.0, -2.0, 4.0])
    q = fp8.quantize_1x128(x, E4M3, pow2_scales=True)
    assert q.scale_inv.tolist() == [[1 / 64]]
    assert q.data[0, :3].float().tolist() == [64.0, -128.0, 256.0]
    assert torch.equal(fp8.dequantize_1x128(q), x)


@pytest.mark.parametrize("k", [128, 200, 384, 7])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=str)
def test_rowwise_blocks(k, pow2, dtype):
    torch.manual_seed(k)
    x = torch.randn(33, k) * torch.logspace(-3, 3, 33).unsqueeze(1)  # rows of very different scale
    q = fp8.quantize_1x128(x, dtype, pow2_scales=pow2)
    blocks = -(-k // BLOCK)
    assert q.data.shape == (33, k) and q.data.dtype == dtype
    assert q.scale_inv.shape == (33, blocks) and q.scale_inv.dtype == torch.float32
    fp8_max = torch.finfo(dtype).max
    data = q.data.float()
    for b in range(blocks):
        block_max = data[:, b * BLOCK : (b + 1) * BLOCK].abs().amax(dim=1)
        assert (block_max <= fp8_max).all()
        # Each block uses its range: pow2 scales lose at most a factor of two.
        assert (block_max >= (fp8_max / 2 if pow2 else fp8_max) * 0.99).all()
    if pow2:
        exponents = torch.log2(q.scale_inv)
        assert torch.equal(exponents, exponents.round()), "pow2 scales must be powers of two"
    relative = (fp8.dequantize_1x128(q) - x).norm() / x.norm()
    assert relative < (0.04 if dtype == E4M3 else 0.08)


def test_blocks_are_independent():
    x = torch.randn(4, 256)
    y = x.clone()
    y[:, 128:] *= 1000
    qx, qy = fp8.quantize_1x128(x, E4M3, True), fp8.quantize_1x128(y, E4M3, True)
    assert torch.equal(qx.data[:, :128].float(), qy.data[:, :128].float())
    assert torch.equal(qx.scale_inv[:, 0], qy.scale_inv[:, 0])


@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (130, 200), (5, 300)])
@pytest.mark.parametrize("pow2", [True, False])
def test_weight_tiles(shape, pow2):
    torch.manual_seed(0)
    w = torch.randn(*shape)
    w[: min(128, shape[0]), : min(128, shape[1])] *= 50  # one loud tile
    q = fp8.quantize_128x128(w, E4M3, pow2_scales=pow2)
    tiles = (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))
    assert q.scale_inv.shape == tiles
    if tiles[1] > 1:
        assert q.scale_inv[0, 0] > 10 * q.scale_inv[0, 1], "the loud tile must not set its neighbours' scale"
    relative = (fp8.dequantize_128x128(q) - w).norm() / w.norm()
    assert relative < 0.04


def test_grouped_columnwise_restarts_blocks_at_group_boundaries():
    torch.manual_seed(1)
    splits = [130, 0, 5, 300]
    x = torch.randn(sum(splits), 64)
    groups = fp8.quantize_grouped_columnwise(x, splits, E4M3, pow2_scales=True)
    assert [tuple(g.data.shape) for g in groups] == [(64, 130), (64, 0), (64, 5), (64, 300)]
    assert [tuple(g.scale_inv.shape) for g in groups] == [(64, 2), (64, 0), (64, 1), (64, 3)]
    start = 0
    for count, g in zip(splits, groups):
        if count:
            original = x[start : start + count].t()
            assert (fp8.dequantize_1x128(g) - original).norm() / original.norm() < 0.04
        start += count


def test_recipe_formats_and_validation():
    assert fp8.Float8BlockScaling().backward_dtype == E4M3
    hybrid = fp8.Float8BlockScaling(fp8_format="HYBRID")
    assert hybrid.forward_dtype == E4M3 and hybrid.backward_dtype == E5M2
    with pytest.raises(ValueError, match="fp8_format"):
        fp8.Float8BlockScaling(fp8_format="E5M2")
    with pytest.raises(ValueError, match="amax_epsilon"):
        fp8.Float8BlockScaling(amax_epsilon=-1.0)


def test_autocast_nests_and_restores():
    assert fp8.get_fp8_recipe() is None
    outer, inner = fp8.Float8BlockScaling(), fp8.Float8BlockScaling(pow2_scales=False)
    with fp8.fp8_autocast(outer):
        assert fp8.get_fp8_recipe() is outer
        with fp8.fp8_autocast(inner):
            assert fp8.get_fp8_recipe() is inner
        with fp8.fp8_autocast(enabled=False):
            assert fp8.get_fp8_recipe() is None
        assert fp8.get_fp8_recipe() is outer
    assert fp8.get_fp8_recipe() is None
    with pytest.raises(TypeError, match="Float8BlockScaling"):
        with fp8.fp8_autocast("deepseek"):
            pass


def test_grouped_linear_refuses_fp8_rather_than_running_bf16():
    from moe_grouped import GroupedLinear

    layer = GroupedLinear(2, 128, 128, backend="reference")
    x = torch.randn(4, 128)
    with fp8.fp8_autocast(fp8.Float8BlockScaling()):
        with pytest.raises(NotImplementedError, match="no FP8 block-scaling GEMMs yet"):
            layer(x, [2, 2])
        with fp8.fp8_autocast(enabled=False):
            assert layer(x, [2, 2]).shape == (4, 128)
