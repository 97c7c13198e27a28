"""The core's ping-pong fprop against its cooperative CUTLASS fprop, on the experts' forward GEMMs.

For each issue-19 shape (benchmarks/kernels/gathered_gemm.py's SHAPES: T, H, ffn I,
E experts, top-k; router-like random top-k routing, R = T * k rows):

  fc1_fprop    g = xp . W1^T on the permuted copy        (N = 2I, K = H)
  fc2_fprop    y = h . W2^T                              (N = H,  K = I)
  fc1_swiglu   g = x[index] . W1^T and h = silu(gate) * up: the fused
               experts path's forward fc1 (x read through the routing index)

Backends, each captured in a CUDA graph and replayed, all in one process,
timed in interleaved rounds (median, 256 MB L2 flush before each):
  cuda               the core's choice (csrc/gemm/heuristic.cpp): the ping-pong
                     kernel for K <= 2048, with SwiGLU in fc1_swiglu's epilogue
  cuda:cutlass_fprop every fprop on the cooperative kernel
                     (MOE_GROUPED_GEMM_FPROP=cutlass); fc1_swiglu is then the
                     gathered kernel followed by the SwiGLU pass
  torch              torch._grouped_mm (fc1_swiglu: on the permuted copy, the
                     copy not timed, then torch's silu(gate) * up)
  loop               one matmul per expert over host-known bounds
  dense              one matmul of the same GEMM FLOPs: the ceiling
The two cuda backends must agree bitwise (checked). TFLOP/s count the GEMM's
2 * R * N * K only.

op ``layer_fwd_bwd``: one training step of the fused MoELayer
(benchmarks/moe_layer.py's), the core's choice against every fprop on the
cooperative kernel, eager and graphed, as benchmarks/kernels/experts_gemm_tiles.py
times its variants.

    python benchmarks/kernels/pingpong_fprop.py    # table + results/pingpong_fprop-<gpu>.json
"""

from __future__ import annotations

import functools
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: common, grouped_gemm, moe_layer
from common import L2Flush, cli, prologue, round_rows, speed  # noqa: E402
from experts_gemm_tiles import FPROP_ENV, finish, replays  # noqa: E402
from gathered_gemm import SHAPES, Case  # noqa: E402

OPS = ("fc1_fprop", "fc2_fprop", "fc1_swiglu")
CUTLASS = {"cuda:cutlass_fprop": {FPROP_ENV: "cutlass"}}


def gemm_shape(case: Case, op: str) -> tuple[int, int]:
    """(N, K) of op's GEMM."""
    n1, k1 = case.nk["fc1_fprop"]
    return (k1, n1 // 2) if op == "fc2_fprop" else (n1, k1)


def core_run(case: Case, op: str):
    c, s, bf16 = case.cuda, case.m_splits, torch.bfloat16
    return {
        "fc1_fprop": lambda: c.fprop(case.xp, [case.w1], s, None, bf16),
        "fc2_fprop": lambda: c.fprop(case.wh, [case.w2], s, None, bf16),
        "fc1_swiglu": lambda: c.fprop_swiglu(case.x, case.index, [case.w1], s),
    }[op]


def reference_run(case: Case, op: str, backend: str):
    if backend == "dense":
        n, k = gemm_shape(case, op)
        a, b = torch.randn(case.rows, k, device="cuda").bfloat16(), torch.randn(k, n, device="cuda").bfloat16()
        return lambda: a @ b
    a, w = (case.wh, case.w2) if op == "fc2_fprop" else (case.xp, case.w1)

    def act(g):
        if op != "fc1_swiglu":
            return g
        gate, up = g.chunk(2, dim=-1)
        return g, torch.nn.functional.silu(gate) * up

    if backend == "torch":
        return lambda: act(torch._grouped_mm(a, w.transpose(-2, -1), offs=case.offs))
    return lambda: [act(a[s:u] @ w[g].t()) for g, s, u in case.bounds]


def main() -> None:
    args = prologue(cli(__doc__, SHAPES, rounds=True))
    flush = L2Flush()
    rows = []
    for name in args.shapes:
        case = Case(SHAPES[name])
        for op in OPS:
            runs = replays(core_run(case, op), functools.partial(reference_run, case, op), op, CUTLASS)
            n, k = gemm_shape(case, op)
            rows += round_rows(runs, args.rounds, flush, f"{name} {op}", 2.0 * case.rows * n * k, "pingpong_fprop",
                               op, name, "topk_random", lambda times: f"  | core's choice "
                               f"{speed(times, 'cuda', 'cuda:cutlass_fprop'):.3f}x as fast as the cooperative kernel")
            del runs
        del case
        torch.cuda.empty_cache()
    finish(rows, args, flush, CUTLASS, "pingpong_fprop")


if __name__ == "__main__":
    main()
