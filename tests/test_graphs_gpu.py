"""moe_grouped.graphs on a GPU with plain torch modules and the toy grouped ops."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import moe_grouped.graphs as graphs
from moe_grouped.graphs import inspect as graph_inspect
from moe_grouped.graphs import splits, testing

from cases import interleaved_microbatches
from test_graphs_toy_ops import ToyGroupedScale, twin

pytestmark = pytest.mark.gpu

E, N, M = 4, 64, 256


def toy_sample(requires_grad: bool = True):
    x = torch.randn(M, N, device="cuda", requires_grad=requires_grad)
    return x, splits.make_splits("balanced", E, M, device="cuda")


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).cuda()


# ---------------------------------------------------------------- the harness against good and broken ops


def test_harness_passes_on_the_correct_toy_op():
    torch.manual_seed(0)
    report = testing.check_replay(ToyGroupedScale(E, N, M), toy_sample(), num_replays=100)
    assert (report.replays, report.runs, report.mismatches) == (100, 200, 0)
    assert report.tensors_compared == 200 * 3  # output, grad of x, grad of scale
    assert set(report.patterns) == set(splits.PATTERNS)


def test_harness_fails_on_per_call_scratch_aliased_across_forward_and_backward_graphs():
    torch.manual_seed(0)
    broken = ToyGroupedScale(E, N, M, scratch="per_call")
    with pytest.raises(testing.ReplayMismatch, match=r"parameter 0 \.grad"):
        testing.check_replay(broken, toy_sample(), num_replays=20, reference=twin(broken, scratch="persistent"))


def test_harness_fails_on_dgrad_and_wgrad_sharing_a_workspace():
    torch.manual_seed(0)
    broken = ToyGroupedScale(E, N, M, wgrad_slot="shared")
    with pytest.raises(testing.ReplayMismatch, match="grad of argument 0"):
        testing.check_replay(broken, toy_sample(), num_replays=20, reference=twin(broken, wgrad_slot="separate"))


def test_watchdog_turns_a_hung_replay_into_a_failure():
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda._sleep(3_000_000_000)  # about 1.5-2 s of spinning
    started = torch.cuda.Event(enable_timing=False)
    started.record()
    import time

    begin = time.monotonic()
    with pytest.raises(testing.ReplayTimeout, match="did not finish within 0.2 s"):
        with testing.watchdog(0.2, "the sleeping replay"):
            graph.replay()
    assert time.monotonic() - begin < 1.0
    torch.cuda.synchronize()


# ---------------------------------------------------------------- make_graphed_callables on plain modules


def test_graphed_mlp_matches_eager_bitwise_and_leaves_warmup_no_trace():
    model = mlp()
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    graphed = graphs.make_graphed_callables(model, (x,))
    assert all(p.grad is None for p in model.parameters())
    for step in range(5):
        xs = torch.randn(32, 64, device="cuda")
        dy = torch.randn(32, 64, device="cuda")
        got_x = xs.clone().requires_grad_(True)
        y = graphed(got_x)
        y.backward(dy)
        got = [y.detach().clone(), got_x.grad] + [p.grad for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        want_x = xs.clone().requires_grad_(True)
        y_eager = model(want_x)
        y_eager.backward(dy)
        want = [y_eager.detach(), want_x.grad] + [p.grad for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"step {step} tensor {i}"


def test_parameter_grads_accumulate_across_replays_without_aliasing_the_static_buffers():
    model = mlp()
    x = torch.randn(32, 64, device="cuda")
    graphed = graphs.make_graphed_callables(model, (x,))
    dy = torch.randn(32, 64, device="cuda")
    graphed(x).backward(dy)
    once = [p.grad.clone() for p in model.parameters()]
    graphed(x).backward(dy)  # no zero_grad: .grad must now hold twice the gradient
    for p, g in zip(model.parameters(), once):
        torch.testing.assert_close(p.grad, 2 * g)


def test_calls_that_do_not_fit_the_capture_raise_clear_errors():
    model = ToyGroupedScale(E, N, M)
    x, s = toy_sample()
    graphed = graphs.make_graphed_callables(model, (x, s))
    with pytest.raises(ValueError, match=r"args\[0\] has shape \(128, 64\).*captured with shape \(256, 64\)"):
        graphed(x[:128], s)
    with pytest.raises(ValueError, match=r"args\[1\] has shape \(4,\), dtype torch.int64"):
        graphed(x, s.long())
    with pytest.raises(ValueError, match=r"args\[1\] has shape \(4,\), dtype torch.int32, device cpu"):
        graphed(x, s.cpu())
    with pytest.raises(TypeError, match="same structure"):
        graphed(x)
    model.eval()
    with pytest.raises(RuntimeError, match="captured in training mode but is now in eval mode"):
        graphed(x, s)
    model.train()
    with torch.no_grad(), pytest.raises(RuntimeError, match="called with gradients disabled"):
        graphed(x, s)
    y = graphed(x, s)  # forward replayed; its backward is next
    with pytest.raises(graphs.ReplayOrderError, match="forward of callable 1 was called when backward of callable 1"):
        graphed(x, s)
    y.sum().backward()
    graphed(x, s).sum().backward()


def test_several_callables_in_an_interleaved_microbatch_order_match_eager():
    torch.manual_seed(0)
    first, second = ToyGroupedScale(E, N, M), ToyGroupedScale(E, N, M)
    x, s = toy_sample()
    h = torch.randn(M, N, device="cuda", requires_grad=True)
    order = [1, 2, 3, -2, -1, 4, -4, -3]
    g = graphs.make_graphed_callables((first, second, first, second), ((x, s), (h, s), (x, s), (h, s)), order=order)
    stream = splits.split_stream(splits.PATTERNS, E, M, seed=1, device="cuda")
    for step in range(30):
        (_, sa), (_, sb) = next(stream), next(stream)
        xa, xb, dya, dyb = (torch.randn(M, N, device="cuda") for _ in range(4))
        params, micro_a, micro_b = (first.scale, second.scale), (xa, sa, dya), (xb, sb, dyb)
        got = interleaved_microbatches(*g, params, micro_a, micro_b)
        want = interleaved_microbatches(first, second, first, second, params, micro_a, micro_b)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"step {step} tensor {i}"
    with pytest.raises(graphs.ReplayOrderError, match=r"\[forward of callable 1, forward of callable 2, forward of callable 3, backward of callable 2"):
        g[1](h, s)


# ---------------------------------------------------------------- inspection


def test_inspection_lists_kernels_and_flags_host_copies():
    model = mlp()
    graphed = graphs.make_graphed_callables(model, (torch.randn(32, 64, device="cuda", requires_grad=True),))
    for graph in (graphed.forward_graph, graphed.backward_graph):
        nodes = graphs.assert_graph_safe(graph)
        kernels = [n for n in nodes if n.type == "kernel"]
        assert kernels and all(n.name for n in kernels), graph_inspect.summary(nodes)
    assert "digraph" in graph_inspect.to_dot(graphs.graph_nodes(graphed.forward_graph))

    pinned = torch.zeros(256, pin_memory=True)
    device = torch.zeros(256, device="cuda")
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        device.copy_(pinned, non_blocking=True)
        device.mul_(2)
        pinned.copy_(device, non_blocking=True)
    graph.instantiate()
    nodes = graphs.graph_nodes(graph)
    assert {n.copy for n in nodes if n.type == "memcpy"} >= {"HtoD", "DtoH"}, graph_inspect.summary(nodes)
    with pytest.raises(graphs.GraphSafetyError, match="HtoD"):
        graphs.assert_graph_safe(graph)


def test_inspecting_a_graph_that_did_not_keep_its_handle_says_how_to_fix_it():
    graph = torch.cuda.CUDAGraph()
    x = torch.zeros(4, device="cuda")
    with torch.cuda.graph(graph):
        x.add_(1)
    with pytest.raises(RuntimeError, match="keep_graph=True"):
        graphs.graph_nodes(graph)


# ---------------------------------------------------------------- whole-step capture


def test_capture_step_replays_an_mlp_training_step_like_eager():
    import copy

    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
    x = torch.randn(32, 64, device="cuda")
    target = torch.randn(32, 64, device="cuda")

    def step(x, target):
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        return loss.detach()

    captured = graphs.capture_step(step, x, target, optimizers=[optimizer])
    graphs.assert_graph_safe(captured.graph)
    twin_model = copy.deepcopy(model)
    twin_optimizer = torch.optim.Adam(twin_model.parameters(), lr=1e-3, capturable=True)
    twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))

    def eager_step(x, target):
        twin_optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(twin_model(x), target)
        loss.backward()
        twin_optimizer.step()
        return loss.detach()

    for i in range(20):
        xi, ti = torch.randn_like(x), torch.randn_like(target)
        got = captured(xi, ti).clone()
        want = eager_step(xi, ti)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {i}: {m}")
    for a, b in zip(model.parameters(), twin_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"args\[0\] has shape \(16, 64\)"):
        captured(x[:16], target)


def test_capture_step_takes_a_step_that_returns_nothing():
    """A step that only updates state (returns None) replays; a Python value as output is refused."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 64, device="cuda")

    def step(x):
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        optimizer.step()

    captured = graphs.capture_step(step, x)
    before = model[0].weight.detach().clone()
    assert captured(torch.randn_like(x)) is None
    assert not torch.equal(before, model[0].weight)
    with pytest.raises(TypeError, match="returned a float as output 0"):
        graphs.capture_step(lambda x: 1.0, x)
