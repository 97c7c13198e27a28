"""How fast the FP8 fused MoE layer step could be: its six GEMMs against dense FP8 GEMMs of the same FLOPs.

For each issue-19 shape (benchmarks/kernels/gathered_gemm.py's SHAPES) on ``topk_random`` splits (R = T * k
rows) and each of the experts' six GEMMs (benchmarks/kernels/experts_gemm_tiles.py's OPS), graph replays
timed in interleaved rounds (median, 256 MB L2 flush before each), in one process:
  cuda        the core's bf16 grouped GEMM
  cuda_fp8    the core's FP8 block-scaled grouped GEMM (1x128 activations and gradients, 128x128 weights;
              operands quantized beforehand, E4M3, power-of-two scales)
  dense       one bf16 matmul of the same FLOPs ([R, K] x [K, N])
  dense_fp8   one FP8 matmul of the same FLOPs (torch._scaled_mm, E4M3, one scale per tensor: the
              tensor cores' FP8 rate without block scaling or groups)
  dense_fp8_block  the same FLOPs with the recipe's block scales (cuBLAS's block-scaled kernels through
              torch._scaled_mm), every 128-deep block promoted as the core's kernels promote it: fprop
              and dgrad as dense_fp8 with 1x128 by 128x128 scales; wgrad as [E*N, R/E] x [R/E, K],
              both operands scaled per 128 along the reduction (an expert's tokens)
Then op ``fwd_bwd``: the fused MoELayer step as benchmarks/moe_layer.py runs it, bf16 and inside
fp8_autocast (``cuda_fused_graphed``, ``cuda_fp8_fused_graphed``), and the derived row
``fp8_dense_gemms`` (``"derived": true``): the FP8 step with each of its GEMMs' time replaced by the
dense FP8 GEMM's (the rest of the step as measured), the ceiling of this design with perfect GEMMs;
and ``fp8_block_dense_gemms``, the same with the dense block-scaled GEMMs' times: the ceiling of this
recipe with GEMMs as fast as cuBLAS's dense ones.

    python benchmarks/kernels/fp8_ceiling.py [--shapes qwen3_30b_16k,...]   # table + results/fp8_ceiling-<gpu>.json
"""

from __future__ import annotations

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: common, moe_layer
from common import L2Flush, cli, dense_fp8_matmul, graphed, prologue, round_rows, write_results  # noqa: E402
from experts_gemm_tiles import OPS, Experts  # noqa: E402
from gathered_gemm import SHAPES  # noqa: E402
import moe_layer  # noqa: E402

from moe_grouped import fp8  # noqa: E402
from moe_grouped.fp8 import gemm as fp8_gemm  # noqa: E402

E4M3 = torch.float8_e4m3fn
BENCH = "fp8_ceiling"


class Fp8Operands:
    """The six GEMMs of ``Experts`` in FP8, on operands quantized once."""

    def __init__(self, ex: Experts):
        self.ex = ex
        s = ex.m_splits
        rows = lambda t: fp8.quantize_rowwise(t, E4M3)  # noqa: E731
        cols = lambda t: fp8.quantize_columnwise_grouped(t, s, E4M3)  # noqa: E731
        self.xp, self.h, self.dy, self.dg = rows(ex.xp), rows(ex.h), rows(ex.dy), rows(ex.dg)
        self.xpt, self.ht, self.dyt, self.dgt = cols(ex.xp), cols(ex.h), cols(ex.dy), cols(ex.dg)
        self.w1, self.w2 = fp8.quantize_weights_128x128(ex.w1, E4M3), fp8.quantize_weights_128x128(ex.w2, E4M3)

    def run(self, op: str):
        ex, s, rows = self.ex, self.ex.m_splits, self.ex.rows

        def wgrad(dyt, xt, out):
            return lambda: fp8_gemm.grouped_wgrad_fp8(dyt, xt, s, [out], total_rows=rows)

        return {
            "fc1_fprop": lambda: fp8_gemm.grouped_fprop_fp8(self.xp, self.w1.w, s),
            "fc2_fprop": lambda: fp8_gemm.grouped_fprop_fp8(self.h, self.w2.w, s),
            "fc2_dgrad": lambda: fp8_gemm.grouped_dgrad_fp8(self.dy, self.w2.wt, s),
            "fc1_dgrad": lambda: fp8_gemm.grouped_dgrad_fp8(self.dg, self.w1.wt, s),
            "fc2_wgrad": wgrad(self.dyt, self.ht, ex.dw2),
            "fc1_wgrad": wgrad(self.dgt, self.xpt, ex.dw1),
        }[op]


