#!/usr/bin/env bash
# The Python half of the GPU check, for the GPU machine (see
# /work/shared/GPU.md: a Python 3.12 virtual environment with torch and
# pybind11 as `python3`): builds the Python module against that interpreter
# (preset cuda), runs the Python tests there (the CPU ones under that
# torch, then tests/python/test_gpu.py: every op on CUDA, torch.compile,
# CUDA graphs) and the decoder-layer example (tools/gpu/decoder_layer.py),
# then the graph-replay comparison with the dispatcher's own
# call and the host-overhead table, and prints a short summary last.
#
#   tools/gpu/python_check.sh [build|test|bench|all]     (default: all)
#
# tools/gpu/check.sh runs it as its `python` stage. Logs go to $OUT (default
# build/gpu-check): nine files, python_*.txt. Exit status: 0 when the build
# and every check passed (the benchmarks' targets are reported, not enforced).
set -uo pipefail
stage=${1:-all}

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root" || exit 2
OUT=${OUT:-$root/build/gpu-check}
mkdir -p "$OUT"
summary="$OUT/python_summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }
status=0
build="$root/build/cuda"
export CUDACXX=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
python=$(command -v python3)

if [[ "$stage" == build || "$stage" == all ]]; then
  started=$(date +%s)
  dlpack_dir=$(tools/gpu/find_dlpack.sh) || { note "FAIL: no dlpack.h (set KDISPATCH_DLPACK_INCLUDE_DIR)"; exit 2; }
  pybind11_dir=$("$python" -m pybind11 --cmakedir 2> /dev/null)
  {
    "$python" -c 'import sys, sysconfig, torch; print(sys.version, "torch", torch.__version__, sysconfig.get_paths()["include"])'
    echo "pybind11: $pybind11_dir"
  } > "$OUT/python_env.txt" 2>&1
  if cmake --preset cuda -DKDISPATCH_DLPACK_INCLUDE_DIR="$dlpack_dir" -DCMAKE_INCLUDE_PATH="$root/.gpu-carry/include" \
        -DPython3_EXECUTABLE="$python" -Dpybind11_DIR="$pybind11_dir" > "$OUT/python_build.log" 2>&1 &&
     cmake --build "$build" -j "$(nproc)" --target kdispatch_python kdispatch kdispatch_plugin_reference kdispatch_plugin_cpu \
        kdispatch_plugin_cuda fx_good >> "$OUT/python_build.log" 2>&1; then
    note "python build: $(grep 'Python module:' "$OUT/python_build.log" | sed 's/^-- //' | paste -sd ';'), $(( $(date +%s) - started )) s"
  else
    note "FAIL: the Python module did not build (python_build.log)"
    grep -m 5 -A 3 -E "CMake Error|error:|FAILED|skipped" "$OUT/python_build.log" | sed 's/^/  | /' | tee -a "$summary"
    exit 1
  fi
fi

export PYTHONPATH="$build/python" PYTHONUNBUFFERED=1
if [[ "$stage" == test || "$stage" == all ]]; then
  # The CPU tests under this torch (registration through register_fake), not
  # the install test, which wants every target of the project built.
  (cd "$build" && ctest -j "$(nproc)" -R '^python\.' -E 'installed_package|^python\.gpu$' --output-on-failure \
      > "$OUT/python_ctest.txt" 2>&1) || status=1
  note "python ctest (CPU tensors, $("$python" -c 'import torch; print("torch", torch.__version__)')): $(grep -E 'tests passed|tests failed' "$OUT/python_ctest.txt")"
  grep -E "\*\*\*Failed|Not Run|Skipped" "$OUT/python_ctest.txt" | head -20 | tee -a "$summary"
  (cd tests/python && timeout 400 "$python" test_gpu.py) > "$OUT/python_gpu.txt" 2>&1
  rc=$?
  [[ $rc == 0 || $rc == 77 ]] || status=1  # 77: skipped (no CUDA device), said in the log
  grep -E "^(ok|FAIL|SKIPPED|gpu:)|Error|error" "$OUT/python_gpu.txt" | head -40 | tee -a "$summary"
  # A Llama-style layer on views and float32 parameters: eager, compiled, CUDA graph.
  timeout 300 "$python" tools/gpu/decoder_layer.py > "$OUT/python_decoder_layer.txt" 2>&1
  rc=$?
  [[ $rc == 0 || $rc == 77 ]] || status=1  # 77: skipped (no CUDA device), said in the log
  note "decoder layer (tools/gpu/decoder_layer.py): exit $rc"
  grep -E "^decoder_layer:|Error|error" "$OUT/python_decoder_layer.txt" | head -20 | tee -a "$summary"
fi

if [[ "$stage" == bench || "$stage" == all ]]; then
  timeout 240 "$python" tools/gpu/python_graph_bench.py > "$OUT/python_graph_bench.txt" 2>&1 ||
    note "graph replay: a difference above 5%, or the benchmark failed (python_graph_bench.txt)"
  for device in cuda cpu; do
    timeout 120 "$python" tools/bench/python_overhead.py --device "$device" --samples 50 \
      > "$OUT/python_overhead_$device.txt" 2>&1 || note "host overhead on $device failed (python_overhead_$device.txt)"
  done
  echo
  cat "$OUT/python_graph_bench.txt" "$OUT/python_overhead_cuda.txt" "$OUT/python_overhead_cpu.txt" | tee -a "$summary"
fi
exit $status
