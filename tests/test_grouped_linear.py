"""GroupedLinear: forward/backward against the oracle, both weight layouts,
fused wgrad accumulation, delayed wgrad, init and state_dict."""

import pytest
import torch

from moe_grouped import GroupedLinear

from cases import (
    backends_for,
    SPLIT_PATTERNS,
    assert_close_to,
    make_splits,
    oracle_dbias,
    oracle_dgrad,
    oracle_fprop,
    oracle_wgrad,
)


DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def stacked_weight(layer):
    return layer.weight if layer.single_grouped_weight else torch.stack(layer.weights())


def stacked_bias(layer):
    return layer.bias if layer.single_grouped_weight else torch.stack(layer.biases())


def weight_grads(layer, attr="grad"):
    grads = [getattr(w, attr) for w in layer.weights()]
    return grads[0] if layer.single_grouped_weight else torch.stack(grads)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("single_grouped_weight", [True, False], ids=["grouped", "separate"])
@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_backward_matches_oracle(device, single_grouped_weight, pattern, dtype):
    num_experts, total, k, n = 5, 80, 32, 24
    splits = make_splits(pattern, num_experts, total, seed=2)
    for backend in backends_for(device, dtype):
        torch.manual_seed(0)
        layer = GroupedLinear(
            num_experts, k, n, bias=True, single_grouped_weight=single_grouped_weight,
            dtype=dtype, device=device, backend=backend,
        )
        x = torch.randn(total, k, dtype=dtype, device=device, requires_grad=True)
        y = layer(x, torch.tensor(splits, device=device))
        dy = torch.randn_like(y)
        y.backward(dy)
        case = f"{backend=} {single_grouped_weight=} {pattern=} {dtype=}"
        w, b = stacked_weight(layer), stacked_bias(layer)
        assert_close_to(y, oracle_fprop(x, [w], splits, b), dtype, "y " + case)
        assert_close_to(x.grad, oracle_dgrad(dy, [w], splits), dtype, "dx " + case)
        assert_close_to(weight_grads(layer), oracle_wgrad(dy, x, splits), dtype, "dw " + case)
        bias_grad = layer.bias.grad if single_grouped_weight else torch.stack([b.grad for b in layer.biases()])
        assert_close_to(bias_grad, oracle_dbias(dy, splits), dtype, "db " + case)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("single_grouped_weight", [True, False], ids=["grouped", "separate"])
def test_fuse_wgrad_accumulation_adds_into_main_grad(device, single_grouped_weight):
    num_experts, total, k, n = 4, 48, 16, 16
    splits = [20, 0, 28, 0]
    for backend in backends_for(device):
        layer = GroupedLinear(
            num_experts, k, n, bias=False, single_grouped_weight=single_grouped_weight,
            fuse_wgrad_accumulation=True, dtype=torch.bfloat16, device=device, backend=backend,
        )
        starts = []
        for w in layer.weights():
            w.main_grad = torch.randn(w.shape, dtype=torch.float32, device=device)
            starts.append(w.main_grad.clone())
        x = torch.randn(total, k, dtype=torch.bfloat16, device=device)
        dy = torch.randn(total, n, dtype=torch.bfloat16, device=device)
        for _ in range(2):  # two micro-batches accumulate
            layer(x, torch.tensor(splits, device=device)).backward(dy)
        start = starts[0] if single_grouped_weight else torch.stack(starts)
        expected = start.double().cpu() + 2 * oracle_wgrad(dy, x, splits)
        assert_close_to(weight_grads(layer, "main_grad"), expected, torch.bfloat16, backend)
        assert all(w.grad is None for w in layer.weights()), "fused accumulation must not produce .grad"
        assert all(getattr(w, "grad_added_to_main_grad", False) for w in layer.weights())
        result = weight_grads(layer, "main_grad")
        for e in (1, 3):  # experts without tokens keep their main_grad bit for bit
            assert torch.equal(result[e], start[e]), f"{backend}: empty expert {e} changed"


def test_fuse_wgrad_accumulation_without_main_grad_says_what_to_allocate():
    layer = GroupedLinear(2, 8, 8, fuse_wgrad_accumulation=True, backend="reference")
    with pytest.raises(RuntimeError, match="main_grad"):
        layer(torch.randn(4, 8), [2, 2]).sum().backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fuse", [False, True], ids=["grad", "main_grad"])
def test_delay_wgrad_compute_defers_parameter_grads_to_backward_dw(device, fuse):
    num_experts, total, k, n = 3, 30, 16, 8
    splits = [10, 0, 20]
    for backend in backends_for(device, torch.float32):
        layer = GroupedLinear(
            num_experts, k, n, single_grouped_weight=True, delay_wgrad_compute=True,
            fuse_wgrad_accumulation=fuse, device=device, backend=backend,
        )
        if fuse:
            layer.weight.main_grad = torch.zeros_like(layer.weight)
        x = torch.randn(total, k, device=device, requires_grad=True)
        dy = torch.randn(total, n, device=device)
        layer(x, torch.tensor(splits, device=device)).backward(dy)
        assert x.grad is not None
        assert layer.weight.grad is None and layer.bias.grad is None, "wgrad must wait for backward_dw()"
        layer.backward_dw()
        dw = layer.weight.main_grad if fuse else layer.weight.grad
        assert_close_to(dw, oracle_wgrad(dy, x, splits), torch.float32, backend)
        assert_close_to(layer.bias.grad, oracle_dbias(dy, splits), torch.float32, backend)
        with pytest.raises(RuntimeError, match="no deferred"):
            layer.backward_dw()


def test_backward_dw_requires_delay_flag():
    with pytest.raises(RuntimeError, match="delay_wgrad_compute"):
        GroupedLinear(2, 8, 8).backward_dw()


@pytest.mark.parametrize("single_grouped_weight", [True, False])
def test_state_dict_round_trip_and_names(single_grouped_weight):
    a = GroupedLinear(3, 8, 4, single_grouped_weight=single_grouped_weight)
    b = GroupedLinear(3, 8, 4, single_grouped_weight=single_grouped_weight)
    keys = set(a.state_dict())
    expected = {"weight", "bias"} if single_grouped_weight else {f"{p}{e}" for p in ("weight", "bias") for e in range(3)}
    assert keys == expected
    b.load_state_dict(a.state_dict())
    x = torch.randn(12, 8)
    assert torch.equal(a(x, [4, 4, 4]), b(x, [4, 4, 4]))


@pytest.mark.parametrize("single_grouped_weight", [True, False])
def test_init_matches_nn_linear_statistics(single_grouped_weight):
    torch.manual_seed(0)
    layer = GroupedLinear(4, 256, 128, single_grouped_weight=single_grouped_weight)
    bound = 1 / 256**0.5  # kaiming_uniform(a=sqrt(5)) gives U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    w = stacked_weight(layer).detach()
    assert w.abs().max() <= bound and w.abs().max() > 0.95 * bound
    assert abs(w.std().item() - bound / 3**0.5) < 0.02 * bound
    for e in range(1, 4):
        assert not torch.equal(w[0], w[e]), "experts must be initialised independently"
    b = stacked_bias(layer).detach()
    assert b.abs().max() <= bound


def test_single_expert_equals_linear():
    layer = GroupedLinear(1, 16, 8, single_grouped_weight=True)
    linear = torch.nn.Linear(16, 8)
    with torch.no_grad():
        linear.weight.copy_(layer.weight[0])
        linear.bias.copy_(layer.bias[0])
    x = torch.randn(10, 16)
    torch.testing.assert_close(layer(x, [10]), linear(x))
