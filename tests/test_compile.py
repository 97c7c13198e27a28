"""torch.compile(fullgraph=True) of every public op and module matches eager.

``fullgraph=True`` turns any graph break into an error, so each case also
proves that no host work (ctypes calls, imports, host reads of the routing)
is reachable from traced Python outside the custom ops. Outputs and the
gradients of inputs, parameters and ``main_grad`` buffers are compared with
the same module run eagerly.

CPU: the ``reference`` and ``torch`` backends under Dynamo's ``eager`` and
``aot_eager`` backends (and one inductor case); GPU (``@pytest.mark.gpu``):
the ``cuda`` and ``torch`` backends under inductor. The FP8 path
(``fp8_autocast``, the quantizers and FP8 GEMMs) on the ``reference``
backend on CPU and the ``cuda`` backend (sm_90) on the GPU.
"""

from __future__ import annotations

import re
import sys
from typing import Callable, Sequence

import pytest
import torch

import moe_grouped
from moe_grouped import GroupedLinear, GroupedMLP, MoELayer, fp8
from moe_grouped.fp8 import gemm as fp8_gemm

from cases import needs_cuda_kernels

CPU_BACKENDS = ("reference", "torch")
COMPILERS = ("eager", "aot_eager")
E, K, N = 4, 16, 24
SPLITS = [5, 0, 7, 8]  # an expert without tokens


def _inductor_runs_on_cpu() -> bool:
    try:
        torch._dynamo.reset()
        return bool(torch.compile(lambda t: t * 2, backend="inductor")(torch.ones(2)).eq(2).all())
    except Exception:  # no C++ toolchain here: the CPU inductor case is skipped
        return False


def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone().requires_grad_(tensor.is_floating_point())


