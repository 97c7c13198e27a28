"""The grouped GEMMs' tile order with few, large groups: along N (chosen) against along M (before).

CUTLASS walks a grouped problem's tiles along M. When a group's rows do not
stay in L2, a wave of persistent CTAs then reads them from memory once per N
tile; walking along N reads them once. The core picks along N for fprop and
dgrad from 32 MiB of rows per group with a weight of at most 8 MiB
(csrc/gemm/heuristic.cpp, raster_along_n). That is the case of a
fine-grained model under expert parallelism: Qwen3-30B-A3B-like experts
(hidden 2048, ffn 768), 131072 routed rows on a rank that holds 4, 8 or 16 of
them. Two routed-size shapes of 32 experts (4096 rows each, 16 MiB) stay
along M, as controls.

Backends, one process, same data, median of CUDA-event-timed runs with a
256 MB L2 flush before each (the two cuda rows in interleaved rounds, the
median of the rounds' medians, since the same kernel timed twice in a row
read up to 11% apart):
  cuda          the core, its own choice of order
  cuda:along_m  the core forced along M (MOE_GROUPED_GEMM_RASTER=m): the order before
  torch         torch._grouped_mm
  loop          one torch.matmul per expert (host splits)
  dense         one matmul of the same FLOPs: the ceiling

Ops fprop and dgrad of fc1 (K = 2048 -> N = 1536) and fc2 (K = 768 -> N = 2048);
splits balanced and skewed (benchmarks/grouped_gemm.py's).

    python benchmarks/kernels/tile_order.py   # table + results/tile_order-<gpu>.json
"""

from __future__ import annotations

import os
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: common, grouped_gemm, moe_layer
from common import L2Flush, cli, print_table, prologue, time_ms, write_results  # noqa: E402
from common import forced  # noqa: E402
from grouped_gemm import SPLITS, Problem, shape_name  # noqa: E402

ROWS = 131072
# (E, M, K, N): fc1 and fc2 of the Qwen3-like experts
SHAPES = [(e, ROWS, k, n) for e in (4, 8, 16, 32) for k, n in ((2048, 1536), (768, 2048))]
OPS = ("fprop", "dgrad")
RASTER_ENV = "MOE_GROUPED_GEMM_RASTER"
BACKENDS = ("cuda", "cuda:along_m", "torch", "loop", "dense")
ROUNDS = 4  # interleaved rounds of the two cuda rows


def timed(problem: Problem, op: str, backend: str, flush: L2Flush, repeats: int) -> float:
    if backend == "cuda:along_m":
        fn = forced({RASTER_ENV: "m"}, problem.cuda_op(op))
    else:
        fn = getattr(problem, f"{backend}_op")(op)
    return time_ms(fn, repeats=repeats, flush=flush)


def main() -> None:
    prologue(cli(__doc__))
    os.environ.pop(RASTER_ENV, None)
    flush = L2Flush()
    rows = []
    for shape in SHAPES:
        for splits_kind in SPLITS:
            problem = Problem(shape, splits_kind)
            for op in OPS:
                rounds = {"cuda": [], "cuda:along_m": []}
                for _ in range(ROUNDS):
                    for backend in rounds:
                        rounds[backend].append(timed(problem, op, backend, flush, repeats=15))
                for backend in BACKENDS:
                    if backend in rounds:
                        ms = statistics.median(rounds[backend])
                    else:
                        ms = timed(problem, op, backend, flush, repeats=30)
                    rows.append({"bench": "tile_order", "op": op, "shape": shape_name(shape), "splits": splits_kind,
                                 "backend": backend, "ms": round(ms, 5),
                                 "tflops": round(problem.flops(op) / ms / 1e9, 2)})
            del problem
            torch.cuda.empty_cache()
    print_table(rows, "tflops")
    by_key = {(r["op"], r["shape"], r["splits"], r["backend"]): r["ms"] for r in rows}
    print()
    for (op, shape, splits, backend), ms in by_key.items():
        if backend == "cuda":
            before, theirs = by_key[(op, shape, splits, "cuda:along_m")], by_key[(op, shape, splits, "torch")]
            print(f"{op:<6} {shape:<24} {splits:<9} chosen/along_m speed {before / ms:5.3f}   "
                  f"cuda/torch {theirs / ms:5.3f}")
    print(f"wrote {write_results('tile_order', rows)}")


if __name__ == "__main__":
    main()
