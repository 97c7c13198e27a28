"""MoE layer step time (forward + backward), eager and as one replayed CUDA graph; permutation bandwidth.

op ``fwd_bwd``: one training step of ``moe_grouped.MoELayer`` (router,
permute, grouped SwiGLU experts, unpermute, router aux loss), bf16, on new
``torch.randn`` inputs every step, so the routing (tokens per expert) changes
from step to step:
  cuda            MoELayer(backend="cuda"), eager
  cuda_graphed    the same layer's forward + backward captured once with
                  ``moe_grouped.graphs.capture_step`` and replayed; each step
                  copies its new input and output gradient into the graph
  torch           MoELayer(backend="torch") (torch._grouped_mm), eager
  torch_graphed   the same, captured and replayed
  loop            the same router and torch permutation, then a Python loop
                  of per-expert bf16 matmuls over splits read on the host
                  (one weight tensor per expert: Megatron's SequentialMLP), eager
Each step sets the gradients to None first (backward allocates them: no
accumulation pass). ``ms``: median of CUDA-event-timed steps, each from an
idle GPU after an L2 flush; ``wall_ms``: steps issued back to back, total time
/ steps. ``tflops``: the expert GEMMs only, 18 * T * top_k * hidden * ffn
per step (fc1 with 2 * ffn outputs and fc2, forward, dgrad and wgrad).

Shapes (no shared experts; token counts fit one 80 GB GPU with bf16 weights,
gradients and activations and keep the script under ~2 minutes):
  mixtral      hidden 4096, ffn 14336,   8 experts, top-2, 16384 tokens (softmax router)
  dsv2_lite    hidden 2048, ffn 1408,   64 experts, top-6,  8192 tokens (softmax router):
               DeepSeek-V2-Lite's MoE, one micro-batch of 2 x 4096 tokens; also at
               4096 tokens (one sequence), where the host's launch cost matters more
  dsv3         hidden 7168, ffn 2048,  128 experts, top-8,  8192 tokens (sigmoid router,
               8 groups / 4 chosen, selection bias): DeepSeek-V3's MoE; about 25 GB
               of bf16 weights and gradients

Experts-path shapes (issue 19; ``--shapes experts_path`` runs only these,
with a top-k-then-softmax router, no aux loss, and writes
results/moe_layer_experts_path-<gpu>.json): each row's ``shape`` is the name,
T, H, ffn, E, top-k:
  qwen3_30b_16k   16384, 2048,   768, 128, 8    olmoe_16k      16384, 2048, 1024, 64, 8
  h4096_e128_32k  32768, 4096,  1024, 128, 8    dsv2_lite_16k  16384, 2048, 1408, 64, 6
  mixtral_8k       8192, 4096, 14336,   8, 2
backends cuda_fused / cuda_unfused (MoELayer(backend="cuda",
experts_path="fused" / "unfused"), eager) and their ``_graphed`` replays,
torch (unfused) and torch_graphed, and (issue 45; ``--no-fp8`` leaves them
out) cuda_fp8_fused / cuda_fp8_unfused: the same cuda layers inside
``fp8_autocast`` (1x128 / 128x128 block scaling; weights quantized in each
step's forward, ``is_first_microbatch=True``, into FP8 buffers the layer
keeps: 1 byte per weight for the copy and 1 for its transpose, outside
``peak_mib`` like the parameters), eager and graphed; cuda_fp8_fused_kept:
the fused layer with the FP8 weights quantized once and reused, as in the
micro-batches after the first of an optimizer step. On every shape ``cuda`` without a suffix
is the layer's default experts path (fused on Hopper with the core's
weighted SwiGLU backward). Each fwd_bwd row has ``peak_mib``: eager rows,
torch.cuda.max_memory_allocated minus the allocated bytes at the start of one
step (after reset_peak_memory_stats). Parameters and inputs are excluded. The
previous step's weight gradients are still allocated at the start and the
step replaces them, so weight gradients are not in the figure either (as
when they accumulate into kept buffers); the input gradient, the kept
activations and the backward's buffers are. Every backend starts that step
with no input gradient allocated. Graphed rows: the same over the warm-up
steps and the capture, which start with no gradients, so these include the
weight gradients (what the graph's pool must hold).

op ``permute``: ``moe_grouped.permute`` + ``unpermute`` (routing weights),
forward and backward, bf16, random distinct top-k experts per token, for the
cuda and torch permutation backends, captured in a CUDA graph and replayed
(GPU time, as in a captured MoE step; the host's launch cost is left out). ``gbps``: effective bandwidth, counting
once each tensor a pass must read or write, T tokens, n = T * top_k copies,
H hidden: permute (read T*H, write n*H), unpermute (read n*H, write T*H), its
backward (read T*H and n*H, write n*H), permute's backward (read n*H, write
T*H): (4 T + 5 n) * H * 2 bytes. The index pass and the [T, top_k] weights are
not counted.

op ``swiglu``: ``moe_grouped.swiglu`` forward + backward on the experts' fc1
output [T * top_k, 2 * ffn] bf16, replayed from a graph, for the cuda (fused
kernels) and torch (composed ops) backends. ``gbps``: (read h, write y, read
dy and h, write dh) = 8 * T * top_k * ffn * 2 bytes.

    python benchmarks/moe_layer.py     # table + results/moe_layer-<gpu>.json
    python benchmarks/moe_layer.py --shapes experts_path   # the five issue-19 shapes only
    python benchmarks/moe_layer.py --shapes qwen3_30b_16k,mixtral_8k   # any shape names
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import moe_grouped  # noqa: E402
import common  # noqa: E402
from common import (  # noqa: E402
    L2Flush, cli, free_memory, graphed, median_rows, print_medians, prologue, run_ms, step_inputs, step_row, time_ms,
    write_results,
)
from moe_grouped import MoELayer, graphs, permute, unpermute  # noqa: E402
from moe_grouped.permute import cuda_unavailable_reason as permute_cuda_unavailable_reason  # noqa: E402
from moe_grouped.activation import cuda_unavailable_reason as swiglu_cuda_unavailable_reason  # noqa: E402
from moe_grouped.activation import swiglu, weighted_backward_unavailable_reason  # noqa: E402
from moe_grouped.moe_layer import _AttachAuxLoss  # noqa: E402


@dataclass
class Shape(common.Shape):
    router: dict = field(default_factory=dict)
    aux_loss_coeff: float = 1e-2
    repeats: int = 20
    named: bool = False  # rows carry the bare name (the experts-path shapes)
    tflops_bar: float = 0.0  # issue 19's bar for the best of eager and graphed, if any
    memory_bar: bool = False  # issue 19's fused peak <= 0.8x unfused applies

    @property
    def label(self) -> str:
        return self.name if self.named else super().label


SHAPES = [
    Shape("mixtral", 4096, 14336, 8, 2, 16384, dict(score_function="softmax", normalize_topk=True), repeats=20),
    Shape("dsv2_lite", 2048, 1408, 64, 6, 8192, dict(score_function="softmax", normalize_topk=False), repeats=50),
    Shape("dsv2_lite", 2048, 1408, 64, 6, 4096, dict(score_function="softmax", normalize_topk=False), repeats=50),
    Shape("dsv3", 7168, 2048, 128, 8, 8192,
          dict(score_function="sigmoid", normalize_topk=True, scaling_factor=2.5, expert_bias=True,
               n_group=8, topk_group=4), aux_loss_coeff=0.0, repeats=20),
]
TOPK_THEN_SOFTMAX = dict(score_function="softmax", topk_before_softmax=True)
# Issue 19's shapes (SonicMoE comparison): T, H, ffn, E, top-k; top-k-then-softmax routing.
EXPERTS_PATH_SHAPES = [
    Shape(name, hidden, ffn, experts, top_k, tokens, TOPK_THEN_SOFTMAX, aux_loss_coeff=0.0, repeats=repeats,
          named=True, tflops_bar=bar, memory_bar=fine_grained)
    for name, tokens, hidden, ffn, experts, top_k, repeats, bar, fine_grained in (
        ("qwen3_30b_16k", 16384, 2048, 768, 128, 8, 10, 530, True),
        ("olmoe_16k", 16384, 2048, 1024, 64, 8, 10, 580, True),
        ("h4096_e128_32k", 32768, 4096, 1024, 128, 8, 5, 620, True),
        ("dsv2_lite_16k", 16384, 2048, 1408, 64, 6, 10, 580, True),
        ("mixtral_8k", 8192, 4096, 14336, 8, 2, 5, 620, False),
    )
]
EXPERTS_PATH_BACKENDS = ["cuda_fused", "cuda_unfused", "torch"]
# FP8 block scaling (fp8_autocast, the default recipe) on the same shapes: issue 45's rows.
# ``_kept``: the FP8 weights quantized once and reused (is_first_microbatch=False), as in the
# micro-batches after an optimizer step's first: the step without the weights' quantization.
FP8_BACKENDS = ["cuda_fp8_fused", "cuda_fp8_unfused", "cuda_fp8_fused_kept"]
DEEPSEEK_LIKE = ("dsv2_lite", "dsv3")
LOOP_LIMIT_S = 2.0  # skip the loop backend for a shape whose first step takes longer
DTYPE = torch.bfloat16


def make_layer(shape: Shape, backend: str, single_grouped_weight: bool = True) -> MoELayer:
    """``backend`` is a row's backend name: ``cuda_fused`` / ``cuda_unfused`` pick the experts path
    (``cuda_fp8_fused``: the same layer, run under fp8_autocast by :func:`forward_of`)."""
    torch.manual_seed(0)
    name, _, path = backend.replace("_fp8", "").replace("_kept", "").partition("_")
    return MoELayer(
        shape.hidden, shape.ffn, shape.experts, shape.top_k, router_options=shape.router,
        aux_loss_coeff=shape.aux_loss_coeff, single_grouped_weight=single_grouped_weight, dtype=DTYPE,
        device="cuda", backend=name, experts_path=path or None,
    )


def forward_of(layer: MoELayer, backend: str):
    """The layer's forward for a row's backend: inside fp8_autocast for the ``_fp8`` rows."""
    if "_fp8" not in backend:
        return layer
    recipe = moe_grouped.fp8.Float8BlockScaling()
    kept = [False]

    def forward(x):
        # True each step: the weights are quantized in every step (an optimizer step came
        # between), into buffers the layer keeps, as a training loop with FP8 weight caching does.
        # "_kept": True once, then False.
        first = not (backend.endswith("_kept") and kept[0])
        kept[0] = True
        with moe_grouped.fp8.fp8_autocast(recipe):
            return layer(x, is_first_microbatch=first)

    return forward


def make_inputs(shape: Shape) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return step_inputs((shape.tokens, shape.hidden), x_requires_grad=True)


def loop_forward(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """The layer's forward with a per-expert loop of bf16 matmuls (host splits) for the experts."""
    routing = layer.router(x)
    permuted, m_splits, row_id_map = permute(x, routing.experts, layer.num_experts, backend="torch")
    fc1, fc2 = layer.experts.fc1, layer.experts.fc2
    outs = [
        F.linear(swiglu(F.linear(rows, getattr(fc1, f"weight{e}")), backend="torch"), getattr(fc2, f"weight{e}"))
        for e, rows in enumerate(permuted.split(m_splits.tolist()))  # .tolist(): a host sync
    ]
    out = unpermute(torch.cat(outs), row_id_map, routing.weights, backend="torch")
    if layer.aux_loss_coeff:
        out = _AttachAuxLoss.apply(out, layer.aux_loss_coeff * routing.aux_loss)
    return out


