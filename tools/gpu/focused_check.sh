#!/usr/bin/env bash
# A focused GPU check that fits one call of the device runner when the whole
# tools/gpu/check.sh does not: builds only the targets it needs (preset
# cuda), then runs the conformance suite on the cuda backend, `kdispatch run
# --all --device cuda`, the Python GPU tests (test_gpu.py, the
# import-before-torch test), the decoder-layer example, the cost of a
# functional form (tools/gpu/functional_cost.py), and tools/gpu/bench.py on
# the cases whose label contains one of the given words, and prints a short
# summary and the tables last.
#
#   tools/gpu/focused_check.sh [BENCH_WORD...]      (no words: no benchmark)
#
# Logs go to $OUT (default build/gpu-check). KD_CHECK_NO_CONFORMANCE=1 skips
# the conformance suite and `run --all` (the longest part);
# KD_CHECK_CONFORMANCE_TIMEOUT bounds the suite (420 s). Exit status: 0
# when the build and every correctness check passed.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root" || exit 2
OUT=${OUT:-$root/build/gpu-check}
mkdir -p "$OUT"
summary="$OUT/focused_summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }
status=0
python=$(command -v python3)

started=$(date +%s)
if tools/gpu/build.sh "$OUT/focused_build.log" kdispatch kdispatch-conformance kdispatch_python \
      kdispatch_plugin_cpu kdispatch_plugin_cuda kdispatch_plugin_reference; then
  note "build: $(( $(date +%s) - started )) s"
else
  note "FAIL: the build (focused_build.log)"
  grep -m 5 -A 3 -E "CMake Error|error:|FAILED" "$OUT/focused_build.log" | sed 's/^/  | /' | tee -a "$summary"
  exit 1
fi

bin="$root/build/cuda/bin"
export KDISPATCH_PLUGIN_PATH="$root/build/cuda/lib/kdispatch/plugins" PYTHONPATH="$root/build/cuda/python"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR="$root/build/cuda/inductor-cache"
if [[ "${KD_CHECK_NO_CONFORMANCE:-0}" != 1 ]]; then
started=$(date +%s)
KDISPATCH_CONFORMANCE_BACKEND=cuda timeout "${KD_CHECK_CONFORMANCE_TIMEOUT:-420}" "$bin/kdispatch-conformance" > "$OUT/conformance-cuda.txt" 2>&1
rc=$?
note "conformance (cuda vs float64 reference): exit $rc, $(( $(date +%s) - started )) s"
grep -E "calls checked|test cases|assertions" "$OUT/conformance-cuda.txt" | sed 's/^.*MESSAGE: //' | tee -a "$summary"
grep -m 10 -E "ERROR|error" "$OUT/conformance-cuda.txt" | tee -a "$summary"
[[ $rc == 0 ]] || status=1
timeout 60 "$bin/kdispatch" run --all --device cuda > "$OUT/run-all-cuda.txt" 2>&1 || status=1
note "kdispatch run --all --device cuda: $(tail -1 "$OUT/run-all-cuda.txt")"
fi
for test in test_gpu.py test_import_order.py; do
  (cd tests/python && timeout 120 "$python" "$test") > "$OUT/python_$test.txt" 2>&1
  rc=$?
  [[ $rc == 0 ]] || status=1
  note "tests/python/$test: exit $rc; $(grep -cE '^ok' "$OUT/python_$test.txt") ok lines"
  grep -E "^(FAIL|SKIPPED)|Error" "$OUT/python_$test.txt" | head -10 | tee -a "$summary"
done
timeout 180 "$python" tools/gpu/decoder_layer.py > "$OUT/decoder_layer.txt" 2>&1
rc=$?
[[ $rc == 0 ]] || status=1
note "tools/gpu/decoder_layer.py: exit $rc"
grep -E "^decoder_layer:|Error|error" "$OUT/decoder_layer.txt" | head -12 | tee -a "$summary"

timeout 120 "$python" tools/gpu/functional_cost.py > "$OUT/functional_cost.txt" 2>&1 || {
  note "tools/gpu/functional_cost.py: failed (functional_cost.txt)"
  status=1
}

if [[ $# -gt 0 ]]; then
  only=()
  for word in "$@"; do only+=(--only "$word"); done
  timeout "${KD_CHECK_BENCH_TIMEOUT:-240}" "$python" tools/gpu/bench.py "${only[@]}" --csv "$OUT/bench.csv" \
      > "$OUT/bench.txt" 2> "$OUT/bench.err" || { note "benchmark: failed (bench.txt, bench.err)"; status=1; }
fi
echo
cat "$summary"
echo
cat "$OUT/functional_cost.txt"
[[ $# -gt 0 ]] && { echo; sed -n '/^GPU us per call/,$p' "$OUT/bench.txt"; tail -5 "$OUT/bench.err"; }
exit $status
