"""What every benchmark shares: its command line and prologue, timing, and the results file.

A benchmark's ``main()`` starts with ``args = prologue(cli(__doc__, SHAPES))``:
the command line is parsed first (``--help`` needs no GPU), then it exits
unless torch sees a CUDA GPU, then the clocks are brought up from idle. Its
rows go to ``benchmarks/results/<bench>-<gpu>.json`` by :func:`write_results`.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pathlib
import statistics
import time
from dataclasses import dataclass

import torch

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
NUM_INPUTS = 4  # distinct (x, dout) pairs a layer's steps cycle through: new routing every step


def gpu_tag() -> str:
    name = torch.cuda.get_device_name().lower()
    for tag in ("h100", "h200", "h800", "a100"):
        if tag in name:
            return tag
    return name.replace(" ", "_")


class L2Flush:
    """Writes a buffer larger than L2 so that each timed run starts cold."""

    def __init__(self, megabytes: int = 256):
        self.buffer = torch.empty(megabytes * (1 << 20) // 4, dtype=torch.int32, device="cuda")

    def __call__(self) -> None:
        self.buffer.zero_()


def run_ms(fn, flush: L2Flush | None = None) -> float:
    """Milliseconds of one CUDA-event-timed ``fn()``, after an L2 flush if given."""
    if flush is not None:
        flush()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_ms(fn, *, warmup: int = 5, repeats: int = 30, flush: L2Flush | None = None) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` CUDA-event-timed runs."""
    for _ in range(warmup):
        fn()
    return statistics.median(run_ms(fn, flush) for _ in range(repeats))


def wall_ms(step, steps: int = 10) -> float:
    """Milliseconds per step of ``steps`` steps issued back to back."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / steps


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def graphed(fn, *, warmup: int = 3):
    """``fn`` captured once in a CUDA graph; returns the replay callable.

    Timing the replay leaves out the host's launch cost (Python, autograd,
    ctypes): the GPU time a captured training step spends in ``fn``. Warm-up
    runs on a side stream first, as capture requires.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    def replay() -> None:
        graph.replay()

    # The graph reads fn's tensors at every replay, and fn is often their only owner (a lambda over
    # operands made for it), so the replay keeps fn alive.
    replay.keeps = fn
    return replay


# The block scalings a dense stand-in can run with: (A's, B's) blocks, as torch._scaled_mm names them.
# "1x128_128x128" is fprop's and dgrad's recipe (activations or gradients by weights), "1x128_1x128" the
# wgrad's (both operands scaled per 128 along the reduction).
BLOCK_SCALINGS = ("1x128_128x128", "1x128_1x128")


