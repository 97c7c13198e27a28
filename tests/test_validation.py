"""Bad input fails loudly with the values, never with a wrong answer."""

import pytest
import torch

import moe_grouped
from moe_grouped import GroupedLinear, gemm


@pytest.fixture
def layer():
    return GroupedLinear(3, 8, 4, backend="torch")


def test_wrong_dtype(layer):
    with pytest.raises(TypeError, match="float64"):
        layer(torch.randn(6, 8, dtype=torch.float64), [2, 2, 2])


def test_integer_input(layer):
    with pytest.raises(TypeError, match="dtype"):
        layer(torch.ones(6, 8, dtype=torch.int64), [2, 2, 2])


def test_wrong_rank(layer):
    with pytest.raises(ValueError, match="2-D"):
        layer(torch.randn(2, 3, 8), [2, 2, 2])


def test_in_features_mismatch(layer):
    with pytest.raises(ValueError, match=r"in_features"):
        layer(torch.randn(6, 7), [2, 2, 2])


def test_non_contiguous_input(layer):
    x = torch.randn(8, 6).t()
    with pytest.raises(ValueError, match="contiguous"):
        layer(x, [2, 2, 2])


def test_splits_wrong_length(layer):
    with pytest.raises(ValueError, match="3 entries"):
        layer(torch.randn(6, 8), [3, 3])
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        layer(torch.randn(6, 8), torch.tensor([3, 3]))


def test_negative_count(layer):
    with pytest.raises(ValueError, match="non-negative"):
        layer(torch.randn(6, 8), [4, -1, 3])


def test_splits_not_summing_to_rows(layer):
    with pytest.raises(ValueError, match="sum to the number of rows 6, got sum 7"):
        layer(torch.randn(6, 8), [2, 2, 3])


def test_float_splits(layer):
    with pytest.raises(TypeError, match="int32 or int64"):
        layer(torch.randn(6, 8), torch.tensor([2.0, 2.0, 2.0]))
    with pytest.raises(TypeError, match="Python ints"):
        layer(torch.randn(6, 8), [2.0, 2, 2])


def test_device_splits_are_not_read_on_host_by_default(layer):
    # Without debug checks a device m_splits is trusted (reading it would sync):
    # a wrong sum is clamped, never out of bounds.
    y = layer(torch.randn(6, 8), torch.tensor([2, 2, 3]))
    assert y.shape == (6, 4)


def test_debug_checks_validate_device_splits(layer):
    moe_grouped.set_debug_checks(True)
    try:
        with pytest.raises(ValueError, match="sum to the number of rows"):
            layer(torch.randn(6, 8), torch.tensor([2, 2, 3]))
        with pytest.raises(ValueError, match="non-negative"):
            layer(torch.randn(6, 8), torch.tensor([4, -1, 3]))
        assert layer(torch.randn(6, 8), torch.tensor([2, 1, 3])).shape == (6, 4)
    finally:
        moe_grouped.set_debug_checks(False)


@pytest.mark.gpu
def test_wrong_device():
    layer = GroupedLinear(2, 8, 4, device="cuda", backend="torch")
    with pytest.raises(ValueError, match="cpu"):
        layer(torch.randn(4, 8), [2, 2])
    with pytest.raises(ValueError, match="m_splits is on cuda"):
        GroupedLinear(2, 8, 4, backend="torch")(torch.randn(4, 8), torch.tensor([2, 2], device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [0, 3])
def test_torch_backend_refuses_more_experts_than_grouped_mm_takes_on_cuda(rows):
    """Found by the GPU fuzz: torch._grouped_mm raised its own error for 1024 groups and took zero rows."""
    x, w = torch.randn(rows, 8, device="cuda", dtype=torch.bfloat16), torch.randn(1024, 8, 8, device="cuda",
                                                                                    dtype=torch.bfloat16)
    m_splits = torch.zeros(1024, dtype=torch.int64, device="cuda")
    m_splits[5] = rows
    with pytest.raises(ValueError, match="at most 1023 experts on CUDA; m_splits holds 1024"):
        gemm.grouped_fprop(x, [w], m_splits, backend="torch")
    with pytest.raises(ValueError, match="at most 1023 experts"):
        gemm.grouped_wgrad(x, x, m_splits, num_groups=1024, backend="torch")
    y = gemm.grouped_fprop(x, [w[:1023]], m_splits[:1023], backend="torch")  # 1023 runs
    torch.testing.assert_close(y.float(), (x.float() @ w[5].float().t()) if rows else y.float(), atol=0.1, rtol=0.02)


@pytest.mark.gpu
def test_splits_to_offsets_device_cuda_takes_splits_on_the_current_gpu():
    """Found by the GPU fuzz: device='cuda' was compared unequal to the splits' cuda:0."""
    m_splits = torch.tensor([2, 0, 3], device="cuda")
    for splits in (m_splits, [2, 0, 3]):
        offsets = gemm.splits_to_offsets(splits, 5, device="cuda", backend="torch")
        assert offsets.device == m_splits.device and offsets.tolist() == [0, 2, 2, 5]


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        GroupedLinear(2, 8, 4, backend="cublas")


def test_cuda_backend_on_cpu_is_refused_not_swapped():
    layer = GroupedLinear(2, 8, 4, backend="cuda")
    with pytest.raises(RuntimeError, match="backend 'cuda' was requested but is unavailable"):
        layer(torch.randn(4, 8), [2, 2])


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="num_experts"):
        GroupedLinear(0, 8, 4)
    with pytest.raises(ValueError, match="in_features"):
        GroupedLinear(2, -1, 4)


