"""Split patterns, shapes and the float64 oracle shared by the tests.

The oracle is deliberately independent of the package: explicit loops over
Python-int boundaries in float64 on the CPU.
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch

import moe_grouped
from moe_grouped import _core

SPLIT_PATTERNS = ("balanced", "skewed", "zero_token_experts", "all_to_one", "single_token_groups")


def make_splits(pattern: str, num_experts: int, total: int, seed: int = 0) -> list[int]:
    """Token counts per expert that sum to ``total``."""
    gen = torch.Generator().manual_seed(seed)
    if pattern == "balanced":
        base = [total // num_experts] * num_experts
        for i in range(total - sum(base)):
            base[i] += 1
        return base
    if pattern == "skewed":
        weights = (torch.randn(num_experts, generator=gen) * 1.5).exp()  # log-normal
        return _apportion(weights, total)
    if pattern == "zero_token_experts":
        weights = torch.rand(num_experts, generator=gen) + 0.1
        weights[::2] = 0  # every other expert gets nothing
        if num_experts == 1:
            weights[0] = 1
        return _apportion(weights, total)
    if pattern == "all_to_one":
        counts = [0] * num_experts
        counts[int(torch.randint(num_experts, (1,), generator=gen))] = total
        return counts
    if pattern == "single_token_groups":
        counts = [1] * min(num_experts, total) + [0] * max(0, num_experts - total)
        counts[-1] += total - sum(counts)
        return counts
    raise ValueError(f"unknown split pattern {pattern!r}")


def _apportion(weights: torch.Tensor, total: int) -> list[int]:
    shares = weights / weights.sum() * total
    counts = [int(math.floor(s)) for s in shares.tolist()]
    order = sorted(range(len(counts)), key=lambda i: -(shares[i].item() - counts[i]))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def bounds(splits: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for count in splits:
        out.append((start, start + count))
        start += count
    return out


def as_expert_list(weights) -> list[torch.Tensor]:
    if len(weights) == 1 and weights[0].dim() == 3:
        return list(weights[0].unbind(0))
    return list(weights)


def oracle_fprop(x, weights, splits, bias=None):
    ws = [w.detach().double().cpu() for w in as_expert_list(weights)]
    xd = x.detach().double().cpu()
    out = torch.zeros(x.shape[0], ws[0].shape[0], dtype=torch.float64)
    for e, (s, t) in enumerate(bounds(splits)):
        out[s:t] = xd[s:t] @ ws[e].t()
        if bias is not None:
            out[s:t] += bias[e].detach().double().cpu()
    return out


def oracle_dgrad(dy, weights, splits):
    ws = [w.detach().double().cpu() for w in as_expert_list(weights)]
    dyd = dy.detach().double().cpu()
    out = torch.zeros(dy.shape[0], ws[0].shape[1], dtype=torch.float64)
    for e, (s, t) in enumerate(bounds(splits)):
        out[s:t] = dyd[s:t] @ ws[e]
    return out


def oracle_wgrad(dy, x, splits):
    dyd, xd = dy.detach().double().cpu(), x.detach().double().cpu()
    return torch.stack([dyd[s:t].t() @ xd[s:t] for s, t in bounds(splits)])


def oracle_dbias(dy, splits):
    dyd = dy.detach().double().cpu()
    return torch.stack([dyd[s:t].sum(0) for s, t in bounds(splits)])


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - cosine-like similarity (DeepGEMM's metric); 0 for identical tensors."""
    x, y = x.double().cpu(), y.double().cpu()
    denominator = (x * x + y * y).sum()
    if denominator == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denominator)


# Relative error bounds per dtype against the float64 oracle.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def assert_close_to(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, case: str) -> None:
    actual = actual.detach().double().cpu()
    assert actual.shape == expected.shape, f"{case}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{case}: non-finite values"
    scale = expected.norm().item()
    error = (actual - expected).norm().item()
    if scale == 0:
        assert error == 0, f"{case}: expected zeros, got norm {error}"
        return
    assert error / scale <= TOLERANCE[dtype], f"{case}: relative error {error / scale:.3e} > {TOLERANCE[dtype]:.0e}"


NO_GPU = "needs a CUDA GPU; none is visible"


def cuda_kernels_reason(
    capability: int = _core.CAP_GROUPED_GEMM_16BIT, kernels: str = "grouped GEMM kernels", *, entry: str = ""
) -> Optional[str]:
    """Why the core's ``kernels`` (the family behind ``capability``, a ``_core.CAP_*`` bit) cannot be
    tested here, or None when they can: no visible GPU, no core, a core built without them, a GPU
    they were not built for, or (``entry``) a core that predates that C function.

    The one skip rule of the GPU tests: use it as ``@needs_cuda_kernels(...)`` on a test or
    parameter, or ``skip_without_cuda_kernels(...)`` inside one."""
    if not torch.cuda.is_available():
        return NO_GPU
    reason = moe_grouped.backends.core_kernels_unavailable_reason(torch.device("cuda"), capability, kernels)
    if reason is None and entry and not hasattr(_core.lib, entry):
        reason = f"the core at {_core.library_path} predates {entry}; rebuild the package"
    return reason