def _run(fn: Callable, args: Sequence, tracked: Sequence[torch.Tensor], seed: int = 1):
    """Output and gradients (``.grad``, else ``main_grad``) of ``tracked`` after one backward."""
    for tensor in tracked:
        tensor.grad = None
        if isinstance(getattr(tensor, "main_grad", None), torch.Tensor):
            tensor.main_grad.zero_()
    out = fn(*args)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    gen = torch.Generator().manual_seed(seed)
    loss = sum(
        (o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum()
        for o in outs
        if o.is_floating_point() and o.requires_grad
    )
    if isinstance(loss, torch.Tensor):  # else nothing is differentiable (the quantizers)
        loss.backward()
    grads = []
    for tensor in tracked:
        main_grad = getattr(tensor, "main_grad", None)
        grads.append(main_grad.clone() if isinstance(main_grad, torch.Tensor) else tensor.grad)
    return [o.detach().clone() for o in outs], grads


def assert_compiled_matches_eager(
    fn: Callable, args: Sequence, params: Sequence[torch.Tensor] = (), *, compiler: str, atol=1e-5, rtol=1e-5,
    grad_atol=None,
) -> None:
    """``torch.compile(fn, fullgraph=True)`` gives eager's outputs and gradients (``grad_atol``: the gradients'
    absolute tolerance where it differs from the outputs')."""
    grad_atol = atol if grad_atol is None else grad_atol
    eager_args = [_leaf(a) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    compiled_args = [_leaf(a) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    float_args = lambda xs: [a for a in xs if isinstance(a, torch.Tensor) and a.requires_grad]  # noqa: E731
    eager_out, eager_grads = _run(fn, eager_args, [*float_args(eager_args), *params])
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=compiler)
    for step in range(2):  # the second call reuses the compiled graph
        out, grads = _run(compiled, compiled_args, [*float_args(compiled_args), *params])
        for i, (got, want) in enumerate(zip(out, eager_out)):
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m: f"output {i} ({step=}): {m}")
        for i, (got, want) in enumerate(zip(grads, eager_grads)):
            assert (got is None) == (want is None), f"gradient {i} ({step=}): compiled {got is None=}, eager {want is None=}"
            if want is not None:
                torch.testing.assert_close(got, want, atol=grad_atol, rtol=rtol,
                                           msg=lambda m: f"gradient {i} ({step=}): {m}")


def _routing(num_tokens: int, top_k: int, seed: int = 0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(num_tokens)])
    probs = torch.rand(num_tokens, top_k, generator=gen)
    return experts.to(device), probs.to(device)


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_grouped_ops(backend, compiler):
    torch.manual_seed(0)
    m_splits = torch.tensor(SPLITS)
    rows = sum(SPLITS)
    x, w, bias = torch.randn(rows, K), torch.randn(E, N, K), torch.randn(E, N)
    separate = list(torch.randn(E, N, K).unbind(0))

    def ops(x, w, bias, w0, w1, w2, w3, m_splits):
        y = moe_grouped.grouped_fprop(x, [w], m_splits, bias, backend=backend)
        y_separate = moe_grouped.grouped_fprop(x, [w0, w1, w2, w3], m_splits, backend=backend)
        dx = moe_grouped.grouped_dgrad(y.detach(), [w.detach()], m_splits, backend=backend)
        (dw,) = moe_grouped.grouped_wgrad(y.detach(), x.detach(), m_splits, num_groups=E, backend=backend)
        db = moe_grouped.grouped_dbias(y.detach(), m_splits, backend=backend)
        offsets = moe_grouped.splits_to_offsets(m_splits, rows, backend=backend)
        return y, y_separate, dx, dw, db, offsets

    assert_compiled_matches_eager(ops, [x, w, bias, *separate, m_splits], compiler=compiler)


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_grouped_wgrad_accumulates_into_out(backend, compiler):
    torch.manual_seed(0)
    m_splits = torch.tensor(SPLITS)
    dy, x = torch.randn(sum(SPLITS), N), torch.randn(sum(SPLITS), K)
    start = torch.randn(E, N, K)

    def accumulate(dy, x, m_splits, out):
        moe_grouped.grouped_wgrad(dy, x, m_splits, out=[out], accumulate=True, backend=backend)
        return out * 1

    want = accumulate(dy, x, m_splits, start.clone())
    torch._dynamo.reset()
    got = torch.compile(accumulate, fullgraph=True, backend=compiler)(dy, x, m_splits, start.clone())
    torch.testing.assert_close(got, want)
    assert torch.equal(got[1], start[1]), "an expert without tokens keeps its accumulated values"


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(
    "drop", [None, ("probs", False), ("position", True)], ids=["dropless", "capacity-probs", "capacity-padded"]
)
def test_permute_unpermute(backend, compiler, drop):
    torch.manual_seed(0)
    num_tokens, top_k = 10, 2
    experts, probs = _routing(num_tokens, top_k)
    tokens = torch.randn(num_tokens, K)
    options = {} if drop is None else {"capacity_factor": 0.75, "drop_policy": drop[0], "pad_to_capacity": drop[1]}

    def dispatch_combine(tokens, probs, experts):
        permuted, m_splits, row_id_map = moe_grouped.permute(
            tokens, experts, E, probs=probs.detach(), backend=backend, **options
        )
        out = moe_grouped.unpermute(permuted * 2, row_id_map, probs, backend=backend)
        return out, permuted, m_splits, row_id_map

    assert_compiled_matches_eager(dispatch_combine, [tokens, probs, experts], compiler=compiler)


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_swiglu(backend, compiler):
    torch.manual_seed(0)
    h = torch.randn(3, 5, 2 * K)
    assert_compiled_matches_eager(lambda h: moe_grouped.swiglu(h, backend=backend), [h], compiler=compiler)


