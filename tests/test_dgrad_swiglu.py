"""fc2's dgrad with the weighted SwiGLU backward in its epilogue (``mg_grouped_dgrad_swiglu``)
against the plain dgrad followed by the standalone pass, and the op that picks between them."""

import ctypes

import pytest
import torch

import moe_grouped
from moe_grouped import _core
from moe_grouped.activation import swiglu_weighted_backward
from moe_grouped.gemm import cuda_backend

from cases import SPLIT_PATTERNS, make_splits, skip_without_cuda_kernels


def partial_cols(k: int) -> int:
    cols = ctypes.c_int64(-1)
    _core.check(_core.require().mg_grouped_dgrad_swiglu_partial_cols(k, ctypes.byref(cols)))
    return cols.value


def require_core_entry():
    if not _core.available() or not hasattr(_core.lib, "mg_grouped_dgrad_swiglu"):
        pytest.skip("core without mg_grouped_dgrad_swiglu")


def test_partial_columns_are_one_per_256_column_tile():
    require_core_entry()
    assert [partial_cols(k) for k in (0, 8, 256, 264, 768, 1408)] == [0, 1, 1, 2, 3, 6]
    with pytest.raises(ValueError, match="k must be >= 0"):
        partial_cols(-8)


def require_fused_kernel():
    skip_without_cuda_kernels(_core.CAP_DGRAD_SWIGLU, "SwiGLU-backward dgrad")
    skip_without_cuda_kernels(_core.CAP_SWIGLU, "SwiGLU kernels", entry="mg_swiglu_weighted_backward")


