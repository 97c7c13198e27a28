"""Fuzz: the FP8 block quantizers (row-wise 1x128, grouped column-wise + dbias, 128x128 weights).

What every quantized block must satisfy, whatever its shape (0 rows, dims
that are not multiples of 128 or 16): its inverse scale is positive and
finite (a power of two with ``pow2_scales``) and its dequantized values
equal the input within half an FP8 step (plus the smallest subnormal step
of the block's scale). On the GPU the core's kernels must equal the CPU
reference bit for bit, as documented, at every position they own.
Arguments that are wrong raise TypeError/ValueError naming them.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from moe_grouped import _core, fp8

from cases import skip_without_cuda_kernels
from fuzz_strategies import (
    Splits, bounds, call, check_splits_outcome, expect_error, expect_ok, fuzz_tests, generator, num_experts, num_tokens,
    splits,
)

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
# (mantissa bits, smallest subnormal) of each FP8 format.
FORMAT = {torch.float8_e4m3fn: (3, 2.0**-9), torch.float8_e5m2: (2, 2.0**-16)}
INPUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
COLS = [1, 7, 16, 100, 127, 128, 129, 200, 256, 300]  # around the 128 block and the 16-element vector width

# Option faults shared by every quantizer: (option, bad values, what the error must name).
OPTION_FAULTS = {
    "fp8_dtype": [torch.float16, torch.int8, "e4m3"],
    "pow2_scales": [1, None, "yes"],
    "amax_epsilon": [-1.0, float("nan"), float("inf"), True],
}


def skip_without_kernels(device: str) -> None:
    if device != "cpu":
        skip_without_cuda_kernels(_core.CAP_FP8_QUANTIZE, "FP8 quantize kernels")


def draw_options(data, fault):
    options = dict(
        fp8_dtype=data.draw(st.sampled_from(FP8_DTYPES), label="fp8_dtype"),
        pow2_scales=data.draw(st.booleans(), label="pow2_scales"),
        amax_epsilon=data.draw(st.sampled_from([0.0, 0.0, 1e-3, 1.0]), label="amax_epsilon"),
    )
    if fault in OPTION_FAULTS:
        options[fault] = data.draw(st.sampled_from(OPTION_FAULTS[fault]), label=f"bad {fault}")
    return options


def random_input(gen, rows, cols, dtype, device):
    """Rows of very different magnitudes (1e-3 .. 1e3), sometimes an all-zero row."""
    x = torch.randn(rows, cols, generator=gen) * 10.0 ** (torch.rand(rows, 1, generator=gen) * 6 - 3)
    if rows > 1:
        x[int(torch.randint(rows, (1,), generator=gen))] = 0
    return x.to(dtype=dtype, device=device)


def check_blocks(x: torch.Tensor, q: fp8.BlockQuantized, dequantized: torch.Tensor, scale_inv_per_value, options,
                 case: str) -> None:
    """Inverse scales positive, finite (powers of two with pow2); dequantized within half an FP8 step of x."""
    scale_inv = q.scale_inv.cpu()
    assert q.data.dtype == options["fp8_dtype"] and scale_inv.dtype == torch.float32, case
    assert bool(torch.isfinite(scale_inv).all()) and bool((scale_inv > 0).all()), f"scale_inv {scale_inv}: {case}"
    if options["pow2_scales"]:
        mantissa, _ = torch.frexp(scale_inv)
        assert bool((mantissa == 0.5).all()), f"scale_inv not powers of two {scale_inv}: {case}"
    mantissa_bits, subnormal = FORMAT[options["fp8_dtype"]]
    x64 = x.detach().cpu().double()
    deq = dequantized.cpu().double()
    assert bool(torch.isfinite(deq).all()), case
    bound = x64.abs() * 2.0 ** -(mantissa_bits + 1) + scale_inv_per_value.cpu().double() * subnormal / 2
    error = (deq - x64).abs()
    worst = (error - bound * (1 + 1e-6) - 1e-30).max() if error.numel() else torch.tensor(0.0)
    assert worst <= 0, f"dequantized off by {error.max():.3g} (bound {bound.max():.3g}): {case}"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.detach().cpu().contiguous().view(torch.uint8),
                                              b.detach().cpu().contiguous().view(torch.uint8))


def prop_quantize_rowwise(data, device):
    skip_without_kernels(device)
    fault = data.draw(st.sampled_from([None] * 5 + ["x_dtype", "x_1d", *OPTION_FAULTS]), label="fault")
    dtype = data.draw(st.sampled_from(INPUT_DTYPES), label="dtype")
    rows = data.draw(st.one_of(num_tokens(), st.just(129)), label="rows")
    cols = data.draw(st.sampled_from(COLS), label="cols")
    options = draw_options(data, fault)
    x = random_input(generator(data), rows, cols, dtype, device)
    given = {"x_dtype": lambda: x.to(torch.float64 if rows % 2 else torch.int32), "x_1d": lambda: x.reshape(-1)}.get(
        fault, lambda: x
    )()
    case = f"{device=} {dtype=} {rows=} {cols=} {fault=} {options}"
    q, error = call(lambda: fp8.quantize_rowwise(given, **options))
    if fault is not None:
        expect_error(error, "x" if fault.startswith("x_") else fault, case=case)
        return
    expect_ok(error, case)
    blocks = -(-cols // fp8.BLOCK)
    assert q.data.shape == (rows, cols) and q.scale_inv.shape == (rows, blocks), case
    per_value = q.scale_inv.repeat_interleave(fp8.BLOCK, dim=1)[:, :cols]
    check_blocks(x, q, fp8.dequantize_1x128(q), per_value, options, case)
    if device != "cpu":
        want = fp8.quantize_1x128(x.cpu(), **options)
        assert same_bits(q.data, want.data) and torch.equal(q.scale_inv.cpu(), want.scale_inv), case


def check_columnwise(x, q: fp8.BlockQuantized, counts, options, case):
    """Each group's block of the grouped column-wise layout: X_e^T quantized 1x128 along its tokens."""
    rows, cols = x.shape
    assert q.data.shape == (cols, fp8.columnwise_padded_rows(rows, len(counts))), case
    assert q.scale_inv.shape == (fp8.columnwise_scale_rows(rows, len(counts)), cols), case
    for (start, end), group in zip(bounds(counts), fp8.columnwise_groups(q, counts)):
        count = end - start
        if count == 0:
            continue
        per_value = group.scale_inv.repeat_interleave(fp8.BLOCK, dim=1)[:, :count]
        check_blocks(x[start : start + count].t(), group, fp8.dequantize_1x128(group), per_value, options,
                     f"group of {count} rows at {start}: {case}")


