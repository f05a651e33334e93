#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test: the release build
# (all plugins found, the CUDA and HIP ones included when their compilers
# are), then the whole suite under AddressSanitizer + UBSan and under
# ThreadSanitizer.
#
#   tools/test.sh               all three presets
#   tools/test.sh default       only the named presets
set -euo pipefail
cd "$(dirname "$0")/.."

tools/install-deps.sh
presets=("$@")
if ((${#presets[@]} == 0)); then presets=(default asan tsan); fi

for preset in "${presets[@]}"; do
  started=${SECONDS}
  echo "=== preset ${preset}: configure + build"
  cmake --preset "${preset}" >/dev/null
  cmake --build --preset "${preset}" -j2
  echo "=== preset ${preset}: test"
  # TSan: the default mmap layout of newer kernels breaks older TSan runtimes.
  if [[ "${preset}" == tsan ]]; then
    setarch "$(uname -m)" -R ctest --preset "${preset}" -j2
  else
    ctest --preset "${preset}" -j2
  fi
  echo "=== preset ${preset}: built and tested in $((SECONDS - started)) s"
done
