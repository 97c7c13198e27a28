#!/usr/bin/env bash
# Usage (device tool, carrying .devbuild/lib): bash tools/device.sh PHASE [PHASE...]
# GPU work with a core built here and carried (.devbuild/lib/libmoe_grouped_core.so; make it
# with tools/build_core.sh) and, for the transformers cases, wheels in .whl/ (pip download
# transformers nvtx for Python 3.12; carry both). Phases:
#   smoke      ep_suite with few replays on 2 GPUs, then on 4
#   suite      ep_suite with 1000 replays on 2 GPUs, then on 4
#   sanitize   a short ep 2 run of ep_suite under compute-sanitizer memcheck
#   memcheck   tools/memcheck_layer.py (the one-GPU layer's steps) under compute-sanitizer memcheck
#   bench      benchmarks/expert_parallel.py on 1, 2 and 4 GPUs (EP_SMS: --sms sweep)
#   profile    tools/ep_profile.py on 2 GPUs and on 1 (EP_PROFILE_ARGS: its options)
#   example    examples/train_moe.py --ep N --compare-eager --steps 200 (graphs vs eager; N = min(GPUs, 4))
#   fp8-example  examples/train_moe.py --device cuda --graphs, bf16 and --fp8 (FP8_EXAMPLE_ARGS: more options)
#   gpu-tests  the single-GPU test suite in GPU_TEST_SHARDS processes (default 2 per GPU)
#   pytest     python -m pytest $PYTEST_ARGS (a few files or tests on one GPU)
#   moe-bench  benchmarks/moe_layer.py $MOE_BENCH_ARGS (default: --shapes experts_path)
#   fp8-ceiling  benchmarks/kernels/fp8_ceiling.py --rounds 4 (FP8 GEMMs against dense FP8)
#   fp8-accuracy  benchmarks/fp8_accuracy.py (FP8 layer's outputs and gradients against bf16 and fp32)
#   wgrad-probe  tools/fp8_wgrad_probe.py $WGRAD_PROBE_ARGS, then ncu on WGRAD_NCU (CASE:TOKENS, if set)
#   wgrad-ab   tools/fp8_wgrad_probe.py under each core build of WGRAD_AB_LIBS (directories holding
#              libmoe_grouped_core.so; carry them): --digest per build (same bits?), then
#              WGRAD_AB_PAIRS rounds (default 2) of alternating timed processes ($WGRAD_PROBE_ARGS)
#   moe-ab     benchmarks/moe_layer.py --shapes experts_path per entry of MOE_AB_SETS, each
#              NAME:TREE:LIBDIR (TREE a tools/old_tree.sh package or empty for the working tree's;
#              carry both), one after the other; each run's JSON to $OUT/moe_ab_NAME.json
#   layer-profile  tools/layer_profile.py $LAYER_PROFILE_ARGS (kernel times of one MoELayer step)
#   probe      tools/host_probe.py (PROBE_ARGS: its options)
#   parts      tools/host_parts.py (host time of the parts of one eager MoELayer step; PARTS_ARGS: its
#              options instead of --trace)
#   host       benchmarks/host_overhead.py (HOST_ARGS: its options)
#   host-pin   host_overhead's HOST_PIN_CASES in processes unpinned, on one core and on two (taskset),
#              taking turns, HOST_PIN_REPEATS times (default 2)
#   host-ab    host_overhead's HOST_AB_CASES, the working tree against .devbuild/before
#              (tools/old_tree.sh COMMIT; carry it; a libmoe_grouped_core.so copied there is
#              the old package's core), HOST_AB_PAIRS alternating pairs of processes (default 3),
#              then the median after/before ratio per case
# Logs and results go to $OUT (at most 8 files come back).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/moe_grouped_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export MOE_GROUPED_CORE_LIB=$PWD/.devbuild/lib/libmoe_grouped_core.so
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --find-links .whl transformers nvtx > /tmp/wheels.log 2>&1 \
    || { tail -5 /tmp/wheels.log; echo "(wheels not installed)"; }
fi
MOE_GROUPED_BUILD_CORE=OFF python3 -m pip install -q --no-build-isolation --no-deps -e . > /tmp/install.log 2>&1 \
  || { tail -30 /tmp/install.log; exit 1; }
