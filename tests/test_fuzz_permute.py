"""Fuzz: permute / unpermute (dropless and with a capacity) against a plain Python oracle (see fuzz_strategies).

The oracle sorts the token copies into per-expert buckets in copy order,
keeps each expert's first ``capacity`` copies (by probability, ties to the
lower copy, or by position), and drops the copies whose expert index is
outside [0, E): the documented rule of the graph-safe backends. Where the
indices are read on the host (the ``reference`` backend, debug checks) such
an index must be refused naming ``experts`` instead.
"""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

import moe_grouped
from moe_grouped import _core, permute, unpermute

from cases import gpu_backends
from fuzz_strategies import (
    assert_close, call, coarser, expect_error, expect_ok, fuzz_tests, generator, num_experts, num_tokens, randn,
)

# One fault per example (None: a valid call); each names the argument at fault.
PERMUTE_FAULTS = {
    "experts_out_of_range": "experts",  # refused only where read on the host; dropped elsewhere
    "top_k_zero": "experts",
    "experts_float": "experts",
    "experts_rows": "experts",
    "experts_list": "experts",
    "num_experts": "num_experts",
    "tokens_int": "tokens",
    "tokens_1d": "tokens",
    "capacity_factor": "capacity_factor",
    "drop_policy": "drop_policy",
    "pad_without_capacity": "pad_to_capacity",
    "probs_missing": "probs",
    "probs_shape": "probs",
}
UNPERMUTE_FAULTS = {
    "row_id_map_int32": "row_id_map",
    "weights_dtype": "weights",
    "top_k_mismatch": "top_k",
    "no_weights_no_top_k": "top_k",
    "weights_rows": "row_id_map",
    "row_out_of_range": "row_id_map",  # refused only where read on the host; dropped by torch; not fuzzed on cuda
}


def permute_backends(device: str) -> list[str]:
    if device == "cpu":
        return ["reference", "torch"]
    return gpu_backends(_core.CAP_PERMUTE, "permute kernels")


def token_dtypes(backend: str) -> list[torch.dtype]:
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    return dtypes if backend == "cuda" else dtypes + [torch.float64]


def oracle_index(experts: list[list[int]], num_experts: int, probs, capacity, pad):
    """(row_id_map, m_splits, rows) by buckets, out-of-range indices dropped."""
    tokens = len(experts)
    top_k = len(experts[0]) if tokens else 0
    buckets = [[] for _ in range(num_experts)]
    for t in range(tokens):
        for j in range(top_k):
            if 0 <= experts[t][j] < num_experts:
                buckets[experts[t][j]].append(t * top_k + j)
    if capacity is not None:
        if probs is not None:
            p = [v for row in probs for v in row]
            buckets = [sorted(sorted(b, key=lambda c: (-p[c], c))[:capacity]) for b in buckets]
        else:
            buckets = [b[:capacity] for b in buckets]
    row_id_map = [-1] * (tokens * top_k)
    row = 0
    for e, bucket in enumerate(buckets):
        if pad:
            row = e * capacity
        for copy in bucket:
            row_id_map[copy] = row
            row += 1
    m_splits = [capacity if pad else len(b) for b in buckets]
    copies = tokens * top_k
    rows = copies if capacity is None else (num_experts * capacity if pad else min(copies, num_experts * capacity))
    return row_id_map, m_splits, rows