def needs_cuda_kernels(
    capability: int = _core.CAP_GROUPED_GEMM_16BIT, kernels: str = "grouped GEMM kernels", *, entry: str = ""
) -> pytest.MarkDecorator:
    """A skip mark with :func:`cuda_kernels_reason`'s reason (evaluated at collection)."""
    reason = cuda_kernels_reason(capability, kernels, entry=entry)
    return pytest.mark.skipif(reason is not None, reason=str(reason))


def skip_without_cuda_kernels(
    capability: int = _core.CAP_GROUPED_GEMM_16BIT, kernels: str = "grouped GEMM kernels", *, entry: str = ""
) -> None:
    """Skips the running test with :func:`cuda_kernels_reason`'s reason, if there is one."""
    reason = cuda_kernels_reason(capability, kernels, entry=entry)
    if reason is not None:
        pytest.skip(reason)


def gpu_backends(capability: int = _core.CAP_GROUPED_GEMM_16BIT, kernels: str = "grouped GEMM kernels") -> list[str]:
    """The graph-safe backends a GPU test runs: ``torch``, and ``cuda`` where its kernels can run."""
    return ["torch"] + (["cuda"] if cuda_kernels_reason(capability, kernels) is None else [])


def backends_for(device: str, dtype: torch.dtype = None) -> list[str]:
    """The backends to check on ``device`` (in ``dtype``): cuda only where it can run."""
    names = ["reference", "torch"]
    if device == "cuda" and cuda_kernels_reason() is None:
        if dtype is None or dtype in moe_grouped.gemm.cuda_backend.SUPPORTED_DTYPES:
            names.append("cuda")
    return names


def layer_train_step(layer):
    """``step(x, dout)`` for a capture test: the layer's forward and backward, returning the
    output, the routing's tokens per expert and every parameter's gradient."""
    params = list(layer.parameters())

    def step(x, dout):
        for p in params:
            p.grad = None
        out = layer(x)
        out.backward(dout)
        return [out.detach(), layer.last_routing.tokens_per_expert, *[p.grad for p in params]]

    return step


def interleaved_microbatches(f1, f2, f3, f4, params, a, b) -> list[torch.Tensor]:
    """Two layers' steps on microbatches ``a`` (f1 then f2) and ``b`` (f3 then f4), each ``(x, m_splits, dy)``,
    in make_graphed_callables' ``order=[1, 2, 3, -2, -1, 4, -4, -3]``: F(l1,a) F(l2,a) F(l1,b) B(l2,a) B(l1,a)
    F(l2,b) B(l2,b) B(l1,b). Returns both outputs, both inputs' gradients and ``params``' gradients (copies)."""
    for p in params:
        p.grad = None
    (xa, sa, dya), (xb, sb, dyb) = a, b
    xa, xb = xa.clone().requires_grad_(True), xb.clone().requires_grad_(True)
    ya = f2(f1(xa, sa), sa)
    hb = f3(xb, sb)
    ya.backward(dya)
    yb = f4(hb, sb)
    yb.backward(dyb)
    return [ya.detach().clone(), yb.detach().clone(), xa.grad, xb.grad, *[p.grad.clone() for p in params]]


def assert_captured_safely(graph) -> dict:
    """The captured graph has no host node, host copy, allocation or free; returns its node counts."""
    from moe_grouped.graphs import inspect as graph_inspect

    counts = graph_inspect.summary(graph_inspect.assert_graph_safe(graph))
    assert not any(kind.startswith(("mem_alloc", "mem_free", "host")) for kind in counts), counts
    return counts


def reset_grads(layer) -> None:
    """An MoE layer's gradients to None; with fused wgrad accumulation, zeroed fp32 ``main_grad``
    on the expert weights (where backward accumulates)."""
    layer.zero_grad(set_to_none=True)
    if layer.experts.fc1.fuse_wgrad_accumulation:
        for linear in (layer.experts.fc1, layer.experts.fc2):
            for weight in linear.weights():
                weight.main_grad = torch.zeros_like(weight, dtype=torch.float32)


def capture_after_a_step(step, steps_before: int = 1):
    """``(graph, outputs)``: ``step`` run ``steps_before`` times on a side stream (workspaces grow outside
    capture), then captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(steps_before):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs



# Token dropping options of the GPU layer tests: dropless, and capacity with each policy.
CAPACITY_OPTIONS = {
    "dropless": {},
    "probs-packed": dict(capacity_factor=0.75, drop_policy="probs"),
    "position-padded": dict(capacity_factor=1.0, drop_policy="position", pad_to_capacity=True),
    "zero-capacity": dict(capacity_factor=0.0),  # every copy dropped: the experts see no rows
}

def peak_step_bytes_per_path(base, x, dout, forward=lambda layer, x: layer(x)) -> dict:
    """Peak bytes allocated by one training step of a copy of MoELayer ``base`` on each experts path, beyond
    what was allocated before it (the second of two steps: workspaces and caches exist)."""
    import copy

    peaks = {}
    for path in ("unfused", "fused"):
        layer = copy.deepcopy(base)
        layer.experts.experts_path = path
        for _ in range(2):
            for p in [x, *layer.parameters()]:
                p.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            forward(layer, x).backward(dout)
            torch.cuda.synchronize()
            peaks[path] = torch.cuda.max_memory_allocated() - start
        del layer
    return peaks
