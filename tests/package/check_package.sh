#!/usr/bin/env bash
# The installed package as a third party uses it: installs the build into a
# temporary prefix, copies the examples it installs (share/kdispatch/examples:
# the scaled_add plugin and the consumer program) out of it, builds them
# against the prefix alone (find_package, and pkg-config for the consumer),
# and drives the installed tool and kdispatch-conformance over the example
# plugin and its reference kernel. Also checks that building the example writes
# nothing outside its build tree and that its install honours --prefix.
#
#   check_package.sh BUILD_DIR SOURCE_DIR CXX [CXXFLAGS [LDFLAGS]]
set -euo pipefail
build=$1 source=$2 cxx=$3 cxxflags=${4:-} ldflags=${5:-}

work=$(mktemp -d "${TMPDIR:-/tmp}/kdispatch-package.XXXXXX")
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix
step() { printf '\n=== %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*"; exit 1; }
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi
# Nothing from the caller's environment steers the builds below.
unset KDISPATCH_PLUGIN_OUTPUT_DIR KDISPATCH_PLUGIN_PATH KDISPATCH_ADD_PLUGIN_PATH KDISPATCH_FORCE_BACKEND \
      KDISPATCH_BACKEND_ORDER KDISPATCH_PLUGINS_DISABLE KDISPATCH_PLUGINS_SELECT CMAKE_PREFIX_PATH PKG_CONFIG_PATH
export HOME=$work/home
mkdir -p "$HOME"

step "cmake --install into $prefix"
cmake --install "$build" --prefix "$prefix" >"$work/install.log"
(cd "$prefix" && find . -path ./lib/python3 -prune -o \( -type f -o -type l \) -print | sort)
examples=$prefix/share/kdispatch/examples
for f in bin/kdispatch bin/kdispatch-conformance include/kdispatch/plugin_helpers.hpp \
         share/kdispatch/examples/scaled_add/CMakeLists.txt share/kdispatch/examples/consumer/CMakeLists.txt; do
  [[ -f "$prefix/$f" ]] || fail "the package does not install $f"
done

configure() {  # SRC BUILD [args...]
  local src=$1 dir=$2
  shift 2
  cmake -S "$src" -B "$dir" "${generator[@]}" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_CXX_FLAGS="$cxxflags" -DCMAKE_EXE_LINKER_FLAGS="$ldflags" \
    -DCMAKE_MODULE_LINKER_FLAGS="$ldflags" "$@" >"$dir.configure.log" 2>&1 ||
    { cat "$dir.configure.log"; fail "configure $src"; }
}

step "example plugin, built against the prefix only"
cp -r "$examples/scaled_add" "$work/scaled_add"
touch "$work/before-build"
sleep 1
configure "$work/scaled_add" "$work/scaled_add-build"
cmake --build "$work/scaled_add-build" >"$work/scaled_add-build.log" 2>&1 ||
  { cat "$work/scaled_add-build.log"; fail "build of the example"; }
if grep -rq -- "$source" "$work/scaled_add-build/CMakeCache.txt"; then
  fail "the example's build names the source checkout $source"
fi
plugins=$work/scaled_add-build/plugins
ls "$plugins"

step "nothing written outside the example's build tree"
outside=$(find "$work" -newer "$work/before-build" -not -path "$work/scaled_add-build*" -not -path "$work" | sort)
[[ -z "$outside" ]] || fail "the example's build wrote outside its build tree: $outside"
for stray in /example_cpu.json /libkdispatch-example-cpu.so /plugins; do
  [[ ! -e "$stray" ]] || fail "$stray exists"
done
echo "only $work/scaled_add-build* changed"

step "the example's install honours --prefix"
cmake --install "$work/scaled_add-build" --prefix "$work/example-prefix" >/dev/null
for f in lib/kdispatch/plugins/libkdispatch-example-cpu.so lib/kdispatch/plugins/example_cpu.json; do
  [[ -f "$work/example-prefix/$f" ]] || fail "missing $work/example-prefix/$f"
  echo "$work/example-prefix/$f"
done

# The example is a cpu backend: selection is asked for the cpu, also on a
# machine whose default device is a GPU.
kd=("$prefix/bin/kdispatch" --add-plugin-path "$plugins")
step "kdispatch --version"
"$prefix/bin/kdispatch" --version

step "kdispatch list: both ops of the example, and the reference of its own"
"${kd[@]}" list --device cpu | tee "$work/list.txt"
grep -Eq '^elementwise\.scaled_add +example_cpu +yes' "$work/list.txt" || fail "list: no usable scaled_add"
grep -A1 -E '^elementwise\.scaled_add ' "$work/list.txt" | grep -Eq '^ +reference +yes +a reference kernel' ||
  fail "list: no reference for scaled_add"
grep -Eq '^ +example_cpu +yes' "$work/list.txt" || fail "list: no example_cpu silu_and_mul"

step "kdispatch select elementwise.scaled_add"
"${kd[@]}" select elementwise.scaled_add --device cpu --json | tee "$work/select.json"
grep -q '"backend": "example_cpu"' "$work/select.json" || fail "select did not pick example_cpu"

step "kdispatch run elementwise.scaled_add: checked against the example's own reference"
"${kd[@]}" run elementwise.scaled_add | tee "$work/run-scaled-add.txt"
for dtype in float32 float16 bfloat16; do
  grep -Eq "^elementwise\.scaled_add +example_cpu +cpu:0 +$dtype .* ok " "$work/run-scaled-add.txt" ||
    fail "run: elementwise.scaled_add in $dtype was not checked ok"
done
grep -Eq '^run: 3 passed, 0 failed, 0 unchecked' "$work/run-scaled-add.txt" || fail "run of elementwise.scaled_add"

step "--backend reference and KDISPATCH_FORCE_BACKEND=reference reach the example's reference"
"${kd[@]}" select elementwise.scaled_add --backend reference --device cpu | tee "$work/select-reference.txt"
KDISPATCH_FORCE_BACKEND=reference "${kd[@]}" select elementwise.scaled_add --device cpu | tee -a "$work/select-reference.txt"
[[ $(grep -c "backend 'reference' (plugin 'example_cpu'" "$work/select-reference.txt") == 2 ]] ||
  fail "the example's reference was not selected"

step "kdispatch-conformance on example_cpu: every case of the schemas' tests"
KDISPATCH_ADD_PLUGIN_PATH=$plugins KDISPATCH_CONFORMANCE_BACKEND=example_cpu "$prefix/bin/kdispatch-conformance" \
  >"$work/conformance.txt" 2>&1 || { cat "$work/conformance.txt"; fail "kdispatch-conformance on example_cpu"; }
grep -E 'calls checked|test cases' "$work/conformance.txt"
grep -q 'elementwise.scaled_add on example_cpu: [0-9]* calls checked' "$work/conformance.txt" ||
  fail "kdispatch-conformance did not check elementwise.scaled_add"

step "kdispatch run activation.silu_and_mul --backend example_cpu (checked)"
"${kd[@]}" run activation.silu_and_mul --backend example_cpu | tee "$work/run.txt"
grep -Eq '^run: 3 passed, 0 failed' "$work/run.txt" || fail "run of example_cpu"

step "the example's silu_and_mul is opt-in: a call that names no backend still gets cpu"
"${kd[@]}" select activation.silu_and_mul --device cpu | tee "$work/select-silu.txt"
grep -q "backend 'cpu'" "$work/select-silu.txt" || fail "installing the example changed the choice for silu_and_mul"

step "naming it reaches it: --backend example_cpu, and KDISPATCH_BACKEND_ORDER=example_cpu,cpu"
"${kd[@]}" select activation.silu_and_mul --device cpu --backend example_cpu | tee "$work/order.txt"
KDISPATCH_BACKEND_ORDER=example_cpu,cpu "${kd[@]}" select activation.silu_and_mul --device cpu | tee -a "$work/order.txt"
[[ $(grep -c "backend 'example_cpu'" "$work/order.txt") == 2 ]] || fail "example_cpu was not selected where named"

step "Python and torch: the installed package over the example plugin"
site=$(find "$prefix/lib" -type d -name kdispatch -path '*-packages/kdispatch' | head -n 1)
if [[ -n "$site" ]] && /usr/bin/python3 -c 'import numpy, torch' 2>/dev/null; then
  PYTHONPATH=$(dirname "$site") KDISPATCH_EXAMPLE_PLUGINS=$plugins /usr/bin/python3 - <<'PY'
import os
import kdispatch
kdispatch.configure(add_plugin_path=[os.environ["KDISPATCH_EXAMPLE_PLUGINS"]])
import torch
import kdispatch.torch
import kdispatch.testing as kt

torch.manual_seed(0)
x = torch.randn(5, 2 * 37)
want = torch.empty(5, 37)
kdispatch.call("activation.silu_and_mul", want, x, backend="reference")
for backend in (None, "example_cpu"):
    chosen = kdispatch.select("activation.silu_and_mul", backend=backend, device="cpu")["backend"]
    out = torch.full((5, 37), float("nan"))
    kdispatch.call("activation.silu_and_mul", out, x, backend=backend)
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-6), backend
    out = torch.full((5, 37), float("nan"))
    kdispatch.op("activation.silu_and_mul", backend)(out, x)
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-6), backend
    got = kdispatch.torch.activation.silu_and_mul(x, backend=backend)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), backend
    print(f"activation.silu_and_mul backend={backend!r}: runs {chosen}, matches the reference")
