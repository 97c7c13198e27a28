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

    python examples/train_moe.py                          # CPU, reference backend: 1 minute on 2 idle cores*
    python examples/train_moe.py --device cuda            # the GPU's default backends
    python examples/train_moe.py --device cuda --graphs   # whole step in one CUDA graph
    python examples/train_moe.py --device cuda --compare-eager --steps 100  # graph vs eager losses
    python examples/train_moe.py --fp8                    # FP8 block-scaled experts (emulated on CPU: 8 minutes*)
    python examples/train_moe.py --checkpoint lm.pt       # save; run again with --resume to go on
    python examples/train_moe.py --plot loss.png          # loss curve (needs matplotlib)
    torchrun --nproc-per-node 2 examples/train_moe.py --device cuda --ep 2   # experts over 2 GPUs

    * 1500 steps on a 2-core x86 machine, lightly loaded (load average 1 to
      2.5): 54 s and 451 s of training. Other work on the cores stretches
      them (the first took 335 s at load 5).

On the GPU the model computes in bfloat16 and the optimizer steps fp32 master
copies of the parameters (``--no-master-weights`` steps the bfloat16
parameters directly). ``--graphs`` captures the whole training step (forward,
backward, master-weight copies, AdamW) once with
``moe_grouped.graphs.capture_step`` and replays it for every batch; its
warm-up steps are undone, so it trains exactly like the eager loop, which
``--compare-eager`` checks.

``--fp8`` runs the expert GEMMs with DeepSeek-V3-style FP8 block scaling
(``moe_grouped.fp8.fp8_autocast``: 1x128 activation and 128x128 weight
scales, E4M3). The model then computes in bfloat16 on the CPU too, where the
``reference`` backend emulates the FP8 arithmetic exactly (slower than the
float32 default); on an H100 the ``cuda`` backend runs CUTLASS FP8 kernels.

``--ep N`` (under ``torchrun`` with N processes) spreads each block's experts
over the N ranks with ``moe_grouped.parallel.ExpertParallelMoELayer``: every
rank trains on its own batches, the replicated parameters' gradients are
averaged over the ranks (data parallel) and the experts' are divided by N, so
the step is that of the mean loss over all ranks. ``--ep 1`` runs the same
code path on one process (the ``local`` transport). ``--ep-transport`` picks
the transport (``peer``, the default on GPUs, ``symm_mem``,
``padded_all_to_all``, ``all_to_all``: see the README). Only rank 0 prints.

Progress uses tqdm when it is installed (``pip install -e ".[examples]"``)
and plain prints otherwise.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
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


def moe_layer(args, dtype, device) -> nn.Module:
    """The feed-forward layer: an MoELayer, or with ``--ep`` one whose experts are spread over the ranks."""
    options = dict(
        aux_loss_coeff=1e-2, z_loss_coeff=1e-3, single_grouped_weight=True, dtype=dtype, device=device,
        backend=args.backend,
    )
    if not getattr(args, "ep", None):
        return moe_grouped.MoELayer(args.dim, args.ffn, args.experts, args.top_k, **options)
    from moe_grouped.parallel import ExpertParallelMoELayer

    layer = ExpertParallelMoELayer(
        args.dim, args.ffn, args.experts, args.top_k, transport=getattr(args, "ep_transport", "auto"), **options
    )
    # The same seed made every rank's parameters equal (right for the replicated ones); each
    # rank's experts are other experts, so they get their own initial values.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed + 1 + layer.ep_rank)
        layer.experts.fc1.reset_parameters()
        layer.experts.fc2.reset_parameters()
    return layer