def test_ops_check_weights_and_bias():
    x = torch.randn(4, 8)
    with pytest.raises(TypeError, match="weights must be a list"):
        gemm.grouped_fprop(x, torch.randn(2, 4, 8), [2, 2])
    with pytest.raises(ValueError, match="weights\\[1\\] has shape"):
        gemm.grouped_fprop(x, [torch.randn(4, 8), torch.randn(5, 8)], [2, 2])
    with pytest.raises(ValueError, match=r"bias must have shape \(2, 4\)"):
        gemm.grouped_fprop(x, [torch.randn(2, 4, 8)], [2, 2], torch.randn(2, 5))
    with pytest.raises(ValueError, match="out_features=4"):
        gemm.grouped_dgrad(torch.randn(4, 5), [torch.randn(2, 4, 8)], [2, 2])
    with pytest.raises(ValueError, match="num_groups"):
        gemm.grouped_wgrad(torch.randn(4, 4), x, [2, 2])
    with pytest.raises(ValueError, match="accumulate=True needs"):
        gemm.grouped_wgrad(torch.randn(4, 4), x, [2, 2], num_groups=2, accumulate=True)


# The reference backend reads m_splits on the host anyway, so a tensor m_splits
# on the tokens' device is validated there like a list (issue 23).
BAD_TENSOR_SPLITS = [
    (torch.tensor([2, 2, 3]), ValueError, "sum to the number of rows 6 or fewer"),
    (torch.tensor([4, -1, 3]), ValueError, "non-negative"),
    (torch.tensor([3, 3]), ValueError, r"shape \(3,\)"),
    (torch.tensor([2.0, 2.0, 2.0]), TypeError, "int32 or int64"),
]


@pytest.mark.parametrize("splits,error,message", BAD_TENSOR_SPLITS)
def test_reference_backend_validates_tensor_splits(splits, error, message):
    layer = GroupedLinear(3, 8, 4, backend="reference")
    with pytest.raises(error, match=message):
        layer(torch.randn(6, 8), splits)
    weights = [torch.randn(3, 4, 8)]
    with pytest.raises(error, match=message):
        gemm.grouped_fprop(torch.randn(6, 8), weights, splits, backend="reference")
    with pytest.raises(error, match=message):
        gemm.grouped_dgrad(torch.randn(6, 4), weights, splits, backend="reference")
    with pytest.raises(error, match=message):
        gemm.grouped_wgrad(torch.randn(6, 4), torch.randn(6, 8), splits, num_groups=3, backend="reference")
    with pytest.raises(error, match=message):
        gemm.grouped_dbias(torch.randn(6, 4), splits, num_groups=3, backend="reference")


@pytest.mark.parametrize("splits,error,message", BAD_TENSOR_SPLITS)
@pytest.mark.parametrize("path", ["fused", "unfused"])
def test_grouped_mlp_on_the_reference_backend_validates_tensor_splits_on_both_paths(splits, error, message, path):
    # Found by tests/test_fuzz_layers.py: the fused path ran with such splits.
    mlp = moe_grouped.GroupedMLP(3, 8, 4, backend="reference", experts_path=path)
    with pytest.raises(error, match=message):
        mlp(torch.randn(6, 8), splits)


@pytest.mark.parametrize("path", [None, "fused", "unfused"])
def test_grouped_mlp_refuses_a_non_tensor_x_naming_it(path):
    # Found by tests/test_fuzz_layers.py: the default path choice read x.device first (AttributeError).
    mlp = moe_grouped.GroupedMLP(3, 8, 4, backend="reference", experts_path=path)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        mlp([[0.0] * 8] * 6, [2, 2, 2])


def test_reference_backend_takes_tensor_splits_covering_fewer_rows():
    # permute with a capacity leaves rows past sum(m_splits) that belong to no expert.
    layer = GroupedLinear(3, 8, 4, backend="reference")
    x = torch.randn(6, 8)
    y = layer(x, torch.tensor([2, 0, 3]))
    assert torch.allclose(y[:5], layer(x[:5], [2, 0, 3]))


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_debug_checks_accept_a_moe_layer_that_drops_tokens(backend):
    moe = moe_grouped.MoELayer(8, 16, num_experts=4, top_k=2, capacity_factor=0.5, drop_policy="position",
                               backend=backend)
    moe_grouped.set_debug_checks(True)
    try:
        assert moe(torch.randn(12, 8)).shape == (12, 8)
    finally:
        moe_grouped.set_debug_checks(False)


