"""Usage: python tools/fp8_wgrad_probe.py [--cases mixtral_fc1,qwen3_fc1] [--tokens 512,1024,2048,4096] [--splits balanced,random] [--rounds 3] [--digest] [--ncu CASE:TOKENS] [--json PATH]

Where the FP8 wgrad's time goes: the grouped FP8 wgrad against bf16 and dense FP8 over reduction lengths.

For each case (an expert's dW of N x K, E experts) and each reduction length (tokens per expert) and split pattern
(split_counts), graph replays timed in interleaved rounds (median, L2 flushed), in one process:
  fp8                     the core's FP8 wgrad into bf16 (the fused layer's dW; its heuristic's schedule)
  fp8_fp32                the core's FP8 wgrad into fp32 (main_grad; its heuristic's schedule)
  fp8_along_n             fp8 with the tiles walked along N (MOE_GROUPED_GEMM_RASTER=n; along M by default)
  bf16                    the core's bf16 wgrad
  dense_fp8               torch._scaled_mm of [E*N, T] x [T, K]: the same FLOPs and reduction length
  dense_fp8_block         the same with both operands scaled per 128 along T (the wgrad's recipe; cuBLAS)
With --digest it prints a digest of each FP8 output instead (two core builds give the same bits when
their digests match). With --ncu CASE:TOKENS it only runs that case's FP8 wgrad into bf16 and the bf16 one, twice each, untimed,
for `ncu --clock-control none -k regex:... python tools/fp8_wgrad_probe.py --ncu ...`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from common import L2Flush, dense_fp8_matmul, forced, graphed, timed_rounds  # noqa: E402

from moe_grouped import fp8  # noqa: E402
from moe_grouped.fp8 import gemm as fp8_gemm  # noqa: E402
from moe_grouped.gemm import cuda_backend  # noqa: E402

E4M3 = torch.float8_e4m3fn
ALONG_N = {"MOE_GROUPED_GEMM_RASTER": "n"}  # the core's tiles walked along N
# name -> (N, K, E): fc1's dW is [2I, H], fc2's [H, I]
CASES = {
    "mixtral_fc1": (2 * 14336, 4096, 8),
    "mixtral_fc2": (4096, 14336, 8),
    "qwen3_fc1": (2 * 768, 2048, 128),
    "qwen3_fc2": (2048, 768, 128),
    "olmoe_fc1": (2 * 1024, 2048, 64),
    "dsv2_fc1": (2 * 1408, 2048, 64),
    "dsv2_fc2": (2048, 1408, 64),
}


def split_counts(kind: str, tokens: int, e: int) -> list[int]:
    """Tokens per expert, summing to tokens * e.

    balanced: all equal; shifted16: the first expert 16 more, the last 16 fewer (every other group
    starts 16 tokens off a 128-token boundary, one has a short last block); random: each of
    tokens * e / k tokens' top-k (k = 8, or 2 for e <= 8) of uniform scores; random128: those counts
    rounded to multiples of 128 (the last takes the rest).
    """
    if kind == "balanced":
        return [tokens] * e
    if kind == "shifted16":
        return [tokens + 16] + [tokens] * (e - 2) + [tokens - 16]
    top = 2 if e <= 8 else 8
    gen = torch.Generator().manual_seed(0)
    picks = torch.rand(tokens * e // top, e, generator=gen).topk(top, dim=1).indices
    counts = torch.bincount(picks.flatten(), minlength=e).tolist()
    if kind == "random":
        return counts
    if kind == "random128":
        rounded = [round(c / 128) * 128 for c in counts[:-1]]
        return rounded + [tokens * e - sum(rounded)]
    raise ValueError(f"unknown splits {kind!r}")


class Case:
    def __init__(self, name: str, tokens: int, splits: str = "balanced"):
        self.n, self.k, self.e = CASES[name]
        self.rows = rows = tokens * self.e
        self.splits = torch.tensor(split_counts(splits, tokens, self.e), dtype=torch.int32, device="cuda")
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.dy = torch.randn(rows, self.n, device="cuda", generator=gen).bfloat16()
        self.x = torch.randn(rows, self.k, device="cuda", generator=gen).bfloat16()
        self.dyt = fp8.quantize_columnwise_grouped(self.dy, self.splits, E4M3)
        self.xt = fp8.quantize_columnwise_grouped(self.x, self.splits, E4M3)
        self.dw = torch.empty(self.e, self.n, self.k, device="cuda", dtype=torch.bfloat16)
        self.dw32 = torch.empty(self.e, self.n, self.k, device="cuda", dtype=torch.float32)
        self.flops = 2.0 * rows * self.n * self.k

    def fp8_wgrad(self, out: torch.Tensor):
        return lambda: fp8_gemm.grouped_wgrad_fp8(self.dyt, self.xt, self.splits, [out], total_rows=self.rows)

    def bf16_wgrad(self):
        return lambda: cuda_backend.wgrad(self.dy, self.x, self.splits, [self.dw], False)

    def dense_fp8(self, scaling: str = "tensor"):
        return dense_fp8_matmul(self.e * self.n, self.k, self.rows // self.e, scaling)


def digest(t: torch.Tensor) -> str:
    """A position-weighted wrapping sum of the tensor's 32-bit words: equal bits, equal digests."""
    words = t.contiguous().view(torch.int32).flatten()
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), 1 << 26):
        chunk = words[start : start + (1 << 26)].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), device=t.device, dtype=torch.int64) * 2654435761 + 1
        total += (chunk * weights).sum()
    return f"{int(total) & (2**64 - 1):016x}"


