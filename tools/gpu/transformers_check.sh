#!/usr/bin/env bash
# The GPU half of kdispatch.integrations.transformers and kdispatch.compat,
# in one call of the device runner: builds the Python package and the cpu,
# cuda and reference plugins (preset cuda), runs the Python tests that need
# CUDA or transformers (tests/python/test_kernelize.py,
# test_transformers_models.py and the test_compat_*.py files), then
# tools/gpu/transformers_decode.py with the given arguments, and prints a
# summary and its tables last.
#
#   tools/gpu/transformers_check.sh [transformers_decode.py ARGS...]
#
# Logs go to $OUT (default build/gpu-check). KD_CHECK_DECODE_TIMEOUT bounds
# the decode benchmark (300 s). Exit status: 0 when everything passed.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root" || exit 2
OUT=${OUT:-$root/build/gpu-check}
mkdir -p "$OUT"
summary="$OUT/transformers_summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }
status=0
python=$(command -v python3)

started=$(date +%s)
if ! tools/gpu/build.sh "$OUT/transformers_build.log" kdispatch_python kdispatch_plugin_cpu kdispatch_plugin_cuda \
      kdispatch_plugin_reference; then
  note "FAIL: the build (transformers_build.log)"
  grep -m 5 -A 3 -E "CMake Error|error:|FAILED" "$OUT/transformers_build.log" | sed 's/^/  | /' | tee -a "$summary"
  exit 1
fi
note "build: $(( $(date +%s) - started )) s"

export KDISPATCH_PLUGIN_PATH="$root/build/cuda/lib/kdispatch/plugins" PYTHONPATH="$root/build/cuda/python"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR="$root/build/cuda/inductor-cache"
for test in test_kernelize.py test_transformers_models.py $(cd tests/python && ls test_compat_*.py 2> /dev/null); do
  started=$(date +%s)
  (cd tests/python && timeout 240 "$python" "$test") > "$OUT/python_$test.txt" 2>&1
  rc=$?
  [[ $rc == 0 ]] || status=1
  note "tests/python/$test: exit $rc, $(( $(date +%s) - started )) s; $(tail -1 "$OUT/python_$test.txt")"
  grep -E "^(FAIL|SKIPPED)|Error" "$OUT/python_$test.txt" | head -10 | tee -a "$summary"
done

timeout "${KD_CHECK_DECODE_TIMEOUT:-300}" "$python" tools/gpu/transformers_decode.py "$@" > "$OUT/decode.txt" 2>&1
rc=$?
[[ $rc == 0 ]] || status=1
note "tools/gpu/transformers_decode.py: exit $rc"
echo
cat "$summary"
echo
grep -E "^(transformers|llama|qwen3_moe)|replaced|left" "$OUT/decode.txt" | head -40
sed -n '/^prefill 4x64/,$p' "$OUT/decode.txt"
[[ $rc == 0 ]] || tail -20 "$OUT/decode.txt"
exit $status
