"""Spawned gloo process groups for the CPU multi-process tests.

The ranks meet through a file store in a fresh directory, not a TCP port:
a port picked free by the test and bound seconds later by rank 0 can be
taken in between. A rank that raises fails the test with its traceback; a
group that does not finish in time fails it with each rank's Python stack,
dumped by faulthandler shortly before the deadline.

A rank whose worker returned leaves with ``os._exit(0)``: its results are in
files by then, and nothing a test checks happens in the interpreter's
teardown (garbage collection of what the worker left, atexit handlers, C++
destructors of gloo's and the CUDA runtime's state with their threads still
running). That teardown is where the DDP test's rare hang sat: rank 1 stuck
after its worker had returned, rank 0 gone. A group past its deadline
reports, for each rank, whether it was still in its worker.
"""

from __future__ import annotations

import faulthandler
import os
import pathlib
import sys
import tempfile
import time

import pytest
import torch.multiprocessing as mp

STACK_MARGIN_S = 30.0  # the stacks are dumped this long before the deadline (at most half the time)


def spawn_group(worker, world: int, args: tuple = (), timeout_s: float = 600.0) -> None:
    """Runs ``worker(rank, init_method, *args)`` in ``world`` spawned processes.

    ``init_method`` is the ``file://`` URL to pass to
    ``torch.distributed.init_process_group``.
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_method = pathlib.Path(tmp, "store").as_uri()
        context = mp.start_processes(
            _run_rank, args=(worker, init_method, tmp, timeout_s, args), nprocs=world, join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1.0):  # raises ProcessRaisedException with the rank's traceback
            if time.monotonic() > deadline:
                states = [_state(tmp, rank, process.is_alive()) for rank, process in enumerate(context.processes)]
                for process in context.processes:
                    process.kill()
                stacks = "\n".join(
                    f"--- rank {rank} ({states[rank]}):\n{_read(os.path.join(tmp, f'stack{rank}.txt'))}"
                    for rank in range(world)
                )
                pytest.fail(f"the {world} gloo processes did not finish in {timeout_s} s; their stacks:\n{stacks}")


def _run_rank(rank: int, worker, init_method: str, tmp: str, timeout_s: float, args: tuple) -> None:
    with open(os.path.join(tmp, f"stack{rank}.txt"), "w") as stack_file:
        faulthandler.dump_traceback_later(timeout_s - min(STACK_MARGIN_S, timeout_s / 2), file=stack_file)
        try:
            worker(rank, init_method, *args)
        finally:
            faulthandler.cancel_dump_traceback_later()
    pathlib.Path(tmp, f"returned{rank}").touch()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: see the module docstring


def _state(tmp: str, rank: int, alive: bool) -> str:
    if not alive:
        return "exited"
    if os.path.exists(os.path.join(tmp, f"returned{rank}")):
        return "its worker returned; stuck on the way out"
    return "in its worker"


def _read(path: str) -> str:
    try:
        return pathlib.Path(path).read_text() or "(no stack dumped)"
    except OSError as error:
        return f"(unreadable: {error})"
