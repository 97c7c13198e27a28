"""fc2's dgrad with the weighted SwiGLU backward in its epilogue, against the two passes it replaces.

The fused experts path's backward through fc2 and SwiGLU, per issue-19 shape
(benchmarks/kernels/gathered_gemm.py's SHAPES), on permuted rows R = T * k with a
router's top-k counts (``topk_random``) and with balanced ones: from dy_u
[R, H], W2 [E, H, I], g [R, 2I] and the routing weights w [R], produce dg
(in place of g), wh = w * h and dprob. Backends, each captured in a CUDA
graph and replayed, one process, interleaved rounds, median, 256 MB L2 flush
before each run:

  cuda_fused    one kernel, dh_u = dy_u W2 never stored (mg_grouped_dgrad_swiglu)
  cuda_unfused  the core's dgrad (dh_u [R, I] stored), then the standalone
                weighted SwiGLU backward pass: the path before the fusion
  torch         torch._grouped_mm's dgrad, then the same pass
  loop          one matmul per expert, then the same pass
  dense         one [R, H] x [H, I] matmul (no SwiGLU): the GEMM's ceiling

TFLOP/s count the dgrad's 2 R H I. dg and wh of cuda_fused are checked to be
bitwise those of cuda_unfused before timing.

op ``layer_fwd_bwd`` (unless ``--no-layer``): one training step of the fused
MoELayer as in benchmarks/kernels/experts_gemm_tiles.py's layer rows, with the two
passes (backend ``cuda``, the default) and with the fused kernel
(``cuda:dgrad_swiglu_fused``, MOE_GROUPED_DGRAD_SWIGLU=fused), eager and
graphed, one process, each captured afresh every round.

    python benchmarks/kernels/dgrad_swiglu.py    # table + results/dgrad_swiglu-<gpu>.json
"""

from __future__ import annotations

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: common, grouped_gemm, moe_layer
from common import L2Flush, cli, graphed, prologue, round_rows, speed  # noqa: E402
from experts_gemm_tiles import SPLITS, Experts, finish  # noqa: E402
from gathered_gemm import SHAPES  # noqa: E402

BACKENDS = ("cuda_fused", "cuda_unfused", "torch", "loop", "dense")
LAYER_VARIANTS = {"cuda:dgrad_swiglu_fused": {"MOE_GROUPED_DGRAD_SWIGLU": "fused"}}


def runs_of(problem: Experts) -> dict:
    """Backend -> graph replay; every backend updates its own copy of g in place, as the layer does."""
    from moe_grouped.gemm import cuda_backend

    rows, ffn = problem.h.shape
    s, w2 = problem.m_splits, problem.w2
    w = torch.rand(rows, device="cuda")
    g0 = (torch.randn(rows, 2 * ffn, device="cuda") * 3).bfloat16()
    dprob = torch.empty(rows, device="cuda")

    def passed(dgrad):
        g = g0.clone()

        def run():
            dh_u = dgrad()
            torch.ops.moe_grouped.swiglu_weighted_backward_(dh_u, g, w, s, dprob, "cuda")
            return g, dh_u
        return run

    def fused():
        g = g0.clone()
        return lambda: (g, cuda_backend.dgrad_swiglu(problem.dy, [w2], s, g, w)[0])

    gm, offs, dy = torch._grouped_mm, problem.offs, problem.dy
    bounds = problem.bounds
    makers = {
        "cuda_fused": fused,
        "cuda_unfused": lambda: passed(lambda: cuda_backend.dgrad(dy, [w2], s, torch.bfloat16)),
        "torch": lambda: passed(lambda: gm(dy, w2, offs=offs)),
        "loop": lambda: passed(lambda: torch.cat([dy[a:b] @ w2[e] for e, a, b in bounds])),
        "dense": lambda: problem.reference("fc2_dgrad", "dense"),
    }
    # One step of each from the same g: the fused kernel's dg and wh are the two passes' bits.
    expected_dg, expected_wh = makers["cuda_unfused"]()()
    got_dg, got_wh = makers["cuda_fused"]()()
    if not (torch.equal(got_dg, expected_dg) and torch.equal(got_wh, expected_wh)):
        raise AssertionError("cuda_fused differs from cuda_unfused")
    del expected_dg, expected_wh, got_dg, got_wh
    return {backend: graphed(makers[backend]()) for backend in BACKENDS}


def main() -> None:
    args = prologue(cli(__doc__, SHAPES, rounds=True))
    flush = L2Flush()
    rows = []
    for name in args.shapes:
        for splits_kind in SPLITS:
            problem = Experts(SHAPES[name], splits_kind)
            rows += round_rows(runs_of(problem), args.rounds, flush, f"{name} {splits_kind}",
                               problem.flops("fc2_dgrad"), "dgrad_swiglu", "fc2_dgrad_swiglu", name, splits_kind,
                               lambda times: f"  fused/unfused speed {speed(times, 'cuda_fused', 'cuda_unfused'):.3f}x")
            del problem
            torch.cuda.empty_cache()
    finish(rows, args, flush, LAYER_VARIANTS, "dgrad_swiglu")


if __name__ == "__main__":
    main()
