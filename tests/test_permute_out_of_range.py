"""Expert indices outside [0, E): ValueError where read on the host, a dropped copy elsewhere.

The oracle for "dropped" is the same routing with those copies removed: the
reference backend's index pass skips them (its permute() entry refuses them),
so calling its ops directly gives the expected (row_id_map, m_splits) and rows.
"""

import pytest
import torch

import moe_grouped
from moe_grouped import _core, permute, unpermute
from moe_grouped.permute import expert_capacity, permuted_rows

from cases import skip_without_cuda_kernels

E = 4
EXPERTS = [[0, 1], [2, 9], [3, -1], [1, 1], [0, 3], [-7, 4]]  # 9, -1, -7 and 4 are outside [0, 4)
BAD_COPIES = [3, 5, 10, 11]  # t * top_k + j of the bad ones


def experts_tensor(device="cpu", dtype=torch.int64):
    return torch.tensor(EXPERTS, dtype=dtype, device=device)


def expected(x, experts, num_experts, probs=None, capacity_factor=None, drop_policy="probs", pad=False):
    """(permuted, m_splits, row_id_map) with the out-of-range copies removed (the reference ops)."""
    tokens, top_k = experts.shape
    capacity = None if capacity_factor is None else expert_capacity(tokens, top_k, num_experts, capacity_factor)
    priority = probs.float() if capacity is not None and drop_policy == "probs" else None
    row_id_map, m_splits = torch.ops.moe_grouped.permute_index(
        experts, priority, num_experts, -1 if capacity is None else capacity, pad, "reference"
    )
    rows = permuted_rows(tokens, top_k, num_experts, capacity, pad)
    permuted = torch.ops.moe_grouped.permute_rows(x, row_id_map, top_k, rows, True, "reference")
    return permuted, m_splits, row_id_map


OPTIONS = [
    {},
    {"capacity_factor": 1.0, "drop_policy": "position"},
    {"capacity_factor": 1.0, "drop_policy": "probs"},
    {"capacity_factor": 0.5, "drop_policy": "position", "pad": True},
    {"capacity_factor": 2.0, "drop_policy": "probs", "pad": True},
]


def run_permute(x, experts, backend, probs, options):
    kwargs = dict(options)
    pad = kwargs.pop("pad", False)
    return permute(x, experts, E, probs=probs, pad_to_capacity=pad, backend=backend, **kwargs)