def _with_main_grads(module: torch.nn.Module) -> None:
    for name, param in module.named_parameters():
        if "weight" in name:
            param.main_grad = torch.zeros_like(param, dtype=torch.float32)


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("single_grouped_weight", [True, False], ids=["grouped", "separate"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("fuse", [False, True], ids=["grad", "main_grad"])
def test_grouped_linear(backend, compiler, single_grouped_weight, bias, fuse):
    torch.manual_seed(0)
    layer = GroupedLinear(
        E, K, N, bias=bias, single_grouped_weight=single_grouped_weight, fuse_wgrad_accumulation=fuse, backend=backend
    )
    if fuse:
        _with_main_grads(layer)
    x = torch.randn(sum(SPLITS), K)
    assert_compiled_matches_eager(layer, [x, torch.tensor(SPLITS)], list(layer.parameters()), compiler=compiler)
    if fuse:
        assert all(w.grad is None and w.grad_added_to_main_grad for w in layer.weights())


def test_grouped_linear_delay_wgrad_compute_is_refused_under_compile():
    layer = GroupedLinear(E, K, N, delay_wgrad_compute=True, backend="reference")
    torch._dynamo.reset()
    with pytest.raises(Exception, match=re.escape("delay_wgrad_compute=True) cannot run under torch.compile")):
        torch.compile(layer, fullgraph=True, backend="eager")(torch.randn(sum(SPLITS), K), torch.tensor(SPLITS))


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_grouped_mlp(backend, compiler):
    torch.manual_seed(0)
    mlp = GroupedMLP(E, K, 32, backend=backend)
    x = torch.randn(sum(SPLITS), K)
    assert_compiled_matches_eager(mlp, [x, torch.tensor(SPLITS)], list(mlp.parameters()), compiler=compiler)


MOE_CASES = {
    "plain": {},
    "aux-shared": {"aux_loss_coeff": 1e-2, "z_loss_coeff": 1e-3, "shared_expert_ffn_hidden": 16},
    "capacity-probs": {"capacity_factor": 1.0, "drop_policy": "probs"},
    "capacity-padded": {"capacity_factor": 1.25, "drop_policy": "position", "pad_to_capacity": True},
    "grouped-bias": {"single_grouped_weight": True, "bias": True},
    "main_grad": {"fuse_wgrad_accumulation": True},
    "sigmoid-groups": {"router_options": {"score_function": "sigmoid", "n_group": 2, "topk_group": 1}},
}


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_layer(backend, compiler, case):
    torch.manual_seed(0)
    layer = MoELayer(K, 32, E, 2, backend=backend, **MOE_CASES[case])
    if MOE_CASES[case].get("fuse_wgrad_accumulation"):
        _with_main_grads(layer.experts)
    x = torch.randn(2, 6, K)  # [batch, seq, hidden]
    assert_compiled_matches_eager(layer, [x], list(layer.parameters()), compiler=compiler)
    assert layer.last_routing is not None and layer.last_routing.experts.shape == (12, 2)


def test_moe_layer_with_debug_checks():
    torch.manual_seed(0)
    layer = MoELayer(K, 32, E, 2, backend="torch")
    moe_grouped.set_debug_checks(True)
    try:
        assert_compiled_matches_eager(layer, [torch.randn(12, K)], list(layer.parameters()), compiler="aot_eager")
    finally:
        moe_grouped.set_debug_checks(False)


def test_moe_layer_inductor_cpu():
    if not _inductor_runs_on_cpu():
        pytest.skip("inductor cannot build CPU kernels here (no C++ toolchain)")
    torch.manual_seed(0)
    layer = MoELayer(K, 32, E, 2, backend="torch", aux_loss_coeff=1e-2, shared_expert_ffn_hidden=16)
    assert_compiled_matches_eager(layer, [torch.randn(12, K)], list(layer.parameters()), compiler="inductor", atol=1e-4, rtol=1e-4)


# GPU: the cuda backend (the core's kernels behind the custom ops) and torch, under inductor.

GPU_BACKENDS = ("cuda", "torch")
BF16 = {"atol": 2e-2, "rtol": 2e-2}


def _cuda_module(module: torch.nn.Module) -> torch.nn.Module:
    return module.to(device="cuda", dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_grouped_ops(backend):
    torch.manual_seed(0)
    m_splits = torch.tensor([40, 0, 72, 16], device="cuda")
    rows = int(m_splits.sum())
    x = torch.randn(rows, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, 128, 64, device="cuda", dtype=torch.bfloat16) / 8
    bias = torch.randn(E, 128, device="cuda", dtype=torch.bfloat16)

    def ops(x, w, bias, m_splits):
        y = moe_grouped.grouped_fprop(x, [w], m_splits, bias, backend=backend)
        dx = moe_grouped.grouped_dgrad(y.detach(), [w.detach()], m_splits, backend=backend)
        db = moe_grouped.grouped_dbias(y.detach(), m_splits, backend=backend)
        offsets = moe_grouped.splits_to_offsets(m_splits, rows, backend=backend)
        return y, dx, db, offsets

    assert_compiled_matches_eager(ops, [x, w, bias, m_splits], compiler="inductor", **BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_permute_swiglu(backend):
    torch.manual_seed(0)
    experts, probs = _routing(64, 2, device="cuda")
    tokens = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)

    def block(tokens, probs, experts):
        permuted, m_splits, row_id_map = moe_grouped.permute(
            tokens, experts, E, probs=probs.detach(), capacity_factor=1.0, backend=backend
        )
        hidden = moe_grouped.swiglu(permuted, backend=backend)
        return moe_grouped.unpermute(torch.cat([hidden, hidden], dim=1), row_id_map, probs, backend=backend), m_splits

    assert_compiled_matches_eager(block, [tokens, probs, experts], compiler="inductor", **BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("single_grouped_weight", [True, False], ids=["grouped", "separate"])
@pytest.mark.parametrize("fuse", [False, True], ids=["grad", "main_grad"])
def test_gpu_grouped_linear(backend, single_grouped_weight, fuse):
    torch.manual_seed(0)
    layer = _cuda_module(
        GroupedLinear(E, 64, 128, single_grouped_weight=single_grouped_weight, fuse_wgrad_accumulation=fuse,
                      backend=backend)
    )
    if fuse:
        _with_main_grads(layer)
    x = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16)
    m_splits = torch.tensor([40, 0, 72, 16], device="cuda")
    assert_compiled_matches_eager(layer, [x, m_splits], list(layer.parameters()), compiler="inductor", **BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("case", list(MOE_CASES))
def test_gpu_moe_layer(backend, case):
    torch.manual_seed(0)
    layer = _cuda_module(MoELayer(128, 256, 8, 2, backend=backend, **MOE_CASES[case]))
    if MOE_CASES[case].get("fuse_wgrad_accumulation"):
        _with_main_grads(layer.experts)
    x = torch.randn(4, 64, 128, device="cuda", dtype=torch.bfloat16)
    # The router computes in float32; inductor's fused bf16 elementwise ops (shared expert, combine) round
    # differently from eager's, hence bf16 tolerances. The router weight's gradient sums 256 tokens' softmax
    # backward of bf16 routing-weight gradients, whose rounding inductor changes on the torch backend (measured
    # on the H100: up to 0.043 on a few of 1024 entries), hence a wider absolute tolerance for the gradients.
    assert_compiled_matches_eager(layer, [x], list(layer.parameters()), compiler="inductor", grad_atol=6e-2, **BF16)


# FP8 block scaling: the quantizers, the FP8 GEMMs and the layers inside fp8_autocast. The compiled graph runs
# the same custom ops as eager, so the results are equal bit for bit.

FP8_E, FP8_K, FP8_N = 4, 128, 64
E4M3 = torch.float8_e4m3fn
EXACT = {"atol": 0.0, "rtol": 0.0}
RECIPES = {"E4M3": fp8.Float8BlockScaling(), "HYBRID": fp8.Float8BlockScaling("HYBRID", pow2_scales=False)}
cuda_fp8 = needs_cuda_kernels(moe_grouped._core.CAP_GROUPED_GEMM_FP8_BLOCKWISE, "FP8 grouped GEMMs")


def _bits(q) -> list[torch.Tensor]:
    """A quantized operand as comparable tensors (fp8 data as its bytes)."""
    return [q.data.view(torch.uint8), q.scale_inv]


@pytest.mark.parametrize("compiler", COMPILERS)
def test_fp8_quantizers(compiler):
    torch.manual_seed(0)
    x, w = torch.randn(sum(SPLITS), FP8_K, dtype=torch.bfloat16), torch.randn(FP8_E, FP8_N, FP8_K)

    def quantize(x, w, m_splits):
        rowwise = fp8.quantize_rowwise(x, E4M3)
        both = fp8.quantize_grouped(x, m_splits, torch.float8_e5m2, False, 1e-3, dbias=True)
        columnwise = fp8.quantize_columnwise_grouped(x, m_splits, E4M3)
        grouped = fp8.quantize_weights_128x128(w, E4M3)
        separate = fp8.quantize_weights_128x128(list(w.unbind(0)), E4M3, transpose=False)
        return (*_bits(rowwise), *_bits(both.rowwise), *_bits(both.columnwise), both.dbias, *_bits(columnwise),
                *_bits(grouped.w), *_bits(grouped.wt), *_bits(separate.w))

    assert_compiled_matches_eager(quantize, [x, w, torch.tensor(SPLITS)], compiler=compiler, **EXACT)


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("accumulate", [False, True], ids=["fresh", "accumulate"])
def test_fp8_gemms(compiler, accumulate):
    torch.manual_seed(0)
    rows = sum(SPLITS)
    x, dy = torch.randn(rows, FP8_K, dtype=torch.bfloat16), torch.randn(rows, FP8_N, dtype=torch.bfloat16)
    w, bias = torch.randn(FP8_E, FP8_N, FP8_K), torch.randn(FP8_E, FP8_N, dtype=torch.bfloat16)
    start = torch.randn(FP8_E, FP8_N, FP8_K)

    def gemms(x, dy, w, bias, m_splits, out):
        xq = fp8.quantize_grouped(x, m_splits, E4M3)
        dyq = fp8.quantize_grouped(dy, m_splits, torch.float8_e5m2)
        wq = fp8.quantize_weights_128x128(w, E4M3)
        y = fp8_gemm.grouped_fprop_fp8(xq.rowwise, wq.w, m_splits, bias, backend="reference")
        dx = fp8_gemm.grouped_dgrad_fp8(dyq.rowwise, wq.wt, m_splits, backend="reference")
        fp8_gemm.grouped_wgrad_fp8(dyq.columnwise, xq.columnwise, m_splits, [out], total_rows=rows,
                                   accumulate=accumulate, backend="reference")
        return y, dx, out * 1

    # out is a fresh copy per run: eager, then the two compiled calls, each from the same start
    torch._dynamo.reset()
    want = gemms(x, dy, w, bias, torch.tensor(SPLITS), start.clone())
    compiled = torch.compile(gemms, fullgraph=True, backend=compiler)
    for step in range(2):
        got = compiled(x, dy, w, bias, torch.tensor(SPLITS), start.clone())
        for i, (a, b) in enumerate(zip(got, want)):
            torch.testing.assert_close(a, b, **EXACT, msg=lambda m: f"output {i} ({step=}): {m}")
    assert torch.equal(want[2][1], start[1] if accumulate else torch.zeros_like(start[1])), "expert without tokens"


def _fp8_call(module, recipe):
    def call(*args):
        with fp8.fp8_autocast(recipe):
            return module(*args)

    return call


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("single_grouped_weight", [True, False], ids=["grouped", "separate"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("fuse", [False, True], ids=["grad", "main_grad"])
def test_fp8_grouped_linear(compiler, recipe, single_grouped_weight, bias, fuse):
    torch.manual_seed(0)
    layer = GroupedLinear(FP8_E, FP8_K, FP8_N, bias=bias, single_grouped_weight=single_grouped_weight,
                          fuse_wgrad_accumulation=fuse, dtype=torch.bfloat16, backend="reference")
    if fuse:
        _with_main_grads(layer)
    x = torch.randn(sum(SPLITS), FP8_K, dtype=torch.bfloat16)
    assert_compiled_matches_eager(_fp8_call(layer, RECIPES[recipe]), [x, torch.tensor(SPLITS)],
                                  list(layer.parameters()), compiler=compiler, **EXACT)
    if fuse:
        assert all(w.grad is None and w.grad_added_to_main_grad for w in layer.weights())


def test_fp8_autocast_outside_the_compiled_region_recompiles():
    """The recipe is read while tracing and guarded: entering fp8_autocast, or changing the recipe, retraces."""
    torch.manual_seed(0)
    layer = GroupedLinear(FP8_E, FP8_K, FP8_N, dtype=torch.bfloat16, backend="reference")
    x, m_splits = torch.randn(sum(SPLITS), FP8_K, dtype=torch.bfloat16), torch.tensor(SPLITS)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    bf16 = layer(x, m_splits)
    for recipe in (None, RECIPES["E4M3"], None, RECIPES["HYBRID"]):
        with fp8.fp8_autocast(recipe, enabled=recipe is not None):
            got, want = compiled(x, m_splits), layer(x, m_splits)
        assert torch.equal(got, want), f"{recipe=}"
        assert torch.equal(got, bf16) == (recipe is None), f"{recipe=}: FP8 must differ from bfloat16"


@pytest.mark.parametrize("experts_path", [None, "fused"], ids=["grouped_linear", "fused_moe_layer"])
def test_fp8_is_first_microbatch_is_refused_under_compile(experts_path):
    if experts_path is None:
        layer = GroupedLinear(FP8_E, FP8_K, FP8_N, dtype=torch.bfloat16, backend="reference")
        args = (torch.randn(sum(SPLITS), FP8_K, dtype=torch.bfloat16), torch.tensor(SPLITS))
    else:  # the fused experts op keeps its FP8 weights in the same cache
        layer = MoELayer(FP8_K, FP8_N, FP8_E, 2, dtype=torch.bfloat16, backend="reference", experts_path="fused")
        args = (torch.randn(12, FP8_K, dtype=torch.bfloat16),)

    def first_microbatch(*args):
        with fp8.fp8_autocast():
            return layer(*args, is_first_microbatch=True)

    torch._dynamo.reset()
    compiled = torch.compile(first_microbatch, fullgraph=True, backend="eager")
    with pytest.raises(Exception, match=re.escape("is_first_microbatch=True/False) cannot run under torch.compile")):
        compiled(*args)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_fp8_grouped_mlp(compiler):
    torch.manual_seed(0)
    mlp = GroupedMLP(FP8_E, FP8_K, FP8_N, dtype=torch.bfloat16, backend="reference")
    x = torch.randn(sum(SPLITS), FP8_K, dtype=torch.bfloat16)
    assert_compiled_matches_eager(_fp8_call(mlp, RECIPES["E4M3"]), [x, torch.tensor(SPLITS)],
                                  list(mlp.parameters()), compiler=compiler, **EXACT)


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("case", ["plain", "aux-shared", "capacity-padded", "grouped-bias", "main_grad"])
def test_fp8_moe_layer(compiler, case):
    torch.manual_seed(0)
    layer = MoELayer(FP8_K, FP8_N, FP8_E, 2, dtype=torch.bfloat16, backend="reference", **MOE_CASES[case])
    if MOE_CASES[case].get("fuse_wgrad_accumulation"):
        _with_main_grads(layer.experts)
    x = torch.randn(2, 6, FP8_K, dtype=torch.bfloat16)
    assert_compiled_matches_eager(_fp8_call(layer, RECIPES["HYBRID"]), [x], list(layer.parameters()),
                                  compiler=compiler, **EXACT)


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("case", ["plain", "capacity-padded", "main_grad"])
def test_fp8_fused_moe_layer(compiler, case):
    """The fused experts op in FP8 (moe_grouped.fp8.experts) traces whole, its backward included."""
    torch.manual_seed(0)
    layer = MoELayer(FP8_K, FP8_N, FP8_E, 2, dtype=torch.bfloat16, backend="reference", experts_path="fused",
                     **MOE_CASES[case])
    if MOE_CASES[case].get("fuse_wgrad_accumulation"):
        _with_main_grads(layer.experts)
    x = torch.randn(2, 6, FP8_K, dtype=torch.bfloat16)
    assert_compiled_matches_eager(_fp8_call(layer, RECIPES["HYBRID"]), [x], list(layer.parameters()),
                                  compiler=compiler, **EXACT)


def test_ops_first_reached_inside_compile_trace_at_the_default_recursion_limit():
    """An op wrapper first looked up while Dynamo traces (a compiled first call, or a backward traced with
    its forward) must not recurse: caching it there was a traced setattr that Dynamo resolved through
    the lookup again, until Python's recursion limit."""
    from moe_grouped._ops import ops

    torch.manual_seed(0)
    layer = MoELayer(K, 32, E, 2, backend="reference", experts_path="fused")
    x = torch.randn(2, 6, K)
    want = layer(x)
    for name in list(vars(ops)):
        delattr(ops, name)  # as in a new process: no wrapper built yet
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)  # Python's default (inductor raises it the first time it compiles)
    try:
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True, backend="eager")
        xx = x.clone().requires_grad_(True)
        got = compiled(xx)
        got.sum().backward()
    finally:
        sys.setrecursionlimit(limit)
    torch.testing.assert_close(got, want)
    assert xx.grad is not None and torch.isfinite(xx.grad).all()


# The fused experts path (moe_grouped.experts): explicit experts_path="fused" on the CPU backends.

FUSED_MOE_CASES = ["plain", "aux-shared", "capacity-probs", "capacity-padded", "sigmoid-groups", "main_grad"]


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("single_grouped_weight", [True, False], ids=["grouped", "separate"])
def test_fused_grouped_mlp(backend, compiler, single_grouped_weight):
    torch.manual_seed(0)
    mlp = GroupedMLP(E, K, 32, single_grouped_weight=single_grouped_weight, backend=backend, experts_path="fused")
    x = torch.randn(sum(SPLITS), K)
    assert mlp.uses_fused_path(x)
    assert_compiled_matches_eager(mlp, [x, torch.tensor(SPLITS)], list(mlp.parameters()), compiler=compiler)


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", FUSED_MOE_CASES)
def test_fused_moe_layer(backend, compiler, case):
    torch.manual_seed(0)
    layer = MoELayer(K, 32, E, 2, backend=backend, experts_path="fused", **MOE_CASES[case])
    if MOE_CASES[case].get("fuse_wgrad_accumulation"):
        _with_main_grads(layer.experts)
    x = torch.randn(2, 6, K)
    assert layer.experts.uses_fused_path(x.view(-1, K))
    assert_compiled_matches_eager(layer, [x], list(layer.parameters()), compiler=compiler)


# ExpertParallelMoELayer on a one-rank gloo group (conftest's one_rank_group): the 'local' transport traces;
# 'all_to_all' (host-read counts) is refused under compile.


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("capacity", [None, 48], ids=["default-capacity", "given-capacity"])
def test_expert_parallel_local(one_rank_group, backend, compiler, capacity):
    from moe_grouped.parallel import ExpertParallelMoELayer

    torch.manual_seed(0)
    layer = ExpertParallelMoELayer(K, 32, E, 2, group=one_rank_group, transport="local", capacity=capacity,
                                   aux_loss_coeff=1e-2, shared_expert_ffn_hidden=16, backend=backend)
    # The first (eager) forward of the helper sets the transport up before the compiled calls.
    assert_compiled_matches_eager(layer, [torch.randn(2, 6, K)], list(layer.parameters()), compiler=compiler)
    layer.check_overflow()  # outside the compiled region, as after capture


def test_expert_parallel_all_to_all_is_refused_under_compile(one_rank_group):
    from moe_grouped.parallel import ExpertParallelMoELayer

    layer = ExpertParallelMoELayer(K, 32, E, 2, group=one_rank_group, transport="all_to_all", backend="torch")
    x = torch.randn(12, K)
    layer(x)  # sets the transport up
    torch._dynamo.reset()
    with pytest.raises(Exception, match=re.escape("transport='all_to_all') cannot run under torch.compile")):
        torch.compile(layer, fullgraph=True, backend="eager")(x)


def test_expert_parallel_first_forward_must_be_eager(one_rank_group):
    from moe_grouped.parallel import ExpertParallelMoELayer

    layer = ExpertParallelMoELayer(K, 32, E, 2, group=one_rank_group, transport="local", backend="torch")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="call the layer once before torch.compile traces it"):
        torch.compile(layer, fullgraph=True, backend="eager")(torch.randn(12, K))


# GPU FP8: the core's quantize kernels and CUTLASS FP8 GEMMs (sm_90) behind the custom ops, under inductor.


@pytest.mark.gpu
@cuda_fp8
@pytest.mark.parametrize("single_grouped_weight", [True, False], ids=["grouped", "separate"])
@pytest.mark.parametrize("fuse", [False, True], ids=["grad", "main_grad"])
def test_gpu_fp8_grouped_linear(single_grouped_weight, fuse):
    torch.manual_seed(0)
    layer = _cuda_module(GroupedLinear(E, 128, 256, single_grouped_weight=single_grouped_weight,
                                       fuse_wgrad_accumulation=fuse, backend="cuda"))
    if fuse:
        _with_main_grads(layer)
    x = torch.randn(128, 128, device="cuda", dtype=torch.bfloat16)
    m_splits = torch.tensor([40, 0, 72, 16], device="cuda")
    assert_compiled_matches_eager(_fp8_call(layer, RECIPES["E4M3"]), [x, m_splits], list(layer.parameters()),
                                  compiler="inductor", **BF16)


@pytest.mark.gpu
@cuda_fp8
@pytest.mark.parametrize("case", ["plain", "aux-shared", "capacity-probs"])
def test_gpu_fp8_moe_layer(case):
    torch.manual_seed(0)
    layer = _cuda_module(MoELayer(128, 256, 8, 2, backend="cuda", **MOE_CASES[case]))
    x = torch.randn(4, 64, 128, device="cuda", dtype=torch.bfloat16)
    assert_compiled_matches_eager(_fp8_call(layer, RECIPES["HYBRID"]), [x], list(layer.parameters()),
                                  compiler="inductor", **BF16)


@pytest.mark.gpu
@cuda_fp8
def test_gpu_fp8_quantizers():
    torch.manual_seed(0)
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, 128, 256, device="cuda", dtype=torch.bfloat16)
    m_splits = torch.tensor([40, 0, 72, 16], device="cuda")

    def quantize(x, w, m_splits):
        both = fp8.quantize_grouped(x, m_splits, E4M3, dbias=True)
        weights = fp8.quantize_weights_128x128(w, E4M3)
        # Column-wise positions no expert owns are left unwritten by the kernel: compare the rest.
        return (*_bits(fp8.quantize_rowwise(x, E4M3)), *_bits(both.rowwise), both.dbias, *_bits(weights.w),
                *_bits(weights.wt))

    assert_compiled_matches_eager(quantize, [x, w, m_splits], compiler="inductor", **EXACT)
