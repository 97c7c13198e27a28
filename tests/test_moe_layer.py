"""MoELayer and GroupedMLP against a per-token loop reference; capture and replay."""

import math

import pytest
import torch
from torch.nn.functional import silu

from moe_grouped import GroupedMLP, MoELayer

from cases import CAPACITY_OPTIONS, calc_diff, capture_after_a_step, gpu_backends


def reference(layer, x, experts, dout, aux_coeff, z_coeff, kept=None):
    """Per-token loops in float64 with autograd, routing choices given.

    ``kept`` [T, top_k] bool marks the copies that reach their expert (token
    dropping); None: all of them. Returns the output and the gradients of
    ``(out * dout).sum() + aux_coeff * aux + z_coeff * z`` w.r.t. x and every
    parameter (by name).
    """
    params = {n: p.detach().double().cpu().requires_grad_(True) for n, p in layer.named_parameters()}

    def matrices(name):  # the float64 copies of one GroupedLinear, per expert
        if layer.experts.fc1.single_grouped_weight:
            return list(params[f"experts.{name}.weight"].unbind(0))
        return [params[f"experts.{name}.weight{e}"] for e in range(layer.num_experts)]

    w1, w2, gate = matrices("fc1"), matrices("fc2"), params["router.weight"]
    ffn = w2[0].shape[1]
    xs = x.detach().double().cpu().reshape(-1, layer.hidden).requires_grad_(True)
    tokens, top_k = experts.shape
    rows = []
    for t in range(tokens):
        probs = torch.softmax(gate @ xs[t], dim=0)
        chosen = probs[experts[t]]
        weights = chosen / chosen.sum()
        y = torch.zeros(layer.hidden, dtype=torch.float64)
        for j, e in enumerate(experts[t].tolist()):
            if kept is not None and not kept[t, j]:
                continue  # dropped: the expert never sees this copy
            h = w1[e] @ xs[t]
            y = y + weights[j] * (w2[e] @ (silu(h[:ffn]) * h[ffn:]))
        if layer.shared_expert is not None:
            h = params["shared_expert.fc1.weight"] @ xs[t]
            half = h.shape[0] // 2
            y = y + params["shared_expert.fc2.weight"] @ (silu(h[:half]) * h[half:])
        rows.append(y)
    out = torch.stack(rows)
    logits = xs @ gate.t()
    counts = torch.bincount(experts.reshape(-1).cpu(), minlength=layer.num_experts).double()
    aux = layer.num_experts * (counts / (tokens * top_k) * torch.softmax(logits, -1).mean(0)).sum()
    z = torch.logsumexp(logits, -1).square().mean()
    loss = (out * dout.double().reshape(out.shape)).sum() + aux_coeff * aux + z_coeff * z
    inputs = [xs, *params.values()]
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)  # all copies dropped: experts unused
    grads = [torch.zeros_like(i) if g is None else g for i, g in zip(inputs, grads)]
    return out.detach(), aux.detach(), z.detach(), grads[0], dict(zip(params, grads[1:]))


def kept_copies(layer, routing):
    """[T, top_k] bool: the copies the layer's capacity keeps (per-expert loops), or None."""
    if layer.capacity_factor is None:
        return None
    experts, probs = routing.experts.cpu().tolist(), routing.weights.float().cpu().tolist()
    tokens = len(experts)
    capacity = math.ceil(tokens * layer.top_k / layer.num_experts * layer.capacity_factor)
    kept = torch.zeros(tokens, layer.top_k, dtype=torch.bool)
    for e in range(layer.num_experts):
        mine = [(t, j) for t in range(tokens) for j in range(layer.top_k) if experts[t][j] == e]
        if layer.drop_policy == "probs":
            mine.sort(key=lambda c: (-probs[c[0]][c[1]], c))
        for t, j in mine[:capacity]:
            kept[t, j] = True
    return kept


