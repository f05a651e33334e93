#!/usr/bin/env bash
# GPU check of the CUDA plugin, for the GPU machine (one H200; see
# /work/shared/GPU.md): builds the project with the `cuda` preset (or, when the
# whole project does not build, the GPU plugins alone), checks the binary
# (exported symbols, SASS of every KDISPATCH_CUDA_ARCHITECTURES arch), runs
# the correctness check of every op x dtype, and the benchmark of kdispatch
# against PyTorch eager and torch.compile under CUDA-graph replay
# (tools/gpu/bench.py), and prints its table last.
#
#   tools/gpu/check.sh [build|test|bench|python|all]     (default: all)
#
# Stages, so that each fits one call of the device runner:
#   build  configure + build the whole project (preset cuda, tests on)
#   test   the conformance suite on the cuda backend, `kdispatch run --all`
#          (checked against the reference backend), ctest, the dispatch benchmark
#   bench  the plugin binary (exports, SASS per arch), tools/gpu/bench.py (kdispatch through its
#          dispatcher, PyTorch eager and torch.compile, graph replay and
#          back-to-back launches), its table
#   python tools/gpu/python_check.sh: the Python module built for the
#          python3 on PATH, the Python tests on CUDA (torch.compile, CUDA
#          graphs), graph replay against the dispatcher's call, host overhead
#
# Full logs go to $OUT (default build/gpu-check). Environment:
#   KD_CHECK_NO_COMPILE=1      PyTorch eager only, no torch.compile
#   KD_CHECK_BENCH_TIMEOUT=s   limit of the benchmark (default 420 s)
# Exit status: 0 when the build and every correctness check passed.
set -uo pipefail
stage=${1:-all}

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root" || exit 2
OUT=${OUT:-$root/build/gpu-check}
mkdir -p "$OUT"
summary="$OUT/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }
jobs=$(nproc)
status=0

# --- toolchain ------------------------------------------------------------------
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
cuda_home=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
export CUDACXX=${CUDACXX:-$nvcc}
{
  nvidia-smi
  "$nvcc" --version
  cmake --version
  g++ --version
  python3 -c 'import sys, torch; print(sys.version); print("torch", torch.__version__)'
} > "$OUT/env.txt" 2>&1

# --- dlpack/dlpack.h: the system's, the carried copy, or one a Python package ships ---
dlpack_dir=$(tools/gpu/find_dlpack.sh) || { note "FAIL: no dlpack.h (set KDISPATCH_DLPACK_INCLUDE_DIR)"; exit 2; }
carry="$root/.gpu-carry/include"

if [[ "$stage" == python ]]; then exec "$root/tools/gpu/python_check.sh" all; fi

# --- build ------------------------------------------------------------------------
plugin="$root/build/cuda/lib/kdispatch/plugins/libkdispatch-cuda.so"
bin="$root/build/cuda/bin"
if [[ "$stage" == build || "$stage" == all ]]; then
  started=$(date +%s)
  # The Python module is built for the python3 on PATH (the virtual
  # environment with torch), with the pybind11 installed there.
  if cmake --preset cuda -DKDISPATCH_DLPACK_INCLUDE_DIR="$dlpack_dir" -DCMAKE_INCLUDE_PATH="$carry" \
        -DPython3_EXECUTABLE="$(command -v python3)" -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir 2> /dev/null)" \
        > "$OUT/build.log" 2>&1 &&
     cmake --build --preset cuda -j "$jobs" >> "$OUT/build.log" 2>&1; then
    note "build: project, preset cuda, $(( $(date +%s) - started )) s"
  else
    note "FAIL: the project did not build (first errors of build.log below)"
    grep -m 5 -A 3 -E "CMake Error|error:|FAILED" "$OUT/build.log" | sed 's/^/  | /' | tee -a "$summary"
    exit 1
  fi
fi

