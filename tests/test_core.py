"""The C ABI through ctypes: loading, errors, workspace manager, setup kernel."""

import os
import subprocess
import sys

import pytest
import torch

from moe_grouped import _core, workspace

needs_core = pytest.mark.skipif(not _core.available(), reason=f"core unavailable: {_core.unavailable_reason}")


def test_core_is_built_when_the_build_required_it():
    # CI builds with MOE_GROUPED_REQUIRE_CORE=1: then the core must have loaded.
    if os.environ.get("MOE_GROUPED_REQUIRE_CORE") == "1":
        assert _core.available(), _core.unavailable_reason
    else:
        assert _core.available() or _core.unavailable_reason


@needs_core
def test_abi_and_build_info():
    assert _core.lib.mg_abi_version() == _core.ABI_VERSION
    info = _core.lib.mg_build_info().decode()
    assert "sm_90a" in info and "setup" in info
    assert _core.has(_core.CAP_SETUP)


@needs_core
def test_invalid_slot_is_a_value_error_with_the_values():
    with pytest.raises(ValueError, match=r"slot must be in \[0, 8\), got 9"):
        workspace.stats(0, 9)
    with pytest.raises(ValueError, match="got -2"):
        workspace.release(0, -2)


@needs_core
def test_errors_carry_the_core_message():
    with pytest.raises(ValueError, match="m_splits must be int32 or int64, got float32"):
        _core.check(_core.lib.mg_grouped_setup(1, _core.dtype_code(torch.float32), 4, 8, 1, 1, 0, 1, None, None))
    with pytest.raises(ValueError, match="num_groups must be positive, got 0"):
        _core.check(_core.lib.mg_grouped_setup(1, _core.dtype_code(torch.int32), 0, 8, 1, 1, 0, 1, None, None))


@needs_core
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_no_gpu_is_reported_as_such_with_the_cuda_message():
    with pytest.raises(_core.CoreError, match=r"^no GPU: .*cudaGetDeviceCount failed") as error:
        workspace.stats(0, 0)
    assert error.value.status == _core.ERROR_CUDA


@pytest.mark.parametrize("cuda_error", ["cudaErrorNoDevice", "cudaErrorInsufficientDriver"])
def test_no_gpu_errors_say_so(monkeypatch, cuda_error):
    """The core's message for a machine without a usable GPU (as it reads on one) becomes "no GPU: ..."."""
    message = f"cudaGetDeviceCount failed: some runtime text ({cuda_error})"

    class Library:
        def mg_last_error(self):
            return message.encode()

    monkeypatch.setattr(_core, "lib", Library())
    with pytest.raises(_core.CoreError, match=r"^no GPU: .*'reference' or 'torch' backend") as error:
        _core.check(_core.ERROR_CUDA)
    assert message in str(error.value)
    message = "cudaMalloc failed: out of memory (cudaErrorMemoryAllocation)"  # other CUDA errors stay as they are
    with pytest.raises(_core.CoreError, match=r"^cudaMalloc failed"):
        _core.check(_core.ERROR_CUDA)


def test_info_command_reports_the_build():
    result = subprocess.run(
        [sys.executable, "-m", "moe_grouped", "info"], capture_output=True, text=True, check=True
    )
    assert "torch" in result.stdout and "core" in result.stdout
    if _core.available():
        assert "built and loaded" in result.stdout
    else:
        assert _core.unavailable_reason.split(":")[0] in result.stdout


gpu_core = [pytest.mark.gpu, needs_core]


@pytest.mark.gpu
@needs_core
def test_workspace_reserve_get_stats_release():
    device = torch.cuda.current_device()
    slot = 5  # a slot no op uses, so the test owns it
    workspace.release(device, slot)
    workspace.reserve(device, slot, 1000)
    first = workspace.stats(device, slot)
    assert first.capacity >= 1000 and first.grow_count == 1 and first.retired_bytes == 0
    pointer = workspace.get(device, slot, 500)
    assert pointer == workspace.get(device, slot, 1000), "a fitting request must not move the buffer"
    bigger = workspace.get(device, slot, 10 * first.capacity)
    grown = workspace.stats(device, slot)
    assert bigger != pointer and grown.grow_count == 2
    assert grown.retired_bytes == first.capacity, "the old buffer stays alive for graphs that captured it"
    assert grown.high_water == 10 * first.capacity
    workspace.release(device, slot)
    assert workspace.stats(device, slot).capacity == 0


