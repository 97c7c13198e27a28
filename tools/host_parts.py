"""Usage: python tools/host_parts.py [--calls N] [--trace FILE] [--router ROUNDS] [--thread-ops ROUNDS] [--steps ROUNDS] [--nodes ROUNDS] [--profile-forward] [--profile-step]   (on the GPU machine; MOE_GROUPED_CORE_LIB for a carried core)

Host and wall microseconds of the parts of one eager MoELayer step (T=256, H=1024, F=512, E=64, k=8, bf16,
cuda, fused, one grouped weight), each issued ``--calls`` times back to back from an idle GPU
(median of 5 rounds; wall above host: the GPU set the pace), beside the floors this host sets: a trivial ctypes call into the core, an
empty tensor, a one-kernel torch op, an autograd Function that does nothing, forward and backward.
The parts do not add up exactly to the step (they run out of context), but they show where
the step's host time is. ``--trace FILE``: also a Chrome trace (torch.profiler, CPU with the Python
functions' stacks) of three steps.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from host_probe import per_call_us  # tools/ is on the path when this runs as a script

import moe_grouped
from moe_grouped import _core, routed_experts
from moe_grouped.experts import FusedExpertsFunction, STAGES
from moe_grouped.routing import SOFTMAX_CHOSEN
from moe_grouped.permute import permute_index, source_rows
from moe_grouped._ops import DirectCalls, ops
from moe_grouped import experts_sequence
from moe_grouped.routing.torch_backend import gate_grads_from_halves

T, H, F, E, K = 256, 1024, 512, 64, 8


def host_and_wall_us(fn, calls: int) -> tuple[float, float]:
    """Median (host, wall) microseconds per call of ``calls`` calls issued back to back (5 rounds): wall
    above host means the GPU, not the host, set the pace."""
    rounds = [per_call_us(fn, calls) for _ in range(5)]
    return statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds)


class _Nothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *weights):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad,) + (None,) * 3


class _Runs(torch.autograd.Function):
    """Identity whose backward also runs ``work()``: the cost of that work on autograd's device thread."""

    @staticmethod
    def forward(ctx, x, work):
        ctx.work = work
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.work()
        return grad, None


