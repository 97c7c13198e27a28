"""Expert parallelism: dispatch + combine bandwidth and the EP layer's step time, eager and graphed.

Runs on any number of GPUs of one host, one process each, under torchrun (or
plain ``python`` for one GPU):

    torchrun --nproc-per-node 1 benchmarks/expert_parallel.py
    torchrun --nproc-per-node 8 benchmarks/expert_parallel.py

Every rank routes T = 8192 tokens of its own; each holds E / ep experts of
``moe_grouped.parallel.ExpertParallelMoELayer`` (bf16, the cuda backend where
the core is built, else torch). Transports (rows name them and the capacity):
the layer's ``auto`` (``local`` on one GPU, ``symm_mem`` (NVSHMEM) for up to
16 ranks) at the default capacity, and on several GPUs ``padded_all_to_all``
(NCCL, fixed-size chunks of capacity / ep rows) at the default capacity and
at 1.5x and 1.25x the average load (rows a rank); a row whose steps dropped
copies for lack of room says how many (``dropped_copies``).

ops (rows carry ``ep`` and ``transport``):
  dispatch_combine   the transport's dispatch of one routed step's token copies
                     and the combine of the received rows back, forward only;
                     eager and captured in a CUDA graph (capturable transports).
                     ``gbps``: bytes this GPU sends in both (its T * top_k
                     copies out, the rows it received back), H * 2 bytes a row,
                     over the time: per-GPU send bandwidth. On one GPU the
                     "transport" is a device copy.
  nccl_all_to_all    ``torch.distributed.all_to_all_single`` there and back of
                     the same bytes in equal splits: what NCCL does with the
                     same traffic, balanced and with the splits known (once
                     per shape, with the bytes of the first transport).
  fwd_bwd            the layer's forward + backward on new inputs each step
                     (so new routing), eager and as a step captured with
                     ``moe_grouped.graphs.capture_step``; ``wall_ms`` steps
                     back to back.
``ms``: median of CUDA-event-timed runs, each after an L2 flush, printed and
written by rank 0 (every rank runs the same sequence; the collectives pace
each other).

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

import gc  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

if not torch.cuda.is_available():
    raise SystemExit("benchmarks/expert_parallel.py needs CUDA GPUs, and torch sees none; run it on the GPU machine")

import moe_grouped  # noqa: E402
from common import L2Flush, graphed, time_ms, write_results  # noqa: E402
from moe_grouped import graphs  # noqa: E402
from moe_grouped.parallel import CapacityOverflowError, ExpertParallelMoELayer  # noqa: E402
from moe_grouped.permute import resolve_backend  # noqa: E402

DTYPE = torch.bfloat16
TOKENS = 8192
NUM_INPUTS = 4  # distinct inputs the steps cycle through: new routing every step
WALL_STEPS = 10


@dataclass
class Shape:
    name: str
    hidden: int
    ffn: int
    experts: int
    top_k: int
    tokens: int = TOKENS

    @property
    def label(self) -> str:
        return f"{self.name}_H{self.hidden}_F{self.ffn}_E{self.experts}_k{self.top_k}_T{self.tokens}"


SHAPES = [
    Shape("qwen3_30b", 2048, 768, 128, 8),
    Shape("dsv2_lite", 2048, 1408, 64, 6),
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
    return dist.get_rank(), dist.get_world_size()


def say(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def make_layer(shape: Shape, backend: str, transport: str, capacity) -> ExpertParallelMoELayer:
    torch.manual_seed(0)
    return ExpertParallelMoELayer(
        shape.hidden, shape.ffn, shape.experts, shape.top_k, router_options=dict(normalize_topk=True),
        max_tokens=shape.tokens, single_grouped_weight=True, dtype=DTYPE, device="cuda", backend=backend,
        transport=transport, capacity=capacity,
    )


def transports(shape: Shape, ep: int) -> list[tuple[str, object]]:
    """(transport, capacity) pairs to measure: the layer's ``auto`` at the default (worst-case)
    capacity, and on several GPUs the fixed-size NCCL one at that capacity and at 1.5x and
    1.25x the average load (its chunks are capacity // ep rows whatever the load)."""
    if ep == 1:
        return [("auto", None)]
    load = shape.tokens * shape.top_k
    return [("auto", None), ("padded_all_to_all", None), ("padded_all_to_all", int(1.5 * load)),
            ("padded_all_to_all", int(1.25 * load))]


def make_inputs(shape: Shape, rank: int):
    gen = torch.Generator(device="cuda").manual_seed(1 + rank)
    return [
        (torch.randn(shape.tokens, shape.hidden, device="cuda", dtype=DTYPE, generator=gen),
         torch.randn(shape.tokens, shape.hidden, device="cuda", dtype=DTYPE, generator=gen))
        for _ in range(NUM_INPUTS)
    ]


def wall_ms(step, steps: int = WALL_STEPS) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / steps


def bench_shape(shape: Shape, backend: str, flush: L2Flush, ep: int, transport_name: str, capacity,
                nccl_reference: bool) -> list[dict]:
    rows = []
    layer = make_layer(shape, backend, transport_name, capacity)
    inputs = make_inputs(shape, dist.get_rank())
    layer(inputs[0][0])  # sets up the transport (symmetric buffers: a collective)
    transport = layer.transport
    base = {"bench": "expert_parallel", "shape": shape.label, "ep": ep, "transport": layer.transport_name,
            "capacity": layer.capacity, "backend": backend}
    say(f" transport {layer.transport_name}, capacity {layer.capacity} rows a rank")

    def record(op, variant, fn, bytes_moved=None):
        ms = time_ms(fn, warmup=3, repeats=20, flush=flush)
        row = {**base, "op": op, "variant": variant, "ms": round(ms, 4)}
        if bytes_moved is not None:
            row["gbps"] = round(bytes_moved / ms / 1e6, 1)
        else:
            row["wall_ms"] = round(wall_ms(fn), 4)
        rows.append(row)
        extra = f"{row['gbps']:8.1f} GB/s" if "gbps" in row else f"back to back {row['wall_ms']:8.3f} ms"
        say(f"  {op:<17} {variant:<8} {ms:9.3f} ms  {extra}")

    # One routed step's send buffer and counts, as the layer builds them.
    with torch.no_grad():
        tokens = inputs[0][0]
        routing = layer.router(tokens)
        experts = routing.experts.contiguous()
        permute_backend = resolve_backend(layer.backend, tokens.device)
        row_id_map, m_splits = torch.ops.moe_grouped.permute_index(
            experts, None, shape.experts, -1, False, permute_backend
        )
        send, _, in_splits = layer.send_buffer(tokens, routing, row_id_map, m_splits, permute_backend)
        recv, layout = transport.dispatch(send, in_splits, layer.recv_rows)
        transport.combine(recv, layout, in_splits, send.shape[0])  # symm_mem: dispatch, combine alternating
        received = int(layout[0].sum())
    row_bytes = shape.hidden * DTYPE.itemsize
    moved = (int(in_splits.sum()) + received) * row_bytes

    @torch.no_grad()
    def dispatch_combine():
        got, got_layout = transport.dispatch(send, in_splits, layer.recv_rows)
        transport.combine(got, got_layout, in_splits, send.shape[0])

    record("dispatch_combine", "eager", dispatch_combine, moved)
    if transport.capturable:
        record("dispatch_combine", "graphed", graphed(dispatch_combine), moved)
    del recv
    free_memory()

    if nccl_reference:
        time_nccl(shape, moved, row_bytes, ep, record)
    time_steps(layer, inputs, record)
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


def time_nccl(shape, moved, row_bytes, ep, record) -> None:
    """NCCL all_to_all_single with about the bytes the transport moved (the ranks' largest), in
    equal splits: what NCCL does with the same traffic, balanced and with the sizes known."""
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


def time_steps(layer, inputs, record) -> None:
    """The layer's forward + backward on new inputs each step, eager and (capturable transports) graphed."""
    params = list(layer.parameters())
    index = [0]

    def fwd_bwd(x, dout):
        for p in params:
            p.grad = None
        out = layer(x)
        out.backward(dout)
        return out.detach()

    def eager():
        x, dout = inputs[index[0] % NUM_INPUTS]
        index[0] += 1
        fwd_bwd(x, dout)

    record("fwd_bwd", "eager", eager)
    if layer.transport.capturable:
        for p in params:
            p.grad = None
        free_memory()
        static = graphs.capture_step(fwd_bwd, inputs[0][0].clone(), inputs[0][1].clone())

        def replay():
            x, dout = inputs[index[0] % NUM_INPUTS]
            index[0] += 1
            static(x, dout)

        record("fwd_bwd", "graphed", replay)
        del static


def main() -> None:
    start = time.perf_counter()
    rank, ep = init()
    backend = "cuda" if moe_grouped.backends.cuda_unavailable_reason(torch.device("cuda")) is None else "torch"
    say(f"{torch.cuda.get_device_name()} x {ep}, torch {torch.__version__}; backend {backend}")
    flush = L2Flush()
    rows = []
    for shape in SHAPES:
        if shape.experts % ep:
            say(f"{shape.label}: skipped, {shape.experts} experts do not split over {ep} ranks")
            continue
        say(f"{shape.label}: ep {ep}, {shape.experts // ep} experts per rank")
        for i, (transport, capacity) in enumerate(transports(shape, ep)):
            rows += bench_shape(shape, backend, flush, ep, transport, capacity, nccl_reference=i == 0)
    if rank == 0:
        path = write_results(f"expert_parallel_ep{ep}", rows)
        print(f"wrote {path} ({time.perf_counter() - start:.0f} s)")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
