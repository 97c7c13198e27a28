"""The MoE layer's router and fused experts as one autograd op (moe_grouped.routed_experts).

Every test runs the same layer, inputs and gradients through the one op and through the two ops it
replaces (``routed_experts.enabled = False``) and asserts the same bits: outputs, every gradient and the
routing the layer reports.
"""

import copy

import pytest
import torch

from moe_grouped import MoELayer, fp8, routed_experts
from moe_grouped.routing import SoftmaxRoute

from cases import CAPACITY_OPTIONS, skip_without_cuda_kernels


def _step(layer, x, dout, *, fp8_recipe=None):
    """Forward and backward of ``layer``; returns what they produced, gradients included."""
    layer.zero_grad(set_to_none=True)
    xg = x.detach().clone().requires_grad_(x.requires_grad)
    with fp8.fp8_autocast(fp8_recipe, enabled=fp8_recipe is not None):
        out = layer(xg)
    out.backward(dout)
    if layer.experts.fc1.delay_wgrad_compute:
        layer.backward_dw()
    routing = layer.last_routing
    grads = [xg.grad] + [p.grad for p in layer.parameters()]
    main_grads = [getattr(p, "main_grad", None) for p in layer.parameters()]
    return [out.detach(), routing.weights, routing.experts, routing.tokens_per_expert, routing.aux_loss,
            routing.z_loss, routing.logits] + grads + main_grads


def _both_ways(monkeypatch, layer, x, dout, **step_options):
    """The step through the one op (asserting it ran) and through the two ops."""
    calls = []
    apply = routed_experts.RoutedExpertsFunction.apply

    def counted(*args):
        calls.append(1)
        return apply(*args)

    monkeypatch.setattr(routed_experts.RoutedExpertsFunction, "apply", counted)
    one_op = _step(layer, x, dout, **step_options)
    assert calls, "the layer did not take the one op"
    monkeypatch.setattr(routed_experts, "enabled", False)
    calls.clear()
    two_ops = _step(layer, x, dout, **step_options)
    assert not calls
    return one_op, two_ops


def _assert_same(one_op, two_ops, case):
    for i, (a, b) in enumerate(zip(one_op, two_ops)):
        assert (a is None) == (b is None), f"{case}: value {i} is None one way only"
        if a is not None:
            assert torch.equal(a, b), f"{case}: value {i} differs"


def _layer(capacity="dropless", **options):
    torch.manual_seed(3)
    return MoELayer(64, 96, 8, 2, dtype=torch.bfloat16, device="cuda", backend="cuda",
                    **CAPACITY_OPTIONS[capacity], **options)


