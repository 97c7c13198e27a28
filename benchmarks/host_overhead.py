"""Host time of an eager training step: what a layer call costs the CPU.

Each case is a forward + backward at a size where the GPU finishes its work
faster than the host issues it (T=256 tokens, hidden 1024, expert ffn 512,
64 experts, top-8, bf16), so the host is the bound. A round issues ``--steps``
steps back to back without a sync and then syncs:
  host_ms  time to issue one step (the loop's time before the final sync / steps)
  wall_ms  the same including the sync
Both are the median over ``--rounds`` rounds (CPU times are noisy); the cases take
turns round by round, so that a busy spell on the host falls on all of them. Every step
sets the gradients to None first and uses new random inputs (4 cycled pairs).

Cases:
  moe_layer_cuda_fused      MoELayer, cuda backend, fused experts path (default: one [E, N, K] weight a layer)
  moe_layer_cuda_fused_per_expert  the same with single_grouped_weight=False (a weight per expert)
  moe_layer_cuda_unfused    MoELayer, cuda backend, unfused path
  moe_layer_torch           MoELayer, torch backend (torch._grouped_mm)
  moe_layer_cuda_fp8        MoELayer in fp8_autocast (the fused experts op in FP8 since 2026-11-28; unfused before)
  moe_layer_compiled        torch.compile(MoELayer) (default mode: no CUDA graphs), cuda fused
  ep_layer_cuda_fused       ExpertParallelMoELayer on a one-rank group
  grouped_linear_cuda       GroupedLinear 1024 -> 1024 on T*k=2048 permuted rows
  grouped_linear_cuda_fp8   the same in fp8_autocast
  hf_block_grouped_mm       transformers' Qwen3MoeSparseMoeBlock, its grouped_mm experts
  hf_block_moe_grouped      the same block with our experts implementation
  hf_model_grouped_mm       a 4-layer Qwen3-MoE causal LM (4 x 1024 tokens), training step
  hf_model_moe_grouped      the same with our experts; ``ms`` is its synchronised step time
The breakdown (``--breakdown``, on by default for two cases) lists the top ops
by self CPU time from torch.profiler for one step.

    python benchmarks/host_overhead.py                       # table + results/host_overhead-<gpu>.json
    python benchmarks/host_overhead.py --cases moe_layer_cuda_fused --cprofile   # Python hot spots
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import pathlib
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import common  # noqa: E402
from common import add_names, cli, free_memory, prologue, write_results  # noqa: E402
import moe_grouped  # noqa: E402
from moe_grouped import fp8  # noqa: E402

TOKENS, HIDDEN, FFN, EXPERTS, TOP_K = 256, 1024, 512, 64, 8
MODEL_BATCH, MODEL_SEQ, MODEL_LAYERS, MODEL_VOCAB = 4, 1024, 4, 32768
DTYPE = torch.bfloat16


class Case(common.Steps):
    """One case: ``step()`` runs an eager forward + backward of ``module`` on the next of its inputs,
    :data:`common.NUM_INPUTS` pairs ``make_input(gen)`` = ((args...), dout), dout None where the module
    returns a scalar loss."""

    def __init__(self, module, make_input):
        gen = torch.Generator(device="cuda").manual_seed(1)
        super().__init__(module, [make_input(gen) for _ in range(common.NUM_INPUTS)])
        self.module = module

    def fwd_bwd(self, args, dout) -> None:
        self.clear_grads()
        self.module(*args).backward(dout)

    def step(self) -> None:
        self.eager()


def _tokens_and_grad(gen, rows=TOKENS, width=HIDDEN):
    x = torch.randn(rows, width, device="cuda", dtype=DTYPE, generator=gen).requires_grad_(True)
    return (x,), torch.randn(rows, width, device="cuda", dtype=DTYPE, generator=gen)


def moe_layer_case(backend: str, experts_path=None, *, autocast=False, compiled=False, single=True) -> Case:
    layer = moe_grouped.MoELayer(
        HIDDEN, FFN, EXPERTS, TOP_K, dtype=DTYPE, device="cuda", backend=backend, experts_path=experts_path,
        single_grouped_weight=single,
    )
    module = torch.compile(layer) if compiled else layer
    if autocast:
        module = _InAutocast(module)
    return Case(module, _tokens_and_grad)


class _InAutocast(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        with fp8.fp8_autocast():
            return self.inner(*args)


class _WithSplits(torch.nn.Module):
    """GroupedLinear on permuted rows with fixed device splits (the splits are an input, not a parameter)."""

    def __init__(self, autocast: bool):
        super().__init__()
        self.linear = moe_grouped.GroupedLinear(EXPERTS, HIDDEN, HIDDEN, dtype=DTYPE, device="cuda", backend="cuda")
        counts = torch.distributions.Multinomial(
            TOKENS * TOP_K, torch.ones(EXPERTS)).sample().to(torch.int64)
        self.register_buffer("m_splits", counts.cuda())
        self.autocast = autocast

    def forward(self, x):
        with fp8.fp8_autocast() if self.autocast else contextlib.nullcontext():
            return self.linear(x, self.m_splits)


def grouped_linear_case(autocast: bool) -> Case:
    return Case(_WithSplits(autocast), lambda gen: _tokens_and_grad(gen, rows=TOKENS * TOP_K))


def ep_layer_case() -> Case:
    import torch.distributed as dist
    from moe_grouped.parallel import ExpertParallelMoELayer

    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    layer = ExpertParallelMoELayer(HIDDEN, FFN, EXPERTS, TOP_K, dtype=DTYPE, device="cuda", backend="cuda")
    return Case(layer, _tokens_and_grad)


def _transformers():
    try:
        import transformers
        from moe_grouped.integrations import transformers as mg_transformers
    except ImportError as error:
        raise SystemExit(f'the hf_* cases need transformers>=5: pip install "transformers>=5" ({error})')
    return transformers, mg_transformers.register()


def _qwen3_config(transformers, implementation: str, **sizes):
    config = transformers.Qwen3MoeConfig(
        hidden_size=HIDDEN, moe_intermediate_size=FFN, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        norm_topk_prob=True, **sizes,
    )
    config._experts_implementation = implementation
    return config


def _init_normal(module) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for param in module.parameters():  # transformers' modules may leave parameters uninitialised
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)


def hf_block_case(implementation: str) -> Case:
    transformers, ours = _transformers()
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    block = Qwen3MoeSparseMoeBlock(_qwen3_config(transformers, ours if implementation == "ours" else implementation))
    block = block.to(device="cuda", dtype=DTYPE)
    _init_normal(block)
    def make_input(gen):  # the block takes [batch, seq, hidden]
        (x,), dout = _tokens_and_grad(gen)
        return (x.detach().unsqueeze(0).requires_grad_(True),), dout.unsqueeze(0)

    return Case(block, make_input)


def hf_model_case(implementation: str) -> Case:
    transformers, ours = _transformers()
    config = _qwen3_config(
        transformers, ours if implementation == "ours" else implementation,
        num_hidden_layers=MODEL_LAYERS, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
        intermediate_size=4 * HIDDEN, vocab_size=MODEL_VOCAB, max_position_embeddings=MODEL_SEQ,
    )
    config._attn_implementation = "sdpa"
    model = transformers.Qwen3MoeForCausalLM(config).to(device="cuda", dtype=DTYPE)
    _init_normal(model)
    model.train()

    def make_input(gen):
        ids = torch.randint(0, MODEL_VOCAB, (MODEL_BATCH, MODEL_SEQ), device="cuda", generator=gen)
        return (ids,), None

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(input_ids=ids, labels=ids).loss

    return Case(Step(), make_input)


CASES = {
    "moe_layer_cuda_fused": lambda: moe_layer_case("cuda", "fused"),
    "moe_layer_cuda_fused_per_expert": lambda: moe_layer_case("cuda", "fused", single=False),
    "moe_layer_cuda_unfused": lambda: moe_layer_case("cuda", "unfused"),
    "moe_layer_torch": lambda: moe_layer_case("torch"),
    "moe_layer_cuda_fp8": lambda: moe_layer_case("cuda", autocast=True),
    "moe_layer_compiled": lambda: moe_layer_case("cuda", "fused", compiled=True),
    "ep_layer_cuda_fused": ep_layer_case,
    "grouped_linear_cuda": lambda: grouped_linear_case(False),
    "grouped_linear_cuda_fp8": lambda: grouped_linear_case(True),
    "hf_block_grouped_mm": lambda: hf_block_case("grouped_mm"),
    "hf_block_moe_grouped": lambda: hf_block_case("ours"),
    "hf_model_grouped_mm": lambda: hf_model_case("grouped_mm"),
    "hf_model_moe_grouped": lambda: hf_model_case("ours"),
}
BREAKDOWN = ("moe_layer_cuda_fused", "hf_block_moe_grouped")


def one_round(case: Case, steps: int) -> tuple[float, float]:
    """(host ms, wall ms) per step of ``steps`` steps issued back to back from an idle GPU."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        case.step()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (issued - start) * 1e3 / steps, (done - start) * 1e3 / steps


