"""The core's FP8 quantize kernels against the reference, bit for bit (GPU).

Grouped outputs are checked at every expert's own positions of the padded
column-wise layout (its tokens, then zeros up to the next 16-byte boundary),
and the positions no expert owns are pre-filled with a sentinel that the
kernels must leave untouched.
"""

import pytest
import torch

from moe_grouped import _checks, _core, fp8, workspace

from cases import SPLIT_PATTERNS, make_splits, needs_cuda_kernels, oracle_dbias

pytestmark = [
    pytest.mark.gpu,
    needs_cuda_kernels(_core.CAP_FP8_QUANTIZE, "FP8 quantize kernels"),
]

DEVICE = "cuda"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [E4M3, E5M2]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (fp8 dtype, pow2 scales, amax epsilon)
SCALE_OPTIONS = [(E4M3, True, 0.0), (E4M3, False, 0.0), (E5M2, True, 1e-2), (E5M2, False, 0.0)]
# Zero-token experts, 1-token experts, counts just off multiples of 16 and 128.
EDGE_SPLITS = [1, 0, 17, 128, 129, 15, 16, 0, 255, 256, 2, 0]
AWKWARD_SPLITS = [219, 2246, 5, 8103, 1, 1117, 4693, 0]
SENTINEL = 0x5A  # an fp8 byte the kernels must not write into padding


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def random_input(rows, cols, dtype, seed, misaligned=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-4, 4, rows).unsqueeze(1)
    if rows > 3:
        x[3] = 0  # an all-zero row: scale 1
    x = x.to(dtype)
    if not misaligned:
        return x.to(DEVICE)
    # A contiguous view one element past a 16-byte boundary: the element path.
    storage = torch.empty(rows * cols + 1, dtype=dtype, device=DEVICE)
    view = storage[1:].view(rows, cols)
    view.copy_(x)
    return view