def check_drops(backend, device, dtype=torch.float32, index_dtype=torch.int64):
    """The backend's permute/unpermute, forward and backward, equal the oracle for every option."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(len(EXPERTS), 8, generator=gen).to(device=device, dtype=dtype)
    experts = experts_tensor(device, index_dtype)
    probs = torch.rand(len(EXPERTS), 2, generator=gen).to(device)
    weights = torch.rand(len(EXPERTS), 2, generator=gen).to(device)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for options in OPTIONS:
        case = f"{backend=} {options=} {index_dtype=}"
        ref_perm, ref_splits, ref_map = expected(x, experts, E, probs, **options)
        xg = x.clone().requires_grad_(True)
        permuted, m_splits, row_id_map = run_permute(xg, experts, backend, probs, options)
        assert torch.equal(row_id_map.cpu(), ref_map.cpu()), case
        assert torch.equal(m_splits.cpu(), ref_splits.cpu()), case
        assert all(row_id_map[c] == -1 for c in BAD_COPIES), case
        # Rows past sum(m_splits) belong to no expert (the cuda backend leaves them unzeroed dropless).
        kept_rows = ref_perm.shape[0] if options.get("pad") else int(ref_splits.sum())
        assert torch.equal(permuted[:kept_rows], ref_perm[:kept_rows]), case
        y = torch.randn(permuted.shape, generator=gen).to(device=device, dtype=dtype)
        yg, wg = y.clone().requires_grad_(True), weights.clone().requires_grad_(True)
        out = unpermute(yg, row_id_map, wg, backend=backend)
        yr, wr = y.clone().requires_grad_(True), weights.clone().requires_grad_(True)
        ref_out = torch.ops.moe_grouped.unpermute_rows(yr, ref_map, wr, 2, "reference")
        assert torch.allclose(out.float(), ref_out.float(), atol=tol, rtol=tol), case
        dout = torch.randn(out.shape, generator=gen).to(device=device, dtype=dtype)
        out.backward(dout)
        ref_out.backward(dout)
        assert torch.allclose(yg.grad.float(), yr.grad.float(), atol=tol, rtol=tol), case
        assert torch.allclose(wg.grad, wr.grad, atol=tol * 10, rtol=tol), case
        assert all(wg.grad.view(-1)[c] == 0 for c in BAD_COPIES), case
        permuted.backward(y)
        xr = x.clone().requires_grad_(True)
        torch.ops.moe_grouped.permute_rows(xr, ref_map, 2, ref_perm.shape[0], True, "reference").backward(y)
        assert torch.allclose(xg.grad.float(), xr.grad.float(), atol=tol, rtol=tol), case


def test_reference_backend_names_the_bad_index_and_its_token():
    x = torch.randn(len(EXPERTS), 8)
    with pytest.raises(ValueError, match=r"experts\[1, 1\] = 9 is outside \[0, 4\)"):
        permute(x, experts_tensor(), E, backend="reference")
    with pytest.raises(ValueError, match=r"experts\[0, 0\] = -3 is outside \[0, 4\)"):
        permute(x[:1], torch.tensor([[-3, 0]]), E, backend="reference")
    with pytest.raises(ValueError, match=r"experts\[0, 1\] = 4 is outside \[0, 4\)"):
        permute(x[:1], torch.tensor([[0, 4]], dtype=torch.int32), E, backend="reference",
                capacity_factor=1.0, drop_policy="position")


def test_debug_checks_refuse_them_on_the_torch_backend_too():
    moe_grouped.set_debug_checks(True)
    try:
        with pytest.raises(ValueError, match=r"experts\[1, 1\] = 9 is outside \[0, 4\)"):
            permute(torch.randn(len(EXPERTS), 8), experts_tensor(), E, backend="torch")
    finally:
        moe_grouped.set_debug_checks(False)


def test_the_oracle_is_the_routing_with_those_copies_removed():
    # Independent of the reference ops: send the bad copies to an extra expert E,
    # which sorts last, and cut it off.
    x = torch.randn(len(EXPERTS), 8)
    experts = experts_tensor()
    redirected = torch.where((experts >= 0) & (experts < E), experts, E)
    full_perm, full_splits, full_map = permute(x, redirected, E + 1, backend="reference")
    ref_perm, ref_splits, ref_map = expected(x, experts, E)
    kept = int(full_splits[:E].sum())
    assert torch.equal(ref_splits, full_splits[:E])
    assert torch.equal(ref_map, torch.where(redirected.view(-1) < E, full_map, -1))
    assert torch.equal(ref_perm[:kept], full_perm[:kept])
    assert torch.equal(ref_perm[kept:], torch.zeros_like(ref_perm[kept:]))


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
def test_torch_backend_drops_them(index_dtype):
    check_drops("torch", "cpu", index_dtype=index_dtype)


def test_torch_backend_zeroes_the_rows_they_leave():
    permuted, m_splits, _ = permute(torch.randn(len(EXPERTS), 8) + 5, experts_tensor(), E, backend="torch")
    assert torch.equal(permuted[int(m_splits.sum()):], torch.zeros(len(BAD_COPIES), 8))


def test_every_copy_out_of_range_gives_zero_splits():
    x = torch.randn(3, 4)
    experts = torch.full((3, 2), 7)
    permuted, m_splits, row_id_map = permute(x, experts, E, backend="torch")
    assert m_splits.tolist() == [0] * E and row_id_map.tolist() == [-1] * 6
    assert torch.equal(unpermute(permuted, row_id_map, torch.ones(3, 2), backend="torch"), torch.zeros(3, 4))


def test_unpermute_refuses_a_row_id_map_past_the_rows_on_the_host():
    y = torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"row_id_map\[1\] = 4 is outside \[-1, 4\)"):
        unpermute(y, torch.tensor([0, 4]), top_k=2, backend="reference")
    with pytest.raises(ValueError, match=r"row_id_map\[0\] = -2 is outside \[-1, 4\)"):
        unpermute(y, torch.tensor([-2, 1]), torch.ones(1, 2), backend="reference")


def test_torch_backend_unpermute_treats_a_bad_row_as_dropped():
    y = torch.randn(4, 3)
    out = unpermute(y, torch.tensor([0, 4, -5, 2]), torch.ones(2, 2), backend="torch")
    assert torch.allclose(out, torch.stack([y[0], y[2]]))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
def test_gpu_backends_drop_them(backend, dtype, index_dtype):
    if backend == "cuda":
        skip_without_cuda_kernels(_core.CAP_PERMUTE, "permute kernels")
    check_drops(backend, "cuda", dtype, index_dtype)


@pytest.mark.gpu
def test_gpu_reference_backend_refuses_them():
    x = torch.randn(len(EXPERTS), 8, device="cuda")
    with pytest.raises(ValueError, match=r"experts\[1, 1\] = 9 is outside \[0, 4\)"):
        permute(x, experts_tensor("cuda"), E, backend="reference")
