"""The router's expert choice: one ranking rule on every path, and the core kernel equal to it."""

import pytest
import torch

from moe_grouped import _core
from moe_grouped.routing import choose_experts, cuda_backend

from cases import capture_after_a_step, skip_without_cuda_kernels

NAN, INF = float("nan"), float("inf")


def by_hand(scores, top_k):
    """Experts by descending score, ties to the lower expert, NaN above all: sorted() on python floats."""
    def rank(expert_and_score):
        expert, score = expert_and_score
        return (0 if score != score else 1, -score if score == score else 0.0, expert)

    chosen = [[e for e, _ in sorted(enumerate(row), key=rank)[:top_k]] for row in scores.tolist()]
    counts = [0] * scores.shape[1]
    for row in chosen:
        for e in row:
            counts[e] += 1
    return chosen, counts


@pytest.mark.parametrize(
    "rows,top_k",
    [
        ([[1.0, 3.0, 2.0, 0.0]], 2),
        ([[1.0, 1.0, 1.0, 1.0]], 3),  # all tied: lowest experts first
        ([[0.0, -0.0, 0.0, -1.0]], 2),  # -0 ties with +0
        ([[-INF, 2.0, NAN, 5.0, NAN]], 3),  # NaN first, in expert order
        ([[-INF, -INF, -INF]], 3),  # group-limited routing masks with -inf
        ([[5.0, 4.0], [4.0, 5.0], [1.0, 1.0]], 1),
    ],
)
def test_ranking_rule_by_hand(rows, top_k):
    scores = torch.tensor(rows)
    experts, counts = choose_experts(scores, top_k)
    want_experts, want_counts = by_hand(scores, top_k)
    assert experts.dtype == torch.int64 and counts.dtype == torch.int64
    assert experts.tolist() == want_experts
    assert counts.tolist() == want_counts


@pytest.mark.parametrize("num_experts,top_k", [(1, 1), (8, 2), (64, 6), (128, 8), (33, 33)])
def test_random_scores_pick_the_topk_values(num_experts, top_k):
    gen = torch.Generator().manual_seed(num_experts)
    scores = torch.randn(300, num_experts, generator=gen)
    experts, counts = choose_experts(scores, top_k)
    assert torch.equal(scores.gather(1, experts), scores.topk(top_k, dim=-1).values)
    assert torch.equal(counts, torch.bincount(experts.reshape(-1), minlength=num_experts))


def test_no_tokens():
    experts, counts = choose_experts(torch.empty(0, 16), 4)
    assert experts.shape == (0, 4) and counts.tolist() == [0] * 16


def test_float64_and_bf16_scores_use_the_same_rule():
    scores = torch.tensor([[1.0, 2.0, 2.0, NAN, -0.0, 0.0]])
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        experts, _ = choose_experts(scores.to(dtype), 4)
        assert experts.tolist() == [[3, 1, 2, 0]], dtype


def scores_of(pattern, tokens, num_experts, gen):
    scores = torch.randn(tokens, num_experts, device="cuda", generator=gen)
    if pattern == "ties":  # few distinct values: most comparisons are ties
        scores = scores.mul(2).round()
    elif pattern == "nan_inf":
        pick = torch.rand(tokens, num_experts, device="cuda", generator=gen)
        scores = scores.masked_fill(pick < 0.05, NAN).masked_fill(pick > 0.9, -INF).masked_fill(
            (pick > 0.05) & (pick < 0.08), INF
        )
    elif pattern == "constant":
        scores = torch.zeros_like(scores)
    elif pattern == "signed_zero":
        scores = torch.where(scores > 0, torch.zeros_like(scores), torch.full_like(scores, -0.0))
    return scores


@pytest.mark.gpu
@pytest.mark.parametrize("num_experts", [1, 8, 33, 64, 128, 256, 1000, 1024])
@pytest.mark.parametrize("top_k", [1, 2, 8, 32])
@pytest.mark.parametrize("pattern", ["random", "ties", "nan_inf", "constant", "signed_zero"])
def test_kernel_equals_the_stable_sort(num_experts, top_k, pattern):
    """mg_route_topk == the stable descending sort, bitwise, counts included."""
    skip_without_cuda_kernels(_core.CAP_PERMUTE, "routing kernels", entry="mg_route_topk")
    top_k = min(top_k, num_experts)
    gen = torch.Generator(device="cuda").manual_seed(num_experts * 100 + top_k)
    for tokens in (0, 1, 7, 4097):
        scores = scores_of(pattern, tokens, num_experts, gen)
        assert cuda_backend.topk_applies(scores, top_k)
        experts, counts = torch.ops.moe_grouped.route_topk(scores, top_k, True)
        want_experts, want_counts = torch.ops.moe_grouped.route_topk(scores, top_k, False)
        assert torch.equal(experts, want_experts), (tokens, pattern)
        assert torch.equal(counts, want_counts), (tokens, pattern)


@pytest.mark.gpu
def test_kernel_limits_fall_back_to_the_sort():
    skip_without_cuda_kernels(_core.CAP_PERMUTE, "routing kernels", entry="mg_route_topk")
    scores = torch.randn(64, 1025, device="cuda")
    assert not cuda_backend.topk_applies(scores, 8)
    assert not cuda_backend.topk_applies(scores[:, :64].contiguous(), 33)
    assert not cuda_backend.topk_applies(scores.bfloat16(), 8)
    experts, counts = choose_experts(scores, 8)
    assert torch.equal(scores.gather(1, experts), scores.topk(8, dim=-1).values)
    assert int(counts.sum()) == 64 * 8


@pytest.mark.gpu
def test_kernel_refuses_out_of_range_arguments():
    skip_without_cuda_kernels(_core.CAP_PERMUTE, "routing kernels", entry="mg_route_topk")
    scores = torch.randn(4, 8, device="cuda")
    with pytest.raises(ValueError, match="top_k"):
        torch.ops.moe_grouped.route_topk(scores, 9, True)
    with pytest.raises(ValueError, match="num_experts"):
        torch.ops.moe_grouped.route_topk(torch.randn(4, 1025, device="cuda"), 2, True)


@pytest.mark.gpu
def test_kernel_replays_in_a_graph_with_new_scores():
    skip_without_cuda_kernels(_core.CAP_PERMUTE, "routing kernels", entry="mg_route_topk")
    static = torch.randn(2048, 128, device="cuda")
    graph, (experts, counts) = capture_after_a_step(lambda: choose_experts(static, 8))
    for seed in range(20):
        static.copy_(torch.randn(2048, 128, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        want_experts, want_counts = torch.ops.moe_grouped.route_topk(static, 8, False)
        assert torch.equal(experts, want_experts) and torch.equal(counts, want_counts), seed