# --- tests on the GPU --------------------------------------------------------------
if [[ "$stage" == test || "$stage" == all ]]; then
  export KDISPATCH_PLUGIN_PATH="$root/build/cuda/lib/kdispatch/plugins"
  "$bin/kdispatch" doctor > "$OUT/doctor.txt" 2>&1
  note "doctor: $(grep -A1 'cuda \[' "$OUT/doctor.txt" | head -5 | tr -s ' ' | tr '\n' ' ')"
  grep "device:" "$OUT/doctor.txt" | tee -a "$summary"
  KDISPATCH_CONFORMANCE_BACKEND=cuda "$bin/kdispatch-conformance" > "$OUT/conformance-cuda.txt" 2>&1
  rc=$?
  note "conformance (cuda vs float64 reference): exit $rc"
  grep -E "calls checked|test cases|assertions|ERROR" "$OUT/conformance-cuda.txt" | head -20 | tee -a "$summary"
  [[ $rc == 0 ]] || status=1
  "$bin/kdispatch" run --all --device cuda > "$OUT/run-all-cuda.txt" 2>&1
  rc=$?
  note "kdispatch run --all --device cuda (checked against the reference backend): exit $rc"
  cat "$OUT/run-all-cuda.txt" | tee -a "$summary"
  [[ $rc == 0 ]] || status=1
  (cd "$root/build/cuda" && ctest -j "$jobs" > "$OUT/ctest.txt" 2>&1)
  note "ctest: $(grep -E 'tests passed|tests failed' "$OUT/ctest.txt")"
  grep -E "Failed|Skipped|Not Run" "$OUT/ctest.txt" | head -20 | tee -a "$summary"
  "$bin/kdispatch-bench-dispatch" --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
      > "$OUT/bench-dispatch.txt" 2>&1
  note "dispatch overhead (host time per call; BM_CudaLaunch*: a 1x128 bf16 rmsnorm launch):"
  grep -E "_median" "$OUT/bench-dispatch.txt" | tee -a "$summary"
fi
[[ "$stage" == bench || "$stage" == all ]] || { echo; cat "$summary"; exit $status; }

# --- the binary --------------------------------------------------------------------
{
  ls -l "$plugin"
  echo "exported symbols:"
  nm -D --defined-only "$plugin"
  echo "needed:"
  readelf -d "$plugin" | grep NEEDED
  echo "device code:"
  if command -v cuobjdump > /dev/null || [[ -x "$cuda_home/bin/cuobjdump" ]]; then
    "$(command -v cuobjdump || echo "$cuda_home/bin/cuobjdump")" --list-elf --list-ptx "$plugin"
  else
    python3 tools/gpu/fatbin_archs.py "$plugin"
  fi
} > "$OUT/plugin.txt" 2>&1
exported=$(nm -D --defined-only "$plugin" | awk '{print $3}' | tr '\n' ' ')
note "plugin: $(stat -c %s "$plugin") bytes, exports: $exported"
[[ "$exported" == "kdispatch_plugin_api " ]] || { note "FAIL: the plugin exports more than kdispatch_plugin_api"; status=1; }
# The archs the build was configured for (plugins/gpu/targets.cmake).
cuda_archs=$(sed -n 's/^KDISPATCH_CUDA_ARCHITECTURES:STRING=//p' "$root/build/cuda/CMakeCache.txt" 2> /dev/null |
             tr ';' ' ')
[[ -n "$cuda_archs" ]] || { note "FAIL: no KDISPATCH_CUDA_ARCHITECTURES in build/cuda/CMakeCache.txt"; status=1; }
for arch in $cuda_archs; do
  grep -q "sm_$arch\b" "$OUT/plugin.txt" || { note "FAIL: no sm_$arch code in the plugin"; status=1; }
done

# --- benchmark ---------------------------------------------------------------------
# torch.compile's kernels are cached beside the build, for the next call.
export TORCHINDUCTOR_CACHE_DIR="$root/build/cuda/inductor-cache" PYTHONPATH="$root/build/cuda/python"
export KDISPATCH_PLUGIN_PATH="$root/build/cuda/lib/kdispatch/plugins"
bench_args=(--csv "$OUT/bench.csv")
[[ "${KD_CHECK_NO_COMPILE:-0}" == 1 ]] && bench_args+=(--no-compile)
timeout "${KD_CHECK_BENCH_TIMEOUT:-420}" python3 tools/gpu/bench.py "${bench_args[@]}" \
    > "$OUT/bench.txt" 2> "$OUT/bench.err"
rc=$?
[[ $rc == 0 ]] || { note "benchmark: exit $rc (bench.txt, bench.err)"; status=1; }
echo
cat "$summary"
echo
sed -n '/^GPU us per call/,$p' "$OUT/bench.txt"
if [[ "$stage" == all ]]; then
  echo
  "$root/tools/gpu/python_check.sh" all || status=1
fi
exit $status