def check_layer(layer, x, aux_coeff, z_coeff, tolerance, case):
    x = x.clone().requires_grad_(True)
    out = layer(x)
    dout = torch.randn_like(out)
    out.backward(dout)
    routing = layer.last_routing
    exp_out, exp_aux, exp_z, exp_dx, exp_grads = reference(
        layer, x, routing.experts.cpu(), dout.cpu(), aux_coeff, z_coeff, kept_copies(layer, routing)
    )
    assert out.shape == x.shape, case
    assert calc_diff(out.detach().reshape(exp_out.shape), exp_out) < tolerance, f"output: {case}"
    assert torch.allclose(routing.aux_loss.double().cpu(), exp_aux, rtol=1e-5), f"aux loss: {case}"
    assert torch.allclose(routing.z_loss.double().cpu(), exp_z, rtol=1e-5), f"z loss: {case}"
    assert calc_diff(x.grad.reshape(exp_dx.shape), exp_dx) < tolerance, f"dx: {case}"
    for name, param in layer.named_parameters():
        assert param.grad is not None, f"{name} has no gradient: {case}"
        assert calc_diff(param.grad, exp_grads[name]) < tolerance, f"grad of {name}: {case}"
    return routing


@pytest.mark.parametrize("single_grouped_weight", [True, False], ids=["grouped", "separate"])
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_layer_matches_per_token_loops_on_cpu(single_grouped_weight, shared, top_k):
    torch.manual_seed(0)
    layer = MoELayer(
        12, 10, 5, top_k, shared_expert_ffn_hidden=6 if shared else None, aux_loss_coeff=0.1,
        z_loss_coeff=0.01, single_grouped_weight=single_grouped_weight, dtype=torch.float64,
    )
    x = torch.randn(3, 7, 12, dtype=torch.float64)  # [B, S, H]
    routing = check_layer(layer, x, 0.1, 0.01, 1e-12, f"{single_grouped_weight=} {shared=} {top_k=}")
    # The layer chose the top-k experts of its own float64 probabilities.
    logits = x.reshape(-1, 12) @ layer.router.weight.detach().t()
    assert torch.equal(routing.experts, logits.topk(top_k, dim=-1).indices)


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True], ids=["packed", "padded"])
@pytest.mark.parametrize("factor", [0.0, 0.5, 1.0])
def test_layer_with_token_dropping_matches_per_token_loops_on_cpu(policy, pad, factor):
    torch.manual_seed(7)
    layer = MoELayer(
        12, 10, 4, 2, shared_expert_ffn_hidden=6, aux_loss_coeff=0.1, z_loss_coeff=0.01,
        capacity_factor=factor, drop_policy=policy, pad_to_capacity=pad, single_grouped_weight=True,
        bias=False, dtype=torch.float64,
    )
    with torch.no_grad():
        layer.router.weight[1] += 0.5  # expert 1 over-full
    x = torch.rand(21, 12, dtype=torch.float64)
    routing = check_layer(layer, x, 0.1, 0.01, 1e-12, f"{policy=} {pad=} {factor=}")
    kept = kept_copies(layer, routing)
    if factor < 1.0:
        assert not kept.all(), "the case must drop copies"
    assert "capacity_factor" in repr(layer)


def test_token_dropping_options_are_checked():
    with pytest.raises(ValueError, match="capacity_factor must be"):
        MoELayer(8, 6, 4, 2, capacity_factor=-0.5)
    with pytest.raises(ValueError, match="needs a capacity_factor"):
        MoELayer(8, 6, 4, 2, pad_to_capacity=True)
    with pytest.raises(ValueError, match="drop_policy must be"):
        MoELayer(8, 6, 4, 2, capacity_factor=1.0, drop_policy="random")


