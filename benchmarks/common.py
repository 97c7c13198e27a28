"""What every benchmark shares: its command line and prologue, timing, and the results file.

A benchmark's ``main()`` starts with ``args = prologue(cli(__doc__, SHAPES))``:
the command line is parsed first (``--help`` needs no GPU), then it exits
unless torch sees a CUDA GPU, then the clocks are brought up from idle. Its
rows go to ``benchmarks/results/<bench>-<gpu>.json`` by :func:`write_results`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics

import torch

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


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
    return graph.replay


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


def median_rows(times: dict, flops: float, bench: str, op: str, shape: str, splits: str) -> list[dict]:
    """One result row per backend of ``timed_rounds``' times: the median ms and the TFLOP/s of ``flops``
    per run."""
    rows = []
    for backend, ts in times.items():
        ms = statistics.median(ts)
        rows.append({"bench": bench, "op": op, "shape": shape, "splits": splits, "backend": backend,
                     "ms": round(ms, 5), "tflops": round(flops / ms / 1e9, 2)})
    return rows


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
