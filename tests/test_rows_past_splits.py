"""Rows past a short device ``m_splits``: zeros in every output and input gradient, on every backend.

A device ``m_splits`` may sum to fewer than the rows M (a buffer sized for a
worst case). The rows at or past the sum belong to no expert: ``grouped_fprop``
and ``grouped_dgrad`` (so ``GroupedLinear``'s output and its input gradient)
are zero there, and the weight and bias gradients ignore them. The inputs'
tail rows hold NaN here, so a kernel that read them would show it.
"""

import pytest
import torch

from moe_grouped import GroupedLinear, gemm

from cases import assert_captured_safely, needs_cuda_kernels, skip_without_cuda_kernels

E, K, N = 3, 32, 16
SPLITS = [5, 0, 6]  # 11 of M = 16 rows
M = 16


def cpu_and_gpu_cases():
    """(backend, device, dtype): the CPU backends here, the graph-safe ones on the GPU."""
    gpu = [pytest.mark.gpu]
    return [
        pytest.param("reference", "cpu", torch.float32, id="reference-cpu"),
        pytest.param("torch", "cpu", torch.float32, id="torch-cpu"),
        pytest.param("torch", "cuda", torch.bfloat16, marks=gpu, id="torch-cuda"),
        pytest.param("cuda", "cuda", torch.bfloat16, marks=[*gpu, needs_cuda_kernels()], id="cuda"),
    ]


def with_nan_tail(shape, end, device, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=gen)
    t[end:] = float("nan")
    return t.to(device=device, dtype=dtype)


@pytest.mark.parametrize("backend, device, dtype", cpu_and_gpu_cases())
def test_grouped_ops_give_zero_rows_past_the_splits(backend, device, dtype):
    end = sum(SPLITS)
    splits = torch.tensor(SPLITS, device=device)
    x = with_nan_tail((M, K), end, device, dtype, seed=0)
    dy = with_nan_tail((M, N), end, device, dtype, seed=1)
    w = [torch.randn(E, N, K, generator=torch.Generator().manual_seed(2)).to(device=device, dtype=dtype)]
    bias = torch.randn(E, N, generator=torch.Generator().manual_seed(3)).to(device=device, dtype=dtype)
    case = f"{backend=}, {device=}, {dtype=}"

    y = gemm.grouped_fprop(x, w, splits, bias, backend=backend)
    assert torch.equal(y[end:], torch.zeros_like(y[end:])), case
    torch.testing.assert_close(y[:end], gemm.grouped_fprop(x[:end], w, splits, bias, backend=backend), msg=case)

    dx = gemm.grouped_dgrad(dy, w, splits, backend=backend)
    assert torch.equal(dx[end:], torch.zeros_like(dx[end:])), case
    torch.testing.assert_close(dx[:end], gemm.grouped_dgrad(dy[:end], w, splits, backend=backend), msg=case)

    dw = gemm.grouped_wgrad(dy, x, splits, num_groups=E, backend=backend)[0]
    torch.testing.assert_close(dw, gemm.grouped_wgrad(dy[:end], x[:end], splits, num_groups=E, backend=backend)[0],
                               msg=case)
    db = gemm.grouped_dbias(dy, splits, backend=backend)
    torch.testing.assert_close(db, gemm.grouped_dbias(dy[:end], splits, backend=backend), msg=case)


@pytest.mark.parametrize("backend, device, dtype", cpu_and_gpu_cases())
@pytest.mark.parametrize("single_grouped_weight", [True, False], ids=["grouped", "separate"])
def test_grouped_linear_gives_zero_rows_and_gradients_past_the_splits(backend, device, dtype, single_grouped_weight):
    end = sum(SPLITS)
    torch.manual_seed(0)
    layer = GroupedLinear(E, K, N, single_grouped_weight=single_grouped_weight, dtype=dtype, device=device,
                          backend=backend)
    x = with_nan_tail((M, K), end, device, dtype, seed=0).requires_grad_(True)
    dy = with_nan_tail((M, N), end, device, dtype, seed=1)
    y = layer(x, torch.tensor(SPLITS, device=device))
    y.backward(dy)
    grads = [p.grad.clone() for p in layer.parameters()]
    case = f"{backend=}, {device=}, {single_grouped_weight=}"
    assert torch.equal(y[end:], torch.zeros_like(y[end:])), case
    assert torch.equal(x.grad[end:], torch.zeros_like(x.grad[end:])), case

    # The same layer on the covered rows alone.
    layer.zero_grad(set_to_none=True)
    x_head = x.detach()[:end].clone().requires_grad_(True)
    y_head = layer(x_head, torch.tensor(SPLITS, device=device))
    y_head.backward(dy[:end])
    torch.testing.assert_close(y.detach()[:end], y_head.detach(), msg=case)
    torch.testing.assert_close(x.grad[:end], x_head.grad, msg=case)
    for got, want in zip(grads, (p.grad for p in layer.parameters())):
        torch.testing.assert_close(got, want, msg=case)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "cuda"])
def test_captured_layer_zeros_the_rows_past_new_splits(backend):
    """Replayed with a new split whose sum moves, the rows past it are zero again: no host read, no
    host node or allocation in the graph."""
    if backend == "cuda":
        skip_without_cuda_kernels()
    torch.manual_seed(0)
    layer = GroupedLinear(E, K, N, dtype=torch.bfloat16, device="cuda", backend=backend)
    x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dy = torch.randn(M, N, dtype=torch.bfloat16, device="cuda")
    splits = torch.tensor(SPLITS, device="cuda")

    def step():
        x.grad = None
        y = layer(x, splits)
        y.backward(dy)
        return y.detach(), x.grad

    stream = torch.cuda.Stream()  # one eager step first (workspaces, pointer arrays), then capture
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph(keep_graph=True)  # kept for the inspection
    with torch.cuda.graph(graph):
        y, dx = step()
    graph.instantiate()
    assert_captured_safely(graph)
    for new in ([2, 3, 1], [0, 16, 0], [0, 0, 0], [4, 4, 4]):
        splits.copy_(torch.tensor(new))
        y.fill_(float("nan"))
        dx.fill_(float("nan"))
        graph.replay()
        end = sum(new)
        assert torch.equal(y[end:], torch.zeros_like(y[end:])), new
        assert torch.equal(dx[end:], torch.zeros_like(dx[end:])), new
        assert not y[:end].isnan().any() and not dx[:end].isnan().any(), new
