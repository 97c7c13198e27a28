"""The expert-parallel layer on several GPUs: run under torchrun, one process per GPU.

    torchrun --nproc-per-node N tests/multi_gpu/ep_suite.py [--replays 1000]

(tests/test_expert_parallel_multi_gpu.py launches it on 2 and on 4 GPUs
where that many are visible.) Every rank runs every check in the same order; a failed check
raises, so the process exits non-zero and torchrun reports the rank. Checks:

- ``peer`` (the core's kernels over symmetric memory), ``symm_mem``
  (torch's NVSHMEM all-to-all) and ``padded_all_to_all`` (NCCL, fixed
  sizes) against ``all_to_all`` (NCCL, host-read counts): outputs and every
  gradient bitwise equal, for option sets that include token dropping, a
  shared expert, fused/delayed wgrad and many experts per rank;
- the same layer against one :class:`moe_grouped.MoELayer` holding all
  experts, run on every rank's tokens;
- inside ``fp8_autocast`` (the experts' fused op in FP8): the transports
  bitwise equal to ``all_to_all`` and close to the MoELayer in FP8;
- the whole step (forward + backward) captured once and replayed with new
  routing (balanced, skewed, every copy to one rank's experts, experts that
  receive nothing): each replay bitwise equal to an eager step on the same
  inputs; the captured graph has no allocation and no host node;
- the receive-capacity rule: copies past ``capacity // ep_size`` per source
  are dropped identically by both transports, counted on the device (in
  replays too) and reported by ``check_overflow`` on every rank.
The replays run with ``peer`` and with ``padded_all_to_all``. Sizes derive
from the number of ranks, so the suite runs on any number of GPUs.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

# NVLink multicast stays off (NCCL, torch symmetric memory, NVSHMEM): on shared hosts a
# program that uses it can take the GPUs out of service. Set before anything starts.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import moe_grouped  # noqa: E402
from cases import assert_captured_safely, calc_diff, layer_train_step, reset_grads  # noqa: E402
from moe_grouped import MoELayer, graphs  # noqa: E402
from moe_grouped.parallel import CapacityOverflowError, ExpertParallelMoELayer  # noqa: E402
from moe_grouped.parallel.layer import kept_experts  # noqa: E402

DTYPE = torch.bfloat16
TRANSPORTS = ("all_to_all", "peer", "symm_mem", "padded_all_to_all")  # the first is the reference
HIDDEN, FFN, TOP_K, TOKENS = 128, 128, 2, 256


def say(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def backend() -> str:
    return "cuda" if moe_grouped.backends.cuda_unavailable_reason(torch.device("cuda")) is None else "torch"


def make_pair(experts: int, options: dict, dtype: torch.dtype = DTYPE, **ep_options):
    """One MoELayer holding all experts (same seed on every rank) and an EP layer per transport loaded from it."""
    torch.manual_seed(0)
    common = dict(dtype=dtype, device="cuda", backend=backend(), **options)
    ref = MoELayer(HIDDEN, FFN, experts, TOP_K, **common)  # the experts path the EP layers take
    layers = {
        name: ExpertParallelMoELayer(HIDDEN, FFN, experts, TOP_K, transport=name, max_tokens=TOKENS, **common,
                                     **ep_options).load_from(ref)
        for name in TRANSPORTS
    }
    return ref, layers


def gradients(layer) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in layer.named_parameters():
        g = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
        out[name] = torch.zeros_like(p) if g is None else g.clone()
    return out


def run(layer, x, dout, recipe=None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """One step of ``layer`` (inside fp8_autocast with ``recipe``): output, x.grad, parameter gradients."""
    reset_grads(layer)
    x = x.clone().requires_grad_(True)
    with moe_grouped.fp8.fp8_autocast(recipe, enabled=recipe is not None):
        out = layer(x)
    out.backward(dout)
    if layer.experts.fc1.delay_wgrad_compute:
        layer.backward_dw()
    return out.detach(), x.grad, gradients(layer)


def inputs(world: int, tokens: int = TOKENS, seed: int = 1, dtype: torch.dtype = DTYPE):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    xs = [torch.randn(tokens, HIDDEN, device="cuda", generator=gen).to(dtype) for _ in range(world)]
    douts = [torch.randn(tokens, HIDDEN, device="cuda", generator=gen).to(dtype) for _ in range(world)]
    return xs, douts


def reference_expert_grad(ref_grads: dict, name: str, first: int, ne: int) -> torch.Tensor:
    """The MoELayer gradient for EP expert parameter ``name`` (local experts from ``first``):
    a slice of a grouped parameter (``experts.fc1.weight``) or another index (``...weight3``)."""
    stem = name.rstrip("0123456789")
    if stem == name:
        return ref_grads[name][first : first + ne]
    return ref_grads[f"{stem}{first + int(name[len(stem):])}"]


def check_transports_and_reference(experts: int, options: dict, dtype: torch.dtype = DTYPE) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    case = f"E={experts} {options}" + ("" if dtype == DTYPE else f" {dtype}")
    ref, layers = make_pair(experts, options, dtype)
    xs, douts = inputs(world, dtype=dtype)
    results = {}
    for name, layer in layers.items():
        for _ in range(2):  # the second step runs on the buffers the first one set up
            results[name] = run(layer, xs[rank], douts[rank])
    out_a, dx_a, g_a = results["all_to_all"]
    for transport in TRANSPORTS[1:]:
        out_s, dx_s, g_s = results[transport]
        assert torch.equal(out_s, out_a), f"{case}: output differs between {transport} and all_to_all"
        assert torch.equal(dx_s, dx_a), f"{case}: x.grad differs between {transport} and all_to_all"
        for name in g_s:
            assert torch.equal(g_s[name], g_a[name]), f"{case}: {name} gradient differs, {transport}"
    # One layer holding all experts, run on every rank's tokens (gradients summed over them).
    ref_grads = None
    for r in range(world):
        out, dx, grads = run(ref, xs[r], douts[r])
        if r == rank:
            ref_out, ref_dx = out, dx
        ref_grads = grads if ref_grads is None else {n: ref_grads[n] + g.float() for n, g in grads.items()}
    # Each rank's weighted sum of a token's copies is rounded to bf16 before the ranks' sums are added
    # (MoELayer rounds once): about 2e-6 apart.
    assert calc_diff(out_s, ref_out) < 1e-5, f"{case}: output vs MoELayer {calc_diff(out_s, ref_out)}"
    assert calc_diff(dx_s, ref_dx) < 1e-5, f"{case}: x.grad vs MoELayer {calc_diff(dx_s, ref_dx)}"
    ne = experts // world
    for name, grad in g_s.items():
        if name.startswith("experts."):
            want = reference_expert_grad(ref_grads, name, rank * ne, ne)
        else:  # replicated: the caller's data-parallel all-reduce
            want = ref_grads[name]
            grad = grad.float()
            dist.all_reduce(grad)
        diff = calc_diff(grad, want)
        assert diff < 1e-5, f"{case}: {name} gradient vs MoELayer: calc_diff {diff}"
    say(f"  ok  {', '.join(TRANSPORTS[1:])} bitwise equal to all_to_all, == MoELayer  ({case})")


def check_fp8(experts: int) -> None:
    """Inside fp8_autocast (the experts' fused op in FP8): every transport bitwise equal to all_to_all,
    and close to one MoELayer in FP8 (its FP8 blocks hold other tokens: each rank quantizes its own)."""
    if not moe_grouped._core.has(moe_grouped._core.CAP_GROUPED_GEMM_FP8_BLOCKWISE):
        say("  skipped FP8: the core was built without its FP8 grouped GEMMs")
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    recipe = moe_grouped.fp8.Float8BlockScaling()
    ref, layers = make_pair(experts, {})
    xs, douts = inputs(world, seed=3)
    results = {name: run(layer, xs[rank], douts[rank], recipe) for name, layer in layers.items()}
    out_a, dx_a, g_a = results["all_to_all"]
    for transport in TRANSPORTS[1:]:
        out_s, dx_s, g_s = results[transport]
        assert torch.equal(out_s, out_a) and torch.equal(dx_s, dx_a), f"FP8: {transport} differs from all_to_all"
        assert all(torch.equal(g_s[n], g_a[n]) for n in g_s), f"FP8: a gradient differs, {transport}"
    ref_out, ref_dx, _ = run(ref, xs[rank], douts[rank], recipe)
    bf16_out, _, _ = run(ref, xs[rank], douts[rank])
    assert not torch.equal(ref_out, bf16_out), "fp8_autocast changed nothing"
    for what, got, want in (("output", out_a, ref_out), ("x.grad", dx_a, ref_dx)):
        assert calc_diff(got, want) < 5e-3, f"FP8 {what} vs MoELayer in FP8: calc_diff {calc_diff(got, want)}"
    say(f"  ok  FP8: {', '.join(TRANSPORTS[1:])} bitwise equal to all_to_all, close to MoELayer in FP8 (E={experts})")


# ------------------------------------------------------------------ graphs with new routing
def steer_router(layer, experts: int) -> None:
    """The gate reads hidden unit e as expert e's logit, so an input chooses its experts."""
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:, :experts].copy_(torch.eye(experts) * 4)


