"""Usage: python tools/layer_profile.py [--shapes qwen3_30b_16k,mixtral_8k] [--modes bf16,fp8] [--steps 3]

Where one MoELayer training step's GPU time goes (on the GPU machine; MOE_GROUPED_CORE_LIB for a
carried core): the step of benchmarks/moe_layer.py (an issue-19 shape, cuda backend, default experts
path; ``fp8`` inside fp8_autocast with is_first_microbatch=True as the benchmark runs it), profiled
with torch.profiler after warm-up. Prints per mode the kernels' summed CUDA time per step, largest
first, with their share of the step.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import moe_layer  # noqa: E402


def kernel_times(step, steps: int) -> collections.Counter:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    times = collections.Counter()
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.key] += event.device_time_total / steps / 1e3  # ms per step
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen3_30b_16k")
    parser.add_argument("--modes", default="bf16,fp8")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    shapes = {s.name: s for s in moe_layer.EXPERTS_PATH_SHAPES}
    for name in args.shapes.split(","):
        shape = shapes[name]
        x, dout = moe_layer.make_inputs(shape)[0]
        for mode in args.modes.split(","):
            backend = "cuda_fp8" if mode == "fp8" else "cuda"
            layer = moe_layer.make_layer(shape, backend)
            forward = moe_layer.forward_of(layer, backend)

            def step(layer=layer, forward=forward):
                layer.zero_grad(set_to_none=True)
                x.grad = None
                forward(x).backward(dout)

            times = kernel_times(step, args.steps)
            total = sum(times.values())
            print(f"\n{name} {mode}: {total:.3f} ms of kernels per step")
            for kernel, ms in times.most_common(args.top):
                print(f"  {ms:8.3f} ms {100 * ms / total:5.1f}%  {kernel[:110]}")
            del layer
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
