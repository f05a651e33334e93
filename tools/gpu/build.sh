#!/usr/bin/env bash
# Configures the cuda preset on the GPU machine (its dlpack header, the
# development headers .gpu-carry brings, its own Python and pybind11) and
# builds the given targets, logging to $1.
#
#   tools/gpu/build.sh LOG TARGET...
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root" || exit 2
log=$1
shift
python=$(command -v python3)
export CUDACXX=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
dlpack_dir=$(tools/gpu/find_dlpack.sh) || { echo "no dlpack.h" > "$log"; exit 2; }
cmake --preset cuda -DKDISPATCH_DLPACK_INCLUDE_DIR="$dlpack_dir" -DCMAKE_INCLUDE_PATH="$root/.gpu-carry/include" \
    -DPython3_EXECUTABLE="$python" -Dpybind11_DIR="$("$python" -m pybind11 --cmakedir 2> /dev/null)" \
    > "$log" 2>&1 &&
  cmake --build build/cuda -j "$(nproc)" --target "$@" >> "$log" 2>&1
