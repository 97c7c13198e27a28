"""moe_grouped.swiglu: the composed ops on every backend, the core's fused kernels on Hopper."""

import pytest
import torch
from torch.nn.functional import silu

import moe_grouped
from moe_grouped import _core
from moe_grouped.activation import resolve_backend, swiglu

from cases import capture_after_a_step, skip_without_cuda_kernels


def composed(h):
    gate, up = h.chunk(2, dim=-1)
    return silu(gate) * up


def test_reference_is_silu_gate_times_up():
    torch.manual_seed(0)
    h = torch.randn(5, 3, 8, dtype=torch.float64)
    out = swiglu(h, backend="reference")
    gate, up = h[..., :4], h[..., 4:]
    assert out.shape == (5, 3, 4)
    assert torch.allclose(out, gate / (1 + torch.exp(-gate)) * up)


def test_reference_gradient_matches_the_formula():
    torch.manual_seed(1)
    h = torch.randn(6, 10, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(6, 5, dtype=torch.float64)
    swiglu(h, backend="reference").backward(dy)
    gate, up = h.detach()[:, :5], h.detach()[:, 5:]
    s = torch.sigmoid(gate)
    assert torch.allclose(h.grad[:, :5], dy * up * s * (1 + gate * (1 - s)))
    assert torch.allclose(h.grad[:, 5:], dy * gate * s)


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (torch.randn(4, 7), ValueError, "even last dimension"),
        (torch.tensor(1.0), ValueError, "even last dimension"),
        (torch.ones(4, 8, dtype=torch.int32), TypeError, "floating-point"),
        ([1.0, 2.0], TypeError, "torch.Tensor"),
    ],
    ids=["odd", "scalar", "int", "list"],
)
def test_bad_input_is_refused(bad, error, match):
    with pytest.raises(error, match=match):
        swiglu(bad)


def test_cuda_backend_on_cpu_tensors_is_refused():
    with pytest.raises(RuntimeError, match="cuda backend needs CUDA tensors"):
        swiglu(torch.randn(2, 4), backend="cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        swiglu(torch.randn(2, 4), backend="triton")


def test_default_backend_on_cpu_is_reference():
    assert resolve_backend(None, torch.device("cpu")) == "reference"


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rows, ffn): 16-byte packs, odd widths (element path), one row, many rows.
SHAPES = [(1, 8), (7, 3), (33, 100), (1000, 1408), (4096, 2048), (3, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, ffn", SHAPES)
def test_cuda_equals_the_composed_ops(dtype, rows, ffn):
    skip_without_cuda_kernels(_core.CAP_SWIGLU, "SwiGLU kernels")
    torch.manual_seed(rows * 31 + ffn)
    h = (torch.randn(rows, 2 * ffn, device="cuda") * 3).to(dtype)
    dy = torch.randn(rows, ffn, device="cuda").to(dtype)
    hc = h.clone().requires_grad_(True)
    out = swiglu(hc, backend="cuda")
    out.backward(dy)
    ht = h.clone().requires_grad_(True)
    expected = composed(ht)
    expected.backward(dy)
    assert out.dtype == dtype and out.shape == (rows, ffn)
    # Same roundings as torch's silu, mul and their backward: equal values.
    assert torch.equal(out, expected)
    assert torch.equal(hc.grad, ht.grad)


@pytest.mark.gpu
def test_cuda_handles_views_leading_dims_and_unaligned_storage():
    skip_without_cuda_kernels(_core.CAP_SWIGLU, "SwiGLU kernels")
    torch.manual_seed(2)
    base = torch.randn(2, 9, 2 * 64 + 1, device="cuda", dtype=torch.bfloat16)
    for h in (base[..., 1:], base[:, ::2, :128], base.reshape(-1)[1 : 1 + 6 * 128].view(6, 128)):
        hc = h.detach().requires_grad_(True)  # keeps the view's strides and storage offset
        out = swiglu(hc, backend="cuda")
        ht = h.detach().clone().requires_grad_(True)
        expected = composed(ht)
        assert torch.equal(out, expected)
        dy = torch.randn_like(expected)
        out.backward(dy)
        expected.backward(dy)
        assert torch.equal(hc.grad, ht.grad)


@pytest.mark.gpu
def test_cuda_refuses_float64():
    skip_without_cuda_kernels(_core.CAP_SWIGLU, "SwiGLU kernels")
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        swiglu(torch.randn(2, 4, device="cuda", dtype=torch.float64), backend="cuda")


@pytest.mark.gpu
def test_cuda_empty_input():
    skip_without_cuda_kernels(_core.CAP_SWIGLU, "SwiGLU kernels")
    h = torch.empty(0, 16, device="cuda", requires_grad=True)
    out = swiglu(h, backend="cuda")
    assert out.shape == (0, 8)
    out.sum().backward()
    assert h.grad.shape == (0, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(0,), (2, 0), (0, 3, 0)], ids=str)
def test_cuda_zero_width_input(shape):
    """Found by the GPU fuzz: a last dimension of 0 made the kernel's [-1, 0] view ambiguous."""
    skip_without_cuda_kernels(_core.CAP_SWIGLU, "SwiGLU kernels")
    h = torch.empty(shape, device="cuda", requires_grad=True)
    out = swiglu(h, backend="cuda")
    assert out.shape == shape
    out.sum().backward()
    assert h.grad.shape == shape


@pytest.mark.gpu
def test_cuda_replays_in_a_graph_with_new_inputs():
    skip_without_cuda_kernels(_core.CAP_SWIGLU, "SwiGLU kernels")
    static_h = torch.randn(256, 2 * 96, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    static_dy = torch.randn(256, 96, device="cuda", dtype=torch.bfloat16)

    def step():
        static_h.grad = None
        out = swiglu(static_h, backend="cuda")
        out.backward(static_dy)
        return out, static_h.grad

    graph, (static_out, static_grad) = capture_after_a_step(step)
    for seed in range(5):
        torch.manual_seed(seed)
        h = torch.randn_like(static_h)
        dy = torch.randn_like(static_dy)
        with torch.no_grad():
            static_h.copy_(h)
        static_dy.copy_(dy)
        graph.replay()
        hr = h.detach().clone().requires_grad_(True)
        expected = composed(hr)
        expected.backward(dy)
        assert torch.equal(static_out, expected), seed
        assert torch.equal(static_grad, hr.grad), seed


@pytest.mark.gpu
def test_grouped_mlp_uses_its_backend_for_swiglu():
    skip_without_cuda_kernels(_core.CAP_SWIGLU, "SwiGLU kernels")
    torch.manual_seed(3)
    mlps = [
        moe_grouped.GroupedMLP(4, 64, 96, single_grouped_weight=True, dtype=torch.bfloat16, device="cuda",
                               backend=backend)
        for backend in ("torch", "cuda")
    ]
    mlps[1].load_state_dict(mlps[0].state_dict())
    x = torch.randn(40, 64, device="cuda", dtype=torch.bfloat16)
    splits = torch.tensor([10, 0, 25, 5], device="cuda")
    outs = []
    for mlp in mlps:
        xg = x.clone().requires_grad_(True)
        out = mlp(xg, splits)
        out.float().square().sum().backward()
        outs.append((out, xg.grad, mlp.fc1.weight.grad))
    for a, b in zip(*outs):
        assert torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)
