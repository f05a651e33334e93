#!/usr/bin/env bash
# GPU check of the CUDA plugin, for the GPU machine (one H200; see
# /work/shared/GPU.md): builds the project with the `cuda` preset (or, when the
# whole project does not build, the GPU plugins alone), checks the binary
# (exported symbols, sm_90 code), runs the correctness check of every op x
# dtype, the kdispatch benchmark and the PyTorch eager / torch.compile
# benchmark, and prints one joined table last.
#
#   tools/gpu/check.sh
#
# Full logs go to $OUT (default build/gpu-check). Environment:
#   KD_CHECK_NO_TORCH=1        skip the PyTorch benchmark
#   KD_CHECK_NO_COMPILE=1      PyTorch eager only, no torch.compile
#   KD_CHECK_TORCH_TIMEOUT=s   limit of the PyTorch benchmark (default 300 s)
# Exit status: 0 when the build and every correctness check passed.
set -uo pipefail

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

# --- dlpack/dlpack.h: the system's, or the copy a Python package ships --------------
dlpack_dir=${KDISPATCH_DLPACK_INCLUDE_DIR:-}
if [[ -z "$dlpack_dir" && -f /usr/include/dlpack/dlpack.h ]]; then
  dlpack_dir=/usr/include
fi
if [[ -z "$dlpack_dir" ]]; then
  header=$(python3 - <<'EOF'
import importlib.util, pathlib
for name in ("cuda.core", "cuda", "torch"):  # cuda-core: _include/dlpack.h; torch: ATen/dlpack.h
    try:
        spec = importlib.util.find_spec(name)
    except Exception:
        continue
    for location in (spec.submodule_search_locations or []) if spec else []:
        for path in sorted(pathlib.Path(location).rglob("dlpack.h")):
            print(path)
            raise SystemExit
EOF
)
  if [[ -z "$header" ]]; then
    note "FAIL: no dlpack.h (set KDISPATCH_DLPACK_INCLUDE_DIR)"
    exit 2
  fi
  dlpack_dir="$root/build/gpu-dlpack"
  mkdir -p "$dlpack_dir/dlpack"
  cp "$header" "$dlpack_dir/dlpack/dlpack.h"
  note "dlpack.h: $header"
fi

# --- build ------------------------------------------------------------------------
started=$(date +%s)
plugin="$root/build/cuda/lib/kdispatch/plugins/libkdispatch-cuda.so"
bench="$root/build/cuda/bin/kdispatch-gpu-bench"
if cmake --preset cuda -DKDISPATCH_DLPACK_INCLUDE_DIR="$dlpack_dir" -DKDISPATCH_BUILD_TESTS=OFF \
      > "$OUT/build.log" 2>&1 &&
   cmake --build --preset cuda -j "$jobs" >> "$OUT/build.log" 2>&1; then
  note "build: project, preset cuda, $(( $(date +%s) - started )) s"
else
  note "build: the whole project did not build (first errors of build.log below); building the GPU plugins alone"
  grep -m 3 -A 2 -E "CMake Error|error:|FAILED" "$OUT/build.log" | sed 's/^/  | /' | tee -a "$summary"
  started=$(date +%s)
  only="$root/build/gpu-plugin-only"
  plugin="$only/lib/kdispatch/plugins/libkdispatch-cuda.so"
  bench="$only/gpu_bench"
  if cmake -S tools/gpu/plugin_only -B "$only" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DKDISPATCH_WITH_CUDA=ON -DKDISPATCH_WITH_HIP=OFF \
        -DKDISPATCH_DLPACK_INCLUDE_DIR="$dlpack_dir" > "$OUT/build-plugin-only.log" 2>&1 &&
     cmake --build "$only" -j "$jobs" >> "$OUT/build-plugin-only.log" 2>&1; then
    note "build: GPU plugins alone, $(( $(date +%s) - started )) s"
  else
    note "FAIL: the CUDA plugin did not build (build-plugin-only.log):"
    tail -n 20 "$OUT/build-plugin-only.log" | tee -a "$summary"
    exit 1
  fi
fi
if [[ ! -x "$bench" ]]; then
  bench="$root/build/gpu-check-bench/gpu_bench"
  mkdir -p "$(dirname "$bench")"
  g++ -std=c++20 -O2 -I core/include -I "$dlpack_dir" -I "$cuda_home/include" \
      tools/bench/gpu_bench.cpp -o "$bench" \
      -L "$cuda_home/lib64" -L "$cuda_home/targets/x86_64-linux/lib" \
      -lcudart_static -ldl -lpthread -lrt >> "$OUT/build.log" 2>&1 ||
    { note "FAIL: gpu_bench did not build (build.log)"; exit 1; }
fi

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
grep -q "sm_90" "$OUT/plugin.txt" || { note "FAIL: no sm_90 code in the plugin"; status=1; }

# --- correctness -------------------------------------------------------------------
"$bench" check "$plugin" > "$OUT/gpu_check.txt" 2>&1
check_rc=$?
note "correctness: $(tail -n 1 "$OUT/gpu_check.txt") (exit $check_rc; gpu_check.txt)"
grep "^FAIL" "$OUT/gpu_check.txt" | head -n 20 | tee -a "$summary"
[[ $check_rc == 0 ]] || status=1

# --- benchmarks --------------------------------------------------------------------
timeout 300 "$bench" bench "$plugin" --csv "$OUT/kdispatch_bench.csv" > "$OUT/kdispatch_bench.txt" 2>&1 ||
  note "kdispatch benchmark failed or timed out (kdispatch_bench.txt)"
if [[ "${KD_CHECK_NO_TORCH:-0}" != 1 ]]; then
  torch_args=(--csv "$OUT/torch_bench.csv")
  [[ "${KD_CHECK_NO_COMPILE:-0}" == 1 ]] && torch_args+=(--no-compile)
  timeout "${KD_CHECK_TORCH_TIMEOUT:-300}" python3 tools/gpu/torch_bench.py "${torch_args[@]}" \
      > "$OUT/torch_bench.txt" 2>&1 ||
    note "PyTorch benchmark failed or timed out; rows it finished are kept (torch_bench.txt)"
fi

echo
cat "$summary"
echo
python3 tools/gpu/report.py "$OUT/kdispatch_bench.csv" "$OUT/torch_bench.csv" | tee "$OUT/report.txt"
exit $status