class Steps(common.Steps):
    """Training steps of one layer over the cycled inputs."""

    def __init__(self, layer: MoELayer, inputs, forward=None):
        super().__init__(layer, inputs)
        self.layer = layer
        self.forward = forward or layer

    def fwd_bwd(self, x, dout) -> torch.Tensor:
        self.clear_grads()
        x.grad = None
        out = self.forward(x)
        out.backward(dout)
        return out.detach()  # capture_step's outputs are tensors

    def clear_input_grads(self) -> None:
        """Drop every cycled input's gradient, so a measured step starts as every backend's does.

        The inputs are shared by the backends of a shape, and a step frees its
        own x.grad when it starts: without this, a backend measured after
        another would start with that x.grad allocated and free it inside the
        measured step, reading one [T, H] input gradient lower.
        """
        for x, _ in self.inputs:
            x.grad = None

    def capture(self):
        self.clear_grads()  # drop the eager steps' gradients and cached blocks before capturing
        free_memory()
        x, dout = self.inputs[0]
        x, dout = x.detach().clone().requires_grad_(True), dout.clone()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        static = graphs.capture_step(self.fwd_bwd, x, dout)
        torch.cuda.synchronize()
        self.capture_peak_mib = (torch.cuda.max_memory_allocated() - start) / (1 << 20)
        return static, self.replay_of(static)


