"""Usage: PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 7 \
    python tools/memcheck_layer.py [--steps 2] [--shapes 0,1]

Training steps of the MoE layer on small shapes, for compute-sanitizer: the fused experts path in bf16 and in
FP8 (weights quantized in the step and kept across steps), and the unfused path; with router-chosen routing,
with every token on the first top_k experts (the others empty), and at each capacity option (tokens dropped,
padded to capacity, every copy dropped). Without PyTorch's caching allocator every tensor is its own
allocation, so that memcheck sees an access past any tensor's end (with the cache it sees only accesses past
a cached segment's). Prints one line per case and a last line when all ran; the sanitizer's report and exit
code say the rest (tests/test_memcheck.py runs it).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

import torch

from moe_grouped import MoELayer, fp8

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from cases import CAPACITY_OPTIONS  # noqa: E402  (the tests' capacity options: dropping, padding, zero)
# (tokens, hidden, ffn, experts, top_k): N and K off multiples of 128, and a group count past 64.
SHAPES = [(1000, 384, 272, 8, 2), (777, 256, 128, 72, 4)]


def step(layer: MoELayer, x: torch.Tensor, fp8_step: bool, first: bool) -> None:
    x = x.detach().requires_grad_()
    if fp8_step:
        with fp8.fp8_autocast():
            out = layer(x, is_first_microbatch=first)
    else:
        out = layer(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.randn_like(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--shapes", default=",".join(str(i) for i in range(len(SHAPES))),
                        help="indices into SHAPES (the slower tools, racecheck, want fewer)")
    args = parser.parse_args()
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") != "1":
        print("note: PYTORCH_NO_CUDA_MEMORY_CACHING is not 1: memcheck sees only accesses past cached segments")
    cases = 0
    for tokens, hidden, ffn, experts, top_k in (SHAPES[int(i)] for i in args.shapes.split(",")):
        for capacity, options in CAPACITY_OPTIONS.items():
            for path, fp8_step in (("fused", False), ("fused", True), ("unfused", False)):
                for routing in ("router", "first_experts"):
                    torch.manual_seed(0)
                    layer = MoELayer(hidden, ffn, experts, top_k, dtype=torch.bfloat16, device="cuda",
                                     backend="cuda", experts_path=path, **options)
                    if routing == "first_experts":
                        with torch.no_grad():
                            layer.router.weight.zero_()  # all scores tie: top_k picks the first experts
                    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
                    for s in range(args.steps):
                        step(layer, x, fp8_step, first=s == 0)
                    torch.cuda.synchronize()
                    print(f"ok {tokens}x{hidden} ffn {ffn} E {experts} k {top_k} {capacity} {path}"
                          f"{' fp8' if fp8_step else ''} {routing}", flush=True)
                    cases += 1
    print(f"done: {cases} cases")


if __name__ == "__main__":
    main()
