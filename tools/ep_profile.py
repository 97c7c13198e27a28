"""Usage: torchrun --nproc-per-node N tools/ep_profile.py [--shape qwen3_30b] [--steps 3] [--overlap-sms 16]

Where an expert-parallel layer step's GPU time goes: the step of
benchmarks/expert_parallel.py (T = 8192 tokens a rank, bf16, default
capacity, the default transport), timed eager and graphed, then a few
graphed steps under torch.profiler; rank 0 prints the last step's kernels in
order with their start and duration. N = 1 profiles the one-GPU (local)
step for comparison.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import expert_parallel as bench  # noqa: E402  (its shapes, layer and inputs)
from moe_grouped import graphs  # noqa: E402


def short(name: str) -> str:
    """A kernel's name cut to what tells it apart (CUTLASS's GEMMs by their layouts)."""
    if "GemmUniversal" in name:
        return f"cutlass GEMM ({name.count('RowMajor')} RowMajor, {name.count('ColumnMajor')} ColumnMajor, len {len(name)})"
    name = name.replace("(anonymous namespace)::", "").replace("moe_grouped::", "")
    return name.split("(")[0].split("<")[0][:90]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3_30b", choices=[s.name for s in bench.SHAPES])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--overlap-sms", type=int, default=None)
    parser.add_argument("--transport", default="auto")
    args = parser.parse_args()
    rank, ep = bench.init()
    shape = next(s for s in bench.SHAPES if s.name == args.shape)
    options = {} if args.overlap_sms is None else dict(overlap_sms=args.overlap_sms)
    layer = bench.make_layer(shape, "cuda", args.transport, **options)
    inputs = bench.make_inputs(shape, rank)
    params = list(layer.parameters())

    def step_on(x, dout):
        for p in params:
            p.grad = None
        x = x.detach().requires_grad_(True)
        out = layer(x)
        out.backward(dout)
        return out.detach()

    def step(i):
        step_on(*inputs[i % len(inputs)])

    for i in range(3):
        step(i)
    torch.cuda.synchronize()
    static = graphs.capture_step(lambda x, dout: step_on(x, dout), inputs[0][0].clone(), inputs[0][1].clone())

    def replay(i):
        x, dout = inputs[i % len(inputs)]
        static(x, dout)

    timings = {}
    for name, fn in (("eager", step), ("graphed", replay)):
        for i in range(3):
            fn(i)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(args.steps):
            fn(i)
        end.record()
        end.synchronize()
        timings[name] = start.elapsed_time(end) / args.steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(args.steps):
            replay(i)
        torch.cuda.synchronize()
    if rank == 0:
        kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                         key=lambda e: e.time_range.start)
        per_step = len(kernels) // args.steps
        last = kernels[-per_step:]
        t0 = last[0].time_range.start
        print(f"{shape.label} ep {ep} transport {layer.transport_name} {options}: step eager {timings['eager']:.3f} ms, "
              f"graphed {timings['graphed']:.3f} ms; {per_step} kernels a step, the last step's in order:")
        for e in last:
            start_ms = (e.time_range.start - t0) / 1e3
            print(f"  at {start_ms:8.3f} ms {e.time_range.elapsed_us() / 1e3:8.3f} ms  {short(e.name)}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
