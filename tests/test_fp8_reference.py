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


AWKWARD_SPLITS = [219, 2246, 5, 8103, 1, 1117, 4693, 0]


def test_columnwise_layout_sizes_hold_every_split():
    assert fp8.columnwise_padded_rows(300, 4) == 384 + 4 * 128
    assert fp8.columnwise_scale_rows(300, 4) == 3 + 4
    assert fp8.columnwise_group_starts([130, 0, 5, 300]) == [(0, 0), (256, 2), (256, 2), (384, 3)]
    gen = torch.Generator().manual_seed(0)
    cases = [AWKWARD_SPLITS, [0] * 7 + [1], [1] * 9, [16] * 4, [17, 15, 128, 129]]
    cases += [torch.randint(0, 300, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen).tolist()
              for _ in range(200)]
    for splits in cases:
        rows, num_groups = sum(splits), len(splits)
        for count, (padded, block) in zip(splits, fp8.columnwise_group_starts(splits)):
            assert padded % fp8.COLUMNWISE_ALIGN == 0, splits
            assert padded + count <= fp8.columnwise_padded_rows(rows, num_groups), splits
            assert block + -(-count // BLOCK) <= fp8.columnwise_scale_rows(rows, num_groups), splits


@pytest.mark.parametrize("splits", [[130, 0, 5, 300], [1, 0, 17, 128, 129, 15], [0, 0, 77], [64]], ids=str)
def test_grouped_columnwise_packs_each_group_at_its_start(splits):
    torch.manual_seed(1)
    cols = 72
    x = torch.randn(sum(splits), cols) * torch.logspace(-2, 2, sum(splits)).unsqueeze(1)
    q = fp8.quantize_grouped_columnwise(x, splits, E4M3, pow2_scales=True)
    rows, num_groups = sum(splits), len(splits)
    assert q.data.shape == (cols, fp8.columnwise_padded_rows(rows, num_groups)) and q.data.dtype == E4M3
    assert q.scale_inv.shape == (fp8.columnwise_scale_rows(rows, num_groups), cols)
    owned_data = torch.zeros(q.data.shape[1], dtype=torch.bool)
    owned_scales = torch.zeros(q.scale_inv.shape[0], dtype=torch.bool)
    start = 0
    for count, (padded, block), group in zip(splits, fp8.columnwise_group_starts(splits), fp8.columnwise_groups(q, splits)):
        want = fp8.quantize_1x128(x[start : start + count].t(), E4M3, pow2_scales=True)
        blocks = -(-count // BLOCK)
        assert torch.equal(q.data[:, padded : padded + count].view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(q.scale_inv[block : block + blocks], want.scale_inv.t())  # [blocks, K], K fastest
        assert torch.equal(group.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(group.scale_inv, want.scale_inv)
        if count:
            original = x[start : start + count].t()
            assert (fp8.dequantize_1x128(group) - original).norm() / original.norm() < 0.04
        owned_data[padded : padded + count] = True
        owned_scales[block : block + blocks] = True
        start += count
    assert (q.data[:, ~owned_data].view(torch.uint8) == 0).all()
    assert (q.scale_inv[~owned_scales] == 0).all()


def test_grouped_columnwise_refuses_splits_that_do_not_cover_the_rows():
    with pytest.raises(ValueError, match="sum to the 10 rows"):
        fp8.quantize_grouped_columnwise(torch.randn(10, 8), [4, 4], E4M3, True)


def _column_sums_in_documented_order(x, splits):
    """The dbias order of the header, one float32 scalar add at a time."""
    out = torch.zeros(len(splits), x.shape[1])
    start = 0
    zero = torch.tensor(0.0)
    for e, count in enumerate(splits):
        for c in range(x.shape[1]):
            block_sums = []
            for b in range(-(-count // BLOCK)):
                segments = []
                for s in range(8):
                    acc = zero
                    for i in range(16):
                        t = b * BLOCK + s * 16 + i
                        acc = acc + (x[start + t, c] if t < count else zero)
                    segments.append(acc)
                s = segments
                block_sums.append(((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])))
            lanes = [zero] * 8
            for j, value in enumerate(block_sums):
                lanes[j % 8] = lanes[j % 8] + value
            total = zero
            for value in lanes:
                total = total + value
            out[e, c] = total
        start += count
    return out


def test_grouped_column_sums_follow_the_documented_order():
    torch.manual_seed(2)
    splits = [300, 0, 1, 1100, 17]
    x = torch.randn(sum(splits), 3) * 1e3
    x[5] = 1e7  # large terms make the order visible in the low bits
    got = fp8.grouped_column_sums(x, splits)
    assert got.dtype == torch.float32 and got.shape == (5, 3)
    assert torch.equal(got, _column_sums_in_documented_order(x, splits))
    assert torch.equal(got[1], torch.zeros(3)), "an empty group sums to zero"
    want = torch.stack([x[a:b].double().sum(0) for a, b in [(0, 300), (300, 300), (300, 301), (301, 1401), (1401, 1418)]])
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-2)


def test_quantize_grouped_1x128_is_the_three_references():
    torch.manual_seed(3)
    splits = [5, 0, 250]
    x = torch.randn(255, 130, dtype=torch.bfloat16)
    out = fp8.quantize_grouped_1x128(x, splits, E5M2, False, 1e-3, rowwise=True, dbias=True)
    rowwise = fp8.quantize_1x128(x, E5M2, False, 1e-3)
    columnwise = fp8.quantize_grouped_columnwise(x, splits, E5M2, False, 1e-3)
    assert torch.equal(out.rowwise.data.view(torch.uint8), rowwise.data.view(torch.uint8))
    assert torch.equal(out.rowwise.scale_inv, rowwise.scale_inv)
    assert torch.equal(out.columnwise.data.view(torch.uint8), columnwise.data.view(torch.uint8))
    assert torch.equal(out.columnwise.scale_inv, columnwise.scale_inv)
    assert torch.equal(out.dbias, fp8.grouped_column_sums(x, splits))
    bare = fp8.quantize_grouped_1x128(x, splits, E5M2, False, 1e-3, rowwise=False)
    assert bare.rowwise is None and bare.dbias is None


def test_cpu_wrappers_fall_back_to_the_references():
    torch.manual_seed(4)
    splits = [3, 0, 200]
    x = torch.randn(203, 64)
    got = fp8.quantize_grouped(x, torch.tensor(splits), E4M3, dbias=True)
    want = fp8.quantize_grouped_1x128(x, splits, E4M3, True, dbias=True)
    assert torch.equal(got.rowwise.data.view(torch.uint8), want.rowwise.data.view(torch.uint8))
    assert torch.equal(got.columnwise.data.view(torch.uint8), want.columnwise.data.view(torch.uint8))
    assert torch.equal(got.dbias, want.dbias)
    columnwise = fp8.quantize_columnwise_grouped(x, splits, E4M3)
    assert torch.equal(columnwise.scale_inv, want.columnwise.scale_inv)
    with pytest.raises(ValueError, match="must sum"):
        fp8.quantize_grouped(x, [3, 3, 3], E4M3)


@pytest.mark.parametrize("shape", [(3, 256, 384), (2, 130, 200), (1, 5, 300)])
def test_grouped_weight_blocks_and_their_transpose(shape):
    torch.manual_seed(5)
    w = torch.randn(*shape)
    w[0, :5, :5] *= 100
    grouped = fp8.quantize_grouped_128x128(w, E4M3, pow2_scales=True)
    separate = fp8.quantize_grouped_128x128(list(w.unbind(0)), E4M3, pow2_scales=True)
    tiles = (-(-shape[1] // BLOCK), -(-shape[2] // BLOCK))
    assert grouped.w.data.shape == shape and grouped.w.scale_inv.shape == (shape[0], *tiles)
    assert grouped.wt.data.shape == (shape[0], shape[2], shape[1])
    assert grouped.wt.scale_inv.shape == (shape[0], tiles[1], tiles[0])
    for e in range(shape[0]):
        want = fp8.quantize_128x128(w[e], E4M3, pow2_scales=True)
        assert torch.equal(grouped.w.data[e].view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(grouped.w.scale_inv[e], want.scale_inv)
        assert torch.equal(grouped.wt.data[e].view(torch.uint8), want.data.t().view(torch.uint8))
        assert torch.equal(grouped.wt.scale_inv[e], want.scale_inv.t())
    assert torch.equal(separate.w.data.view(torch.uint8), grouped.w.data.view(torch.uint8))
    cpu = fp8.quantize_weights_128x128(w, E4M3, transpose=False)
    assert cpu.wt is None and torch.equal(cpu.w.scale_inv, grouped.w.scale_inv)


def test_recipe_formats_and_validation():
    assert fp8.Float8BlockScaling().backward_dtype == E4M3
    hybrid = fp8.Float8BlockScaling(fp8_format="HYBRID")
    assert hybrid.forward_dtype == E4M3 and hybrid.backward_dtype == E5M2
    with pytest.raises(ValueError, match="fp8_format"):
        fp8.Float8BlockScaling(fp8_format="E5M2")
    with pytest.raises(ValueError, match="amax_epsilon"):
        fp8.Float8BlockScaling(amax_epsilon=-1.0)
    # Checked here once: the FP8 experts' stages pass the recipe's options to the quantizers unchecked.
    with pytest.raises(ValueError, match="amax_epsilon"):
        fp8.Float8BlockScaling(amax_epsilon=float("inf"))
    with pytest.raises(ValueError, match="amax_epsilon"):
        fp8.Float8BlockScaling(amax_epsilon="0")
    with pytest.raises(TypeError, match="pow2_scales"):
        fp8.Float8BlockScaling(pow2_scales=1)


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
