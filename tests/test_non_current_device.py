"""Layers whose tensors live on a GPU other than the current one run there, as torch's own ops do.

A model moved to ``cuda:1`` is called while ``cuda:0`` is current (pipeline
stages, several models in one process). Every core call must launch on the
device of the tensors it is given; these tests compare each step bitwise with
the same step run with ``cuda:1`` current, and check that the caller's
current device is left as it was. They need two GPUs.
"""

import pytest
import torch

from moe_grouped import MoELayer, fp8, permute, swiglu, unpermute

from cases import make_splits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

T, H, F, E, K = 192, 256, 128, 8, 2
OTHER = torch.device("cuda", 1)


def _step(layer, x, dout, fp8_recipe=None):
    """(output, input gradient, parameter gradients) of one forward + backward."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    if fp8_recipe is None:
        out = layer(x)
    else:
        with fp8.fp8_autocast(fp8_recipe):
            out = layer(x, is_first_microbatch=True)
    out.backward(dout)
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]


def _on_other_device_while_cuda0_is_current(fn):
    torch.cuda.set_device(0)
    got = fn()
    torch.cuda.synchronize(OTHER)
    assert torch.cuda.current_device() == 0, "a core call left another device current"
    with torch.cuda.device(OTHER):
        expected = fn()
    return got, expected


@pytest.mark.parametrize("experts_path", ["fused", "unfused"])
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
@pytest.mark.parametrize("fp8_recipe", [None, fp8.Float8BlockScaling()], ids=["bf16", "fp8"])
def test_gpu_layer_on_a_non_current_device_matches_it_run_current(experts_path, capacity_factor, fp8_recipe):
    torch.manual_seed(0)
    layer = MoELayer(H, F, E, K, capacity_factor=capacity_factor, aux_loss_coeff=1e-2, z_loss_coeff=1e-3,
                     dtype=torch.bfloat16, device=OTHER, backend="cuda", experts_path=experts_path)
    x = torch.randn(T, H, device=OTHER, dtype=torch.bfloat16)
    dout = torch.randn(T, H, device=OTHER, dtype=torch.bfloat16)
    got, expected = _on_other_device_while_cuda0_is_current(lambda: _step(layer, x, dout, fp8_recipe))
    for a, b in zip(got, expected):
        assert a.device == OTHER
        assert torch.equal(a, b)


def test_gpu_permute_and_swiglu_ops_on_a_non_current_device():
    torch.manual_seed(0)
    x = torch.randn(T, H, device=OTHER, dtype=torch.bfloat16)
    experts = torch.stack([torch.randperm(E, device=OTHER)[:K] for _ in range(T)])
    weights = torch.rand(T, K, device=OTHER)
    h = torch.randn(T * K, 2 * F, device=OTHER, dtype=torch.bfloat16)

    def ops():
        permuted, splits, row_id_map = permute(x, experts, E, backend="cuda")
        combined = unpermute(permuted, row_id_map, weights, backend="cuda")
        return [permuted, splits, row_id_map, combined, swiglu(h, backend="cuda")]

    got, expected = _on_other_device_while_cuda0_is_current(ops)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_gpu_layer_on_a_non_current_device_captures_and_replays_like_eager():
    from graphs import testing
    from test_experts_path import SplitRoutedMoE

    torch.cuda.set_device(0)
    torch.manual_seed(9)
    with torch.cuda.device(OTHER):  # the module builds its tensors on the current device
        module = SplitRoutedMoE(tokens=256, hidden=256, ffn=128, num_experts=16, top_k=4)
    splits = torch.tensor(make_splits("balanced", 16, 256 * 4), device=OTHER)
    x = torch.randn(256, 256, dtype=torch.bfloat16, device=OTHER, requires_grad=True)
    report = testing.check_replay(module, (x, splits), num_replays=50, captures=1, exact=True)
    assert len(report.patterns) > 1, report
    assert torch.cuda.current_device() == 0
