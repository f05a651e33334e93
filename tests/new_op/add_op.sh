#!/usr/bin/env bash
# Adding an op touches its schema, its reference kernel, one kernel file per
# backend and one manifest entry per backend, and nothing else. This test
# adds the throwaway op scratch.scaled_add (files/ and kernels.json beside
# this script) to a copy of the source tree, checks that the copy's
# `git status` lists exactly those files, builds the copy (core, reference
# and cpu plugins, tool, conformance suite, Python module) and runs every
# check on the new op: validate, run, the conformance suite, and the NumPy
# and torch tests.
#
#   add_op.sh SOURCE_DIR WORK_DIR
set -euo pipefail
src=$(cd "$1" && pwd)
work=$2
here=$(cd "$(dirname "$0")" && pwd)
python=${KDISPATCH_PYTHON:-/usr/bin/python3}

rm -rf "$work"
mkdir -p "$work/tree"
tree=$work/tree
# The tracked and untracked (not ignored) files of the checkout, as a
# clean clone has them.
(cd "$src" && git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$tree")
git -C "$tree" init -q
git -C "$tree" add -A
git -C "$tree" -c user.name=test -c user.email=test@localhost commit -q -m "the tree before the op"

echo "=== adding scratch.scaled_add"
cp -r "$here/files/." "$tree/"
"$python" - "$tree" "$here/kernels.json" <<'PY'
import json, pathlib, sys
tree, kernels = pathlib.Path(sys.argv[1]), json.loads(pathlib.Path(sys.argv[2]).read_text())
for backend, entry in kernels.items():
    path = tree / "manifests" / f"{backend}.json"
    text = path.read_text()
    # One entry appended to the "kernels" list, the rest of the file as it is.
    at = text.index('"kernels": [') + len('"kernels": [')
    path.write_text(text[:at] + "\n    " + json.dumps(entry) + "," + text[at:])
PY
git -C "$tree" add -A
changed=$(git -C "$tree" status --porcelain | awk '{print $2}' | sort | tr '\n' ' ')
expected="manifests/cpu.json manifests/ops/scratch.json manifests/reference.json plugins/cpu/scaled_add.cpp plugins/reference/scaled_add.cpp "
echo "files the op touches: $changed"
git -C "$tree" diff --cached --stat
if [[ "$changed" != "$expected" ]]; then
  echo "FAIL: expected exactly: $expected"
  exit 1
fi

echo "=== building the tree with the op"
# Unoptimised (-O0, no debug info): what is checked is which files the op
# touches and that every check passes, which needs no optimised code; -O0
# builds the copy faster.
cmake -S "$tree" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-O0 \
  -DCMAKE_C_FLAGS_DEBUG=-O0 -DKDISPATCH_WITH_CUDA=OFF -DKDISPATCH_WITH_HIP=OFF -DKDISPATCH_BUILD_BENCH=OFF -DPython3_EXECUTABLE="$python" >/dev/null
cmake --build "$work/build" -j2 --target kdispatch kdispatch_plugin_reference kdispatch_plugin_cpu \
  kdispatch-plugin-scanner kdispatch-conformance kdispatch_python
bin=$work/build/bin
export XDG_CACHE_HOME=$work/cache PYTHONPATH=$work/build/python
unset KDISPATCH_PLUGIN_PATH KDISPATCH_ADD_PLUGIN_PATH KDISPATCH_PLUGINS_DISABLE KDISPATCH_PLUGINS_SELECT

echo "=== validate"
"$bin/kdispatch" validate "$tree/manifests/reference.json" "$tree/manifests/cpu.json" "$tree/manifests/ops/scratch.json"
echo "=== run"
"$bin/kdispatch" run scratch.scaled_add
echo "=== conformance suite"
KDISPATCH_CONFORMANCE_BACKEND=cpu "$bin/kdispatch-conformance" --subcase=scratch.scaled_add --success \
  >"$work/conformance.log" || { cat "$work/conformance.log"; exit 1; }
# The op's cases ran (a filter that matched nothing would pass vacuously).
grep -E "scratch.scaled_add on cpu: [1-9][0-9]* calls checked" "$work/conformance.log"
grep -E "^\[doctest\] (test cases|assertions)" "$work/conformance.log"
echo "=== Python: NumPy and torch"
(cd "$tree/tests/python" && "$python" test_numpy_calls.py --op scratch.scaled_add &&
  "$python" test_torch_ops.py --op scratch.scaled_add)
echo "new op: every check passed"
