"""Expert parallelism: dispatch + combine bandwidth and the EP layer's step time, eager and graphed.

Runs on any number of GPUs of one host, one process each, under torchrun (or
plain ``python`` for one GPU):

    torchrun --nproc-per-node 1 benchmarks/expert_parallel.py
    torchrun --nproc-per-node 4 benchmarks/expert_parallel.py [--sms 16,32,64]

Every rank routes T = 8192 tokens of its own; each holds E / ep experts of
``moe_grouped.parallel.ExpertParallelMoELayer`` (bf16, the cuda backend where
the core is built, else torch), default (dropless) capacity. Transports: on
one GPU the layer's ``local`` path; on several, ``peer`` (the core's kernels
over symmetric memory: the default), ``symm_mem`` (torch's NVSHMEM
all-to-all) and ``padded_all_to_all`` (NCCL, fixed-size chunks).

ops (rows carry ``ep``, ``transport`` and the variant):
  dispatch_combine   one routed step's dispatch of the tokens (with their
                     routes) and the combine of the received rows back,
                     forward only; eager and captured in a CUDA graph.
                     ``gbps``: the bytes of the step's token copies over the
                     time, as an all-to-all of copies would move them (this
                     GPU's T * top_k copies out and the copies it received
                     back, H * 2 bytes each): the figure the ``nccl_all_to_all``
                     row moves. ``wire_gbps``: the bytes the transport moved
                     (a token goes once to each rank that holds any of its
                     experts, and one row comes back).
                     With ``--sms``, the peer transport again with that many
                     CTAs a call (variant ``graphed_sms<N>``).
  nccl_all_to_all    ``torch.distributed.all_to_all_single`` there and back of
                     the copies' bytes in equal splits: what NCCL does with
                     the same traffic, balanced and with the splits known.
  fwd_bwd            the layer's forward + backward on new inputs each step
                     (new routing; the input's gradient too, as inside a
                     model), eager and as a step captured with
                     ``moe_grouped.graphs.capture_step``; ``wall_ms`` steps
                     back to back; ``peak_mib`` the step's peak memory. The
                     peer transport also with its backward combine beside
                     fc1's weight gradient (``overlap_sms`` 16 and 32).
``ms``: median of CUDA-event-timed runs, each after an L2 flush, printed and
written by rank 0 (every rank runs the same sequence; the collectives pace
each other). Scaling efficiency: the one-GPU fwd_bwd graphed row over an
ep row (each GPU does the same expert FLOPs).

Shapes (no shared expert, softmax router):
  qwen3_30b   hidden 2048, ffn 768,  128 experts, top-8 (Qwen3-30B-A3B's MoE)
  dsv2_lite   hidden 2048, ffn 1408,  64 experts, top-6 (DeepSeek-V2-Lite's MoE)

Rank 0 writes results/expert_parallel_ep<N>-<gpu>.json (one file per group size).
"""

from __future__ import annotations

import os

# NVLink multicast (NVLS) off in NCCL, torch symmetric memory and NVSHMEM, before any of them
# starts: on the shared machines this runs on, a program that uses it can put the host's GPUs
# out of service for a long time.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import common  # noqa: E402
from common import (  # noqa: E402
    L2Flush, Shape, cli, free_memory, graphed, prologue, step_inputs, time_ms, wall_ms, write_results,
)

import moe_grouped  # noqa: E402
from moe_grouped import graphs  # noqa: E402
from moe_grouped.parallel import CapacityOverflowError, ExpertParallelMoELayer, PeerTransport  # noqa: E402
from moe_grouped.parallel.layer import shared_transport  # noqa: E402
from moe_grouped.parallel.plan import encode_routes, make_plan  # noqa: E402

DTYPE = torch.bfloat16
TOKENS = 8192

SHAPES = [
    Shape("qwen3_30b", 2048, 768, 128, 8, TOKENS),
    Shape("dsv2_lite", 2048, 1408, 64, 6, TOKENS),
]


def init() -> tuple[int, int]:
    """The process group: torchrun's, or one rank of this process."""
    # NVSHMEM's team manager is pinned to one device index: name it everywhere.
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    if "RANK" in os.environ:
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    # One symmetric-memory backend a process: NVSHMEM serves torch's symm_mem transport and ours.
    import torch.distributed._symmetric_memory as symm_mem

    if dist.get_world_size() > 1 and symm_mem.is_nvshmem_available():
        symm_mem.set_backend("NVSHMEM")
    return dist.get_rank(), dist.get_world_size()