def peak_mib(step) -> float:
    """MiB allocated at the peak of one ``step`` beyond what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - start) / (1 << 20)


def bench_layer(shape: Shape, backends: list[str], flush: L2Flush, loop: bool = True) -> list[dict]:
    rows = []
    inputs = make_inputs(shape)

    def record(backend, step, peak=None):
        if peak is None:
            rows.append(step_row("moe_layer", shape, backend, step, flush, shape.repeats))
        else:
            rows.append(step_row("moe_layer", shape, backend, step, flush, shape.repeats,
                                 f"  peak {peak:9.1f} MiB", peak_mib=round(peak, 1)))

    for backend in backends:
        bench_grouped(shape, backend, inputs, record)
        free_memory()
    if loop:
        bench_loop(shape, inputs, record)
        free_memory()
    return rows


def bench_grouped(shape: Shape, backend: str, inputs, record) -> None:
    """``backend`` eagerly, then the same layer captured and replayed."""
    layer = make_layer(shape, backend)
    steps = Steps(layer, inputs, forward_of(layer, backend))
    steps.eager()  # first-call setup (workspaces, gradients' first allocation) outside the measured step
    steps.clear_input_grads()
    record(backend, steps.eager, peak_mib(steps.eager))
    _, replay = steps.capture()
    record(f"{backend}_graphed", replay, steps.capture_peak_mib)


def bench_loop(shape: Shape, inputs, record) -> None:
    layer = make_layer(shape, "torch", single_grouped_weight=False)
    steps = Steps(layer, inputs, forward=lambda x: loop_forward(layer, x))
    first = steps.first_eager_s()
    if first > LOOP_LIMIT_S:
        print(f"  loop           skipped: its first step took {first:.1f} s (> {LOOP_LIMIT_S} s)", flush=True)
        return
    record("loop", steps.eager)


def bench_permute(shape: Shape, backends: list[str], flush: L2Flush) -> list[dict]:
    rows = []
    tokens, hidden, top_k, num_experts = shape.tokens, shape.hidden, shape.top_k, shape.experts
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE, generator=gen).requires_grad_(True)
    dout = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE, generator=gen)
    scores = torch.rand(tokens, num_experts, device="cuda", generator=gen)
    experts = scores.topk(top_k, dim=-1).indices
    weights = torch.softmax(scores.gather(1, experts), dim=-1).requires_grad_(True)
    copies = tokens * top_k
    nbytes = (4 * tokens + 5 * copies) * hidden * x.element_size()
    for backend in backends:
        def step():
            x.grad = weights.grad = None
            permuted, _, row_id_map = permute(x, experts, num_experts, backend=backend)
            unpermute(permuted, row_id_map, weights, backend=backend).backward(dout)

        ms = time_ms(graphed(step), warmup=5, repeats=50, flush=flush)
        rows.append({"bench": "moe_layer", "op": "permute", "shape": f"T{tokens}_H{hidden}_k{top_k}_E{num_experts}",
                     "splits": "random_topk", "backend": backend, "ms": round(ms, 4),
                     "gbps": round(nbytes / ms / 1e6, 1)})
        print(f"  permute {backend:<6} {ms:9.4f} ms  {rows[-1]['gbps']:8.1f} GB/s", flush=True)
    return rows


def bench_swiglu(shape: Shape, backends: list[str], flush: L2Flush) -> list[dict]:
    """SwiGLU forward + backward on the experts' fc1 output [T * top_k, 2 * ffn], replayed from a graph."""
    rows = []
    copies = shape.tokens * shape.top_k
    gen = torch.Generator(device="cuda").manual_seed(3)
    h = torch.randn(copies, 2 * shape.ffn, device="cuda", dtype=DTYPE, generator=gen).requires_grad_(True)
    dy = torch.randn(copies, shape.ffn, device="cuda", dtype=DTYPE, generator=gen)
    # forward: read h, write y; backward: read dy and h, write dh.
    nbytes = copies * shape.ffn * (2 + 1 + 1 + 2 + 2) * h.element_size()
    for backend in backends:
        def step():
            h.grad = None
            swiglu(h, backend=backend).backward(dy)

        ms = time_ms(graphed(step), warmup=5, repeats=50, flush=flush)
        rows.append({"bench": "moe_layer", "op": "swiglu", "shape": f"M{copies}_F{shape.ffn}",
                     "splits": "-", "backend": backend, "ms": round(ms, 4), "gbps": round(nbytes / ms / 1e6, 1)})
        print(f"  swiglu  {backend:<6} {ms:9.4f} ms  {rows[-1]['gbps']:8.1f} GB/s", flush=True)
    return rows