def setup_expert_parallel(args) -> None:
    """Joins the torchrun job for ``--ep N``: one process per rank, one GPU each on cuda."""
    # NVLink multicast (NVLS) stays off in NCCL, torch symmetric memory and NVSHMEM: on the
    # shared machines this runs on, a program that uses it can put the host's GPUs out of
    # service for a long time. Set before the process group or any symmetric buffer exists.
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    import torch.distributed as dist

    if "RANK" not in os.environ:
        raise SystemExit("--ep runs under torchrun, e.g. torchrun --nproc-per-node 2 examples/train_moe.py --ep 2")
    if args.device == "cuda":
        # NVSHMEM's team manager is pinned to one device index: name it everywhere.
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    if dist.get_world_size() != args.ep:
        raise SystemExit(f"--ep {args.ep} needs {args.ep} processes, torchrun started {dist.get_world_size()}")
    if dist.get_rank() != 0:
        sys.stdout = open(os.devnull, "w")  # one rank reports


@torch.no_grad()
def average_gradients(model) -> None:
    """With ``--ep``: the gradient of the mean of the ranks' losses (device collectives only).

    Replicated parameters: all-reduce and divide by the ranks. Experts: their
    gradients already sum every rank's tokens; divide by the ranks.
    """
    import torch.distributed as dist

    ranks = dist.get_world_size()
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        if ".moe.experts." not in name:
            dist.all_reduce(param.grad)
        param.grad.div_(ranks)


class MoELanguageModel(nn.Module):
    def __init__(self, vocab: int, args, dtype, device):
        super().__init__()
        self.fp8_recipe = moe_grouped.fp8.Float8BlockScaling() if getattr(args, "fp8", False) else None
        self.embed = nn.Embedding(vocab, args.dim, dtype=dtype, device=device)
        self.pos = nn.Parameter(torch.zeros(args.seq, args.dim, dtype=dtype, device=device))
        self.blocks = nn.ModuleList(
            Block(
                args.dim,
                args.heads,
                moe_layer(args, dtype, device),
                dtype,
                device,
            )
            for _ in range(args.layers)
        )
        self.norm = nn.RMSNorm(args.dim, dtype=dtype, device=device)
        self.expert_parallel = bool(getattr(args, "ep", None))
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return F.linear(self.norm(x), self.embed.weight)  # LM head tied to the embedding

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # The expert GEMMs take the recipe when they run forward; their backward reuses it.
        with moe_grouped.fp8.fp8_autocast(self.fp8_recipe, enabled=self.fp8_recipe is not None):
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


class MasterWeights:
    """fp32 master copies of low-precision parameters; the optimizer steps the copies.

    The model computes in bfloat16; the optimizer's small updates accumulate in
    fp32 copies, rounded into the bfloat16 parameters after each step. Every
    operation is a device copy, so a captured training step can contain it.
    """

    def __init__(self, params):
        self.params = list(params)
        self.master = [nn.Parameter(p.detach().float().clone()) for p in self.params]
        for m in self.master:
            m.grad = torch.zeros_like(m)  # persistent: refilled in place every step

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        for m, p in zip(self.master, self.params):
            if p.grad is None:
                m.grad.zero_()
            else:
                m.grad.copy_(p.grad)
        optimizer.step()
        for m, p in zip(self.master, self.params):
            p.copy_(m)

    @torch.no_grad()
    def load(self, tensors=None) -> None:
        """Sets the master copies from saved ones, or from the parameters."""
        for m, p, t in zip(self.master, self.params, tensors or self.params):
            m.copy_(t)


def training_step(model, optimizer, master, x, y) -> torch.Tensor:
    """One step: forward, backward, optimizer step. No host sync, so it can be captured."""
    loss = model.loss(x, y)
    model.zero_grad(set_to_none=True)
    loss.backward()
    if model.expert_parallel:
        average_gradients(model)
    if master is None:
        optimizer.step()
    else:
        master.step(optimizer)
    return loss.detach()


@torch.no_grad()
def save_training_state(model, optimizer, master) -> dict:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "master": [m.detach().clone() for m in master.master] if master is not None else [],
        "optimizer": {
            p: {k: v.clone() for k, v in state.items() if torch.is_tensor(v)} for p, state in optimizer.state.items()
        },
    }


