"""Usage: python tools/quantize_probe.py [--shapes qwen3_30b_16k,...] [--passes tokens_colwise,...] [--rounds 4] [--ncu]

The FP8 fused layer step's quantizations alone, at an issue-19 shape's sizes (benchmarks/kernels/
gathered_gemm.py's SHAPES: R = T * k routed rows, top-k of uniform scores), each as the step calls it
(``quantize_rows``, ``quantize_weights_128x128``), timed as graph replays in interleaved rounds (median, L2
flushed) beside a device copy, with the bytes it must move (bf16 read, each gathered row counted; FP8 data
and fp32 scales written) and its rate:
  tokens_rowwise   x [T, H] through the index, row-wise (fc1's fprop)
  tokens_colwise   x through the index, column-wise (fc1's wgrad)
  dout_both        dout [T, H] through the index, both copies (fc2's dgrad and wgrad)
  wh_colwise       wh [R, I], column-wise (fc2's wgrad)
  dg_rowwise       dg [R, 2I], row-wise (fc1's dgrad)
  dg_colwise       dg, column-wise (fc1's wgrad)
  swiglu_h         h = swiglu(g) from g [R, 2I] (dg's memory here), row-wise (fc2's fprop)
  w1, w2           fc1's weights [E, 2I, H] and fc2's [E, H, I] in 128x128 blocks with their transposes
  copy             a device copy of a bf16 [R, H] (its read and its write counted)
With --ncu each pass runs twice, untimed, for `ncu -k regex:quantize python tools/quantize_probe.py --ncu ...`.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "kernels"))
from common import L2Flush, graphed, timed_rounds  # noqa: E402
from gathered_gemm import SHAPES  # noqa: E402

from moe_grouped.fp8.quantize import (  # noqa: E402
    BlockQuantized, WeightQuantized, quantize_rows, quantize_weights_128x128, swiglu_quantize_rows)

E4M3 = torch.float8_e4m3fn
PASSES = ("tokens_rowwise", "tokens_colwise", "dout_both", "wh_colwise", "dg_rowwise", "dg_colwise", "swiglu_h", "w1",
          "w2", "copy")


class Step:
    """One shape's routed rows and the tensors its quantizations read."""

    def __init__(self, shape):
        t, h, i, e, k = shape
        gen = torch.Generator(device="cuda").manual_seed(0)
        experts = torch.rand(t, e, device="cuda", generator=gen).topk(k, dim=1).indices.flatten()
        self.index = (torch.argsort(experts, stable=True) // k).to(torch.int32)  # permuted row -> token
        self.m_splits = torch.bincount(experts, minlength=e).to(torch.int32)
        self.rows = t * k
        rand = lambda *size: torch.randn(*size, device="cuda", generator=gen).bfloat16()  # noqa: E731
        self.x, self.dout = rand(t, h), rand(t, h)
        self.wh, self.dg = rand(self.rows, i), rand(self.rows, 2 * i)
        self.w1, self.w2 = rand(e, 2 * i, h), rand(e, h, i)
        self.copy_src = rand(self.rows, h)
        self.copy_dst = torch.empty_like(self.copy_src)

    def run(self, name: str):
        """(the pass as a callable returning what it writes, the bf16 bytes it reads)."""
        if name == "copy":
            return (lambda: self.copy_dst.copy_(self.copy_src)), self.copy_src.nbytes
        if name == "swiglu_h":
            return (lambda: swiglu_quantize_rows(self.dg, E4M3, True, 0.0, "cuda")), self.dg.nbytes
        if name in ("w1", "w2"):
            w = getattr(self, name)
            out = quantize_weights_128x128(w, E4M3)  # buffers the graphed pass writes into
            return (lambda: quantize_weights_128x128(w, E4M3, out=out, backend="cuda")), w.nbytes
        src, index, rowwise, colwise = {
            "tokens_rowwise": (self.x, self.index, True, False),
            "tokens_colwise": (self.x, self.index, False, True),
            "dout_both": (self.dout, self.index, True, True),
            "wh_colwise": (self.wh, None, False, True),
            "dg_rowwise": (self.dg, None, True, False),
            "dg_colwise": (self.dg, None, False, True),
        }[name]
        splits = self.m_splits if colwise else None
        read = self.rows * src.shape[1] * src.element_size()  # each gathered row counted
        return (lambda: quantize_rows(src, index, E4M3, True, 0.0, splits, rowwise, "cuda")), read


def written(out) -> int:
    """Bytes of what one pass writes: the copy's tensor, or the FP8 copies and their fp32 scales."""
    if isinstance(out, torch.Tensor):
        return out.nbytes
    if isinstance(out, BlockQuantized):
        return out.data.nbytes + out.scale_inv.nbytes
    copies = (out.w, out.wt) if isinstance(out, WeightQuantized) else (out.rowwise, out.columnwise)
    return sum(b.data.nbytes + b.scale_inv.nbytes for b in copies if b is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen3_30b_16k,h4096_e128_32k")
    parser.add_argument("--passes", default=",".join(PASSES))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--ncu", action="store_true")
    args = parser.parse_args()
    passes = args.passes.split(",")
    unknown = sorted(set(passes) - set(PASSES))
    if unknown:
        parser.error(f"unknown passes {unknown}; known: {', '.join(PASSES)}")
    flush = L2Flush()
    for shape_name in args.shapes.split(","):
        step = Step(SHAPES[shape_name])
        runs = {name: step.run(name) for name in passes}
        if args.ncu:
            for fn, _ in runs.values():
                fn(), fn()
            torch.cuda.synchronize()
            continue
        moved_bytes = {name: read + written(fn()) for name, (fn, read) in runs.items()}
        times = timed_rounds({name: graphed(fn) for name, (fn, _) in runs.items()}, args.rounds, flush, per_round=3)
        for name in runs:
            ms, moved = statistics.median(times[name]), moved_bytes[name]
            print(f"{shape_name} {name:<15} {ms:8.4f} ms  {moved / 1e6:9.1f} MB  {moved / ms / 1e9:6.2f} TB/s")
        del step, runs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
