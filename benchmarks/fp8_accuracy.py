"""How far the FP8 fused MoE layer lands from the bf16 one: relative error of the output and every gradient.

On each experts-path shape (issue 45's five, ``moe_layer.py --shapes
experts_path``: top-k-then-softmax router, no aux loss) one training step of
``MoELayer(backend="cuda")`` on the fused experts path, from the same weights,
input and output gradient (``torch.randn``), three ways:

  fp32_reference  the layer in float32 on the ``reference`` backend, the
                  weights upcast from the bf16 ones: the yardstick
  cuda_fused      the bf16 layer
  cuda_fp8_fused  the bf16 layer inside ``fp8_autocast`` (1x128 activations
                  and gradients, 128x128 weights, power-of-two scales)

Each row is one tensor (``out``, ``dx``, the router's and both expert layers'
weight gradients) of one way against another: ``rel_err`` = ||a - b|| / ||b||
(Frobenius norms, in float64). ``cuda_fp8_fused`` against ``cuda_fused`` is
the issue's figure; both against ``fp32_reference`` say how much of it is
FP8's own error beside bf16's rounding. The router runs in the layer's dtype
in every way, so the three route alike; the script checks that the bf16 and
FP8 steps chose the same experts and counts the tokens whose choice differs
from the float32 layer's (``routing_diff`` in the JSON).

    python benchmarks/fp8_accuracy.py       # table + results/fp8_accuracy-<gpu>.json
    python benchmarks/fp8_accuracy.py --shapes qwen3_30b_16k
"""

from __future__ import annotations

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from common import cli, free_memory, prologue, write_results  # noqa: E402
from moe_layer import EXPERTS_PATH_SHAPES, Shape  # noqa: E402

import moe_grouped  # noqa: E402
from moe_grouped import MoELayer  # noqa: E402

SHAPES = {shape.name: shape for shape in EXPERTS_PATH_SHAPES}
COMPARISONS = (
    ("cuda_fp8_fused", "cuda_fused"),
    ("cuda_fused", "fp32_reference"),
    ("cuda_fp8_fused", "fp32_reference"),
)


def make_layer(shape: Shape, dtype: torch.dtype, backend: str) -> MoELayer:
    return MoELayer(
        shape.hidden, shape.ffn, shape.experts, shape.top_k, router_options=shape.router,
        aux_loss_coeff=shape.aux_loss_coeff, dtype=dtype, device="cuda", backend=backend,
        experts_path="fused" if backend == "cuda" else None,
    )


def step(layer: MoELayer, x: torch.Tensor, dout: torch.Tensor, fp8: bool) -> tuple[dict, torch.Tensor]:
    """({tensor name: float64 copy} of one forward + backward, the chosen experts)."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().to(layer.router.weight.dtype).requires_grad_(True)
    if fp8:
        with moe_grouped.fp8.fp8_autocast(moe_grouped.fp8.Float8BlockScaling()):
            out = layer(x, is_first_microbatch=True)
    else:
        out = layer(x)
    out.backward(dout.to(out.dtype))
    tensors = {"out": out, "dx": x.grad}
    tensors.update({f"d({name})": p.grad for name, p in layer.named_parameters()})
    return {name: t.detach().double() for name, t in tensors.items()}, layer.last_routing.experts


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def measure(shape: Shape) -> tuple[list[dict], dict]:
    torch.manual_seed(0)
    bf16 = make_layer(shape, torch.bfloat16, "cuda")
    generator = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(shape.tokens, shape.hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
    dout = torch.randn(shape.tokens, shape.hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
    results = {}
    results["cuda_fused"], chosen = step(bf16, x, dout, fp8=False)
    results["cuda_fp8_fused"], chosen_fp8 = step(bf16, x, dout, fp8=True)
    if not torch.equal(chosen, chosen_fp8):
        raise RuntimeError(f"{shape.name}: the bf16 and FP8 steps routed differently; the router is not FP8")
    reference = make_layer(shape, torch.float32, "reference")
    reference.load_state_dict(bf16.state_dict())  # the bf16 weights, upcast
    del bf16
    free_memory()
    results["fp32_reference"], chosen_ref = step(reference, x, dout, fp8=False)
    diff_tokens = int((chosen_ref != chosen).any(dim=1).sum())
    del reference
    free_memory()
    rows = []
    for got, against in COMPARISONS:
        for tensor, value in results[got].items():
            rows.append({
                "bench": "fp8_accuracy", "op": "fwd_bwd", "shape": shape.name, "splits": "router",
                "backend": got, "against": against, "tensor": tensor,
                "rel_err": rel_err(value, results[against][tensor]),
            })
    return rows, {"shape": shape.name, "tokens_routed_differently_in_fp32": diff_tokens, "tokens": shape.tokens}


def main() -> None:
    args = prologue(cli(__doc__, SHAPES), warm_up=False)
    rows, routing_diff = [], []
    for name in args.shapes:
        shape_rows, diff = measure(SHAPES[name])
        rows += shape_rows
        routing_diff.append(diff)
        print(f"{name}: {diff['tokens_routed_differently_in_fp32']} of {diff['tokens']} tokens routed "
              f"differently by the float32 layer", flush=True)
        for row in shape_rows:
            print(f"  {row['tensor']:<24} {row['backend']:<16} vs {row['against']:<16} {row['rel_err']:.3e}")
    path = write_results("fp8_accuracy", rows, routing_diff=routing_diff)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