def check_columnwise_bits(got: fp8.BlockQuantized, want: fp8.BlockQuantized, counts, case):
    """The kernels' grouped column-wise output equals the reference at every position a group owns."""
    for count, (padded, block) in zip(counts, fp8.columnwise_group_starts(counts)):
        end = padded + -(-count // 16) * 16  # the group's tokens, then its zeros up to a 16-byte boundary
        assert same_bits(got.data[:, padded:end], want.data[:, padded:end]), f"columns [{padded}, {end}): {case}"
        blocks = -(-count // fp8.BLOCK)
        assert torch.equal(got.scale_inv[block : block + blocks].cpu(), want.scale_inv[block : block + blocks]), case


def own_groups(split: Splits, rows: int) -> Splits:
    """quantize_grouped takes E from len(m_splits): a split of another length is a split for another E,
    valid or not by its values alone."""
    if split.kind not in ("too_short", "too_long"):
        return split
    counts = split.value.tolist() if split.is_tensor else list(split.value)
    if not counts:
        return split  # no group at all: refused everywhere
    if min(counts) >= 0 and sum(counts) == rows:
        return Splits(counts, split.value, "int64" if split.is_tensor else "list")
    return Splits(counts, split.value, "sum_over")


def prop_quantize_grouped(data, device):
    skip_without_kernels(device)
    fault = data.draw(st.sampled_from([None] * 5 + ["x_dtype", *OPTION_FAULTS]), label="fault")
    dtype = data.draw(st.sampled_from(INPUT_DTYPES), label="dtype")
    groups = data.draw(num_experts(), label="E")
    rows = data.draw(st.one_of(num_tokens(), st.just(130)), label="rows")
    cols = data.draw(st.sampled_from(COLS), label="cols")
    allow_invalid = fault is None and data.draw(st.booleans(), label="invalid splits allowed")  # half: valid only
    split = own_groups(data.draw(splits(rows, groups, device, allow_invalid=allow_invalid), label="m_splits"), rows)
    groups = len(split.counts)
    rowwise = data.draw(st.booleans(), label="rowwise")
    dbias = data.draw(st.booleans(), label="dbias")
    options = draw_options(data, fault)
    x = random_input(generator(data), rows, cols, dtype, device)
    given = x.to(torch.float64) if fault == "x_dtype" else x
    backend = "reference" if device == "cpu" else "cuda"
    case = f"{device=} {dtype=} E={groups} {rows=} {cols=} {split.kind=} {rowwise=} {dbias=} {fault=} {options}"
    q, error = call(lambda: fp8.quantize_grouped(given, split.value, rowwise=rowwise, dbias=dbias, backend=backend,
                                                 **options))
    if fault is not None:
        expect_error(error, "x" if fault == "x_dtype" else fault, case=case)
        return
    if not check_splits_outcome(split, backend, error, case):
        return
    counts = split.counts
    assert (q.rowwise is None) != rowwise and (q.dbias is None) != dbias, case
    if rowwise:
        assert q.rowwise.data.shape == (rows, cols), case
        per_value = q.rowwise.scale_inv.repeat_interleave(fp8.BLOCK, dim=1)[:, :cols]
        check_blocks(x, q.rowwise, fp8.dequantize_1x128(q.rowwise), per_value, options, f"rowwise: {case}")
    check_columnwise(x.cpu(), fp8.BlockQuantized(q.columnwise.data.cpu(), q.columnwise.scale_inv.cpu()), counts,
                     options, f"columnwise: {case}")
    if dbias:
        assert q.dbias.shape == (groups, cols) and q.dbias.dtype == torch.float32, case
        x64 = x.cpu().double()
        expected = torch.stack([x64[start:end].sum(0) for start, end in bounds(counts)])
        magnitude = torch.stack([x64[start:end].abs().sum(0) for start, end in bounds(counts)])
        error = (q.dbias.cpu().double() - expected).abs()  # float32 sums of at most 130 values
        assert bool((error <= magnitude * 1e-5 + 1e-30).all()), f"dbias off by {error.max():.3g}: {case}"
    if device != "cpu":
        want = fp8.quantize_grouped_1x128(x.cpu(), counts, **options, rowwise=rowwise, dbias=dbias)
        check_columnwise_bits(q.columnwise, want.columnwise, counts, case)
        if rowwise:
            assert same_bits(q.rowwise.data, want.rowwise.data), case
            assert torch.equal(q.rowwise.scale_inv.cpu(), want.rowwise.scale_inv), case
        if dbias:
            assert torch.equal(q.dbias.cpu(), want.dbias), case


WEIGHT_DIMS = [1, 5, 16, 128, 129, 200]
WEIGHT_FAULTS = {"weights_2d": "weights", "weights_dtype": "weights", "weights_mismatch": "weights", "empty": "weights"}


def prop_quantize_weights(data, device):
    skip_without_kernels(device)
    fault = data.draw(st.sampled_from([None] * 5 + list(WEIGHT_FAULTS) + list(OPTION_FAULTS)), label="fault")
    dtype = data.draw(st.sampled_from(INPUT_DTYPES), label="dtype")
    groups = data.draw(st.integers(1, 4), label="E")
    n = data.draw(st.sampled_from(WEIGHT_DIMS), label="N")
    k = data.draw(st.sampled_from(WEIGHT_DIMS), label="K")
    as_list = data.draw(st.booleans(), label="list of experts")
    transpose = data.draw(st.booleans(), label="transpose")
    options = draw_options(data, fault)
    gen = generator(data)
    w = (torch.randn(groups, n, k, generator=gen) * 10.0 ** (torch.rand(groups, 1, 1, generator=gen) * 4 - 2))
    w = w.to(dtype=dtype, device=device)
    # Views of one [E, N, K] tensor start wherever N*K lands them; separate
    # copies are fresh (aligned) allocations.
    views = data.draw(st.booleans(), label="list of views") if as_list else False
    given = (list(w.unbind(0)) if views else [t.clone() for t in w.unbind(0)]) if as_list else w
    if fault == "weights_2d":
        given = w[0]
    elif fault == "weights_dtype":
        given = w.to(torch.float64)
    elif fault == "weights_mismatch":
        given = [w[0], w[0, :, :-1] if k > 1 else torch.zeros(n, 2, dtype=dtype, device=device)]
    elif fault == "empty":
        given = []
    backend = "reference" if device == "cpu" else "cuda"
    case = f"{device=} {dtype=} E={groups} {n=} {k=} {as_list=} {views=} {transpose=} {fault=} {options}"
    q, error = call(lambda: fp8.quantize_weights_128x128(given, transpose=transpose, backend=backend, **options))
    if fault is not None:
        expect_error(error, WEIGHT_FAULTS.get(fault, fault), case=case)
        return
    if backend == "cuda" and as_list and any(t.data_ptr() % 16 for t in given):
        expect_error(error, "16-byte aligned", case=case)  # TMA's rule, refused by name
        return
    expect_ok(error, case)
    tiles = (-(-n // fp8.BLOCK), -(-k // fp8.BLOCK))
    assert q.w.data.shape == (groups, n, k) and q.w.scale_inv.shape == (groups, *tiles), case
    for e in range(groups):
        block = fp8.BlockQuantized(q.w.data[e].cpu(), q.w.scale_inv[e].cpu())
        per_value = block.scale_inv.repeat_interleave(fp8.BLOCK, 0).repeat_interleave(fp8.BLOCK, 1)[:n, :k]
        check_blocks(w[e], block, fp8.dequantize_128x128(block), per_value, options, f"expert {e}: {case}")
    if transpose:
        assert same_bits(q.wt.data, q.w.data.transpose(1, 2)), case
        assert torch.equal(q.wt.scale_inv, q.w.scale_inv.transpose(1, 2)), case
    else:
        assert q.wt is None, case
    if device != "cpu":
        want = fp8.quantize_grouped_128x128(w.cpu(), **options, transpose=False)
        assert same_bits(q.w.data, want.w.data) and torch.equal(q.w.scale_inv.cpu(), want.w.scale_inv), case


test_quantize_rowwise_cpu, test_quantize_rowwise_gpu = fuzz_tests(prop_quantize_rowwise)
test_quantize_grouped_cpu, test_quantize_grouped_gpu = fuzz_tests(prop_quantize_grouped)
test_quantize_weights_cpu, test_quantize_weights_gpu = fuzz_tests(prop_quantize_weights)
