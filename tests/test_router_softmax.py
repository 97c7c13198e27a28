"""The softmax router's kernels (``mg_route_softmax`` and its backward) against the torch composition."""

import pytest
import torch

from moe_grouped import Router, _core, routing

from cases import capture_after_a_step, skip_without_cuda_kernels

ROUTERS = {  # name: Router options that take the kernels, and the weights mode they map to
    "topk_then_softmax": (dict(topk_before_softmax=True), routing.SOFTMAX_CHOSEN),
    "softmax_normalized": (dict(normalize_topk=True), routing.SOFTMAX_CHOSEN),
    "softmax_plain": (dict(normalize_topk=False), routing.SOFTMAX_ALL),
    "softmax_scaled": (dict(normalize_topk=True, scaling_factor=2.5), routing.SOFTMAX_CHOSEN),
    "plain_scaled": (dict(normalize_topk=False, scaling_factor=0.75), routing.SOFTMAX_ALL),
}


def composed(monkeypatch, router, x):
    """The router's torch composition on x (the kernels switched off)."""
    with monkeypatch.context() as patch:
        patch.setattr(routing, "softmax_route_applies", lambda *args: False)
        return router(x)


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_options_map_to_a_weights_mode(monkeypatch, name):
    options, mode = ROUTERS[name]
    router = Router(16, 8, 2, **options)
    monkeypatch.setattr(routing, "softmax_route_applies", lambda *args: True)
    assert router.fused_mode(torch.zeros(1, 16)) == mode


@pytest.mark.parametrize(
    "options", [dict(score_function="sigmoid"), dict(expert_bias=True), dict(n_group=4, topk_group=2)]
)
def test_other_routers_compose_torch_ops(monkeypatch, options):
    router = Router(16, 8, 2, **options)
    monkeypatch.setattr(routing, "softmax_route_applies", lambda *args: True)
    assert router.fused_mode(torch.zeros(1, 16)) is None


def test_kernels_take_bf16_cuda_only():
    x, w = torch.zeros(4, 16, dtype=torch.bfloat16), torch.zeros(8, 16, dtype=torch.bfloat16)
    assert not routing.softmax_route_applies(x, w, 2)  # CPU
    if torch.cuda.is_available() and routing.cuda_backend._CORE_HAS_SOFTMAX:
        x, w = x.cuda(), w.cuda()
        assert routing.softmax_route_applies(x, w, 2)
        assert not routing.softmax_route_applies(x.float(), w.float(), 2)
        assert not routing.softmax_route_applies(x, w, 33)
        assert not routing.softmax_route_applies(x, torch.zeros(1025, 16, dtype=torch.bfloat16, device="cuda"), 2)


def routed_loss(out, gen):
    """A loss that reaches every differentiable output: weights, both losses and the logits."""
    cw = torch.randn(out.weights.shape, device="cuda", generator=gen)
    cl = torch.randn(out.logits.shape, device="cuda", generator=gen)
    return (out.weights * cw).sum() + 0.3 * out.aux_loss + 0.7 * out.z_loss + 1e-3 * (out.logits * cl).sum()