class _RouterLike(torch.autograd.Function):
    """x -> routing weights [T, k]: a stand-in node that computes nothing."""

    @staticmethod
    def forward(ctx, x, gate):
        return x.new_empty(x.shape[0], K, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        return grad.new_zeros(T, H, dtype=torch.bfloat16), None


class _ExpertsLike(torch.autograd.Function):
    """(x, weights) -> out: a stand-in node whose gradients are new tensors, as the experts' are."""

    @staticmethod
    def forward(ctx, x, weights):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.clone(), grad.new_empty(T, K, dtype=torch.float32)


class _MergedLike(torch.autograd.Function):
    """x -> out: the two stand-ins as one node (its x gradient summed inside)."""

    @staticmethod
    def forward(ctx, x, gate):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        dx = grad.clone()
        dx.add_(grad.new_zeros(T, H))
        return dx, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--trace", help="write a Chrome trace of three steps here")
    parser.add_argument("--router", type=int, default=0, metavar="ROUNDS",
                        help="only the router's backward variants, in ROUNDS alternating rounds")
    parser.add_argument("--steps", type=int, default=0, metavar="ROUNDS",
                        help="only the step, with its backward on autograd's thread and on this one, in ROUNDS "
                             "alternating rounds")
    parser.add_argument("--thread-ops", type=int, default=0, metavar="ROUNDS",
                        help="only single ops ten times, here and in a backward, in ROUNDS alternating rounds")
    parser.add_argument("--nodes", type=int, default=0, metavar="ROUNDS",
                        help="only a router-like and an experts-like node against one merged node (no work), "
                             "in ROUNDS alternating rounds")
    parser.add_argument("--profile-forward", action="store_true",
                        help="only cProfile's top functions (own time) over 500 forwards with grad")
    parser.add_argument("--profile-step", action="store_true",
                        help="only cProfile's top functions (own time) over 300 steps, bf16 then in FP8 autocast, "
                             "the backward on this thread (set_multithreading_enabled(False)) so that it is seen")
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

    # The router's backward pieces, on what its forward saves.
    logits = torch.mm(x.detach(), layer.router.weight.detach().t(), out_dtype=torch.float32)
    chosen, counts, route_weights, lse, _ = ops.route_softmax(logits, K, SOFTMAX_CHOSEN, 1.0)
    ones = torch.ones_like(route_weights)

    def route_backward():
        return ops.route_softmax_backward(logits, lse, chosen, counts, K, SOFTMAX_CHOSEN, 1.0, ones, None,
                                          None)

    halves = route_backward()

    lib = _core.require()
    gate = layer.router.weight.detach()
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

    def in_backward(work):
        def fwd_bwd():
            x.grad = None
            _Runs.apply(x, work).backward(dout)
        return fwd_bwd

    def route_and_gate_grads():
        gate_grads_from_halves(route_backward(), xd, gate, True, True)

    def ten_launches():
        for _ in range(10):
            small.add_(1)

    from moe_grouped.routing import library as routing_library

    def patched(name, replacement, fn):
        def run():
            original = getattr(routing_library, name)
            setattr(routing_library, name, replacement)
            try:
                fn()
            finally:
                setattr(routing_library, name, original)
        return run

    no_gate_grads = patched("gate_grads_from_halves", lambda *args: (None, None), router_fwd_bwd)
    kept_grads = gate_grads_from_halves(halves, xd, gate, True, True)

    def computed_not_returned(*args):
        gate_grads_from_halves(*args)
        return None, None

    def computed_detached(detach_x: bool, detach_weight: bool):
        def replacement(halves, x, weight, need_x, need_weight):
            gate_grads_from_halves(halves, x.detach() if detach_x else x, weight.detach() if detach_weight else weight,
                                   need_x, need_weight)
            return None, None
        return patched("gate_grads_from_halves", replacement, router_fwd_bwd)

    # The router's backward with its gate gradients computed or not, returned or not: which costs.
    router_variants = {
        "router fwd+bwd": router_fwd_bwd,
        "  gate grads neither computed nor returned": no_gate_grads,
        "  gate grads computed, not returned": patched("gate_grads_from_halves", computed_not_returned,
                                                       router_fwd_bwd),
        "  gate grads returned, not computed (kept ones, cloned)": patched("gate_grads_from_halves",
                                                                   lambda *args: kept_grads, router_fwd_bwd),
        "  computed on detached x and weight, returned": patched(
            "gate_grads_from_halves", lambda halves, x, weight, need_x, need_weight: gate_grads_from_halves(
                halves, x.detach(), weight.detach(), need_x, need_weight), router_fwd_bwd),
        "  computed on detached x and weight, not returned": computed_detached(True, True),
        "  computed on detached x, not returned": computed_detached(True, False),
        "  computed on detached weight, not returned": computed_detached(False, True),
    }
    def fresh_x_grad(fn):  # x's gradient set, not accumulated, as in a step
        def run():
            gate_x.grad = None
            fn()
        return run

    router_variants = {name: fresh_x_grad(fn) for name, fn in router_variants.items()}
    halves_out = torch.empty_like(halves)
    route_args = (logits.data_ptr(), lse.data_ptr(), chosen.data_ptr(), counts.data_ptr(), T, E, K, SOFTMAX_CHOSEN,
                  1.0, ones.data_ptr(), None, None, _core.dtype_code(torch.bfloat16), halves_out.data_ptr())

    def raw_route_backward():  # the kernel launch through the core alone: no allocation, no Python wrapper
        _core.check(lib.mg_route_softmax_backward(*route_args, _core.stream_handle(x.device)))

    seq_g = torch.randn(rows, 2 * F, device="cuda", dtype=torch.bfloat16)
    w1, w2 = experts.fc1.weights(), experts.fc2.weights()

    def sequence_backward():  # g becomes dg in place each call: the values do not matter here
        with torch.no_grad(), DirectCalls([xd, probs, seq_g]):
            experts_sequence.backward(plan, (True, True, True, True), dout, xd, probs.detach(), row_id_map, m_splits,
                                      seq_g, w1, w2)

    # Ten of one op on this thread, and inside a Function's backward (autograd's device thread).
    ten = {
        "mm, bf16 out": gate_mms[1],
        "mm, fp32 out": gate_mms[2],
        "cat": lambda: torch.cat([gate, gate]),
        "empty": lambda: torch.empty(T, H, device="cuda", dtype=torch.bfloat16),
        "add_ (1 launch)": lambda: small.add_(1),
        "add, out= (gate dW's sum)": lambda: torch.add(kept_both[:E], kept_both[E:], out=kept_dw),
        "ctypes mg_abi_version": lib.mg_abi_version,
        "ops.route_softmax_backward": route_backward,
        "route bwd + gate grads (1/10 of)": lambda: route_and_gate_grads() if _tick() else None,
        "core launch, raw ctypes (route softmax bwd)": raw_route_backward,
        "experts_sequence.backward (1/10 of)": lambda: sequence_backward() if _tick() else None,
        "gate grads from halves (1/10 of)": (
            lambda: gate_grads_from_halves(halves, xd, gate, True, True) if _tick() else None),
    }
    kept_both = torch.mm(halves.t(), xd, out_dtype=torch.float32)
    kept_dw = torch.empty_like(gate)
    calls = [0]

    def _tick():  # true once in ten calls: the composite parts run once per ten-op round
        calls[0] += 1
        return calls[0] % 10 == 0

    thread_variants = {}
    for name, op in ten.items():
        def ten_of(op=op):
            for _ in range(10):
                op()
        thread_variants[f"10x {name}, here"] = ten_of
        thread_variants[f"10x {name}, in a backward"] = in_backward(ten_of)
    thread_variants["nothing, in a backward"] = in_backward(lambda: None)
    def step_on_this_thread():
        with torch.autograd.set_multithreading_enabled(False):
            step()

    def step_two_ops():
        routed_experts.enabled = False
        try:
            step()
        finally:
            routed_experts.enabled = True

    step_variants = {"step": step, "step, backward on this thread (set_multithreading_enabled(False))":
                     step_on_this_thread, "step, router and experts as two ops (routed_experts off)": step_two_ops}
    if args.profile_step:
        import cProfile
        import pstats

        from moe_grouped import fp8

        for recipe in (None, fp8.Float8BlockScaling()):
            def profiled_step():
                with fp8.fp8_autocast(recipe, enabled=recipe is not None), \
                        torch.autograd.set_multithreading_enabled(False):
                    step()

            for _ in range(20):
                profiled_step()
            torch.cuda.synchronize()
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(300):
                profiled_step()
            profiler.disable()
            torch.cuda.synchronize()
            print(f"==== {'FP8' if recipe else 'bf16'} step, 300 calls")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(40)
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(60)
        return
    if args.profile_forward:
        import cProfile
        import pstats

        for _ in range(20):
            layer(x)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(500):
            layer(x)
        profiler.disable()
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
        return
    node_x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    node_gate = torch.randn(E, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def two_nodes():
        node_x.grad = None
        _ExpertsLike.apply(node_x, _RouterLike.apply(node_x, node_gate)).backward(dout)

    def one_node():
        node_x.grad = None
        _MergedLike.apply(node_x, node_gate).backward(dout)

    node_variants = {"router-like + experts-like nodes, x grad summed by autograd": two_nodes,
                     "one merged node, x grad summed inside": one_node}
    if args.nodes:
        router_variants, args.router = node_variants, args.nodes
    if args.steps:
        router_variants, args.router = step_variants, args.steps
    if args.thread_ops:
        router_variants, args.router = thread_variants, args.thread_ops
    if args.router:
        for fn in router_variants.values():
            fn()
        times = {name: [] for name in router_variants}
        for r in range(args.router):
            names = list(router_variants) if r % 2 == 0 else list(reversed(router_variants))
            for name in names:
                times[name].append(host_and_wall_us(router_variants[name], args.calls)[0])
        for name, values in times.items():
            print(f"{name:<48} host {statistics.median(values):8.1f} us  (median of {args.router} rounds, "
                  f"alternating)", flush=True)
        return

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
        "router bwd: route_softmax_backward": route_backward,
        "router bwd: gate grads from halves": lambda: gate_grads_from_halves(halves, xd, gate, True, True),
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
        "10 launches (small.add_)": ten_launches,
        "Function fwd+bwd, nothing in bwd": in_backward(lambda: None),
        "Function fwd+bwd, 10 launches in bwd": in_backward(ten_launches),
        "Function fwd+bwd, gate mm dx in bwd": in_backward(gate_mms[1]),
        "route bwd + gate grads": route_and_gate_grads,
        "router fwd+bwd, no gate grads": no_gate_grads,
        "router fwd+bwd, x without grad": lambda: (setattr(layer.router.weight, "grad", None),
                                                   layer.router(xd).weights.backward(ones)),
        "router fwd+bwd, ones given": lambda: (setattr(layer.router.weight, "grad", None),
                                               setattr(gate_x, "grad", None),
                                               layer.router(gate_x).weights.backward(ones)),
        "Function fwd+bwd, route bwd + gate grads in bwd": in_backward(route_and_gate_grads),
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
        host, wall = host_and_wall_us(fn, args.calls)
        print(f"{name:<40} host {host:8.1f} us   wall {wall:8.1f} us", flush=True)


if __name__ == "__main__":
    main()
