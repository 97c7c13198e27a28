"""Train a small random-init Hugging Face Qwen3-MoE model with moe_grouped's experts.

``moe_grouped.integrations.transformers.register()`` adds moe_grouped to
transformers' experts implementations; the model is built with
``experts_implementation="moe_grouped"`` and switched with
``model.set_experts_implementation(...)`` to transformers' own
``"grouped_mm"`` for comparison. Each run starts from the same weights and
sees the same batches (a learnable next-token rule), so the losses of the two
implementations track each other; the step times are the point.

    python examples/transformers_moe.py                   # CPU: eager steps (reference backend), a few seconds
    python examples/transformers_moe.py --device cuda     # bf16, eager and the whole step in a CUDA graph
    python examples/transformers_moe.py --device cuda --fp8   # our experts in FP8 block scaling

On the GPU each implementation also trains with the whole step (forward,
backward, AdamW) captured once by ``moe_grouped.graphs.capture_step`` and
replayed; the routing changes every step, the graph does not. Needs
``pip install "moe_grouped[transformers]"``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from moe_grouped import fp8
from moe_grouped.graphs import capture_step
from moe_grouped.integrations import transformers as mg_transformers


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=128, help="each expert's intermediate size")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="timed training steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--fp8", action="store_true", help="our experts in FP8 (bf16 model; emulated on CPU)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    return args


def build_model(args, device: torch.device, dtype: torch.dtype, name: str):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.ffn, num_experts=args.experts, num_experts_per_tok=args.top_k,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=args.hidden // 4, norm_topk_prob=True, max_position_embeddings=max(args.seq, 128), use_cache=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, experts_implementation=name)
    return model.to(device=device, dtype=dtype).train()


def batches(args, device: torch.device, count: int):
    """Sequences following x[t+1] = (5 x[t] + 3) mod vocab from random starts: learnable, the same every run."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        ids = torch.empty(args.batch, args.seq, dtype=torch.long)
        ids[:, 0] = torch.randint(args.vocab, (args.batch,), generator=gen)
        for t in range(1, args.seq):
            ids[:, t] = (5 * ids[:, t - 1] + 3) % args.vocab
        out.append(ids.to(device))
    return out


def make_step(model, optimizer, use_fp8: bool):
    def step(ids):
        optimizer.zero_grad(set_to_none=True)
        with fp8.fp8_autocast() if use_fp8 else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def train(model, initial_state, implementation: str, graphed: bool, args, data, device) -> tuple[list, list]:
    """One run from ``initial_state``: (per-step seconds of the timed steps, losses of all steps)."""
    model.load_state_dict(initial_state)
    model.set_experts_implementation(implementation)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=device.type == "cuda")
    step = make_step(model, optimizer, args.fp8 and implementation == mg_transformers.DEFAULT_NAME)
    if graphed:
        # capture_step's warm-up steps train too: they are the untimed steps here.
        step = capture_step(step, data[0].clone(), num_warmup_iters=max(args.warmup, 1), optimizers=[optimizer])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, losses = [], []
    for i, ids in enumerate(data):
        sync()
        start = time.perf_counter()
        loss = step(ids)
        sync()
        if i >= (0 if graphed else args.warmup):
            times.append(time.perf_counter() - start)
        losses.append(float(loss))
    return times, losses


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU, and torch sees none")
    dtype = torch.bfloat16 if device.type == "cuda" or args.fp8 else torch.float32
    name = mg_transformers.register()
    model = build_model(args, device, dtype, name)
    initial_state = {k: v.clone() for k, v in model.state_dict().items()}
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    print(
        f"Qwen3-MoE, random init: {args.layers} layers, hidden {args.hidden}, {args.experts} experts (top {args.top_k}) "
        f"of width {args.ffn}, {experts / 1e6:.2f}M expert parameters; batch {args.batch} x {args.seq} tokens, "
        f"{dtype}, {device}{', FP8 experts (ours)' if args.fp8 else ''}"
    )
    runs = [(name, False), ("grouped_mm", False)]
    if device.type == "cuda":
        runs += [(name, True), ("grouped_mm", True)]
    for implementation, graphed in runs:
        data = batches(args, device, args.steps + (0 if graphed else args.warmup))
        times, losses = train(model, initial_state, implementation, graphed, args, data, device)
        mode = "whole step in a CUDA graph" if graphed else "eager"
        print(
            f"experts_implementation={implementation!r:14} {mode:27} step {1e3 * statistics.median(times):8.2f} ms "
            f"(median of {len(times)}), loss {losses[0]:.3f} -> {losses[-1]:.3f}"
        )


if __name__ == "__main__":
    main()