def _block_scales(rows: int, cols: int, depth: int, scaling: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Random positive scales for A [rows, depth] and B [depth, cols] in the layouts _scaled_mm's block
    scalings take: A's 1x128 scales [rows, depth/128] column-major (stride (1, rows)); B's 1x128
    [depth/128, cols] row-major, B's 128x128 [depth/128, cols/128] column-major."""
    if depth % 128 or (scaling == "1x128_128x128" and cols % 128):
        raise ValueError(f"block scaling {scaling} needs whole 128-blocks: depth {depth}, cols {cols}")
    blocks = depth // 128
    scale_a = (torch.rand(blocks, rows, device="cuda") + 0.5).t()
    if scaling == "1x128_1x128":
        scale_b = torch.rand(blocks, cols, device="cuda") + 0.5
    elif scaling == "1x128_128x128":
        scale_b = (torch.rand(cols // 128, blocks, device="cuda") + 0.5).t()
    else:
        raise ValueError(f"unknown block scaling {scaling!r}; known: {BLOCK_SCALINGS}")
    return scale_a, scale_b


def _expand_scales(scale_a, scale_b, scaling: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-element scales of A and B that ``_block_scales`` describes, for checking a product."""
    a = scale_a.repeat_interleave(128, dim=1)
    b = scale_b.repeat_interleave(128, dim=0)
    if scaling == "1x128_128x128":
        b = b.repeat_interleave(128, dim=1)
    return a, b


_checked_scalings: set[str] = set()


def _check_block_scaling(scaling: str) -> None:
    """Once per scaling: a small block-scaled _scaled_mm against the dequantized product, so that a
    stand-in never times a layout torch reads differently from the one meant."""
    if scaling in _checked_scalings:
        return
    rows, cols, depth = 256, 384, 512
    a = torch.randn(rows, depth, device="cuda").to(torch.float8_e4m3fn)
    bt = torch.randn(cols, depth, device="cuda").to(torch.float8_e4m3fn)
    scale_a, scale_b = _block_scales(rows, cols, depth, scaling)
    got = torch._scaled_mm(a, bt.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
    sa, sb = _expand_scales(scale_a, scale_b, scaling)
    want = (a.float() * sa) @ (bt.t().float() * sb)
    err = ((got - want).norm() / want.norm()).item()
    if err > 1e-3:
        raise RuntimeError(f"torch._scaled_mm with {scaling} scaling is off by {err:.2e} from the "
                           "dequantized product: the scale layouts here are not the ones it reads")
    _checked_scalings.add(scaling)


def dense_fp8_matmul(rows: int, cols: int, depth: int, scaling: str = "tensor"):
    """One ``torch._scaled_mm`` of random E4M3 [rows, depth] x [depth, cols] into bfloat16.

    ``scaling="tensor"``: one scale per tensor, the tensor cores' FP8 rate for a GEMM of those FLOPs
    without block scaling or groups. One of ``BLOCK_SCALINGS``: the same GEMM with the recipe's block
    scales promoted at every 128-deep block (cuBLAS's kernels, CUDA 12.9 or later), checked once
    against the dequantized product.
    """
    a = torch.randn(rows, depth, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(cols, depth, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm takes B
    if scaling == "tensor":
        scale_a = scale_b = torch.ones((), device="cuda")
    else:
        _check_block_scaling(scaling)
        scale_a, scale_b = _block_scales(rows, cols, depth, scaling)
    return lambda: torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)


def forced(env: dict, fn):
    """``fn`` run (and captured) with ``env`` set for the core; ``fn`` itself for an empty one (the core's choice)."""
    if not env:
        return fn

    def run():
        os.environ.update(env)
        try:
            return fn()
        finally:
            for name in env:
                os.environ.pop(name)
    return run


def timed_rounds(runs: dict, rounds: int, flush: L2Flush, per_round: int) -> dict:
    """Backend -> CUDA-event milliseconds of each run; backends alternate order every round.

    Each runs once first, untimed: a graph's first replay also uploads it.
    """
    for run in runs.values():
        run()
    times = {backend: [] for backend in runs}
    for r in range(rounds):
        for backend in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            times[backend] += [run_ms(runs[backend], flush) for _ in range(per_round)]
    return times


@dataclass
class Shape:
    """An MoE layer's sizes and the tokens of one step; ``label`` names its result rows."""

    name: str
    hidden: int
    ffn: int
    experts: int
    top_k: int
    tokens: int

    @property
    def label(self) -> str:
        return f"{self.name}_H{self.hidden}_F{self.ffn}_E{self.experts}_k{self.top_k}_T{self.tokens}"

    def flops(self) -> float:
        """The expert GEMMs of one training step: fc1 (2 * ffn outputs) and fc2, forward, dgrad and wgrad."""
        return 18.0 * self.tokens * self.top_k * self.hidden * self.ffn


def step_inputs(size: tuple, seed: int = 1, x_requires_grad: bool = False) -> list[tuple]:
    """:data:`NUM_INPUTS` pairs (x, dout) of bf16 ``torch.randn`` of ``size`` on the GPU, from one generator."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [
        (torch.randn(*size, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(x_requires_grad),
         torch.randn(*size, device="cuda", dtype=torch.bfloat16, generator=gen))
        for _ in range(NUM_INPUTS)
    ]


class Steps:
    """Training steps of ``module`` on its cycled ``inputs`` (a subclass defines ``fwd_bwd(x, dout)``).

    :meth:`eager` runs the next pair; :meth:`replay_of` a step captured with
    ``moe_grouped.graphs.capture_step``, which copies the next pair in and
    replays. Both walk the same cycle.
    """

    def __init__(self, module, inputs):
        self.inputs = inputs
        self.params = list(module.parameters())
        self.index = 0

    def clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def next_inputs(self) -> tuple:
        x, dout = self.inputs[self.index % NUM_INPUTS]
        self.index += 1
        return x, dout

    def eager(self) -> None:
        self.fwd_bwd(*self.next_inputs())

    def first_eager_s(self) -> float:
        """Seconds of one :meth:`eager` step to its end (a slow backend's first step: whether to time it)."""
        torch.cuda.synchronize()
        start = time.perf_counter()
        self.eager()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def replay_of(self, static):
        def replay() -> None:
            static(*self.next_inputs())  # copies the new inputs into the graph's buffers, replays

        return replay


def step_row(bench: str, shape: Shape, backend: str, step, flush: L2Flush, repeats: int, note: str = "",
             **extra) -> dict:
    """The ``fwd_bwd`` row of ``step`` (one training step of ``shape``): the median ms of ``repeats`` timed
    steps, the expert GEMMs' TFLOP/s, ``wall_ms`` back to back, then ``extra``; printed with ``note``."""
    ms = time_ms(step, warmup=3, repeats=repeats, flush=flush)
    wall = wall_ms(step)
    row = {"bench": bench, "op": "fwd_bwd", "shape": shape.label, "splits": "router", "backend": backend,
           "ms": round(ms, 4), "tflops": round(shape.flops() / ms / 1e9, 1), "wall_ms": round(wall, 4), **extra}
    print(f"  {backend:<20} {ms:9.3f} ms  {row['tflops']:7.1f} TFLOP/s  (back to back {wall:8.3f} ms/step){note}",
          flush=True)
    return row


def median_rows(times: dict, flops: float, bench: str, op: str, shape: str, splits: str) -> list[dict]:
    """One result row per backend of ``timed_rounds``' times: the median ms and the TFLOP/s of ``flops``
    per run."""
    rows = []
    for backend, ts in times.items():
        ms = statistics.median(ts)
        rows.append({"bench": bench, "op": op, "shape": shape, "splits": splits, "backend": backend,
                     "ms": round(ms, 5), "tflops": round(flops / ms / 1e9, 2)})
    return rows


def round_rows(runs: dict, rounds: int, flush: L2Flush, label: str, flops: float, bench: str, op: str, shape: str,
               splits: str, note=lambda times: "") -> list[dict]:
    """``median_rows`` of ``runs`` timed in ``rounds`` interleaved rounds of 3 runs each, printed as
    ``<label>: <backend> <ms> ...<note(times)>``."""
    times = timed_rounds(runs, rounds, flush, per_round=3)
    rows = median_rows(times, flops, bench, op, shape, splits)
    print_medians(label, rows, note(times))
    return rows


def speed(times: dict, backend: str, against: str) -> float:
    """How many times as fast as ``against`` ``backend`` ran: the ratio of their median ms in ``times``."""
    return statistics.median(times[against]) / statistics.median(times[backend])


def print_medians(label: str, rows: list[dict], note: str = "") -> None:
    print(f"{label}: " + "  ".join(f"{r['backend']} {r['ms']:.3f}" for r in rows) + note, flush=True)


def cli(doc: str, shapes=None, *, rounds: bool = False) -> argparse.ArgumentParser:
    """The command line of a benchmark whose module docstring ``doc`` is its help.

    ``shapes``: the benchmark's named shapes, chosen with ``--shapes`` (comma-
    separated; default all; ``args.shapes`` is the list of names).
    ``rounds``: ``--rounds`` and ``--no-layer``, the options of the benchmarks
    built on :func:`timed_rounds` and ``moe_layer.layer_step_rows``.
    """
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if shapes is not None:
        add_names(parser, "--shapes", shapes)
    if rounds:
        parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds of 3 timed runs per backend")
        parser.add_argument("--no-layer", action="store_true", help="skip the MoE layer steps")
    return parser


def add_names(parser: argparse.ArgumentParser, option: str, known) -> None:
    """``option``: comma-separated names of ``known`` (default: all), parsed into a list; an unknown name is
    a usage error that lists the known ones."""
    known = list(known)

    def names(spec: str) -> list[str]:
        chosen = spec.split(",")
        unknown = [n for n in chosen if n not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; known {known}")
        return chosen

    parser.add_argument(option, type=names, default=known, help="comma-separated, of " + ", ".join(known))


def prologue(parser: argparse.ArgumentParser, *, warm_up: bool = True) -> argparse.Namespace:
    """Every benchmark's prologue: the command line parsed, an exit unless torch sees a CUDA GPU, then
    (``warm_up``) :func:`warm_up_clocks`."""
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(f"{parser.prog} needs a CUDA GPU, and torch sees none; run it on the GPU machine")
    if warm_up:
        warm_up_clocks()
    return args


def warm_up_clocks(seconds: float = 3.0) -> None:
    """Runs matrix products until the GPU has left its idle clocks."""
    a = torch.randn(8192, 8192, device="cuda").bfloat16()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    elapsed = 0.0
    while elapsed < seconds * 1000:
        for _ in range(10):
            a @ a
        end.record()
        end.synchronize()
        elapsed = start.elapsed_time(end)


def write_results(bench: str, rows: list[dict], **extra) -> pathlib.Path:
    """Writes ``benchmarks/results/<bench>-<gpu>.json`` in the project's format (``extra``: more top-level keys)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{bench}-{gpu_tag()}.json"
    payload = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.date.today().isoformat(),
        **extra,
        "rows": rows,
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def print_table(rows: list[dict], metric: str) -> None:
    print(f"{'op':<12} {'shape':<24} {'splits':<10} {'backend':<18} {'ms':>9} {metric:>9}")
    for row in rows:
        print(f"{row['op']:<12} {row['shape']:<24} {row['splits']:<10} {row['backend']:<18} "
              f"{row['ms']:>9.4f} {row[metric]:>9.1f}")
