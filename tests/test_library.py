"""The torch.library registration: fake implementations, opcheck, gradcheck."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import moe_grouped  # noqa: F401  (registers torch.ops.moe_grouped)
from moe_grouped import gemm


def problem(dtype=torch.float32, num_experts=3, total=12, k=8, n=4, layout="grouped", device="cpu"):
    x = torch.randn(total, k, dtype=dtype, device=device)
    w = torch.randn(num_experts, n, k, dtype=dtype, device=device)
    weights = [w] if layout == "grouped" else list(w.unbind(0))
    return x, weights, torch.tensor([5, 0, total - 5], device=device)


def test_meta_tensors_get_shapes():
    x = torch.empty(12, 8, device="meta")
    w = [torch.empty(3, 4, 8, device="meta")]
    splits = torch.empty(3, dtype=torch.int64, device="meta")
    y = torch.ops.moe_grouped.grouped_fprop(x, w, splits, None, torch.float32, "torch", True)
    assert y.shape == (12, 4) and y.device.type == "meta"
    dx = torch.ops.moe_grouped.grouped_dgrad(torch.empty(12, 4, device="meta"), w, splits, torch.float32, "torch", True)
    assert dx.shape == (12, 8)
    db = torch.ops.moe_grouped.grouped_dbias(torch.empty(12, 4, device="meta"), splits, 3, torch.float32, "torch")
    assert db.shape == (3, 4)
    offsets = torch.ops.moe_grouped.splits_to_offsets(splits, 12, "torch")
    assert offsets.shape == (4,) and offsets.dtype == torch.int64


def test_fake_tensor_mode_shapes():
    with FakeTensorMode():
        x = torch.empty(20, 16, dtype=torch.bfloat16)
        w = [torch.empty(16, 16, dtype=torch.bfloat16) for _ in range(4)]
        splits = torch.empty(4, dtype=torch.int32)
        y = torch.ops.moe_grouped.grouped_fprop(x, w, splits, None, torch.float32, "torch", True)
        assert y.shape == (20, 16) and y.dtype == torch.float32


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("layout", ["grouped", "separate"])
def test_opcheck(backend, layout):
    x, weights, splits = problem(layout=layout)
    bias = torch.randn(3, 4)
    torch.library.opcheck(torch.ops.moe_grouped.grouped_fprop, (x, weights, splits, bias, torch.float32, backend, True))
    dy = torch.randn(12, 4)
    torch.library.opcheck(torch.ops.moe_grouped.grouped_dgrad, (dy, weights, splits, torch.float32, backend, True))
    out = [torch.zeros(3, 4, 8)] if layout == "grouped" else [torch.zeros(4, 8) for _ in range(3)]
    torch.library.opcheck(torch.ops.moe_grouped.grouped_wgrad_, (dy, x, splits, out, True, backend))
    torch.library.opcheck(torch.ops.moe_grouped.grouped_dbias, (dy, splits, 3, torch.float32, backend))
    torch.library.opcheck(torch.ops.moe_grouped.splits_to_offsets, (splits, 12, backend))


# float64 gradcheck needs a float64 backend: the torch backend's grads are
# checked against the oracle in test_grouped_linear.py instead.
@pytest.mark.parametrize("backend", ["reference"])
@pytest.mark.parametrize("layout", ["grouped", "separate"])
def test_gradcheck_functional_fprop(backend, layout):
    x, weights, splits = problem(torch.float64, layout=layout)
    bias = torch.randn(3, 4, dtype=torch.float64)
    inputs = [x, *weights, bias]
    for t in inputs:
        t.requires_grad_(True)
    count = len(weights)

    def f(x, *rest):
        return gemm.grouped_fprop(x, list(rest[:count]), splits, rest[count], backend=backend)

    assert torch.autograd.gradcheck(f, tuple(inputs))


@pytest.mark.parametrize("backend", ["reference"])
@pytest.mark.parametrize("single_grouped_weight", [True, False])
def test_gradcheck_grouped_linear(backend, single_grouped_weight):
    layer = moe_grouped.GroupedLinear(
        3, 6, 5, single_grouped_weight=single_grouped_weight, dtype=torch.float64, backend=backend
    )
    splits = torch.tensor([4, 0, 3])
    names = [name for name, _ in layer.named_parameters()]
    x = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)

    def f(x, *params):
        return torch.func.functional_call(layer, dict(zip(names, params)), (x, splits))

    params = tuple(p.detach().clone().requires_grad_(True) for p in layer.parameters())
    assert torch.autograd.gradcheck(f, (x, *params))


def test_compile_sees_shapes():
    x, weights, splits = problem()

    @torch.compile(backend="eager", fullgraph=True)
    def f(x, w, s):
        return torch.ops.moe_grouped.grouped_fprop(x, w, s, None, torch.float32, "torch", True) * 2

    torch.testing.assert_close(f(x, weights, splits), 2 * gemm.grouped_fprop(x, weights, splits, backend="torch"))


def test_backend_without_float64_says_so():
    x, weights, splits = problem(torch.float64)
    with pytest.raises(TypeError, match="backend 'torch' supports dtypes"):
        gemm.grouped_fprop(x, weights, splits, backend="torch")
