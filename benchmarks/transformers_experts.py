"""transformers' Qwen3-MoE sparse block, forward + backward, under each experts implementation.

op ``fwd_bwd``: one training step of ``Qwen3MoeSparseMoeBlock`` (transformers'
router, then the experts module) in bf16 on new ``torch.randn`` inputs every
step (the routing changes from step to step), with
``config._experts_implementation``:
  moe_grouped          ours (``moe_grouped.integrations.transformers``,
                       default backend: the CUDA core on Hopper), eager
  moe_grouped_graphed  the same step captured once with
                       ``moe_grouped.graphs.capture_step`` and replayed; each
                       step copies its new input and output gradient in
  grouped_mm           transformers' own (torch grouped_mm), eager
  grouped_mm_graphed   the same, captured and replayed
  eager                transformers' per-expert loop (host syncs); skipped for
                       a shape whose first step takes longer than 2 s
Each step sets the gradients to None first. ``ms``: median of CUDA-event-timed
steps, each from an idle GPU after an L2 flush; ``wall_ms``: steps issued
back to back, total time / steps. ``tflops``: the expert GEMMs only,
18 * T * top_k * hidden * ffn per step. ``rel_err``: the output and the
expert weight gradients against grouped_mm's on one input (largest of the
relative errors).

Shapes (the Qwen3-MoE block class with these sizes; no shared experts):
  qwen3_30b_a3b  hidden 2048, ffn  768, 128 experts, top-8, 8192 tokens
  dsv2_lite      hidden 2048, ffn 1408,  64 experts, top-6, 8192 tokens
  mixtral        hidden 4096, ffn 14336,  8 experts, top-2, 8192 tokens

    python benchmarks/transformers_experts.py   # table + results/transformers_experts-<gpu>.json
"""

from __future__ import annotations

import pathlib
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

try:
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
except ImportError as error:
    raise SystemExit(f'benchmarks/transformers_experts.py needs transformers>=5: pip install "transformers>=5" ({error})')

import common  # noqa: E402
from common import L2Flush, cli, free_memory, prologue, step_inputs, step_row, write_results  # noqa: E402
from moe_grouped import graphs  # noqa: E402
from moe_grouped.integrations import transformers as mg_transformers  # noqa: E402


@dataclass
class Shape(common.Shape):
    repeats: int = 20


SHAPES = [
    Shape("qwen3_30b_a3b", 2048, 768, 128, 8, 8192),
    Shape("dsv2_lite", 2048, 1408, 64, 6, 8192),
    Shape("mixtral", 4096, 14336, 8, 2, 8192),
]
OURS = mg_transformers.register()
EAGER_LIMIT_S = 2.0
DTYPE = torch.bfloat16


def make_block(shape: Shape) -> Qwen3MoeSparseMoeBlock:
    config = transformers.Qwen3MoeConfig(
        hidden_size=shape.hidden, moe_intermediate_size=shape.ffn, num_experts=shape.experts,
        num_experts_per_tok=shape.top_k, norm_topk_prob=True,
    )
    block = Qwen3MoeSparseMoeBlock(config).to(device="cuda", dtype=DTYPE)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():  # the block leaves its parameters uninitialised
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
    return block


def make_inputs(shape: Shape) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return step_inputs((1, shape.tokens, shape.hidden))


class Steps(common.Steps):
    """Training steps of the block under one experts implementation, over the cycled inputs."""

    def __init__(self, block, implementation: str, inputs):
        super().__init__(block, inputs)
        self.block, self.implementation = block, implementation

    def fwd_bwd(self, x, dout) -> torch.Tensor:
        self.block.experts.config._experts_implementation = self.implementation
        self.clear_grads()
        out = self.block(x.detach().requires_grad_(True))
        out.backward(dout)
        return out.detach()  # capture_step's outputs are tensors

    def capture(self):
        self.clear_grads()
        free_memory()
        x, dout = self.inputs[0]
        static = graphs.capture_step(self.fwd_bwd, x.clone(), dout.clone())
        return static, self.replay_of(static)


def rel_errors(block, inputs) -> float:
    """Largest relative error of ours against grouped_mm: the output and the expert weight gradients."""
    x, dout = inputs[0]
    results = {}
    for implementation in (OURS, "grouped_mm"):
        out = Steps(block, implementation, inputs).fwd_bwd(x, dout).float()
        results[implementation] = [out, block.experts.gate_up_proj.grad.float(), block.experts.down_proj.grad.float()]
    errors = [float((a - b).norm() / b.norm()) for a, b in zip(results[OURS], results["grouped_mm"])]
    for p in block.parameters():
        p.grad = None
    return max(errors)


def bench_shape(shape: Shape, flush: L2Flush) -> list[dict]:
    rows = []
    inputs = make_inputs(shape)
    block = make_block(shape)
    error = rel_errors(block, inputs)
    print(f"  ours vs grouped_mm: largest relative error (output, expert weight grads) {error:.2e}", flush=True)

    def record(backend, step):
        ours = {"rel_err": round(error, 6)} if backend.startswith(OURS) else {}
        rows.append(step_row("transformers_experts", shape, backend, step, flush, shape.repeats, **ours))

    for implementation in (OURS, "grouped_mm"):
        steps = Steps(block, implementation, inputs)
        record(implementation, steps.eager)
        try:
            static, replay = steps.capture()
        except Exception as failure:  # noqa: BLE001 -- report and go on with the other rows
            print(f"  {implementation}_graphed  not captured: {type(failure).__name__}: {failure}", flush=True)
        else:
            record(f"{implementation}_graphed", replay)
            del static, replay
        free_memory()

    steps = Steps(block, "eager", inputs)
    first = steps.first_eager_s()
    if first > EAGER_LIMIT_S:
        print(f"  eager                skipped: its first step took {first:.1f} s (> {EAGER_LIMIT_S} s)", flush=True)
    else:
        record("eager", steps.eager)
    del block, steps
    free_memory()
    return rows


def summarize(rows: list[dict]) -> None:
    print(f"\n{'shape':<44} {'backend':<20} {'ms':>9} {'wall_ms':>9} {'TFLOP/s':>8}")
    for r in rows:
        print(f"{r['shape']:<44} {r['backend']:<20} {r['ms']:>9.3f} {r['wall_ms']:>9.3f} {r['tflops']:>8.1f}")
    ms = {(r["shape"], r["backend"]): r["ms"] for r in rows}
    print("\nspeed-ups (slower ms / faster ms; bars in brackets)")
    for shape in SHAPES:
        for ours, theirs in ((OURS, "grouped_mm"), (f"{OURS}_graphed", "grouped_mm_graphed"),
                             (f"{OURS}_graphed", "grouped_mm"), (OURS, "eager")):
            if (shape.label, ours) in ms and (shape.label, theirs) in ms:
                bar = " [>= 1.8x]" if shape.name == "qwen3_30b_a3b" and (ours, theirs) == (OURS, "grouped_mm") else ""
                print(f"  {shape.name:<14} {ours} vs {theirs}: "
                      f"{ms[(shape.label, theirs)] / ms[(shape.label, ours)]:5.2f}x{bar}")


def main() -> None:
    prologue(cli(__doc__))
    start = time.perf_counter()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}",
          flush=True)
    flush = L2Flush()
    rows = []
    for shape in SHAPES:
        print(f"{shape.label}: {shape.flops() / 1e12:.1f} TFLOP of expert GEMMs per step", flush=True)
        rows += bench_shape(shape, flush)
    summarize(rows)
    path = write_results("transformers_experts", rows)
    print(f"wrote {path} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