# Gaps the fuzz suite found (issue 23): each raised from internals, or was accepted.
FP8_BAD = [
    (dict(fp8_dtype=torch.float16), TypeError, "fp8_dtype"),
    (dict(fp8_dtype=torch.int8), TypeError, "fp8_dtype"),
    (dict(pow2_scales="yes"), TypeError, "pow2_scales"),
    (dict(amax_epsilon=-1.0), ValueError, "amax_epsilon"),
    (dict(amax_epsilon=float("nan")), ValueError, "amax_epsilon"),
]


@pytest.mark.parametrize("bad,error,message", FP8_BAD)
def test_fp8_quantizers_check_their_options(bad, error, message):
    from moe_grouped import fp8

    options = dict(fp8_dtype=torch.float8_e4m3fn, pow2_scales=True, amax_epsilon=0.0)
    options.update(bad)
    args = (options["fp8_dtype"], options["pow2_scales"], options["amax_epsilon"])
    x = torch.randn(4, 8)
    for call in (
        lambda: fp8.quantize_rowwise(x, *args),
        lambda: fp8.quantize_grouped(x, [1, 3], *args),
        lambda: fp8.quantize_columnwise_grouped(x, [4, 0], *args),
        lambda: fp8.quantize_weights_128x128(torch.randn(2, 3, 8), *args),
        lambda: fp8.quantize_1x128(x, *args),
        lambda: fp8.quantize_grouped_columnwise(x, [0, 0, 4], *args),
    ):
        with pytest.raises(error, match=message):
            call()


def test_fp8_quantizers_check_splits_and_weights():
    from moe_grouped import fp8

    with pytest.raises(TypeError, match="m_splits must be a tensor or a list"):
        fp8.quantize_grouped(torch.randn(4, 8), 3, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="sum to the number of rows 4"):
        fp8.quantize_grouped(torch.randn(4, 8), torch.tensor([1, 2]), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="at least one expert"):
        fp8.quantize_weights_128x128(torch.randn(0, 3, 8), torch.float8_e4m3fn)


def test_ops_check_out_dtype_num_groups_and_offsets_arguments():
    weights = [torch.randn(2, 3, 4)]
    with pytest.raises(TypeError, match="out_dtype"):
        gemm.grouped_fprop(torch.randn(4, 4), weights, [2, 2], out_dtype=torch.int32, backend="reference")
    with pytest.raises(TypeError, match="out_dtype"):
        gemm.grouped_dgrad(torch.randn(4, 3), weights, [2, 2], out_dtype="float", backend="reference")
    with pytest.raises(TypeError, match="out_dtype"):
        gemm.grouped_dbias(torch.randn(4, 3), [2, 2], out_dtype=torch.int64, backend="reference")
    with pytest.raises(ValueError, match="num_groups"):
        gemm.grouped_dbias(torch.randn(4, 3), [2, 2], num_groups=-1, backend="reference")
    with pytest.raises(ValueError, match="num_groups"):
        gemm.grouped_wgrad(torch.randn(4, 3), torch.randn(4, 2), [], num_groups=0, backend="reference")
    with pytest.raises(TypeError, match="accumulate"):
        gemm.grouped_wgrad(torch.randn(4, 3), torch.randn(4, 2), [2, 2], out=[torch.zeros(2, 3, 2)], accumulate=1)
    with pytest.raises(ValueError, match="m_splits must be 1-D"):
        gemm.grouped_dbias(torch.randn(4, 3), torch.tensor(4), backend="reference")
    with pytest.raises(ValueError, match="m_splits must be 1-D"):
        gemm.splits_to_offsets(torch.tensor(4), 4)
    with pytest.raises(TypeError, match="m_splits must be a tensor or a list"):
        gemm.splits_to_offsets(5, 5)
    for total_rows in (-3, 3.0, True):
        with pytest.raises(ValueError, match="total_rows"):
            gemm.splits_to_offsets([1, 2], total_rows)
    with pytest.raises(ValueError, match="at least one expert"):
        gemm.grouped_fprop(torch.randn(0, 4), [torch.randn(0, 3, 4)], [], backend="reference")


def test_torch_backend_takes_zero_rows():
    # torch._grouped_mm refuses an empty operand; the row count is static, so the backend returns early.
    weights = [torch.randn(3, 8, 16)]
    assert gemm.grouped_fprop(torch.randn(0, 16), weights, [0, 0, 0], backend="torch").shape == (0, 8)
    assert gemm.grouped_dgrad(torch.randn(0, 8), weights, [0, 0, 0], backend="torch").shape == (0, 16)
    (dw,) = gemm.grouped_wgrad(torch.randn(0, 8), torch.randn(0, 16), [0, 0, 0], num_groups=3, backend="torch")
    assert torch.equal(dw, torch.zeros(3, 8, 16))


def test_torch_backend_names_features_whose_rows_are_not_16_bytes():
    with pytest.raises(ValueError, match="in_features=3"):
        gemm.grouped_fprop(torch.randn(2, 3), [torch.randn(2, 8, 3)], [1, 1], backend="torch")
    with pytest.raises(ValueError, match="out_features=5"):
        gemm.grouped_dgrad(torch.randn(2, 5), [torch.randn(2, 5, 8)], [1, 1], backend="torch")
