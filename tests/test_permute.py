"""permute / unpermute against a per-token loop oracle, round trips, gradients, capture."""

import pytest
import torch

import cases
from moe_grouped import _core, permute, unpermute

ROUTINGS = ("random", "zero_token_experts", "all_to_one", "one_per_expert")


def make_experts(routing, tokens, top_k, num_experts, seed=0, device="cpu"):
    """[tokens, top_k] distinct experts per token following ``routing``."""
    gen = torch.Generator().manual_seed(seed)
    if routing == "all_to_one":  # every token's first choice is expert 1
        rest = torch.stack([torch.randperm(num_experts - 2, generator=gen)[: top_k - 1] + 2 for _ in range(tokens)])
        experts = torch.cat([torch.ones(tokens, 1, dtype=torch.int64), rest], dim=1)
        if top_k == 1:
            experts = torch.ones(tokens, 1, dtype=torch.int64)
    elif routing == "zero_token_experts":  # only the even experts are used
        used = torch.arange(0, num_experts, 2)
        experts = torch.stack([used[torch.randperm(len(used), generator=gen)[:top_k]] for _ in range(tokens)])
    elif routing == "one_per_expert":  # token t goes to experts t, t+1, ... (mod E)
        experts = (torch.arange(tokens).unsqueeze(1) + torch.arange(top_k)) % num_experts
    else:
        experts = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
    return experts.to(device)


def oracle(x, experts, num_experts, y=None, weights=None):
    """Per-token loops in float64: (permuted, m_splits, row of each copy, combined output)."""
    x, experts = x.detach().double().cpu(), experts.cpu()
    tokens, top_k = experts.shape
    rows, copies, counts = {}, [], [0] * num_experts
    for e in range(num_experts):
        for t in range(tokens):
            for j in range(top_k):
                if int(experts[t, j]) == e:
                    rows[(t, j)] = len(copies)
                    copies.append(x[t])
                    counts[e] += 1
    permuted = torch.stack(copies) if copies else x.new_zeros(0, x.shape[1])
    combined = None
    if y is not None:
        y = y.detach().double().cpu()
        combined = torch.zeros(tokens, y.shape[1], dtype=torch.float64)
        for t in range(tokens):
            for j in range(top_k):
                w = 1.0 if weights is None else float(weights[t, j])
                combined[t] += w * y[rows[(t, j)]]
    row_list = [rows[(t, j)] for t in range(tokens) for j in range(top_k)]
    return permuted, counts, row_list, combined


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("top_k", [1, 3])
def test_permute_and_unpermute_match_the_loop_oracle(backend, routing, top_k):
    tokens, hidden, num_experts = 13, 6, 7
    x = torch.randn(tokens, hidden)
    experts = make_experts(routing, tokens, top_k, num_experts)
    permuted, m_splits, row_id_map = permute(x, experts, num_experts, backend=backend)
    y = torch.randn(tokens * top_k, hidden)
    weights = torch.rand(tokens, top_k)
    expected, counts, rows, combined = oracle(x, experts, num_experts, y, weights)
    case = f"{backend=} {routing=} {top_k=}"
    assert torch.equal(permuted, expected.float()), case
    assert m_splits.tolist() == counts and m_splits.dtype == torch.int64, case
    assert row_id_map.tolist() == rows, case
    out = unpermute(y, row_id_map, weights, backend=backend)
    assert torch.allclose(out.double(), combined, atol=1e-5), case


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_round_trip_with_weights_summing_to_one_gives_the_tokens_back(backend):
    tokens, hidden, num_experts, top_k = 32, 8, 5, 2
    x = torch.randn(tokens, hidden, dtype=torch.float64)
    experts = make_experts("random", tokens, top_k, num_experts, seed=3)
    weights = torch.softmax(torch.randn(tokens, top_k, dtype=torch.float64), dim=-1)
    permuted, _, row_id_map = permute(x, experts, num_experts, backend=backend)
    assert torch.allclose(unpermute(permuted, row_id_map, weights, backend=backend), x)
    assert torch.allclose(unpermute(permuted, row_id_map, top_k=top_k, backend=backend), top_k * x)