assert kdispatch.select("activation.silu_and_mul", device="cpu")["backend"] == "cpu"
out = torch.full((5, 37), float("nan"))
torch.ops.kdispatch.activation_silu_and_mul(out, x, "example_cpu")
assert torch.allclose(out, want, rtol=1e-5, atol=1e-6)
print("torch.ops.kdispatch.activation_silu_and_mul(out, x, 'example_cpu'): matches the reference")

op = "elementwise.scaled_add"
for dtype in kt.dtypes(op, backend="example_cpu"):
    checked = 0
    for case in kt.cases(op):
        inputs = kt.inputs(op, dtype, case)
        got = [t.clone() for t in inputs]
        kdispatch.call(op, *got, backend="example_cpu", **case.attrs)
        verdict = kt.check(op, got, inputs, case)
        assert verdict.ok, (case, verdict.first_mismatch)
        checked += 1
    print(f"{op} {dtype} on example_cpu from Python: {checked} cases match the example's reference")
PY
else
  echo "the installed Python package, NumPy or torch is missing: the Python step is not run"
fi

step "consumer built with find_package"
cp -r "$examples/consumer" "$work/consumer"
configure "$work/consumer" "$work/consumer-build"
cmake --build "$work/consumer-build" >"$work/consumer-build.log" 2>&1 ||
  { cat "$work/consumer-build.log"; fail "build of the consumer"; }
"$work/consumer-build/kdispatch-consumer"

step "consumer built with pkg-config"
if ! command -v pkg-config >/dev/null; then
  # Every other step passed; this one cannot run: the test reports itself skipped.
  echo "pkg-config is not installed (Debian: pkg-config): the pkg-config consumer is not built"
  printf '\npackage: all checks passed but the pkg-config build, which was skipped\n'
  exit 77
fi
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
echo "pkg-config --cflags --libs kdispatch: $(pkg-config --cflags --libs kdispatch) (version $(pkg-config --modversion kdispatch))"
# shellcheck disable=SC2046,SC2086
"$cxx" -std=c++20 $cxxflags $(pkg-config --cflags kdispatch) "$work/consumer/consumer.cpp" \
  -o "$work/consumer-pc" $ldflags $(pkg-config --libs kdispatch) -Wl,-rpath,"$(pkg-config --variable=libdir kdispatch)"
"$work/consumer-pc"

printf '\npackage: all checks passed\n'
