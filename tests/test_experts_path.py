"""The fused experts path (moe_grouped.experts) against the unfused one, the weighted SwiGLU backward
against its formula, capture and replay, and the activation memory it saves."""

import contextlib
import copy

import pytest
import torch
from torch import nn
from torch.nn.functional import silu

import moe_grouped
from moe_grouped import GroupedMLP, MoELayer, _core, experts_sequence
from moe_grouped.activation import swiglu_weighted_backward
from moe_grouped.permute import permute, permute_index, unpermute

from cases import (
    SPLIT_PATTERNS,
    assert_close_to,
    calc_diff,
    make_splits,
    peak_step_bytes_per_path,
    skip_without_cuda_kernels,
)

# Capacity variants: (capacity_factor, drop_policy, pad_to_capacity).
DROPPING = {
    "probs-packed-0.5": (0.5, "probs", False),
    "position-padded-0.5": (0.5, "position", True),
    "probs-padded-1.0": (1.0, "probs", True),
    "all-dropped": (0.0, "probs", False),
}
ROUTINGS = [(pattern, None) for pattern in SPLIT_PATTERNS] + [("skewed", name) for name in DROPPING]


def routed_experts(pattern: str, tokens: int, top_k: int, num_experts: int, seed: int) -> torch.Tensor:
    """[tokens, top_k] expert indices whose per-expert counts follow ``pattern``, copies shuffled."""
    counts = make_splits(pattern, num_experts, tokens * top_k, seed)
    ids = torch.repeat_interleave(torch.arange(num_experts), torch.tensor(counts))
    order = torch.randperm(tokens * top_k, generator=torch.Generator().manual_seed(seed))
    return ids[order].view(tokens, top_k)


def run_experts(mlp, path, x, experts, probs, dout, backend, drop):
    """Output and gradients (x, probs, then every parameter) of the routed experts on ``path``."""
    mlp.experts_path = path
    for param in mlp.parameters():
        param.grad = None
    x = x.clone().requires_grad_(True)
    probs = probs.clone().requires_grad_(True)
    options = {}
    if drop is not None:
        factor, policy, pad = drop
        options = dict(capacity_factor=factor, drop_policy=policy, pad_to_capacity=pad)
    if path == "fused":
        row_id_map, m_splits, rows = permute_index(x, experts, mlp.num_experts, probs=probs.detach(),
                                                   backend=backend, **options)
        out = mlp.forward_routed(x, probs, row_id_map, m_splits, rows, zero_unmapped=drop is not None,
                                 permute_backend=backend)
    else:
        permuted, m_splits, row_id_map = permute(x, experts, mlp.num_experts, probs=probs.detach(),
                                                 backend=backend, **options)
        out = unpermute(mlp(permuted, m_splits), row_id_map, probs, backend=backend)
    out.backward(dout)
    return [out.detach(), x.grad, probs.grad, *[p.grad for p in mlp.parameters()]]


@pytest.mark.parametrize("backend, dtype", [("reference", torch.float64), ("torch", torch.float32)])
@pytest.mark.parametrize("pattern, drop", ROUTINGS, ids=[f"{p}-{d or 'dropless'}" for p, d in ROUTINGS])
def test_fused_equals_unfused_on_cpu(backend, dtype, pattern, drop):
    tokens, hidden, ffn, num_experts, top_k = 24, 16, 8, 6, 3
    torch.manual_seed(11)
    mlp = GroupedMLP(num_experts, hidden, ffn, single_grouped_weight=backend == "torch", bias=False,
                     dtype=dtype, backend=backend)
    experts = routed_experts(pattern, tokens, top_k, num_experts, seed=3)
    x = torch.randn(tokens, hidden, dtype=dtype)
    probs = torch.softmax(torch.randn(tokens, top_k, dtype=dtype), -1).to(
        torch.float64 if dtype == torch.float64 else torch.float32)
    dout = torch.randn(tokens, hidden, dtype=dtype)
    expected = run_experts(mlp, "unfused", x, experts, probs, dout, backend, DROPPING.get(drop))
    actual = run_experts(mlp, "fused", x, experts, probs, dout, backend, DROPPING.get(drop))
    names = ["out", "dx", "dprobs", *[n for n, _ in mlp.named_parameters()]]
    for name, a, e in zip(names, actual, expected):
        assert_close_to(a, e.double(), dtype, f"{name}: {backend=} {pattern=} {drop=}")


