"""Time, power and energy of the experts' GEMMs and the MoE layer step at the GPU's power cap.

An H100 SXM running these GEMMs back to back draws its whole power limit
(700 W) and lowers its SM clock to stay there, so a kernel's sustained speed
is set by the energy it spends per FLOP as much as by its schedule; a run
from an idle GPU starts at the top clock and reads faster. This benchmark
measures both for the same graph replay, in one process:

  ms / tflops    from idle: after IDLE_S seconds idle, the median of RUNS
                 CUDA-event-timed replays, each after a 256 MB L2 flush
                 (how the other benchmarks time)
  steady_*       back to back: WARM_S seconds of replays, then WINDOW_S seconds
                 more, timed on the host between synchronisations
  watts, mj      average power and energy per run over that window (NVML's
                 total-energy counter)
  sm_mhz         median SM clock sampled during the window
  capped         fraction of those samples in which NVML lists the software
                 power cap among the clock's current event reasons (it is
                 listed even where the clock stays near its top, as in the
                 torch layer steps: sm_mhz shows how far the clock came down)

GEMM rows (the six GEMMs of benchmarks/kernels/experts_gemm_tiles.py on ``topk_random``
splits of the issue-19 shapes, R = T * top-k rows): ``cuda`` the core's
choice, ``torch`` torch._grouped_mm, ``loop`` one matmul per expert, ``dense``
one matmul of the same FLOPs (the ceiling). Layer rows (op ``fwd_bwd``, splits
``router``): a captured training step of MoELayer as in benchmarks/moe_layer.py
(``cuda_fused_graphed``, ``torch_graphed``), new inputs every step; tflops
counts the expert GEMMs only (18 * T * k * H * I).

    python benchmarks/kernels/power_envelope.py [--shapes qwen3_30b_16k,...]
    # table + results/power_envelope-<gpu>.json
"""

from __future__ import annotations

import ctypes
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: common, grouped_gemm, moe_layer
from common import L2Flush, cli, graphed, prologue, time_ms, write_results  # noqa: E402
from experts_gemm_tiles import OPS, Experts  # noqa: E402
from gathered_gemm import SHAPES  # noqa: E402

IDLE_S = 0.3
RUNS = 10
WARM_S = 0.3
WINDOW_S = 0.8
SAMPLE_S = 0.02
GEMM_BACKENDS = ("cuda", "torch", "loop", "dense")
LAYER_BACKENDS = ("cuda_fused", "torch")
SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap


class Nvml:
    """The few NVML queries this benchmark needs, through ctypes (no extra package)."""

    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError as error:
            raise SystemExit(f"power_envelope needs NVML (libnvidia-ml.so.1): {error}") from error
        self._check(self.lib.nvmlInit_v2(), "nvmlInit_v2")
        # NVML's device order need not be CUDA's (CUDA_VISIBLE_DEVICES): find torch's device by its UUID.
        uuid = f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}".encode()
        self.handle = ctypes.c_void_p()
        self._check(self.lib.nvmlDeviceGetHandleByUUID(uuid, ctypes.byref(self.handle)),
                    f"nvmlDeviceGetHandleByUUID({uuid.decode()})")
        reasons = getattr(self.lib, "nvmlDeviceGetCurrentClocksEventReasons", None)
        self._reasons = reasons or self.lib.nvmlDeviceGetCurrentClocksThrottleReasons

    @staticmethod
    def _check(status: int, call: str) -> None:
        if status != 0:
            raise RuntimeError(f"{call} failed with NVML status {status}")

    def _query(self, fn, ctype, *args):
        value = ctype()
        self._check(fn(self.handle, *args, ctypes.byref(value)), fn.__name__)
        return value.value

    def energy_mj(self) -> int:
        return self._query(self.lib.nvmlDeviceGetTotalEnergyConsumption, ctypes.c_ulonglong)

    def sm_mhz(self) -> int:
        return self._query(self.lib.nvmlDeviceGetClockInfo, ctypes.c_uint, 1)  # NVML_CLOCK_SM

    def clock_reasons(self) -> int:
        return self._query(self._reasons, ctypes.c_ulonglong)

    def power_limit_w(self) -> float:
        return self._query(self.lib.nvmlDeviceGetEnforcedPowerLimit, ctypes.c_uint) / 1000.0


def from_idle_ms(run, flush: L2Flush) -> float:
    """Median ms of RUNS flushed runs, after IDLE_S seconds with nothing on the GPU."""
    torch.cuda.synchronize()
    time.sleep(IDLE_S)
    return time_ms(run, warmup=0, repeats=RUNS, flush=flush)