@torch.no_grad()
def restore_training_state(model, optimizer, master, saved: dict) -> None:
    """Puts the saved values back in place (a captured graph keeps the tensors' addresses).

    Optimizer state created since the save (AdamW's step and moments on its
    first step) goes back to zero: its initial value.
    """
    for name, tensor in model.state_dict().items():
        tensor.copy_(saved["model"][name])
    if master is not None:
        master.load(saved["master"])
    for param, state in optimizer.state.items():
        before = saved["optimizer"].get(param, {})
        for key, value in state.items():
            if torch.is_tensor(value):
                value.copy_(before[key]) if key in before else value.zero_()


def make_graphed_step(model, optimizer, master, sample_x, sample_y):
    """Captures forward + backward + optimizer step with ``moe_grouped.graphs.capture_step``.

    Returns ``step(x, y) -> loss tensor`` that copies the batch into the
    static inputs and replays. The routing (tokens per expert) changes every
    replay; nothing in the step reads it on the host. ``capture_step`` warms up
    with three real training steps on a side stream (they allocate the
    workspaces and the optimizer state); they are undone afterwards, so the
    graphed run trains exactly like the eager one.
    """
    saved = save_training_state(model, optimizer, master)
    step = moe_grouped.graphs.capture_step(
        lambda x, y: training_step(model, optimizer, master, x, y),
        sample_x.clone(), sample_y.clone(), optimizers=[optimizer],
    )
    restore_training_state(model, optimizer, master, saved)
    return step


def save_checkpoint(path, model, optimizer, master, step, losses, args) -> None:
    tmp = f"{path}.tmp"
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
         "master": [m.detach() for m in master.master] if master is not None else None,
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
    dtype = torch.bfloat16 if device.type == "cuda" or args.fp8 else torch.float32  # FP8 GEMMs take bfloat16
    data = CharData(load_corpus(), device)
    model = MoELanguageModel(len(data.chars), args, dtype, device)
    graphs = args.graphs
    use_master = args.master_weights if args.master_weights is not None else dtype != torch.float32
    master = MasterWeights(model.parameters()) if use_master else None
    # capturable on the GPU in eager runs too: the same AdamW arithmetic with and without --graphs.
    optimizer = torch.optim.AdamW(
        master.master if master is not None else model.parameters(), lr=args.lr, weight_decay=0.01,
        capturable=device.type == "cuda",
    )
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
        if master is not None:
            master.load(state.get("master"))  # the saved fp32 copies, else the parameters
        optimizer.load_state_dict(state["optimizer"])
        first_step, losses = state["step"] + 1, state["losses"]
        print(f"resumed from {args.checkpoint} at step {state['step']}")
    backend = args.backend or moe_grouped.backends.default_backend(device)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." in n)
    print(
        f"training a {args.layers}-block character LM ({sum(p.numel() for p in model.parameters()):,} "
        f"parameters, {experts:,} in {args.experts} experts per block, top-{args.top_k}) on {device} "
        f"with the {backend!r} backend{', FP8 block-scaled experts' if args.fp8 else ''}"
        f"{', fp32 master weights' if master is not None else ''}"
        f"{', whole step in a CUDA graph' if graphs else ''}; corpus: pydoc_data.topics, "
        f"{len(data.train):,} training characters"
    )
    rank = int(os.environ.get("RANK", 0)) if getattr(args, "ep", None) else 0
    gen = torch.Generator().manual_seed(args.seed + first_step + 7919 * rank)  # each rank its own batches
    graphed_step = None
    tokens_per_step = args.batch * args.seq
    progress = Progress(first_step, args.steps, args.log_every)
    start = time.perf_counter()
    for step in range(first_step, args.steps + 1):
        x, y = data.batch("train", args.batch, args.seq, gen)
        if graphs and graphed_step is None:
            graphed_step = make_graphed_step(model, optimizer, master, x, y)
        if graphed_step is not None:
            loss = graphed_step(x, y)
        else:
            loss = training_step(model, optimizer, master, x, y)
        losses.append(loss.item())
        rate = (step - first_step + 1) * tokens_per_step / (time.perf_counter() - start)
        progress.update(step, losses[-1], rate)
        if args.checkpoint and args.save_every and step % args.save_every == 0:
            save_checkpoint(args.checkpoint, model, optimizer, master, step, losses, args)
    progress.close()
    elapsed = time.perf_counter() - start
    done = args.steps - first_step + 1
    if done > 0:
        print(f"{done} steps in {elapsed:.1f} s: {done * tokens_per_step / elapsed:,.0f} tokens/s")
    if args.checkpoint:
        save_checkpoint(args.checkpoint, model, optimizer, master, args.steps, losses, args)
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
COMPARE_TOLERANCE = 1e-3


