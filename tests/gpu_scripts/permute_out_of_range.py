"""Out-of-range expert ids through the cuda permute kernels, for compute-sanitizer.

Runs permute / unpermute forward and backward on the ``cuda`` (and ``torch``)
backend with expert ids that are negative, equal to num_experts, far past it
and at the index type's limits, for every dropping option, over shapes that
span several 256-copy chunks, and checks each result against the reference
ops with those copies removed. Meant to run under

    compute-sanitizer --tool memcheck --error-exitcode 1 python tests/gpu_scripts/permute_out_of_range.py

Exit status 0 iff every result is right (and, under the sanitizer, no access
went out of bounds).
"""

from __future__ import annotations

import sys

import torch

from moe_grouped import permute, unpermute
from moe_grouped.permute import cuda_unavailable_reason, expert_capacity, permuted_rows

OPTIONS = [
    {},
    {"capacity_factor": 1.0, "drop_policy": "position"},
    {"capacity_factor": 1.0, "drop_policy": "probs"},
    {"capacity_factor": 0.5, "drop_policy": "position", "pad_to_capacity": True},
    {"capacity_factor": 1.5, "drop_policy": "probs", "pad_to_capacity": True},
]
SHAPES = [(1, 1, 1), (7, 2, 4), (300, 4, 16), (1000, 8, 64), (64, 2, 4096)]  # tokens, top_k, experts


def bad_ids(num_experts: int, dtype: torch.dtype) -> list[int]:
    limit = torch.iinfo(dtype)
    return [-1, -2, num_experts, num_experts + 1, 5 * num_experts + 3, limit.max, limit.min]


def routing(tokens, top_k, num_experts, dtype, gen):
    experts = torch.randint(0, num_experts, (tokens, top_k), generator=gen, dtype=torch.int64)
    bad = torch.tensor(bad_ids(num_experts, dtype), dtype=torch.int64)
    mask = torch.rand(tokens, top_k, generator=gen) < 0.3
    mask.view(-1)[0] = True  # at least one bad copy
    picks = bad[torch.randint(0, len(bad), (tokens, top_k), generator=gen)]
    return torch.where(mask, picks, experts).to(dtype)


def expected(x, experts, num_experts, probs, options):
    """The reference ops on the CPU: the same routing with the bad copies removed."""
    tokens, top_k = experts.shape
    factor = options.get("capacity_factor")
    capacity = None if factor is None else expert_capacity(tokens, top_k, num_experts, factor)
    pad = options.get("pad_to_capacity", False)
    priority = probs if capacity is not None and options.get("drop_policy") == "probs" else None
    row_id_map, m_splits = torch.ops.moe_grouped.permute_index(
        experts, priority, num_experts, -1 if capacity is None else capacity, pad, "reference"
    )
    rows = permuted_rows(tokens, top_k, num_experts, capacity, pad)
    permuted = torch.ops.moe_grouped.permute_rows(x, row_id_map, top_k, rows, True, "reference")
    return permuted, m_splits, row_id_map


def check(backend, tokens, top_k, num_experts, index_dtype, dtype, options, seed) -> list[str]:
    case = f"{backend=} {tokens=} {top_k=} {num_experts=} {index_dtype=} {dtype=} {options=}"
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 40, generator=gen).to(dtype)
    experts = routing(tokens, top_k, num_experts, index_dtype, gen)
    probs = torch.rand(tokens, top_k, generator=gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    ref_perm, ref_splits, ref_map = expected(x, experts, num_experts, probs, options)
    y = torch.randn(ref_perm.shape, generator=gen).to(dtype)
    dout = torch.randn(tokens, 40, generator=gen).to(dtype)
    yr, wr = y.clone().requires_grad_(True), weights.clone().requires_grad_(True)
    ref_out = torch.ops.moe_grouped.unpermute_rows(yr, ref_map, wr, top_k, "reference")
    ref_out.backward(dout)
    xr = x.clone().requires_grad_(True)
    torch.ops.moe_grouped.permute_rows(xr, ref_map, top_k, ref_perm.shape[0], True, "reference").backward(y)

    xg = x.cuda().requires_grad_(True)
    permuted, m_splits, row_id_map = permute(xg, experts.cuda(), num_experts, probs=probs.cuda(),
                                             backend=backend, **options)
    yg, wg = y.cuda().requires_grad_(True), weights.cuda().requires_grad_(True)
    out = unpermute(yg, row_id_map, wg, backend=backend)
    out.backward(dout.cuda())
    permuted.backward(y.cuda())
    torch.cuda.synchronize()

    tol = 1e-5 if dtype == torch.float32 else 2e-2
    kept = ref_perm.shape[0] if options.get("pad_to_capacity") else int(ref_splits.sum())
    failures = []
    for name, ok in (
        ("row_id_map", torch.equal(row_id_map.cpu(), ref_map)),
        ("m_splits", torch.equal(m_splits.cpu(), ref_splits)),
        ("permuted", torch.equal(permuted[:kept].detach().cpu(), ref_perm[:kept])),
        ("unpermute", torch.allclose(out.detach().cpu().float(), ref_out.detach().float(), atol=tol, rtol=tol)),
        ("d permuted rows", torch.allclose(yg.grad.cpu().float(), yr.grad.float(), atol=tol, rtol=tol)),
        ("d weights", torch.allclose(wg.grad.cpu(), wr.grad, atol=10 * tol, rtol=tol)),
        ("d tokens", torch.allclose(xg.grad.cpu().float(), xr.grad.float(), atol=tol, rtol=tol)),
    ):
        if not ok:
            failures.append(f"{name} differs: {case}")
    return failures


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    backends = ["torch"]
    reason = cuda_unavailable_reason(torch.device("cuda"))
    if reason:
        print(f"cuda backend unavailable ({reason}); checking only the torch backend", file=sys.stderr)
        return_code_if_ok = 3  # not a pass: the point is the cuda kernels
    else:
        backends.append("cuda")
        return_code_if_ok = 0
    failures, cases = [], 0
    for backend in backends:
        for shape_index, (tokens, top_k, num_experts) in enumerate(SHAPES):
            for index_dtype in (torch.int64, torch.int32):
                for dtype in (torch.float32, torch.bfloat16):
                    for option_index, options in enumerate(OPTIONS):
                        seed = 1000 * shape_index + 10 * option_index + (index_dtype == torch.int32)
                        failures += check(backend, tokens, top_k, num_experts, index_dtype, dtype, options, seed)
                        cases += 1
    for failure in failures:
        print("FAIL", failure)
    print(f"{cases} cases on {backends}, {len(failures)} failures")
    return 1 if failures else return_code_if_ok


if __name__ == "__main__":
    sys.exit(main())