def expert_weights(layout: str, experts: int, hidden: int, ffn: int) -> list[torch.Tensor]:
    """fc2's weights W_e [hidden, ffn]: one grouped [E, hidden, ffn] tensor or E separate ones."""
    w = torch.randn(experts, hidden, ffn, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5
    return [w] if layout == "grouped" else [t.contiguous() for t in w.unbind(0)]


def composed(dy, weights, m_splits, g, w):
    """The plain cuda dgrad, then the standalone cuda pass: (dg, wh, dprob)."""
    dh_u = torch.ops.moe_grouped.grouped_dgrad(dy, weights, m_splits, dy.dtype, "cuda", True)
    return swiglu_weighted_backward(dh_u, g, w, m_splits, backend="cuda")


# (experts, hidden, ffn): ffn below one 256-column tile, a partial last tile
# (1408 = 5.5 tiles), whole tiles; hidden is the dgrad's reduction.
SHAPES = [(4, 64, 136), (8, 256, 1408), (6, 512, 768), (3, 128, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("experts, hidden, ffn", SHAPES)
@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
@pytest.mark.parametrize("layout", ["grouped", "separate"])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("raster", ["auto", "n"])
def test_gpu_fused_dgrad_swiglu_equals_the_dgrad_then_the_pass(experts, hidden, ffn, pattern, layout, weighted, raster,
                                                               monkeypatch):
    """Also with the tiles walked along N (MOE_GROUPED_GEMM_RASTER=n), as large groups are."""
    monkeypatch.setenv("MOE_GROUPED_GEMM_RASTER", raster)
    require_fused_kernel()
    torch.manual_seed(experts * ffn + hidden)
    real = 777
    rows = real + 37  # a capacity-style tail no expert computes
    splits = make_splits(pattern, experts, real, seed=ffn)
    case = f"{experts=} {hidden=} {ffn=} {pattern=} {layout=} {weighted=} {raster=} {splits=}"
    dy = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    g = (torch.randn(rows, 2 * ffn, device="cuda") * 3).to(torch.bfloat16)
    w = torch.rand(rows, device="cuda") if weighted else None
    weights = expert_weights(layout, experts, hidden, ffn)
    for splits_dtype in (torch.int64, torch.int32):
        m_splits = torch.tensor(splits, device="cuda", dtype=splits_dtype)
        edg, ewh, edprob = composed(dy, weights, m_splits, g, w)
        runs = []
        for _ in range(2):
            dg = g.clone()
            wh, dprob = cuda_backend.dgrad_swiglu(dy, weights, m_splits, dg, w)
            runs.append((dg, wh, dprob))
        dg, wh, dprob = runs[0]
        assert torch.equal(dg[:real], edg[:real]), case
        assert torch.equal(wh[:real], ewh[:real]), case
        # The same products summed per 256-column tile, then over the tiles.
        torch.testing.assert_close(dprob[:real], edprob[:real], rtol=1e-5, atol=1e-5 * ffn ** 0.5, msg=case)
        # Rows past the real total: dprob 0, g not written.
        assert torch.equal(dprob[real:], torch.zeros_like(dprob[real:])), case
        assert torch.equal(dg[real:], g[real:]), case
        # Deterministic: the same bits again.
        for a, b in zip(runs[0], runs[1]):
            assert torch.equal(a[:real], b[:real]), case


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_dgrad_swiglu_op_fuses_bf16_and_composes_otherwise(dtype, monkeypatch):
    """The op's results do not depend on whether it fused: bf16 with MOE_GROUPED_DGRAD_SWIGLU=fused vs
    =unfused; fp16 (no fused kernel) composes either way."""
    require_fused_kernel()
    torch.manual_seed(3)
    experts, hidden, ffn, rows = 4, 128, 264, 300
    m_splits = torch.tensor(make_splits("skewed", experts, rows, seed=1), device="cuda")
    dy = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    g = (torch.randn(rows, 2 * ffn, device="cuda") * 3).to(dtype)
    w = torch.rand(rows, device="cuda")
    weights = [torch.randn(experts, hidden, ffn, device="cuda", dtype=dtype) / hidden ** 0.5]
    results = {}
    for setting in ("fused", "unfused"):
        monkeypatch.setenv(cuda_backend.DGRAD_SWIGLU_ENV, setting)
        assert cuda_backend.dgrad_swiglu_fuses(dy, g) == (setting == "fused" and dtype == torch.bfloat16)
        dg = g.clone()
        wh, dprob = torch.ops.moe_grouped.grouped_dgrad_swiglu_(dy, weights, m_splits, dg, w, "cuda", "cuda")
        results[setting] = (dg, wh, dprob)
    fused, unfused = results["fused"], results["unfused"]
    assert torch.equal(fused[0], unfused[0]) and torch.equal(fused[1], unfused[1])
    torch.testing.assert_close(fused[2], unfused[2], rtol=1e-5, atol=1e-4)
    monkeypatch.delenv(cuda_backend.DGRAD_SWIGLU_ENV)
    assert not cuda_backend.dgrad_swiglu_fuses(dy, g), "the two passes are the default (measured faster)"
    monkeypatch.setenv(cuda_backend.DGRAD_SWIGLU_ENV, "sometimes")
    with pytest.raises(ValueError, match="expected 'fused' or 'unfused'"):
        torch.ops.moe_grouped.grouped_dgrad_swiglu_(dy, weights, m_splits, g.clone(), w, "cuda", "cuda")


@pytest.mark.gpu
def test_gpu_dgrad_swiglu_entry_point_refuses_bad_arguments():
    require_fused_kernel()
    lib = _core.require()
    experts, hidden, ffn, rows = 2, 64, 256, 16
    m_splits = torch.tensor([10, 6], device="cuda")
    dy = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(rows, 2 * ffn, device="cuda", dtype=torch.bfloat16)
    wh = torch.empty(rows, ffn, device="cuda", dtype=torch.bfloat16)
    partials = torch.zeros(rows, 1, device="cuda")
    weights = [torch.randn(experts, hidden, ffn, device="cuda", dtype=torch.bfloat16)]

    def call(dtype=torch.bfloat16, cols=1, g_ptr=None):
        problem = cuda_backend.grouped_problem(dy, m_splits, experts, hidden, ffn, cuda_backend.SLOT_FPROP_DGRAD,
                                        dtype=dtype)
        _core.check(lib.mg_grouped_dgrad_swiglu(
            ctypes.byref(problem), dy.data_ptr(), cuda_backend.group_operand(weights),
            g.data_ptr() if g_ptr is None else g_ptr, None, wh.data_ptr(), partials.data_ptr(), cols,
            _core.stream_handle(dy.device)))

    call()  # well-formed
    with pytest.raises(ValueError, match="dprob_partials needs 1 columns for k = 256, got 2"):
        call(cols=2)
    with pytest.raises(_core.UnsupportedError, match="built for bf16 operands, got float16"):
        call(dtype=torch.float16)
    with pytest.raises(ValueError, match="g must be 16-byte aligned"):
        call(g_ptr=g.data_ptr() + 2)


@pytest.mark.gpu
def test_gpu_moe_layer_step_with_the_fused_kernel_matches_the_default(monkeypatch):
    """A fused-path MoELayer step: the experts' weight gradients are bitwise the same with the fused kernel
    (dg and wh are); the routing weights' gradient, summed per tile, moves x's and the router's by rounding."""
    require_fused_kernel()
    torch.manual_seed(5)
    layer = moe_grouped.MoELayer(256, 264, 8, 4, single_grouped_weight=True, dtype=torch.bfloat16, device="cuda",
                                 backend="cuda")
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(x)
    results = {}
    for setting in ("unfused", "fused"):
        monkeypatch.setenv(cuda_backend.DGRAD_SWIGLU_ENV, setting)
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        out.backward(dout)
        results[setting] = (out.detach(), xi.grad, {n: p.grad.clone() for n, p in layer.named_parameters()})
    (out0, dx0, grads0), (out1, dx1, grads1) = results["unfused"], results["fused"]
    assert torch.equal(out0, out1)
    assert torch.equal(grads0["experts.fc1.weight"], grads1["experts.fc1.weight"])
    assert torch.equal(grads0["experts.fc2.weight"], grads1["experts.fc2.weight"])
    torch.testing.assert_close(dx1, dx0, rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(grads1["router.weight"], grads0["router.weight"], rtol=2 ** -7, atol=1e-3)
