#!/usr/bin/env bash
# Usage: bash tools/run_on_device.sh [pytest args...]   (from any folder, on the GPU machine)
#
# One call on the GPU machine: install (building the core with all cores),
# report, run the whole test suite, then the user-facing benchmarks. Logs and
# JSON go to $OUT (the device tool brings that folder back, at most 8 files).
# The GPU machine reaches no package index: carry .whl/ (the nvidia-cutlass
# and nvtx wheels for its Python) with the working tree.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/moe_grouped_out}
mkdir -p "$OUT"

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/summary.txt"
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) MOE_GROUPED_REQUIRE_CORE=1
start=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -40 "$OUT/install.log"; exit 1; }
echo "install+build: $(( $(date +%s) - start )) s"
python3 -m moe_grouped info | tee -a "$OUT/summary.txt"

python3 -m pytest -q -p no:cacheprovider tests "$@" 2>&1 | tee "$OUT/pytest.log" | tail -25
tests_status=${PIPESTATUS[0]}

for bench in benchmarks/fp8.py benchmarks/grouped_gemm.py benchmarks/graph_overhead.py benchmarks/moe_layer.py; do
  [ -f "$bench" ] || continue
  [ -n "${SKIP_BENCH:-}" ] && continue
  name=$(basename "$bench" .py)
  timeout 240 python3 "$bench" > "/tmp/bench_$name.txt" 2>&1
  echo "== $bench (exit $?)" | tee -a "$OUT/bench.txt"; cat "/tmp/bench_$name.txt" >> "$OUT/bench.txt"
  tail -30 "/tmp/bench_$name.txt"
done
cp benchmarks/results/*.json "$OUT/" 2>/dev/null
exit "$tests_status"
