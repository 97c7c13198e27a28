#!/usr/bin/env bash
# Usage: bash tools/old_tree.sh COMMIT [DIR]   (DIR defaults to .devbuild/before)
# Writes the Python package as it was at COMMIT into DIR (moe_grouped/, with graphs/ as
# moe_grouped/graphs, as the wheel maps it), so that PYTHONPATH=DIR imports that version
# beside the installed one: tools/device.sh's host-ab phase compares its host times with
# the working tree's (carry DIR). The core library is the carried one: COMMIT must share its ABI.
set -euo pipefail
cd "$(dirname "$0")/.."
commit=$1
dir=${2:-.devbuild/before}
rm -rf "$dir"
mkdir -p "$dir"
git archive "$commit" moe_grouped | tar -x -C "$dir"
git archive --prefix=moe_grouped/ "$commit" graphs | tar -x -C "$dir"
git rev-parse "$commit" > "$dir/COMMIT"
echo "$dir: moe_grouped at $(cat "$dir/COMMIT")"
