"""Gathered grouped GEMMs: the fused experts path's four token-side GEMMs.

Each reads token rows ([T, H] tokens x, or the layer's output gradient dout)
through the routing index instead of from a permuted [T*k, H] copy:

  fc1_fprop  g = x[index] . W1^T              (N = 2I, K = H)
  fc2_dgrad  dh = dout[index] . W2            (N = H,  K = I)
  fc2_wgrad  dW2 = dout[index]^T . wh         (per expert, K = its tokens)
  fc1_wgrad  dW1 = dg^T . x[index]

Backends, all in one process on the same data (Qwen3-like routing: random
top-k experts per token, so rows of one expert come from all over x):
  cuda_gathered   the core's gathered kernel: no permuted copy
  cuda_gather     the permute kernel's copy, then the plain kernel: what
                  the layer ran before the gathered kernels
  cuda            the plain kernel on an already permuted copy (the copy not
                  timed): the GEMM the gathered kernel must match
  torch           torch._grouped_mm on the permuted copy (copy not timed)
  loop            one torch.matmul per expert on the permuted copy
  dense           one torch.matmul of the same FLOPs
TFLOP/s count the GEMM only (2 * rows * N * K). Median of CUDA-event-timed
runs with a 256 MB L2 flush before each.

    python benchmarks/kernels/gathered_gemm.py [--shapes qwen3_30b_16k,...]
"""

from __future__ import annotations

import math
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: common, grouped_gemm, moe_layer
from common import L2Flush, cli, print_table, prologue, time_ms, write_results  # noqa: E402

# name: (T, H, I, E, k), the experts-path shapes of benchmarks/moe_layer.py
SHAPES = {
    "qwen3_30b_16k": (16384, 2048, 768, 128, 8),
    "olmoe_16k": (16384, 2048, 1024, 64, 8),
    "h4096_e128_32k": (32768, 4096, 1024, 128, 8),
    "dsv2_lite_16k": (16384, 2048, 1408, 64, 6),
    "mixtral_8k": (8192, 4096, 14336, 8, 2),
}
OPS = ("fc1_fprop", "fc2_dgrad", "fc2_wgrad", "fc1_wgrad")
BACKENDS = ("cuda_gathered", "cuda_gather", "cuda", "torch", "loop", "dense")


