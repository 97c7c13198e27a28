import pytest
import torch


def pytest_collection_modifyitems(config, items):
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
