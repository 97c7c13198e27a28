"""The replay regression harness: replay == eager, whatever the allocation history.

:func:`check_replay` captures a callable (forward, backward, delayed wgrad)
with :func:`make_graphed_callables`, then for N replays draws new token
splits (balanced, skewed, zero-token experts, all tokens to one expert) and
new inputs, runs the graphs and an eager reference on them, and compares
outputs, input gradients, parameter ``.grad`` and ``main_grad``:

(a) bitwise with ``exact=True`` (deterministic kernels), else within
    ``rtol``/``atol``;
(b) over several independent captures (``captures``), the later ones taken
    with the caching allocator perturbed before and between captures, and
    with the allocator perturbed (blocks allocated, poisoned, freed or held)
    before every run, so a result that depends on allocation history (a
    per-call scratch buffer read after its block was reused) differs;
(c) under a watchdog: a run whose GPU work does not finish within
    ``timeout_s`` raises :class:`ReplayTimeout` instead of hanging the suite.

Failures raise :class:`ReplayMismatch` (an ``AssertionError``, so pytest
reports it as a test failure) naming the replay, split pattern, splits and
tensor.
"""

from __future__ import annotations

import collections
import contextlib
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.utils._pytree as pytree

from . import callables as _callables
from . import nvtx
from .callables import GraphedCallable, make_graphed_callables
from .splits import PATTERNS, split_stream


class ReplayMismatch(AssertionError):
    """Replayed results differ from the eager reference."""


class ReplayTimeout(AssertionError):
    """A replay (or the eager reference) did not finish within the watchdog's timeout."""


@dataclass
class ReplayReport:
    """What :func:`check_replay` ran and found."""

    replays: int = 0
    captures: int = 0
    runs: int = 0
    tensors_compared: int = 0
    mismatches: int = 0
    max_abs_diff: float = 0.0
    patterns: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