def test_all_tokens_to_one_expert_leaves_the_others_without_gradient():
    torch.manual_seed(1)
    layer = MoELayer(8, 6, 4, 1, dtype=torch.float64, single_grouped_weight=True)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[2] = 10.0  # positive inputs: expert 2 wins every token
    x = torch.rand(9, 8, dtype=torch.float64) + 0.1
    routing = check_layer(layer, x, 0.0, 0.0, 1e-12, "all to expert 2")
    assert routing.tokens_per_expert.tolist() == [0, 0, 9, 0]
    grad = layer.experts.fc1.weight.grad
    assert grad[2].abs().sum() > 0 and grad[[0, 1, 3]].abs().sum() == 0


def test_aux_losses_reach_the_router_only_in_training():
    torch.manual_seed(2)
    layer = MoELayer(8, 6, 4, 2, aux_loss_coeff=1.0, z_loss_coeff=1.0, dtype=torch.float64)
    x = torch.randn(10, 8, dtype=torch.float64)
    # Zero output gradient: the router's gradient comes from the losses alone.
    layer(x).backward(torch.zeros(10, 8, dtype=torch.float64))
    assert layer.router.weight.grad.abs().sum() > 0
    layer.zero_grad()
    layer.eval()
    layer(x).backward(torch.zeros(10, 8, dtype=torch.float64))
    assert layer.router.weight.grad.abs().sum() == 0


@pytest.mark.parametrize("single_grouped_weight", [True, False], ids=["grouped", "separate"])
def test_delay_wgrad_compute_gives_the_same_gradients_after_backward_dw(single_grouped_weight):
    torch.manual_seed(3)
    layers = [MoELayer(8, 6, 4, 2, dtype=torch.float64, delay_wgrad_compute=d,
                       single_grouped_weight=single_grouped_weight) for d in (False, True)]
    layers[1].load_state_dict(layers[0].state_dict())
    x, dout = torch.randn(10, 8, dtype=torch.float64), torch.randn(10, 8, dtype=torch.float64)
    for layer in layers:
        layer(x).backward(dout)
    assert all(w.grad is None for w in layers[1].experts.fc1.weights())
    layers[1].backward_dw()
    for (name, p0), p1 in zip(layers[0].named_parameters(), layers[1].parameters()):
        assert torch.allclose(p0.grad, p1.grad), name


def test_grouped_mlp_is_swiglu_per_expert():
    torch.manual_seed(4)
    mlp = GroupedMLP(3, 8, 5, single_grouped_weight=True, dtype=torch.float64)
    x, splits = torch.randn(7, 8, dtype=torch.float64), [2, 0, 5]
    out = mlp(x, splits)
    start = 0
    for e, count in enumerate(splits):
        h = x[start : start + count] @ mlp.fc1.weight[e].t()
        expected = (silu(h[:, :5]) * h[:, 5:]) @ mlp.fc2.weight[e].t()
        assert torch.allclose(out[start : start + count], expected), f"expert {e}"
        start += count


def test_bad_input_shape_is_refused():
    layer = MoELayer(8, 6, 4, 2)
    with pytest.raises(ValueError, match=r"\[tokens, 8\] or \[batch, seq, 8\]"):
        layer(torch.randn(4, 7))


@pytest.mark.gpu
@pytest.mark.parametrize("capacity", sorted(CAPACITY_OPTIONS))
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared"])
def test_gpu_layer_matches_per_token_loops(shared, capacity):
    for backend in gpu_backends():
        torch.manual_seed(5)
        layer = MoELayer(
            64, 96, 8, 2, shared_expert_ffn_hidden=32 if shared else None, aux_loss_coeff=0.01,
            z_loss_coeff=0.001, single_grouped_weight=True, dtype=torch.bfloat16, device="cuda",
            backend=backend, **CAPACITY_OPTIONS[capacity],
        )
        x = torch.randn(2, 48, 64, dtype=torch.bfloat16, device="cuda")
        check_layer(layer, x, 0.01, 0.001, 1e-3, f"{backend=} {shared=} {capacity=}")


