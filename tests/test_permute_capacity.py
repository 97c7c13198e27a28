"""Expert capacity (token dropping): a hand-worked example, a per-token loop oracle, gradients,
zero capacity, the cuda kernels and capture."""

import math

import pytest
import torch

from moe_grouped import permute, unpermute
from moe_grouped.permute import CUDA_MAX_EXPERTS, expert_capacity, permuted_rows

from cases import capture_after_a_step
from test_permute import ROUTINGS, check_backend_against_reference, gpu_backends, make_experts

# A hand-worked example: 6 tokens, top-2 of 3 experts; copy i = 2 * t + j.
#   expert 0: copies 0 (p .6), 2 (.7), 5 (.5), 6 (.9), 10 (.55)
#   expert 1: copies 1 (.4), 4 (.5), 7 (.1), 9 (.2)
#   expert 2: copies 3 (.3), 8 (.8), 11 (.45)
HAND_EXPERTS = [[0, 1], [0, 2], [1, 0], [0, 1], [2, 1], [0, 2]]
HAND_PROBS = [[0.6, 0.4], [0.7, 0.3], [0.5, 0.5], [0.9, 0.1], [0.8, 0.2], [0.55, 0.45]]
HAND_CASES = {
    # capacity_factor 0.5: capacity ceil(12 / 3 * 0.5) = 2.
    # By position each expert keeps its first two copies.
    ("position", 0.5, False): ([0, 2, 1, 4, 3, -1, -1, -1, 5, -1, -1, -1], [2, 2, 2], 6),
    # By probability: expert 0 keeps 6 and 2, expert 1 keeps 4 and 1, expert 2 keeps 8 and 11;
    # rows stay in token order within each expert.
    ("probs", 0.5, False): ([-1, 2, 0, -1, 3, -1, 1, -1, 4, -1, -1, 5], [2, 2, 2], 6),
    # capacity_factor 1: capacity 4, padded. Expert 0 drops copy 5 (the lowest, .5); expert 2
    # has 3 copies and one padding row (11).
    ("probs", 1.0, True): ([0, 4, 1, 8, 5, -1, 2, 6, 9, 7, 3, 10], [4, 4, 4], 12),
    # By position expert 0 drops its last copy, 10.
    ("position", 1.0, True): ([0, 4, 1, 8, 5, 2, 3, 6, 9, 7, -1, 10], [4, 4, 4], 12),
}


def capacity_oracle(experts, probs, num_experts, capacity, policy, pad):
    """Per-expert loops over (token, choice): (row of each copy or -1, m_splits, rows)."""
    experts = experts.tolist()
    probs = probs.float().tolist() if probs is not None else None  # ranked in float32, like the ops
    tokens, top_k = len(experts), len(experts[0]) if experts else 0
    rows, splits, next_row = {}, [], 0
    for e in range(num_experts):
        mine = [(t, j) for t in range(tokens) for j in range(top_k) if experts[t][j] == e]
        ranked = sorted(mine, key=lambda c: (-probs[c[0]][c[1]], c)) if policy == "probs" else mine
        kept = set(ranked[:capacity])
        if pad:
            next_row = e * capacity
        for copy in mine:  # token order
            if copy in kept:
                rows[copy] = next_row
                next_row += 1
        splits.append(capacity if pad else len(kept))
    row_list = [rows.get((t, j), -1) for t in range(tokens) for j in range(top_k)]
    total = num_experts * capacity if pad else min(tokens * top_k, num_experts * capacity)
    return row_list, splits, total


def combine_oracle(x_rows, row_list, weights, tokens, top_k):
    out = torch.zeros(tokens, x_rows.shape[1], dtype=torch.float64)
    for t in range(tokens):
        for j in range(top_k):
            row = row_list[t * top_k + j]
            if row >= 0:
                out[t] += float(weights[t, j]) * x_rows[row].double().cpu()
    return out