@contextlib.contextmanager
def watchdog(timeout_s: float, what: str = "the replay"):
    """Fails with :class:`ReplayTimeout` if the GPU work queued inside does not finish in time.

    Work is asynchronous: the body only queues it, and on exit an event
    recorded on the current stream is polled until it completes or
    ``timeout_s`` passes. A hung kernel then becomes a test failure; the GPU
    stays busy with it, so run hang-prone cases in a subprocess.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    start = time.monotonic()
    yield
    event = torch.cuda.Event()
    event.record()
    deadline = start + timeout_s
    pause = 1e-5
    while not event.query():
        if time.monotonic() > deadline:
            raise ReplayTimeout(
                f"{what} did not finish within {timeout_s:.3g} s (GPU work still running: a hung "
                "kernel, e.g. a grid-sync flag left set in a shared workspace)"
            )
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


class AllocatorPerturber:
    """Changes the caching allocator's state without touching live tensors.

    ``perturb()`` allocates blocks of assorted sizes in the default pool,
    poisons them (NaN / 0xFF bytes), frees some and holds others (a bounded,
    rotating set). ``perturb_pool(pool)`` does the same inside a graph pool by
    capturing a throw-away graph (never replayed) that allocates and frees
    blocks there, changing which blocks later captures get.
    """

    SIZES = (512, 2048, 8192, 65536, 1 << 20, 3 << 20)

    def __init__(self, seed: int, device: torch.device, max_held: int = 32):
        self.random = random.Random(seed)
        self.device = device
        self.held: collections.deque = collections.deque(maxlen=max_held)
        self.dummy_graphs: list = []

    def _blocks(self) -> list[torch.Tensor]:
        count = self.random.randint(1, 6)
        return [torch.empty(self.random.choice(self.SIZES), dtype=torch.uint8, device=self.device) for _ in range(count)]

    def perturb(self) -> None:
        for block in self._blocks():
            block.fill_(0xFF)  # poison: reads of a freed block show up as NaN/garbage
            if self.random.random() < 0.5:
                self.held.append(block)

    def perturb_pool(self, pool) -> None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            for block in self._blocks():
                block.fill_(0)  # a node, so the throw-away graph is not empty (it never replays)
                if self.random.random() < 0.5:
                    self.held.append(block)
        self.dummy_graphs.append(graph)


@contextlib.contextmanager
def _perturbing_captures(perturber: Optional[AllocatorPerturber]):
    if perturber is None:
        yield
        return
    _callables._between_captures.append(perturber.perturb_pool)
    try:
        yield
    finally:
        _callables._between_captures.remove(perturber.perturb_pool)


def _params(function) -> list[torch.Tensor]:
    return list(function.parameters()) if isinstance(function, torch.nn.Module) else []


def _delayed(function) -> list[torch.nn.Module]:
    return _callables._delayed_wgrad_modules(function if isinstance(function, torch.nn.Module) else None)


def _main_grad_baseline(params: Sequence[torch.Tensor]) -> list[Optional[torch.Tensor]]:
    return [p.main_grad.clone() if isinstance(getattr(p, "main_grad", None), torch.Tensor) else None for p in params]


def _reset_grads(params: Sequence[torch.Tensor], baseline) -> None:
    with torch.no_grad():
        for param, main_grad in zip(params, baseline):
            param.grad = None
            if main_grad is not None:
                param.main_grad.copy_(main_grad)


def _collect(outputs, inputs, params, baseline) -> list[tuple[str, Optional[torch.Tensor]]]:
    results = [(f"output {i}", o.detach().clone()) for i, o in enumerate(pytree.tree_leaves(outputs))]
    for i, tensor in enumerate(inputs):
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            results.append((f"grad of argument {i}", None if tensor.grad is None else tensor.grad.clone()))
    for i, (param, main_grad) in enumerate(zip(params, baseline)):
        results.append((f"parameter {i} .grad", None if param.grad is None else param.grad.clone()))
        if main_grad is not None:
            results.append((f"parameter {i} .main_grad", param.main_grad.clone()))
    return results


def _run(function, inputs, grad_outputs_fn, delayed_modules, graphed: Optional[GraphedCallable]):
    outputs = function(*inputs)
    differentiable = [o for o in pytree.tree_leaves(outputs) if isinstance(o, torch.Tensor) and o.requires_grad]
    if differentiable:
        torch.autograd.backward(differentiable, grad_outputs_fn(differentiable))
        if graphed is not None and graphed.wgrad_graph is not None:
            graphed.backward_dw()
        elif graphed is None:
            for module in delayed_modules:
                module.backward_dw()
    return outputs


def _differ(a: Optional[torch.Tensor], b: Optional[torch.Tensor], exact: bool, rtol: float, atol: float) -> Optional[str]:
    if a is None or b is None:
        return None if a is None and b is None else f"one side is None (replay {a is None}, reference {b is None})"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"replay has shape {tuple(a.shape)} {a.dtype}, reference {tuple(b.shape)} {b.dtype}"
    if exact:
        same = torch.equal(a, b)
    else:
        same = torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol, equal_nan=False)
    if same:
        return None
    diff = (a.double() - b.double()).abs()
    finite = torch.isfinite(diff)
    worst = diff[finite].max().item() if finite.any() else float("nan")
    return f"max |diff| {worst:.3e}, {int((~finite).sum())} non-finite, {int((diff != 0).sum())} of {diff.numel()} differ"


def check_replay(
    function: Callable,
    sample_args: Sequence[torch.Tensor],
    *,
    splits_index: int = 1,
    patterns: Sequence[str] = PATTERNS,
    num_replays: int = 100,
    reference: Optional[Callable] = None,
    exact: bool = True,
    rtol: float = 1e-2,
    atol: float = 1e-2,
    captures: int = 2,
    perturb: bool = True,
    timeout_s: float = 60.0,
    seed: int = 0,
    raise_on_mismatch: bool = True,
) -> ReplayReport:
    """Replays ``function`` with new splits and compares with eager runs.

    Args:
        function: a module or function ``f(*args)`` with the token counts at
            ``args[splits_index]``.
        sample_args: CUDA sample arguments (shapes and dtypes of every call).
            Floating-point arguments get fresh random values at every replay
            (with the sample's ``requires_grad``), the splits new counts, the
            rest keeps the sample.
        patterns: split patterns to cycle through (:data:`graphs.splits.PATTERNS`).
        num_replays: replays per capture.
        reference: the eager oracle, same signature and the same parameters in
            the same order (values, ``main_grad``); default: ``function`` itself.
        exact: compare bitwise; otherwise with ``rtol``/``atol``.
        captures: independent captures; all but the first are taken with the
            allocator perturbed before and between the captures.
        perturb: perturb the allocator before every run too.
        timeout_s: watchdog per run.
        seed: for splits, inputs and perturbations.
        raise_on_mismatch: raise :class:`ReplayMismatch` at the end if any
            tensor differed (otherwise only report).

    Parameters' ``main_grad`` (when present) is restored to its value at the
    start before every run, so fused accumulation is checked from the same
    base each time; ``.grad`` is reset to None.

    .. warning::
        Preconditions: ``function`` meets :func:`make_graphed_callables`'
        (CUDA inputs, graph-safe ops); the reference's parameters equal the
        function's; kernels must be deterministic for ``exact=True``. The
        function's parameters get ``.grad`` values and its delayed-wgrad
        modules are drained; ``main_grad`` is left at its starting value.
    """
    if not isinstance(sample_args, (tuple, list)) or not 0 <= splits_index < len(sample_args):
        raise ValueError(
            f"splits_index {splits_index} must index sample_args, which has "
            f"{len(sample_args) if isinstance(sample_args, (tuple, list)) else 'no'} entries"
        )
    sample_splits = sample_args[splits_index]
    if not isinstance(sample_splits, torch.Tensor) or sample_splits.dim() != 1 or sample_splits.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"sample_args[{splits_index}] must be a 1-D int32/int64 tensor of token counts, got {sample_splits!r}")
    for name, value in (("num_replays", num_replays), ("captures", captures)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    device = sample_splits.device
    reference = function if reference is None else reference
    # The static total: whatever the sample counts sum to (read once, before any capture).
    total = int(sample_splits.sum())
    num_experts = sample_splits.numel()

    params, reference_params = _params(function), _params(reference)
    if len(params) != len(reference_params):
        raise ValueError(
            f"the reference has {len(reference_params)} parameters but the function has {len(params)}; "
            "they must match one to one"
        )
    baseline, reference_baseline = _main_grad_baseline(params), _main_grad_baseline(reference_params)
    delayed_reference = _delayed(reference)

    graphed: list[GraphedCallable] = []
    perturbers: list[AllocatorPerturber] = []
    for capture in range(captures):
        perturber = AllocatorPerturber(seed * 1000 + capture, device) if capture > 0 else None
        pool = torch.cuda.graph_pool_handle()
        if perturber is not None:
            perturber.perturb()
            perturber.perturb_pool(pool)
        with nvtx.range("graphs.testing.capture"), _perturbing_captures(perturber):
            graphed.append(make_graphed_callables(function, tuple(sample_args), pool=pool))
        perturbers.append(perturber or AllocatorPerturber(seed * 1000 + captures, device))
        _reset_grads(params, baseline)

    report = ReplayReport(captures=captures)
    generator = torch.Generator(device=device).manual_seed(seed)
    splits = split_stream(patterns, num_experts, total, seed=seed, device="cpu", dtype=sample_splits.dtype)

    def fresh_inputs(new_splits: torch.Tensor) -> list:
        inputs = []
        for i, sample in enumerate(sample_args):
            if i == splits_index:
                inputs.append(new_splits.to(device, non_blocking=False))
            elif isinstance(sample, torch.Tensor) and sample.is_floating_point():
                value = torch.randn(sample.shape, generator=generator, device=device, dtype=sample.dtype)
                inputs.append(value.requires_grad_(sample.requires_grad))
            else:
                inputs.append(sample)
        return inputs

    def clone_inputs(inputs: list) -> list:
        return [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs]

    for replay in range(num_replays):
        pattern, new_splits = next(splits)
        report.patterns[pattern] = report.patterns.get(pattern, 0) + 1
        inputs = fresh_inputs(new_splits)
        grad_seed = int(torch.randint(1 << 62, (1,), generator=torch.Generator().manual_seed(seed * 7919 + replay)))

        def grad_outputs(tensors, grad_seed=grad_seed):
            g = torch.Generator(device=device).manual_seed(grad_seed)
            return [torch.randn(t.shape, generator=g, device=device, dtype=t.dtype) for t in tensors]

        _reset_grads(reference_params, reference_baseline)
        eager_inputs = clone_inputs(inputs)
        with nvtx.range("graphs.testing.eager"), watchdog(timeout_s, f"the eager reference run (replay {replay})"):
            if perturb:
                perturbers[0].perturb()
            outputs = _run(reference, eager_inputs, grad_outputs, delayed_reference, None)
        expected = _collect(outputs, eager_inputs, reference_params, reference_baseline)
        del outputs

        for capture, graph in enumerate(graphed):
            _reset_grads(params, baseline)
            replay_inputs = clone_inputs(inputs)
            with nvtx.range("graphs.testing.replay"), watchdog(timeout_s, f"replay {replay} of capture {capture}"):
                if perturb:
                    perturbers[capture].perturb()
                outputs = _run(graph, replay_inputs, grad_outputs, (), graph)
            actual = _collect(outputs, replay_inputs, params, baseline)
            del outputs
            report.runs += 1
            for (name, got), (_, want) in zip(actual, expected):
                report.tensors_compared += 1
                problem = _differ(got, want, exact, rtol, atol)
                if problem is None:
                    continue
                report.mismatches += 1
                if got is not None and want is not None and got.shape == want.shape:
                    diff = (got.double() - want.double()).abs()
                    diff = diff[torch.isfinite(diff)]
                    if diff.numel():
                        report.max_abs_diff = max(report.max_abs_diff, float(diff.max()))
                if len(report.failures) < 5:
                    report.failures.append(
                        f"replay {replay} (capture {capture}, {pattern} splits {new_splits.tolist()}): {name}: {problem}"
                    )
        report.replays += 1

    _reset_grads(params, baseline)
    _reset_grads(reference_params, reference_baseline)
    if report.mismatches and raise_on_mismatch:
        raise ReplayMismatch(
            f"{report.mismatches} of {report.tensors_compared} compared tensors differ between replay "
            f"and the eager reference over {report.replays} replays x {captures} captures "
            f"({'bitwise' if exact else f'rtol={rtol}, atol={atol}'}); first: " + " | ".join(report.failures)
        )
    return report


__all__ = [
    "check_replay",
    "ReplayReport",
    "ReplayMismatch",
    "ReplayTimeout",
    "AllocatorPerturber",
    "watchdog",
]