def routed_input(pattern: str, experts: int, world: int, gen: torch.Generator, step: int) -> torch.Tensor:
    x = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen)
    logits = x[:, :experts]
    ne = experts // world
    if pattern == "skewed":  # most copies to the first few experts
        logits += torch.linspace(6, 0, experts, device="cuda")
    elif pattern == "one_rank":  # every copy to the experts of one rank
        owner = step % world
        logits[:, owner * ne : (owner + 1) * ne] += 50
    elif pattern == "zero_token":  # every third expert receives nothing
        logits[:, ::3] -= 50
    return x.to(DTYPE)


PATTERNS = ("balanced", "skewed", "one_rank", "zero_token")


def check_replays(experts: int, replays: int, options: dict, transport: str = "peer") -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layer = ExpertParallelMoELayer(
        HIDDEN, FFN, experts, TOP_K, transport=transport, max_tokens=TOKENS, dtype=DTYPE, device="cuda",
        backend=backend(), **options,
    )
    steer_router(layer, experts)
    step = layer_train_step(layer)
    gen = torch.Generator(device="cuda").manual_seed(100 + rank)
    static_x = routed_input("balanced", experts, world, gen, 0)
    captured = graphs.capture_step(step, static_x, torch.randn_like(static_x))
    counts = assert_captured_safely(captured.graph)  # no host nodes or copies (no syncs), no allocations
    seen = {p: set() for p in PATTERNS}
    empty_local = 0
    start = time.perf_counter()
    for replay in range(replays):
        pattern = PATTERNS[replay % len(PATTERNS)]
        x = routed_input(pattern, experts, world, gen, replay // len(PATTERNS))
        dout = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).to(DTYPE)
        got = [t.clone() for t in captured(x, dout)]
        want = step(x, dout)
        for i, (a, b) in enumerate(zip(got, want)):
            if not torch.equal(a, b):
                raise AssertionError(
                    f"{transport} E={experts} {options} replay {replay} ({pattern}), rank {rank}: output {i} differs from "
                    f"eager (calc_diff {calc_diff(a.float(), b.float())})"
                )
        per_expert = got[1]
        seen[pattern].add(tuple(per_expert.tolist()))
        if pattern == "one_rank":
            owner = (replay // len(PATTERNS)) % world
            ne = experts // world
            outside = torch.cat([per_expert[: owner * ne], per_expert[(owner + 1) * ne :]])
            assert int(outside.sum()) == 0, f"one_rank pattern routed copies outside rank {owner}: {per_expert.tolist()}"
        if pattern == "zero_token":
            assert int(per_expert[::3].sum()) == 0, per_expert.tolist()
            empty_local += 1
    layer.check_overflow()  # the default capacity (worst case) never drops
    elapsed = time.perf_counter() - start
    for pattern, routings in seen.items():
        assert len(routings) > 1 or replays < 2 * len(PATTERNS), f"{pattern}: the routing never changed"
    say(f"  ok  {transport}: {replays} replays bitwise equal to eager, 4 routing patterns, E={experts} {options} "
        f"({elapsed:.1f} s; graph: {counts})")


# ------------------------------------------------------------------ capacity and overflow
def expect_overflow(layer, dropped: int, what: str) -> None:
    """``check_overflow`` raises, reporting ``dropped`` copies over the whole group."""
    try:
        layer.check_overflow()
    except CapacityOverflowError as error:
        assert str(error).startswith(f"{dropped} token copies did not fit"), f"{what}: {error}"
    else:
        raise AssertionError(f"{what}: check_overflow did not raise after {dropped} dropped copies")


def check_overflow(experts: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    budget = 16
    _, layers = make_pair(experts, {}, capacity=budget * world)
    xs, douts = inputs(world, seed=3)
    results, routing = {}, None
    for name, layer in layers.items():
        with torch.no_grad():
            results[name] = layer(xs[rank])
        routing = layer.last_routing
    for name in TRANSPORTS[1:]:
        assert torch.equal(results[name], results["all_to_all"]), f"{name} dropped differently from all_to_all"
    assert torch.isfinite(results["peer"]).all()
    row_id_map, m_splits = torch.ops.moe_grouped.permute_index(routing.experts, None, experts, -1, False, "torch")
    _, dropped = kept_experts(routing.experts, row_id_map, m_splits, world, budget)
    total = dropped.clone()
    dist.all_reduce(total)
    assert int(total) > 0, "the check needs copies past the budget"
    for name, layer in layers.items():
        expect_overflow(layer, int(total), f"{name}, eager")
    for name in TRANSPORTS[1:]:
        layer = layers[name]
        layer.check_overflow()  # reset by the raise above: nothing since
        captured = graphs.capture_step(layer, xs[rank].clone(), num_warmup_iters=1)
        layer.overflow_count.zero_()
        for _ in range(3):
            out = captured(xs[rank])
        torch.cuda.synchronize()
        assert int(layer.overflow_count) == 3 * int(dropped), (name, int(layer.overflow_count), int(dropped))
        assert torch.equal(out, results[name]), f"{name}: replay differs from eager under drops"
        expect_overflow(layer, 3 * int(total), f"{name}, 3 replays")
    say(f"  ok  capacity {budget * world} (budget {budget} a source): {int(total)} copies dropped alike by every "
        "transport, counted in replays, reported on every rank")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replays", type=int, default=1000)
    parser.add_argument("--quick", action="store_true",
                        help="one transport comparison and the peer replays only (e.g. under compute-sanitizer)")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun: torchrun --nproc-per-node N tests/multi_gpu/ep_suite.py")
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    world = dist.get_world_size()
    # One symmetric-memory backend serves a process: NVSHMEM, which torch's all_to_all_vdev
    # (the symm_mem transport) needs; the peer transport runs on either.
    import torch.distributed._symmetric_memory as symm_mem

    if symm_mem.is_nvshmem_available():
        symm_mem.set_backend("NVSHMEM")
    else:
        global TRANSPORTS
        TRANSPORTS = tuple(t for t in TRANSPORTS if t != "symm_mem")
    say(f"{torch.cuda.get_device_name()} x {world}, torch {torch.__version__}, backend {backend()}")
    start = time.perf_counter()
    option_sets = [
        {},
        dict(capacity_factor=0.75, drop_policy="probs", shared_expert_ffn_hidden=64, aux_loss_coeff=0.01),
        dict(single_grouped_weight=True, fuse_wgrad_accumulation=True, delay_wgrad_compute=True, bias=True),
    ]
    if args.quick:
        check_transports_and_reference(4 * world, {})
        check_replays(4 * world, args.replays, dict(single_grouped_weight=True))
        check_overflow(4 * world)
        say(f"all expert-parallel checks passed on {world} GPUs (quick) in {time.perf_counter() - start:.0f} s")
        dist.barrier()
        dist.destroy_process_group()
        return
    for experts in (4 * world, 20 * world):  # 4 and 20 experts a rank
        for options in option_sets:
            check_transports_and_reference(experts, options)
    check_transports_and_reference(64 * world, {})  # 64 a rank, as Qwen3-30B on two GPUs
    # Another dtype in the same process: its combine kernel is another of the same signature, which
    # must get its own shared-memory limit.
    check_transports_and_reference(4 * world, {}, torch.float16)
    check_fp8(4 * world)
    for experts in (4 * world, 20 * world):
        check_replays(experts, args.replays, dict(single_grouped_weight=True))
    check_replays(4 * world, max(args.replays // 10, 8), dict(capacity_factor=1.0))
    # The fixed-size NCCL transport, captured, at the default capacity.
    check_replays(20 * world, args.replays, dict(single_grouped_weight=True), "padded_all_to_all")
    check_overflow(4 * world)
    say(f"all expert-parallel checks passed on {world} GPUs in {time.perf_counter() - start:.0f} s")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
