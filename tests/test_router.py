"""Router semantics against hand computations on tiny cases."""

import math

import pytest
import torch

from moe_grouped import Router
from moe_grouped.router import tokens_per_expert
from moe_grouped.routing import router_logits
from moe_grouped.routing.torch_backend import _split_bf16


def router_with_logits(num_experts, top_k, **options):
    """A router whose logits equal its input (gate weight = identity)."""
    router = Router(num_experts, num_experts, top_k, dtype=torch.float64, **options)
    with torch.no_grad():
        router.weight.copy_(torch.eye(num_experts, dtype=torch.float64))
    return router


def softmax(values):
    exps = [math.exp(v) for v in values]
    return [e / sum(exps) for e in exps]


def sigmoid(v):
    return 1 / (1 + math.exp(-v))


LOGITS = [1.0, 2.0, 3.0, 0.0]


def route(router, rows):
    return router(torch.tensor(rows, dtype=torch.float64))


def assert_weights(actual, expected):
    assert torch.allclose(actual.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6), (
        f"weights {actual.tolist()} != {expected}"
    )


@pytest.mark.parametrize("normalize", [True, False])
def test_softmax_then_topk(normalize):
    out = route(router_with_logits(4, 2, normalize_topk=normalize), [LOGITS])
    probs = softmax(LOGITS)
    assert out.experts.tolist() == [[2, 1]]
    expected = [probs[2], probs[1]]
    if normalize:  # Mixtral: renormalise the chosen probabilities
        expected = [p / sum(expected) for p in expected]
    assert_weights(out.weights, [expected])
    assert out.weights.dtype == torch.float64  # float64 input keeps float64


def test_low_precision_gates_route_in_float32():
    router = Router(8, 4, 2, dtype=torch.bfloat16)
    out = router(torch.randn(5, 8, dtype=torch.bfloat16))
    assert out.logits.dtype == out.weights.dtype == out.aux_loss.dtype == torch.float32
    assert out.experts.dtype == out.tokens_per_expert.dtype == torch.int64


def test_topk_then_softmax_ignores_the_other_logits():
    out = route(router_with_logits(4, 2, topk_before_softmax=True, normalize_topk=False), [LOGITS])
    assert out.experts.tolist() == [[2, 1]]
    assert_weights(out.weights, [softmax([3.0, 2.0])])


def test_sigmoid_bias_changes_the_choice_but_not_the_weights():
    router = router_with_logits(4, 2, score_function="sigmoid", expert_bias=True, scaling_factor=2.5)
    plain = route(router, [LOGITS])
    assert plain.experts.tolist() == [[2, 1]]
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([0.0, 0.0, -1.0, 0.6]))
    biased = route(router, [LOGITS])
    # Choice scores sigmoid + bias = [0.73, 0.88, -0.05, 1.1]: experts 3 then 1.
    assert biased.experts.tolist() == [[3, 1]]
    scores = [sigmoid(LOGITS[3]), sigmoid(LOGITS[1])]  # the bias is not in the weights
    assert_weights(biased.weights, [[2.5 * s / sum(scores) for s in scores]])


def test_group_limited_routing_keeps_tokens_in_their_best_groups():
    logits = [2.0, 1.5, 3.0, -3.0]
    free = route(router_with_logits(4, 2, score_function="sigmoid"), [logits])
    assert free.experts.tolist() == [[2, 0]]
    # Groups {0, 1} and {2, 3}; group score = sum of its two best scores:
    # 0.88 + 0.82 > 0.95 + 0.05, so only group 0 is allowed.
    limited = route(router_with_logits(4, 2, score_function="sigmoid", n_group=2, topk_group=1), [logits])
    assert limited.experts.tolist() == [[0, 1]]
    scores = [sigmoid(2.0), sigmoid(1.5)]
    assert_weights(limited.weights, [[s / sum(scores) for s in scores]])


def test_aux_loss_z_loss_and_counts_by_hand():
    out = route(router_with_logits(2, 1), [[2.0, 0.0], [1.0, 0.0]])
    assert out.experts.tolist() == [[0], [0]]
    assert out.tokens_per_expert.tolist() == [2, 0]
    mean_p0 = (softmax([2.0, 0.0])[0] + softmax([1.0, 0.0])[0]) / 2
    # E * sum_e f_e * P_e with f = [1, 0]
    assert math.isclose(out.aux_loss.item(), 2 * 1.0 * mean_p0, rel_tol=1e-6)
    lse = [math.log(math.exp(2.0) + 1), math.log(math.exp(1.0) + 1)]
    assert math.isclose(out.z_loss.item(), (lse[0] ** 2 + lse[1] ** 2) / 2, rel_tol=1e-6)
    uniform = route(router_with_logits(2, 1), [[1.0, 0.0], [0.0, 1.0]])
    assert math.isclose(uniform.aux_loss.item(), 1.0, rel_tol=1e-6)


def test_aux_loss_has_a_gradient_through_the_probabilities():
    router = Router(8, 4, 2)
    out = router(torch.randn(16, 8))
    (grad,) = torch.autograd.grad(out.aux_loss, router.weight)
    assert grad.abs().sum() > 0