def test_expert_capacity_is_megatrons_formula():
    assert expert_capacity(6, 2, 3, 0.5) == 2
    assert expert_capacity(6, 2, 3, 1.0) == 4
    assert expert_capacity(10, 1, 4, 1.0) == 3  # ceil(2.5)
    assert expert_capacity(16, 2, 8, 0) == 0
    assert expert_capacity(0, 2, 8, 1.5) == 0
    assert expert_capacity(4096, 8, 128, 1.25) == math.ceil(4096 * 8 / 128 * 1.25)
    assert permuted_rows(6, 2, 3, None) == 12
    assert permuted_rows(6, 2, 3, 2) == 6
    assert permuted_rows(6, 2, 3, 8) == 12
    assert permuted_rows(6, 2, 3, 8, pad_to_capacity=True) == 24


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("case", sorted(HAND_CASES), ids=str)
def test_hand_worked_example(backend, case):
    policy, factor, pad = case
    rows, splits, total = HAND_CASES[case]
    experts, probs = torch.tensor(HAND_EXPERTS), torch.tensor(HAND_PROBS)
    x = torch.arange(1.0, 7.0).unsqueeze(1) * torch.ones(6, 3)  # token t is all t + 1
    permuted, m_splits, row_id_map = permute(
        x, experts, 3, probs=probs, capacity_factor=factor, drop_policy=policy, pad_to_capacity=pad,
        backend=backend,
    )
    assert row_id_map.tolist() == rows and m_splits.tolist() == splits and permuted.shape == (total, 3)
    assert (rows, splits, total) == capacity_oracle(experts, probs, 3, expert_capacity(6, 2, 3, factor), policy, pad)
    expected = torch.zeros(total, 3)
    for copy, row in enumerate(rows):
        if row >= 0:
            expected[row] = copy // 2 + 1
    assert torch.equal(permuted, expected), f"{backend=} {case=}"  # padding rows are zero
    out = unpermute(permuted, row_id_map, probs, backend=backend)
    kept = (torch.tensor(rows) >= 0).view(6, 2).float()
    assert torch.allclose(out, x * (probs * kept).sum(1, keepdim=True)), f"{backend=} {case=}"


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_ties_in_probability_keep_the_lower_token(backend):
    experts = torch.zeros(5, 1, dtype=torch.int64)
    probs = torch.tensor([[0.5], [0.5], [0.7], [0.5], [-0.0]])
    _, m_splits, row_id_map = permute(
        torch.randn(5, 2), experts, 2, probs=probs, capacity_factor=1.2, backend=backend  # capacity 3
    )
    assert row_id_map.tolist() == [0, 1, 2, -1, -1] and m_splits.tolist() == [3, 0]


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True], ids=["packed", "padded"])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("top_k", [1, 3])
def test_matches_the_loop_oracle(backend, policy, pad, routing, top_k):
    tokens, hidden, num_experts = 19, 5, 7
    for factor in (0.0, 0.3, 1.0, 1.5, 10.0):
        gen = torch.Generator().manual_seed(int(factor * 10) + top_k)
        x = torch.randn(tokens, hidden, generator=gen)
        experts = make_experts(routing, tokens, top_k, num_experts, seed=int(factor * 10))
        probs = torch.rand(tokens, top_k, generator=gen)
        probs[::3] = 0.25  # some ties
        capacity = expert_capacity(tokens, top_k, num_experts, factor)
        rows, splits, total = capacity_oracle(experts, probs, num_experts, capacity, policy, pad)
        permuted, m_splits, row_id_map = permute(
            x, experts, num_experts, probs=probs, capacity_factor=factor, drop_policy=policy,
            pad_to_capacity=pad, backend=backend,
        )
        case = f"{backend=} {policy=} {pad=} {routing=} {top_k=} {factor=}"
        assert row_id_map.tolist() == rows, case
        assert m_splits.tolist() == splits, case
        assert permuted.shape == (total, hidden), case
        assert max(splits, default=0) <= capacity, case
        for copy, row in enumerate(rows):
            if row >= 0:
                assert torch.equal(permuted[row], x[copy // top_k]), case
        unused = torch.ones(total, dtype=torch.bool)
        unused[[r for r in rows if r >= 0]] = False
        assert not permuted[unused].any(), case
        y = torch.randn(total, hidden, generator=gen)
        out = unpermute(y, row_id_map, probs, backend=backend)
        assert torch.allclose(out.double(), combine_oracle(y, rows, probs, tokens, top_k), atol=1e-5), case


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_a_large_capacity_drops_nothing(backend):
    tokens, num_experts, top_k = 40, 6, 2
    x = torch.randn(tokens, 4)
    experts = make_experts("all_to_one", tokens, top_k, num_experts, seed=2)
    probs = torch.rand(tokens, top_k)
    dropless = permute(x, experts, num_experts, backend=backend)
    for policy in ("probs", "position"):
        capped = permute(
            x, experts, num_experts, probs=probs, capacity_factor=num_experts, drop_policy=policy, backend=backend
        )
        for a, b in zip(dropless, capped):
            assert torch.equal(a, b), f"{backend=} {policy=}"


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("pad", [False, True], ids=["packed", "padded"])
def test_zero_capacity_drops_every_copy(backend, pad):
    tokens, hidden, num_experts, top_k = 8, 3, 4, 2
    x = torch.randn(tokens, hidden, dtype=torch.float64, requires_grad=True)
    experts = make_experts("random", tokens, top_k, num_experts)
    weights = torch.rand(tokens, top_k, dtype=torch.float64, requires_grad=True)
    permuted, m_splits, row_id_map = permute(
        x, experts, num_experts, probs=weights, capacity_factor=0.0, pad_to_capacity=pad, backend=backend
    )
    assert permuted.shape == (0, hidden) and m_splits.tolist() == [0] * num_experts
    assert row_id_map.tolist() == [-1] * (tokens * top_k)
    out = unpermute(permuted * 2, row_id_map, weights, backend=backend)
    assert out.shape == (tokens, hidden) and not out.any()
    out.sum().backward()
    assert not x.grad.any() and not weights.grad.any()


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_no_tokens_with_a_capacity(backend):
    for pad in (False, True):
        permuted, m_splits, row_id_map = permute(
            torch.zeros(0, 4), torch.zeros(0, 2, dtype=torch.int64), 3, probs=torch.zeros(0, 2),
            capacity_factor=1.0, pad_to_capacity=pad, backend=backend,
        )
        assert permuted.shape == (0, 4) and m_splits.tolist() == [0, 0, 0] and row_id_map.numel() == 0
        assert unpermute(permuted, row_id_map, torch.zeros(0, 2), backend=backend).shape == (0, 4)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True], ids=["packed", "padded"])
