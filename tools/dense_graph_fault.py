"""Usage: python tools/dense_graph_fault.py [--with-core] [--with-layer] [--shapes qwen3_30b_16k,olmoe_16k,h4096_e128_32k] [--rounds 2]

Does a graphed cuBLAS matmul fault at replay beside other graphs? benchmarks/kernels/fp8_ceiling.py first
captured its dense stand-ins (one torch matmul / torch._scaled_mm each) in CUDA graphs beside the core's, and a
dense bf16 graph's replay faulted (illegal address) at the second or third shape (docs/experts-path.md, the
FP8 ceiling of 2026-11-29). This runs the same shapes, operands and timing rounds with the dense stand-ins
graphed: alone (the default) or beside the core's bf16 and FP8 graphs (--with-core), and with the fused
layer's steps graphed after each shape's GEMMs as fp8_ceiling.py runs them (--with-layer). A fault without
the core is torch's or cuBLAS's; prints each (shape, op) as it completes, so the last line before a fault
names it.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

root = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root / "benchmarks"), str(root / "benchmarks" / "kernels")]
from common import L2Flush, graphed, timed_rounds  # noqa: E402
from experts_gemm_tiles import OPS, Experts  # noqa: E402
from fp8_ceiling import Fp8Operands, dense_fp8  # noqa: E402
from gathered_gemm import SHAPES  # noqa: E402
import moe_layer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--with-core", action="store_true")
    parser.add_argument("--with-layer", action="store_true")
    parser.add_argument("--shapes", default="qwen3_30b_16k,olmoe_16k,h4096_e128_32k")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    flush = L2Flush()
    for name in args.shapes.split(","):
        ex = Experts(SHAPES[name], "topk_random")
        q = Fp8Operands(ex) if args.with_core else None
        for op in OPS:
            runs = {"dense": graphed(ex.reference(op, "dense")), "dense_fp8": graphed(dense_fp8(ex, op))}
            if q is not None:
                runs.update(cuda=graphed(ex.core(op)), cuda_fp8=graphed(q.run(op)))
            timed_rounds(runs, args.rounds, flush, per_round=3)
            torch.cuda.synchronize()
            print(f"ok {name} {op} ({', '.join(runs)})", flush=True)
        del ex, q
        if args.with_layer:
            shape = next(s for s in moe_layer.EXPERTS_PATH_SHAPES if s.name == name)
            moe_layer.bench_layer(shape, ["cuda_fused", "cuda_fp8_fused"], flush, loop=False)
            torch.cuda.synchronize()
            print(f"ok {name} layer steps", flush=True)
        torch.cuda.empty_cache()
    print("no fault")


if __name__ == "__main__":
    main()