def draw_routing(data, gen, device, backend, fault):
    """(tokens, experts tensor, E, top_k, probs, options) honest except for ``fault``."""
    dtype = data.draw(st.sampled_from(token_dtypes(backend)), label="dtype")
    groups = data.draw(num_experts(), label="E")
    count = data.draw(num_tokens(), label="T")
    top_k = data.draw(st.integers(1, 4), label="top_k")
    hidden = data.draw(st.integers(1, 9), label="H")
    index_dtype = data.draw(st.sampled_from([torch.int32, torch.int64]), label="index dtype")
    experts = torch.randint(groups, (count, top_k), generator=gen)
    if fault == "experts_out_of_range" and count:
        bad = data.draw(st.sampled_from([-1, -7, groups, groups + 5]), label="bad index")
        where = torch.rand(count, top_k, generator=gen) < 0.4
        where[data.draw(st.integers(0, count - 1), label="bad token"), 0] = True
        experts = torch.where(where, torch.tensor(bad), experts)
    # Probabilities from a few values, so that ties (broken by copy order) happen.
    probs = torch.tensor([0.125, 0.25, 0.5, 0.75])[torch.randint(4, (count, top_k), generator=gen)]
    capacity_factor = data.draw(st.sampled_from([None, None, 0.0, 0.25, 1.0, 1.5, 4.0]), label="capacity_factor")
    policy = data.draw(st.sampled_from(["probs", "position"]), label="drop_policy")
    pad = capacity_factor is not None and data.draw(st.booleans(), label="pad_to_capacity")
    give_probs = data.draw(st.booleans(), label="give probs") or (capacity_factor is not None and policy == "probs")
    options = dict(capacity_factor=capacity_factor, drop_policy=policy, pad_to_capacity=pad,
                   probs=probs.to(device) if give_probs else None)
    tokens = randn(gen, count, hidden, dtype=dtype, device=device)
    experts = experts.to(dtype=index_dtype, device=device)
    if fault == "top_k_zero":
        experts = experts[:, :0]
    elif fault == "experts_float":
        experts = experts.float()
    elif fault == "experts_rows":
        experts = torch.cat([experts, torch.zeros(1, top_k, dtype=index_dtype, device=device)])
    elif fault == "experts_list":
        experts = experts.tolist()
    elif fault == "num_experts":
        groups = data.draw(st.sampled_from([0, -2, True, 2.0]), label="bad E")
    elif fault == "tokens_int":
        tokens = tokens.to(torch.int64)
    elif fault == "tokens_1d":
        tokens = tokens.reshape(-1)
    elif fault == "capacity_factor":
        options["capacity_factor"] = data.draw(st.sampled_from([-1.0, float("nan"), float("inf"), "1"]), label="bad cf")
    elif fault == "drop_policy":
        options["drop_policy"] = "random"
    elif fault == "pad_without_capacity":
        options.update(capacity_factor=None, pad_to_capacity=True)
    elif fault == "probs_missing":
        options.update(capacity_factor=1.0, drop_policy="probs", probs=None)
    elif fault == "probs_shape":
        options.update(capacity_factor=1.0, drop_policy="probs", probs=torch.rand(count, top_k + 1, device=device))
    return tokens, experts, groups, top_k, options, probs


