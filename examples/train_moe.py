"""Train a small Mixture-of-Experts language model with moe_grouped.MoELayer.

The model: character embedding, a few transformer blocks (causal attention by
``torch.nn.functional.scaled_dot_product_attention`` and an MoE SwiGLU
feed-forward layer: router, permute, grouped experts, unpermute), and an LM
head tied to the embedding. The router's load-balancing and z losses are added
to the gradient by the layer itself.

The corpus is real English shipped with every CPython install: the text of
the Python documentation topics behind ``help()`` (``pydoc_data.topics``,
about 700 KB, from the Python Language Reference and Library docs; PSF
license). Characters are the tokens.

    python examples/train_moe.py                          # CPU, reference backend, ~1 minute
    python examples/train_moe.py --device cuda            # the GPU's default backends
    python examples/train_moe.py --device cuda --graphs   # whole step in one CUDA graph
    python examples/train_moe.py --checkpoint lm.pt       # save; run again with --resume to go on
    python examples/train_moe.py --plot loss.png          # loss curve (needs matplotlib)

Progress uses tqdm when it is installed (``pip install -e ".[examples]"``)
and plain prints otherwise.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
from torch import nn
from torch.nn import functional as F

import moe_grouped

try:
    from tqdm import tqdm
except ImportError:  # optional: the `examples` extra
    tqdm = None


def load_corpus() -> str:
    """The Python documentation topics' text, in a fixed order."""
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # some distributions split the stdlib docs out
        raise SystemExit(
            f"this example trains on the stdlib's pydoc_data.topics, which this Python lacks ({exc}); "
            "install your distribution's full Python standard library"
        ) from None
    return "\n\n".join(topics[name] for name in sorted(topics))


