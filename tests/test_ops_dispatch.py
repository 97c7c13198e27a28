"""``moe_grouped._ops.ops``: the direct eager call of an op gives what the dispatcher gives, and steps
aside wherever the dispatcher does more (autograd, fake and meta tensors, compile, inference tensors)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from moe_grouped._ops import _BODIES, DirectCalls, direct_region, ops


def problem(num_experts=3, total=12, k=8, n=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(total, k, generator=gen)
    w = torch.randn(num_experts, n, k, generator=gen)
    dy = torch.randn(total, n, generator=gen)
    return x, [w], dy, torch.tensor([5, 0, total - 5])


@pytest.fixture
def direct_calls(monkeypatch):
    """Counts the bodies run directly (not through the dispatcher)."""
    calls = []
    for name, (body, mutated) in list(_BODIES.items()):
        def counted(*args, _body=body, _name=name):
            calls.append(_name)
            return _body(*args)
        monkeypatch.setitem(_BODIES, name, (counted, mutated))
    built = dict(vars(ops))  # the callers built so far hold the real bodies: build new ones
    vars(ops).clear()
    yield calls
    vars(ops).clear()
    vars(ops).update(built)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_direct_call_equals_the_dispatched_op(backend, direct_calls):
    x, w, dy, splits = problem()
    with torch.no_grad():
        direct = ops.grouped_fprop(x, w, splits, None, torch.float32, backend, True)
        dispatched = torch.ops.moe_grouped.grouped_fprop(x, w, splits, None, torch.float32, backend, True)
    assert direct_calls == ["grouped_fprop"]
    torch.testing.assert_close(direct, dispatched, rtol=0, atol=0)


def test_autograd_goes_through_the_dispatcher(direct_calls):
    x, w, dy, splits = problem()
    x.requires_grad_(True)
    w[0].requires_grad_(True)
    y = ops.grouped_fprop(x, w, splits, None, torch.float32, "reference", True)
    assert direct_calls == [] and y.grad_fn is not None
    y.backward(dy)
    ref_x = x.detach().clone().requires_grad_(True)
    ref_w = w[0].detach().clone().requires_grad_(True)
    torch.ops.moe_grouped.grouped_fprop(ref_x, [ref_w], splits, None, torch.float32, "reference", True).backward(dy)
    torch.testing.assert_close(x.grad, ref_x.grad)
    torch.testing.assert_close(w[0].grad, ref_w.grad)


def _saved_for_backward(out):
    """(a loss whose backward reads ``out`` [E, N, K], ``out``'s version now)."""
    leaf = torch.ones(out.shape[0], requires_grad=True)
    return (leaf[:, None, None] * out).sum(), out._version  # mul saves `out` for leaf's gradient


def test_direct_in_place_op_bumps_the_version_autograd_checks(direct_calls):
    x, w, dy, splits = problem()
    out = torch.zeros_like(w[0])
    saved, version = _saved_for_backward(out)
    with torch.no_grad():
        ops.grouped_wgrad_(dy, x, splits, [out], False, "reference")
    assert direct_calls == ["grouped_wgrad_"]
    assert out._version > version
    assert out.abs().sum() > 0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()


def test_fake_and_meta_tensors_take_the_fake_implementation(direct_calls):
    with torch.no_grad():
        meta = ops.grouped_fprop(
            torch.empty(12, 8, device="meta"), [torch.empty(3, 4, 8, device="meta")],
            torch.empty(3, dtype=torch.int64, device="meta"), None, torch.float32, "torch", True,
        )
        with FakeTensorMode():
            fake = ops.grouped_fprop(
                torch.empty(12, 8), [torch.empty(3, 4, 8)], torch.empty(3, dtype=torch.int64), None,
                torch.float32, "torch", True,
            )
    assert direct_calls == []
    assert meta.shape == (12, 4) and meta.device.type == "meta"
    assert fake.shape == (12, 4)


def test_a_torch_function_mode_takes_the_dispatcher(direct_calls):
    x, w, dy, splits = problem()
    with torch.no_grad(), torch.device("cpu"):
        y = ops.grouped_fprop(x, w, splits, None, torch.float32, "reference", True)
    assert direct_calls == [] and y.shape == (12, 4)


def test_compiled_code_calls_the_registered_op(direct_calls):
    x, w, dy, splits = problem()

    @torch.compile(backend="eager", fullgraph=True)
    def f(x, w, splits):
        return ops.grouped_fprop(x, [w], splits, None, torch.float32, "torch", True)

    with torch.no_grad():
        y = f(x, w[0], splits)
        expected = torch.ops.moe_grouped.grouped_fprop(x, w, splits, None, torch.float32, "torch", True)
    assert "grouped_fprop" not in direct_calls
    torch.testing.assert_close(y, expected)


def _outcome(call, out):
    """(the error's message or None, ``out`` after the call)."""
    try:
        call()
    except RuntimeError as error:
        return str(error), out
    return None, out


def test_inference_tensors_get_the_dispatcher_rules(direct_calls):
    # Whether an in-place op on an inference tensor outside inference mode raises depends on the torch
    # release (2.13 refuses it, 2.11 runs it): the direct call must give what the dispatcher gives.
    x, w, dy, splits = problem()
    with torch.inference_mode():
        outs = [torch.zeros_like(w[0]) for _ in range(2)]
    with torch.no_grad():
        expected = _outcome(
            lambda: torch.ops.moe_grouped.grouped_wgrad_(dy, x, splits, [outs[0]], False, "reference"), outs[0])
        got = _outcome(lambda: ops.grouped_wgrad_(dy, x, splits, [outs[1]], False, "reference"), outs[1])
    assert direct_calls == []
    assert got[0] == expected[0]
    assert torch.equal(got[1], expected[1])
    with torch.inference_mode():
        ops.grouped_wgrad_(dy, x, splits, [outs[1]], False, "reference")
    assert direct_calls == ["grouped_wgrad_"] and outs[1].abs().sum() > 0


def test_a_direct_region_runs_bodies_and_still_bumps_versions(direct_calls):
    x, w, dy, splits = problem()
    out = torch.zeros_like(w[0])
    saved, version = _saved_for_backward(out)
    with torch.no_grad(), DirectCalls((x, w[0], dy, splits, out, None)):
        assert direct_region()
        y = ops.grouped_fprop(x, w, splits, None, torch.float32, "reference", True)
        ops.grouped_wgrad_(dy, x, splits, [out], False, "reference")
    assert not direct_region()
    assert direct_calls == ["grouped_fprop", "grouped_wgrad_"]
    torch.testing.assert_close(y, torch.ops.moe_grouped.grouped_fprop(x, w, splits, None, torch.float32,
                                                                      "reference", True), rtol=0, atol=0)
    assert out._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()


@pytest.mark.parametrize("why", ["grad mode", "meta tensor", "fake tensor", "torch function mode"])
def test_a_direct_region_is_off_where_a_call_would_need_the_dispatcher(why, direct_calls):
    x, w, dy, splits = problem()
    if why == "meta tensor":
        x = torch.empty(12, 8, device="meta")
    with torch.set_grad_enabled(why == "grad mode"):
        if why == "fake tensor":
            with FakeTensorMode() as mode:
                fake = mode.from_tensor(x)
            region = DirectCalls((fake, w[0]))
        elif why == "torch function mode":
            with torch.device("cpu"):
                region = DirectCalls((x, w[0]))
        else:
            region = DirectCalls((x, w[0]))
        with region:
            assert not direct_region()
    assert direct_calls == []


def test_unknown_op_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no op 'not_an_op'"):
        ops.not_an_op