def test_gradcheck_with_dropping(backend, policy, pad):
    tokens, hidden, num_experts, top_k = 7, 3, 3, 2
    experts = make_experts("all_to_one", tokens, top_k, num_experts, seed=4)
    probs = torch.rand(tokens, top_k, dtype=torch.float64)
    options = dict(probs=probs, capacity_factor=0.6, drop_policy=policy, pad_to_capacity=pad, backend=backend)
    x = torch.randn(tokens, hidden, dtype=torch.float64, requires_grad=True)
    permuted, _, row_id_map = permute(x.detach(), experts, num_experts, **options)
    assert (row_id_map < 0).any(), "the case must drop copies"
    y = torch.randn(permuted.shape, dtype=torch.float64, requires_grad=True)
    weights = probs.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: permute(t, experts, num_experts, **options)[0], (x,))
    assert torch.autograd.gradcheck(lambda a, w: unpermute(a, row_id_map, w, backend=backend), (y, weights))
    assert torch.autograd.gradcheck(lambda a: unpermute(a, row_id_map, top_k=top_k, backend=backend), (y,))
    # A dropped copy's weight gets no gradient; padding rows get none either.
    unpermute(y, row_id_map, weights, backend=backend).sum().backward()
    dropped = (row_id_map < 0).view(tokens, top_k)
    assert not weights.grad[dropped].any()
    used = torch.zeros(permuted.shape[0], dtype=torch.bool)
    used[row_id_map[row_id_map >= 0]] = True
    assert not y.grad[~used].any()


def test_ops_with_capacity_pass_opcheck():
    experts = make_experts("all_to_one", 9, 2, 4)
    probs = torch.rand(9, 2)
    for args in ((experts, probs, 4, 3, False, "torch"), (experts, None, 4, 3, True, "torch"), (experts, probs, 4, 0, True, "torch")):
        torch.library.opcheck(torch.ops.moe_grouped.permute_index, args)
    row_id_map, _ = torch.ops.moe_grouped.permute_index(experts, probs, 4, 3, True, "torch")
    x = torch.randn(9, 5, requires_grad=True)
    torch.library.opcheck(torch.ops.moe_grouped.permute_rows, (x, row_id_map, 2, 12, True, "torch"))
    y, w = torch.randn(12, 5, requires_grad=True), torch.rand(9, 2, requires_grad=True)
    torch.library.opcheck(torch.ops.moe_grouped.unpermute_rows, (y, row_id_map, w, 2, "torch"))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(capacity_factor=-1.0), ValueError, "capacity_factor must be"),
        (dict(capacity_factor=float("nan")), ValueError, "capacity_factor must be"),
        (dict(capacity_factor=True), ValueError, "capacity_factor must be"),
        (dict(capacity_factor=1.0), ValueError, "drop_policy='probs' needs probs"),
        (dict(capacity_factor=1.0, drop_policy="random"), ValueError, "drop_policy must be"),
        (dict(pad_to_capacity=True), ValueError, "needs a capacity_factor"),
        (dict(capacity_factor=1.0, probs=torch.rand(4, 2)), ValueError, r"probs must have experts' shape \(4, 1\)"),
    ],
)
def test_bad_capacity_arguments_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        permute(torch.randn(4, 2), torch.zeros(4, 1, dtype=torch.int64), 2, **kwargs)


