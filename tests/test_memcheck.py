"""The MoE layer's kernels under compute-sanitizer memcheck: no access outside the tensor it belongs to.

tools/memcheck_layer.py runs training steps of the layer (fused bf16 and FP8, unfused; routing that empties
experts; every capacity option) with PyTorch's caching allocator off, so that each tensor is its own
allocation and memcheck sees an access past any tensor's end. GPU, where compute-sanitizer is installed.
"""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from moe_grouped import _core

from cases import skip_without_cuda_kernels

TOOL = pathlib.Path(__file__).resolve().parents[1] / "tools" / "memcheck_layer.py"


@pytest.mark.gpu
def test_layer_steps_access_only_their_own_tensors():
    skip_without_cuda_kernels(_core.CAP_EXPERTS_SEQUENCE_FP8, "the fused FP8 experts path")
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        pytest.skip("compute-sanitizer is not on PATH")
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    result = subprocess.run([sanitizer, "--tool", "memcheck", "--error-exitcode", "7", sys.executable, str(TOOL)],
                            env=env, capture_output=True, text=True, timeout=900)
    report = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0, report
    assert "ERROR SUMMARY: 0 errors" in result.stdout, report
    assert "\ndone: " in result.stdout, report  # every case ran
