"""FP8: quantize bandwidth, FP8 grouped GEMM throughput, FP8 GroupedLinear step.

GEMMs (op ``fprop``): our FP8 block-scaled kernels (``cuda_fp8``, operands
already quantized) vs our bf16 kernels (``cuda``) vs torch._scaled_grouped_mm
with row-wise scales (``torch_fp8_rowwise``, the nearest torch has). Op
``fwd_bwd``: one GroupedLinear forward + backward (weight gradient into a
fresh tensor, no bias), FP8 with every quantization included vs bf16, and
``cuda_fp8_kept_weights``: a later micro-batch of gradient accumulation
(``is_first_microbatch=False``), which reuses the FP8 weights of the first;
each also as ``<backend>_graphed``, the step captured in a CUDA graph and
replayed (GPU time, without the host's launch latency at the step's start).

Effective bandwidth counts the bytes the caller reads and gets written: the
bf16 input, the fp8 data and the fp32 scales (and dbias) of each variant;
not the kernels' own scratch (offsets, per-block dbias partials). The
device-to-device copy row is the ceiling. Variants: row-wise; grouped
column-wise; both from one read ("both"); either with the fused dbias; and
the 128x128 weight quantizer with its transposed copy. The cuda quantizers
are timed as a replayed CUDA graph: the kernels' GPU time, without the
host's per-call cost (a captured training step pays none).

    python benchmarks/fp8.py      # H100: writes benchmarks/results/fp8-h100.json
"""

from __future__ import annotations

import sys
import pathlib

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import L2Flush, cli, graphed, print_table, prologue, time_ms, write_results  # noqa: E402
# (E, M, K, N) of the grouped GEMM benchmark's GEMMs (the first two are Mixtral's).
from grouped_gemm import SHAPES as GEMM_SHAPES  # noqa: E402

from moe_grouped import fp8  # noqa: E402

# (E, total tokens M, hidden K) of the grouped GEMM benchmark's activations.
SHAPES = [(8, 16384, 4096), (8, 16384, 14336), (32, 32768, 7168), (32, 32768, 2048), (128, 32768, 2048)]
# (E, N, K) of grouped expert weights.
WEIGHT_SHAPES = [(8, 14336, 4096), (8, 4096, 14336), (32, 2048, 7168), (128, 1536, 2048)]
E4M3 = torch.float8_e4m3fn


