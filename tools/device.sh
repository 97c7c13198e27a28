#!/usr/bin/env bash
# Usage (device tool, carrying .devbuild/lib): bash tools/ep_device.sh PHASE [PHASE...]
# Expert-parallel work on a multi-GPU machine with a core built here and carried
# (.devbuild/lib/libmoe_grouped_core.so; make it with tools/build_core.sh). Phases:
#   smoke      ep_suite with few replays on 2 GPUs, then on 4
#   suite      ep_suite with 1000 replays on 2 GPUs, then on 4
#   sanitize   a short ep 2 run of ep_suite under compute-sanitizer memcheck
#   bench      benchmarks/expert_parallel.py on 1, 2 and 4 GPUs (EP_SMS: --sms sweep)
#   profile    tools/ep_profile.py on 2 GPUs and on 1 (EP_PROFILE_ARGS: its options)
#   example    examples/train_moe.py --ep N --compare-eager --steps 200 (graphs vs eager; N = min(GPUs, 4))
#   gpu-tests  the single-GPU test suite, its files spread over the visible GPUs
# Logs and results go to $OUT (at most 8 files come back).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/moe_grouped_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export MOE_GROUPED_CORE_LIB=$PWD/.devbuild/lib/libmoe_grouped_core.so
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
    gpu-tests)
      mapfile -t files < <(ls tests/test_*.py | grep -v multi_gpu)
      for ((g = 0; g < gpus; g++)); do
        part=()
        for ((i = g; i < ${#files[@]}; i += gpus)); do part+=("${files[i]}"); done
        CUDA_VISIBLE_DEVICES=$g timeout -k 10 "${RUN_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider \
          "${part[@]}" \
          > "$OUT/gpu_tests$g.log" 2>&1 &
      done
      wait
      for ((g = 0; g < gpus; g++)); do echo "gpu $g: $(tail -n 1 "$OUT/gpu_tests$g.log")"; done
      grep -h -E "^(FAILED|ERROR)" "$OUT"/gpu_tests*.log | head -30
      grep -q -E "^(FAILED|ERROR)" "$OUT"/gpu_tests*.log && status=1 ;;
    *) echo "unknown phase $phase"; status=2 ;;
  esac
done
exit "$status"