class CharData:
    """Character-level tokens with a 95/5 train/validation split."""

    def __init__(self, text: str, device: torch.device):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        data = torch.tensor([self.index[c] for c in text], dtype=torch.int64)
        split = int(0.95 * len(data))
        self.train, self.val = data[:split], data[split:]
        self.device = device

    def batch(self, split: str, batch: int, seq: int, gen: torch.Generator):
        data = self.train if split == "train" else self.val
        starts = torch.randint(len(data) - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s : s + seq] for s in starts.tolist()])
        y = torch.stack([data[s + 1 : s + seq + 1] for s in starts.tolist()])
        return x.to(self.device), y.to(self.device)

    def unigram_entropy(self) -> float:
        """Entropy (nats/char) of the training characters' frequencies."""
        counts = torch.bincount(self.train, minlength=len(self.chars)).double()
        probs = counts[counts > 0] / counts.sum()
        return float(-(probs * probs.log()).sum())

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MoE feed-forward layer."""

    def __init__(self, dim: int, heads: int, moe: moe_grouped.MoELayer, dtype, device):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.RMSNorm(dim, dtype=dtype, device=device)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False, dtype=dtype, device=device)
        self.proj = nn.Linear(dim, dim, bias=False, dtype=dtype, device=device)
        self.norm2 = nn.RMSNorm(dim, dtype=dtype, device=device)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.moe(self.norm2(x))


class MoELanguageModel(nn.Module):
    def __init__(self, vocab: int, args, dtype, device):
        super().__init__()
        self.embed = nn.Embedding(vocab, args.dim, dtype=dtype, device=device)
        self.pos = nn.Parameter(torch.zeros(args.seq, args.dim, dtype=dtype, device=device))
        self.blocks = nn.ModuleList(
            Block(
                args.dim,
                args.heads,
                moe_grouped.MoELayer(
                    args.dim, args.ffn, args.experts, args.top_k, aux_loss_coeff=1e-2, z_loss_coeff=1e-3,
                    single_grouped_weight=True, dtype=dtype, device=device, backend=args.backend,
                ),
                dtype,
                device,
            )
            for _ in range(args.layers)
        )
        self.norm = nn.RMSNorm(args.dim, dtype=dtype, device=device)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return F.linear(self.norm(x), self.embed.weight)  # LM head tied to the embedding

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(ids)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


class Progress:
    """tqdm when installed, plain prints every ``log_every`` steps otherwise."""

    def __init__(self, first: int, total: int, log_every: int):
        self.bar = tqdm(total=total, initial=first - 1, unit="step") if tqdm is not None else None
        self.log_every, self.total = log_every, total

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self.bar.update(1)
        elif step == 1 or step % self.log_every == 0 or step == self.total:
            print(f"step {step:5d}  loss {loss:.4f}  {tokens_per_s:,.0f} tokens/s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def make_graphed_step(model, optimizer, sample_x, sample_y):
    """Captures forward + backward + optimizer step in one CUDA graph.

    Returns ``step(x, y) -> loss tensor`` that copies the batch into the
    static inputs and replays. The routing (tokens per expert) changes every
    replay; nothing in the step reads it on the host. Warm-up runs three real
    training steps on a side stream first (they allocate the workspaces).
    """
    static_x, static_y = sample_x.clone(), sample_y.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            model.loss(static_x, static_y).backward()
            optimizer.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = model.loss(static_x, static_y)
        static_loss.backward()
        optimizer.step()

    def step(x, y):
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        return static_loss

    return step


def save_checkpoint(path, model, optimizer, step, losses, args) -> None:
    tmp = f"{path}.tmp"
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
         "losses": losses, "config": {k: getattr(args, k) for k in MODEL_ARGS}},
        tmp,
    )
    os.replace(tmp, path)  # never leave a half-written checkpoint


def plot_losses(path: str, losses: list[float]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed (pip install -e \".[examples]\"); no plot written")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(1, len(losses) + 1), losses, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/char)")
    ax.set_title("MoE character LM on pydoc_data.topics")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"loss curve saved to {path}")


@torch.no_grad()
def sample(model, data: CharData, prompt: str, length: int, seq: int, gen: torch.Generator) -> str:
    ids = [data.index[c] for c in prompt if c in data.index]
    for _ in range(length):
        context = torch.tensor([ids[-seq:]], device=data.device)
        probs = torch.softmax(model(context)[0, -1].float() / 0.8, dim=-1).cpu()
        ids.append(int(torch.multinomial(probs, 1, generator=gen)))
    return data.decode(ids)


def train(args) -> list[float]:
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    data = CharData(load_corpus(), device)
    model = MoELanguageModel(len(data.chars), args, dtype, device)
    graphs = args.graphs
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, capturable=graphs)
    first_step, losses = 1, []
    if args.resume:
        if not args.checkpoint or not os.path.exists(args.checkpoint):
            raise SystemExit(f"--resume needs an existing --checkpoint file, got {args.checkpoint!r}")
        state = torch.load(args.checkpoint, map_location=device)
        saved = state["config"]
        mismatched = {k: (saved[k], getattr(args, k)) for k in MODEL_ARGS if saved.get(k) != getattr(args, k)}
        if mismatched:
            raise SystemExit(f"the checkpoint was trained with other settings (saved, given): {mismatched}")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first_step, losses = state["step"] + 1, state["losses"]
        print(f"resumed from {args.checkpoint} at step {state['step']}")
    backend = args.backend or moe_grouped.backends.default_backend(device)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." in n)
    print(
        f"training a {args.layers}-block character LM ({sum(p.numel() for p in model.parameters()):,} "
        f"parameters, {experts:,} in {args.experts} experts per block, top-{args.top_k}) on {device} "
        f"with the {backend!r} backend; corpus: pydoc_data.topics, {len(data.train):,} training characters"
    )
    gen = torch.Generator().manual_seed(args.seed + first_step)
    graphed_step = None
    tokens_per_step = args.batch * args.seq
    progress = Progress(first_step, args.steps, args.log_every)
    start = time.perf_counter()
    for step in range(first_step, args.steps + 1):
        x, y = data.batch("train", args.batch, args.seq, gen)
        if graphs and graphed_step is None:
            graphed_step = make_graphed_step(model, optimizer, x, y)  # trains on this batch 3 times
        if graphed_step is not None:
            loss = graphed_step(x, y)
        else:
            loss = model.loss(x, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        losses.append(loss.item())
        rate = (step - first_step + 1) * tokens_per_step / (time.perf_counter() - start)
        progress.update(step, losses[-1], rate)
        if args.checkpoint and args.save_every and step % args.save_every == 0:
            save_checkpoint(args.checkpoint, model, optimizer, step, losses, args)
    progress.close()
    elapsed = time.perf_counter() - start
    done = args.steps - first_step + 1
    if done > 0:
        print(f"{done} steps in {elapsed:.1f} s: {done * tokens_per_step / elapsed:,.0f} tokens/s")
    if args.checkpoint:
        save_checkpoint(args.checkpoint, model, optimizer, args.steps, losses, args)
        print(f"checkpoint saved to {args.checkpoint} (step {args.steps}); --resume with more --steps goes on")
    model.eval()
    with torch.no_grad():
        val_gen = torch.Generator().manual_seed(0)
        val = sum(model.loss(*data.batch("val", args.batch, args.seq, val_gen)).item() for _ in range(4)) / 4
        print(f"validation loss {val:.4f} nats/char; unigram entropy {data.unigram_entropy():.4f} "
              f"(the best any model that ignores context can do); uniform guess {math.log(len(data.chars)):.4f}")
        routing = model.blocks[-1].moe.last_routing
        print(f"last block: aux loss {routing.aux_loss.item():.3f} (1.0 = balanced), "
              f"tokens per expert {routing.tokens_per_expert.tolist()}")
    if args.sample:
        print("sample:", repr(sample(model, data, "The ", args.sample, args.seq, torch.Generator().manual_seed(1))))
    if args.plot:
        plot_losses(args.plot, losses)
    if len(losses) >= 20:
        first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
        print(f"mean loss of the first 10 steps {first:.5f}, of the last 10 {last:.5f}")
    return losses


MODEL_ARGS = ("dim", "heads", "ffn", "layers", "experts", "top_k", "seq")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="default: cpu")
    parser.add_argument("--backend", default=None, choices=moe_grouped.backends.BACKENDS,
                        help="expert GEMM and permutation backend (default: the device's)")
    parser.add_argument("--steps", type=int, default=1500, help="train up to this step (default: 1500)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=128, help="hidden width of each expert")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=250)
    parser.add_argument("--graphs", action="store_true",
                        help="capture forward + backward + optimizer step in one CUDA graph (cuda only)")
    parser.add_argument("--fp8", action="store_true", help="FP8 block-scaled experts (not yet supported)")
    parser.add_argument("--checkpoint", default=None, help="save model and optimizer here at the end")
    parser.add_argument("--save-every", type=int, default=0, help="also save every N steps (with --checkpoint)")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    parser.add_argument("--plot", default=None, help="save the loss curve to this PNG (needs matplotlib)")
    parser.add_argument("--sample", type=int, default=120, help="characters to sample at the end (0: none)")
    args = parser.parse_args(argv)
    if args.fp8:
        parser.error(
            "--fp8 is not yet supported: moe_grouped has no FP8 grouped GEMM kernels yet "
            "(GroupedLinear refuses to run inside fp8_autocast); run without --fp8"
        )
    if args.graphs:
        if args.device != "cuda":
            parser.error("--graphs needs --device cuda")
        if args.backend == "reference":
            parser.error("--graphs cannot use the reference backend (it reads the routing on the host); "
                         "use --backend torch or cuda, or leave --backend out")
    if args.dim % args.heads:
        parser.error(f"--dim {args.dim} must be divisible by --heads {args.heads}")
    return args


if __name__ == "__main__":
    train(parse_args())