def summarize(rows: list[dict]) -> None:
    """The table and the ratios the project's bars are about."""
    print(f"\n{'op':<8} {'shape':<40} {'backend':<20} {'ms':>9} {'wall_ms':>9} {'TFLOP/s|GB/s':>13}")
    for r in rows:
        metric = r.get("tflops", r.get("gbps"))
        print(f"{r['op']:<8} {r['shape']:<40} {r['backend']:<20} {r['ms']:>9.3f} "
              f"{r.get('wall_ms', float('nan')):>9.3f} {metric:>13.1f}")
    ms = {(r["op"], r["shape"], r["backend"]): r for r in rows}
    print("\nratios (speed-up = slower ms / faster ms; bars in brackets)")
    for shape in SHAPES:
        key = lambda backend: ("fwd_bwd", shape.label, backend)  # noqa: E731
        name = f"{shape.name} T{shape.tokens}"
        for backend in ("cuda", "torch"):
            if key(backend) in ms and key(f"{backend}_graphed") in ms:
                eager, graphed = ms[key(backend)], ms[key(f"{backend}_graphed")]
                bar = " [>= 1.2x]" if shape.name in DEEPSEEK_LIKE else ""
                print(f"  {name:<16} {backend}_graphed vs {backend}: {eager['ms'] / graphed['ms']:5.2f}x "
                      f"(back to back {eager['wall_ms'] / graphed['wall_ms']:5.2f}x){bar}")
        if key("cuda_graphed") in ms and key("torch_graphed") in ms:
            print(f"  {name:<16} cuda_graphed vs torch_graphed: "
                  f"{ms[key('torch_graphed')]['ms'] / ms[key('cuda_graphed')]['ms']:5.2f}x [>= 1.15x]")
        if key("cuda") in ms and key("loop") in ms:
            print(f"  {name:<16} cuda vs loop: {ms[key('loop')]['ms'] / ms[key('cuda')]['ms']:5.2f}x")
    for r in rows:
        if r["op"] == "permute":
            bar = " [>= 2000 GB/s]" if r["backend"] == "cuda" else ""
            print(f"  permute+unpermute fwd+bwd {r['shape']:<26} {r['backend']:<6} {r['gbps']:8.1f} GB/s{bar}")
        elif r["op"] == "swiglu":
            print(f"  swiglu fwd+bwd            {r['shape']:<26} {r['backend']:<6} {r['gbps']:8.1f} GB/s")


