"""The softmax router's kernels against the torch composition they replace, alone and in the layer.

op ``router_fwd_bwd``: ``moe_grouped.Router`` forward and backward on bf16
tokens [T, H] of each issue-19 shape (T, H, E, top-k as in
benchmarks/moe_layer.py; top-k-then-softmax routing, as there), with a loss
that reaches the weights and both auxiliary losses, captured in a CUDA graph
and replayed (GPU time), 256 MB L2 flush before each run, interleaved rounds,
median:

  cuda    mg_route_softmax and its backward after the gate GEMM (the default
          for bf16 on CUDA)
  torch   the same router composing torch ops (softmax, gather, the losses'
          reductions; backward: softmax backward, scatter, bf16 split), the
          path before the kernels
  gate    the gate GEMMs alone (forward logits, dx, dW): the floor both share

op ``layer_fwd_bwd`` (unless ``--no-layer``): one training step of the fused
MoELayer (benchmarks/moe_layer.py's ``cuda_fused``) with each router, eager
and graphed, each captured afresh every round, one graph alive at a time.
``tflops``: the expert GEMMs' 18 T k H I per step, as moe_layer.py.

    python benchmarks/router.py    # table + results/router-<gpu>.json
"""

from __future__ import annotations

import contextlib
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import L2Flush, cli, graphed, print_table, prologue, run_ms, write_results  # noqa: E402

import moe_layer  # noqa: E402
from moe_layer import layer_step_rows  # noqa: E402

SHAPES = {s.name: s for s in moe_layer.EXPERTS_PATH_SHAPES}


@contextlib.contextmanager
def router_path(name: str):
    """``cuda``: the kernels where they apply (the default); ``torch``: the composition."""
    from moe_grouped import routing

    applies = routing.softmax_route_applies
    if name == "torch":
        routing.softmax_route_applies = lambda *args: False
    try:
        yield
    finally:
        routing.softmax_route_applies = applies


def router_runs(shape) -> dict:
    """Backend -> graph replay of one router step on this shape's tokens."""
    from moe_grouped import Router

    torch.manual_seed(0)
    router = Router(shape.hidden, shape.experts, shape.top_k, dtype=torch.bfloat16, device="cuda", **shape.router)
    x = torch.randn(shape.tokens, shape.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    coeffs = torch.randn(shape.tokens, shape.top_k, device="cuda")

    def step():
        x.grad = router.weight.grad = None
        out = router(x)
        ((out.weights * coeffs).sum() + 1e-2 * out.aux_loss + 1e-3 * out.z_loss).backward()

    def gate():
        x.grad = router.weight.grad = None
        logits = torch.mm(x, router.weight.t(), out_dtype=torch.float32)
        halves = torch.empty(shape.tokens, 2 * shape.experts, device="cuda", dtype=torch.bfloat16)
        torch.mm(halves, torch.cat([router.weight, router.weight]))
        torch.mm(halves.t(), x, out_dtype=torch.float32)
        return logits

    runs = {}
    for name in ("cuda", "torch"):
        with router_path(name):
            runs[name] = graphed(step)
    runs["gate"] = graphed(gate)
    return runs


def router_rows(names, rounds: int, flush: L2Flush) -> list[dict]:
    rows = []
    for name in names:
        shape = SHAPES[name]
        runs = router_runs(shape)
        times = {backend: [] for backend in runs}
        for r in range(rounds):
            for backend, run in (runs.items() if r % 2 == 0 else reversed(runs.items())):
                times[backend] += [run_ms(run, flush) for _ in range(5)]
        for backend, ts in times.items():
            ms = statistics.median(ts)
            # bytes every backend moves at least: x [T, H] read twice (forward, dW) and dx written
            rows.append({"bench": "router", "op": "router_fwd_bwd", "shape": name, "splits": "router",
                         "backend": backend, "ms": round(ms, 5),
                         "gbps": round(3 * shape.tokens * shape.hidden * 2 / ms / 1e6, 1)})
        print(f"{name} router: " + "  ".join(f"{r['backend']} {r['ms']:.4f}" for r in rows[-len(runs):]), flush=True)
        del runs
        moe_layer.free_memory()
    return rows


def on_router_path(name: str):
    """A wrapper that runs a step (its eager run or its capture) with router ``name``."""
    def runner(fn):
        def run():
            with router_path(name):
                return fn()
        return run
    return runner


def main() -> None:
    args = prologue(cli(__doc__, SHAPES, rounds=True))
    names = args.shapes
    flush = L2Flush()
    rows = router_rows(names, args.rounds, flush)
    if not args.no_layer:
        rows += layer_step_rows(names, args.rounds, flush, {p: on_router_path(p) for p in ("cuda", "torch")}, "router")
    print_table([r for r in rows if r["op"] == "router_fwd_bwd"], "gbps")
    print_table([r for r in rows if r["op"] == "layer_fwd_bwd"], "tflops")
    by_case = {(r["op"], r["shape"], r["backend"]): r["ms"] for r in rows}
    for (op, name, backend), ms in by_case.items():
        if backend.startswith("cuda"):
            torch_ms = by_case[(op, name, backend.replace("cuda", "torch"))]
            print(f"{op} {name} {backend}: kernels {ms:.4f} ms, torch composition {torch_ms:.4f} ms, "
                  f"{torch_ms / ms:.3f}x")
    print(f"wrote {write_results('router', rows)}")


if __name__ == "__main__":
    main()
