"""Train a tiny Mixture-of-Experts regressor with moe_grouped.GroupedLinear.

A fixed random "teacher" MoE produces targets; a student MoE with its own
router learns to match it. Routing is top-k over a softmax gate, tokens are
sorted by expert on the device and ``m_splits`` stays a device tensor, so the
same code is what a CUDA graph would capture. On a CPU it uses the
``reference`` backend and takes a few seconds:

    python examples/train_moe.py                  # CPU, reference backend
    python examples/train_moe.py --device cuda    # the GPU's default backend
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import moe_grouped


class TinyMoE(nn.Module):
    """Router + permutation + two GroupedLinear layers (GELU MLP experts)."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int, backend, device, dtype):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False, device=device, dtype=dtype)
        self.fc1 = moe_grouped.GroupedLinear(num_experts, hidden, ffn, backend=backend, device=device, dtype=dtype)
        self.fc2 = moe_grouped.GroupedLinear(num_experts, ffn, hidden, backend=backend, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        flat_experts = experts.reshape(-1)
        # Sort the token copies by expert; all on the device, no host sync.
        order = torch.argsort(flat_experts, stable=True)
        m_splits = torch.bincount(flat_experts, minlength=self.num_experts)
        tokens = x.repeat_interleave(self.top_k, dim=0)[order]
        h = self.fc2(torch.nn.functional.gelu(self.fc1(tokens, m_splits)), m_splits)
        out = torch.empty_like(h).index_copy_(0, order, h)  # back to token order
        return (out.view(-1, self.top_k, x.shape[-1]) * weights.unsqueeze(-1)).sum(1)


def train(args) -> list[float]:
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    make = lambda: TinyMoE(args.hidden, args.ffn, args.experts, args.top_k, args.backend, device, dtype)  # noqa: E731
    teacher, student = make(), make()
    teacher.requires_grad_(False)
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr)
    backend = student.fc1.backend or moe_grouped.backends.default_backend(device)
    print(f"training a {args.experts}-expert top-{args.top_k} MoE on {device} with the {backend!r} backend")
    losses, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype)
        loss = nn.functional.mse_loss(student(x).float(), teacher(x).float())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            elapsed = time.perf_counter() - start
            rate = step * args.tokens / elapsed
            print(f"step {step:5d}  loss {losses[-1]:.5f}  {rate:,.0f} tokens/s")
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    print(f"mean loss of the first 10 steps {first:.5f}, of the last 10 {last:.5f}")
    return losses


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--backend", default=None, choices=moe_grouped.backends.BACKENDS,
                        help="GroupedLinear backend (default: the device's)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--ffn", type=int, default=64)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=50)
    return parser.parse_args(argv)


if __name__ == "__main__":
    train(parse_args())
