"""GroupedLinear under CUDA-graph capture: replay with new m_splits == eager."""

import pytest
import torch

from moe_grouped import GroupedLinear

from cases import SPLIT_PATTERNS, capture_after_a_step, gpu_backends, make_splits

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("single_grouped_weight", [True, False], ids=["grouped", "separate"])
def test_fwd_bwd_capture_replays_new_splits_like_eager(single_grouped_weight):
    num_experts, total, k, n = 8, 512, 128, 256
    for backend in gpu_backends():
        torch.manual_seed(0)
        layer = GroupedLinear(
            num_experts, k, n, single_grouped_weight=single_grouped_weight,
            dtype=torch.bfloat16, device="cuda", backend=backend,
        )
        static_x = torch.randn(total, k, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        static_splits = torch.tensor(make_splits("balanced", num_experts, total), device="cuda")
        static_dy = torch.randn(total, n, dtype=torch.bfloat16, device="cuda")
        params = list(layer.parameters())

        def step():
            for p in [static_x, *params]:
                p.grad = None
            y = layer(static_x, static_splits)
            y.backward(static_dy)
            return y

        graph, static_y = capture_after_a_step(step, steps_before=3)
        grads = [static_x.grad, *[p.grad for p in params]]

        for replay in range(40):
            pattern = SPLIT_PATTERNS[replay % len(SPLIT_PATTERNS)]
            splits = make_splits(pattern, num_experts, total, seed=replay)
            x = torch.randn(total, k, dtype=torch.bfloat16, device="cuda")
            dy = torch.randn(total, n, dtype=torch.bfloat16, device="cuda")
            static_splits.copy_(torch.tensor(splits))
            with torch.no_grad():
                static_x.copy_(x)
            static_dy.copy_(dy)
            graph.replay()

            x_eager = x.clone().requires_grad_(True)
            for p in params:
                p.grad = None
            y_eager = layer(x_eager, torch.tensor(splits, device="cuda"))
            y_eager.backward(dy)
            eager = [x_eager.grad, *[p.grad for p in params]]
            case = f"{backend=} {replay=} {pattern=} {splits=}"
            assert torch.equal(static_y, y_eager), f"forward differs: {case}"
            for i, (g_replay, g_eager) in enumerate(zip(grads, eager)):
                assert torch.equal(g_replay, g_eager), f"grad {i} differs: {case}"


def test_reference_backend_refuses_capture_with_a_pointer_to_graph_safe_backends():
    layer = GroupedLinear(2, 16, 16, device="cuda", backend="reference")
    x = torch.randn(8, 16, device="cuda")
    splits = torch.tensor([4, 4], device="cuda")
    layer(x, splits)
    with pytest.raises(RuntimeError, match="backend='torch' or backend='cuda'"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            layer(x, splits)


def test_host_splits_under_capture_are_refused():
    layer = GroupedLinear(2, 16, 16, device="cuda", backend="torch")
    x = torch.randn(8, 16, device="cuda")
    layer(x, [4, 4])
    with pytest.raises(RuntimeError, match="Pass m_splits as a device tensor"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            layer(x, [4, 4])
