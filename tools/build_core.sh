#!/usr/bin/env bash
# Usage: bash tools/build_core.sh   (here, no GPU needed; about 8 minutes the first time on 2 cores)
# Builds the CUDA core (Release, sm_90a) into .devbuild/core with ninja, incrementally, and
# copies the library to .devbuild/lib, which the device tool carries (carry: [".devbuild/lib"])
# and MOE_GROUPED_CORE_LIB points at (tools/device.sh does).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=/usr/local/cuda-13.0/bin:$PATH
cutlass=$(python3 -c "import importlib.util, os; s = importlib.util.find_spec('cutlass_library'); print(os.path.join(s.submodule_search_locations[0], 'source'))")
[ -f .devbuild/core/build.ninja ] || cmake -S . -B .devbuild/core -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DMOE_GROUPED_REQUIRE_CORE=ON -DMOE_GROUPED_CUTLASS_DIR="$cutlass"
ninja -C .devbuild/core -j "$(nproc)"
mkdir -p .devbuild/lib
cp .devbuild/core/libmoe_grouped_core.so .devbuild/lib/
MOE_GROUPED_CORE_LIB=$PWD/.devbuild/lib/libmoe_grouped_core.so python3 -c \
  "import moe_grouped._core as c; print(c.lib.mg_build_info().decode())"
