"""FP8 grouped quantize bandwidth: the core's kernels vs the PyTorch reference.

Effective bandwidth counts the bytes read (the bf16 input) and written (fp8
data and fp32 scales). The device-to-device copy row is the ceiling.

    python benchmarks/fp8.py      # H100: writes benchmarks/results/fp8-h100.json
"""

from __future__ import annotations

import sys
import pathlib

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import L2Flush, print_table, time_ms, write_results  # noqa: E402

from moe_grouped import fp8  # noqa: E402

# (E, total tokens M, hidden K) of the grouped GEMM benchmark's activations.
SHAPES = [(8, 16384, 4096), (8, 16384, 14336), (32, 32768, 7168), (32, 32768, 2048), (128, 32768, 2048)]


def skewed_splits(num_experts: int, total: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    weights = (torch.randn(num_experts, generator=gen) * 1.0).exp()
    weights[torch.randperm(num_experts, generator=gen)[: max(1, num_experts // 8)]] = 0
    counts = (weights / weights.sum() * total).floor().long()
    counts[int(weights.argmax())] += total - int(counts.sum())
    return counts


def main() -> None:
    torch.manual_seed(0)
    flush = L2Flush()
    rows = []
    for num_experts, total, hidden in SHAPES:
        x = torch.randn(total, hidden, device="cuda", dtype=torch.bfloat16)
        splits = skewed_splits(num_experts, total).cuda()
        shape = f"({num_experts},{total},{hidden})"
        scale_bytes = 4 * total * -(-hidden // 128)
        moved = x.numel() * 2 + x.numel() + scale_bytes
        out = fp8.quantize_columnwise_grouped(x, splits, torch.float8_e4m3fn)
        cases = {
            ("quantize_rowwise", "cuda_fp8"): lambda: fp8.quantize_rowwise(x, torch.float8_e4m3fn),
            ("quantize_rowwise", "torch_reference"): lambda: fp8.quantize_1x128(x, torch.float8_e4m3fn, True),
            ("quantize_colwise", "cuda_fp8"): lambda: fp8.quantize_columnwise_grouped(
                x, splits, torch.float8_e4m3fn, out=out),
        }
        for (op, backend), fn in cases.items():
            ms = time_ms(fn, flush=flush)
            rows.append({"bench": "fp8", "op": op, "shape": shape, "splits": "skewed",
                         "backend": backend, "ms": ms, "gbps": moved / ms / 1e6})
        copy_target = torch.empty_like(x)
        ms = time_ms(lambda: copy_target.copy_(x), flush=flush)
        rows.append({"bench": "fp8", "op": "copy", "shape": shape, "splits": "-",
                     "backend": "device_copy", "ms": ms, "gbps": 2 * x.numel() * 2 / ms / 1e6})
    print_table(rows, "gbps")
    print("wrote", write_results("fp8", rows))


if __name__ == "__main__":
    main()
