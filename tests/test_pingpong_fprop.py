"""The ping-pong fprop (csrc/gemm/sm90_pingpong_fprop_bf16.cu) and fc1 with SwiGLU.

The core runs a bf16 fprop into bf16 on its own ping-pong kernel where that
kernel takes the problem and the heuristic prefers it, else on the cooperative
CUTLASS kernel; ``MOE_GROUPED_GEMM_FPROP=pingpong|cutlass`` forces either.
Both issue the same wgmma instructions over the same 64-wide k-tiles in the
same order, so their results must be bitwise equal (test_cuda_gemm checks the
cooperative kernel against the float64 oracle).

- GPU: forced onto each kernel, the plain and the gathered fprop are bitwise
  equal over split patterns, int32 and int64 splits, index patterns and
  shapes on and off the 256-column tile, up to the 256-group limit and past
  it (the cooperative kernel then runs either way);
- ``fprop_swiglu``'s g and h are bitwise the GEMM followed by the SwiGLU
  pass, on the fused kernel and on the two-pass fallback (2 * ffn not a
  multiple of 256, weights as separate tensors);
- wrong m_splits (negative counts, a sum past the rows) are clamped alike:
  the same rows written with the same values, the others untouched;
- the entry point and the environment switch refuse bad input by name;
- a captured graph replays with new splits and indices bitwise equal to eager.
- Every machine: the fused op's fake (meta) shapes, as torch.compile sees them.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

import moe_grouped  # noqa: F401  (registers the ops)
from moe_grouped import _core
from moe_grouped.activation import swiglu
from moe_grouped._tensors import gather_rows

from cases import SPLIT_PATTERNS, capture_after_a_step, cuda_kernels_reason, make_splits, needs_cuda_kernels
from test_gathered_gemm import INDEX_PATTERNS, load_routing, make_index

FPROP_ENV = "MOE_GROUPED_GEMM_FPROP"


CUDA_REASON = cuda_kernels_reason(_core.CAP_FPROP_SWIGLU, "fc1 + SwiGLU kernels")
needs_kernels = needs_cuda_kernels(_core.CAP_FPROP_SWIGLU, "fc1 + SwiGLU kernels")

if CUDA_REASON is None:
    from moe_grouped.gemm import cuda_backend
else:  # collected but skipped
    cuda_backend = None

# (E, T, top_k, K, N): K a multiple of the 64-wide k-tile (else the cooperative
# kernel runs), N on and off the 256-column tile; 300 groups is past the
# ping-pong kernel's 256.
SHAPES = [(1, 77, 1, 64, 200), (4, 150, 2, 256, 520), (8, 512, 4, 512, 256), (64, 700, 6, 128, 512),
          (256, 600, 8, 192, 768), (300, 200, 4, 64, 256)]
SHAPE_IDS = ["E{}_T{}_k{}_K{}_N{}".format(*s) for s in SHAPES]
# fc1 + SwiGLU takes N = 2 * ffn in multiples of 16; the fused kernel needs 256 (else two passes).
SWIGLU_SHAPES = [s for s in SHAPES if s[4] % 16 == 0] + [(4, 150, 2, 256, 528)]
SWIGLU_SHAPE_IDS = ["E{}_T{}_k{}_K{}_N{}".format(*s) for s in SWIGLU_SHAPES]


def _operands(shape, pattern, index_pattern, splits_dtype=torch.int32, seed=0):
    num_experts, tokens, top_k, k, n = shape
    rows = tokens * top_k
    gen = torch.Generator().manual_seed(seed)
    m_splits = torch.tensor(make_splits(pattern, num_experts, rows, seed), dtype=splits_dtype, device="cuda")
    index = make_index(index_pattern, rows, tokens, top_k, seed).cuda()
    x = torch.randn(tokens, k, generator=gen).bfloat16().cuda()
    w = [(torch.randn(num_experts, n, k, generator=gen) / k**0.5).bfloat16().cuda()]
    return m_splits, index, x, w


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)  # NaN-safe bitwise comparison


def _assert_bitwise(got, expected, case):
    assert got.shape == expected.shape and got.dtype == expected.dtype, case
    assert torch.equal(_bits(got), _bits(expected)), (
        f"{case}: {(_bits(got) != _bits(expected)).sum().item()} elements differ")


def _on(kernel, monkeypatch, fn, *args):
    monkeypatch.setenv(FPROP_ENV, kernel)
    try:
        return fn(*args)
    finally:
        monkeypatch.delenv(FPROP_ENV)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("splits_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_cuda_pingpong_fprop_equals_the_cooperative_kernel(shape, pattern, splits_dtype, monkeypatch):
    m_splits, index, x, w = _operands(shape, pattern, "routing", splits_dtype)
    xp = gather_rows(x, index)
    case = f"{shape=} {pattern=} {splits_dtype=}"
    runs = {kernel: _on(kernel, monkeypatch, cuda_backend.fprop, xp, w, m_splits, None, torch.bfloat16)
            for kernel in ("pingpong", "cutlass")}
    _assert_bitwise(runs["pingpong"], runs["cutlass"], "fprop " + case)
    # The core's own choice is one of the two.
    _assert_bitwise(cuda_backend.fprop(xp, w, m_splits, None, torch.bfloat16), runs["cutlass"], "auto " + case)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("index_pattern", INDEX_PATTERNS)
@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_cuda_pingpong_gathered_fprop_equals_the_cooperative_kernel(shape, pattern, index_pattern, monkeypatch):
    m_splits, index, x, w = _operands(shape, pattern, index_pattern)
    runs = {kernel: _on(kernel, monkeypatch, cuda_backend.fprop_gathered, x, index, w, m_splits, torch.bfloat16)
            for kernel in ("pingpong", "cutlass")}
    _assert_bitwise(runs["pingpong"], runs["cutlass"], f"gathered fprop {shape=} {pattern=} {index_pattern=}")


def _fprop_then_swiglu(x, index, w, m_splits):
    g = (cuda_backend.fprop_gathered(x, index, w, m_splits, torch.bfloat16) if index is not None
         else cuda_backend.fprop(x, w, m_splits, None, torch.bfloat16))
    return g, swiglu(g, backend="cuda")


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("gathered", [True, False], ids=["gathered", "stored"])
@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
@pytest.mark.parametrize("shape", SWIGLU_SHAPES, ids=SWIGLU_SHAPE_IDS)
def test_cuda_fprop_swiglu_is_the_gemm_then_the_pass(shape, pattern, gathered, monkeypatch):
    """With N a multiple of 256 the ping-pong kernel computes h in its epilogue; elsewhere, and forced onto
    the cooperative kernel, the core runs the GEMM and the pass. Bitwise the two calls either way."""
    m_splits, index, x, w = _operands(shape, pattern, "unmapped_rows", seed=1)
    if not gathered:
        x, index = gather_rows(x, index), None
    expected_g, expected_h = _fprop_then_swiglu(x, index, w, m_splits)
    for kernel in ("auto", "pingpong", "cutlass"):
        g, h = _on(kernel, monkeypatch, cuda_backend.fprop_swiglu, x, index, w, m_splits)
        case = f"{kernel=} {shape=} {pattern=} {gathered=}"
        _assert_bitwise(g, expected_g, "g " + case)
        _assert_bitwise(h, expected_h, "h " + case)


@pytest.mark.gpu
@needs_kernels
def test_cuda_fprop_swiglu_with_separate_expert_weights():
    # An [E] list of weights is a pointer array, which the ping-pong kernel does not take: two passes.
    m_splits, index, x, w = _operands((8, 512, 4, 512, 256), "skewed", "routing", seed=2)
    separate = [t.clone() for t in w[0].unbind(0)]
    g, h = cuda_backend.fprop_swiglu(x, index, separate, m_splits)
    expected_g, expected_h = _fprop_then_swiglu(x, index, w, m_splits)
    _assert_bitwise(g, expected_g, "g")
    _assert_bitwise(h, expected_h, "h")


def _raw_fprop(x, w, m_splits, out, h=None, kernel="auto", monkeypatch=None):
    """The C entry point on preset outputs (the Python wrappers allocate theirs), so unwritten rows show."""
    lib = _core.require()
    num_experts, n, k = w.shape
    problem = cuda_backend.grouped_problem(out, m_splits, num_experts, n, k, cuda_backend.SLOT_FPROP_DGRAD,
                                    dtype=torch.bfloat16)
    monkeypatch.setenv(FPROP_ENV, kernel)
    stream = _core.stream_handle(x.device)
    if h is None:
        status = lib.mg_grouped_fprop(ctypes.byref(problem), x.data_ptr(), cuda_backend.group_operand([w]), None,
                                      out.data_ptr(), _core.dtype_code(torch.bfloat16), stream)
    else:
        status = lib.mg_grouped_fprop_swiglu(ctypes.byref(problem), x.data_ptr(), None, cuda_backend.group_operand([w]),
                                             out.data_ptr(), h.data_ptr(), stream)
    _core.check(status)
    torch.cuda.synchronize()


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("splits", [[-5, 300, 100, 7], [700, 900, 3, 0], [0, 0, -1, 2**31 - 1], [100, -100, 150, 50]],
                         ids=["negative", "past_the_rows", "huge", "negative_then_more"])
@pytest.mark.parametrize("splits_dtype", [torch.int32, torch.int64], ids=str)
def test_cuda_pingpong_fprop_clamps_wrong_splits_as_the_cooperative_kernel(splits, splits_dtype, monkeypatch):
    """Counts clamped to [0, rows], groups cut where the buffer ends (core/setup.cuh): the same rows written
    with the same values; rows no group reaches keep their NaN."""
    gen = torch.Generator().manual_seed(4)
    rows, k, n = 600, 128, 512
    x = torch.randn(rows, k, generator=gen).bfloat16().cuda()
    w = (torch.randn(len(splits), n, k, generator=gen) / k**0.5).bfloat16().cuda()
    m_splits = torch.tensor(splits, dtype=splits_dtype, device="cuda")
    outs = {}
    for kernel in ("pingpong", "cutlass"):
        y = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        _raw_fprop(x, w, m_splits, y, kernel=kernel, monkeypatch=monkeypatch)
        g = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        h = torch.full((rows, n // 2), float("nan"), dtype=torch.bfloat16, device="cuda")
        _raw_fprop(x, w, m_splits, g, h, kernel=kernel, monkeypatch=monkeypatch)
        outs[kernel] = (y, g, h)
    _assert_bitwise(outs["pingpong"][0], outs["cutlass"][0], f"y {splits=}")
    _assert_bitwise(outs["pingpong"][1], outs["cutlass"][1], f"g {splits=}")
    # h past the clamped sum is not specified (the two-pass fallback computes it from g's unwritten rows).
    clamped = min(sum(max(0, min(c, rows)) for c in splits), rows)
    _assert_bitwise(outs["pingpong"][2][:clamped], outs["cutlass"][2][:clamped], f"h {splits=}")
    written = ~torch.isnan(outs["pingpong"][0].float()).all(dim=1)
    assert int(written.sum()) == clamped and bool(written[:clamped].all()), f"{splits=}: rows written"


@pytest.mark.gpu
@needs_kernels
def test_cuda_fprop_swiglu_entry_point_refuses_bad_input(monkeypatch):
    lib = _core.require()
    m_splits, index, x, w = _operands((4, 150, 2, 256, 512), "balanced", "routing")
    rows = index.shape[0]
    g = torch.empty(rows, 512, dtype=torch.bfloat16, device="cuda")
    h = torch.empty(rows, 256, dtype=torch.bfloat16, device="cuda")
    stream = _core.stream_handle(x.device)

    def call(source=x, gather=None, n=512, dtype=torch.bfloat16, out=g):
        problem = cuda_backend.grouped_problem(out, m_splits, 4, n, 256, cuda_backend.SLOT_FPROP_DGRAD, total_rows=rows,
                                        dtype=dtype)
        rows_arg = ctypes.byref(gather) if gather is not None else None
        return lib.mg_grouped_fprop_swiglu(ctypes.byref(problem), source.data_ptr(), rows_arg,
                                           cuda_backend.group_operand(w), out.data_ptr(), h.data_ptr(), stream)

    good = _core.RowGather(index=index.data_ptr(), source_rows=x.shape[0])
    _core.check(call(gather=good))
    with pytest.raises(_core.UnsupportedError, match="built for bf16"):
        _core.check(call(dtype=torch.float16))
    with pytest.raises(ValueError, match="multiple of 16"):
        _core.check(call(n=520))
    with pytest.raises(ValueError, match="source_rows must be in"):
        _core.check(call(gather=_core.RowGather(index=index.data_ptr(), source_rows=0)))
    with pytest.raises(ValueError, match="row index must be a device pointer"):
        _core.check(call(gather=_core.RowGather(index=None, source_rows=150)))
    with pytest.raises(ValueError, match="16-byte"):
        _core.check(call(out=g.view(-1)[1:]))
    monkeypatch.setenv(FPROP_ENV, "fastest")
    with pytest.raises(ValueError, match="expected auto, pingpong or cutlass"):
        _core.check(call(gather=good))


@pytest.mark.gpu
@needs_kernels
def test_cuda_pingpong_graph_replays_with_new_index_and_splits():
    """fc1 with SwiGLU (gathered) and fc2 on the ping-pong kernel, captured once, replayed with new routing."""
    num_experts, tokens, top_k, hidden, ffn = 16, 300, 4, 256, 256
    rows = tokens * top_k
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16().cuda()
    w1 = [(torch.randn(num_experts, 2 * ffn, hidden, generator=gen) / hidden**0.5).bfloat16().cuda()]
    w2 = [(torch.randn(num_experts, hidden, ffn, generator=gen) / ffn**0.5).bfloat16().cuda()]
    m_splits = torch.empty(num_experts, dtype=torch.int32, device="cuda")
    index = torch.empty(rows, dtype=torch.int32, device="cuda")

    def step():
        g, h = cuda_backend.fprop_swiglu(x, index, w1, m_splits)
        return g, h, cuda_backend.fprop(h, w2, m_splits, None, torch.bfloat16)

    load_routing(m_splits, index, tokens, top_k, 0)
    graph, static = capture_after_a_step(step)
    for seed in range(1, 41):
        load_routing(m_splits, index, tokens, top_k, seed)
        graph.replay()
        expected = step()
        for name, got, want in zip(("g", "h", "y"), static, expected):
            _assert_bitwise(got, want, f"replay {seed}: {name}")


def test_fprop_swiglu_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(10, 64, dtype=torch.bfloat16)
        w = [torch.empty(4, 256, 64, dtype=torch.bfloat16)]
        m_splits = torch.empty(4, dtype=torch.int32)
        g, h = torch.ops.moe_grouped.grouped_fprop_swiglu(x, None, w, m_splits)
        assert g.shape == (10, 256) and h.shape == (10, 128) and h.dtype == torch.bfloat16
        index = torch.empty(30, dtype=torch.int32)
        g, h = torch.ops.moe_grouped.grouped_fprop_swiglu(x, index, w, m_splits)
        assert g.shape == (30, 256) and h.shape == (30, 128)
