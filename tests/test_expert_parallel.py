"""ExpertParallelMoELayer: the routing plan and the transports' layouts; several gloo processes
against one MoELayer holding all experts; the receive budget and its overflow counter; refused
options; ep_size 1 capture on the GPU."""

import pytest
import torch
import torch.distributed as dist

import moe_grouped
import moe_grouped.parallel
from moe_grouped import MoELayer
from moe_grouped.parallel import CapacityOverflowError, ExpertParallelMoELayer, SymmMemTransport
from moe_grouped.parallel.layer import kept_experts
from moe_grouped.parallel.plan import decode_routes, encode_routes, plan_torch
from moe_grouped.parallel.transport import AllToAllTransport, PaddedAllToAllTransport

from cases import assert_captured_safely, calc_diff, layer_train_step, reset_grads
from process_groups import spawn_group

HIDDEN, FFN, EXPERTS, TOP_K, TOKENS = 16, 12, 8, 2, 10


# ------------------------------------------------------------------ the routing plan (no processes)
def plan_by_loops(experts, ne, ep, segment_rows):
    """Each token once to every rank owning one of its experts, in token order, at most S rows a rank."""
    pos = [[-1] * ep for _ in experts]
    index = [[-1] * segment_rows for _ in range(ep)]
    counts = [0] * ep
    for t, chosen in enumerate(experts):
        for d in sorted({e // ne for e in chosen if 0 <= e < ne * ep}):
            if counts[d] < segment_rows:
                pos[t][d] = counts[d]
                index[d][counts[d]] = t
                counts[d] += 1
    return pos, index, counts


@pytest.mark.parametrize("ep,ne,top_k", [(1, 8, 2), (2, 4, 2), (3, 2, 3), (4, 32, 8), (8, 2, 6), (16, 1, 4)])
@pytest.mark.parametrize("pattern", ["random", "one_rank", "dropped", "empty_rank"])
@pytest.mark.parametrize("segment", ["all", "tight"])
def test_plan_sends_each_token_once_to_each_rank_owning_one_of_its_experts(ep, ne, top_k, pattern, segment):
    generator = torch.Generator().manual_seed(ep * 100 + ne)
    tokens = 37
    experts = torch.stack([torch.randperm(ep * ne, generator=generator)[:top_k] for _ in range(tokens)])
    if pattern == "one_rank":
        experts = experts % ne + (ep - 1) * ne
    elif pattern == "dropped":  # copies dropped upstream arrive as -1
        experts[torch.rand(experts.shape, generator=generator) < 0.4] = -1
    elif pattern == "empty_rank" and ep > 1:
        experts = torch.where(experts // ne == 0, -1, experts)
    segment_rows = tokens if segment == "all" else max(tokens // 3, 1)
    plan = plan_torch(experts, ne, ep, segment_rows)
    pos, index, counts = plan_by_loops(experts.tolist(), ne, ep, segment_rows)
    case = f"{ep=} {ne=} {top_k=} {pattern=} {segment=}"
    assert plan.pos.dtype == plan.index.dtype == plan.counts.dtype == torch.int32, case
    assert plan.pos.tolist() == pos, case
    assert plan.index.tolist() == index, case
    assert plan.counts.tolist() == counts, case


@pytest.mark.parametrize("budget", [0, 1, 3, 7, 100])
@pytest.mark.parametrize("ep_size", [1, 2, 4])
def test_budget_keeps_the_first_copies_per_destination_in_expert_token_order(ep_size, budget):
    generator = torch.Generator().manual_seed(budget + 10 * ep_size)
    experts = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(TOKENS)])
    row_id_map, m_splits = torch.ops.moe_grouped.permute_index(experts, None, EXPERTS, 2, False, "reference")
    kept, dropped = kept_experts(experts, row_id_map, m_splits, ep_size, budget)
    flat, rows = experts.reshape(-1).tolist(), row_id_map.tolist()
    ne = EXPERTS // ep_size
    order = sorted((c for c in range(len(flat)) if rows[c] >= 0), key=lambda c: (flat[c], c))
    taken, want, want_dropped = [0] * ep_size, [-1] * len(flat), 0
    for c in order:
        if taken[flat[c] // ne] < budget:
            taken[flat[c] // ne] += 1
            want[c] = flat[c]
        else:
            want_dropped += 1
    assert kept.reshape(-1).tolist() == want
    assert int(dropped) == want_dropped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_routes_travel_with_experts_and_weights_and_zero_rows_decode_to_no_copy(dtype):
    experts = torch.tensor([[0, 5], [7, -1], [3, 2]])
    weights = torch.tensor([[0.25, 0.75], [1.0, 0.0], [0.5, 0.5]], dtype=dtype)
    routes = encode_routes(experts, weights)
    routes = torch.cat([routes, torch.zeros_like(routes[:1])])
    local, got = decode_routes(routes, 2, first_expert=4, num_local_experts=4, dtype=dtype)
    assert local.tolist() == [[-1, 1], [3, -1], [-1, -1], [-1, -1]]
    assert torch.equal(got[:3], weights) and not got[3].any()


def gradient(param):
    """What backward left for ``param``: ``main_grad`` with fused accumulation, else ``grad``."""
    return param.main_grad if getattr(param, "main_grad", None) is not None else param.grad


def run_step(layer, x, dout):
    out = layer(x)
    out.backward(dout)
    if layer.experts.fc1.delay_wgrad_compute:
        layer.backward_dw()
    return out


def reference_run(ref, xs, douts):
    """MoELayer (all experts) on every rank's tokens: per-rank outputs and input grads, summed param grads."""
    reset_grads(ref)
    outs, x_grads = [], []
    for x, dout in zip(xs, douts):
        x = x.clone().requires_grad_(True)
        outs.append(run_step(ref, x, dout).detach())
        x_grads.append(x.grad)
    return outs, x_grads, {n: gradient(p) for n, p in ref.named_parameters()}


def expert_slice(name: str, grad: torch.Tensor, rank: int, ne: int) -> torch.Tensor:
    """The part of a MoELayer expert parameter's gradient that ``rank`` holds, in EP's parameter name."""
    stem = name.rsplit(".", 1)
    if grad.dim() >= 2 and stem[1] in ("weight", "bias") and grad.shape[0] == EXPERTS:
        return name, grad[rank * ne : (rank + 1) * ne]
    index = int("".join(ch for ch in stem[1] if ch.isdigit()))
    return f"{stem[0]}.{stem[1].rstrip('0123456789')}{index - rank * ne}", grad


def check_against_reference(rank, world, dtype, options, tolerance, transport="all_to_all"):
    torch.manual_seed(0)
    ref = MoELayer(HIDDEN, FFN, EXPERTS, TOP_K, dtype=dtype, backend="reference", **options)
    ep = ExpertParallelMoELayer(
        HIDDEN, FFN, EXPERTS, TOP_K, dtype=dtype, backend="reference", transport=transport, **options
    ).load_from(ref)
    generator = torch.Generator().manual_seed(7)
    xs = [torch.randn(TOKENS + r, HIDDEN, generator=generator).to(dtype) for r in range(world)]
    douts = [torch.randn(TOKENS + r, HIDDEN, generator=generator).to(dtype) for r in range(world)]
    ep_x = [None] * world
    for step in range(2):  # twice: the buffers set up on the first forward serve the second
        reset_grads(ep)
        x = xs[rank].clone().requires_grad_(True)
        out = run_step(ep, x, douts[rank])
        ep_x[rank] = x
    want_outs, want_x_grads, want_grads = reference_run(ref, xs, douts)
    case = f"{rank=} {world=} {dtype=} {options=} {transport=}"

    def close(name, got, want):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {case}: {m}")
        else:
            assert calc_diff(got.double(), want.double()) < tolerance, f"{name}: {case}"

    close("out", out.detach(), want_outs[rank])
    close("x.grad", ep_x[rank].grad, want_x_grads[rank])
    ne = EXPERTS // world
    ep_params = dict(ep.named_parameters())
    for name, grad in want_grads.items():
        if name.startswith("experts."):
            local_name, want = expert_slice(name, grad, rank, ne)
            if local_name not in ep_params:
                continue  # another rank's expert (separate weights)
            got = gradient(ep_params[local_name])
            got = torch.zeros_like(want) if got is None else got
        else:  # replicated: the data-parallel all-reduce the layer leaves to the caller
            got = ep_params[name].grad.clone()
            dist.all_reduce(got)
            want = grad
        close(name, got, want)


def check_overflow_rule(rank, world):
    torch.manual_seed(1)
    ref = MoELayer(HIDDEN, FFN, EXPERTS, TOP_K, dtype=torch.float64, backend="reference")
    budget = 3
    ep = ExpertParallelMoELayer(
        HIDDEN, FFN, EXPERTS, TOP_K, dtype=torch.float64, backend="reference", transport="all_to_all",
        capacity=budget * world,
    ).load_from(ref)
    x = torch.randn(TOKENS, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    out = ep(x)
    # Expected: every copy the budget keeps, through the full layer's experts, weighted.
    routing = ep.last_routing
    flat = routing.experts.reshape(-1).tolist()
    ne = EXPERTS // world
    taken, kept, dropped = [0] * world, [], 0
    for copy in sorted(range(len(flat)), key=lambda c: (flat[c], c)):
        if taken[flat[copy] // ne] < budget:
            taken[flat[copy] // ne] += 1
            kept.append(copy)
        else:
            dropped += 1
    assert dropped > 0, "the test needs some copies past the budget"
    want = torch.zeros_like(out)
    with torch.no_grad():
        for copy in kept:
            t, e = copy // TOP_K, flat[copy]
            one_hot = [1 if i == e else 0 for i in range(EXPERTS)]
            want[t] += routing.weights.reshape(-1)[copy] * ref.experts(x[t : t + 1], one_hot)[0]
    torch.testing.assert_close(out.detach(), want, rtol=1e-10, atol=1e-12)
    total = torch.tensor(dropped)
    dist.all_reduce(total)
    with pytest.raises(CapacityOverflowError, match=rf"^{int(total)} token copies did not fit"):
        ep.check_overflow()  # every rank raises: the counters are all-reduced
    ep.check_overflow()  # reset: nothing new since
    ep(x)
    with pytest.raises(CapacityOverflowError):
        ep(x)  # the next eager forward reports the previous one's drops
    with pytest.raises(ValueError, match="max_tokens=10"):
        ep(torch.randn(TOKENS + 1, HIDDEN, dtype=torch.float64))


def check_padded_equals_all_to_all(rank, world):
    """The fixed-size transport gives what the host-split one gives, bit for bit, drops included."""
    for capacity in (None, 3 * world):
        torch.manual_seed(5)
        ref = MoELayer(HIDDEN, FFN, EXPERTS, TOP_K, backend="reference", shared_expert_ffn_hidden=8)
        results = {}
        for transport in ("all_to_all", "padded_all_to_all"):
            ep = ExpertParallelMoELayer(
                HIDDEN, FFN, EXPERTS, TOP_K, backend="reference", transport=transport, capacity=capacity,
                shared_expert_ffn_hidden=8,
            ).load_from(ref)
            x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(rank)).requires_grad_(True)
            out = run_step(ep, x, torch.ones_like(x))
            dropped = None
            if capacity is not None:
                with pytest.raises(CapacityOverflowError) as error:
                    ep.check_overflow()
                dropped = str(error.value).split(" token copies")[0]
            results[transport] = [out.detach(), x.grad] + [p.grad for p in ep.parameters()] + [dropped]
        want, got = results["all_to_all"], results["padded_all_to_all"]
        for i, (a, b) in enumerate(zip(want, got)):
            same = a == b if isinstance(a, str) or a is None else torch.equal(a, b)
            assert same, f"{rank=} {capacity=}: result {i} differs between the transports"


def check_transport_layouts(rank, world):
    """dispatch and combine of the host-split and the padded transports, row by row, against loops
    over every rank's plan (rows carry their source and token in their value)."""
    ne, top_k, segment_rows = 3, 2, 12
    generator = torch.Generator().manual_seed(50 + rank)
    tokens = 7 + rank
    experts = torch.randint(0, ne * world, (tokens, top_k), generator=generator)
    experts[torch.rand(experts.shape, generator=generator) < 0.2] = -1
    plan = plan_torch(experts, ne, world, segment_rows)
    everyone = [None] * world
    dist.all_gather_object(everyone, experts.tolist())
    rows = (rank * 1000 + torch.arange(tokens, dtype=torch.float64)).unsqueeze(1).repeat(1, 4)
    extra = torch.stack([torch.arange(tokens), -torch.arange(tokens)], 1).to(torch.int32) + rank * 100
    for transport in (AllToAllTransport(None, world, segment_rows), PaddedAllToAllTransport(None, world, segment_rows)):
        out, out_extra = transport.dispatch(rows, extra, plan)
        assert out.shape == (world * segment_rows, 4) and out_extra.shape == (world * segment_rows, 2)
        for s in range(world):
            _, index, _ = plan_by_loops(everyone[s], ne, world, segment_rows)
            for p, t in enumerate(index[rank]):
                value = s * 1000 + t if t >= 0 else 0
                assert out[s * segment_rows + p].tolist() == [value] * 4, (transport.name, rank, s, p)
                want_extra = [t + s * 100, -t + s * 100] if t >= 0 else [0, 0]
                assert out_extra[s * segment_rows + p].tolist() == want_extra, (transport.name, rank, s, p)
        # Rank d returns each received row times (d + 1): token t gets its value times the sum of d + 1
        # over the ranks it went to.
        back, back_extra = transport.combine(out * (rank + 1), out[:, :2].to(torch.float32), plan)
        pos, _, _ = plan_by_loops(experts.tolist(), ne, world, segment_rows)
        for t in range(tokens):
            ranks = [d for d in range(world) if pos[t][d] >= 0]
            value = rank * 1000 + t
            assert back[t].tolist() == [value * sum(d + 1 for d in ranks)] * 4, (transport.name, rank, t)
            assert back_extra[t].tolist() == [float(value * len(ranks))] * 2, (transport.name, rank, t)


def check_refusals(rank, world):
    with pytest.raises(ValueError, match=f"multiple of the group's {world} ranks"):
        ExpertParallelMoELayer(HIDDEN, FFN, world * 2 + 1, TOP_K)
    with pytest.raises(ValueError, match="transport='local' serves a group of one rank"):
        ExpertParallelMoELayer(HIDDEN, FFN, EXPERTS, TOP_K, transport="local")
    with pytest.raises(ValueError, match=f"capacity must be at least ep_size={world}"):
        ExpertParallelMoELayer(HIDDEN, FFN, EXPERTS, TOP_K, capacity=world - 1)
    uneven = ExpertParallelMoELayer(HIDDEN, FFN, EXPERTS, TOP_K, capacity=world * (rank + 1))
    with pytest.raises(ValueError, match=f"capacity must be the same on every rank of the group, got values from {world} to {world * world}"):
        uneven(torch.randn(TOKENS, HIDDEN))


def worker(rank, init_method, world, cases):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        for case in cases:
            if case == "refusals":
                check_refusals(rank, world)
            elif case == "overflow":
                check_overflow_rule(rank, world)
            elif case == "padded":
                check_padded_equals_all_to_all(rank, world)
            elif case == "layouts":
                check_transport_layouts(rank, world)
            else:
                check_against_reference(rank, world, *case)
    finally:
        dist.destroy_process_group()


CASES = [
    (torch.float32, dict(shared_expert_ffn_hidden=8, aux_loss_coeff=0.01, z_loss_coeff=0.001), 0),
    (torch.float32, dict(capacity_factor=0.75, drop_policy="probs", bias=True, single_grouped_weight=True), 0),
    (torch.float32, dict(capacity_factor=1.0, drop_policy="position"), 0),
    (torch.float32, dict(fuse_wgrad_accumulation=True, delay_wgrad_compute=True, single_grouped_weight=True), 0),
    (torch.bfloat16, dict(shared_expert_ffn_hidden=8), 2e-3),
    (torch.float32, dict(capacity_factor=0.75, bias=True, aux_loss_coeff=0.01), 0, "padded_all_to_all"),
    "padded",
    "layouts",
    "overflow",
    "refusals",
]


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_expert_parallel_equals_one_layer_holding_all_experts(world):
    # A hang (a collective one rank skipped) fails the test with the ranks' stacks.
    spawn_group(worker, world, (world, CASES))


# ------------------------------------------------------------------ one rank, in this process
def test_ep_size_1_local_transport_equals_moe_layer_on_cpu(one_rank_group):
    torch.manual_seed(2)
    options = dict(shared_expert_ffn_hidden=8, capacity_factor=0.5, aux_loss_coeff=0.01)
    ref = MoELayer(HIDDEN, FFN, EXPERTS, TOP_K, backend="reference", **options)
    layers = {
        name: ExpertParallelMoELayer(HIDDEN, FFN, EXPERTS, TOP_K, backend="reference", transport=name, **options)
        .load_from(ref)
        for name in ("auto", "all_to_all")
    }
    assert layers["auto"].transport_name == "local"
    x = torch.randn(2, 6, HIDDEN)
    dout = torch.randn(2, 6, HIDDEN)
    xr = x.clone().requires_grad_(True)
    out_ref = ref(xr)
    out_ref.backward(dout)
    for name, layer in layers.items():
        xe = x.clone().requires_grad_(True)
        out = layer(xe)
        out.backward(dout)
        torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(xe.grad, xr.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        want = dict(ref.named_parameters())
        for pname, p in layer.named_parameters():
            torch.testing.assert_close(p.grad, want[pname].grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {pname}: {m}")


@pytest.mark.parametrize("experts_path", ["unfused", "fused"])
def test_ep_size_1_fp8_experts_equal_moe_layer_fp8_bitwise(one_rank_group, experts_path):
    # One rank keeps MoELayer's row order, so the FP8 blocks (and their scales) are the same.
    torch.manual_seed(3)
    ref = MoELayer(128, 128, 4, 2, dtype=torch.bfloat16, backend="reference", experts_path=experts_path)
    ep = ExpertParallelMoELayer(128, 128, 4, 2, dtype=torch.bfloat16, backend="reference").load_from(ref)
    ep.experts.experts_path = experts_path
    x = torch.randn(32, 128, dtype=torch.bfloat16)
    dout = torch.randn_like(x)
    results = []
    for layer in (ref, ep):
        xi = x.clone().requires_grad_(True)
        with moe_grouped.fp8.fp8_autocast(moe_grouped.fp8.Float8BlockScaling()):
            out = layer(xi)
        out.backward(dout)
        results.append([out.detach(), xi.grad, *[p.grad for _, p in sorted(layer.named_parameters())]])
    with torch.no_grad():
        plain = ep(x)
    assert not torch.equal(plain, results[1][0]), "fp8_autocast changed nothing"
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), f"tensor {i} differs"


def test_options_that_do_not_fit_expert_parallelism_are_refused(one_rank_group):
    with pytest.raises(ValueError, match="pad_to_capacity is not supported under expert parallelism"):
        ExpertParallelMoELayer(HIDDEN, FFN, EXPERTS, TOP_K, capacity_factor=1.0, pad_to_capacity=True)
    with pytest.raises(ValueError, match="transport must be one of"):
        ExpertParallelMoELayer(HIDDEN, FFN, EXPERTS, TOP_K, transport="nccl")
    with pytest.raises(ValueError, match="capacity must be a positive int or None, got 0"):
        ExpertParallelMoELayer(HIDDEN, FFN, EXPERTS, TOP_K, capacity=0)
    with pytest.raises(ValueError, match="drop_policy must be one of"):
        ExpertParallelMoELayer(HIDDEN, FFN, EXPERTS, TOP_K, capacity_factor=1.0, drop_policy="random")
    with pytest.raises(ValueError, match="symm_mem transport needs at least 2 ranks"):
        SymmMemTransport(one_rank_group, 1, 4, max_tokens=8, row_bytes=16, extra_bytes=16, device="cpu")
    with pytest.raises(ValueError, match="runs on CUDA devices"):
        SymmMemTransport(one_rank_group, 2, 4, max_tokens=8, row_bytes=16, extra_bytes=16, device="cpu")
    with pytest.raises(RuntimeError, match="the peer transport cannot run"):
        moe_grouped.parallel.PeerTransport(
            one_rank_group, 1, 4, max_tokens=8, hidden=8, dtype=torch.float32, top_k=2, device="cpu"
        )
    with pytest.raises(ValueError, match="top_k must be an int in"):
        ExpertParallelMoELayer(HIDDEN, FFN, EXPERTS, EXPERTS + 1)


def test_layer_needs_an_initialised_process_group():
    if dist.is_initialized():
        pytest.fail("a process group is already initialised in the test process")
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        ExpertParallelMoELayer(HIDDEN, FFN, EXPERTS, TOP_K)


# ------------------------------------------------------------------ GPU, ep_size 1
def gpu_backend() -> str:
    if moe_grouped.backends.cuda_unavailable_reason(torch.device("cuda")) is None:
        return "cuda"
    return "torch"


@pytest.mark.gpu
@pytest.mark.parametrize("experts_path", [None, "unfused"])
def test_gpu_ep_size_1_equals_moe_layer_bitwise(one_rank_group, experts_path):
    """One rank runs MoELayer's experts on its own tokens, the same path in the same order: the same bits."""
    backend = gpu_backend()
    torch.manual_seed(3)
    options = dict(single_grouped_weight=True, dtype=torch.bfloat16, device="cuda", backend=backend)
    ref = MoELayer(64, 96, 8, 2, experts_path=experts_path, **options)
    ep = ExpertParallelMoELayer(64, 96, 8, 2, transport="local", **options).load_from(ref)
    ep.experts.experts_path = experts_path
    x = torch.randn(256, 64, dtype=torch.bfloat16, device="cuda")
    dout = torch.randn_like(x)
    xr, xe = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out_ref, out = ref(xr), ep(xe)
    out_ref.backward(dout)
    out.backward(dout)
    assert torch.equal(out, out_ref), f"{backend=} {experts_path=}"
    assert torch.equal(xe.grad, xr.grad), f"{backend=} {experts_path=}"
    want = dict(ref.named_parameters())
    for name, p in ep.named_parameters():
        assert torch.equal(p.grad, want[name].grad), f"{backend=} {experts_path=} {name}"


@pytest.mark.gpu
def test_gpu_ep_size_1_step_captures_and_200_replays_with_new_routing_equal_eager_bitwise(one_rank_group):
    from moe_grouped import graphs

    backend = gpu_backend()
    torch.manual_seed(4)
    tokens, hidden = 256, 64
    layer = ExpertParallelMoELayer(
        hidden, 128, 8, 2, transport="local", capacity_factor=1.0, single_grouped_weight=True,
        dtype=torch.bfloat16, device="cuda", backend=backend,
    )
    step = layer_train_step(layer)
    static_x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    captured = graphs.capture_step(step, static_x, torch.randn_like(static_x))
    assert_captured_safely(captured.graph)  # no host nodes or copies (no syncs), no allocations

    generator = torch.Generator(device="cuda").manual_seed(5)
    seen = set()
    for replay in range(200):
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda", generator=generator) * (1 + replay % 3)
        dout = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda", generator=generator)
        got = [t.clone() for t in captured(x, dout)]
        want = step(x, dout)
        seen.add(tuple(got[1].tolist()))
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"{backend=} {replay=}: output {i} differs (calc_diff {calc_diff(a.float(), b.float())})"
    assert len(seen) > 1, "the routing never changed between replays"


@pytest.mark.gpu
def test_gpu_ep_size_1_overflow_is_counted_on_the_device_during_replay(one_rank_group):
    from moe_grouped import graphs

    layer = ExpertParallelMoELayer(
        32, 64, 4, 2, transport="local", capacity=16, dtype=torch.bfloat16, device="cuda", backend=gpu_backend(),
    )
    x = torch.randn(64, 32, dtype=torch.bfloat16, device="cuda")  # 128 copies, 16 rows of room

    def forward(x):
        return layer(x)

    with pytest.raises(CapacityOverflowError):
        forward(x)
        forward(x)  # the eager check at the next forward reports the first one's drops
    captured = graphs.capture_step(forward, x, num_warmup_iters=1)
    layer.overflow_count.zero_()
    captured.replay()
    torch.cuda.synchronize()
    assert int(layer.overflow_count) == 128 - 16
    out = captured.replay()
    assert torch.isfinite(out).all()
    with pytest.raises(CapacityOverflowError, match=f"^{2 * (128 - 16)} token copies"):
        layer.check_overflow()


def require_peer_kernels(fp8: bool, fp8_capability: int) -> None:
    """Skip unless the peer transport runs on this GPU and, for an FP8 case, the core has ``fp8_capability``."""
    from moe_grouped.parallel import peer_unavailable_reason

    reason = peer_unavailable_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    if fp8 and not moe_grouped._core.has(fp8_capability):
        pytest.skip(f"the core was built without capability {fp8_capability} (FP8 kernels)")


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_peer_transport_on_one_rank_equals_local_bitwise_and_replays(one_rank_nccl_group, fp8):
    """The peer kernels (plan, dispatch, combine, their barrier) on one GPU: bitwise the local path, eagerly
    and in 50 captured replays with new routing, with the backward's combine beside fc1's weight gradient;
    also with the experts' fused op in FP8 (fp8_autocast)."""
    from moe_grouped import graphs

    require_peer_kernels(fp8, moe_grouped._core.CAP_GROUPED_GEMM_FP8_BLOCKWISE)
    torch.manual_seed(6)
    options = dict(single_grouped_weight=True, dtype=torch.bfloat16, device="cuda", backend=gpu_backend(),
                   router_options=dict(normalize_topk=True))
    tokens, hidden = 384, 128
    local = ExpertParallelMoELayer(hidden, 256, 16, 4, transport="local", **options)
    peer = ExpertParallelMoELayer(hidden, 256, 16, 4, transport="peer", max_tokens=tokens, overlap_sms=8, **options)
    peer.load_state_dict(local.state_dict())
    def train_step(layer):
        params = list(layer.parameters())

        def step(x, dout):
            for p in params:
                p.grad = None
            x = x.detach().requires_grad_(True)  # the input's gradient takes the overlapped combine
            with moe_grouped.fp8.fp8_autocast(enabled=fp8):
                out = layer(x)
            out.backward(dout)
            return [out.detach(), x.grad, layer.last_routing.tokens_per_expert, *[p.grad for p in params]]

        return step

    steps = {name: train_step(layer) for name, layer in (("local", local), ("peer", peer))}
    generator = torch.Generator(device="cuda").manual_seed(7)

    def batch(scale=1.0):
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda", generator=generator) * scale
        return x, torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda", generator=generator)

    for _ in range(2):
        x, dout = batch()
        want, got = steps["local"](x, dout), steps["peer"](x, dout)
        for i, (a, b) in enumerate(zip(want, got)):
            assert torch.equal(a, b), f"eager output {i} differs (calc_diff {calc_diff(a.float(), b.float())})"
    assert peer.transport is not None and peer.transport.name == "peer"
    captured = graphs.capture_step(steps["peer"], *batch())
    assert_captured_safely(captured.graph)
    for replay in range(50):
        x, dout = batch(1 + replay % 3)
        got = [t.clone() for t in captured(x, dout)]
        want = steps["local"](x, dout)
        for i, (a, b) in enumerate(zip(want, got)):
            assert torch.equal(a, b), f"{replay=}: output {i} differs (calc_diff {calc_diff(a.float(), b.float())})"


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_peer_transport_sequences_equal_the_python_stages_bitwise(one_rank_nccl_group, monkeypatch, fp8):
    """With the peer transport's sinks (dx into its buffer, the combine started from the callback, fc1's
    weight gradient on the SMs left) the experts' core sequences give the Python stages' bits."""
    from moe_grouped import experts_sequence
    from moe_grouped.fp8 import sequence as fp8_sequence

    require_peer_kernels(fp8, moe_grouped._core.CAP_EXPERTS_SEQUENCE_FP8)
    torch.manual_seed(9)
    tokens, hidden = 320, 128
    layer = ExpertParallelMoELayer(hidden, 256, 16, 4, transport="peer", max_tokens=tokens, overlap_sms=8,
                                   single_grouped_weight=True, dtype=torch.bfloat16, device="cuda",
                                   backend=gpu_backend())
    module = fp8_sequence if fp8 else experts_sequence
    calls = []
    backward = module.backward
    monkeypatch.setattr(module, "backward", lambda *args: calls.append(1) or backward(*args))
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    dout = torch.randn_like(x)
    results = {}
    for sequenced in (True, False):
        monkeypatch.setattr(module, "enabled", sequenced)
        reset_grads(layer)
        xi = x.clone().requires_grad_(True)
        with moe_grouped.fp8.fp8_autocast(enabled=fp8):
            out = layer(xi)
        out.backward(dout)
        results[sequenced] = [out.detach(), xi.grad, *[p.grad for p in layer.parameters()]]
    assert len(calls) == 1, "the sequence did not run with the peer transport's sinks"
    for i, (a, b) in enumerate(zip(results[True], results[False])):
        assert torch.equal(a, b), f"output {i} differs ({fp8=}, calc_diff {calc_diff(a.float(), b.float())})"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [0, 1, 255, 256, 1000, 8192, 70001])
@pytest.mark.parametrize("ep,ne,top_k", [(1, 8, 2), (2, 64, 8), (3, 4, 6), (4, 32, 8), (16, 2, 4)])
def test_gpu_plan_kernel_equals_the_torch_plan(tokens, ep, ne, top_k):
    from moe_grouped.parallel.plan import make_plan, plan_kernel_unavailable_reason

    reason = plan_kernel_unavailable_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    generator = torch.Generator(device="cuda").manual_seed(tokens + ep)
    experts = torch.randint(0, ep * ne, (tokens, top_k), device="cuda", generator=generator)
    experts[torch.rand(experts.shape, device="cuda", generator=generator) < 0.1] = -1
    for segment_rows in (max(tokens, 1), max(tokens // 3, 1)):
        got = make_plan(experts, ne, ep, segment_rows)
        want = plan_torch(experts, ne, ep, segment_rows)
        case = f"{tokens=} {ep=} {ne=} {top_k=} {segment_rows=}"
        for name in ("pos", "index", "counts"):
            assert torch.equal(getattr(got, name), getattr(want, name)), f"{name}: {case}"
