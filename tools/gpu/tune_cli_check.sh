#!/usr/bin/env bash
# `kdispatch tune --device cuda` on the GPU machine: builds the tool and the
# cuda, cpu and reference plugins (preset cuda, tools/gpu/build.sh) unless
# KD_TUNE_NO_BUILD=1 says they are built, then tunes layernorm.rmsnorm and
# activation.silu_and_mul in bfloat16 at 1, 64 and 32768 rows: each cuda
# backend checked against the reference, then timed by the cuda plugin
# under CUDA-graph replay and back to back. Prints the table; the tuning
# file goes to $OUT/tune-cli.json.
#
#   tools/gpu/tune_cli_check.sh [EXTRA TUNE OPTIONS...]
#
# Exit status: the tool's (0: every backend matched and was timed).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root" || exit 2
OUT=${OUT:-$root/build/gpu-check}
mkdir -p "$OUT"
if [ "${KD_TUNE_NO_BUILD:-0}" != 1 ]; then
  if ! tools/gpu/build.sh "$OUT/tune_cli_build.log" kdispatch kdispatch_plugin_cpu kdispatch_plugin_cuda \
      kdispatch_plugin_reference; then
    echo "FAIL: the build ($OUT/tune_cli_build.log)"
    grep -m 5 -A 3 -E "CMake Error|error:|FAILED" "$OUT/tune_cli_build.log" | sed 's/^/  | /'
    exit 1
  fi
fi
export KDISPATCH_PLUGIN_PATH="$root/build/cuda/lib/kdispatch/plugins"
export XDG_CACHE_HOME=$(mktemp -d)
tool="$root/build/cuda/bin/kdispatch"
args=(tune layernorm.rmsnorm activation.silu_and_mul --device cuda --dtype bfloat16
      --size rows=1,64,32768 --out "$OUT/tune-cli.json" "$@")
echo "+ kdispatch ${args[*]}"
"$tool" "${args[@]}"
status=$?
echo "exit status: $status; the file: $OUT/tune-cli.json"
exit $status
