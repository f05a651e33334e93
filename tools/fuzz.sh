#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz with clang in build/fuzz and runs
# each for SECONDS (default 60), seeded from the repository's manifests, op
# schemas and fixtures, and from the generated GPU manifests, the plugin
# libraries and the files the built tool writes (registry cache, verdict
# file, tuning file) of build/default when they are there. Corpora grow in build/fuzz/corpus/<target>; a crashing
# input is written to build/fuzz/artifacts/ and stops that target.
#
#   tools/fuzz.sh [SECONDS] [TARGET...]
#     targets: manifest op_schema elf_check registry_cache verdicts tuning_file
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
seconds=${1:-60}
shift || true
targets=("$@")
((${#targets[@]})) || targets=(manifest op_schema elf_check registry_cache verdicts tuning_file)
build="$root/build/fuzz"

cmake -S "$root/tests/fuzz" -B "$build" -G Ninja -DCMAKE_CXX_COMPILER="${CXX:-clang++}" >/dev/null
cmake --build "$build" -j "${FUZZ_BUILD_JOBS:-2}"

seed() {  # seed TARGET FILE...
  local dir="$build/corpus/$1"
  shift
  mkdir -p "$dir"
  for f in "$@"; do
    [[ -f $f ]] || continue
    [[ $(stat -c %s "$f") -le 1048576 ]] || continue
    cp -n "$f" "$dir/$(sha1sum "$f" | cut -c1-16)-$(basename "$f")"
  done
}
shopt -s nullglob globstar
seed manifest "$root"/manifests/*.json "$root"/build/default/manifests/*.json "$root"/manifests/ops/*.json \
  "$root"/tests/fixtures/**/*.json
seed op_schema "$root"/manifests/ops/*.json
seed elf_check "$root"/build/default/lib/kdispatch/plugins/*.so "$root"/build/default/tests/fixtures/**/*.so
# The entries of a registry cache that the built tool writes over the shipped plugins (its first line, which
# names the build, left out).
if [[ -x $root/build/default/bin/kdispatch ]]; then
  rm -rf "$build/seed-cache"
  XDG_CACHE_HOME="$build/seed-cache" "$root/build/default/bin/kdispatch" list > /dev/null 2>&1 || true
  for f in "$build"/seed-cache/kdispatch/*.cache; do tail -n +2 "$f" > "$f.entries"; done
  seed registry_cache "$build"/seed-cache/kdispatch/*.entries
  # A verdict file and a tuning file from checks and timings of shipped ops: the verdict file whole and
  # its entries (the target reads both), the tuning file as written and with a "when" on the op's
  # hidden size.
  rm -rf "$build/seed-tuning"
  mkdir -p "$build/seed-tuning"
  for op in layernorm.rmsnorm activation.silu_and_mul; do
    XDG_CACHE_HOME="$build/seed-tuning" "$root/build/default/bin/kdispatch" run "$op" > /dev/null 2>&1 || true
  done
  XDG_CACHE_HOME="$build/seed-tuning" "$root/build/default/bin/kdispatch" tune layernorm.rmsnorm --dtype float32 \
    --size H=8,4096 --budget 5 --out "$build/seed-tuning/tuning.json" > /dev/null 2>&1 || true
  for f in "$build"/seed-tuning/kdispatch/conformance-verdicts-*.txt; do tail -n +2 "$f" > "$f.entries"; done
  seed verdicts "$build"/seed-tuning/kdispatch/conformance-verdicts-*.txt{,.entries}
  if [[ -f $build/seed-tuning/tuning.json ]]; then
    sed 's/"when": ""/"when": "H > 64 \&\& dtype == float32"/' "$build/seed-tuning/tuning.json" \
      > "$build/seed-tuning/tuning-when.json"
    seed tuning_file "$build"/seed-tuning/tuning*.json
  fi
fi
printf '%s\n' '{"preferences": {"layernorm.rmsnorm": ["cpu", "reference"], "activation.silu_and_mul": ["cpu"]}}' \
  > "$build/preferences.json"
seed tuning_file "$build/preferences.json"

mkdir -p "$build/artifacts"
status=0
for t in "${targets[@]}"; do
  max_len=65536
  [[ $t == elf_check ]] && max_len=1048576
  echo "== fuzz_$t for ${seconds}s"
  if ! "$build/fuzz_$t" "$build/corpus/$t" -max_total_time="$seconds" -max_len="$max_len" -rss_limit_mb=2048 \
      -timeout=10 -print_final_stats=1 -artifact_prefix="$build/artifacts/$t-" 2>"$build/fuzz_$t.log"; then
    status=1
    echo "fuzz_$t: FAILED, see $build/fuzz_$t.log and $build/artifacts/"
  fi
  grep -E "^#[0-9]+.*DONE|^stat::number_of_executed_units|^stat::peak_rss_mb|cov:" "$build/fuzz_$t.log" | tail -4
done
exit $status