# ---- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True], ids=["packed", "padded"])
@pytest.mark.parametrize("tokens", [700, 1500], ids=["one_cta", "four_kernels"])  # the index pass's two forms
def test_gpu_backends_match_the_reference_with_dropping(dtype, routing, policy, pad, tokens):
    hidden, num_experts, top_k = 96, 64, 4
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    experts = make_experts(routing, tokens, top_k, num_experts, seed=5, device="cuda")
    probs = torch.randint(0, 8, (tokens, top_k), device="cuda").float() / 8  # many ties
    dout = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    for factor in (0.0, 0.5, 1.0, 2.0):
        options = dict(probs=probs, capacity_factor=factor, drop_policy=policy, pad_to_capacity=pad)
        reference = permute(x, experts, num_experts, backend="reference", **options)
        for backend in gpu_backends():
            check_backend_against_reference(backend, x, experts, num_experts, probs, dout, reference,
                                            f"{backend=} {dtype=} {routing=} {policy=} {pad=} {factor=} {tokens=}",
                                            **options)


@pytest.mark.gpu
def test_gpu_many_experts():
    """The cuda index kernels handle up to CUDA_MAX_EXPERTS experts and refuse more by name."""
    hidden, top_k = 8, 2
    # 512 and 513 experts over 2000 copies: the one-CTA index pass's largest E, and the four kernels.
    for tokens, num_experts in ((1000, 512), (1000, 513), (3000, 1025), (3000, CUDA_MAX_EXPERTS)):
        x = torch.randn(tokens, hidden, device="cuda")
        probs = torch.rand(tokens, top_k, device="cuda")
        experts = make_experts("random", tokens, top_k, num_experts, seed=7, device="cuda")
        for options in (dict(), dict(probs=probs, capacity_factor=1.0), dict(capacity_factor=0.5, drop_policy="position")):
            expected = permute(x, experts, num_experts, backend="reference", **options)
            for backend in gpu_backends():
                for a, b in zip(permute(x, experts, num_experts, backend=backend, **options), expected):
                    assert torch.equal(a, b), f"{backend=} {num_experts=} {options=}"
    if "cuda" in gpu_backends():
        experts = torch.zeros(tokens, top_k, dtype=torch.int64, device="cuda")
        with pytest.raises(ValueError, match=f"at most {CUDA_MAX_EXPERTS} experts"):
            permute(x, experts, CUDA_MAX_EXPERTS + 1, backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True], ids=["packed", "padded"])
def test_gpu_capture_with_dropping_replays_new_routing(policy, pad):
    tokens, hidden, num_experts, top_k = 512, 64, 16, 2
    for backend in gpu_backends():
        static_x = torch.randn(tokens, hidden, device="cuda")
        static_experts = make_experts("random", tokens, top_k, num_experts, device="cuda")
        static_w = torch.rand(tokens, top_k, device="cuda")
        options = dict(capacity_factor=0.75, drop_policy=policy, pad_to_capacity=pad, backend=backend)

        def step():
            permuted, m_splits, row_id_map = permute(static_x, static_experts, num_experts, probs=static_w, **options)
            return unpermute(permuted * 2, row_id_map, static_w, backend=backend), m_splits, row_id_map

        graph, (static_out, static_splits, static_map) = capture_after_a_step(step)
        dropped = set()
        for seed, routing in enumerate(ROUTINGS):
            static_experts.copy_(make_experts(routing, tokens, top_k, num_experts, seed=seed, device="cuda"))
            static_x.copy_(torch.randn(tokens, hidden, device="cuda"))
            static_w.copy_(torch.rand(tokens, top_k, device="cuda"))
            graph.replay()
            eager_out, eager_splits, eager_map = step()
            case = f"{backend=} {policy=} {pad=} {routing=}"
            assert torch.equal(static_out, eager_out), case
            assert torch.equal(static_splits, eager_splits), case
            assert torch.equal(static_map, eager_map), case
            _, ref_splits, ref_map = permute(static_x, static_experts, num_experts, probs=static_w,
                                             **{**options, "backend": "reference"})
            assert torch.equal(static_map, ref_map), case
            dropped.add(int((static_map < 0).sum()))
        assert len(dropped) > 1, f"{backend=}: the number of dropped copies never changed between replays"
