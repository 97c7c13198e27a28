"""The expert-parallel suite (tests/multi_gpu/ep_suite.py under torchrun) on 2 and on 4 GPUs.

Each size is skipped unless that many GPUs are visible. Set
``MOE_GROUPED_EP_REPLAYS`` to change the number of captured-step replays
(default 1000).
"""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

SUITE = pathlib.Path(__file__).resolve().parent / "multi_gpu" / "ep_suite.py"


@pytest.mark.gpu
@pytest.mark.parametrize("gpus", [2, 4])
def test_expert_parallel_suite(gpus):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs, {torch.cuda.device_count()} visible")
    env = dict(
        os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
        PYTHONUNBUFFERED="1",
    )
    replays = os.environ.get("MOE_GROUPED_EP_REPLAYS", "1000")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus), str(SUITE),
               "--replays", replays]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1500)
    output = result.stdout + result.stderr
    print(output)
    assert result.returncode == 0, f"the suite failed (exit {result.returncode}):\n{output[-6000:]}"
    assert f"all expert-parallel checks passed on {gpus} GPUs" in result.stdout, output[-6000:]
