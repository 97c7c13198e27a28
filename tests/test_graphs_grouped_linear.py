"""moe_grouped's real ops under moe_grouped.graphs: GroupedLinear, microbatches, a whole MoE step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import moe_grouped
import moe_grouped.graphs as graphs
from moe_grouped import GroupedLinear
from moe_grouped.graphs import splits, testing

from cases import interleaved_microbatches, skip_without_cuda_kernels

pytestmark = pytest.mark.gpu

E, K, N, M = 8, 128, 256, 1024
GRAPH_SAFE_BACKENDS = ("torch", "cuda")


def need(backend: str) -> torch.dtype:
    """Skips a backend this machine cannot run; returns the dtype to test it in."""
    if backend == "cuda":
        skip_without_cuda_kernels()
    return torch.bfloat16


def layer(backend, **options) -> GroupedLinear:
    torch.manual_seed(0)
    out = GroupedLinear(E, K, N, dtype=need(backend), device="cuda", backend=backend, **options)
    if options.get("fuse_wgrad_accumulation"):
        for weight in out.weights():
            weight.main_grad = torch.randn(weight.shape, dtype=torch.float32, device="cuda")  # accumulate onto non-zero
    return out


def sample(dtype=torch.bfloat16, features=K):
    x = torch.randn(M, features, dtype=dtype, device="cuda", requires_grad=True)
    return x, splits.make_splits("balanced", E, M, device="cuda")


@pytest.mark.parametrize("backend", GRAPH_SAFE_BACKENDS)
@pytest.mark.parametrize("fuse", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("delay", [False, True], ids=["wgrad", "delayed_wgrad"])
def test_grouped_linear_1000_replays_match_eager_bitwise(backend, fuse, delay):
    module = layer(backend, single_grouped_weight=True, fuse_wgrad_accumulation=fuse, delay_wgrad_compute=delay)
    report = testing.check_replay(module, sample(), num_replays=1000, captures=2, timeout_s=30)
    print(f"\n[graphs] GroupedLinear {backend} fuse={fuse} delay={delay}: {report.replays} replays x "
          f"{report.captures} captures, {report.tensors_compared} tensors compared, {report.mismatches} mismatches, "
          f"patterns {report.patterns}")
    assert report.replays == 1000 and report.mismatches == 0
    assert set(report.patterns) == set(splits.PATTERNS)


@pytest.mark.parametrize("backend", GRAPH_SAFE_BACKENDS)
def test_grouped_linear_separate_weights_graphs_are_host_free(backend):
    module = layer(backend, fuse_wgrad_accumulation=True, delay_wgrad_compute=True)
    report = testing.check_replay(module, sample(), num_replays=100, captures=1)
    assert report.mismatches == 0
    graphed = graphs.make_graphed_callables(module, sample())
    for graph in (graphed.forward_graph, graphed.backward_graph, graphed.wgrad_graph):
        nodes = graphs.assert_graph_safe(graph)
        assert any(n.type == "kernel" for n in nodes)


def test_reference_backend_refuses_capture_with_its_own_message():
    torch.manual_seed(0)
    module = GroupedLinear(E, K, N, dtype=torch.float32, device="cuda", backend="reference")
    with pytest.raises(RuntimeError, match="backend='torch' or backend='cuda'"):
        graphs.make_graphed_callables(module, sample(torch.float32))


@pytest.mark.parametrize("backend", GRAPH_SAFE_BACKENDS)
def test_two_grouped_linear_layers_as_microbatches_in_interleaved_order(backend):
    dtype = need(backend)
    torch.manual_seed(0)
    first = GroupedLinear(E, K, K, dtype=dtype, device="cuda", backend=backend)
    second = GroupedLinear(E, K, N, dtype=dtype, device="cuda", backend=backend)
    x, s = sample(dtype)
    h = torch.randn(M, K, dtype=dtype, device="cuda", requires_grad=True)
    # 2 layers x 2 microbatches: F(l1,a) F(l2,a) F(l1,b) B(l2,a) B(l1,a) F(l2,b) B(l2,b) B(l1,b)
    order = [1, 2, 3, -2, -1, 4, -4, -3]
    g = graphs.make_graphed_callables((first, second, first, second), ((x, s), (h, s), (x, s), (h, s)), order=order)
    params = [*first.parameters(), *second.parameters()]
    stream = splits.split_stream(splits.PATTERNS, E, M, seed=5, device="cuda")
    for step in range(50):
        (pa, sa), (pb, sb) = next(stream), next(stream)
        xa, xb = (torch.randn(M, K, dtype=dtype, device="cuda") for _ in range(2))
        dya, dyb = (torch.randn(M, N, dtype=dtype, device="cuda") for _ in range(2))
        micro_a, micro_b = (xa, sa, dya), (xb, sb, dyb)
        got = interleaved_microbatches(*g, params, micro_a, micro_b)
        want = interleaved_microbatches(first, second, first, second, params, micro_a, micro_b)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"{backend=} {step=} splits {pa}/{pb}: tensor {i} differs"


def moe_model(backend: str, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    hidden = 64
    return nn.Sequential(
        moe_grouped.MoELayer(hidden, 128, E, 2, dtype=dtype, device="cuda", backend=backend),
        nn.Linear(hidden, hidden, dtype=dtype, device="cuda"),
    )


@pytest.mark.parametrize("backend", GRAPH_SAFE_BACKENDS)
def test_whole_moe_training_step_capture_matches_eager_loss_for_50_steps(backend):
    # bf16 for both: torch._grouped_mm's float32 path copies the offsets to the host (not capturable).
    dtype = need(backend)
    model = moe_model(backend, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    tokens = 256
    x = torch.randn(tokens, 64, dtype=dtype, device="cuda")
    target = torch.randn(tokens, 64, dtype=dtype, device="cuda")

    def make_step(net, opt):
        def step(x, target):
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(net(x).float(), target.float())
            loss.backward()
            opt.step()
            return loss.detach()
        return step

    captured = graphs.capture_step(make_step(model, optimizer), x, target, optimizers=[optimizer])
    graphs.assert_graph_safe(captured.graph)
    twin = copy.deepcopy(model)
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=1e-3, capturable=True)
    twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    eager = make_step(twin, twin_optimizer)

    generator = torch.Generator(device="cuda").manual_seed(1)
    losses, exact = [], 0
    for i in range(50):
        xi = torch.randn(tokens, 64, dtype=dtype, device="cuda", generator=generator)
        ti = torch.randn(tokens, 64, dtype=dtype, device="cuda", generator=generator)
        got = captured(xi, ti).clone()
        want = eager(xi, ti)
        exact += bool(torch.equal(got, want))
        losses.append((got.item(), want.item()))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{backend=} step {i}: {m}")
    print(f"\n[graphs] whole MoE step {backend}: 50 steps, {exact} bitwise-equal losses, "
          f"first {losses[0]}, last {losses[-1]}")
    assert losses[-1][0] < losses[0][0] * 1.5  # training moves, nothing blew up
