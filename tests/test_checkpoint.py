"""Activation checkpointing (``torch.utils.checkpoint``, non-reentrant) around MoELayer.

Backward recomputes the layer's forward (routing, permutation, experts) from
its input; the gradients must be eager's. On the GPU, a checkpointed
training step captured with :func:`moe_grouped.graphs.capture_step` must
replay new inputs (new routing) like the eager layer.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from cases import calc_diff
from moe_grouped import MoELayer, backends, graphs

CASES = {
    "plain": {},
    "aux-shared": {"aux_loss_coeff": 1e-2, "z_loss_coeff": 1e-3, "shared_expert_ffn_hidden": 16},
    "capacity-probs": {"capacity_factor": 0.75, "drop_policy": "probs"},
    "capacity-padded": {"capacity_factor": 1.0, "drop_policy": "position", "pad_to_capacity": True},
    "grouped-bias": {"single_grouped_weight": True, "bias": True},
    "main_grad": {"fuse_wgrad_accumulation": True},
}


def _grads(layer: MoELayer, x: torch.Tensor) -> list[torch.Tensor]:
    grads = [x.grad]
    for param in layer.parameters():
        main_grad = getattr(param, "main_grad", None)
        grads.append(main_grad.clone() if isinstance(main_grad, torch.Tensor) else param.grad)
    return grads


def _step(layer: MoELayer, x: torch.Tensor, dout: torch.Tensor, use_checkpoint: bool):
    x = x.detach().clone().requires_grad_(True)
    out = checkpoint(layer, x, use_reentrant=False) if use_checkpoint else layer(x)
    out.backward(dout)
    return out.detach(), _grads(layer, x)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("case", list(CASES))
def test_checkpointed_layer_gives_eager_gradients(backend, case):
    torch.manual_seed(0)
    layer = MoELayer(16, 32, 4, 2, backend=backend, **CASES[case])
    twin = copy.deepcopy(layer)
    for module in (layer, twin):
        if CASES[case].get("fuse_wgrad_accumulation"):
            for weight in module.experts.fc1.weights() + module.experts.fc2.weights():
                weight.main_grad = torch.zeros_like(weight)
    x, dout = torch.randn(2, 10, 16), torch.randn(2, 10, 16)
    want_out, want = _step(layer, x, dout, use_checkpoint=False)
    got_out, got = _step(twin, x, dout, use_checkpoint=True)
    torch.testing.assert_close(got_out, want_out, atol=0, rtol=0)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), f"{case}: gradient {i}"
        if w is not None:
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6, msg=lambda m: f"{case}: gradient {i}: {m}")


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpoint_recompute_does_not_count_tokens_twice(use_reentrant):
    """The expert-bias load counter sees each token once although backward re-runs the router."""
    torch.manual_seed(0)
    options = {"score_function": "sigmoid", "expert_bias": True}
    layer = MoELayer(16, 32, 4, 2, backend="reference", router_options=options)
    twin = copy.deepcopy(layer)
    x, dout = torch.randn(2, 10, 16), torch.randn(2, 10, 16)
    layer(x).backward(dout)
    xc = x.clone().requires_grad_(True)
    checkpoint(twin, xc, use_reentrant=use_reentrant).backward(dout)
    counted = twin.router.tokens_since_update
    assert int(counted.sum()) == 2 * 10 * 2  # tokens x top_k, once
    assert torch.equal(counted, layer.router.tokens_since_update)


@pytest.mark.gpu
@pytest.mark.parametrize("single_grouped_weight", [True, False], ids=["grouped", "separate"])
@pytest.mark.parametrize("case", ["plain", "aux-shared", "capacity-probs"])
def test_gpu_checkpointed_step_captured_replays_new_inputs_like_eager(case, single_grouped_weight):
    tokens, hidden, ffn, num_experts, top_k = 256, 64, 128, 8, 2
    options = {**CASES[case], "single_grouped_weight": single_grouped_weight}
    for backend in [b for b in backends.available_backends(torch.device("cuda")) if b != "reference"]:
        torch.manual_seed(7)
        layer = MoELayer(hidden, ffn, num_experts, top_k, dtype=torch.bfloat16, device="cuda", backend=backend,
                         **options)
        eager_layer = copy.deepcopy(layer)
        params = list(layer.parameters())
        static_x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        static_dout = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")

        def step(x, dout):
            for tensor in [x, *params]:
                tensor.grad = None
            # The layer draws no random numbers: no RNG state to save and restore inside the capture.
            out = checkpoint(layer, x, use_reentrant=False, preserve_rng_state=False)
            out.backward(dout)
            return out.detach(), x.grad, *[p.grad for p in params]

        captured = graphs.capture_step(step, static_x, static_dout)
        seen_counts = set()
        for replay in range(8):
            x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda") * (1 + replay)
            dout = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
            got_out, *got_grads = [t.clone() for t in captured(x, dout)]
            seen_counts.add(tuple(layer.last_routing.tokens_per_expert.tolist()))
            want_out, want_grads = _step(eager_layer, x, dout, use_checkpoint=False)
            for param in eager_layer.parameters():
                param.grad = None
            label = f"{backend=} {case=} {single_grouped_weight=} {replay=}"
            assert calc_diff(got_out, want_out) < 1e-6, label
            assert len(got_grads) == len(want_grads), label
            for i, (g, w) in enumerate(zip(got_grads, want_grads)):
                assert calc_diff(g, w) < 1e-6, f"gradient {i}: {label}"
        assert len(seen_counts) > 1, f"{backend=}: the routing never changed between replays"
