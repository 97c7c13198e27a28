"""Grouped GEMM throughput: the core's kernels against torch._grouped_mm.

Backends, all in one process on the same data:
  cuda   moe_grouped's core (CUTLASS SM90 ptr-array, device m_splits)
  torch  torch._grouped_mm with int32 cumulative offsets (also CUTLASS SM90)
  loop   one torch.matmul per expert (host splits; not graph-safe)
  dense  one torch.matmul of the same FLOPs, [M, K] x [K, N]: the ceiling
  cuda_graphed, torch_graphed  the cuda and torch ops captured in a CUDA graph
         and replayed: GPU time, without the host's launch latency, which the
         eager rows of the short ops (E=128: 0.4-0.5 ms) include

Ops: fprop (y = x W^T), dgrad (dx = dy W), wgrad (dW = dy^T x per expert,
written in the operand dtype, no accumulation), fwd_bwd (the three in a row).
Splits: balanced, and skewed (log-normal with some zero-token experts, fixed
seed). Median of CUDA-event-timed runs with a 256 MB L2 flush before each.

    python benchmarks/grouped_gemm.py              # table + results/grouped_gemm-<gpu>.json
    python benchmarks/grouped_gemm.py --tiles PATH # also wgrad into fp32 per tile config
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import L2Flush, cli, graphed, print_table, prologue, time_ms, write_results  # noqa: E402

# (E, M, K, N)
SHAPES = [
    (8, 16384, 4096, 14336),
    (8, 16384, 14336, 4096),
    (32, 32768, 7168, 2048),
    (32, 32768, 2048, 7168),
    (128, 32768, 2048, 1408),
]
SPLITS = ("balanced", "skewed")
OPS = ("fprop", "dgrad", "wgrad", "fwd_bwd")
TILE_ENV = "MOE_GROUPED_GEMM_TILE"
# Tile configurations of the cuda kernels that --tiles times against each
# other: wgrad accumulating into an fp32 main_grad has two.
TILES = {"wgrad": ["coop_128x256x64_c2x1"]}


def make_splits(kind: str, num_experts: int, total: int, seed: int = 0) -> list[int]:
    if kind == "balanced":
        return [total // num_experts] * num_experts
    gen = torch.Generator().manual_seed(seed)
    weights = torch.randn(num_experts, generator=gen).exp()  # log-normal, sigma 1
    weights[torch.randperm(num_experts, generator=gen)[: max(1, num_experts // 8)]] = 0
    shares = weights / weights.sum() * total
    counts = [int(math.floor(s)) for s in shares.tolist()]
    order = sorted(range(num_experts), key=lambda i: counts[i] - shares[i].item())
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


class Problem:
    def __init__(self, shape, splits_kind):
        from moe_grouped.gemm import cuda_backend

        self.cuda = cuda_backend
        self.num_experts, self.total, self.k, self.n = shape
        splits = make_splits(splits_kind, self.num_experts, self.total)
        self.splits = splits
        gen = torch.Generator(device="cuda").manual_seed(0)
        e, m, k, n = shape
        self.x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        self.dy = torch.randn(m, n, device="cuda", generator=gen).bfloat16()
        self.w = (torch.randn(e, n, k, device="cuda", generator=gen) / math.sqrt(k)).bfloat16()
        self.m_splits = torch.tensor(splits, dtype=torch.int32, device="cuda")
        self.offs = torch.cumsum(self.m_splits, 0, dtype=torch.int32)
        bounds = [0]
        for c in splits:
            bounds.append(bounds[-1] + c)
        self.bounds = list(zip(bounds[:-1], bounds[1:]))
        self.y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        self.dx = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
        self.dw = torch.empty(e, n, k, device="cuda", dtype=torch.bfloat16)

    def flops(self, op: str) -> float:
        return 2.0 * self.total * self.n * self.k * (3 if op == "fwd_bwd" else 1)

    # ---- backends ----
    def cuda_op(self, op):
        c, w, s = self.cuda, [self.w], self.m_splits
        if op == "fprop":
            return lambda: c.fprop(self.x, w, s, None, torch.bfloat16)
        if op == "dgrad":
            return lambda: c.dgrad(self.dy, w, s, torch.bfloat16)
        if op == "wgrad":
            return lambda: c.wgrad(self.dy, self.x, s, [self.dw], False)
        parts = [self.cuda_op(o) for o in ("fprop", "dgrad", "wgrad")]
        return lambda: [p() for p in parts]

    def torch_op(self, op):
        gm, offs = torch._grouped_mm, self.offs
        if op == "fprop":
            return lambda: gm(self.x, self.w.transpose(-2, -1), offs=offs)
        if op == "dgrad":
            return lambda: gm(self.dy, self.w, offs=offs)
        if op == "wgrad":
            return lambda: gm(self.dy.t(), self.x, offs=offs)
        parts = [self.torch_op(o) for o in ("fprop", "dgrad", "wgrad")]
        return lambda: [p() for p in parts]

    def loop_op(self, op):
        bounds = [(e, s, t) for e, (s, t) in enumerate(self.bounds) if t > s]
        if op == "fprop":
            def run():
                for e, s, t in bounds:
                    torch.matmul(self.x[s:t], self.w[e].t(), out=self.y[s:t])
        elif op == "dgrad":
            def run():
                for e, s, t in bounds:
                    torch.matmul(self.dy[s:t], self.w[e], out=self.dx[s:t])
        elif op == "wgrad":
            def run():
                for e, s, t in bounds:
                    torch.matmul(self.dy[s:t].t(), self.x[s:t], out=self.dw[e])
        else:
            parts = [self.loop_op(o) for o in ("fprop", "dgrad", "wgrad")]
            def run():
                for p in parts:
                    p()
        return run

    def dense_op(self, op):
        w0 = self.w[0]
        if op == "fprop":
            return lambda: torch.matmul(self.x, w0.t(), out=self.y)
        if op == "dgrad":
            return lambda: torch.matmul(self.dy, w0, out=self.dx)
        if op == "wgrad":
            return lambda: torch.matmul(self.dy.t(), self.x, out=self.dw[0])
        parts = [self.dense_op(o) for o in ("fprop", "dgrad", "wgrad")]
        return lambda: [p() for p in parts]


def shape_name(shape) -> str:
    return "E{}_M{}_K{}_N{}".format(*shape)


def main() -> None:
    parser = cli(__doc__)
    parser.add_argument("--tiles", type=pathlib.Path, help="also time every cuda tile config; JSON here")
    parser.add_argument("--repeats", type=int, default=40)
    args = prologue(parser)
    flush = L2Flush()
    rows, tile_rows = [], []
    for shape in SHAPES:
        for splits_kind in SPLITS:
            problem = Problem(shape, splits_kind)
            for op in OPS:
                for backend in ("cuda", "torch", "loop", "dense", "cuda_graphed", "torch_graphed"):
                    if backend.endswith("_graphed"):
                        fn = graphed(getattr(problem, f"{backend[: -len('_graphed')]}_op")(op))
                    else:
                        fn = getattr(problem, f"{backend}_op")(op)
                    ms = time_ms(fn, repeats=args.repeats, flush=flush)
                    rows.append({"bench": "grouped_gemm", "op": op, "shape": shape_name(shape),
                                 "splits": splits_kind, "backend": backend, "ms": round(ms, 5),
                                 "tflops": round(problem.flops(op) / ms / 1e9, 2)})
                    del fn
                if args.tiles is not None and op in TILES:
                    main_grad = torch.zeros(problem.dw.shape, device="cuda")
                    for tile in TILES[op]:
                        os.environ[TILE_ENV] = tile
                        fn = lambda: problem.cuda.wgrad(problem.dy, problem.x, problem.m_splits, [main_grad], True)
                        ms = time_ms(fn, repeats=args.repeats, flush=flush)
                        tile_rows.append({"op": "wgrad_fp32_accumulate", "shape": shape_name(shape), "splits": splits_kind,
                                          "backend": f"cuda:{tile}", "ms": round(ms, 5),
                                          "tflops": round(problem.flops(op) / ms / 1e9, 2)})
                    os.environ.pop(TILE_ENV)
            del problem
            torch.cuda.empty_cache()
    print_table(rows, "tflops")
    print()
    summarize(rows)
    path = write_results("grouped_gemm", rows)
    print(f"wrote {path}")
    if args.tiles is not None:
        print_table(tile_rows, "tflops")
        args.tiles.write_text(json.dumps(tile_rows, indent=1) + "\n")


def summarize(rows) -> None:
    """cuda / torch speed ratio per op, and its geometric mean: eager, then graphed."""
    by_key = {(r["op"], r["shape"], r["splits"], r["backend"]): r for r in rows}
    for ours, theirs in (("cuda", "torch"), ("cuda_graphed", "torch_graphed")):
        for op in OPS:
            ratios = []
            for (o, shape, splits, backend), row in by_key.items():
                if o == op and backend == ours:
                    other = by_key[(o, shape, splits, theirs)]
                    ratio = other["ms"] / row["ms"]
                    ratios.append(ratio)
                    print(f"{op:<8} {shape:<24} {splits:<9} {ours}/{theirs} {ratio:5.3f}  "
                          f"({row['tflops']:.0f} vs {other['tflops']:.0f} TFLOP/s)")
            geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
            print(f"{op:<8} geometric mean {ours}/{theirs} {geomean:.3f}, min {min(ratios):.3f}\n")


if __name__ == "__main__":
    main()
