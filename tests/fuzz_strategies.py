"""Shared strategies and rules of the property-based fuzz suite (tests/test_fuzz_*.py).

The rule every fuzzed call obeys: it returns what the float64 oracle returns
(within the dtype's tolerance), or it raises ValueError / TypeError /
RuntimeError whose message names the argument at fault. Never an IndexError
from internals, a crash, a hang or a silently wrong result.

Each property is a function ``prop(data, device)`` drawing everything from
``data``; :func:`fuzz_tests` turns it into a CPU test (500 examples,
derandomized so CI is reproducible) and a GPU test (``@pytest.mark.gpu``, 200
examples, the torch and cuda backends against the oracle on the host).
Examples stay tiny (a few tokens, features <= 16) so the CPU suite runs in
minutes; the expert count still goes up to 1024.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional, Union

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ALLOWED_ERRORS = (ValueError, TypeError, RuntimeError)
CPU_EXAMPLES = 500
GPU_EXAMPLES = 200

_COMMON = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
CPU_SETTINGS = settings(max_examples=CPU_EXAMPLES, **_COMMON)
GPU_SETTINGS = settings(max_examples=GPU_EXAMPLES, **_COMMON)

# Splits as given to an op: valid (a list, an int64 or int32 tensor) or invalid.
VALID_KINDS = ("list", "int64", "int32")
INVALID_KINDS = ("negative", "sum_over", "sum_under", "too_short", "too_long", "float_list", "float_tensor", "bool_list")


def fuzz_tests(prop: Callable) -> tuple[Callable, Callable]:
    """(cpu test, gpu test) running ``prop(data, device)``."""

    @CPU_SETTINGS
    @given(data=st.data())
    def cpu(data):
        prop(data, "cpu")

    @pytest.mark.gpu
    @GPU_SETTINGS
    @given(data=st.data())
    def gpu(data):
        prop(data, "cuda")

    return cpu, gpu


def backends_for(device: str) -> list[str]:
    """Backends under test: reference and torch on the CPU; torch and (when built) cuda on a GPU."""
    if device == "cpu":
        return ["reference", "torch"]
    names = ["torch"]
    if _cuda_gemm_available():
        names.append("cuda")
    return names


def _cuda_gemm_available() -> bool:
    import moe_grouped

    try:
        return moe_grouped.backends.resolve("cuda", torch.device("cuda")) == "cuda"
    except RuntimeError:
        return False


def float_dtypes(device: str, backend: str) -> list[torch.dtype]:
    """The grouped GEMM dtypes ``backend`` supports (cuda: bf16/fp16; torch: no float64)."""
    if backend == "cuda":
        return [torch.bfloat16, torch.float16]
    names = [torch.float32, torch.bfloat16]
    if backend == "reference":
        names.append(torch.float64)
    return names  # float16 only on cuda: torch._grouped_mm's fp16 support varies by torch version


def feature_dims(backend: str) -> st.SearchStrategy[int]:
    """N / K: tiny; multiples of 8 for the torch and cuda GEMMs (rows of 16 bytes)."""
    return st.integers(1, 9) if backend == "reference" else st.sampled_from([8, 16])


def num_experts() -> st.SearchStrategy[int]:
    """Mostly a handful, sometimes 1024 (the rule must hold for wide routing too)."""
    return st.one_of(st.integers(1, 5), st.integers(1, 5), st.integers(1, 5), st.sampled_from([64, 1024]))


def num_tokens() -> st.SearchStrategy[int]:
    """0 and 1 tokens are the edge cases; up to 12 otherwise."""
    return st.one_of(st.sampled_from([0, 1]), st.integers(0, 12))


@dataclass
class Splits:
    counts: list[int]  # the valid counts the invalid ones were derived from
    value: Union[list, torch.Tensor]  # what the op is given
    kind: str

    @property
    def valid(self) -> bool:
        return self.kind in VALID_KINDS

    @property
    def is_tensor(self) -> bool:
        return isinstance(self.value, torch.Tensor)

    def refused_everywhere(self) -> bool:
        """Wrong on the host side of every backend: length, dtype, or any invalid list."""
        return not self.valid and (not self.is_tensor or self.kind in ("too_short", "too_long", "float_tensor"))

    def tensor(self, device) -> torch.Tensor:
        return torch.tensor(self.counts, dtype=torch.int64, device=device)


@st.composite
def splits(draw, rows: int, groups: int, device: str = "cpu", allow_invalid: bool = True) -> Splits:
    """Tokens per expert for ``rows`` tokens and ``groups`` experts, valid or invalid."""
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    shape = draw(st.sampled_from(["random", "one_expert", "first_and_last"]))
    if rows == 0:
        counts = [0] * groups
    elif shape == "one_expert":
        counts = [0] * groups
        counts[int(torch.randint(groups, (1,), generator=gen))] = rows
    elif shape == "first_and_last" and groups > 1:
        counts = [0] * groups
        counts[0], counts[-1] = rows // 2, rows - rows // 2
    else:
        counts = torch.bincount(torch.randint(groups, (rows,), generator=gen), minlength=groups).tolist()
    kinds = VALID_KINDS + INVALID_KINDS if allow_invalid else VALID_KINDS
    kind = draw(st.sampled_from(kinds))
    as_tensor = draw(st.booleans())
    value: Union[list, torch.Tensor]
    bad = list(counts)
    if kind == "list":
        value = list(counts)
    elif kind in ("int64", "int32"):
        value = torch.tensor(counts, dtype=getattr(torch, kind), device=device)
    elif kind == "float_list":
        value = [float(c) for c in counts]
    elif kind == "bool_list":
        value = [bool(c) for c in counts]
    elif kind == "float_tensor":
        value = torch.tensor(counts, dtype=torch.float32, device=device)
    else:
        if kind == "negative":
            amount = draw(st.integers(1, 3))
            bad[0] -= counts[0] + amount  # negative, and (with 2+ experts) still summing to the rows
            if groups > 1:
                bad[-1] += counts[0] + amount
        elif kind == "sum_over":
            bad[-1] += draw(st.integers(1, 3))
        elif kind == "sum_under":
            if rows == 0:
                kind, bad[-1] = "sum_over", bad[-1] + 1
            else:
                i = max(range(groups), key=lambda e: bad[e])
                bad[i] -= 1
        elif kind == "too_short":
            bad = bad[:-1]
        elif kind == "too_long":
            bad = bad + [0]
        value = torch.tensor(bad, dtype=torch.int64, device=device) if as_tensor else bad
    if kind == "sum_under" and isinstance(value, torch.Tensor):
        # A device m_splits may cover fewer rows than the buffer (permute with a
        # capacity): not an error for tensors. Use a length error instead.
        kind, value = "too_long", torch.tensor(counts + [0], dtype=torch.int64, device=device)
    return Splits(counts, value, kind)


def mentions(error: BaseException, *names: str) -> bool:
    message = str(error)
    return any(re.search(re.escape(name), message) for name in names)


def call(fn: Callable) -> tuple[Optional[object], Optional[BaseException]]:
    """(result, None) or (None, the allowed error); anything else propagates and fails the example."""
    try:
        return fn(), None
    except ALLOWED_ERRORS as error:
        return None, error


def expect_error(error: Optional[BaseException], *names: str, case: str = "") -> None:
    assert error is not None, f"expected an error naming {names}, got a result: {case}"
    assert mentions(error, *names), f"{type(error).__name__} {error!s} does not name {names}: {case}"


def expect_ok(error: Optional[BaseException], case: str = "") -> None:
    if error is not None:
        raise AssertionError(f"valid call raised {type(error).__name__}: {error}: {case}") from error


def tolerance(dtype: torch.dtype) -> dict:
    return {
        torch.float64: dict(atol=1e-9, rtol=1e-9),
        torch.float32: dict(atol=1e-4, rtol=1e-4),
        torch.bfloat16: dict(atol=5e-2, rtol=2e-2),
        torch.float16: dict(atol=1e-2, rtol=1e-2),
    }[dtype]


def coarser(*dtypes: torch.dtype | None) -> torch.dtype:
    """The least precise of the dtypes (None ignored): the tolerance to compare with."""
    order = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
    return max((d for d in dtypes if d is not None), key=order.index)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, case: str) -> None:
    torch.testing.assert_close(
        actual.detach().cpu().double(), expected.detach().cpu().double(), **tolerance(dtype), msg=lambda m: f"{m}\n{case}"
    )


def randn(gen: torch.Generator, *shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """Small values (|x| <= ~2) so low-precision sums stay within tolerance."""
    return (torch.randn(*shape, generator=gen) / 2).to(dtype=dtype, device=device)


def generator(data) -> torch.Generator:
    return torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))


def bounds(counts):
    """(start, end) of each expert's rows for valid counts."""
    start = 0
    for count in counts:
        yield start, start + count
        start += count


def gemm_refused(backend: str, device: str, groups: int) -> bool:
    """The torch backend on CUDA refuses more experts than torch._grouped_mm takes."""
    from moe_grouped.gemm.torch_backend import MAX_CUDA_GROUPS

    return backend == "torch" and device != "cpu" and groups > MAX_CUDA_GROUPS


def check_splits_outcome(
    split: Splits, backend: str, error: Optional[BaseException], case: str, *, too_many_groups: bool = False
) -> bool:
    """Invalid splits: refused naming m_splits where they are read on the host. True if the call may go on.

    ``too_many_groups``: more experts than the backend takes (torch._grouped_mm on CUDA), refused naming m_splits.
    """
    if too_many_groups:
        expect_error(error, "m_splits", case=case)
        return False
    if split.valid:
        expect_ok(error, case)
        return True
    if split.refused_everywhere() or backend == "reference":
        expect_error(error, "m_splits", case=case)
        return False
    # A device tensor on a graph-safe backend is not read on the host: any
    # result is allowed (the kernels clamp the counts), an error must name it.
    if error is not None:
        expect_error(error, "m_splits", case=case)
    return False
