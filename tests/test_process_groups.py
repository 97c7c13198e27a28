"""The spawned-group helper the CPU multi-process tests rely on (tests/process_groups.py)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from process_groups import spawn_group


def _sum_ranks(rank: int, init_method: str, world: int) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        total = torch.tensor([float(rank)])
        dist.all_reduce(total)
        assert total.item() == world * (world - 1) / 2
    finally:
        dist.destroy_process_group()


def _rank_one_hangs(rank: int, init_method: str) -> None:
    if rank == 1:
        time.sleep(3600)


def _rank_one_raises(rank: int, init_method: str) -> None:
    if rank == 1:
        raise ValueError("rank 1 gives up")


def _rank_one_cannot_exit(rank: int, init_method: str) -> None:
    """Returns, but leaves what would block the interpreter's exit: a non-daemon thread that never ends
    and an atexit handler that never returns (the shape of the DDP test's old hang)."""
    if rank == 1:
        import atexit
        import threading

        threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()
        atexit.register(time.sleep, 3600)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_meet_through_the_file_store(world):
    spawn_group(_sum_ranks, world, (world,), timeout_s=120)


def test_a_hang_fails_with_the_ranks_stacks():
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failure:
        spawn_group(_rank_one_hangs, 2, timeout_s=20)
    message = str(failure.value)
    assert "did not finish in 20 s" in message
    assert "_rank_one_hangs" in message and "--- rank 1 (in its worker):" in message, message
    assert time.monotonic() - start < 60


def test_a_raising_rank_fails_with_its_error():
    with pytest.raises(Exception, match="rank 1 gives up"):
        spawn_group(_rank_one_raises, 2, timeout_s=120)


def test_a_rank_whose_worker_returned_exits_even_if_its_teardown_would_hang():
    start = time.monotonic()
    spawn_group(_rank_one_cannot_exit, 2, timeout_s=120)
    assert time.monotonic() - start < 100