def compare_with_eager(args) -> float:
    """Trains eagerly, then with the step in a CUDA graph, from the same seed; the largest loss gap."""
    quiet = dict(checkpoint=None, resume=False, plot=None, sample=0)
    print("== eager")
    eager = train(argparse.Namespace(**{**vars(args), **quiet, "graphs": False}))
    print("== whole step in a CUDA graph")
    graphed = train(argparse.Namespace(**{**vars(args), **quiet, "graphs": True}))
    gap = max(abs(a - b) for a, b in zip(eager, graphed))
    worst = max(range(len(eager)), key=lambda i: abs(eager[i] - graphed[i]))
    print(f"graph vs eager: max |loss difference| over {len(eager)} steps {gap:.3e} at step {worst + 1} "
          f"(eager {eager[worst]:.6f}, graph {graphed[worst]:.6f}); tolerance {COMPARE_TOLERANCE:g}")
    return gap


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
    parser.add_argument("--compare-eager", action="store_true",
                        help="train eagerly and with --graphs from the same seed and compare the losses "
                             f"(cuda only; exits with status 1 if they differ by more than {COMPARE_TOLERANCE:g})")
    parser.add_argument("--master-weights", action=argparse.BooleanOptionalAction, default=None,
                        help="step fp32 master copies of the parameters (default: on when the model is bfloat16, "
                             "i.e. on cuda)")
    parser.add_argument("--fp8", action="store_true",
                        help="FP8 block-scaled expert GEMMs (cuda backend on sm_90, reference emulation on CPU)")
    parser.add_argument("--checkpoint", default=None, help="save model and optimizer here at the end")
    parser.add_argument("--save-every", type=int, default=0, help="also save every N steps (with --checkpoint)")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    parser.add_argument("--plot", default=None, help="save the loss curve to this PNG (needs matplotlib)")
    parser.add_argument("--sample", type=int, default=120, help="characters to sample at the end (0: none)")
    parser.add_argument("--ep", type=int, default=None,
                        help="spread the experts over N ranks (expert parallel; launch N processes with torchrun)")
    parser.add_argument("--ep-transport", default="auto",
                        choices=("auto", "peer", "symm_mem", "padded_all_to_all", "all_to_all", "local"),
                        help="with --ep: how token copies travel between ranks (default: auto)")
    args = parser.parse_args(argv)
    if args.fp8 and args.backend == "torch":
        parser.error("--fp8 runs on the cuda backend (H100) or the reference backend (emulation), not torch")
    if args.graphs or args.compare_eager:
        flag = "--graphs" if args.graphs else "--compare-eager"
        if args.device != "cuda":
            parser.error(f"{flag} needs --device cuda")
        if args.backend == "reference":
            parser.error(f"{flag} cannot use the reference backend (it reads the routing on the host); "
                         "use --backend torch or cuda, or leave --backend out")
    if args.ep is not None:
        if args.ep < 1 or args.experts % args.ep:
            parser.error(f"--ep {args.ep} must be a positive divisor of --experts {args.experts}")
        if args.checkpoint or args.resume:
            parser.error("--checkpoint/--resume are not supported with --ep (each rank holds other experts)")
    if args.dim % args.heads:
        parser.error(f"--dim {args.dim} must be divisible by --heads {args.heads}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.ep:
        setup_expert_parallel(args)
    if args.compare_eager:
        if compare_with_eager(args) > COMPARE_TOLERANCE:
            raise SystemExit(1)
    else:
        train(args)


if __name__ == "__main__":
    main()