@pytest.mark.gpu
@pytest.mark.parametrize("capacity", sorted(CAPACITY_OPTIONS))
def test_gpu_backward_on_the_calling_thread_gives_the_same_gradients(capacity):
    """``torch.autograd.set_multithreading_enabled(False)`` (the README's tip for eager steps) runs the
    backward on the caller's thread instead of autograd's device thread: the same bits."""
    for backend in gpu_backends():
        torch.manual_seed(7)
        layer = MoELayer(64, 96, 8, 2, aux_loss_coeff=0.01, z_loss_coeff=0.001, dtype=torch.bfloat16,
                         device="cuda", backend=backend, **CAPACITY_OPTIONS[capacity])
        x = torch.randn(96, 64, dtype=torch.bfloat16, device="cuda")
        dout = torch.randn(96, 64, dtype=torch.bfloat16, device="cuda")
        results = []
        for threaded in (True, False):
            layer.zero_grad(set_to_none=True)
            xg = x.clone().requires_grad_(True)
            out = layer(xg)
            with torch.autograd.set_multithreading_enabled(threaded):
                out.backward(dout)
            results.append([out.detach(), xg.grad] + [p.grad for p in layer.parameters()])
        for a, b in zip(*results):
            assert torch.equal(a, b), f"{backend=} {capacity=}"


@pytest.mark.gpu
@pytest.mark.parametrize("capacity", sorted(CAPACITY_OPTIONS))
def test_gpu_capture_of_forward_and_backward_replays_new_routing(capacity):
    tokens, hidden, ffn, num_experts, top_k = 256, 64, 128, 8, 2
    dtype = torch.bfloat16  # torch._grouped_mm copies offsets to the host for float32
    for backend in gpu_backends():
        torch.manual_seed(6)
        layer = MoELayer(
            hidden, ffn, num_experts, top_k, aux_loss_coeff=0.01, z_loss_coeff=0.001,
            shared_expert_ffn_hidden=32, single_grouped_weight=True, dtype=dtype, device="cuda",
            backend=backend, **CAPACITY_OPTIONS[capacity],
        )
        params = list(layer.parameters())
        static_x = torch.randn(tokens, hidden, dtype=dtype, device="cuda", requires_grad=True)
        static_dout = torch.randn(tokens, hidden, dtype=dtype, device="cuda")

        def step():
            for p in [static_x, *params]:
                p.grad = None
            out = layer(static_x)
            out.backward(static_dout)
            return out

        graph, static_out = capture_after_a_step(step, steps_before=3)
        static_experts = layer.last_routing.experts
        static_counts = layer.last_routing.tokens_per_expert
        static_grads = [static_x.grad, *[p.grad for p in params]]
        seen_counts = set()
        for replay in range(6):
            x = torch.randn(tokens, hidden, dtype=dtype, device="cuda") * (1 + replay)
            dout = torch.randn(tokens, hidden, dtype=dtype, device="cuda")
            with torch.no_grad():
                static_x.copy_(x)
            static_dout.copy_(dout)
            graph.replay()
            x_eager = x.clone().requires_grad_(True)
            for p in params:
                p.grad = None
            out = layer(x_eager)
            out.backward(dout)
            case = f"{backend=} {capacity=} {replay=}"
            assert torch.equal(static_experts, layer.last_routing.experts), case
            assert torch.equal(static_counts, layer.last_routing.tokens_per_expert), case
            seen_counts.add(tuple(static_counts.tolist()))
            assert calc_diff(static_out.detach(), out.detach()) < 1e-6, case
            for i, (g_replay, g_eager) in enumerate(zip(static_grads, [x_eager.grad, *[p.grad for p in params]])):
                assert calc_diff(g_replay, g_eager) < 1e-6, f"grad {i}: {case}"
        assert len(seen_counts) > 1, f"{backend=}: the routing never changed between replays"
