"""Fuzz: the grouped ops, splits_to_offsets and swiglu against float64 oracles (see fuzz_strategies)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import assume, strategies as st

from moe_grouped import grouped_dbias, grouped_dgrad, grouped_fprop, grouped_wgrad, splits_to_offsets, swiglu

from fuzz_strategies import (
    assert_close, backends_for, bounds, call, check_splits_outcome, coarser, expect_error, expect_ok, feature_dims,
    float_dtypes, fuzz_tests, gemm_refused, generator, num_experts, num_tokens, randn, splits,
)


def draw_problem(data, device):
    backend = data.draw(st.sampled_from(backends_for(device)), label="backend")
    dtype = data.draw(st.sampled_from(float_dtypes(device, backend)), label="dtype")
    groups = data.draw(num_experts(), label="E")
    rows = data.draw(num_tokens(), label="M")
    n = data.draw(feature_dims(backend), label="N")
    k = data.draw(feature_dims(backend), label="K")
    split = data.draw(splits(rows, groups, device), label="m_splits")
    grouped = data.draw(st.booleans(), label="grouped weights") or groups > 64
    return backend, dtype, groups, rows, n, k, split, grouped


def weights_for(gen, grouped, groups, n, k, dtype, device):
    w = randn(gen, groups, n, k, dtype=dtype, device=device)
    return [w] if grouped else list(w.unbind(0))


def prop_fprop_dgrad(data, device):
    backend, dtype, groups, rows, n, k, split, grouped = draw_problem(data, device)
    gen = generator(data)
    weights = weights_for(gen, grouped, groups, n, k, dtype, device)
    use_bias = data.draw(st.booleans(), label="bias")
    bias = randn(gen, groups, n, dtype=dtype, device=device) if use_bias else None
    out_dtype = data.draw(st.sampled_from([None, torch.float32]), label="out_dtype")
    x = randn(gen, rows, k, dtype=dtype, device=device)
    dy = randn(gen, rows, n, dtype=dtype, device=device)
    case = f"{backend=} {dtype=} E={groups} M={rows} {n=} {k=} {split.kind=} {grouped=} {use_bias=} {out_dtype=}"
    refused = gemm_refused(backend, device, groups)
    y, error = call(lambda: grouped_fprop(x, weights, split.value, bias, out_dtype=out_dtype, backend=backend))
    if check_splits_outcome(split, backend, error, case, too_many_groups=refused):
        assert y.shape == (rows, n) and y.dtype == (out_dtype or dtype), case
        w64 = torch.stack([w.cpu().double() for w in weights]).view(groups, n, k)
        expected = torch.zeros(rows, n, dtype=torch.float64)
        for e, (start, end) in enumerate(bounds(split.counts)):
            expected[start:end] = x[start:end].cpu().double() @ w64[e].t()
            if bias is not None:
                expected[start:end] += bias[e].cpu().double()
        assert_close(y, expected, coarser(dtype, out_dtype), case)
    dx, error = call(lambda: grouped_dgrad(dy, weights, split.value, out_dtype=out_dtype, backend=backend))
    if check_splits_outcome(split, backend, error, case, too_many_groups=refused):
        assert dx.shape == (rows, k), case
        w64 = torch.stack([w.cpu().double() for w in weights]).view(groups, n, k)
        expected = torch.zeros(rows, k, dtype=torch.float64)
        for e, (start, end) in enumerate(bounds(split.counts)):
            expected[start:end] = dy[start:end].cpu().double() @ w64[e]
        assert_close(dx, expected, coarser(dtype, out_dtype), case)


def prop_wgrad_dbias(data, device):
    backend, dtype, groups, rows, n, k, split, grouped = draw_problem(data, device)
    gen = generator(data)
    x = randn(gen, rows, k, dtype=dtype, device=device)
    dy = randn(gen, rows, n, dtype=dtype, device=device)
    accumulate = data.draw(st.booleans(), label="accumulate")
    case = f"{backend=} {dtype=} E={groups} M={rows} {n=} {k=} {split.kind=} {grouped=} {accumulate=}"
    expected_dw = torch.zeros(groups, n, k, dtype=torch.float64)
    expected_db = torch.zeros(groups, n, dtype=torch.float64)
    for e, (start, end) in enumerate(bounds(split.counts)):
        expected_dw[e] = dy[start:end].cpu().double().t() @ x[start:end].cpu().double()
        expected_db[e] = dy[start:end].cpu().double().sum(0)
    if accumulate:
        start_value = randn(gen, groups, n, k, dtype=torch.float32, device=device)
        out = [start_value.clone()] if grouped else [t.clone() for t in start_value.unbind(0)]
        result, error = call(lambda: grouped_wgrad(dy, x, split.value, out=out, accumulate=True, backend=backend))
        expected_dw = expected_dw + start_value.cpu().double()
        out_dtype = torch.float32
    else:
        result, error = call(lambda: grouped_wgrad(dy, x, split.value, num_groups=groups, backend=backend))
        out_dtype = dtype
    if check_splits_outcome(split, backend, error, case, too_many_groups=gemm_refused(backend, device, groups)):
        dw = torch.stack([t.cpu() for t in result]).view(groups, n, k)
        assert dw.dtype == out_dtype, case
        assert_close(dw, expected_dw, coarser(dtype, out_dtype), case)
    db, error = call(lambda: grouped_dbias(dy, split.value, num_groups=groups, backend=backend))
    if check_splits_outcome(split, backend, error, case):
        assert db.shape == (groups, n), case
        assert_close(db, expected_db, dtype, case)


def prop_splits_to_offsets(data, device):
    backend = data.draw(st.sampled_from(backends_for(device)), label="backend")
    groups = data.draw(num_experts(), label="E")
    rows = data.draw(num_tokens(), label="M")
    split = data.draw(splits(rows, groups, device), label="m_splits")
    assume(split.kind not in ("too_short", "too_long"))  # no expert count to be wrong against
    total_rows = data.draw(st.one_of(st.just(rows), st.sampled_from([-1, 2.0])), label="total_rows")
    case = f"{backend=} E={groups} M={rows} {split.kind=} {split.value!r:.80} {total_rows=}"
    offsets, error = call(lambda: splits_to_offsets(split.value, total_rows, device=device, backend=backend))
    if type(total_rows) is not int or total_rows != rows:  # 2.0 == 2 in Python
        expect_error(error, "total_rows", case=case)
        return
    if split.valid:
        expect_ok(error, case)
        expected = torch.tensor([0] + torch.tensor(split.counts).cumsum(0).tolist(), dtype=torch.int64)
        assert torch.equal(offsets.cpu(), expected), case
    elif split.refused_everywhere():
        expect_error(error, "m_splits", case=case)
    else:  # a same-device tensor is clamped (documented): non-decreasing within [0, M]
        expect_ok(error, case)
        assert offsets.shape == (groups + 1,) and int(offsets[0]) == 0, case
        assert bool((offsets[1:] >= offsets[:-1]).all()) and int(offsets[-1]) <= rows, case


def prop_swiglu(data, device):
    backend = data.draw(st.sampled_from(backends_for(device)), label="backend")
    dtypes = [torch.float32, torch.bfloat16] + ([torch.float64] if backend == "reference" else [])
    dtypes += [torch.float16] if device != "cpu" else []
    dtype = data.draw(st.sampled_from(dtypes), label="dtype")
    gen = generator(data)
    leading = data.draw(st.lists(st.integers(0, 3), max_size=2), label="leading dims")
    width = data.draw(st.integers(0, 9), label="last dim")
    h = randn(gen, *leading, width, dtype=dtype, device=device).requires_grad_(True)
    case = f"{backend=} {dtype=} shape={tuple(h.shape)}"
    y, error = call(lambda: swiglu(h, backend=backend))
    if width % 2:
        expect_error(error, "h must have an even last dimension", case=case)
        return
    expect_ok(error, case)
    h64 = h.detach().cpu().double().requires_grad_(True)
    gate, up = h64.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    assert y.shape == expected.shape and y.dtype == dtype, case
    assert_close(y, expected, dtype, case)
    dy = randn(gen, *expected.shape, dtype=dtype, device=device)
    y.backward(dy)
    expected.backward(dy.cpu().double())
    assert_close(h.grad, h64.grad, dtype, case)


test_fprop_dgrad_cpu, test_fprop_dgrad_gpu = fuzz_tests(prop_fprop_dgrad)
test_wgrad_dbias_cpu, test_wgrad_dbias_gpu = fuzz_tests(prop_wgrad_dbias)
test_splits_to_offsets_cpu, test_splits_to_offsets_gpu = fuzz_tests(prop_splits_to_offsets)
test_swiglu_cpu, test_swiglu_gpu = fuzz_tests(prop_swiglu)
