"""Usage: python tools/host_probe.py [--single-weight]   (on the GPU machine; MOE_GROUPED_CORE_LIB for a carried core)

Where an eager MoE step's time goes: host issue time, GPU time, and the cost of single calls.

Prints, for MoELayer (T=256, H=1024, F=512, E=64, k=8, bf16, cuda fused):
the host time to issue a step when 1, 3 or 100 steps go back to back (the
launch queue fills only for long runs: a gap between them means the GPU is
the bound); the GPU time of the same step captured and replayed; a
torch.profiler table with CUDA runtime calls; then per-call host and wall
microseconds of single ops (the custom op, its backend function, the bare
ctypes call).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import moe_grouped
from moe_grouped import graphs
from moe_grouped.gemm import cuda_backend

T, H, F, E, K = 256, 1024, 512, 64, 8


def issue_ms(step, steps: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        times.append((time.perf_counter() - start) * 1e3 / steps)
    torch.cuda.synchronize()
    return statistics.median(times)


def per_call_us(fn, calls: int = 300) -> tuple[float, float]:
    """(host issue µs, wall µs) per call of ``fn`` over ``calls`` calls back to back."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (issued - start) * 1e6 / calls, (done - start) * 1e6 / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--single-weight", action="store_true", help="one [E, N, K] weight per layer")
    args = parser.parse_args()
    layer = moe_grouped.MoELayer(H, F, E, K, dtype=torch.bfloat16, device="cuda", backend="cuda",
                                 experts_path="fused", single_grouped_weight=args.single_weight)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    params = list(layer.parameters())

    def step():
        for p in params:
            p.grad = None
        layer(x).backward(dout)

    for _ in range(10):
        step()
    for steps in (1, 3, 100):
        print(f"issue ms per step, {steps:3d} back to back: {issue_ms(step, steps, 20 if steps < 100 else 5):.3f}")
    def fwd_bwd(a, b):
        for p in params:
            p.grad = None
        out = layer(a.detach().requires_grad_(True))
        out.backward(b)
        return out.detach()

    static = graphs.capture_step(fwd_bwd, x.detach().clone(), dout.clone())
    inputs = (x.detach().clone(), dout.clone())
    replay_ms = issue_ms(lambda: (static(*inputs), torch.cuda.synchronize()), 20, 3)
    print(f"graph replay (copy in + replay + sync) ms per step: {replay_ms:.3f}")

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))

    w = layer.experts.fc1.weights()
    splits = torch.full((E,), T * K // E, dtype=torch.int64, device="cuda")
    xp = torch.randn(T * K, H, device="cuda", dtype=torch.bfloat16)
    gate = layer.router.weight.detach()
    one_group = torch.tensor([T], dtype=torch.int64, device="cuda")
    calls = {
        "torch.ops grouped_fprop": lambda: torch.ops.moe_grouped.grouped_fprop(
            xp, w, splits, None, torch.bfloat16, "cuda", False),
        "cuda_backend.fprop": lambda: cuda_backend.fprop(xp, w, splits, None, torch.bfloat16),
        "torch.mm": lambda: torch.mm(xp, xp[:H].t()),
        # The router's logits, [T, E] in fp32 from bf16 operands, three ways.
        "router mm out_dtype fp32": lambda: torch.mm(x.detach(), gate.t(), out_dtype=torch.float32),
        "router mm bf16": lambda: torch.mm(x.detach(), gate.t()),
        "router core fprop fp32": lambda: cuda_backend.fprop(x.detach(), [gate[None]], one_group, None,
                                                             torch.float32),
        "torch.empty": lambda: torch.empty(T * K, H, device="cuda", dtype=torch.bfloat16),
        "current_stream": lambda: torch.cuda.current_stream(xp.device).cuda_stream,
        "raw stream": lambda: torch._C._cuda_getCurrentRawStream(0),
    }
    for name, fn in calls.items():
        host, wall = per_call_us(fn)
        print(f"{name:<28} host {host:8.1f} us   wall {wall:8.1f} us")


if __name__ == "__main__":
    main()
