"""Usage: python tools/fp8_tile_cost.py [--rows 131072] [--n 2048] [--ks 256,512,768,1024,2048,4096] [--experts 1,8,32,128] [--rounds 3]

What an FP8 grouped fprop tile costs besides its K blocks (GPU; MOE_GROUPED_CORE_LIB for a carried core).

For each reduction length K and expert count E (balanced splits, every expert's rows a multiple of 128, so
no tile is partial), graph replays of the core's FP8 fprop of [rows, K] x [E, n, K] in interleaved rounds
(median, L2 flushed), beside one torch._scaled_mm of [rows, K] x [K, n] (per-tensor scales). Then per E a
least-squares line over K: microseconds per 128x256 tile = fixed + per_k_block * K / 128, the fixed part
being what a tile costs whatever its K (epilogue, pipeline fill, changes of group). E = 1 has no change of
group after a CTA's first tile; larger E changes group at nearly every tile of a CTA.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from common import L2Flush, dense_fp8_matmul, graphed, timed_rounds  # noqa: E402

from moe_grouped import fp8  # noqa: E402
from moe_grouped.fp8 import gemm as fp8_gemm  # noqa: E402

E4M3 = torch.float8_e4m3fn


def median_ms(runs: dict, rounds: int, flush: L2Flush) -> dict:
    return {name: statistics.median(t) for name, t in timed_rounds(runs, rounds, flush, per_round=10).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=131072)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--ks", default="256,512,768,1024,2048,4096")
    parser.add_argument("--experts", default="1,8,32,128")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    if len(set(ks)) < 2:
        parser.error("--ks needs at least two reduction lengths: the fit is a line over K")
    experts = [int(e) for e in args.experts.split(",")]
    rows, n = args.rows, args.n
    flush = L2Flush()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = rows // 128 * -(-n // 256)
    print(f"{torch.cuda.get_device_name()}: rows {rows}, n {n}, {tiles} tiles of 128x256 on {sms} SMs")
    per_tile = {e: [] for e in experts}
    for k in ks:
        x = fp8.quantize_rowwise(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16), E4M3)
        runs = {}
        for e in experts:
            assert rows % (128 * e) == 0, "balanced splits of whole tiles"
            splits = torch.full((e,), rows // e, dtype=torch.int64, device="cuda")
            w = fp8.quantize_weights_128x128(torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16), E4M3).w
            runs[f"E{e}"] = graphed(lambda x=x, w=w, s=splits: fp8_gemm.grouped_fprop_fp8(x, w, s))
        runs["dense"] = dense_fp8_matmul(rows, n, k)
        ms = median_ms(runs, args.rounds, flush)
        flops = 2.0 * rows * n * k
        line = "  ".join(f"{name} {t:.4f} ms {flops / t / 1e9:6.0f} TF/s" for name, t in ms.items())
        print(f"K {k:5d}: {line}")
        for e in experts:
            # µs a CTA spends per tile: the kernel's time over its tiles per SM
            per_tile[e].append(ms[f"E{e}"] * 1e3 / (tiles / sms))
    blocks = [k / 128 for k in ks]
    mean_b = statistics.fmean(blocks)
    for e in experts:
        ys = per_tile[e]
        mean_y = statistics.fmean(ys)
        slope = sum((b - mean_b) * (y - mean_y) for b, y in zip(blocks, ys)) / sum((b - mean_b) ** 2 for b in blocks)
        fixed = mean_y - slope * mean_b
        print(f"E {e:4d}: per tile {fixed:.2f} us fixed + {slope:.3f} us per K block "
              f"(per-tile us: {', '.join(f'{y:.2f}' for y in ys)})")


if __name__ == "__main__":
    main()