def prop_permute_unpermute(data, device):
    backend = data.draw(st.sampled_from(permute_backends(device)), label="backend")
    fault = data.draw(st.sampled_from([None] * 13 + list(PERMUTE_FAULTS)), label="permute fault")
    debug = fault == "experts_out_of_range" and data.draw(st.booleans(), label="debug checks")
    gen = generator(data)
    tokens, experts, groups, top_k, options, probs = draw_routing(data, gen, device, backend, fault)
    case = f"{backend=} {fault=} {debug=} E={groups} {top_k=} tokens={tuple(tokens.shape)} {tokens.dtype} " + (
        f"cf={options['capacity_factor']} {options['drop_policy']} pad={options['pad_to_capacity']}"
    )
    x = tokens.clone().requires_grad_(tokens.is_floating_point())
    previous = moe_grouped.debug_checks_enabled()
    moe_grouped.set_debug_checks(debug)
    try:
        result, error = call(lambda: permute(x, experts, groups, backend=backend, **options))
    finally:
        moe_grouped.set_debug_checks(previous)
    refused = fault is not None and (fault != "experts_out_of_range" or backend == "reference" or debug)
    if fault == "experts_out_of_range" and tokens.shape[0] == 0:
        refused = False  # no token, no index to be wrong
    if refused:
        expect_error(error, PERMUTE_FAULTS[fault], case=case)
        return
    expect_ok(error, case)
    permuted, m_splits, row_id_map = result
    cf = options["capacity_factor"]
    count = tokens.shape[0]
    capacity = None if cf is None else math.ceil(count * top_k / groups * cf)
    by_probs = cf is not None and options["drop_policy"] == "probs"
    want_map, want_splits, rows = oracle_index(
        experts.cpu().tolist(), groups, probs.tolist() if by_probs else None, capacity, options["pad_to_capacity"]
    )
    assert row_id_map.dtype == torch.int64 and row_id_map.device == tokens.device, case
    assert row_id_map.cpu().tolist() == want_map, case
    assert m_splits.dtype == torch.int64 and m_splits.cpu().tolist() == want_splits, case
    assert permuted.shape == (rows, tokens.shape[1]) and permuted.dtype == tokens.dtype, case
    expected = torch.zeros(rows, tokens.shape[1], dtype=tokens.dtype)
    for copy, row in enumerate(want_map):
        if row >= 0:
            expected[row] = tokens[copy // top_k].cpu()
    # Dropless, the rows past sum(m_splits) (left by out-of-range copies) belong to no expert.
    checked = rows if cf is not None else sum(want_splits)
    assert torch.equal(permuted.detach().cpu()[:checked], expected[:checked]), case
    grad = randn(gen, *permuted.shape, dtype=tokens.dtype, device=device)
    permuted.backward(grad)
    expected_dx = torch.zeros(tokens.shape, dtype=torch.float64)
    for copy, row in enumerate(want_map):
        if row >= 0:
            expected_dx[copy // top_k] += grad[row].cpu().double()
    assert_close(x.grad, expected_dx, tokens.dtype, case)
    check_unpermute(data, gen, device, backend, row_id_map, want_map, rows, count, top_k, tokens.dtype, case)


def check_unpermute(data, gen, device, backend, row_id_map, want_map, rows, count, top_k, dtype, case):
    faults = [None] * 4 + [f for f in UNPERMUTE_FAULTS if not (f == "row_out_of_range" and backend == "cuda")]
    fault = data.draw(st.sampled_from(faults), label="unpermute fault")
    weights_dtype = data.draw(st.sampled_from([None, torch.float32, dtype]), label="weights dtype")
    hidden = data.draw(st.integers(1, 9), label="unpermute H")
    y = randn(gen, rows, hidden, dtype=dtype, device=device).requires_grad_(True)
    w = None
    if weights_dtype is not None:
        w = torch.rand(count, top_k, generator=gen).to(dtype=weights_dtype, device=device).requires_grad_(True)
    top_k_arg = top_k if w is None or data.draw(st.booleans(), label="pass top_k") else None
    mapping = list(want_map)
    if fault == "row_id_map_int32":
        row_id_map = row_id_map.int()
    elif fault == "weights_dtype":
        wrong = torch.bfloat16 if dtype == torch.float64 else torch.float64  # neither float32 nor permuted's
        w = torch.rand(count, top_k, generator=gen).to(dtype=wrong, device=device)
    elif fault == "top_k_mismatch":
        w = torch.rand(count, top_k, generator=gen).to(device)
        top_k_arg = top_k + 1
    elif fault == "no_weights_no_top_k":
        w, top_k_arg = None, None
    elif fault == "weights_rows":
        w = torch.rand(count + 1, top_k, generator=gen).to(device)
    elif fault == "row_out_of_range":
        if count == 0:
            fault = None  # no entry to spoil
        else:
            copy = data.draw(st.integers(0, count * top_k - 1), label="bad copy")
            mapping[copy] = data.draw(st.sampled_from([-2, -9, rows, rows + 3]), label="bad row")
            row_id_map = torch.tensor(mapping, dtype=torch.int64, device=device)
            mapping[copy] = -1  # the torch backend's rule: such a copy adds nothing
    case = f"{case} | unpermute {fault=} weights={weights_dtype} top_k_arg={top_k_arg} H={hidden}"
    out, error = call(lambda: unpermute(y, row_id_map, w, top_k=top_k_arg, backend=backend))
    if fault is not None and not (fault == "row_out_of_range" and backend == "torch"):
        expect_error(error, UNPERMUTE_FAULTS[fault], case=case)
        return
    expect_ok(error, case)
    assert out.shape == (count, hidden) and out.dtype == dtype, case
    y64 = y.detach().cpu().double()
    w64 = None if w is None else w.detach().cpu().double()
    expected = torch.zeros(count, hidden, dtype=torch.float64)
    for copy, row in enumerate(mapping):
        if row >= 0:
            expected[copy // top_k] += y64[row] * (1.0 if w64 is None else w64[copy // top_k, copy % top_k])
    tol = coarser(dtype, weights_dtype)
    assert_close(out, expected, tol, case)
    dout = randn(gen, count, hidden, dtype=dtype, device=device)
    out.backward(dout)
    d64 = dout.cpu().double()
    expected_dy = torch.zeros(rows, hidden, dtype=torch.float64)
    expected_dw = torch.zeros(count, top_k, dtype=torch.float64)
    for copy, row in enumerate(mapping):
        if row >= 0:
            t, j = divmod(copy, top_k)
            expected_dy[row] = d64[t] * (1.0 if w64 is None else w64[t, j])
            expected_dw[t, j] = d64[t] @ y64[row]
    assert_close(y.grad, expected_dy, tol, case)
    if w is not None:
        assert w.grad.dtype == w.dtype, case
        assert_close(w.grad, expected_dw, tol, case)


test_permute_unpermute_cpu, test_permute_unpermute_gpu = fuzz_tests(prop_permute_unpermute)