def test_update_bias_moves_against_the_load():
    router = Router(8, 4, 1, score_function="sigmoid", expert_bias=True)
    router.update_bias(torch.tensor([6, 2, 0, 4]), rate=0.1)  # mean 3
    assert torch.allclose(router.expert_bias, torch.tensor([-0.1, 0.1, 0.1, -0.1]))
    # Default: the counts accumulated by training forwards since the last update.
    router.train()
    x = torch.randn(10, 8)
    counts = router(x).tokens_per_expert + router(x).tokens_per_expert
    assert torch.equal(router.tokens_since_update, counts)
    before = router.expert_bias.clone()
    router.update_bias(rate=0.5)
    expected = before + 0.5 * torch.sign(counts.float().mean() - counts.float())
    assert torch.allclose(router.expert_bias, expected)
    assert router.tokens_since_update.sum() == 0


def test_tokens_per_expert_counts_zero_token_experts():
    experts = torch.tensor([[3, 1], [3, 1], [3, 0]])
    assert tokens_per_expert(experts, 6).tolist() == [1, 2, 0, 3, 0, 0]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"top_k": 5}, "top_k must be at most num_experts=4"),
        ({"score_function": "relu"}, "score_function must be one of"),
        ({"score_function": "sigmoid", "topk_before_softmax": True}, "needs score_function='softmax'"),
        ({"n_group": 2}, "n_group and topk_group go together"),
        ({"n_group": 3, "topk_group": 1}, "divisible by n_group=3"),
        ({"n_group": 4, "topk_group": 1}, "cannot be chosen from topk_group=1"),
    ],
)
def test_invalid_configurations_are_refused(options, message):
    kwargs = {"top_k": 2, **options}
    with pytest.raises(ValueError, match=message):
        Router(8, 4, **kwargs)


def test_update_bias_without_bias_is_refused():
    with pytest.raises(RuntimeError, match="expert_bias=True"):
        Router(8, 4, 1).update_bias(torch.zeros(4))


def test_gate_gradient_split_keeps_sixteen_bits():
    """The backward's bf16 ``[hi | lo]`` halves sum back to the float32 gradient within 2^-16."""
    gen = torch.Generator().manual_seed(0)
    d = torch.randn(64, 32, generator=gen) * 10.0 ** torch.randint(-30, 30, (64, 32), generator=gen)
    halves = _split_bf16(d)
    assert halves.dtype == torch.bfloat16 and halves.shape == (64, 64)
    rebuilt = halves[:, :32].double() + halves[:, 32:].double()
    assert bool(((rebuilt - d.double()).abs() <= d.double().abs() * 2.0**-16).all())
    # hi alone is bf16's 8 bits: the lo half is what carries the rest.
    assert bool(((halves[:, :32].double() - d.double()).abs() > d.double().abs() * 2.0**-16).any())


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,hidden,experts", [(1, 8, 4), (257, 2048, 128), (4096, 1024, 64), (33, 4096, 8)])
def test_bf16_gate_on_tensor_cores_matches_float64(tokens, hidden, experts):
    """bf16 gate on CUDA: float32 logits and bf16 gradients as exact as the float32 GEMMs they replace."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16().requires_grad_(True)
    w = (torch.randn(experts, hidden, device="cuda", generator=gen) * 0.02).bfloat16().requires_grad_(True)
    # Gradients over six decades, as softmax/aux-loss gradients are.
    d = torch.randn(tokens, experts, device="cuda", generator=gen)
    d = d * 10.0 ** (torch.rand(tokens, experts, device="cuda", generator=gen) * 6 - 5)
    logits = router_logits(x, w)
    assert logits.dtype == torch.float32
    logits.backward(d)
    x64, w64, d64 = x.detach().double(), w.detach().double(), d.double()
    # float32 accumulation of exact products: far below 2^-16 of the magnitude.
    bound = x64.abs() @ w64.abs().t() * 2.0**-16
    assert bool(((logits.double() - x64 @ w64.t()).abs() <= bound).all())
    for name, grad, want, magnitude in (
        ("x", x.grad, d64 @ w64, d64.abs() @ w64.abs()),
        ("weight", w.grad, d64.t() @ x64, d64.abs().t() @ x64.abs()),
    ):
        assert grad.dtype == torch.bfloat16
        # One rounding to bf16 (2^-8 relative) plus the split's 2^-16 of the magnitude.
        error = (grad.double() - want).abs()
        assert bool((error <= want.abs() * 2.0**-8 + magnitude * 2.0**-15).all()), f"d{name}: {error.max():.3g}"


@pytest.mark.gpu
def test_router_forward_uses_the_float32_gate_numbers_on_cuda():
    """The router's bf16 logits on CUDA equal the float32 linear of the same bf16 values (to fp32 rounding)."""
    torch.manual_seed(0)
    router = Router(512, 16, 2, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(300, 512, device="cuda").bfloat16()
    out = router(x)
    want = torch.nn.functional.linear(x.float(), router.weight.float())
    torch.testing.assert_close(out.logits, want, rtol=1e-5, atol=1e-5)