def assert_grads_close(got, want, what):
    scale = want.float().abs().max().clamp_min(1e-6)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-3 * float(scale), msg=what)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(ROUTERS))
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (60, 6), (128, 8), (160, 1), (1024, 32)])
@pytest.mark.parametrize("tokens", [1, 257, 4096])
def test_kernels_match_the_torch_composition(monkeypatch, name, num_experts, top_k, tokens):
    skip_without_cuda_kernels(_core.CAP_PERMUTE, "routing kernels", entry="mg_route_softmax")
    options, mode = ROUTERS[name]
    torch.manual_seed(tokens + num_experts)
    router = Router(256, num_experts, top_k, dtype=torch.bfloat16, device="cuda", **options)
    assert router.fused_mode(torch.zeros(1, 256, dtype=torch.bfloat16, device="cuda")) == mode
    x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
    results = []
    for run in ("kernels", "torch"):
        xr = x.clone().requires_grad_(True)
        router.weight.grad = None
        out = router(xr) if run == "kernels" else composed(monkeypatch, router, xr)
        routed_loss(out, torch.Generator(device="cuda").manual_seed(5)).backward()
        results.append((out, xr.grad, router.weight.grad))
    (got, got_dx, got_dw), (want, want_dx, want_dw) = results
    assert torch.equal(got.experts, want.experts)
    assert torch.equal(got.tokens_per_expert, want.tokens_per_expert)
    assert torch.equal(got.logits, want.logits)
    assert got.weights.dtype == torch.float32
    torch.testing.assert_close(got.weights, want.weights, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(got.z_loss, want.z_loss, rtol=1e-5, atol=0)
    assert_grads_close(got_dx, want_dx, "dx")
    assert_grads_close(got_dw, want_dw, "dW")


@pytest.mark.gpu
@pytest.mark.parametrize("used", ["weights", "aux_loss", "z_loss", "logits"])
def test_each_gradient_alone(monkeypatch, used):
    """Backward with only one output reached: the others' gradients are None in the kernel."""
    skip_without_cuda_kernels(_core.CAP_PERMUTE, "routing kernels", entry="mg_route_softmax")
    router = Router(128, 64, 4, dtype=torch.bfloat16, device="cuda", normalize_topk=False)
    x = torch.randn(1000, 128, device="cuda", dtype=torch.bfloat16)
    grads = []
    for run in ("kernels", "torch"):
        xr = x.clone().requires_grad_(True)
        out = router(xr) if run == "kernels" else composed(monkeypatch, router, xr)
        value = getattr(out, used)
        (value.float().square().sum() if value.dim() else value).backward()
        grads.append(xr.grad)
    assert grads[0].abs().max() > 0
    assert_grads_close(grads[0], grads[1], used)


@pytest.mark.gpu
def test_tied_logits_pick_the_lower_experts_and_split_evenly():
    skip_without_cuda_kernels(_core.CAP_PERMUTE, "routing kernels", entry="mg_route_softmax")
    router = Router(64, 16, 4, dtype=torch.bfloat16, device="cuda", topk_before_softmax=True)
    out = router(torch.zeros(33, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True))
    assert out.experts.tolist() == [[0, 1, 2, 3]] * 33
    assert torch.equal(out.weights, torch.full((33, 4), 0.25, device="cuda"))
    assert out.tokens_per_expert.tolist() == [33] * 4 + [0] * 12
    torch.testing.assert_close(out.aux_loss, torch.tensor(16 * 4 * (0.25 * 1 / 16), device="cuda"))


@pytest.mark.gpu
def test_no_tokens():
    skip_without_cuda_kernels(_core.CAP_PERMUTE, "routing kernels", entry="mg_route_softmax")
    router = Router(64, 16, 4, dtype=torch.bfloat16, device="cuda")
    x = torch.zeros(0, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = router(x)
    assert out.weights.shape == (0, 4) and out.experts.shape == (0, 4)
    assert out.tokens_per_expert.tolist() == [0] * 16
    assert out.aux_loss.item() == 0 and out.z_loss.item() == 0
    (out.aux_loss + out.z_loss + out.weights.sum()).backward()
    assert x.grad.shape == (0, 64) and int(router.weight.grad.count_nonzero()) == 0


@pytest.mark.gpu
def test_deterministic():
    skip_without_cuda_kernels(_core.CAP_PERMUTE, "routing kernels", entry="mg_route_softmax")
    router = Router(512, 128, 8, dtype=torch.bfloat16, device="cuda", topk_before_softmax=True)
    x = torch.randn(16384, 512, device="cuda", dtype=torch.bfloat16)
    runs = []
    for _ in range(2):
        xr = x.clone().requires_grad_(True)
        router.weight.grad = None
        out = router(xr)
        routed_loss(out, torch.Generator(device="cuda").manual_seed(1)).backward()
        runs.append([out.weights, out.aux_loss, out.z_loss, xr.grad, router.weight.grad])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_graph_replays_with_new_tokens_equal_eager():
    skip_without_cuda_kernels(_core.CAP_PERMUTE, "routing kernels", entry="mg_route_softmax")
    router = Router(256, 128, 8, dtype=torch.bfloat16, device="cuda", topk_before_softmax=True)
    static_x = torch.randn(2048, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gen = torch.Generator(device="cuda").manual_seed(3)
    coeffs = torch.randn(2048, 8, device="cuda", generator=gen)

    def step(x):
        router.weight.grad = None
        x.grad = None
        out = router(x)
        ((out.weights * coeffs).sum() + out.aux_loss + out.z_loss).backward()
        return out

    graph, static_out = capture_after_a_step(lambda: step(static_x), steps_before=2)
    static_dx, static_dw = static_x.grad, router.weight.grad
    for seed in range(10):
        x = torch.randn(2048, 256, device="cuda", dtype=torch.bfloat16,
                        generator=torch.Generator(device="cuda").manual_seed(seed))
        with torch.no_grad():
            static_x.copy_(x)
        graph.replay()
        got = [static_out.experts.clone(), static_out.weights.clone(), static_out.aux_loss.clone(),
               static_dx.clone(), static_dw.clone()]
        eager_x = x.clone().requires_grad_(True)
        eager = step(eager_x)
        want = [eager.experts, eager.weights, eager.aux_loss, eager_x.grad, router.weight.grad]
        for a, b in zip(got, want):
            assert torch.equal(a, b), seed


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [routing.SOFTMAX_CHOSEN, routing.SOFTMAX_ALL])
def test_backward_fp32_output_is_what_the_bf16_halves_round(mode):
    """out_dtype fp32 writes d logits itself; bf16's [hi | lo] are its rounding and the remainder's."""
    skip_without_cuda_kernels(_core.CAP_PERMUTE, "routing kernels", entry="mg_route_softmax")
    torch.manual_seed(0)
    tokens, num_experts, top_k, scaling = 777, 64, 6, 1.5
    logits = torch.randn(tokens, num_experts, device="cuda") * 3
    experts, counts, weights, lse, _ = torch.ops.moe_grouped.route_softmax(logits, top_k, mode, scaling)
    grads = (torch.randn_like(weights), torch.tensor([0.3, -0.7], device="cuda"), torch.randn_like(logits))
    halves = torch.ops.moe_grouped.route_softmax_backward(
        logits, lse, experts, counts, top_k, mode, scaling, *grads)
    full = torch.full_like(logits, float("nan"))
    _core.check(_core.require().mg_route_softmax_backward(
        logits.data_ptr(), lse.data_ptr(), experts.data_ptr(), counts.data_ptr(), tokens, num_experts, top_k, mode,
        scaling, *(g.data_ptr() for g in grads), _core.dtype_code(torch.float32), full.data_ptr(),
        _core.stream_handle(logits.device)))
    hi, lo = halves[:, :num_experts], halves[:, num_experts:]
    assert full.abs().max() > 0
    assert torch.equal(full.bfloat16(), hi)
    assert torch.equal((full - hi.float()).bfloat16(), lo)


@pytest.mark.gpu
def test_core_refuses_bad_arguments():
    skip_without_cuda_kernels(_core.CAP_PERMUTE, "routing kernels", entry="mg_route_softmax")
    logits = torch.randn(4, 8, device="cuda")
    with pytest.raises(ValueError, match="top_k"):
        torch.ops.moe_grouped.route_softmax(logits, 9, 0, 1.0)
    with pytest.raises(ValueError, match="weights_mode"):
        torch.ops.moe_grouped.route_softmax(logits, 2, 2, 1.0)
    with pytest.raises(ValueError, match="num_experts"):
        torch.ops.moe_grouped.route_softmax(torch.randn(4, 1025, device="cuda"), 2, 0, 1.0)