python3 -m moe_grouped info | grep -E "core|gpu|torch" | head -6
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi topo -m 2>/dev/null | head -8
status=0
run() {  # run NAME COMMAND...: its output to $OUT/NAME.log, a tail here, status kept
  local name=$1; shift
  echo "== $name: $*"
  local start=$(date +%s)
  timeout -k 10 "${RUN_TIMEOUT:-300}" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-12}" "$OUT/$name.log"
  echo "== $name: exit $rc, $(( $(date +%s) - start )) s"
  [ "$rc" -eq 0 ] || status=$rc
}
torchrun_n="python3 -m torch.distributed.run --standalone --nproc-per-node"
for phase in "$@"; do
  case $phase in
    smoke)
      run smoke2 $torchrun_n 2 tests/multi_gpu/ep_suite.py --replays 12
      [ "$gpus" -ge 4 ] && run smoke4 $torchrun_n 4 tests/multi_gpu/ep_suite.py --replays 12 ;;
    suite)
      run suite2 $torchrun_n 2 tests/multi_gpu/ep_suite.py --replays 1000
      [ "$gpus" -ge 4 ] && run suite4 $torchrun_n 4 tests/multi_gpu/ep_suite.py --replays 1000 ;;
    sanitize)
      run sanitize $torchrun_n 2 --no-python compute-sanitizer --tool memcheck --error-exitcode 7 \
        python3 tests/multi_gpu/ep_suite.py --replays 4 --quick ;;
    memcheck)
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 run memcheck compute-sanitizer --tool memcheck --error-exitcode 7 \
        python3 tools/memcheck_layer.py ;;
    bench)
      sms="${EP_SMS:+--sms $EP_SMS} ${EP_BENCH_ARGS:-}"
      for n in ${EP_BENCH_GPUS:-4 2 1}; do
        [ "$gpus" -ge "$n" ] || continue
        TAIL=40 run "bench$n" $torchrun_n "$n" benchmarks/expert_parallel.py $sms
      done
      cp benchmarks/results/expert_parallel_ep*.json "$OUT/" ;;
    profile)
      for n in 4 2 1; do
        [ "$gpus" -ge "$n" ] || continue
        TAIL=60 run "profile$n" $torchrun_n "$n" tools/ep_profile.py ${EP_PROFILE_ARGS:-}
      done ;;
    example)
      n=$(( gpus < 4 ? gpus : 4 ))
      TAIL=6 run "example$n" $torchrun_n "$n" examples/train_moe.py --device cuda --ep "$n" --compare-eager \
        --steps 200 --log-every 50 --sample 0 ;;
    fp8-example)
      for mode in bf16 fp8; do
        flag=""; [ "$mode" = fp8 ] && flag=--fp8
        TAIL=5 run "example_$mode" python3 examples/train_moe.py --device cuda --graphs --sample 0 \
          --log-every 500 ${FP8_EXAMPLE_ARGS:-} $flag
      done ;;
    gpu-tests)
      # Interleaved shards of the collected tests (tests/conftest.py), several per GPU: most tests
      # are small, so the host, not the GPU, bounds one process.
      # Each process gets its share of the cores (torch's default is every core in every process;
      # tools/README.md has the slow run that led to this).
      shards=${GPU_TEST_SHARDS:-$((gpus * 2))}
      threads=$(( $(nproc) / shards > 0 ? $(nproc) / shards : 1 ))
      for ((s = 0; s < shards; s++)); do
        OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads \
        MOE_GROUPED_TEST_SHARD="$s/$shards" CUDA_VISIBLE_DEVICES=$((s % gpus)) timeout -k 10 "${RUN_TIMEOUT:-300}" \
          python3 -m pytest -q -p no:cacheprovider --durations=15 tests > "/tmp/gpu_tests$s.log" 2>&1 &
      done
      wait
      for ((s = 0; s < shards; s++)); do
        echo "shard $s/$shards: $(tail -n 1 "/tmp/gpu_tests$s.log")"
        grep -E "^(FAILED|ERROR)" "/tmp/gpu_tests$s.log"
      done | tee "$OUT/gpu_tests.log"
      for ((s = 0; s < shards; s++)); do tail -n 80 "/tmp/gpu_tests$s.log"; done >> "$OUT/gpu_tests_tails.log"
      grep -q -E "^(FAILED|ERROR)" /tmp/gpu_tests*.log && status=1
      for ((s = 0; s < shards; s++)); do
        tail -n 1 "/tmp/gpu_tests$s.log" | grep -q -E "passed|no tests ran" || status=1
      done ;;
    pytest)
      TAIL=40 run pytest python3 -m pytest -q -p no:cacheprovider -rfE ${PYTEST_ARGS:-tests} ;;
    moe-bench)
      TAIL=40 run moe_bench python3 benchmarks/moe_layer.py ${MOE_BENCH_ARGS:---shapes experts_path}
      cp benchmarks/results/moe_layer*-*.json "$OUT/" 2>/dev/null ;;
    fp8-ceiling)
      TAIL=8 run fp8_ceiling python3 benchmarks/kernels/fp8_ceiling.py --rounds 4
      cp benchmarks/results/fp8_ceiling-*.json "$OUT/" 2>/dev/null ;;
    fp8-accuracy)
      TAIL=60 run fp8_accuracy python3 benchmarks/fp8_accuracy.py
      cp benchmarks/results/fp8_accuracy-*.json "$OUT/" 2>/dev/null ;;
    wgrad-probe)
      TAIL=40 run wgrad_probe python3 tools/fp8_wgrad_probe.py --json "$OUT/wgrad_probe.json" ${WGRAD_PROBE_ARGS:-}
      if [ -n "${WGRAD_NCU:-}" ]; then
        TAIL=30 run wgrad_ncu ncu --clock-control none -k regex:device_kernel --launch-count 4 \
          --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
          --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
          python3 tools/fp8_wgrad_probe.py --ncu "$WGRAD_NCU"
      fi ;;
    wgrad-ab)
      for lib in ${WGRAD_AB_LIBS:?}; do
        MOE_GROUPED_CORE_LIB=$PWD/$lib/libmoe_grouped_core.so python3 tools/fp8_wgrad_probe.py --digest \
          ${WGRAD_PROBE_ARGS:-} 2>&1 | sed "s|^|$lib: |" >> "$OUT/wgrad_ab.log"
      done
      for ((i = 1; i <= ${WGRAD_AB_PAIRS:-2}; i++)); do
        for lib in $WGRAD_AB_LIBS; do
          MOE_GROUPED_CORE_LIB=$PWD/$lib/libmoe_grouped_core.so python3 tools/fp8_wgrad_probe.py \
            ${WGRAD_PROBE_ARGS:-} 2>&1 | tr '|' '\n' | grep -E "TF|Error" | sed "s|^ *|$lib $i: |" >> "$OUT/wgrad_ab.log"
        done
      done
      cat "$OUT/wgrad_ab.log" ;;
    moe-ab)
      for set in ${MOE_AB_SETS:?}; do
        IFS=: read -r name tree lib <<< "$set"
        runner=""; [ -n "$tree" ] && runner="tools/run_with_tree.py $tree"
        MOE_GROUPED_CORE_LIB=$PWD/$lib/libmoe_grouped_core.so TAIL=16 run "moe_ab_$name" \
          python3 $runner benchmarks/moe_layer.py --shapes experts_path
        cp "$(ls -t benchmarks/results/moe_layer_experts_path-*.json | head -1)" "$OUT/moe_ab_$name.json"
      done ;;
    layer-profile)
      TAIL=120 run layer_profile python3 tools/layer_profile.py ${LAYER_PROFILE_ARGS:-} ;;
    probe)
      TAIL=100 run probe python3 tools/host_probe.py ${PROBE_ARGS:-} ;;
    parts)
      TAIL=40 run parts python3 tools/host_parts.py ${PARTS_ARGS:---trace "$OUT/step_trace.json"} ;;
    host-ab)
      # Host times of an older package (.devbuild/before, from tools/old_tree.sh) against the
      # working tree's, in alternating processes (one process's times drift 20-40% from another's):
      # HOST_AB_PAIRS pairs (default 3) of HOST_AB_ROUNDS rounds each (default 5), then per case the
      # median of the pairs' after/before ratios.
      for ((i = 1; i <= ${HOST_AB_PAIRS:-3}; i++)); do
        for tree in after before; do
          runner=""; lib=$MOE_GROUPED_CORE_LIB
          if [ "$tree" = before ]; then
            runner="tools/run_with_tree.py .devbuild/before"
            # A core copied beside the old package (its build) is the one it runs with.
            [ -f .devbuild/before/libmoe_grouped_core.so ] && lib=$PWD/.devbuild/before/libmoe_grouped_core.so
          fi
          MOE_GROUPED_CORE_LIB=$lib timeout -k 10 "${RUN_TIMEOUT:-300}" python3 $runner benchmarks/host_overhead.py --no-write --rounds "${HOST_AB_ROUNDS:-5}" \
            --cases "${HOST_AB_CASES:-moe_layer_cuda_fused}" > /tmp/host_ab.log 2>&1 || tail -5 /tmp/host_ab.log
          grep -E " host .* ms" /tmp/host_ab.log | sed "s/^/$tree $i: /" >> "$OUT/host_ab.log"
        done
      done
      python3 tools/ab_ratios.py "$OUT/host_ab.log" >> "$OUT/host_ab.log"
      cat "$OUT/host_ab.log" ;;
    host-pin)
      # The autograd engine runs a CUDA backward on its own thread; on one core that thread and the caller's
      # share the caches (docs/host-overhead.md).
      for ((i = 1; i <= ${HOST_PIN_REPEATS:-2}; i++)); do
        for pin in none 3 3,4; do
          pre=""; [ "$pin" = none ] || pre="taskset -c $pin"
          timeout -k 10 "${RUN_TIMEOUT:-300}" $pre python3 benchmarks/host_overhead.py --no-write --rounds 5 \
            --cases "${HOST_PIN_CASES:-moe_layer_cuda_fused,moe_layer_cuda_fp8,moe_layer_torch}" 2>&1 \
            | grep " host " | sed "s/^/pin=$pin round $i: /" >> "$OUT/host_pin.log"
        done
      done
      cat "$OUT/host_pin.log" ;;
    host)
      TAIL=60 run host python3 benchmarks/host_overhead.py ${HOST_ARGS:-}
      cp benchmarks/results/host_overhead-*.json "$OUT/" 2>/dev/null ;;
    *) echo "unknown phase $phase"; status=2 ;;
  esac
done
exit "$status"