def steady(run, nvml: Nvml, run_ms_estimate: float) -> dict:
    """Back-to-back runs: ms per run, watts, mJ per run, median SM clock and the capped fraction."""
    count = max(3, int(WINDOW_S * 1e3 / run_ms_estimate))
    for _ in range(max(1, int(WARM_S * 1e3 / run_ms_estimate))):
        run()
    torch.cuda.synchronize()
    energy, start = nvml.energy_mj(), time.perf_counter()
    for _ in range(count):
        run()
    done = torch.cuda.Event()
    done.record()
    clocks, capped = [], 0
    while not done.query():
        clocks.append(nvml.sm_mhz())
        capped += bool(nvml.clock_reasons() & SW_POWER_CAP)
        time.sleep(SAMPLE_S)
    done.synchronize()
    seconds = time.perf_counter() - start
    joules = (nvml.energy_mj() - energy) / 1e3
    return {"steady_ms": round(seconds * 1e3 / count, 5), "watts": round(joules / seconds, 1),
            "mj": round(joules * 1e3 / count, 2), "sm_mhz": statistics.median(clocks) if clocks else nvml.sm_mhz(),
            "capped": round(capped / len(clocks), 3) if clocks else None}


def measure(run, flops: float, nvml: Nvml, flush: L2Flush, **row) -> dict:
    run()  # a graph's first replay also uploads it
    ms = from_idle_ms(run, flush)
    result = steady(run, nvml, ms)
    return {"bench": "power_envelope", **row, "ms": round(ms, 5), "tflops": round(flops / ms / 1e9, 2),
            **result, "steady_tflops": round(flops / result["steady_ms"] / 1e9, 2)}


def gemm_rows(name: str, nvml: Nvml, flush: L2Flush) -> list[dict]:
    problem = Experts(SHAPES[name], "topk_random")
    rows = []
    for op in OPS:
        runs = {"cuda": graphed(problem.core(op))}
        for backend in GEMM_BACKENDS[1:]:
            runs[backend] = graphed(problem.reference(op, backend))
        for backend, run in runs.items():
            rows.append(measure(run, problem.flops(op), nvml, flush, op=op, shape=name, splits="topk_random",
                                backend=backend))
            print_row(rows[-1])
        del runs
    del problem
    torch.cuda.empty_cache()
    return rows


def layer_rows(name: str, nvml: Nvml, flush: L2Flush) -> list[dict]:
    import moe_layer

    shape = next(s for s in moe_layer.EXPERTS_PATH_SHAPES if s.name == name)
    rows = []
    for backend in LAYER_BACKENDS:
        steps = moe_layer.Steps(moe_layer.make_layer(shape, backend), moe_layer.make_inputs(shape))
        steps.eager()
        static, replay = steps.capture()
        rows.append(measure(replay, shape.flops(), nvml, flush, op="fwd_bwd", shape=name, splits="router",
                            backend=f"{backend}_graphed"))
        print_row(rows[-1])
        del steps, static, replay
        moe_layer.free_memory()
    return rows


def print_row(row: dict) -> None:
    capped = "-" if row["capped"] is None else f"{row['capped']:.2f}"
    print(f"{row['op']:<10} {row['shape']:<15} {row['backend']:<18} {row['ms']:8.3f} {row['tflops']:6.0f} | "
          f"{row['steady_ms']:8.3f} {row['steady_tflops']:6.0f} {row['watts']:5.0f} W {row['mj']:8.1f} mJ "
          f"{row['sm_mhz']:5.0f} MHz capped {capped}", flush=True)


def summarize(rows: list[dict]) -> None:
    """Per shape: the core's GEMM energy against dense GEMMs of the same FLOPs, and the layer's two speeds."""
    print("\nenergy per step's GEMMs, relative to dense GEMMs of the same FLOPs (steady state):")
    for name in dict.fromkeys(r["shape"] for r in rows):
        shape_rows = [r for r in rows if r["shape"] == name]
        energy = {}  # backend -> mJ of its six GEMMs
        for r in shape_rows:
            if r["op"] != "fwd_bwd":
                energy[r["backend"]] = energy.get(r["backend"], 0.0) + r["mj"]
        if energy.get("dense"):
            print(f"  {name:<15} " + "  ".join(f"{b} {mj / energy['dense']:.3f}x" for b, mj in energy.items()))
        for r in shape_rows:
            if r["op"] == "fwd_bwd":
                print(f"    {r['backend']:<18} step {r['ms']:.3f} ms from idle, {r['steady_ms']:.3f} ms back to back "
                      f"({r['steady_ms'] / r['ms']:.3f}x), {r['mj'] / 1e3:.2f} J at {r['watts']:.0f} W")


def main() -> None:
    parser = cli(__doc__, SHAPES)
    parser.add_argument("--no-gemms", action="store_true", help="only the layer steps")
    args = prologue(parser)
    names = args.shapes
    nvml = Nvml()
    flush = L2Flush()
    limit = nvml.power_limit_w()
    print(f"power limit {limit:.0f} W; columns: from idle ms, TFLOP/s | back to back ms, TFLOP/s, W, mJ per run, "
          "SM clock, capped fraction", flush=True)
    rows = []
    for name in names:
        if not args.no_gemms:
            rows += gemm_rows(name, nvml, flush)
        rows += layer_rows(name, nvml, flush)
    summarize(rows)
    print(f"wrote {write_results('power_envelope', rows, power_limit_w=limit)}")


if __name__ == "__main__":
    main()