def say(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def make_layer(shape: Shape, backend: str, transport: str, **options) -> ExpertParallelMoELayer:
    torch.manual_seed(0)
    return ExpertParallelMoELayer(
        shape.hidden, shape.ffn, shape.experts, shape.top_k, router_options=dict(normalize_topk=True),
        max_tokens=shape.tokens, single_grouped_weight=True, dtype=DTYPE, device="cuda", backend=backend,
        transport=transport, **options,
    )


def make_inputs(shape: Shape, rank: int):
    return step_inputs((shape.tokens, shape.hidden), seed=1 + rank)


class Recorder:
    def __init__(self, base: dict, flush: L2Flush):
        self.base, self.flush, self.rows = base, flush, []

    def __call__(self, op, variant, fn, bytes_moved=None, wire_bytes=None, **extra):
        ms = time_ms(fn, warmup=3, repeats=20, flush=self.flush)
        row = {**self.base, "op": op, "variant": variant, "ms": round(ms, 4), **extra}
        if bytes_moved is not None:
            row["gbps"] = round(bytes_moved / ms / 1e6, 1)
        if wire_bytes is not None:
            row["wire_gbps"] = round(wire_bytes / ms / 1e6, 1)
        if bytes_moved is None:
            row["wall_ms"] = round(wall_ms(fn), 4)
        self.rows.append(row)
        extra_text = (f"{row['gbps']:8.1f} GB/s" + (f"  wire {row['wire_gbps']:7.1f} GB/s" if wire_bytes else "")
                      if bytes_moved is not None else f"back to back {row['wall_ms']:8.3f} ms")
        say(f"  {op:<17} {variant:<16} {ms:9.3f} ms  {extra_text}")
        return row


def traffic(layer, tokens):
    """One routed step's plan and routes, and its bytes: as copies, and as moved (see the docstring)."""
    with torch.no_grad():
        routing = layer.router(tokens)
        plan = make_plan(routing.experts, layer.num_local_experts, layer.ep_size, layer.segment_rows)
        routes = encode_routes(routing.experts, routing.weights)
        row_bytes = tokens.shape[1] * tokens.element_size()
        owner = routing.experts.reshape(-1).div(layer.num_local_experts, rounding_mode="floor")
        copies_to = torch.zeros(layer.ep_size, dtype=torch.int64, device=tokens.device)
        copies_to.index_add_(0, owner, torch.ones_like(owner))
        tokens_to = plan.counts.to(torch.int64)
        dist.all_reduce(copies_to)  # over the sources: what each rank receives
        dist.all_reduce(tokens_to)
        copies = (tokens.shape[0] * layer.top_k + int(copies_to[layer.ep_rank])) * row_bytes
        wire = (int(plan.counts.sum()) + int(tokens_to[layer.ep_rank])) * row_bytes
    return plan, routes, copies, wire


def time_transport(layer, transport, tokens, plan, routes, copies, wire, record, variant_suffix=""):
    partial = torch.randn(layer.ep_size * layer.segment_rows, layer.hidden, device="cuda", dtype=DTYPE)
    if isinstance(transport, PeerTransport):  # the layer's experts write their rows into its buffer
        partial = transport.partial_buffer().copy_(partial)

    @torch.no_grad()
    def dispatch_combine():
        transport.dispatch(tokens, routes, plan)
        transport.combine(partial, None, plan)

    if not variant_suffix:
        record("dispatch_combine", "eager", dispatch_combine, copies, wire)
    if transport.capturable:
        record("dispatch_combine", "graphed" + variant_suffix, graphed(dispatch_combine), copies, wire)


def bench_shape(shape: Shape, backend: str, flush: L2Flush, ep: int, transport_name: str, sms_sweep,
                nccl_reference: bool) -> list[dict]:
    layer = make_layer(shape, backend, transport_name)
    inputs = make_inputs(shape, dist.get_rank())
    layer(inputs[0][0])  # sets up the transport (symmetric buffers: a collective)
    base = {"bench": "expert_parallel", "shape": shape.label, "splits": "topk", "backend": backend, "ep": ep,
            "transport": layer.transport_name, "capacity": layer.capacity}
    record = Recorder(base, flush)
    say(f" transport {layer.transport_name}, capacity {layer.capacity} copies a rank")
    if layer.transport is not None:
        plan, routes, copies, wire = traffic(layer, inputs[0][0])
        time_transport(layer, layer.transport, inputs[0][0], plan, routes, copies, wire, record)
        if nccl_reference:
            time_nccl(shape, copies, record)
        if transport_name == "peer":
            for sms in sms_sweep:
                other = shared_transport("peer", layer.group, ep, layer.segment_rows, max_tokens=layer.max_tokens,
                                         hidden=layer.hidden, dtype=DTYPE, top_k=layer.top_k, device="cuda",
                                         num_sms=sms, overlap_sms=layer.overlap_sms)
                time_transport(layer, other, inputs[0][0], plan, routes, copies, wire, record, f"_sms{sms}")
        free_memory()
    time_steps(layer, inputs, record)
    rows = record.rows
    if transport_name == "peer":
        for overlap in (16, 32):
            other = make_layer(shape, backend, transport_name, overlap_sms=overlap)
            other(inputs[0][0])
            variant_record = Recorder({**base, "overlap_sms": overlap}, flush)
            time_steps(other, inputs, variant_record, graphed_only=True)
            rows += variant_record.rows
            del other
            free_memory()
    try:
        layer.check_overflow()
    except CapacityOverflowError as error:  # dropped copies make a step cheaper: say so in its rows
        dropped = int(str(error).split()[0])
        for row in rows:
            row["dropped_copies"] = dropped
        say(f"  ({dropped} copies dropped over these steps, all ranks)")
    del layer
    free_memory()
    return rows


def time_nccl(shape, moved, record) -> None:
    """NCCL all_to_all_single with about the bytes of the step's copies (the ranks' largest), in
    equal splits: what NCCL does with the same traffic, balanced and with the sizes known."""
    ep = dist.get_world_size()
    row_bytes = shape.hidden * DTYPE.itemsize
    largest = torch.tensor(moved, device="cuda")
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    per_rank = -(-(int(largest) // 2) // (row_bytes * ep))
    a = torch.randn(per_rank * ep, shape.hidden, device="cuda", dtype=DTYPE)
    b = torch.empty_like(a)

    def nccl():
        dist.all_to_all_single(b, a)
        dist.all_to_all_single(a, b)

    record("nccl_all_to_all", "eager", nccl, 2 * a.numel() * a.element_size())
    del a, b
    free_memory()


class Steps(common.Steps):
    """Training steps of the EP layer over the cycled inputs, with the input's gradient."""

    def __init__(self, layer, inputs):
        super().__init__(layer, inputs)
        self.layer = layer

    def fwd_bwd(self, x, dout):
        self.clear_grads()
        x = x.detach().requires_grad_(True)  # a layer inside a model: its input's gradient is needed
        out = self.layer(x)
        out.backward(dout)
        return out.detach(), x.grad


def time_steps(layer, inputs, record, graphed_only: bool = False) -> None:
    """The layer's forward + backward on new inputs each step, eager and (capturable transports) graphed."""
    steps = Steps(layer, inputs)
    if not graphed_only:
        torch.cuda.reset_peak_memory_stats()
        row = record("fwd_bwd", "eager", steps.eager)
        row["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
    if layer.transport is None or layer.transport.capturable:
        steps.clear_grads()
        free_memory()
        static = graphs.capture_step(steps.fwd_bwd, inputs[0][0].clone(), inputs[0][1].clone())
        torch.cuda.reset_peak_memory_stats()
        row = record("fwd_bwd", "graphed", steps.replay_of(static))
        row["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
        del static


def main() -> None:
    parser = cli(__doc__, [s.name for s in SHAPES])
    parser.add_argument("--transports", default="peer,symm_mem,padded_all_to_all",
                        help="transports to measure on several GPUs (the first also gives the NCCL reference)")
    parser.add_argument("--sms", default="", help="comma-separated CTA counts for the peer transport's calls")
    args = prologue(parser)
    start = time.perf_counter()
    rank, ep = init()
    backend = "cuda" if moe_grouped.backends.cuda_unavailable_reason(torch.device("cuda")) is None else "torch"
    say(f"{torch.cuda.get_device_name()} x {ep}, torch {torch.__version__}; backend {backend}")
    flush = L2Flush()
    sms_sweep = [int(v) for v in args.sms.split(",") if v]
    transports = ["local"] if ep == 1 else args.transports.split(",")
    rows = []
    for shape in SHAPES:
        if shape.name not in args.shapes:
            continue
        if shape.experts % ep:
            say(f"{shape.label}: skipped, {shape.experts} experts do not split over {ep} ranks")
            continue
        say(f"{shape.label}: ep {ep}, {shape.experts // ep} experts per rank")
        for i, transport in enumerate(transports):
            try:
                rows += bench_shape(shape, backend, flush, ep, transport, sms_sweep, nccl_reference=i == 0)
            except Exception as error:  # one transport's failure must not hide the others' figures
                say(f"  {transport} failed: {type(error).__name__}: {error}")
                rows.append({"bench": "expert_parallel", "shape": shape.label, "ep": ep, "transport": transport,
                             "op": "error", "error": f"{type(error).__name__}: {error}"[:500]})
                free_memory()
    if rank == 0:
        path = write_results(f"expert_parallel_ep{ep}", rows)
        print(f"wrote {path} ({time.perf_counter() - start:.0f} s)")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