def dense_fp8(ex: Experts, op: str, scaling: str = "tensor"):
    """The dense stand-in of ``op``: [R, K] x [K, N]; with the wgrad's block scaling, [E*N, R/E] x [R/E, K]
    instead (the same FLOPs; R/E rounded up to whole 128-token blocks, which the five shapes have), so
    that the reduction it promotes along is as long as an expert's tokens."""
    n, k = ex.nk[op]
    if scaling == "1x128_1x128":
        e = ex.m_splits.numel()
        return dense_fp8_matmul(e * n, k, -(-ex.rows // (128 * e)) * 128, scaling)
    return dense_fp8_matmul(ex.rows, n, k, scaling)


def recipe_scaling(op: str) -> str:
    """The block scaling of ``op``'s operands in the recipe: the wgrads reduce over tokens, along which
    both of their operands (the column-wise copies) are scaled per 128."""
    return "1x128_1x128" if op.endswith("wgrad") else "1x128_128x128"


def gemm_rows(name: str, rounds: int, flush: L2Flush) -> list[dict]:
    ex = Experts(SHAPES[name], "topk_random")
    q = Fp8Operands(ex)
    rows = []
    for op in OPS:
        runs = {"cuda": graphed(ex.core(op)), "cuda_fp8": graphed(q.run(op)),
                "dense": graphed(ex.reference(op, "dense")), "dense_fp8": graphed(dense_fp8(ex, op)),
                "dense_fp8_block": graphed(dense_fp8(ex, op, recipe_scaling(op)))}
        rows += round_rows(runs, rounds, flush, f"{name} {op}", ex.flops(op), BENCH, op, name, "topk_random")
    return rows


def layer_rows(name: str, flush: L2Flush, gemms: list[dict]) -> list[dict]:
    shape = next(s for s in moe_layer.EXPERTS_PATH_SHAPES if s.name == name)
    rows = moe_layer.bench_layer(shape, ["cuda_fused", "cuda_fp8_fused"], flush, loop=False)
    rows = [dict(r, bench=BENCH) for r in rows if r["backend"].endswith("_graphed")]
    step = next(r["ms"] for r in rows if r["backend"] == "cuda_fp8_fused_graphed")
    ms = {(r["op"], r["backend"]): r["ms"] for r in gemms}
    for backend, dense in (("fp8_dense_gemms", "dense_fp8"), ("fp8_block_dense_gemms", "dense_fp8_block")):
        ceiling = step - sum(ms[(op, "cuda_fp8")] - ms[(op, dense)] for op in OPS)
        rows.append({"bench": BENCH, "op": "fwd_bwd", "shape": name, "splits": "router", "backend": backend,
                     "ms": round(ceiling, 4), "tflops": round(shape.flops() / ceiling / 1e9, 1), "derived": True})
    return rows


def summarize(rows: list[dict]) -> None:
    print("\nper shape: sum of the six GEMMs (ms), and the step (graphed)")
    for name in dict.fromkeys(r["shape"] for r in rows):
        ms = {(r["op"], r["backend"]): r["ms"] for r in rows if r["shape"] == name}
        sums = {b: sum(ms[(op, b)] for op in OPS)
                for b in ("cuda", "cuda_fp8", "dense", "dense_fp8", "dense_fp8_block")}
        bf16, fp8_step, ceiling, block_ceiling = (
            ms[("fwd_bwd", b)] for b in
            ("cuda_fused_graphed", "cuda_fp8_fused_graphed", "fp8_dense_gemms", "fp8_block_dense_gemms"))
        print(f"  {name:<16} GEMMs bf16 {sums['cuda']:.3f}  fp8 {sums['cuda_fp8']:.3f} "
              f"({sums['cuda'] / sums['cuda_fp8']:.2f}x)  dense bf16 {sums['dense']:.3f}  dense fp8 "
              f"{sums['dense_fp8']:.3f}  dense fp8 block-scaled {sums['dense_fp8_block']:.3f};  "
              f"step bf16 {bf16:.3f}  fp8 {fp8_step:.3f} ({bf16 / fp8_step:.2f}x)  "
              f"with dense-fp8 GEMMs {ceiling:.3f} ({bf16 / ceiling:.2f}x), "
              f"block-scaled {block_ceiling:.3f} ({bf16 / block_ceiling:.2f}x)")


def main() -> None:
    parser = cli(__doc__, SHAPES, rounds=True)
    args = prologue(parser)
    flush = L2Flush()
    rows = []
    for name in args.shapes:
        gemms = gemm_rows(name, args.rounds, flush)
        rows += gemms
        if not args.no_layer:
            rows += layer_rows(name, flush, gemms)
        torch.cuda.empty_cache()
    if not args.no_layer:
        summarize(rows)
    print(f"wrote {write_results(BENCH, rows)}")


if __name__ == "__main__":
    main()
