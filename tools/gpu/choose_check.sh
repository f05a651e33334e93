#!/usr/bin/env bash
# Choosing among real backends on the GPU machine: builds what the check
# needs (preset cuda), then
#   1. the conformance checks of the torch backend (kdispatch.native) and the
#      triton backend (kdispatch.triton) on CUDA, op by op, in parallel
#      (tests/python/test_native.py --device cuda --op OP,
#      tests/python/test_triton.py [--op OP]);
#   2. tools/gpu/tune_check.py: kdispatch.tuning.tune over the cuda plugin
#      and both backends at 1, 64 and 32768 rows, and an independent timing
#      of every candidate in the same run;
#   3. tools/gpu/decoder_layer.py under the tuning file just written
#      (eager, torch.compile, CUDA graph), with the backend and rule of each
#      of its calls from the trace;
#   4. kdispatch-bench-dispatch on this host;
# and prints a short summary and the tables last.
#
#   tools/gpu/choose_check.sh [STAGE...]    (conformance tune layer bench; default: all, in that order)
#
# KD_CHECK_CONFORMANCE_OPS: lines "native OP" / "triton OP" ("triton -":
# its selection and capture tests) to check instead of every op of both;
# KD_CHECK_CONFORMANCE_TIMEOUT bounds that stage (150 s). Logs go to $OUT
# (default build/gpu-check), at most 8 files. Exit status: 0 when the
# build and every check passed.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root" || exit 2
OUT=${OUT:-$root/build/gpu-check}
mkdir -p "$OUT"
summary="$OUT/choose_summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }
status=0
python=$(command -v python3)
stages=" ${*:-conformance tune layer bench} "
# The build log and the traces stay outside $OUT until the end, where they go
# into one archive.
logs=$(mktemp -d)

started=$(date +%s)
if tools/gpu/build.sh "$logs/choose_build.log" kdispatch kdispatch-bench-dispatch kdispatch_python \
      kdispatch_plugin_cpu kdispatch_plugin_cuda kdispatch_plugin_reference; then
  note "build: $(( $(date +%s) - started )) s"
else
  note "FAIL: the build (choose_build.log, in choose_logs.tgz)"
  grep -m 5 -A 3 -E "CMake Error|error:|FAILED" "$logs/choose_build.log" | sed 's/^/  | /' | tee -a "$summary"
  exit 1
fi
export KDISPATCH_PLUGIN_PATH="$root/build/cuda/lib/kdispatch/plugins" PYTHONPATH="$root/build/cuda/python"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR="$root/build/cuda/inductor-cache"

# 1. Conformance of the run-time backends, one process per (backend, op).
conformance() {
  started=$(date +%s)
  mkdir -p "$OUT/conformance"
  ops=${KD_CHECK_CONFORMANCE_OPS:-$("$python" -c 'import kdispatch.native as n, kdispatch.triton as t
print("\n".join(["native " + op for op in n.KERNELS] + ["triton " + op for op in t.KERNELS] + ["triton -"]))')}
  limit=${KD_CHECK_CONFORMANCE_TIMEOUT:-150}
  echo "$ops" | LIMIT=$limit timeout "$limit" xargs -P 8 -L 1 bash -c '
    backend=$1 op=$2
    if [[ $op == - ]]; then args=(); else args=(--op "$op"); fi
    [[ $backend == native ]] && args+=(--device cuda)
    (cd tests/python && timeout $((LIMIT - 10)) python3 "test_$backend.py" "${args[@]}") > "$0/conformance/$backend.$op.txt" 2>&1
    echo "exit $?" >> "$0/conformance/$backend.$op.txt"' "$OUT"
  for f in "$OUT"/conformance/*.txt; do
    rc=$(tail -1 "$f" | awk '{print $2}')
    name=$(basename "$f" .txt)
    [[ $rc == 0 || $rc == 77 ]] || status=1
    checked=$(grep -hoE "[0-9]+ calls checked" "$f" | head -1)
    note "  $name: exit $rc ${checked:+($checked)}$([[ $rc == 77 ]] && echo " skipped: $(grep -m1 SKIPPED "$f")")"
    [[ $rc == 0 || $rc == 77 ]] || grep -m 5 -E "FAIL|Error|differ" "$f" | sed 's/^/    | /' | tee -a "$summary"
  done
  note "conformance of the torch and triton backends on cuda: $(( $(date +%s) - started )) s"
}

# 2. Tuning, and the independent timing.
tune() {
  timeout 300 "$python" tools/gpu/tune_check.py --out "$OUT/tuning.json" > "$OUT/tune_check.txt" 2>&1
  rc=$?
  [[ $rc == 0 ]] || status=1
  note "tools/gpu/tune_check.py: exit $rc; $(grep -E '^tune_check: [0-9]+ of' "$OUT/tune_check.txt")"
}

# 3. The decoder layer under the tuning file.
layer() {
  for tokens in 64 1; do
    KDISPATCH_TRACE="$logs/layer_trace_$tokens.jsonl" timeout 120 "$python" tools/gpu/decoder_layer.py \
        --tokens "$tokens" --tuning "$OUT/tuning.json" > "$OUT/decoder_layer_$tokens.txt" 2>&1
    rc=$?
    [[ $rc == 0 ]] || status=1
    note "tools/gpu/decoder_layer.py --tokens $tokens --tuning tuning.json: exit $rc"
    grep -E "^decoder_layer:|Error|error" "$OUT/decoder_layer_$tokens.txt" | head -12 | tee -a "$summary"
  done
}

# 4. The dispatcher's host cost on this machine: pinned to one core, 12
# repetitions in random order (this host's runs spread widely).
bench() {
  timeout 150 taskset -c 1 build/cuda/bin/kdispatch-bench-dispatch --benchmark_repetitions=12 \
      --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=true \
      > "$OUT/bench_dispatch.txt" 2>&1 || note "kdispatch-bench-dispatch: failed (bench_dispatch.txt)"
  note "dispatch overhead:"
  sed -n '/Performance targets/,$p' "$OUT/bench_dispatch.txt" | sed 's/^/  /' | tee -a "$summary"
}

for stage in $stages; do
  case $stage in
    conformance | tune | layer | bench) $stage ;;
    *) note "unknown stage '$stage' (conformance, tune, layer, bench)"; status=2 ;;
  esac
done

echo
cat "$summary"
echo
grep -vE "^tune:" "$OUT/tune_check.txt" 2> /dev/null
# What comes back from the device machine is at most 8 files: the rest in one archive.
[[ -d "$OUT/conformance" ]] && mv "$OUT/conformance" "$logs/"
tar czf "$OUT/choose_logs.tgz" -C "$logs" . && rm -rf "$logs"
exit $status