def summarize_experts_path(rows: list[dict], shapes: list[Shape]) -> None:
    """Fused vs unfused per shape: time, TFLOP/s against issue 19's bars, peak memory."""
    by_key = {(r["shape"], r["backend"]): r for r in rows if r["op"] == "fwd_bwd"}
    print("\nexperts path: fused vs unfused (best of eager and graphed; bars in brackets)")
    for shape in shapes:
        got = {b: by_key.get((shape.label, b)) for b in
               ("cuda_fused", "cuda_fused_graphed", "cuda_unfused", "cuda_unfused_graphed")}
        if any(r is None for r in got.values()):
            continue
        fused = min(got["cuda_fused"]["ms"], got["cuda_fused_graphed"]["ms"])
        unfused = min(got["cuda_unfused"]["ms"], got["cuda_unfused_graphed"]["ms"])
        tflops = shape.flops() / fused / 1e9
        memory = got["cuda_fused"]["peak_mib"] / got["cuda_unfused"]["peak_mib"]
        memory_bar = " [<= 0.80x]" if shape.memory_bar else ""
        print(f"  {shape.label:<16} fused {fused:8.3f} ms {tflops:6.1f} TFLOP/s [>= {shape.tflops_bar:.0f}]  "
              f"unfused {unfused:8.3f} ms: {unfused / fused:5.2f}x  peak fused/unfused {memory:5.2f}x{memory_bar}")
        fp8 = {b: by_key.get((shape.label, b)) for b in ("cuda_fp8_fused", "cuda_fp8_fused_graphed")}
        if all(r is not None for r in fp8.values()):
            best = min(r["ms"] for r in fp8.values())
            bar = 1.3 if shape.memory_bar else 1.5  # issue 45: fine-grained shapes, Mixtral-like
            print(f"  {'':<16} fp8 fused {best:8.3f} ms {shape.flops() / best / 1e9:6.1f} TFLOP/s: "
                  f"{fused / best:5.2f}x bf16 fused [>= {bar}x]  peak fp8/bf16 "
                  f"{fp8['cuda_fp8_fused']['peak_mib'] / got['cuda_fused']['peak_mib']:5.2f}x [<= 1.00x]")
        kept = [by_key.get((shape.label, b)) for b in ("cuda_fp8_fused_kept", "cuda_fp8_fused_kept_graphed")]
        if all(r is not None for r in kept):
            best_kept = min(r["ms"] for r in kept)
            print(f"  {'':<16} fp8 fused, weights kept {best_kept:8.3f} ms: {fused / best_kept:5.2f}x bf16 fused")