@pytest.mark.gpu
@pytest.mark.parametrize("capacity", sorted(CAPACITY_OPTIONS))
@pytest.mark.parametrize("losses", [False, True])
@pytest.mark.parametrize("single", [True, False])
def test_gpu_one_op_gives_the_two_ops_bits(monkeypatch, capacity, losses, single):
    skip_without_cuda_kernels()
    coeffs = dict(aux_loss_coeff=0.01, z_loss_coeff=0.001) if losses else {}
    layer = _layer(capacity, single_grouped_weight=single, **coeffs)
    x = torch.randn(96, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dout = torch.randn(96, 64, dtype=torch.bfloat16, device="cuda")
    one_op, two_ops = _both_ways(monkeypatch, layer, x, dout)
    _assert_same(one_op, two_ops, f"{capacity=} {losses=} {single=}")
    assert one_op[7] is not None and one_op[8] is not None  # x's and the gate's gradients exist


@pytest.mark.gpu
@pytest.mark.parametrize("frozen", ["x", "gate", "experts", "gate and x"])
def test_gpu_one_op_without_some_gradients(monkeypatch, frozen):
    """Inputs without gradient get none, the others the two ops' bits."""
    skip_without_cuda_kernels()
    layer = _layer(aux_loss_coeff=0.01)
    if "gate" in frozen:
        layer.router.weight.requires_grad_(False)
    if frozen == "experts":
        for p in layer.experts.parameters():
            p.requires_grad_(False)
    x = torch.randn(96, 64, dtype=torch.bfloat16, device="cuda", requires_grad="x" not in frozen)
    dout = torch.randn(96, 64, dtype=torch.bfloat16, device="cuda")
    one_op, two_ops = _both_ways(monkeypatch, layer, x, dout)
    _assert_same(one_op, two_ops, frozen)
    assert (one_op[7] is None) == ("x" in frozen)


@pytest.mark.gpu
@pytest.mark.parametrize("wgrad", ["delay_wgrad_compute", "fuse_wgrad_accumulation"])
def test_gpu_one_op_with_deferred_or_accumulated_weight_gradients(monkeypatch, wgrad):
    skip_without_cuda_kernels()
    layer = _layer(**{wgrad: True})
    if wgrad == "fuse_wgrad_accumulation":
        for p in layer.experts.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device="cuda")
    x = torch.randn(96, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dout = torch.randn(96, 64, dtype=torch.bfloat16, device="cuda")
    start = copy.deepcopy([getattr(p, "main_grad", None) for p in layer.experts.parameters()])
    one_op = _step_resetting(layer, x, dout, start, monkeypatch, enabled=True)
    two_ops = _step_resetting(layer, x, dout, start, monkeypatch, enabled=False)
    _assert_same(one_op, two_ops, wgrad)


def _step_resetting(layer, x, dout, main_grads, monkeypatch, *, enabled):
    for p, start in zip(layer.experts.parameters(), main_grads):
        if start is not None:
            p.main_grad = start.clone()
    monkeypatch.setattr(routed_experts, "enabled", enabled)
    return _step(layer, x, dout)


@pytest.mark.gpu
def test_gpu_one_op_in_fp8(monkeypatch):
    skip_without_cuda_kernels()
    torch.manual_seed(3)
    layer = MoELayer(128, 128, 8, 2, aux_loss_coeff=0.01, dtype=torch.bfloat16, device="cuda", backend="cuda")
    x = torch.randn(256, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dout = torch.randn(256, 128, dtype=torch.bfloat16, device="cuda")
    recipe = fp8.Float8BlockScaling()
    with fp8.fp8_autocast(recipe):
        assert layer.experts.fused_path_unavailable_reason(x) is None
    one_op, two_ops = _both_ways(monkeypatch, layer, x, dout, fp8_recipe=recipe)
    _assert_same(one_op, two_ops, "fp8")
    assert not torch.equal(one_op[0], _step(layer, x, dout)[0]), "fp8_autocast changed nothing"


@pytest.mark.gpu
def test_gpu_one_op_when_only_the_router_outputs_reach_the_loss():
    """Gradients reaching the routing weights, the losses and the logits, and not the experts' output,
    give x and the gate the router's own gradients, and the experts none."""
    skip_without_cuda_kernels()
    layer = _layer()
    x = torch.randn(96, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    tokens = x.detach().requires_grad_(True)
    mode = layer.router.fused_mode(x)
    assert mode is not None
    out, weights, losses, logits, chosen, counts = _apply_one_op(layer, x)
    loss = (weights * torch.arange(2, device="cuda")).sum() + losses.sum() + logits.square().mean()
    loss.backward()
    ref_weights, ref_losses, ref_logits, ref_chosen, ref_counts = SoftmaxRoute.apply(
        tokens, layer.router.weight, 2, mode, layer.router.scaling_factor
    )
    gate_grad = layer.router.weight.grad.clone()
    layer.router.weight.grad = None
    ref = (ref_weights * torch.arange(2, device="cuda")).sum() + ref_losses.sum() + ref_logits.square().mean()
    ref.backward()
    assert torch.equal(chosen, ref_chosen) and torch.equal(counts, ref_counts)
    assert torch.equal(x.grad, tokens.grad)
    assert torch.equal(gate_grad, layer.router.weight.grad)
    assert all(p.grad is None for p in layer.experts.parameters())


def _apply_one_op(layer, x):
    from moe_grouped.permute import permuted_rows

    route = routed_experts.Route(2, layer.router.fused_mode(x), layer.router.scaling_factor, 8, -1, False, False)
    plan = layer.experts.routed_plan(x, 2, permuted_rows(x.shape[0], 2, 8, None), False, "cuda")
    stages = layer.experts.fused_stages(x, plan.gemm_backend)
    return routed_experts.RoutedExpertsFunction.apply(
        x, layer.router.weight, route, plan, stages, layer.experts.fc1._delayed, layer.experts.fc2._delayed,
        *layer.experts.fused_weights(),
    )


@pytest.mark.gpu
def test_gpu_one_op_on_no_tokens(monkeypatch):
    """An empty batch: an empty output, empty and zero gradients, the two ops' bits."""
    skip_without_cuda_kernels()
    layer = _layer(aux_loss_coeff=0.01, z_loss_coeff=0.001)
    x = torch.zeros(0, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dout = torch.zeros(0, 64, dtype=torch.bfloat16, device="cuda")
    one_op, two_ops = _both_ways(monkeypatch, layer, x, dout)
    _assert_same(one_op, two_ops, "no tokens")
    assert one_op[0].shape == (0, 64) and one_op[7].shape == (0, 64)
    assert int(layer.router.weight.grad.count_nonzero()) == 0


@pytest.mark.gpu
def test_gpu_hooks_on_the_router_keep_the_router_called(monkeypatch):
    """A hook on the router module (a user's, or FSDP's) sees every call: the layer then calls the router
    and runs the two ops, with the one op's results."""
    skip_without_cuda_kernels()
    layer = _layer(aux_loss_coeff=0.01)
    x = torch.randn(96, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dout = torch.randn(96, 64, dtype=torch.bfloat16, device="cuda")
    one_op = _step(layer, x, dout)
    seen = []
    handle = layer.router.register_forward_hook(lambda module, args, out: seen.append(out.experts))
    calls = []
    apply = routed_experts.RoutedExpertsFunction.apply
    monkeypatch.setattr(routed_experts.RoutedExpertsFunction, "apply", lambda *a: calls.append(1) or apply(*a))
    try:
        hooked = _step(layer, x, dout)
    finally:
        handle.remove()
    assert len(seen) == 1 and not calls
    _assert_same(one_op, hooked, "a hooked router")
    assert torch.equal(seen[0], one_op[2])
