"""ExpertParallelMoELayer: several gloo processes against one MoELayer holding all experts;
the receive budget and its overflow counter; refused options; ep_size 1 capture on the GPU."""


import pytest
import torch
import torch.distributed as dist

import moe_grouped
from moe_grouped import MoELayer
from moe_grouped.parallel import CapacityOverflowError, ExpertParallelMoELayer, SymmMemTransport
from moe_grouped.parallel.layer import plan_sends
from moe_grouped._tensors import gather_rows
from moe_grouped.parallel.transport import (
    LocalTransport,
    bin_layout,
    buffer_order,
    expert_bins,
    receive_index,
    return_index,
)

from cases import assert_captured_safely, calc_diff, layer_train_step, reset_grads
from process_groups import spawn_group

HIDDEN, FFN, EXPERTS, TOP_K, TOKENS = 16, 12, 8, 2, 10


@pytest.fixture
def one_rank_group():
    """A 1-rank gloo default group in this process (ep_size 1 needs no collectives)."""
    if dist.is_initialized():
        pytest.fail("a process group is already initialised in the test process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ the send plan (no processes)
def send_plan_by_loops(experts, row_id_map, ep_size, ne, budget):
    """Each destination keeps the first ``budget`` copies in (expert, token) order."""
    order = sorted(
        (c for c in range(len(experts)) if row_id_map[c] >= 0), key=lambda c: (experts[c], c)
    )
    send_map, in_splits, taken, dropped = [-1] * len(experts), [0] * (ep_size * ne), [0] * ep_size, 0
    position = 0
    for c in order:
        rank = experts[c] // ne
        if taken[rank] < budget:
            taken[rank] += 1
            in_splits[experts[c]] += 1
            send_map[c] = position
            position += 1
        else:
            dropped += 1
    return send_map, in_splits, dropped


@pytest.mark.parametrize("budget", [0, 1, 3, 7, 100])
@pytest.mark.parametrize("ep_size", [1, 2, 4])
def test_send_plan_keeps_the_first_copies_per_destination_up_to_the_budget(ep_size, budget):
    num_experts = 8
    generator = torch.Generator().manual_seed(budget + 10 * ep_size)
    for capacity in (-1, 3):
        experts = torch.randint(0, num_experts, (20, 2), generator=generator)
        experts[:4] = 1  # a crowded expert
        row_id_map, m_splits = torch.ops.moe_grouped.permute_index(
            experts, None, num_experts, capacity, False, "reference"
        )
        flat = experts.reshape(-1)
        send_map, in_splits, dropped = plan_sends(row_id_map, flat, m_splits, ep_size, budget)
        want = send_plan_by_loops(flat.tolist(), row_id_map.tolist(), ep_size, num_experts // ep_size, budget)
        case = f"{ep_size=} {budget=} {capacity=}"
        assert send_map.tolist() == want[0], case
        assert in_splits.tolist() == want[1], case
        assert int(dropped) == want[2], case
        # Padded: the same copies, rank r's at rows r * budget onwards in the same order.
        padded_map, padded_splits, padded_dropped = plan_sends(row_id_map, flat, m_splits, ep_size, budget, True)
        ne = num_experts // ep_size
        kept_before = [sum(want[1][: r * ne]) for r in range(ep_size)]
        want_padded = [
            -1 if row < 0 else int(flat[c]) // ne * budget + row - kept_before[int(flat[c]) // ne]
            for c, row in enumerate(want[0])
        ]
        assert padded_map.tolist() == want_padded, case
        assert padded_splits.tolist() == want[1] and int(padded_dropped) == want[2], case


# ------------------------------------------------------------------ symm_mem's bins (no processes)
@pytest.mark.parametrize("ne", range(1, 130))
def test_expert_bins_cover_the_experts_in_at_most_16_bins(ne):
    bins, per_bin = expert_bins(ne)
    assert bins <= 16 and bins * per_bin >= ne > (bins - 1) * per_bin, (ne, bins, per_bin)
    assert per_bin == 1 or ne > 16


def vdev_2d_dispatch(sends, splits, ep, ne, bins, per_bin, capacity):
    """What torch's all_to_all_vdev_2d leaves on each rank when every rank sends per (rank, bin):
    chunks bin-major, then by source (each a contiguous run of the source's rank-major send
    buffer), an empty bin still taking one row; stale rows are NaN. Also each rank's layout."""
    buffers, layouts = [], []
    for r in range(ep):
        rows, chunk_rows, chunk_starts = [], [], []
        for b in range(bins):
            first_expert, last_expert = b * per_bin, min((b + 1) * per_bin, ne)
            bin_start = len(rows)
            for s in range(ep):
                first = int(splits[s][: r * ne + first_expert].sum())
                n = int(splits[s][r * ne + first_expert : r * ne + last_expert].sum())
                chunk_rows.append(n)
                chunk_starts.append(len(rows))
                rows += list(sends[s][first : first + n])
            if len(rows) == bin_start:
                rows.append(torch.full_like(sends[0][0], float("nan")))
        rows += [torch.full_like(sends[0][0], float("nan"))] * (capacity + bins - len(rows))
        buffers.append(torch.stack(rows))
        layouts.append(torch.tensor([chunk_rows, chunk_starts]))
    return buffers, layouts


def vdev_2d_combine(buffers, layouts, ep):
    """torch's all_to_all_vdev_2d_offset with those layouts: each source gets back, rank-major,
    every (rank, bin) chunk it sent."""
    back = []
    for s in range(ep):
        rows = []
        for r in range(ep):
            chunk_rows, chunk_starts = layouts[r].view(2, -1, ep)
            for b in range(chunk_rows.shape[0]):
                start, n = int(chunk_starts[b, s]), int(chunk_rows[b, s])
                rows.append(buffers[r][start : start + n])
        back.append(torch.cat(rows))
    return back


@pytest.mark.parametrize("ep", [2, 3])
@pytest.mark.parametrize("ne", [1, 4, 16, 17, 20, 64])
def test_symm_mem_reorder_turns_torchs_bin_layout_into_packed_expert_major_and_back(ep, ne):
    bins, per_bin = expert_bins(ne)
    generator = torch.Generator().manual_seed(ep * 100 + ne)
    capacity = 6 * ep * ne
    splits = []
    for s in range(ep):
        counts = torch.randint(0, 6, (ep * ne,), generator=generator)
        counts[torch.rand(ep * ne, generator=generator) < 0.4] = 0  # empty experts, and empty bins
        if s == 0:
            counts[: ne] = 0  # rank 0's experts get nothing from rank 0
        splits.append(counts)
    sends = [torch.randn(int(c.sum()) + 3, 8, generator=generator) for c in splits]
    buffers, layouts = vdev_2d_dispatch(sends, splits, ep, ne, bins, per_bin, capacity)
    returned = []
    for r in range(ep):
        counts = torch.stack([splits[s].view(ep, ne)[r] for s in range(ep)], dim=1)  # [ne, ep]
        assert torch.equal(bin_layout(counts, bins, per_bin), layouts[r]), f"rank {r}: torch's layout"
        gather = receive_index(counts, bins, per_bin, capacity)
        recv = gather_rows(buffers[r], gather)
        want = [
            sends[s][int(splits[s][: r * ne + e].sum()) :][: int(counts[e, s])] for e in range(ne) for s in range(ep)
        ]
        want = torch.cat(want)
        total = want.shape[0]
        assert torch.equal(recv[:total], want), f"rank {r}: rows not packed expert-major"
        assert not recv[total:].any(), f"rank {r}: rows past the total are not zero"
        back = return_index(counts, bins, per_bin, capacity + bins, buffer_order(ne, ep, bins, per_bin))
        inside = gather >= 0
        assert torch.equal(back[gather[inside]], torch.arange(capacity)[inside]), f"rank {r}: not inverse"
        assert int((back >= 0).sum()) == total
        y = recv * 2 + 1  # what the experts return, in recv's layout
        returned.append(y.index_select(0, back.clamp(min=0)))
    combined = vdev_2d_combine(returned, layouts, ep)
    for s in range(ep):
        sent = sends[s][: int(splits[s].sum())]
        assert torch.equal(combined[s], sent * 2 + 1), f"rank {s}: the combine did not return its rows"


# ------------------------------------------------------------------ several gloo processes
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
    # Expected: every copy kept by the plan, through the full layer's experts, weighted.
    routing = ep.last_routing
    flat = routing.experts.reshape(-1)
    row_id_map, m_splits = torch.ops.moe_grouped.permute_index(routing.experts, None, EXPERTS, -1, False, "reference")
    want_map, _, dropped = send_plan_by_loops(flat.tolist(), row_id_map.tolist(), world, EXPERTS // world, budget)
    assert dropped > 0, "the test needs some copies past the budget"
    want = torch.zeros_like(out)
    with torch.no_grad():
        for copy, row in enumerate(want_map):
            if row < 0:
                continue
            t, e = divmod(copy, TOP_K)[0], int(flat[copy])
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


def test_ep_size_1_fp8_experts_equal_moe_layer_fp8_bitwise(one_rank_group):
    # One rank keeps MoELayer's row order, so the FP8 blocks (and their scales) are the same.
    torch.manual_seed(3)
    ref = MoELayer(128, 128, 4, 2, dtype=torch.bfloat16, backend="reference")
    ep = ExpertParallelMoELayer(128, 128, 4, 2, dtype=torch.bfloat16, backend="reference").load_from(ref)
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


class GappedLocalTransport(LocalTransport):
    """One rank whose dispatch leaves a (zero) row for an expert that receives nothing, as torch's
    all_to_all_vdev_2d does: the layer must take the layout's offsets, not assume packed chunks."""

    def recv_rows(self, capacity):
        return capacity + self.num_local_experts

    def _targets(self, in_splits):
        spans = in_splits.clamp(min=1)
        offsets = spans.cumsum(0) - spans
        packed = in_splits.cumsum(0) - in_splits
        expert = torch.repeat_interleave(torch.arange(in_splits.shape[0]), in_splits)
        rows = torch.arange(expert.shape[0])
        return offsets[expert] + rows - packed[expert], torch.stack([in_splits, offsets])

    def dispatch(self, send, in_splits, recv_rows):
        targets, layout = self._targets(in_splits)
        recv = send.new_zeros((recv_rows, send.shape[1]))
        recv[targets] = send[: targets.shape[0]]
        return recv, layout

    def combine(self, y, layout, in_splits, send_rows):
        targets, _ = self._targets(in_splits)
        back = y.new_zeros(send_rows, y.shape[1])
        back[: targets.shape[0]] = y[targets]
        return back


def test_layer_takes_a_dispatch_layout_with_a_row_for_each_empty_expert(one_rank_group):
    torch.manual_seed(4)
    ref = MoELayer(HIDDEN, FFN, EXPERTS, TOP_K, bias=True, backend="reference")
    ep = ExpertParallelMoELayer(HIDDEN, FFN, EXPERTS, TOP_K, bias=True, backend="reference").load_from(ref)
    x = torch.randn(3, HIDDEN)  # 6 copies over 8 experts: some receive nothing
    ep(x)  # sets the layer up; then the transport is swapped for the gapped one
    ep.transport = GappedLocalTransport(None, 1, EXPERTS)
    ep.recv_rows = ep.transport.recv_rows(ep.capacity)
    results = []
    for layer in (ref, ep):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        out.backward(torch.ones_like(out))
        results.append((out.detach(), xi.grad, {n: p.grad for n, p in layer.named_parameters()}))
    assert int((ep.last_routing.tokens_per_expert == 0).sum()) > 0, "the test needs an empty expert"
    (out_ref, dx_ref, grads_ref), (out, dx, grads) = results
    torch.testing.assert_close(out, out_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-6, atol=1e-6)
    for name, grad in grads_ref.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")


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
        SymmMemTransport(one_rank_group, 1, 4, max_send_rows=8, capacity=8, hidden=4, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="at most 16 ranks, got ep_size=17"):
        SymmMemTransport(one_rank_group, 17, 4, max_send_rows=8, capacity=8, hidden=4, dtype=torch.float32, device="cpu")


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
def test_gpu_ep_size_1_equals_moe_layer(one_rank_group):
    backend = gpu_backend()
    torch.manual_seed(3)
    options = dict(single_grouped_weight=True, dtype=torch.bfloat16, device="cuda", backend=backend)
    # The EP layer runs the experts unfused (permute, GroupedMLP, unpermute); so does the reference here, since
    # the fused path's float32 routing-weight gradient rounds differently (calc_diff ~1e-5 on dx).
    ref = MoELayer(64, 96, 8, 2, experts_path="unfused", **options)
    ep = ExpertParallelMoELayer(64, 96, 8, 2, transport="local", **options).load_from(ref)
    x = torch.randn(256, 64, dtype=torch.bfloat16, device="cuda")
    dout = torch.randn_like(x)
    xr, xe = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out_ref, out = ref(xr), ep(xe)
    out_ref.backward(dout)
    out.backward(dout)
    assert calc_diff(out.float(), out_ref.float()) < 1e-6, f"{backend=}"
    assert calc_diff(xe.grad.float(), xr.grad.float()) < 1e-6, f"{backend=}"
    want = dict(ref.named_parameters())
    for name, p in ep.named_parameters():
        assert calc_diff(p.grad.float(), want[name].grad.float()) < 1e-6, f"{backend=} {name}"


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