def select_shapes(spec: str) -> tuple[list[Shape], str]:
    """``--shapes``: "all", "experts_path" or comma-separated names; and the results file's bench name."""
    if spec == "all":
        return SHAPES + EXPERTS_PATH_SHAPES, "moe_layer"
    if spec == "experts_path":
        return EXPERTS_PATH_SHAPES, "moe_layer_experts_path"
    names = [n for n in spec.split(",") if n]
    known = {s.name for s in SHAPES + EXPERTS_PATH_SHAPES}
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(f"--shapes: unknown shape names {unknown}; known: all, experts_path, {sorted(known)}")
    return [s for s in SHAPES + EXPERTS_PATH_SHAPES if s.name in names], "moe_layer_subset"


def layer_step_rows(names: list[str], rounds: int, flush: L2Flush, runners: dict, bench: str) -> list[dict]:
    """Rows of op ``layer_fwd_bwd``: a fused MoELayer step of each named issue-19 shape, eager and graphed,
    under each of ``runners`` (label -> a wrapper of the step's eager run and capture, which sets what the
    variant changes), in interleaved rounds."""
    rows = []
    for shape in [s for s in EXPERTS_PATH_SHAPES if s.name in names]:
        inputs = make_inputs(shape)
        layer = make_layer(shape, "cuda_fused")  # the runner picks the kernels at each call
        runs = tuple(runners.items())
        times = {f"{label}{mode}": [] for label, _ in runs for mode in ("", "_graphed")}
        for r in range(rounds):
            # One variant's graph alive at a time, captured afresh each round:
            # with every variant's graph held at once, replays slowed unevenly,
            # whatever their kernels (Mixtral-like on the H100: the core's
            # choice 7% behind the same kernels under another name; in another
            # capture order one variant 21% behind). Five graphs of one layer
            # alive replay 2-7% slower than one alone.
            for label, runner in (runs if r % 2 == 0 else runs[::-1]):
                steps = Steps(layer, inputs)
                eager = runner(steps.eager)
                eager()
                _, replay = runner(steps.capture)()
                replay()  # a graph's first replay also uploads it
                for mode, run in (("", eager), ("_graphed", replay)):
                    times[label + mode] += [run_ms(run, flush) for _ in range(2)]
                del steps, eager, replay
                free_memory()
        rows += median_rows(times, shape.flops(), bench, "layer_fwd_bwd", shape.name, "router")
        print_medians(f"{shape.name} layer", rows[-len(times):])
        del layer
        free_memory()
    return rows


