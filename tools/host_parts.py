"""Usage: python tools/host_parts.py [--calls N] [--trace FILE]   (on the GPU machine; MOE_GROUPED_CORE_LIB for a carried core)

Host microseconds of the parts of one eager MoELayer step (T=256, H=1024, F=512, E=64, k=8, bf16,
cuda, fused, one grouped weight), each issued ``--calls`` times back to back from an idle GPU
(median of 5 rounds), beside the floors this host sets: a trivial ctypes call into the core, an
empty tensor, a one-kernel torch op, an autograd Function that does nothing, forward and backward.
The parts do not add up exactly to the step (they run out of context), but they show where
the step's host time is. ``--trace FILE``: also a Chrome trace (torch.profiler, CPU with the Python
functions' stacks) of three steps.
"""

from __future__ import annotations

import argparse

import torch
from host_probe import issue_ms  # tools/ is on the path when this runs as a script

import moe_grouped
from moe_grouped import _core
from moe_grouped.experts import FusedExpertsFunction, STAGES
from moe_grouped.permute import permute_index, source_rows

T, H, F, E, K = 256, 1024, 512, 64, 8


def host_us(fn, calls: int) -> float:
    """Median host microseconds per call of ``calls`` calls issued back to back (5 rounds)."""
    fn()
    return issue_ms(fn, calls, 5) * 1e3


class _Nothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *weights):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad,) + (None,) * 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--trace", help="write a Chrome trace of three steps here")
    args = parser.parse_args()
    layer = moe_grouped.MoELayer(H, F, E, K, dtype=torch.bfloat16, device="cuda", backend="cuda")
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    params = list(layer.parameters())
    experts = layer.experts

    def step():
        for p in params:
            p.grad = None
        x.grad = None
        layer(x).backward(dout)

    def forward_only():
        with torch.no_grad():
            layer(x)

    routing = layer.router(x)
    row_id_map, m_splits, rows = permute_index(x, routing.experts, E, backend="cuda")
    plan = experts._plan(x, routed=True, top_k=K, num_rows=rows, zero_unmapped=False, permute_backend="cuda")
    weights = experts.fc1.weights() + experts.fc2.weights()
    probs = routing.weights.detach().requires_grad_(True)

    def fused_apply():
        return FusedExpertsFunction.apply(x, probs, row_id_map, m_splits, plan, None, STAGES,
                                          experts.fc1._delayed, experts.fc2._delayed, *weights)

    out = fused_apply()

    def fused_backward():
        for p in params:
            p.grad = None
        x.grad = probs.grad = None
        fused_apply().backward(dout)

    gate_x = x.detach().requires_grad_(True)

    def router_fwd_bwd():
        layer.router.weight.grad = None
        r = layer.router(gate_x)
        r.weights.backward(torch.ones_like(r.weights))

    leaves = [torch.zeros(1, device="cuda", requires_grad=True) for _ in range(3)]
    small = torch.zeros(1, device="cuda")

    def nothing_fwd_bwd():
        x.grad = None
        _Nothing.apply(x, *leaves).backward(dout)

    lib = _core.require()
    gate = layer.router.weight.detach()
    halves = torch.randn(T, 2 * E, device="cuda").to(torch.bfloat16)
    gate2 = torch.cat([gate, gate])
    xd = x.detach()
    gate_mms = (
        lambda: torch.mm(xd, gate.t(), out_dtype=torch.float32),
        lambda: torch.mm(halves, gate2),
        lambda: torch.mm(halves.t(), xd, out_dtype=torch.float32),
    )

    def three_mms():
        for mm in gate_mms:
            mm()

    parts = {
        "step (fwd+bwd)": step,
        "forward, no grad": forward_only,
        "forward, grad": lambda: layer(x),
        "router fwd": lambda: layer.router(x),
        "router fwd+bwd": router_fwd_bwd,
        "uses_fused_path": lambda: experts.uses_fused_path(x),
        "permute_index": lambda: permute_index(x, routing.experts, E, backend="cuda"),
        "source_rows": lambda: source_rows(row_id_map, K, rows),
        "_plan": lambda: experts._plan(x, routed=True, top_k=K, num_rows=rows, zero_unmapped=False,
                                       permute_backend="cuda"),
        "FusedExperts fwd": fused_apply,
        "FusedExperts fwd+bwd": fused_backward,
        "routing.detached()": lambda: routing.detached(),
        "gate mm: logits (fp32 out)": gate_mms[0],
        "gate mm: dx": gate_mms[1],
        "gate mm: dW (fp32 out)": gate_mms[2],
        "gate mms: the three in turn": three_mms,
        "floor: ctypes mg_abi_version": lib.mg_abi_version,
        "floor: torch.empty": lambda: torch.empty(T, H, device="cuda", dtype=torch.bfloat16),
        "floor: small.add_(1) (1 launch)": lambda: small.add_(1),
        "floor: Function fwd+bwd, 4 leaves": nothing_fwd_bwd,
        "floor: stream_handle": lambda: _core.stream_handle(x.device),
    }
    del out
    if args.trace:
        from torch.profiler import ProfilerActivity, profile

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        prof.export_chrome_trace(args.trace)
    for name, fn in parts.items():
        print(f"{name:<36} {host_us(fn, args.calls):9.1f} us", flush=True)


if __name__ == "__main__":
    main()
