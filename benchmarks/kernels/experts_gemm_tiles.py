"""The core's grouped GEMM variants (tile configurations, D-map handling) on the MoE experts' six GEMMs.

For each issue-19 shape (benchmarks/kernels/gathered_gemm.py's SHAPES: T, H, ffn I,
E experts, top-k) and each of the experts' GEMMs on permuted rows (R = T * k):

  fc1_fprop  g = xp . W1^T      (N = 2I, K = H)    fc1_dgrad  dxp = dg . W1  (N = H,  K = 2I)
  fc2_fprop  y = h . W2^T       (N = H,  K = I)    fc2_dgrad  dh = dy . W2   (N = I,  K = H)
  fc1_wgrad  dW1 = dg^T . xp    per expert          fc2_wgrad  dW2 = dy^T . h  per expert

with two splits: ``topk_random`` (each token's top-k of uniform random
scores, what a router gives: counts near R / E but rarely a multiple of the
tile) and ``balanced`` (every expert R / E rows, a multiple of 256 here).

Backends, every one captured in a CUDA graph and replayed (GPU time only),
all in one process, timed in interleaved rounds (median of the runs, 256 MB
L2 flush before each):
  cuda:<config>  the core forced to one tile configuration (MOE_GROUPED_GEMM_TILE)
  cuda:in_kernel_maps  the core's tile, D stored through CUTLASS's per-CTA tensor
                 maps rewritten in the kernel at each change of group
                 (MOE_GROUPED_GEMM_STORE_MAPS=in_kernel), as before the prebuilt maps
  cuda:cutlass_fprop  every fprop on the cooperative CUTLASS kernel, none on the
                 core's ping-pong kernel (MOE_GROUPED_GEMM_FPROP=cutlass); in
                 the layer step also fc1's SwiGLU as its own pass
  cuda           the core's own choice (csrc/gemm/heuristic.cpp, prebuilt maps)
  torch          torch._grouped_mm
  loop           one matmul per expert over host-known bounds
  dense          one matmul of the same FLOPs ([R, K] x [K, N]): the ceiling
Every variant must give bitwise the same result (same tile, same order of
the K loop; only the cluster or the store's tensor map differs), which the
script checks.

op ``layer_fwd_bwd``: one training step of the fused MoELayer (as in
benchmarks/moe_layer.py: top-k-then-softmax router, new inputs every step)
with every GEMM run as each variant (``cuda:<variant>``; where a configuration
is not built for a GEMM the core runs the 2x1 cluster with CUTLASS's epilogue
pieces, so fprop/dgrad under c2x1_e128x64 and wgrad under c1x1 run plain
2x1) and as the core's choice (``cuda``), eager and captured (``_graphed``),
in one process on one layer, each variant captured afresh every round with
no other variant's graph alive, in alternating order.
``cuda:coop_128x256x64_c1x1`` is the core's choice as it was before the
128x64 wgrad epilogue.

    python benchmarks/kernels/experts_gemm_tiles.py    # table + results/experts_gemm_tiles-<gpu>.json
"""

from __future__ import annotations

import functools
import math
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: common, grouped_gemm, moe_layer
from common import L2Flush, add_names, cli, forced, graphed, print_table, prologue, round_rows, write_results  # noqa: E402
from gathered_gemm import SHAPES  # noqa: E402
from grouped_gemm import TILE_ENV  # noqa: E402
from moe_layer import layer_step_rows  # noqa: E402

CONFIGS = ("coop_128x256x64_c2x1", "coop_128x256x64_c1x1", "coop_128x256x64_c2x1_e128x64")
STORE_MAPS_ENV = "MOE_GROUPED_GEMM_STORE_MAPS"
FPROP_ENV = "MOE_GROUPED_GEMM_FPROP"
# backend name -> the environment the core runs under; "cuda" is the core's own choice
VARIANTS = {**{f"cuda:{config}": {TILE_ENV: config} for config in CONFIGS},
            "cuda:in_kernel_maps": {STORE_MAPS_ENV: "in_kernel"},
            "cuda:cutlass_fprop": {FPROP_ENV: "cutlass"}}
OPS = ("fc1_fprop", "fc2_fprop", "fc2_dgrad", "fc1_dgrad", "fc2_wgrad", "fc1_wgrad")
SPLITS = ("topk_random", "balanced")


