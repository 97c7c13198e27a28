"""moe_grouped.graphs without a GPU: argument checks, errors, split generators, nvtx, inspection logic."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import moe_grouped.graphs as graphs
from moe_grouped.graphs import callables as graph_callables
from moe_grouped.graphs import inspect as graph_inspect
from moe_grouped.graphs import nvtx, splits, testing
from moe_grouped.graphs._inputs import check_and_copy, flatten_sample, leaf_names


# ---------------------------------------------------------------- splits


@pytest.mark.parametrize("pattern", splits.PATTERNS)
@pytest.mark.parametrize("num_experts,total", [(1, 0), (1, 9), (2, 1), (8, 4096), (8, 3), (64, 1000), (128, 131072)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_splits_are_non_negative_and_sum_to_total(pattern, num_experts, total, dtype):
    generator = torch.Generator().manual_seed(num_experts * 7 + total)
    for _ in range(20):
        counts = splits.make_splits(pattern, num_experts, total, generator=generator, dtype=dtype)
        assert counts.dtype == dtype and counts.shape == (num_experts,)
        splits.check_splits(counts, num_experts, total)


def test_split_patterns_have_their_shape():
    generator = torch.Generator().manual_seed(0)
    balanced = splits.make_splits("balanced", 8, 4099)
    assert balanced.tolist() == [513, 513, 513, 512, 512, 512, 512, 512]
    for _ in range(50):
        one = splits.make_splits("all_to_one", 8, 4096, generator=generator)
        assert sorted(one.tolist()) == [0] * 7 + [4096]
        zeros = splits.make_splits("zero_token_experts", 8, 4096, generator=generator).tolist()
        assert 1 <= zeros.count(0) <= 7, zeros
    skewed = [splits.make_splits("skewed", 8, 4096, generator=generator) for _ in range(50)]
    spread = [int(s.max() - s.min()) for s in skewed]
    assert min(spread) > 0 and max(spread) > 1000, spread  # log-normal: far from balanced


def test_split_stream_is_reproducible_and_cycles_patterns():
    def take(seed):
        return [(p, s.tolist()) for _, (p, s) in zip(range(8), splits.split_stream(splits.PATTERNS, 8, 512, seed=seed))]

    first, again, other = take(3), take(3), take(4)
    assert first == again and first != other
    assert [pair[0] for pair in first] == list(splits.PATTERNS) * 2


def test_split_errors_name_the_values():
    with pytest.raises(ValueError, match="unknown split pattern 'uniform'"):
        splits.make_splits("uniform", 4, 8)
    with pytest.raises(ValueError, match="num_experts must be a positive int, got 0"):
        splits.make_splits("balanced", 0, 8)
    with pytest.raises(ValueError, match="total must be a non-negative int, got -1"):
        splits.make_splits("balanced", 4, -1)
    with pytest.raises(TypeError, match="int32 or torch.int64, got torch.float32"):
        splits.make_splits("balanced", 4, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="unknown split pattern 'x'"):
        next(splits.split_stream(["balanced", "x"], 4, 8))
    with pytest.raises(ValueError, match="sum to 8, got \\[1, 2\\]"):
        splits.check_splits(torch.tensor([1, 2]), 2, 8)
    with pytest.raises(ValueError, match="shape \\(3,\\)"):
        splits.check_splits(torch.tensor([1, 2]), 3, 3)


# ---------------------------------------------------------------- nvtx


def test_nvtx_range_is_a_context_manager_and_a_decorator():
    calls = []

    @nvtx.range("decorated")
    def work(value):
        calls.append(value)
        return value * 2

    with nvtx.range("block"):
        assert work(3) == 6
    assert calls == [3]
    assert isinstance(nvtx.enabled(), bool)
    with pytest.raises(TypeError, match="must be a str, got int"):
        nvtx.range(5)


@pytest.fixture
def nvtx_setting():
    yield
    nvtx.set_enabled(None)  # back to what this process's environment says


def test_nvtx_follows_the_environment_and_set_enabled(monkeypatch, nvtx_setting):
    monkeypatch.setenv("MOE_GROUPED_NVTX", "0")
    monkeypatch.setenv("NVTX_INJECTION64_PATH", "/a/profiler.so")
    nvtx.set_enabled(None)
    assert nvtx.enabled() is False
    with nvtx.range("off"):
        pass
    monkeypatch.delenv("MOE_GROUPED_NVTX")
    nvtx.set_enabled(None)
    assert nvtx.enabled() is (nvtx._nvtx is not None)  # a profiler listens
    monkeypatch.delenv("NVTX_INJECTION64_PATH")
    nvtx.set_enabled(None)
    assert nvtx.enabled() is False  # nothing listens: NVTX calls would be no-ops
    monkeypatch.setenv("MOE_GROUPED_NVTX", "1")
    nvtx.set_enabled(None)
    assert nvtx.enabled() is (nvtx._nvtx is not None)
    nvtx.set_enabled(False)
    assert nvtx.enabled() is False


def test_nvtx_ranges_stay_balanced_when_turned_off_inside_one(monkeypatch, nvtx_setting):
    events = []
    monkeypatch.setattr(nvtx, "_nvtx", type("Fake", (), {
        "push_range": staticmethod(lambda name, domain: events.append(("push", name))),
        "pop_range": staticmethod(lambda domain: events.append(("pop",))),
    }))
    nvtx.set_enabled(True)
    with nvtx.range("outer"):
        nvtx.set_enabled(False)
        with nvtx.range("inner"):
            pass
    assert events == [("push", "outer"), ("pop",)]

    # The same as a decorator, where one range object serves every (here nested) call.
    events.clear()
    nvtx.set_enabled(True)

    @nvtx.range("recursive")
    def nested(depth):
        if depth:
            nvtx.set_enabled(False)
            nested(depth - 1)

    nested(1)
    assert events == [("push", "recursive"), ("pop",)]


# ---------------------------------------------------------------- make_graphed_callables: checks before CUDA


def test_order_parsing_accepts_schedules_and_rejects_bad_ones():
    parse = graph_callables._parse_order
    assert parse(None, 2) == [("forward", 0), ("forward", 1), ("backward", 1), ("backward", 0)]
    assert parse([1, 2, -1, 3, -2, -3], 3) == [
        ("forward", 0), ("forward", 1), ("backward", 0), ("forward", 2), ("backward", 1), ("backward", 2),
    ]
    with pytest.raises(ValueError, match="name -2 exactly once"):
        parse([1, 2, -1], 2)
    with pytest.raises(ValueError, match="1 <= i <= 2, got 3"):
        parse([1, 3, -1, -3], 2)
    with pytest.raises(ValueError, match="backward of callable 1 before its forward"):
        parse([-1, 1], 1)
    with pytest.raises(ValueError, match="name 1 exactly once"):
        parse([1, 1, -1], 1)
    with pytest.raises(TypeError, match="sequence of ints"):
        parse("1,-1", 1)


def test_schedule_enforces_the_captured_order_cyclically():
    schedule = graph_callables.Schedule([("forward", 0), ("forward", 1), ("backward", 1), ("backward", 0)])
    for _ in range(2):
        for step in schedule.steps:
            schedule.advance(step)
    schedule.advance(("forward", 0))
    with pytest.raises(graphs.ReplayOrderError, match="backward of callable 1 was called when forward of callable 2"):
        schedule.advance(("backward", 0))
    schedule.reset()
    schedule.advance(("forward", 0))


def test_make_graphed_callables_rejects_bad_arguments_with_the_values():
    linear = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="num_warmup_iters must be an int >= 1.*got 0"):
        graphs.make_graphed_callables(linear, (x,), num_warmup_iters=0)
    with pytest.raises(ValueError, match="sample_args must be a tuple of 2 argument tuples"):
        graphs.make_graphed_callables((linear, linear), (x,))
    with pytest.raises(TypeError, match="callable 1 is a int"):
        graphs.make_graphed_callables(3, (x,))
    with pytest.raises(TypeError, match=r"args\[0\] is int 7.*functools.partial"):
        graphs.make_graphed_callables(linear, (7, x))
    with pytest.raises(ValueError, match=r"sample args\[0\] must be a CUDA tensor, got shape \(2, 4\)"):
        graphs.make_graphed_callables(linear, (x,))
    with pytest.raises(ValueError, match="order entries must be ints"):
        graphs.make_graphed_callables(linear, (x,), order=[1, -2])


def test_modules_with_hooks_or_trainable_buffers_are_refused():
    hooked = nn.Linear(4, 4)
    hooked.register_forward_hook(lambda *args: None)
    with pytest.raises(ValueError, match="has module hooks registered"):
        graph_callables._check_module(0, hooked)
    buffered = nn.Linear(4, 4)
    buffered.register_buffer("running", torch.zeros(4, requires_grad=True))
    with pytest.raises(ValueError, match="buffers that require grad \\(running\\)"):
        graph_callables._check_module(0, buffered)


def test_delayed_wgrad_modules_are_found_by_duck_typing():
    class Delayed(nn.Module):
        delay_wgrad_compute = True

        def backward_dw(self):
            pass

    class NotDelayed(Delayed):
        delay_wgrad_compute = False

    model = nn.Sequential(Delayed(), NotDelayed(), nn.Linear(2, 2))
    found = graph_callables._delayed_wgrad_modules(model)
    assert [type(m).__name__ for m in found] == ["Delayed"]
    assert graph_callables._delayed_wgrad_modules(None) == []


def test_sample_flattening_names_leaves_and_kwargs():
    a, b, c = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    assert leaf_names((a, [b]), {"m_splits": c}) == ["args[0]", "args[1][0]", "kwargs['m_splits']"]
    with pytest.raises(TypeError, match="sample kwargs must be a dict, got list"):
        flatten_sample("f", (a,), [c])


def test_static_inputs_are_checked_and_copied():
    static = [torch.zeros(4, 3), torch.zeros(2, dtype=torch.int32)]
    names = ["args[0]", "args[1]"]
    new = [torch.ones(4, 3), torch.tensor([1, 3], dtype=torch.int32)]
    check_and_copy("f", names, static, new)
    assert torch.equal(static[0], new[0]) and static[1].tolist() == [1, 3]
    with pytest.raises(ValueError, match=r"args\[1\] has shape \(3,\), dtype torch.int32.*captured with shape \(2,\)"):
        check_and_copy("f", names, static, [new[0], torch.zeros(3, dtype=torch.int32)])
    with pytest.raises(ValueError, match=r"args\[1\] has shape \(2,\), dtype torch.int64"):
        check_and_copy("f", names, static, [new[0], torch.zeros(2, dtype=torch.int64)])
    with pytest.raises(TypeError, match="captured with 2 tensor arguments"):
        check_and_copy("f", names, static, [new[0]])
    with pytest.raises(TypeError, match=r"args\[0\] must be a tensor"):
        check_and_copy("f", names, static, [[1.0], new[1]])
    with pytest.raises(ValueError, match="requires grad but its sample did not"):
        check_and_copy("f", names, static, [torch.ones(4, 3, requires_grad=True), new[1]])
    # The static buffer itself is not copied onto itself.
    check_and_copy("f", names, static, static)


@pytest.mark.parametrize("order", ["large_first", "small_first"])
def test_large_and_small_inputs_are_all_copied(order):
    """Inputs of 1 MiB or more take one copy_ each, smaller ones one _foreach_copy_: all land."""
    shapes = [(512, 512), (3,), (1024, 256), (7, 5)]  # 1 MiB, small, 1 MiB, small (float32)
    if order == "small_first":
        shapes = shapes[::-1]
    static = [torch.zeros(shape) for shape in shapes]
    new = [torch.randn(shape) for shape in shapes]
    check_and_copy("f", [f"args[{i}]" for i in range(len(shapes))], static, new)
    for got, want in zip(static, new):
        assert torch.equal(got, want)


# ---------------------------------------------------------------- capture_step: checks before CUDA


def test_capture_step_rejects_bad_arguments():
    with pytest.raises(TypeError, match="fn must be callable"):
        graphs.capture_step(None, torch.zeros(1))
    with pytest.raises(ValueError, match="num_warmup_iters must be an int >= 1, got 0"):
        graphs.capture_step(lambda x: x, torch.zeros(1), num_warmup_iters=0)
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        graphs.capture_step(lambda x: x, torch.zeros(1))


def test_optimizers_without_capturable_are_refused_with_the_fix():
    params = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="Adam.*capturable=False.*capturable=True"):
        graphs.check_optimizers([torch.optim.Adam(params, capturable=False)])
    graphs.check_optimizers([torch.optim.Adam(params, capturable=True), torch.optim.SGD(params, lr=0.1)])
    with pytest.raises(TypeError, match="must be a torch.optim.Optimizer, got list"):
        graphs.check_optimizers([[]])


# ---------------------------------------------------------------- inspection logic


def test_copy_directions_and_unsafe_nodes():
    assert graph_inspect.classify_copy(True, False) == "HtoD"
    assert graph_inspect.classify_copy(False, True) == "DtoH"
    assert graph_inspect.classify_copy(False, False) == "DtoD"
    nodes = [
        graph_inspect.GraphNode(0, "kernel", name="gemm"),
        graph_inspect.GraphNode(1, "memcpy", copy="DtoD", dependencies=(0,)),
        graph_inspect.GraphNode(2, "memset", dependencies=(1,)),
    ]
    assert graph_inspect.assert_graph_safe(nodes) == nodes
    assert graph_inspect.summary(nodes) == {"kernel": 1, "memcpy DtoD": 1, "memset": 1}
    bad = nodes + [graph_inspect.GraphNode(3, "host"), graph_inspect.GraphNode(4, "memcpy", copy="DtoH")]
    assert [n.index for n in graph_inspect.unsafe_nodes(bad)] == [3, 4]
    with pytest.raises(graph_inspect.GraphSafetyError, match="2 node\\(s\\) that involve the host \\(#3 host; #4 memcpy DtoH\\)"):
        graph_inspect.assert_graph_safe(bad)
    dot = graph_inspect.to_dot(bad, "step")
    assert dot.startswith('digraph "step" {') and "n0 -> n1;" in dot and "n1 -> n2;" in dot
    assert 'n3 [label="#3 host", style=filled' in dot


def test_raw_graph_handle_needs_a_graph():
    assert graph_inspect.raw_graph_handle(1234) == 1234
    with pytest.raises(TypeError, match="expected a torch.cuda.CUDAGraph.*got str"):
        graph_inspect.raw_graph_handle("graph")


# ---------------------------------------------------------------- harness: checks and comparisons


def test_harness_rejects_bad_arguments():
    with pytest.raises(ValueError, match="splits_index 2 must index sample_args, which has 2 entries"):
        testing.check_replay(nn.Identity(), (torch.zeros(2), torch.zeros(2, dtype=torch.int32)), splits_index=2)
    with pytest.raises(TypeError, match=r"sample_args\[1\] must be a 1-D int32/int64 tensor"):
        testing.check_replay(nn.Identity(), (torch.zeros(2), torch.zeros(2)))
    with pytest.raises(ValueError, match="num_replays must be a positive int, got 0"):
        testing.check_replay(nn.Identity(), (torch.zeros(2), torch.zeros(2, dtype=torch.int32)), num_replays=0)
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        with testing.watchdog(0):
            pass


def test_harness_comparison_is_bitwise_or_tolerant():
    a = torch.tensor([1.0, 2.0, 3.0])
    assert testing._differ(a, a.clone(), True, 0, 0) is None
    nudged = a + torch.tensor([0.0, 1e-6, 0.0])
    assert "1 of 3 differ" in testing._differ(nudged, a, True, 0, 0)
    assert testing._differ(nudged, a, False, 1e-5, 0) is None
    assert "one side is None" in testing._differ(None, a, True, 0, 0)
    assert testing._differ(None, None, True, 0, 0) is None
    assert "shape (2,)" in testing._differ(a[:2], a, True, 0, 0)