def measure(name: str, tokens: int, splits: str, rounds: int, flush: L2Flush) -> list[dict]:
    case = Case(name, tokens, splits)
    runs = {"fp8": graphed(case.fp8_wgrad(case.dw)),
            "fp8_fp32": graphed(case.fp8_wgrad(case.dw32)),
            "fp8_along_n": graphed(forced(ALONG_N, case.fp8_wgrad(case.dw))),
            "bf16": graphed(case.bf16_wgrad()),
            "dense_fp8": graphed(case.dense_fp8()),
            "dense_fp8_block": graphed(case.dense_fp8("1x128_1x128"))}
    times = timed_rounds(runs, rounds, flush, per_round=10)
    rows = []
    for backend, runs_ms in times.items():
        ms = statistics.median(runs_ms)
        rows.append({"case": name, "tokens": tokens, "splits": splits, "backend": backend, "ms": round(ms, 5),
                     "tflops": round(case.flops / ms / 1e9, 1)})
    del case, runs
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--cases", default="mixtral_fc1,qwen3_fc1")
    parser.add_argument("--tokens", default="512,1024,2048,4096")
    parser.add_argument("--splits", default="balanced", help="comma-separated: " + "balanced,shifted16,random,random128")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ncu", default="")
    parser.add_argument("--json", default="")
    parser.add_argument("--digest", action="store_true")
    args = parser.parse_args()
    if args.ncu:
        name, tokens = args.ncu.split(":")
        case = Case(name, int(tokens))
        for fn in (case.fp8_wgrad(case.dw), case.bf16_wgrad()):
            for _ in range(2):
                fn()
        torch.cuda.synchronize()
        return
    if args.digest:
        for name in args.cases.split(","):
            for tokens, splits in ((int(t), s) for t in args.tokens.split(",") for s in args.splits.split(",")):
                case = Case(name, int(tokens), splits)
                case.fp8_wgrad(case.dw)()
                case.fp8_wgrad(case.dw32)()
                line = f"digest {name}:{tokens}:{splits} bf16 {digest(case.dw)} fp32 {digest(case.dw32)}"
                forced(ALONG_N, case.fp8_wgrad(case.dw))()
                print(f"{line} bf16_along_n {digest(case.dw)}", flush=True)
                del case
                torch.cuda.empty_cache()
        return
    flush = L2Flush()
    rows = []
    for name in args.cases.split(","):
        for tokens, splits in ((int(t), s) for t in args.tokens.split(",") for s in args.splits.split(",")):
            new = measure(name, tokens, splits, args.rounds, flush)
            rows += new
            print(" ".join(f"{r['case']}:{r['tokens']}:{r['splits']} {r['backend']} {r['ms']:.3f} ms {r['tflops']:.0f} TF |"
                           for r in new), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                                      indent=1))


if __name__ == "__main__":
    main()