def skewed_splits(num_experts: int, total: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    weights = (torch.randn(num_experts, generator=gen) * 1.0).exp()
    weights[torch.randperm(num_experts, generator=gen)[: max(1, num_experts // 8)]] = 0
    counts = (weights / weights.sum() * total).floor().long()
    counts[int(weights.argmax())] += total - int(counts.sum())
    return counts


def _row(op: str, shape: str, splits: str, backend: str, ms: float, moved: int) -> dict:
    return {"bench": "fp8", "op": op, "shape": shape, "splits": splits, "backend": backend, "ms": ms,
            "gbps": moved / ms / 1e6}


def activation_rows(flush: L2Flush) -> list[dict]:
    rows = []
    for num_experts, total, hidden in SHAPES:
        x = torch.randn(total, hidden, device="cuda", dtype=torch.bfloat16)
        splits = skewed_splits(num_experts, total).cuda()
        shape = f"({num_experts},{total},{hidden})"
        read, data = x.numel() * 2, x.numel()
        row_scales = 4 * total * -(-hidden // 128)
        col_scales = 4 * hidden * sum(-(-c // 128) for c in splits.tolist())
        dbias = 4 * num_experts * hidden
        both = fp8.quantize_grouped(x, splits, E4M3, dbias=True)  # warm-up: sizes the workspace
        colwise = fp8.quantize_grouped(x, splits, E4M3, rowwise=False, dbias=True)
        cases = {
            ("quantize_rowwise", "cuda_fp8"): (lambda: fp8.quantize_rowwise(x, E4M3), read + data + row_scales),
            ("quantize_rowwise", "torch_reference"): (
                lambda: fp8.quantize_1x128(x, E4M3, True), read + data + row_scales),
            ("quantize_colwise", "cuda_fp8"): (
                lambda: fp8.quantize_columnwise_grouped(x, splits, E4M3, out=colwise.columnwise),
                read + data + col_scales),
            ("quantize_colwise_dbias", "cuda_fp8"): (
                lambda: fp8.quantize_grouped(x, splits, E4M3, rowwise=False, dbias=True, out=colwise),
                read + data + col_scales + dbias),
            ("quantize_both", "cuda_fp8"): (
                lambda: fp8.quantize_grouped(x, splits, E4M3, out=both._replace(dbias=None)),
                read + 2 * data + row_scales + col_scales),
            ("quantize_both_dbias", "cuda_fp8"): (
                lambda: fp8.quantize_grouped(x, splits, E4M3, dbias=True, out=both),
                read + 2 * data + row_scales + col_scales + dbias),
        }
        for (op, backend), (fn, moved) in cases.items():
            # The kernels' GPU time: replayed from a CUDA graph (the reference reads splits on the host).
            timed = fn if backend == "torch_reference" else graphed(fn)
            rows.append(_row(op, shape, "skewed", backend, time_ms(timed, flush=flush), moved))
        copy_target = torch.empty_like(x)
        ms = time_ms(lambda: copy_target.copy_(x), flush=flush)
        rows.append(_row("copy", shape, "-", "device_copy", ms, 2 * x.numel() * 2))
        del x, both, colwise, copy_target
    return rows


def weight_rows(flush: L2Flush) -> list[dict]:
    rows = []
    for num_experts, n, k in WEIGHT_SHAPES:
        w = torch.randn(num_experts, n, k, device="cuda", dtype=torch.bfloat16)
        shape = f"({num_experts},{n},{k})"
        scales = 2 * 4 * num_experts * -(-n // 128) * -(-k // 128)
        out = fp8.quantize_weights_128x128(w, E4M3)
        ms = time_ms(graphed(lambda: fp8.quantize_weights_128x128(w, E4M3, out=out)), flush=flush)
        rows.append(_row("quantize_weight", shape, "-", "cuda_fp8", ms, w.numel() * 2 + 2 * w.numel() + scales))
        del w, out
    return rows


# ---- FP8 grouped GEMMs and the FP8 GroupedLinear step ----------------------

def _gemm_row(op, shape, splits, backend, ms, flops) -> dict:
    return {"bench": "fp8", "op": op, "shape": shape, "splits": splits, "backend": backend, "ms": ms,
            "tflops": flops / ms / 1e9}


def _torch_rowwise_fprop(x, w, splits):
    """torch._scaled_grouped_mm with per-row / per-column scales (the nearest torch has)."""
    amax_x = x.abs().amax(dim=1).float().clamp(min=1e-12)
    scale_x = (amax_x / 448.0)
    xa = (x.float() / scale_x[:, None]).to(E4M3)
    amax_w = w.abs().amax(dim=2).float().clamp(min=1e-12)
    scale_w = amax_w / 448.0
    wb = (w.float() / scale_w[..., None]).to(E4M3).transpose(-2, -1)
    offs = torch.cumsum(splits, 0).to(torch.int32)
    return lambda: torch._scaled_grouped_mm(xa, wb, scale_x, scale_w, offs=offs, out_dtype=torch.bfloat16)


def gemm_rows(flush: L2Flush) -> list[dict]:
    from moe_grouped import GroupedLinear
    from moe_grouped.fp8 import gemm as fp8_gemm
    from moe_grouped.gemm import cuda_backend

    rows = []
    recipe = fp8.Float8BlockScaling("E4M3")
    for e, m, k, n in GEMM_SHAPES:
        shape = f"({e},{m},{k},{n})"
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        wq = fp8.quantize_weights_128x128(w, E4M3, transpose=False).w
        xq = fp8.quantize_rowwise(x, E4M3)
        for splits_kind in ("balanced", "skewed"):
            splits = (torch.full((e,), m // e, dtype=torch.int64) if splits_kind == "balanced"
                      else skewed_splits(e, m)).cuda()
            flops = 2.0 * m * n * k
            cases = {
                "cuda_fp8": lambda: fp8_gemm.grouped_fprop_fp8(xq, wq, splits),
                "cuda": lambda: cuda_backend.fprop(x, [w], splits, None, torch.bfloat16),
            }
            try:
                cases["torch_fp8_rowwise"] = _torch_rowwise_fprop(x, w, splits)
                cases["torch_fp8_rowwise"]()
            except Exception as exc:  # e.g. group sizes torch's kernel does not take
                cases.pop("torch_fp8_rowwise", None)
                print(f"torch_fp8_rowwise {shape} {splits_kind}: skipped ({type(exc).__name__}: {str(exc)[:120]})")
            for backend, fn in cases.items():
                rows.append(_gemm_row("fprop", shape, splits_kind, backend, time_ms(fn, flush=flush), flops))
            # GroupedLinear fwd+bwd: quantization included for FP8.
            layer = GroupedLinear(e, k, n, bias=False, single_grouped_weight=True, dtype=torch.bfloat16,
                                  device="cuda", backend="cuda")
            xg = x.detach().requires_grad_(True)
            dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

            def step(use_fp8, is_first_microbatch=None):
                with fp8.fp8_autocast(recipe, enabled=use_fp8):
                    y = layer(xg, splits, is_first_microbatch=is_first_microbatch)
                y.backward(dy)
                layer.weight.grad = None
                xg.grad = None

            # cuda_fp8_kept_weights: a later micro-batch of gradient accumulation
            # (is_first_microbatch=False), the weights quantized by the first.
            # *_graphed: the same step captured and replayed (GPU time only, as
            # a captured training step runs it).
            step(True, is_first_microbatch=True)
            for backend, use_fp8, first in (("cuda_fp8", True, None), ("cuda", False, None),
                                            ("cuda_fp8_kept_weights", True, False)):
                ms = time_ms(lambda: step(use_fp8, first), flush=flush, repeats=15)
                rows.append(_gemm_row("fwd_bwd", shape, splits_kind, backend, ms, 3 * flops))
                replay = graphed(lambda: step(use_fp8, first))
                ms = time_ms(replay, flush=flush, repeats=15)
                rows.append(_gemm_row("fwd_bwd", shape, splits_kind, backend + "_graphed", ms, 3 * flops))
                del replay
            del layer, xg, dy
        del x, w, wq, xq
        torch.cuda.empty_cache()
    return rows


def print_ratios(rows: list[dict]) -> None:
    """cuda_fp8 over cuda (our bf16) and over torch_fp8_rowwise, per case: the bars' numbers."""
    by_case = {}
    for row in rows:
        by_case.setdefault((row["op"], row["shape"], row["splits"]), {})[row["backend"]] = row["tflops"]
    for (op, shape, splits), tflops in by_case.items():
        fp8_tflops = tflops.get("cuda_fp8")
        parts = [f"{op:<8} {shape:<24} {splits:<9} cuda_fp8 {fp8_tflops:7.1f} TFLOP/s"]
        for other in ("cuda", "torch_fp8_rowwise"):
            if other in tflops:
                parts.append(f"{fp8_tflops / tflops[other]:.3f}x {other}")
        if "cuda_fp8_kept_weights" in tflops:
            parts.append(f"kept weights {tflops['cuda_fp8_kept_weights'] / tflops['cuda']:.3f}x cuda")
        if "cuda_graphed" in tflops:
            graphed_bf16 = tflops["cuda_graphed"]
            parts.append(f"graphed {tflops['cuda_fp8_graphed'] / graphed_bf16:.3f}x, kept weights "
                         f"{tflops['cuda_fp8_kept_weights_graphed'] / graphed_bf16:.3f}x cuda_graphed")
        print("  ".join(parts))


def main() -> None:
    prologue(cli(__doc__), warm_up=False)
    torch.manual_seed(0)
    flush = L2Flush()
    quantize = activation_rows(flush) + weight_rows(flush)
    print_table(quantize, "gbps")
    gemms = gemm_rows(flush)
    print_table(gemms, "tflops")
    print_ratios(gemms)
    print("wrote", write_results("fp8", quantize + gemms))


if __name__ == "__main__":
    main()