class Case:
    """Routing, tokens and weights of one shape, and each op's operands."""

    def __init__(self, shape):
        import moe_grouped
        from moe_grouped.gemm import cuda_backend
        from moe_grouped.permute import source_rows

        self.cuda = cuda_backend
        t, h, i, e, k = shape
        self.top_k, self.rows = k, t * k
        gen = torch.Generator(device="cuda").manual_seed(0)
        experts = torch.rand(t, e, device="cuda", generator=gen).topk(k, dim=1).indices
        self.row_id_map, self.m_splits, rows = moe_grouped.permute_index(
            torch.empty(t, 1, device="cuda"), experts, e, backend="cuda")
        assert rows == self.rows
        self.index = source_rows(self.row_id_map, k, rows)
        self.offs = torch.cumsum(self.m_splits, 0, dtype=torch.int32)
        self.bounds = [(g, s, u) for g, (s, u) in enumerate(
            zip([0] + self.offs.tolist()[:-1], self.offs.tolist())) if u > s]
        rand = lambda *size: torch.randn(*size, device="cuda", generator=gen).bfloat16()  # noqa: E731
        self.x, self.dout = rand(t, h), rand(t, h)
        self.w1, self.w2 = rand(e, 2 * i, h) / math.sqrt(h), rand(e, h, i) / math.sqrt(i)
        self.dg, self.wh = rand(rows, 2 * i), rand(rows, i)
        self.xp, self.dyp = self.gather(self.x), self.gather(self.dout)
        self.dw1 = torch.empty(e, 2 * i, h, device="cuda", dtype=torch.bfloat16)
        self.dw2 = torch.empty(e, h, i, device="cuda", dtype=torch.bfloat16)
        # (N, K) of each op's GEMM, for FLOPs and the dense stand-in.
        self.nk = {"fc1_fprop": (2 * i, h), "fc2_dgrad": (i, h), "fc2_wgrad": (h, i), "fc1_wgrad": (2 * i, h)}

    def gather(self, tokens):
        return torch.ops.moe_grouped.permute_rows(tokens, self.row_id_map, self.top_k, self.rows, False, "cuda")

    def flops(self, op):
        n, k = self.nk[op]
        return 2.0 * self.rows * n * k

    def run(self, op, backend):
        c, s, bf16 = self.cuda, self.m_splits, torch.bfloat16
        gm, offs = torch._grouped_mm, self.offs
        if backend == "dense":
            n, k = self.nk[op]
            a, b = torch.randn(self.rows, k, device="cuda").bfloat16(), torch.randn(k, n, device="cuda").bfloat16()
            return lambda: a @ b
        if op == "fc1_fprop":
            return {
                "cuda_gathered": lambda: c.fprop_gathered(self.x, self.index, [self.w1], s, bf16),
                "cuda_gather": lambda: c.fprop(self.gather(self.x), [self.w1], s, None, bf16),
                "cuda": lambda: c.fprop(self.xp, [self.w1], s, None, bf16),
                "torch": lambda: gm(self.xp, self.w1.transpose(-2, -1), offs=offs),
                "loop": lambda: [self.xp[a:b] @ self.w1[g].t() for g, a, b in self.bounds],
            }[backend]
        if op == "fc2_dgrad":
            return {
                "cuda_gathered": lambda: c.dgrad_gathered(self.dout, self.index, [self.w2], s, bf16),
                "cuda_gather": lambda: c.dgrad(self.gather(self.dout), [self.w2], s, bf16),
                "cuda": lambda: c.dgrad(self.dyp, [self.w2], s, bf16),
                "torch": lambda: gm(self.dyp, self.w2, offs=offs),
                "loop": lambda: [self.dyp[a:b] @ self.w2[g] for g, a, b in self.bounds],
            }[backend]
        if op == "fc2_wgrad":
            return {
                "cuda_gathered": lambda: c.wgrad_gathered(self.dout, self.index, self.wh, None, s, [self.dw2], False),
                "cuda_gather": lambda: c.wgrad(self.gather(self.dout), self.wh, s, [self.dw2], False),
                "cuda": lambda: c.wgrad(self.dyp, self.wh, s, [self.dw2], False),
                "torch": lambda: gm(self.dyp.t(), self.wh, offs=offs),
                "loop": lambda: [self.dyp[a:b].t() @ self.wh[a:b] for g, a, b in self.bounds],
            }[backend]
        return {
            "cuda_gathered": lambda: c.wgrad_gathered(self.dg, None, self.x, self.index, s, [self.dw1], False),
            "cuda_gather": lambda: c.wgrad(self.dg, self.gather(self.x), s, [self.dw1], False),
            "cuda": lambda: c.wgrad(self.dg, self.xp, s, [self.dw1], False),
            "torch": lambda: gm(self.dg.t(), self.xp, offs=offs),
            "loop": lambda: [self.dg[a:b].t() @ self.xp[a:b] for g, a, b in self.bounds],
        }[backend]


def main() -> None:
    parser = cli(__doc__, SHAPES)
    parser.add_argument("--repeats", type=int, default=30)
    args = prologue(parser)
    names = args.shapes
    flush = L2Flush()
    rows = []
    for name in names:
        case = Case(SHAPES[name])
        for op in OPS:
            for backend in BACKENDS:
                ms = time_ms(case.run(op, backend), repeats=args.repeats, flush=flush)
                rows.append({"bench": "gathered_gemm", "op": op, "shape": name, "splits": "topk_random",
                             "backend": backend, "ms": round(ms, 5), "tflops": round(case.flops(op) / ms / 1e9, 2)})
        del case
        torch.cuda.empty_cache()
    print_table(rows, "tflops")
    by_key = {(r["op"], r["shape"], r["backend"]): r["ms"] for r in rows}
    print("\ncuda_gathered vs cuda_gather (the copy + plain kernel) and vs cuda (plain kernel alone):")
    for name in names:
        for op in OPS:
            g = by_key[(op, name, "cuda_gathered")]
            print(f"  {name:<16} {op:<10} {by_key[(op, name, 'cuda_gather')] / g:5.3f}x  "
                  f"{by_key[(op, name, 'cuda')] / g:5.3f}x")
    print(f"wrote {write_results('gathered_gemm', rows)}")


if __name__ == "__main__":
    main()
