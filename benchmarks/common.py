"""Timing and result files shared by the benchmarks."""

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


def shapes_parser(doc: str, known) -> argparse.ArgumentParser:
    """A parser for a benchmark whose docstring is ``doc``, with ``--shapes`` (default: all of ``known``)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(known), help="comma-separated names of " + ", ".join(known))
    return parser


def shape_names(spec: str, known, option: str = "--shapes") -> list[str]:
    """The names in a comma-separated ``option`` value; exits naming any not in ``known``."""
    names = spec.split(",")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"{option}: unknown {unknown}; known {list(known)}")
    return names


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