def test_empty_input_gives_zero_splits():
    for backend in ("reference", "torch"):
        permuted, m_splits, row_id_map = permute(
            torch.zeros(0, 4), torch.zeros(0, 2, dtype=torch.int64), 3, backend=backend
        )
        assert permuted.shape == (0, 4) and m_splits.tolist() == [0, 0, 0] and row_id_map.numel() == 0
        assert unpermute(permuted, row_id_map, torch.zeros(0, 2), backend=backend).shape == (0, 4)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("routing", ["random", "all_to_one"])
def test_gradcheck_in_float64(backend, routing):
    tokens, hidden, num_experts, top_k = 6, 3, 4, 2
    experts = make_experts(routing, tokens, top_k, num_experts, seed=1)
    x = torch.randn(tokens, hidden, dtype=torch.float64, requires_grad=True)
    y = torch.randn(tokens * top_k, hidden, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(tokens, top_k, dtype=torch.float64, requires_grad=True)
    _, _, row_id_map = permute(x.detach(), experts, num_experts, backend=backend)
    assert torch.autograd.gradcheck(lambda t: permute(t, experts, num_experts, backend=backend)[0], (x,))
    assert torch.autograd.gradcheck(lambda a, w: unpermute(a, row_id_map, w, backend=backend), (y, weights))
    assert torch.autograd.gradcheck(lambda a: unpermute(a, row_id_map, top_k=top_k, backend=backend), (y,))


def test_ops_pass_opcheck():
    x = torch.randn(5, 4)
    experts = make_experts("random", 5, 2, 3)
    row_id_map, _ = torch.ops.moe_grouped.permute_index(experts, None, 3, -1, False, "torch")
    torch.library.opcheck(torch.ops.moe_grouped.permute_index, (experts, None, 3, -1, False, "torch"))
    torch.library.opcheck(torch.ops.moe_grouped.permute_rows, (x.requires_grad_(), row_id_map, 2, 10, False, "torch"))
    y, w = torch.randn(10, 4, requires_grad=True), torch.rand(5, 2, requires_grad=True)
    torch.library.opcheck(torch.ops.moe_grouped.unpermute_rows, (y, row_id_map, w, 2, "torch"))


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: permute(torch.randn(4, 2), torch.zeros(3, 1, dtype=torch.int64), 2), ValueError, r"shape \[4, top_k\]"),
        (lambda: permute(torch.randn(4, 2), torch.zeros(4, 1), 2), ValueError, "int32/int64"),
        (lambda: permute(torch.randn(4, 2), torch.zeros(4, 1, dtype=torch.int64), 0), ValueError, "num_experts"),
        (lambda: permute(torch.randn(4, 2), torch.zeros(4, 1, dtype=torch.int64), 2, backend="x"), ValueError, "backend must be"),
        (lambda: permute(torch.randn(4, 2), torch.zeros(4, 1, dtype=torch.int64), 2, backend="cuda"), RuntimeError, "needs CUDA tensors"),
        (lambda: unpermute(torch.randn(4, 2), torch.zeros(3, dtype=torch.int64), torch.rand(2, 2)), ValueError, r"shape \(4,\)"),
        (lambda: unpermute(torch.randn(4, 2), torch.zeros(4, dtype=torch.int64), torch.rand(3, 2)), ValueError, "cover 6 copies"),
        (lambda: unpermute(torch.randn(4, 2), torch.zeros(4, dtype=torch.int64)), ValueError, "top_k must be"),
        (lambda: unpermute(torch.randn(4, 2), torch.zeros(4, dtype=torch.int64), torch.rand(2, 2, dtype=torch.float64)), TypeError, "float32 or permuted"),
    ],
)
def test_bad_arguments_are_refused(call, error, message):
    with pytest.raises(error, match=message):
        call()


def gpu_backends() -> list[str]:
    """The permutation's GPU backends: torch, and cuda where its kernels run."""
    return cases.gpu_backends(_core.CAP_PERMUTE, "permute kernels")


