import os

import pytest
import torch

# "i/n": run the i-th of n interleaved shards of the collected tests (tools/device.sh runs the GPU
# suite as several processes this way).
SHARD_ENV = "MOE_GROUPED_TEST_SHARD"


def _keep_shard(config, items) -> None:
    shard = os.environ.get(SHARD_ENV)
    if not shard:
        return
    index, count = (int(part) for part in shard.split("/"))
    if not 0 <= index < count:
        raise pytest.UsageError(f"{SHARD_ENV} must be i/n with 0 <= i < n, got {shard!r}")
    config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % count != index])
    items[:] = items[index::count]


def pytest_collection_modifyitems(config, items):
    _keep_shard(config, items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _one_rank_group(backend: str, **options):
    """A 1-rank default process group of ``backend`` in this process for one test, then destroyed."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.fail("a process group is already initialised in the test process")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **options)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture
def one_rank_group():
    """A 1-rank gloo default group in this process (ep_size 1 needs no collectives)."""
    yield from _one_rank_group("gloo")


@pytest.fixture
def one_rank_nccl_group():
    """A 1-rank NCCL default group in this process: the peer transport's kernels then run on one GPU."""
    yield from _one_rank_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
