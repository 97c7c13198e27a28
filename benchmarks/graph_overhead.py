"""CPU-side cost of a GroupedLinear fwd+bwd step: eager vs replayed CUDA graphs.

For each graph-safe backend, shape and split pattern, one step is
``y = layer(x, m_splits); y.backward(dy)`` run eagerly or through
``moe_grouped.graphs.make_graphed_callables`` (which copies x and m_splits
into its static buffers and replays the forward and backward graphs), or as
one whole-step graph (``graphs.capture_step``): ``step_graph`` copies new x,
m_splits and dy into the static buffers and replays, ``step_graph_replay``
only replays (inputs already in place, as a data loader writing into the
static buffers would leave them).

Columns: ``cpu_ms`` is the host time to issue one step onto an idle GPU
(median of 50; the CPU-side cost); ``ms`` the GPU time per step (CUDA
events, median of 30); ``wall_ms`` the time per step of 200 steps issued
back to back (throughput); ``host_syncs`` the synchronising calls torch's
sync debug mode reports for one step. Writes
``benchmarks/results/graph_overhead-<gpu>.json``.
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import moe_grouped  # noqa: E402
from common import cli, prologue, time_ms, write_results  # noqa: E402
from moe_grouped import GroupedLinear, graphs  # noqa: E402

SHAPES = [(8, 1024, 512, 512), (8, 8192, 2048, 2048)]  # (E, M, K, N)
PATTERNS = ("balanced", "skewed")
STEPS = 200


def host_ms(step, steps: int = STEPS) -> tuple[float, float]:
    """(host ms to issue one step onto an idle GPU, median; wall ms per step over ``steps`` back to back).

    Issuing many steps back to back fills the launch queue, after which the
    host waits for the GPU: the first number measures one step from an empty
    queue instead, so it is the CPU-side cost alone.
    """
    for _ in range(5):
        step()
    issue = []
    for _ in range(50):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        issue.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return statistics.median(issue) * 1e3, (time.perf_counter() - start) * 1e3 / steps


def host_syncs(step) -> int:
    """How many synchronising calls one step makes (torch's sync debug mode)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in caught)


def main() -> None:
    prologue(cli(__doc__), warm_up=False)
    backends = ["torch"]
    if moe_grouped.backends.cuda_unavailable_reason(torch.device("cuda")) is None:
        backends.append("cuda")
    rows = []
    for backend in backends:
        for num_experts, tokens, k, n in SHAPES:
            for pattern in PATTERNS:
                torch.manual_seed(0)
                layer = GroupedLinear(num_experts, k, n, single_grouped_weight=True, dtype=torch.bfloat16,
                                      device="cuda", backend=backend)
                x = torch.randn(tokens, k, dtype=torch.bfloat16, device="cuda", requires_grad=True)
                dy = torch.randn(tokens, n, dtype=torch.bfloat16, device="cuda")
                generator = torch.Generator().manual_seed(0)
                m_splits = graphs.splits.make_splits(pattern, num_experts, tokens, generator=generator).cuda()
                graphed = graphs.make_graphed_callables(layer, (x, m_splits))
                params = list(layer.parameters())

                def eager_step():
                    for p in params:
                        p.grad = None
                    layer(x, m_splits).backward(dy)

                def graph_step():
                    for p in params:
                        p.grad = None
                    graphed(x, m_splits).backward(dy)

                # The whole fwd+bwd as one graph (graphs.capture_step): a step
                # is one copy of the new inputs into the static buffers and
                # one graph launch, so its host cost is the replay's.
                static = (x.detach().clone().requires_grad_(True), m_splits.clone(), dy.clone())

                def whole_step(xs, splits_s, dys):
                    for p in params:
                        p.grad = None
                    xs.grad = None
                    layer(xs, splits_s).backward(dys)
                    return [xs.grad, *(p.grad for p in params)]

                step_graph = graphs.capture_step(whole_step, *static)
                fresh = (x.detach().clone(), m_splits.clone(), dy.clone())

                def step_graph_step():
                    step_graph(*fresh)

                modes = (("eager", eager_step), ("graph", graph_step), ("step_graph", step_graph_step),
                         ("step_graph_replay", step_graph.replay))
                for mode, step in modes:
                    syncs = host_syncs(step)
                    cpu_ms, wall_ms = host_ms(step)
                    gpu_ms = time_ms(step, warmup=5, repeats=30)
                    rows.append({
                        "bench": "graph_overhead",
                        "op": "grouped_linear_fwd_bwd",
                        "shape": f"E={num_experts} M={tokens} K={k} N={n}",
                        "splits": pattern,
                        "backend": backend,
                        "mode": mode,
                        "ms": gpu_ms,
                        "cpu_ms": cpu_ms,
                        "wall_ms": wall_ms,
                        "host_syncs": syncs,
                    })
                    print(f"{backend:<6} {rows[-1]['shape']:<28} {pattern:<9} {mode:<6} "
                          f"gpu {gpu_ms:8.4f} ms  host {cpu_ms:8.4f} ms/step  wall {wall_ms:8.4f} ms/step  syncs {syncs}", flush=True)
    path = write_results("graph_overhead", rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