@pytest.mark.parametrize("split_pattern", ["skewed", "zero_token_experts", "all_to_one"])
def test_grouped_mlp_fused_equals_unfused_with_deferred_and_fused_wgrad_on_cpu(split_pattern):
    torch.manual_seed(12)
    splits = make_splits(split_pattern, 5, 19, seed=1)
    x, dout = torch.randn(19, 12, dtype=torch.float64), torch.randn(19, 12, dtype=torch.float64)
    results = {}
    for path in ("unfused", "fused"):
        torch.manual_seed(13)
        mlp = GroupedMLP(5, 12, 8, fuse_wgrad_accumulation=True, delay_wgrad_compute=True, dtype=torch.float64,
                         backend="reference", experts_path=path)
        for p in mlp.parameters():
            p.main_grad = torch.zeros_like(p)
        xx = x.clone().requires_grad_(True)
        out = mlp(xx, splits)
        out.backward(dout)
        assert all(p.main_grad.abs().sum() == 0 for p in mlp.parameters()), "wgrad was not deferred"
        mlp.backward_dw()
        results[path] = [out.detach(), xx.grad, *[p.main_grad for p in mlp.parameters()]]
    for i, (a, e) in enumerate(zip(results["fused"], results["unfused"])):
        assert_close_to(a, e, torch.float64, f"tensor {i}: {split_pattern}")


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_moe_layer_fused_equals_unfused_including_the_router_on_cpu(capacity_factor):
    torch.manual_seed(14)
    unfused = MoELayer(12, 8, 4, 2, shared_expert_ffn_hidden=6, aux_loss_coeff=0.1, capacity_factor=capacity_factor,
                       dtype=torch.float64, experts_path="unfused")
    fused = copy.deepcopy(unfused)
    fused.experts.experts_path = "fused"
    assert "experts_path=fused" in repr(fused)
    x, dout = torch.randn(2, 9, 12, dtype=torch.float64), torch.randn(2, 9, 12, dtype=torch.float64)
    results = []
    for layer in (unfused, fused):
        xx = x.clone().requires_grad_(True)
        out = layer(xx)
        out.backward(dout)
        results.append([out.detach(), xx.grad, *[p.grad for p in layer.parameters()]])
    names = ["out", "dx", *[n for n, _ in unfused.named_parameters()]]
    for name, a, e in zip(names, results[1], results[0]):
        assert_close_to(a, e, torch.float64, f"{name}: {capacity_factor=}")