def measure(cases: dict, steps: dict, rounds: int, synced: frozenset = frozenset()) -> dict:
    """Case -> median host and wall ms per step; the cases take turns every round (the order reversed
    every other round), so a busy spell on the host falls on all of them. Cases in ``synced`` also get
    ``ms``: the median of single synchronised steps, a few taken in each of their rounds."""
    for case in cases.values():
        for _ in range(5):
            case.step()
    times = {name: ([], [], []) for name in cases}
    for r in range(rounds):
        for name in (list(cases) if r % 2 == 0 else list(cases)[::-1]):
            host, wall = one_round(cases[name], steps[name])
            times[name][0].append(host)
            times[name][1].append(wall)
            if name in synced:
                times[name][2].extend(synced_times(cases[name], 4))
    results = {}
    for name, (host, wall, steps_ms) in times.items():
        results[name] = {"host_ms": statistics.median(host), "host_ms_min": min(host),
                         "wall_ms": statistics.median(wall)}
        if steps_ms:
            results[name]["ms"] = statistics.median(steps_ms)
    return results


def synced_times(case: Case, steps: int) -> list[float]:
    """Milliseconds of single steps, each ended by a sync (a model step's time as a user sees it)."""
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        case.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def breakdown(case: Case, top: int = 15) -> list[dict]:
    """The ``top`` ops by self CPU time over 10 steps (torch.profiler), per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            case.step()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"op": e.key, "calls_per_step": e.count / 10, "self_cpu_us_per_step": round(e.self_cpu_time_total / 10, 1)}
            for e in events]


def python_profile(case: Case, steps: int = 200) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        case.step()
    profiler.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=out).sort_stats(key).print_stats(45)
    return out.getvalue()


def main() -> None:
    parser = cli(__doc__)
    add_names(parser, "--cases", CASES)
    parser.add_argument("--steps", type=int, default=100, help="steps per round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per case (the median is reported)")
    parser.add_argument("--cprofile", action="store_true", help="print each case's Python profile (cProfile)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave the results file alone")
    args = prologue(parser)
    rows, breakdowns, cases = [], {}, {}
    shape = f"T{TOKENS}_H{HIDDEN}_F{FFN}_E{EXPERTS}_k{TOP_K}"
    model_shape = f"L{MODEL_LAYERS}_B{MODEL_BATCH}_S{MODEL_SEQ}_H{HIDDEN}_F{FFN}_E{EXPERTS}_k{TOP_K}"
    for name in args.cases:
        try:
            cases[name] = CASES[name]()
            cases[name].step()
        except Exception as failure:  # noqa: BLE001 -- report it and go on with the other cases
            print(f"{name:<26} failed: {type(failure).__name__}: {failure}", flush=True)
            cases.pop(name, None)
    steps = {name: max(args.steps // 10, 5) if name.startswith("hf_model") else args.steps for name in cases}
    models = frozenset(name for name in cases if name.startswith("hf_model"))
    results = measure(cases, steps, args.rounds, synced=models)
    for name, case in cases.items():
        row = {"bench": "host_overhead", "op": "fwd_bwd", "case": name, "backend": name,
               "shape": model_shape if name in models else shape, "splits": "router",
               **{k: round(v, 4) for k, v in results[name].items()}}
        row.setdefault("ms", row["wall_ms"])
        rows.append(row)
        print(f"{name:<26} host {row['host_ms']:8.3f} ms  (min {row['host_ms_min']:.3f})  wall {row['wall_ms']:8.3f} ms"
              f"  step {row['ms']:8.3f} ms", flush=True)
    for name, case in cases.items():
        if name in BREAKDOWN:
            breakdowns[name] = breakdown(case)
            print(f"{name}: top ops by self CPU time per step (torch.profiler)")
            for entry in breakdowns[name]:
                print(f"    {entry['self_cpu_us_per_step']:9.1f} us  {entry['calls_per_step']:6.1f}x  {entry['op']}")
        if args.cprofile:
            print(f"{name}: Python profile of 200 steps")
            print(python_profile(case))
    by_case = {r["case"]: r for r in rows}
    for ours, theirs in (("hf_block_moe_grouped", "hf_block_grouped_mm"), ("hf_model_moe_grouped", "hf_model_grouped_mm")):
        if ours in by_case and theirs in by_case:
            print(f"{ours} / {theirs}: host {by_case[ours]['host_ms'] / by_case[theirs]['host_ms']:.2f}x, "
                  f"step {by_case[ours]['ms'] / by_case[theirs]['ms']:.2f}x")
    if not args.no_write:
        print(f"wrote {write_results('host_overhead', rows, breakdown=breakdowns)}")


if __name__ == "__main__":
    main()