@pytest.mark.gpu
@needs_core
def test_workspace_refuses_to_grow_during_capture_and_names_the_reservation():
    device = torch.cuda.current_device()
    slot = 6
    workspace.release(device, slot)
    workspace.reserve(device, slot, 4096)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with pytest.raises(_core.CaptureError, match=rf"reserve\({device}, {slot}, 1048576\)"):
            with torch.cuda.graph(graph, stream=stream):
                workspace.get(device, slot, 1 << 20)
    with torch.cuda.stream(stream), torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):
        workspace.get(device, slot, 4096)  # fits: fine during capture
    with pytest.raises(RuntimeError, match="before the capture starts"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            workspace.reserve(device, slot, 1 << 20)
    workspace.release(device, slot)


@pytest.mark.gpu
@needs_core
@pytest.mark.parametrize("num_groups", [1, 7, 256, 1500])
@pytest.mark.parametrize("splits_dtype", [torch.int32, torch.int64], ids=str)
def test_setup_kernel_offsets_and_problem_shapes(num_groups, splits_dtype):
    total = 4096
    gen = torch.Generator().manual_seed(num_groups)
    raw = torch.randint(0, 2 * total // num_groups + 2, (num_groups,), generator=gen)
    raw[::3] = 0
    raw[-1] += max(0, total - int(raw.sum()))  # may overshoot: exercises clamping
    m_splits = raw.to(splits_dtype).cuda()
    offsets = torch.empty(num_groups + 1, dtype=torch.int64, device="cuda")
    shapes = torch.empty(num_groups, 3, dtype=torch.int32, device="cuda")
    n, k = 48, 80
    expected_offsets = [0]
    for count in raw.tolist():
        expected_offsets.append(min(expected_offsets[-1] + count, total))
    counts = [b - a for a, b in zip(expected_offsets[:-1], expected_offsets[1:])]
    for kind, make in ((_core.GEMM_FPROP, lambda m: (m, n, k)), (_core.GEMM_DGRAD, lambda m: (m, k, n)), (_core.GEMM_WGRAD, lambda m: (n, k, m))):
        _core.check(
            _core.lib.mg_grouped_setup(
                m_splits.data_ptr(), _core.dtype_code(splits_dtype), num_groups, total, n, k, kind,
                offsets.data_ptr(), shapes.data_ptr(), _core.stream_handle(m_splits.device),
            )
        )
        assert offsets.tolist() == expected_offsets
        assert [tuple(s) for s in shapes.tolist()] == [make(c) for c in counts], f"kind {kind}"


def _sequence_args(cls, **fields):
    """A ``cls`` (the sequences' argument struct) of valid sizes and fake aligned addresses, then ``fields``."""
    problem = _core.GroupedProblem(num_groups=4, total_rows=32, n=0, k=0, m_splits=256,
                                   splits_dtype=_core.dtype_code(torch.int64),
                                   dtype=_core.dtype_code(torch.bfloat16), device=0, workspace_slot=0)
    args = cls(problem=problem, num_tokens=16, top_k=2, hidden=64, ffn=32, row_id_map=256, tokens=256,
               scratch=256)
    for name in ("g", "dout", "probs", "y", "index"):
        if any(name == f[0] for f in cls._fields_):
            setattr(args, name, 256)
    for name, value in fields.items():
        if name in ("dtype", "total_rows"):
            setattr(args.problem, name, value)
        else:
            setattr(args, name, value)
    return args


@needs_core
@pytest.mark.skipif(not _core.has(_core.CAP_EXPERTS_SEQUENCE), reason="core built without the experts sequences")
def test_experts_sequences_check_their_arguments_before_any_launch():
    import ctypes

    lib = _core.lib
    backward = (lib.mg_experts_backward_fc2, lib.mg_experts_backward_fc1)
    for entry in backward:
        with pytest.raises(ValueError, match="args must not be NULL"):
            _core.check(entry(None, None))
        args = _sequence_args(_core.ExpertsBackwardArgs, dtype=_core.dtype_code(torch.float32))
        with pytest.raises(ValueError, match="runs bf16 or fp16 operands, got float32"):
            _core.check(entry(ctypes.byref(args), None))
        args = _sequence_args(_core.ExpertsBackwardArgs, total_rows=0)
        with pytest.raises(ValueError, match="must be positive, got 0, 16, 2, 64, 32"):
            _core.check(entry(ctypes.byref(args), None))
        args = _sequence_args(_core.ExpertsBackwardArgs, scratch=0x101)
        with pytest.raises(ValueError, match="scratch must be 256-byte aligned"):
            _core.check(entry(ctypes.byref(args), None))
    args = _sequence_args(_core.ExpertsForwardArgs, dtype=_core.dtype_code(torch.float16))
    with pytest.raises(_core.UnsupportedError, match="gathered fc1 runs bf16 operands, got float16"):
        _core.check(lib.mg_experts_forward_fc(ctypes.byref(args), None))
    args = _sequence_args(_core.ExpertsForwardArgs, y=None)
    with pytest.raises(ValueError, match="scratch, g and y must be device pointers"):
        _core.check(lib.mg_experts_forward_fc(ctypes.byref(args), None))
    with pytest.raises(ValueError, match="top_k > 0, got 8, 4, 0"):
        _core.check(lib.mg_permute_source_rows(256, 8, 0, 4, 256, None))
    size = ctypes.c_size_t()
    with pytest.raises(ValueError, match="phase must be 2 \\(fc2\\) or 1 \\(fc1\\), got 3"):
        _core.check(lib.mg_experts_backward_scratch_bytes(3, 32, 64, 32, _core.dtype_code(torch.bfloat16),
                                                          ctypes.byref(size)))
    # Each buffer on a 256-byte boundary: index [32] int32 then h [32, 32] bf16.
    _core.check(lib.mg_experts_forward_scratch_bytes(32, 32, _core.dtype_code(torch.bfloat16), ctypes.byref(size)))
    assert size.value == 256 + 32 * 32 * 2
    # fc2 phase: rows [32, 64] and wh [32, 32] bf16, row weights and dprob [32] fp32.
    _core.check(lib.mg_experts_backward_scratch_bytes(2, 32, 64, 32, _core.dtype_code(torch.bfloat16),
                                                      ctypes.byref(size)))
    assert size.value == 32 * 64 * 2 + 32 * 32 * 2 + 256 + 256


@needs_core
@pytest.mark.skipif(not _core.has(_core.CAP_EXPERTS_SEQUENCE_FP8), reason="core built without the FP8 stages")
def test_fp8_experts_stages_check_their_arguments_before_any_launch():
    import ctypes

    lib = _core.lib
    stage = lib.mg_experts_fp8_stage
    with pytest.raises(ValueError, match="args must not be NULL"):
        _core.check(stage(None, _core.FP8_FORWARD_FC1, None))
    args = _sequence_args(_core.ExpertsFp8Args, dtype=_core.dtype_code(torch.float16))
    with pytest.raises(ValueError, match="run bf16 tokens, got float16"):
        _core.check(stage(ctypes.byref(args), _core.FP8_FORWARD_FC1, None))
    args = _sequence_args(_core.ExpertsFp8Args, total_rows=0)
    with pytest.raises(ValueError, match="must be positive, got 0, 16, 2, 64, 32"):
        _core.check(stage(ctypes.byref(args), _core.FP8_FORWARD_FC1, None))
    args = _sequence_args(_core.ExpertsFp8Args, index=None)
    with pytest.raises(ValueError, match="row_id_map, index and g must be device pointers"):
        _core.check(stage(ctypes.byref(args), _core.FP8_FORWARD_FC1, None))
    args = _sequence_args(_core.ExpertsFp8Args, scratch=0x101)
    with pytest.raises(ValueError, match="scratch must be 256-byte aligned"):
        _core.check(stage(ctypes.byref(args), _core.FP8_FORWARD_FC1, None))
    args = _sequence_args(_core.ExpertsFp8Args)
    with pytest.raises(ValueError, match="unknown stage 10"):
        _core.check(stage(ctypes.byref(args), 10, None))
    # Each stage names what it lacks before it launches anything.
    for number, missing in ((_core.FP8_FORWARD_FC2, "y"), (_core.FP8_BACKWARD_FC2_DGRAD, "row_weights"),
                            (_core.FP8_BACKWARD_SWIGLU, "dh"), (_core.FP8_BACKWARD_FC2_WGRAD, "wh_t"),
                            (_core.FP8_BACKWARD_DPROBS, "dprobs"), (_core.FP8_BACKWARD_FC1_DGRAD, "dxp"),
                            (_core.FP8_BACKWARD_DX, "dx"), (_core.FP8_BACKWARD_DG_COLUMNWISE, "dg_t"),
                            (_core.FP8_BACKWARD_FC1_WGRAD, "dg_t")):
        args = _sequence_args(_core.ExpertsFp8Args, y=None)
        with pytest.raises(ValueError, match=f"{missing}.* must be given for this stage"):
            _core.check(stage(ctypes.byref(args), number, None))
    size = ctypes.c_size_t()
    with pytest.raises(ValueError, match="unknown stage -1"):
        _core.check(lib.mg_experts_fp8_scratch_bytes(-1, 32, 64, 32, 4, ctypes.byref(size)))
    # FORWARD_FC1: x's row-wise copy, [32, 64] fp8 then [32, 1] fp32 scales, each on a 256-byte boundary.
    _core.check(lib.mg_experts_fp8_scratch_bytes(_core.FP8_FORWARD_FC1, 32, 64, 32, 4, ctypes.byref(size)))
    assert size.value == 32 * 64 + 256
    # FC1_DGRAD: dg's row-wise copy, [32, 64] fp8 and its scales.
    _core.check(lib.mg_experts_fp8_scratch_bytes(_core.FP8_BACKWARD_FC1_DGRAD, 32, 64, 32, 4, ctypes.byref(size)))
    assert size.value == 32 * 64 + 256
    _core.check(lib.mg_experts_fp8_scratch_bytes(_core.FP8_BACKWARD_DX, 32, 64, 32, 4, ctypes.byref(size)))
    assert size.value == 0
    # FC1_WGRAD: the tokens column-wise, [64, round_up(32, 128) + 128 * 4] fp8 then [1 + 4, 64] fp32 scales.
    _core.check(lib.mg_experts_fp8_scratch_bytes(_core.FP8_BACKWARD_FC1_WGRAD, 32, 64, 32, 4, ctypes.byref(size)))
    assert size.value == 64 * 640 + 5 * 64 * 4