def sentinel_out(rows, cols, num_groups, fp8_dtype, rowwise, dbias) -> fp8.GroupedQuantized:
    def block(data_shape, scale_shape):
        data = torch.full(data_shape, SENTINEL, dtype=torch.uint8, device=DEVICE).view(fp8_dtype)
        return fp8.BlockQuantized(data, torch.full(scale_shape, float("nan"), device=DEVICE))

    return fp8.GroupedQuantized(
        block((rows, cols), (rows, -(-cols // 128))) if rowwise else None,
        block((cols, fp8.columnwise_padded_rows(rows, num_groups)), (fp8.columnwise_scale_rows(rows, num_groups), cols)),
        torch.full((num_groups, cols), float("nan"), device=DEVICE) if dbias else None,
    )


def assert_columnwise(got: fp8.BlockQuantized, want: fp8.BlockQuantized, splits, rows, case, sentinel=True):
    """Each expert's columns (zeros past its tokens up to a 128-token boundary) and
    scale rows bit for bit; positions no expert owns untouched."""
    cols, num_groups = got.data.shape[0], len(splits)
    assert got.data.shape == (cols, fp8.columnwise_padded_rows(rows, num_groups)), case
    assert got.scale_inv.shape == (fp8.columnwise_scale_rows(rows, num_groups), cols), case
    owned_data = torch.zeros(got.data.shape[1], dtype=torch.bool)
    owned_scales = torch.zeros(got.scale_inv.shape[0], dtype=torch.bool)
    for e, (count, (padded, block)) in enumerate(zip(splits, fp8.columnwise_group_starts(splits))):
        blocks = -(-count // 128)
        where = f"{case}: expert {e} of {splits} ({count} tokens at column {padded}, scale row {block})"
        assert padded % fp8.COLUMNWISE_ALIGN == 0, where
        # the group's columns, written in whole 128-byte runs
        run_end = padded + -(-count // fp8.COLUMNWISE_ALIGN) * fp8.COLUMNWISE_ALIGN
        assert same_bits(got.data[:, padded:run_end], want.data[:, padded:run_end]), where
        assert same_bits(got.scale_inv[block : block + blocks], want.scale_inv[block : block + blocks]), where
        owned_data[padded:run_end] = True
        owned_scales[block : block + blocks] = True
    if sentinel:
        assert (bits(got.data)[:, ~owned_data] == SENTINEL).all(), f"{case}: columns no expert owns were written"
        assert torch.isnan(got.scale_inv.cpu()[~owned_scales]).all(), f"{case}: unused scale rows were written"


def assert_rowwise(got: fp8.BlockQuantized, want: fp8.BlockQuantized, case):
    assert same_bits(got.data, want.data), f"{case}: row-wise data"
    assert same_bits(got.scale_inv, want.scale_inv), f"{case}: row-wise scales"


def assert_dbias(got: torch.Tensor, x: torch.Tensor, splits, case):
    """Bit for bit against the reference order; close to the float64 sums."""
    x = x.cpu()
    assert same_bits(got, fp8.grouped_column_sums(x, splits)), f"{case}: dbias differs from the reference order"
    want = oracle_dbias(x, splits)
    magnitude = torch.stack([x[s : s + c].double().abs().sum(0) for s, c in zip(_starts(splits), splits)])
    error = (got.cpu().double() - want).abs()
    assert (error <= 1e-5 * magnitude).all(), f"{case}: dbias error {float((error - 1e-5 * magnitude).max()):.3e}"
    for e, count in enumerate(splits):
        if count == 0:
            assert (got[e] == 0).all(), f"{case}: empty expert {e} must get a zero dbias"


def _starts(splits):
    out, start = [], 0
    for count in splits:
        out.append(start)
        start += count
    return out


# ---- row-wise ---------------------------------------------------------------


@pytest.mark.parametrize("cols", [7, 128, 200, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fp8_dtype", FP8, ids=str)
@pytest.mark.parametrize("pow2,epsilon", [(True, 0.0), (False, 0.0), (True, 1e-2)])
def test_rowwise_matches_reference_bitwise(cols, dtype, fp8_dtype, pow2, epsilon):
    x = random_input(37, cols, dtype, seed=cols)
    got = fp8.quantize_rowwise(x, fp8_dtype, pow2, epsilon)
    want = fp8.quantize_1x128(x.cpu(), fp8_dtype, pow2, epsilon)
    assert_rowwise(got, want, f"{cols=} {dtype=} {fp8_dtype=} {pow2=} {epsilon=}")


# ---- grouped column-wise, row-wise + column-wise, dbias ---------------------


@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
@pytest.mark.parametrize(
    "num_groups,rows,cols",
    # A column-wise-only CTA takes four column tiles of one block: (16, 32768,
    # 1024) has two such units, (6, 3000, 320) one of three tiles, (12, 3000,
    # 640) a full unit then one tile, (24, 5000, 776) a full unit then three
    # tiles, the last 8 columns wide (unaligned rows: the element path). Each
    # CTA scans m_splits with 256 threads: 300 and 1100 groups take two and
    # five per thread.
    [(1, 300, 64), (4, 517, 200), (32, 4096, 128), (256, 2000, 96), (8, 1000, 7), (16, 32768, 1024),
     (6, 3000, 320), (12, 3000, 640), (24, 5000, 776), (300, 2500, 128), (1100, 4000, 136)],
)
@pytest.mark.parametrize("fp8_dtype", FP8, ids=str)
@pytest.mark.parametrize("splits_dtype", [torch.int32, torch.int64], ids=str)
def test_columnwise_grouped_matches_reference_bitwise(pattern, num_groups, rows, cols, fp8_dtype, splits_dtype):
    splits = make_splits(pattern, num_groups, rows, seed=num_groups)
    x = random_input(rows, cols, torch.bfloat16, seed=rows)
    out = sentinel_out(rows, cols, num_groups, fp8_dtype, rowwise=False, dbias=False).columnwise
    got = fp8.quantize_columnwise_grouped(
        x, torch.tensor(splits, dtype=splits_dtype, device=DEVICE), fp8_dtype, True, out=out
    )
    assert got.data.data_ptr() == out.data.data_ptr()
    want = fp8.quantize_grouped_columnwise(x.cpu(), splits, fp8_dtype, True)
    assert_columnwise(got, want, splits, rows, f"{pattern=} {num_groups=} {rows=} {cols=} {fp8_dtype=}")


@pytest.mark.parametrize("splits", [EDGE_SPLITS, AWKWARD_SPLITS, [0, 0, 0, 4000], [4000]], ids=["edges", "awkward", "last", "one"])
@pytest.mark.parametrize("cols", [256, 136])
def test_grouped_awkward_splits(splits, cols):
    rows = sum(splits)
    x = random_input(rows, cols, torch.bfloat16, seed=len(splits))
    out = sentinel_out(rows, cols, len(splits), E4M3, rowwise=True, dbias=True)
    got = fp8.quantize_grouped(x, torch.tensor(splits, device=DEVICE), E4M3, dbias=True, out=out)
    want = fp8.quantize_grouped_1x128(x.cpu(), splits, E4M3, True)
    case = f"{splits=} {cols=}"
    assert_rowwise(got.rowwise, want.rowwise, case)
    assert_columnwise(got.columnwise, want.columnwise, splits, rows, case)
    assert_dbias(got.dbias, x, splits, case)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cols", [7, 96, 200, 256])
@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("rowwise", [True, False], ids=["both", "columnwise"])
@pytest.mark.parametrize("fp8_dtype,pow2,epsilon", SCALE_OPTIONS, ids=str)
def test_grouped_dtypes_layouts_and_scale_options(dtype, cols, misaligned, rowwise, fp8_dtype, pow2, epsilon):
    splits = EDGE_SPLITS
    rows = sum(splits)
    x = random_input(rows, cols, dtype, seed=cols, misaligned=misaligned)
    out = sentinel_out(rows, cols, len(splits), fp8_dtype, rowwise=rowwise, dbias=True)
    got = fp8.quantize_grouped(
        x, torch.tensor(splits, device=DEVICE), fp8_dtype, pow2, epsilon, rowwise=rowwise, dbias=True, out=out
    )
    want = fp8.quantize_grouped_1x128(x.cpu(), splits, fp8_dtype, pow2, epsilon, rowwise=rowwise)
    case = f"{dtype=} {cols=} {misaligned=} {rowwise=} {fp8_dtype=} {pow2=} {epsilon=}"
    if rowwise:
        assert_rowwise(got.rowwise, want.rowwise, case)
    else:
        assert got.rowwise is None
    assert_columnwise(got.columnwise, want.columnwise, splits, rows, case)
    assert_dbias(got.dbias, x, splits, case)


@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
@pytest.mark.parametrize("num_groups,rows,cols", [(8, 4096, 512), (128, 3000, 256), (3, 100, 1024), (16, 32768, 1024), (300, 3000, 256)])
@pytest.mark.parametrize("fp8_dtype", FP8, ids=str)
def test_fused_rowwise_columnwise_dbias_matches_reference_and_is_deterministic(pattern, num_groups, rows, cols, fp8_dtype):
    splits = make_splits(pattern, num_groups, rows, seed=rows)
    x = random_input(rows, cols, torch.bfloat16, seed=num_groups)
    device_splits = torch.tensor(splits, device=DEVICE)
    out = sentinel_out(rows, cols, num_groups, fp8_dtype, rowwise=True, dbias=True)
    got = fp8.quantize_grouped(x, device_splits, fp8_dtype, dbias=True, out=out)
    want = fp8.quantize_grouped_1x128(x.cpu(), splits, fp8_dtype, True)
    case = f"{pattern=} {num_groups=} {rows=} {cols=} {fp8_dtype=}"
    assert_rowwise(got.rowwise, want.rowwise, case)
    assert_columnwise(got.columnwise, want.columnwise, splits, rows, case)
    assert_dbias(got.dbias, x, splits, case)
    again = fp8.quantize_grouped(x, device_splits, fp8_dtype, dbias=True)
    assert same_bits(again.dbias, got.dbias), f"{case}: dbias differs between two runs"
    assert same_bits(again.rowwise.data, got.rowwise.data), case
    # The same bytes as the separate row-wise quantizer.
    assert_rowwise(fp8.quantize_rowwise(x, fp8_dtype), got.rowwise, case)


def test_rowwise_covers_rows_past_the_groups(monkeypatch):
    # m_splits summing to less than the rows (not validated on the device):
    # the row-wise copy still covers every row; the groups get what they own.
    monkeypatch.setattr(_checks, "_debug_checks", False)
    rows, cols, splits = 700, 256, [100, 0, 250]
    x = random_input(rows, cols, torch.bfloat16, seed=7)
    out = sentinel_out(rows, cols, len(splits), E4M3, rowwise=True, dbias=True)
    got = fp8.quantize_grouped(x, torch.tensor(splits, device=DEVICE), E4M3, dbias=True, out=out)
    assert_rowwise(got.rowwise, fp8.quantize_1x128(x.cpu(), E4M3, True), "rows past the groups")
    owned = x[: sum(splits)].cpu()
    assert_columnwise(got.columnwise, fp8.quantize_grouped_columnwise(owned, splits, E4M3, True), splits, rows,
                      "rows past the groups")
    assert same_bits(got.dbias, fp8.grouped_column_sums(owned, splits))


def test_no_tokens_gives_zero_dbias():
    x = torch.empty(0, 96, device=DEVICE, dtype=torch.bfloat16)
    got = fp8.quantize_grouped(x, torch.zeros(4, dtype=torch.int64, device=DEVICE), E4M3, dbias=True)
    assert got.rowwise.data.shape == (0, 96) and got.columnwise.data.shape == (96, 4 * 128)
    assert got.columnwise.scale_inv.shape == (4, 96)
    assert torch.equal(got.dbias.cpu(), torch.zeros(4, 96))


@pytest.mark.parametrize("rowwise,dbias", [(False, False), (True, True), (False, True)], ids=["columnwise", "both+dbias", "columnwise+dbias"])
def test_grouped_replays_under_capture_with_new_splits(rowwise, dbias):
    num_groups, rows, cols = 8, 1024, 256
    static_x = torch.randn(rows, cols, device=DEVICE, dtype=torch.bfloat16)
    static_splits = torch.tensor(make_splits("balanced", num_groups, rows), device=DEVICE)
    # Warm-up outside capture: sizes the workspace (the dbias partials).
    out = fp8.quantize_grouped(static_x, static_splits, E4M3, rowwise=rowwise, dbias=dbias)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8.quantize_grouped(static_x, static_splits, E4M3, rowwise=rowwise, dbias=dbias, out=out)
    edge = [1, 0, 17, 128, 129, 15, 16, 718]
    for replay in range(50):
        if replay % 7 == 6:
            splits = edge
        else:
            splits = make_splits(SPLIT_PATTERNS[replay % len(SPLIT_PATTERNS)], num_groups, rows, seed=replay)
        static_x.copy_(torch.randn(rows, cols, device=DEVICE, dtype=torch.bfloat16))
        static_splits.copy_(torch.tensor(splits))
        graph.replay()
        torch.cuda.synchronize()
        want = fp8.quantize_grouped_1x128(static_x.cpu(), splits, E4M3, True, rowwise=rowwise)
        case = f"{replay=} {splits=}"
        if rowwise:
            assert_rowwise(out.rowwise, want.rowwise, case)
        # Padding keeps bytes of earlier replays: compare the owned positions only.
        assert_columnwise(out.columnwise, want.columnwise, splits, rows, case, sentinel=False)
        if dbias:
            assert_dbias(out.dbias, static_x, splits, case)


def test_grouped_without_dbias_captures_without_a_workspace():
    # Without dbias the quantizer needs no scratch memory: a capture with no
    # eager call before it works, and the slot stays unallocated.
    slot = _core.MAX_SLOTS - 1  # used by nothing else
    workspace.release(DEVICE, slot)
    rows, cols, num_groups = 1000, 256, 8
    static_x = torch.randn(rows, cols, device=DEVICE, dtype=torch.bfloat16)
    static_splits = torch.zeros(num_groups, dtype=torch.int64, device=DEVICE)
    out = sentinel_out(rows, cols, num_groups, E4M3, rowwise=True, dbias=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8.quantize_grouped(static_x, static_splits, E4M3, workspace_slot=slot, out=out)
    for replay, pattern in enumerate(SPLIT_PATTERNS):
        splits = make_splits(pattern, num_groups, rows, seed=replay)
        static_splits.copy_(torch.tensor(splits))
        graph.replay()
        torch.cuda.synchronize()
        want = fp8.quantize_grouped_1x128(static_x.cpu(), splits, E4M3, True)
        assert_rowwise(out.rowwise, want.rowwise, pattern)
        assert_columnwise(out.columnwise, want.columnwise, splits, rows, pattern, sentinel=False)
    assert workspace.stats(DEVICE, slot).capacity == 0


# ---- 128x128 weights ---------------------------------------------------------


def _weights(shape, dtype, layout, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=gen) * torch.logspace(-3, 3, shape[0]).view(-1, 1, 1)
    w[0, : min(5, shape[1]), : min(5, shape[2])] *= 1000  # one loud block
    w = w.to(dtype).to(DEVICE)
    return (w, [w]) if layout == "grouped" else (w, [t.clone() for t in w.unbind(0)])


def assert_weights(got: fp8.WeightQuantized, want: fp8.WeightQuantized, case):
    assert same_bits(got.w.data, want.w.data), f"{case}: w data"
    assert same_bits(got.w.scale_inv, want.w.scale_inv), f"{case}: w scales"
    if want.wt is None:
        assert got.wt is None, case
        return
    assert same_bits(got.wt.data, want.wt.data), f"{case}: wt data"
    assert same_bits(got.wt.scale_inv, want.wt.scale_inv), f"{case}: wt scales"
    assert same_bits(got.wt.data, got.w.data.transpose(1, 2)), f"{case}: wt is not w transposed"


@pytest.mark.parametrize("shape", [(3, 256, 384), (2, 130, 200), (1, 7, 5), (4, 128, 128), (2, 300, 96), (2, 1024, 2048)])
@pytest.mark.parametrize("layout", ["grouped", "separate"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fp8_dtype,pow2,epsilon", SCALE_OPTIONS, ids=str)
def test_weights_match_reference_bitwise(shape, layout, dtype, fp8_dtype, pow2, epsilon):
    w, weights = _weights(shape, dtype, layout, seed=shape[1])
    got = fp8.quantize_weights_128x128(weights, fp8_dtype, pow2, epsilon)
    want = fp8.quantize_grouped_128x128(w.cpu(), fp8_dtype, pow2, epsilon)
    assert_weights(got, want, f"{shape=} {layout=} {dtype=} {fp8_dtype=} {pow2=} {epsilon=}")


@pytest.mark.parametrize("shape", [(2, 130, 200), (3, 256, 384)])
def test_weights_without_transpose_and_misaligned(shape):
    w, _ = _weights(shape, torch.bfloat16, "grouped", seed=1)
    want = fp8.quantize_grouped_128x128(w.cpu(), E4M3, True)
    got = fp8.quantize_weights_128x128(w, E4M3, transpose=False)
    assert_weights(got, want._replace(wt=None), f"{shape=} no transpose")
    storage = torch.empty(w.numel() + 1, dtype=w.dtype, device=DEVICE)
    misaligned = storage[1:].view(shape)  # contiguous, one element past 16 bytes: the element path
    misaligned.copy_(w)
    assert_weights(fp8.quantize_weights_128x128(misaligned, E4M3), want, f"{shape=} misaligned")


@pytest.mark.parametrize("layout", ["grouped", "separate"])
def test_weights_replay_under_capture(layout):
    shape = (4, 384, 256)
    w, weights = _weights(shape, torch.bfloat16, layout, seed=3)
    out = fp8.quantize_weights_128x128(weights, E4M3)  # warm-up: caches the address array
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8.quantize_weights_128x128(weights, E4M3, out=out)
    for replay in range(10):
        fresh = torch.randn(shape, device=DEVICE) * (10.0**replay / 1e4)
        for e, target in enumerate(weights if layout == "separate" else [w]):
            target.copy_(fresh[e] if layout == "separate" else fresh)
        graph.replay()
        torch.cuda.synchronize()
        want = fp8.quantize_grouped_128x128(fresh.to(torch.bfloat16).cpu(), E4M3, True)
        assert_weights(out, want, f"{layout=} {replay=}")


# ---- argument checks -----------------------------------------------------------


def test_bad_arguments_are_value_errors():
    x = torch.randn(4, 128, device=DEVICE)
    with pytest.raises(TypeError, match="fp8_dtype"):
        fp8.quantize_rowwise(x, torch.bfloat16)
    with pytest.raises(ValueError, match="amax_epsilon must be a finite number >= 0"):
        fp8.quantize_rowwise(x, E4M3, True, -1.0)
    splits = torch.tensor([4], device=DEVICE)
    with pytest.raises(ValueError, match="out must hold"):
        bad = fp8.BlockQuantized(torch.empty(1, 1, device=DEVICE, dtype=E4M3), torch.empty(1, 1, device=DEVICE))
        fp8.quantize_columnwise_grouped(x, splits, E4M3, out=bad)
    with pytest.raises(ValueError, match="out must have rowwise"):
        columnwise_only = fp8.quantize_grouped(x, splits, E4M3, rowwise=False)
        fp8.quantize_grouped(x, splits, E4M3, out=columnwise_only)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        fp8.quantize_weights_128x128(torch.randn(2, 8, 8, device=DEVICE, dtype=torch.float64), E4M3)
    with pytest.raises(ValueError, match=r"\[E, N, K\]"):
        fp8.quantize_weights_128x128(torch.randn(8, 8, device=DEVICE), E4M3)