def formula(dh_u, g, w, real_rows):
    """float64 autograd: dg of swiglu at g for the gradient w * dh_u, w * h and <dh_u, h>."""
    g = g.detach().double().requires_grad_(True)
    ffn = dh_u.shape[1]
    h = silu(g[:, :ffn]) * g[:, ffn:]
    w = torch.ones(g.shape[0], dtype=torch.float64) if w is None else w.double()
    (dg,) = torch.autograd.grad(h, g, w[:, None] * dh_u.double())
    h = h.detach()
    keep = (torch.arange(g.shape[0]) < real_rows)[:, None]
    return dg * keep, w[:, None] * h * keep, (dh_u.double() * h).sum(-1) * keep[:, 0]


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("splits, weighted", [(None, True), ([3, 0, 4], True), ([2, 9], False), ([0, 0], True)])
def test_weighted_swiglu_backward_matches_the_formula(backend, dtype, splits, weighted):
    torch.manual_seed(15)
    rows, ffn = 11, 6
    g, dh_u = torch.randn(rows, 2 * ffn, dtype=dtype), torch.randn(rows, ffn, dtype=dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    w = torch.rand(rows, dtype=acc) if weighted else None
    m_splits = None if splits is None else torch.tensor(splits)
    real_rows = rows if splits is None else min(sum(splits), rows)
    dg, wh, dprob = swiglu_weighted_backward(dh_u, g, w, m_splits, backend=backend)
    assert dg.dtype == dtype and wh.dtype == dtype and dprob.dtype == acc
    case = f"{backend=} {dtype=} {splits=} {weighted=}"
    # Inputs rounded to dtype, so the float64 formula sees the same values; one rounding step per stored tensor.
    tolerance = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for name, actual, expected in zip(("dg", "wh", "dprob"), (dg, wh, dprob), formula(dh_u, g, w, real_rows)):
        assert torch.all(actual.double()[real_rows:] == 0), f"{name} past the real rows: {case}"
        error = (actual.double() - expected).norm() / expected.norm().clamp(min=1e-30)
        assert error <= tolerance, f"{name}: relative error {error:.2e}: {case}"
    # The in-place op (the fused path's) writes the same values into g and dh_u.
    g2, dh2 = g.clone(), dh_u.clone()
    dprob2 = torch.empty_like(dprob)
    torch.ops.moe_grouped.swiglu_weighted_backward_(dh2, g2, w, m_splits, dprob2, backend)
    assert torch.equal(g2, dg) and torch.equal(dh2, wh) and torch.equal(dprob2, dprob), case


def test_weighted_swiglu_backward_checks_its_arguments():
    g, dh_u = torch.randn(4, 8), torch.randn(4, 4)
    with pytest.raises(ValueError, match=r"g must have shape \[rows, 2 \* ffn\]"):
        swiglu_weighted_backward(dh_u, torch.randn(4, 6))
    with pytest.raises(ValueError, match="weights must be a \\[4\\] torch.float32"):
        swiglu_weighted_backward(dh_u, g, torch.rand(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="m_splits must be"):
        swiglu_weighted_backward(dh_u, g, None, torch.tensor([1.0]))
    with pytest.raises(RuntimeError, match="cuda backend needs CUDA tensors"):
        swiglu_weighted_backward(dh_u, g, backend="cuda")


def test_experts_path_choice_and_its_limits():
    x = torch.randn(6, 8)
    with pytest.raises(ValueError, match="experts_path must be one of"):
        GroupedMLP(2, 8, 4, experts_path="fast")
    # The default fuses only with the cuda backend: on the CPU it stays unfused.
    assert not GroupedMLP(2, 8, 4).uses_fused_path(x)
    assert GroupedMLP(2, 8, 4, experts_path="fused").uses_fused_path(x)
    with pytest.raises(ValueError, match=r"experts_path='fused' cannot run the layers have biases"):
        GroupedMLP(2, 8, 4, bias=True, experts_path="fused").uses_fused_path(x)
    recipe = moe_grouped.fp8.Float8BlockScaling()
    with moe_grouped.fp8.fp8_autocast(recipe):
        assert not GroupedMLP(2, 8, 4).uses_fused_path(x)
        # FP8 runs fused (tests/test_fp8_experts.py), but not a float32 layer.
        with pytest.raises(ValueError, match="cannot run in FP8 here: FP8 GroupedLinear takes bfloat16"):
            GroupedMLP(2, 8, 4, experts_path="fused").uses_fused_path(x)


def test_a_second_backward_through_the_fused_path_fails_loudly():
    torch.manual_seed(16)
    mlp = GroupedMLP(3, 8, 4, dtype=torch.float64, backend="reference", experts_path="fused")
    out = mlp(torch.randn(5, 8, dtype=torch.float64, requires_grad=True), [2, 0, 3])
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


# ---- GPU ----------------------------------------------------------------------


def require_fused_cuda():
    skip_without_cuda_kernels()
    skip_without_cuda_kernels(_core.CAP_SWIGLU, "SwiGLU kernels", entry="mg_swiglu_weighted_backward")


# One unit in the last place of each dtype (a last-bit fp32 difference may round either way).
GATE_RTOL = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 1e-5}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("rows, ffn, splits", [(1, 8, None), (7, 3, None), (300, 96, [100, 0, 57]),
                                               (1000, 1408, [1000]), (64, 100, [10, 20]), (5, 8, [0])])
@pytest.mark.parametrize("weighted", [True, False])
def test_gpu_weighted_swiglu_backward_equals_the_composed_ops(dtype, rows, ffn, splits, weighted):
    require_fused_cuda()
    torch.manual_seed(rows + ffn)
    g = (torch.randn(rows, 2 * ffn, device="cuda") * 3).to(dtype)
    dh_u = torch.randn(rows, ffn, device="cuda").to(dtype)
    w = torch.rand(rows, device="cuda") if weighted else None
    for splits_dtype in (torch.int64, torch.int32):
        m_splits = None if splits is None else torch.tensor(splits, device="cuda", dtype=splits_dtype)
        dg, wh, dprob = swiglu_weighted_backward(dh_u, g, w, m_splits, backend="cuda")
        edg, ewh, edprob = swiglu_weighted_backward(dh_u, g, w, m_splits, backend="torch")
        case = f"{dtype=} {rows=} {ffn=} {splits=} {splits_dtype=} {weighted=}"
        # Same roundings; the gate's gradient may differ in the last fp32 bit before rounding (contraction).
        assert torch.equal(wh, ewh), case
        assert torch.equal(dg[:, ffn:], edg[:, ffn:]), case
        torch.testing.assert_close(dg[:, :ffn], edg[:, :ffn], rtol=GATE_RTOL[dtype], atol=1e-5, msg=case)
        torch.testing.assert_close(dprob, edprob, rtol=1e-4, atol=1e-4 * ffn ** 0.5, msg=case)
        # In place, and the same bits on a second run (deterministic). The in-place op (the fused path's)
        # leaves the rows past the counts as they were: nothing reads them, and a capacity's tail can be
        # most of the buffer.
        real = rows if splits is None else min(sum(splits), rows)
        g2, dh2, dprob2 = g.clone(), dh_u.clone(), torch.empty_like(dprob)
        torch.ops.moe_grouped.swiglu_weighted_backward_(dh2, g2, w, m_splits, dprob2, "cuda")
        assert torch.equal(g2[:real], dg[:real]) and torch.equal(dh2[:real], wh[:real]), case
        assert torch.equal(g2[real:], g[real:]) and torch.equal(dh2[real:], dh_u[real:]), case
        assert torch.equal(dprob2, dprob), case


# GPU layer cases: dropless, capacity by probability (packed), by position (padded).
GPU_DROPPING = {
    "dropless": {},
    "probs-packed": dict(capacity_factor=0.75, drop_policy="probs"),
    "position-padded": dict(capacity_factor=1.0, drop_policy="position", pad_to_capacity=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("capacity", sorted(GPU_DROPPING))
def test_gpu_fused_matches_unfused_and_the_reference(dtype, capacity):
    require_fused_cuda()
    from test_moe_layer import check_layer  # the float64 per-token loops

    torch.manual_seed(17)
    layers = {}
    base = MoELayer(64, 96, 8, 4, shared_expert_ffn_hidden=32, aux_loss_coeff=0.01, single_grouped_weight=True,
                    dtype=dtype, device="cuda", backend="cuda", **GPU_DROPPING[capacity])
    for path in ("fused", "unfused"):
        layers[path] = copy.deepcopy(base)
        layers[path].experts.experts_path = path
    assert base.experts.uses_fused_path(torch.empty(1, 64, dtype=dtype, device="cuda")), "the default must fuse"
    x = torch.randn(2, 48, 64, dtype=dtype, device="cuda")
    results = {}
    for path, layer in layers.items():
        torch.manual_seed(18)  # the same dout in check_layer
        check_layer(layer, x, 0.01, 0.0, 1e-3, f"{path=} {capacity=} {dtype=}")
        results[path] = [p.grad for p in layer.parameters()]
    for name, a, e in zip([n for n, _ in base.named_parameters()], results["fused"], results["unfused"]):
        assert calc_diff(a, e) < 1e-4, f"{name}: fused vs unfused, {capacity=} {dtype=}"


@pytest.mark.gpu
def test_gpu_fused_fc1_reads_the_tokens_through_the_routing_index(monkeypatch):
    """bf16 on the cuda backend: fc1 is the gathered GEMM, so forward makes no permuted copy of x."""
    require_fused_cuda()
    import moe_grouped.experts as experts

    monkeypatch.setattr(experts_sequence, "enabled", False)  # the Python stages' backward, counted below

    calls = {"index": 0, "copy": 0}
    source_rows, gather = experts.source_rows, experts._gather

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)
        return call

    monkeypatch.setattr(experts, "source_rows", counted("index", source_rows))
    monkeypatch.setattr(experts, "_gather", counted("copy", gather))
    layer = MoELayer(64, 96, 8, 4, dtype=torch.bfloat16, device="cuda", backend="cuda")
    x = torch.randn(40, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    out = layer(x)
    assert calls == {"index": 1, "copy": 0}, calls
    out.float().square().sum().backward()
    assert calls["copy"] == 2, calls  # backward: the output gradient for fc2, the tokens for fc1's wgrad
    assert x.grad is not None and torch.isfinite(x.grad).all()


SEQUENCE_CASES = {
    "dropless-grouped": (dict(), True, "skewed"),
    "dropless-per-expert": (dict(), False, "zero_token_experts"),
    "all-to-one": (dict(), True, "all_to_one"),
    "probs-packed": (dict(capacity_factor=0.75, drop_policy="probs"), True, "skewed"),
    "position-padded": (dict(capacity_factor=1.0, drop_policy="position", pad_to_capacity=True), False, "skewed"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", sorted(SEQUENCE_CASES))
@pytest.mark.parametrize("variant", [None, "x", "probs", "fc1", "fc2", "16-bit-probs"])
def test_gpu_sequenced_backward_equals_the_python_stages_bitwise(monkeypatch, dtype, case, variant):
    """The core's sequences (experts_sequence: fc1 and fc2 forward, the backward in two calls) give the
    Python stages' output and gradients bit for bit, with capacity, either weight layout, any of the
    op's inputs without a gradient (``variant``), and routing weights in the tokens' dtype."""
    require_fused_cuda()
    skip_without_cuda_kernels(_core.CAP_EXPERTS_SEQUENCE, "experts sequence kernels")
    drop, single, pattern = SEQUENCE_CASES[case]
    tokens, hidden, ffn, num_experts, top_k = 96, 64, 48, 8, 4
    torch.manual_seed(5)
    mlp = GroupedMLP(num_experts, hidden, ffn, single_grouped_weight=single, dtype=dtype, device="cuda",
                     backend="cuda", experts_path="fused")
    for name in ("fc1", "fc2"):
        if variant == name:
            getattr(mlp, name).requires_grad_(False)
    x = torch.randn(tokens, hidden, dtype=dtype, device="cuda")
    experts = routed_experts(pattern, tokens, top_k, num_experts, seed=3).to("cuda")
    probs = torch.rand(tokens, top_k, device="cuda")
    if variant == "16-bit-probs":  # routing weights in the tokens' dtype, as transformers' routers give them
        probs = probs.to(dtype)
    dout = torch.randn(tokens, hidden, dtype=dtype, device="cuda")
    calls = assert_sequenced_equals_stages(monkeypatch, experts_sequence, mlp, x, probs, experts, dout, drop, variant,
                                           contextlib.nullcontext, f"{case=}, {dtype=}, {variant=}")
    # Forward: the gathered fc1 is bf16 only (fp16 takes the stages); backward: either dtype.
    assert calls == {"forward_fc": int(dtype == torch.bfloat16), "backward": 1}, calls


def assert_sequenced_equals_stages(monkeypatch, module, mlp, x, probs, experts, dout, drop: dict, variant, context,
                                   case: str) -> dict:
    """One forward and backward of ``mlp`` with ``module``'s sequences on, one with them off (the Python
    stages), inside ``context()``: outputs and gradients must be equal bit for bit. Returns how often the
    sequences' ``forward_fc`` and ``backward`` ran."""
    calls = {"forward_fc": 0, "backward": 0}

    def counted(name):
        fn = getattr(module, name)

        def call(*args):
            calls[name] += 1
            return fn(*args)
        return call

    for name in calls:
        monkeypatch.setattr(module, name, counted(name))
    results = {}
    for sequenced in (True, False):
        monkeypatch.setattr(module, "enabled", sequenced)
        for p in mlp.parameters():
            p.grad = None
        xi = x.clone().requires_grad_(variant != "x")
        pi = probs.clone().requires_grad_(variant != "probs")
        row_id_map, m_splits, rows = permute_index(xi, experts, mlp.num_experts, probs=pi.detach(), backend="cuda",
                                                   **drop)
        with context():
            out = mlp.forward_routed(xi, pi, row_id_map, m_splits, rows, zero_unmapped=bool(drop),
                                     permute_backend="cuda")
        out.backward(dout)
        results[sequenced] = [out, xi.grad, pi.grad, *[p.grad for p in mlp.parameters()]]
    for i, (a, e) in enumerate(zip(results[True], results[False])):
        assert (a is None) == (e is None), f"gradient {i}: present in one backward only"
        if a is not None:
            assert torch.equal(a, e), f"gradient {i} differs ({case})"
    assert results[True][1 if variant != "x" else 2] is not None
    return calls


FP8_RECIPES = {
    "E4M3": moe_grouped.fp8.Float8BlockScaling(),
    "HYBRID": moe_grouped.fp8.Float8BlockScaling("HYBRID", pow2_scales=False, amax_epsilon=1e-12),
}


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", sorted(FP8_RECIPES))
@pytest.mark.parametrize("case", sorted(SEQUENCE_CASES))
@pytest.mark.parametrize("variant", [None, "x", "probs", "fc1", "fc2", "16-bit-probs"])
def test_gpu_fp8_sequenced_steps_equal_the_python_stages_bitwise(monkeypatch, recipe, case, variant):
    """In FP8 autocast the core's FP8 stages (moe_grouped.fp8.sequence: two calls forward, eight backward)
    give the Python FP8 stages' output and gradients bit for bit, with capacity, either weight layout,
    any of the op's inputs without a gradient, and routing weights in the tokens' dtype."""
    from moe_grouped.fp8 import sequence

    require_fused_cuda()
    skip_without_cuda_kernels(_core.CAP_EXPERTS_SEQUENCE_FP8, "FP8 experts stages")
    drop, single, pattern = SEQUENCE_CASES[case]
    # ffn 80: h's 1x128 blocks overhang; hidden 192: x's and dx's do.
    tokens, hidden, ffn, num_experts, top_k = 96, 192, 80, 8, 4
    torch.manual_seed(6)
    mlp = GroupedMLP(num_experts, hidden, ffn, single_grouped_weight=single, dtype=torch.bfloat16,
                     device="cuda", backend="cuda", experts_path="fused")
    for name in ("fc1", "fc2"):
        if variant == name:
            getattr(mlp, name).requires_grad_(False)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    experts = routed_experts(pattern, tokens, top_k, num_experts, seed=4).to("cuda")
    probs = torch.rand(tokens, top_k, device="cuda")
    if variant == "16-bit-probs":
        probs = probs.to(torch.bfloat16)
    dout = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    with moe_grouped.fp8.fp8_autocast(recipe=FP8_RECIPES[recipe]):
        assert mlp.uses_fused_path(x)
    calls = assert_sequenced_equals_stages(
        monkeypatch, sequence, mlp, x, probs, experts, dout, drop, variant,
        lambda: moe_grouped.fp8.fp8_autocast(recipe=FP8_RECIPES[recipe]), f"{case=}, {recipe=}, {variant=}",
    )
    assert calls == {"forward_fc": 1, "backward": 1}, calls


class SplitRoutedMoE(nn.Module):
    """A MoE layer whose routing follows given token counts, so the replay harness drives it.

    Copy slot i goes to the expert whose count range holds ``order[i]`` (a
    fixed shuffle); the routing weights are a softmax over a per-slot linear
    gate (no gather, whose backward would sum with atomics), so their
    gradient reaches a parameter through the fused combine.
    """

    def __init__(self, tokens, hidden, ffn, num_experts, top_k, **drop):
        super().__init__()
        self.num_experts, self.top_k, self.drop = num_experts, top_k, drop
        self.gate = nn.Linear(hidden, top_k, bias=False, dtype=torch.bfloat16, device="cuda")
        self.experts = GroupedMLP(num_experts, hidden, ffn, single_grouped_weight=True, dtype=torch.bfloat16,
                                  device="cuda", backend="cuda", experts_path="fused")
        order = torch.randperm(tokens * top_k, generator=torch.Generator().manual_seed(0))
        self.register_buffer("order", order.to("cuda"))

    def forward(self, x, splits):
        slots = torch.arange(self.order.numel(), device=x.device)
        ends = torch.cumsum(splits, 0)
        expert_of_slot = torch.searchsorted(ends, slots, right=True).clamp_(max=self.num_experts - 1)
        experts = expert_of_slot.index_select(0, self.order).view(-1, self.top_k)
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        row_id_map, m_splits, rows = permute_index(x, experts, self.num_experts, probs=probs.detach(),
                                                   backend="cuda", **self.drop)
        return self.experts.forward_routed(x, probs, row_id_map, m_splits, rows,
                                           zero_unmapped=bool(self.drop), permute_backend="cuda")


# Two shapes scaled down from the benchmark's: fine-grained (Qwen3-like) and Mixtral-like with dropping.
REPLAY_SHAPES = {
    "qwen3_like": (dict(tokens=512, hidden=256, ffn=128, num_experts=32, top_k=8), {}),
    "mixtral_like_dropping": (dict(tokens=256, hidden=256, ffn=512, num_experts=8, top_k=2),
                              dict(capacity_factor=1.0, drop_policy="probs")),
}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(REPLAY_SHAPES))
def test_gpu_fused_capture_replays_new_routing_bitwise_1000_times(shape):
    require_fused_cuda()
    from graphs import testing

    torch.manual_seed(19)
    sizes, drop = REPLAY_SHAPES[shape]
    module = SplitRoutedMoE(**sizes, **drop)
    total = sizes["tokens"] * sizes["top_k"]
    splits = torch.tensor(make_splits("balanced", sizes["num_experts"], total), device="cuda")
    x = torch.randn(sizes["tokens"], sizes["hidden"], dtype=torch.bfloat16, device="cuda", requires_grad=True)
    report = testing.check_replay(module, (x, splits), num_replays=1000, captures=1, exact=True, timeout_s=60)
    assert len(report.patterns) > 1, report


@pytest.mark.gpu
def test_gpu_fused_path_keeps_fewer_bytes():
    require_fused_cuda()
    torch.manual_seed(20)
    base = MoELayer(512, 128, 32, 8, router_options=dict(score_function="softmax"), single_grouped_weight=True,
                    dtype=torch.bfloat16, device="cuda", backend="cuda")
    x = torch.randn(4096, 512, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    peaks = peak_step_bytes_per_path(base, x, torch.randn_like(x))
    assert peaks["fused"] <= 0.8 * peaks["unfused"], peaks
