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


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("source_single", [True, False], ids=["from_grouped", "from_separate"])
def test_either_layout_loads_into_the_other(source_single, bias):
    source = GroupedLinear(3, 8, 4, bias=bias, single_grouped_weight=source_single)
    target = GroupedLinear(3, 8, 4, bias=bias, single_grouped_weight=not source_single)
    state = source.state_dict()
    target.load_state_dict(state)
    assert set(state) == set(source.state_dict())  # the caller's dict is not rewritten
    x = torch.randn(12, 8)
    assert torch.equal(source(x, [5, 0, 7]), target(x, [5, 0, 7]))
    for w_source, w_target in zip(source.weights(), target.weights()):
        assert w_target.data_ptr() != w_source.data_ptr()  # copied, not shared


def test_layout_conversion_refuses_a_state_dict_of_other_experts():
    # Three experts' weights do not fill four: the usual missing/unexpected-key error, no partial load.
    for source_single in (True, False):
        source = GroupedLinear(3, 8, 4, single_grouped_weight=source_single)
        target = GroupedLinear(4, 8, 4, single_grouped_weight=not source_single)
        with pytest.raises(RuntimeError, match="Missing key"):
            target.load_state_dict(source.state_dict())
    source = GroupedLinear(3, 8, 4, single_grouped_weight=True)
    target = GroupedLinear(3, 8, 5, single_grouped_weight=False)
    with pytest.raises(RuntimeError, match="size mismatch"):
        target.load_state_dict(source.state_dict())


def test_moe_layer_loads_a_per_expert_checkpoint():
    torch.manual_seed(0)
    from moe_grouped import MoELayer

    old = MoELayer(8, 6, 4, 2, single_grouped_weight=False)
    new = MoELayer(8, 6, 4, 2)
    assert new.experts.fc1.single_grouped_weight  # the default
    new.load_state_dict(old.state_dict())
    x = torch.randn(10, 8)
    torch.testing.assert_close(new(x), old(x), rtol=0, atol=1e-6)


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
