"""DDP and FSDP2 (``fully_shard``) around MoELayer and GroupedLinear.

Two CPU processes on gloo, each with half of the batch, must produce the
gradients one process gets for the same model on the whole batch (fp32,
tight tolerance). Each run has a deadline, so a hang fails instead of
blocking CI.

``fuse_wgrad_accumulation`` puts weight gradients into ``main_grad`` and gives
autograd none, so DDP and FSDP2 (which reduce ``.grad``) have nothing to
reduce for those weights: it is meant for Megatron-style data parallelism,
which reduces the ``main_grad`` buffers itself. That is what is tested for
it here.
"""

from __future__ import annotations

import gc
import os
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from moe_grouped import GroupedLinear, MoELayer
from process_groups import spawn_group

WORLD = 2
TOKENS_PER_RANK = 12
E, HIDDEN, FFN, TOP_K = 4, 16, 32, 2
DEADLINE_S = 600  # generous: CI machines may be loaded; a hang still fails
MODELS = ("linear-grouped", "linear-separate", "moe-grouped", "moe-separate")


def _build(model: str, fuse: bool = False) -> torch.nn.Module:
    """The same parameters in every process (seeded)."""
    torch.manual_seed(0)
    kind, layout = model.split("-")
    grouped = layout == "grouped"
    if kind == "linear":
        return GroupedLinear(E, HIDDEN, FFN, single_grouped_weight=grouped, fuse_wgrad_accumulation=fuse,
                             backend="reference")
    return MoELayer(HIDDEN, FFN, E, TOP_K, single_grouped_weight=grouped, bias=True,
                    shared_expert_ffn_hidden=8, fuse_wgrad_accumulation=fuse, backend="reference")


def _batch(model: str):
    """(inputs, output cotangent) of the whole batch; rank r takes rows [r * T, (r + 1) * T)."""
    gen = torch.Generator().manual_seed(1)
    total = WORLD * TOKENS_PER_RANK
    x = torch.randn(total, HIDDEN, generator=gen)
    out_features = FFN if model.startswith("linear") else HIDDEN
    cotangent = torch.randn(total, out_features, generator=gen)
    return x, cotangent


def _splits(num_rows: int, seed: int) -> torch.Tensor:
    """Tokens per expert for GroupedLinear's input, with an empty expert."""
    gen = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randint(0, num_rows + 1, (E - 2,), generator=gen).tolist())
    counts = [a - b for a, b in zip([*cuts, num_rows], [0, *cuts])]
    return torch.tensor([counts[0], 0, *counts[1:]])


def _forward(module, model: str, x: torch.Tensor, seed: int) -> torch.Tensor:
    if model.startswith("linear"):
        return module(x, _splits(x.shape[0], seed))
    return module(x)


def _loss(module, model: str, rows: slice, divisor: int) -> torch.Tensor:
    """The loss of ``rows`` over ``divisor``. DDP and FSDP2 average the ranks'
    gradients, so the one-process loss is the mean of the ranks' losses."""
    x, cotangent = _batch(model)
    # GroupedLinear's rows are grouped per rank (each rank has its own m_splits).
    if model.startswith("linear"):
        seeds = range(rows.start // TOKENS_PER_RANK, rows.stop // TOKENS_PER_RANK)
        outs = [
            _forward(module, model, x[s * TOKENS_PER_RANK : (s + 1) * TOKENS_PER_RANK], seed=s) for s in seeds
        ]
        out = torch.cat(outs)
    else:
        out = _forward(module, model, x[rows], seed=0)
    return (out * cotangent[rows]).sum() / divisor


def _single_process_grads(model: str) -> dict[str, torch.Tensor]:
    module = _build(model)
    _loss(module, model, slice(0, WORLD * TOKENS_PER_RANK), WORLD).backward()
    return {name: p.grad.clone() for name, p in module.named_parameters()}


def _rank_grads(model: str, wrapper: str, rows: slice) -> dict:
    """This rank's gradients of one model under ``wrapper``.

    The wrapper (DDP's reducer, FSDP2's state) is built and released here,
    while the process group is alive: one left for the worker's frame to
    release after ``destroy_process_group`` was the suspect when rank 1 hung
    after its worker returned (rank 0 had exited; about 1 CI run in 8).
    """
    fuse = wrapper == "main_grad"
    module = _build(model, fuse=fuse)
    if wrapper == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(module)
    elif wrapper == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        if model.startswith("moe"):
            fully_shard(module.experts, mesh=mesh)
        wrapped = fully_shard(module, mesh=mesh)
    else:  # Megatron-style: fused wgrad into main_grad, which the caller reduces
        for name, param in module.named_parameters():
            param.main_grad = torch.zeros_like(param)
        wrapped = module
    # main_grad is summed over the ranks below, .grad is averaged by the wrappers.
    _loss(wrapped, model, rows, WORLD if fuse else 1).backward()
    if fuse:
        fused = [w for m in module.modules() if isinstance(m, GroupedLinear) for w in m.weights()]
        assert fused and all(w.grad is None for w in fused), "fused wgrad must leave .grad empty"
    grads = {}
    for name, param in module.named_parameters():
        if wrapper == "main_grad":
            grad = param.main_grad
            if param.grad is not None:  # parameters outside the experts produce .grad as usual
                grad = grad + param.grad
            dist.all_reduce(grad)
        else:
            grad = param.grad
            if hasattr(grad, "full_tensor"):  # FSDP2: a sharded DTensor
                grad = grad.full_tensor()
        grads[name] = grad.detach().clone()
    return grads


def _worker(rank: int, init_method: str, wrapper: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=DEADLINE_S // 2))
    try:
        rows = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
        results = {model: _rank_grads(model, wrapper, rows) for model in MODELS}
        gc.collect()  # anything the wrappers left in reference cycles goes while the group lives
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "grads.pt"))
        dist.barrier()  # both ranks are done with the group before either tears it down
    finally:
        dist.destroy_process_group()


def _run_two_processes(wrapper: str) -> dict:
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_group(_worker, WORLD, (wrapper, out_dir), timeout_s=DEADLINE_S)
        return torch.load(os.path.join(out_dir, "grads.pt"))


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2", "main_grad"])
def test_two_processes_match_one_process_on_the_whole_batch(wrapper):
    results = _run_two_processes(wrapper)
    assert set(results) == set(MODELS)
    for model in MODELS:
        expected = _single_process_grads(model)
        got = results[model]
        assert set(got) == set(expected), f"{wrapper} {model}: parameters {sorted(got)} vs {sorted(expected)}"
        for name, want in expected.items():
            torch.testing.assert_close(
                got[name], want, atol=1e-5, rtol=1e-5, msg=lambda m: f"{wrapper} {model} {name}: {m}"
            )