def main() -> None:
    parser = cli(__doc__)
    parser.add_argument("--shapes", default="all",
                        help='"all" (default), "experts_path" (issue 19\'s five shapes) or comma-separated names')
    parser.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=True,
                        help="also the FP8 rows (cuda_fp8_fused, cuda_fp8_unfused) on the experts-path shapes")
    args = prologue(parser)
    shapes, bench_name = select_shapes(args.shapes)
    start = time.perf_counter()
    backends = ["cuda", "torch"]
    reason = moe_grouped.backends.cuda_unavailable_reason(torch.device("cuda"))
    if reason is not None:
        print(f"skipping the cuda backend: {reason}")
        backends.remove("cuda")
    fused_reason = reason or weighted_backward_unavailable_reason(torch.device("cuda"))
    experts_path_backends = [b for b in EXPERTS_PATH_BACKENDS if b == "torch" or reason is None]
    if fused_reason is not None and reason is None:
        print(f"skipping cuda_fused: {fused_reason}")
        experts_path_backends.remove("cuda_fused")
    if fused_reason is None and moe_grouped._core.has(moe_grouped._core.CAP_GROUPED_GEMM_FP8_BLOCKWISE):
        experts_path_backends += [b for b in FP8_BACKENDS if args.fp8]
    permute_backends = [b for b in ("cuda", "torch")
                        if b != "cuda" or permute_cuda_unavailable_reason(torch.device("cuda")) is None]
    swiglu_backends = [b for b in ("cuda", "torch")
                       if b != "cuda" or swiglu_cuda_unavailable_reason(torch.device("cuda")) is None]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; fwd_bwd backends {backends} "
          f"(+ _graphed, loop), permute backends {permute_backends}", flush=True)
    flush = L2Flush()
    rows = []
    for shape in shapes:
        print(f"{shape.label}: {shape.flops() / 1e12:.1f} TFLOP of expert GEMMs per step", flush=True)
        if shape in EXPERTS_PATH_SHAPES:
            rows += bench_layer(shape, experts_path_backends, flush, loop=False)
            free_memory()
            continue
        rows += bench_layer(shape, backends, flush)
        rows += bench_permute(shape, permute_backends, flush)
        rows += bench_swiglu(shape, swiglu_backends, flush)
        free_memory()
    summarize(rows)
    summarize_experts_path(rows, shapes)
    path = write_results(bench_name, rows)
    print(f"wrote {path} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