def check_backend_against_reference(backend, x, experts, num_experts, weights, dout, reference, case, **options):
    """``permute(..., **options)`` on ``backend`` is ``reference`` (the reference backend's three results)
    bitwise, with int64 and int32 indices; ``unpermute`` with ``weights`` (forward, and its backward into the
    rows and the weights) and ``permute``'s backward agree with the reference backend's within tolerance."""
    ref_perm, ref_splits, ref_map = reference
    for index_dtype in (torch.int64, torch.int32):
        permuted, m_splits, row_id_map = permute(x, experts.to(index_dtype), num_experts, backend=backend, **options)
        assert torch.equal(row_id_map, ref_map), case
        assert torch.equal(m_splits, ref_splits), case
        assert torch.equal(permuted, ref_perm), case
    y = torch.randn(permuted.shape, device="cuda", dtype=x.dtype, requires_grad=True)
    w = weights.clone().requires_grad_(True)
    out = unpermute(y, row_id_map, w, backend=backend)
    y_ref, w_ref = y.detach().clone().requires_grad_(True), weights.clone().requires_grad_(True)
    expected = unpermute(y_ref, ref_map, w_ref, backend="reference")
    tol = 1e-5 if x.dtype == torch.float32 else 1e-2
    assert torch.allclose(out.float(), expected.float(), atol=tol, rtol=tol), case
    out.backward(dout)
    expected.backward(dout)
    assert torch.allclose(y.grad.float(), y_ref.grad.float(), atol=tol, rtol=tol), case
    assert torch.allclose(w.grad, w_ref.grad, atol=tol * 10, rtol=tol), case
    xg = x.detach().clone().requires_grad_(True)
    permute(xg, experts, num_experts, backend=backend, **options)[0].backward(y.detach())
    xr = x.detach().clone().requires_grad_(True)
    permute(xr, experts, num_experts, backend="reference", **options)[0].backward(y.detach())
    assert torch.allclose(xg.grad.float(), xr.grad.float(), atol=tol, rtol=tol), case


# Copies of the index pass: 2800 run in one CTA (three 1024-copy chunks), 6000 in the four kernels
# (several 256-copy chunks).
INDEX_TOKENS = {"one_cta": 700, "four_kernels": 1500}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("index_pass", INDEX_TOKENS)
def test_gpu_backends_match_the_reference(dtype, routing, index_pass):
    tokens, hidden, num_experts, top_k = INDEX_TOKENS[index_pass], 96, 64, 4
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    experts = make_experts(routing, tokens, top_k, num_experts, seed=5, device="cuda")
    weights = torch.rand(tokens, top_k, device="cuda")
    reference = permute(x, experts, num_experts, backend="reference")
    dout = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    for backend in gpu_backends():
        check_backend_against_reference(backend, x, experts, num_experts, weights, dout, reference,
                                        f"{backend=} {dtype=} {routing=} {index_pass=}")


@pytest.mark.gpu
def test_capture_replays_new_routing():
    tokens, hidden, num_experts, top_k = 512, 64, 16, 2
    for backend in gpu_backends():
        static_x = torch.randn(tokens, hidden, device="cuda")
        static_experts = make_experts("random", tokens, top_k, num_experts, device="cuda")
        static_w = torch.rand(tokens, top_k, device="cuda")

        def step():
            permuted, m_splits, row_id_map = permute(static_x, static_experts, num_experts, backend=backend)
            return unpermute(permuted * 2, row_id_map, static_w, backend=backend), m_splits

        graph, (static_out, static_splits) = cases.capture_after_a_step(step)
        for seed, routing in enumerate(ROUTINGS):
            experts = make_experts(routing, tokens, top_k, num_experts, seed=seed, device="cuda")
            static_experts.copy_(experts)
            static_x.copy_(torch.randn(tokens, hidden, device="cuda"))
            graph.replay()
            eager_out, eager_splits = step()
            assert torch.equal(static_out, eager_out), f"{backend=} {routing=}"
            assert torch.equal(static_splits, eager_splits), f"{backend=} {routing=}"