class Experts:
    """Operands of one shape's six GEMMs for one split of the R rows."""

    def __init__(self, shape, splits_kind: str):
        from moe_grouped.gemm import cuda_backend

        self.cuda = cuda_backend
        t, h, i, e, k = shape
        self.rows = rows = t * k
        gen = torch.Generator(device="cuda").manual_seed(0)
        if splits_kind == "balanced":
            self.m_splits = torch.full((e,), rows // e, dtype=torch.int32, device="cuda")
        else:
            experts = torch.rand(t, e, device="cuda", generator=gen).topk(k, dim=1).indices
            self.m_splits = torch.bincount(experts.flatten(), minlength=e).to(torch.int32)
        self.offs = torch.cumsum(self.m_splits, 0, dtype=torch.int32)
        ends = self.offs.tolist()
        self.bounds = [(g, s, u) for g, (s, u) in enumerate(zip([0] + ends[:-1], ends)) if u > s]
        rand = lambda *size: torch.randn(*size, device="cuda", generator=gen).bfloat16()  # noqa: E731
        self.xp, self.dy, self.h, self.dg = rand(rows, h), rand(rows, h), rand(rows, i), rand(rows, 2 * i)
        self.w1, self.w2 = rand(e, 2 * i, h) / math.sqrt(h), rand(e, h, i) / math.sqrt(i)
        self.dw1 = torch.empty(e, 2 * i, h, device="cuda", dtype=torch.bfloat16)
        self.dw2 = torch.empty(e, h, i, device="cuda", dtype=torch.bfloat16)
        # (N, K) of each op's GEMM, for FLOPs and the dense stand-in
        self.nk = {"fc1_fprop": (2 * i, h), "fc2_fprop": (h, i), "fc2_dgrad": (i, h),
                   "fc1_dgrad": (h, 2 * i), "fc2_wgrad": (h, i), "fc1_wgrad": (2 * i, h)}

    def flops(self, op: str) -> float:
        n, k = self.nk[op]
        return 2.0 * self.rows * n * k

    def core(self, op):
        """The core's op on this split; returns its output tensor."""
        c, s, bf16 = self.cuda, self.m_splits, torch.bfloat16
        return {
            "fc1_fprop": lambda: c.fprop(self.xp, [self.w1], s, None, bf16),
            "fc2_fprop": lambda: c.fprop(self.h, [self.w2], s, None, bf16),
            "fc2_dgrad": lambda: c.dgrad(self.dy, [self.w2], s, bf16),
            "fc1_dgrad": lambda: c.dgrad(self.dg, [self.w1], s, bf16),
            "fc2_wgrad": lambda: (c.wgrad(self.dy, self.h, s, [self.dw2], False), self.dw2)[1],
            "fc1_wgrad": lambda: (c.wgrad(self.dg, self.xp, s, [self.dw1], False), self.dw1)[1],
        }[op]

    def reference(self, op, backend: str):
        gm, offs = torch._grouped_mm, self.offs
        if backend == "dense":
            n, k = self.nk[op]
            a, b = torch.randn(self.rows, k, device="cuda").bfloat16(), torch.randn(k, n, device="cuda").bfloat16()
            return lambda: a @ b
        a, b = {"fc1_fprop": (self.xp, self.w1.transpose(-2, -1)), "fc2_fprop": (self.h, self.w2.transpose(-2, -1)),
                "fc2_dgrad": (self.dy, self.w2), "fc1_dgrad": (self.dg, self.w1),
                "fc2_wgrad": (self.dy, self.h), "fc1_wgrad": (self.dg, self.xp)}[op]
        if op.endswith("wgrad"):
            if backend == "torch":
                return lambda: gm(a.t(), b, offs=offs)
            return lambda: [a[s:u].t() @ b[s:u] for _, s, u in self.bounds]
        if backend == "torch":
            return lambda: gm(a, b, offs=offs)
        return lambda: [a[s:u] @ b[g] for g, s, u in self.bounds]


def replays(core, reference, op: str, variants: dict) -> dict:
    """Backend name -> graph replay of op: each of ``variants`` (name -> the core's environment), the core's
    choice ("cuda") and the reference backends (torch, loop, dense: ``reference(backend)``). Checks that every
    variant agrees bitwise with the core's choice, in each output where op returns a tuple."""
    def outputs(result):
        return result if isinstance(result, tuple) else (result,)

    expected = [t.clone() for t in outputs(core())]
    for backend, env in variants.items():
        got = outputs(forced(env, core)())
        if len(got) != len(expected) or not all(torch.equal(e, g) for e, g in zip(expected, got)):
            raise AssertionError(f"{op}: {backend} differs from the core's choice")
    runs = {backend: graphed(forced(env, core)) for backend, env in variants.items()}
    runs["cuda"] = graphed(core)
    for backend in ("torch", "loop", "dense"):
        runs[backend] = graphed(reference(backend))
    return runs


def main() -> None:
    parser = cli(__doc__, SHAPES, rounds=True)
    add_names(parser, "--variants", VARIANTS)
    add_names(parser, "--splits", SPLITS)
    args = prologue(parser)
    variants = {name: VARIANTS[name] for name in args.variants}
    flush = L2Flush()
    rows = []
    for name in args.shapes:
        for splits_kind in args.splits:
            problem = Experts(SHAPES[name], splits_kind)
            for op in OPS:
                runs = replays(problem.core(op), functools.partial(problem.reference, op), op, variants)
                rows += round_rows(runs, args.rounds, flush, f"{name} {splits_kind} {op}", problem.flops(op),
                                   "experts_gemm_tiles", op, name, splits_kind)
                del runs
            del problem
            torch.cuda.empty_cache()
    finish(rows, args, flush, variants, "experts_gemm_tiles", summarize)


def layer_rows(names: list[str], rounds: int, flush: L2Flush, variants: dict, bench: str) -> list[dict]:
    """Rows of op ``layer_fwd_bwd``: a fused MoELayer step under each of ``variants`` (name -> the core's
    environment) and the core's choice ("cuda"), eager and graphed (see the module docstring)."""
    runners = {label: functools.partial(forced, env) for label, env in variants.items()}
    return layer_step_rows(names, rounds, flush, {**runners, "cuda": lambda fn: fn}, bench)


def summarize_layer(rows, variants) -> None:
    """Layer step of the core's choice relative to each variant's, per shape and mode."""
    layer = {(r["shape"], r["backend"]): r["ms"] for r in rows if r["op"] == "layer_fwd_bwd"}
    for shape in dict.fromkeys(s for s, _ in layer):
        for mode in ("", "_graphed"):
            new = layer[(shape, f"cuda{mode}")]
            print(f"layer {shape:<16} {mode[1:] or 'eager':<8} core's choice {new:8.3f} ms  " + "  ".join(
                f"{backend} {layer[(shape, backend + mode)] / new:.3f}x" for backend in variants))


def finish(rows: list[dict], args, flush: L2Flush, variants: dict, bench: str, summary=summarize_layer) -> None:
    """A kernel benchmark's end: the layer rows (unless ``--no-layer``), the table, ``summary(rows,
    variants)`` and the results file."""
    if not args.no_layer:
        rows += layer_rows(args.shapes, args.rounds, flush, variants, bench)
    print_table(rows, "tflops")
    summary(rows, variants)
    print(f"wrote {write_results(bench, rows)}")


def summarize(rows, variants: dict) -> None:
    """Speed of the core's choice relative to each variant, per split: min, geometric mean, max over ops."""
    choice = {(r["op"], r["shape"], r["splits"]): r["ms"] for r in rows if r["backend"] == "cuda"}
    if any(r["op"] == "layer_fwd_bwd" for r in rows):
        summarize_layer(rows, variants)
    for backend in variants:
        for splits_kind in dict.fromkeys(r["splits"] for r in rows if r["op"] != "layer_fwd_bwd"):
            for kinds in (("fprop", "dgrad"), ("wgrad",)):
                ratios = [r["ms"] / choice[(r["op"], r["shape"], r["splits"])] for r in rows
                          if r["backend"] == backend and r["splits"] == splits_kind and r["op"].endswith(kinds)]
                print(f"core's choice vs {backend}, {splits_kind}, {'/'.join(kinds)}: min {min(ratios):.3f}  "
                      f"geomean {statistics.geometric_mean(ratios):.3f}  max {max(ratios):.3f}")


if __name__ == "__main__":
    main()
