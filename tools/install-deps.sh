#!/usr/bin/env bash
# Installs the Debian 12 packages kdispatch needs to build, test and benchmark.
# Idempotent: prints what it installs, and does nothing when everything is there.
#
#   tools/install-deps.sh           build + test dependencies (CPU and HIP plugins)
#   KDISPATCH_DEPS_NO_HIP=1 ...     skip hipcc / libamdhip64-dev
#   KDISPATCH_DEPS_NO_FUZZ=1 ...    skip clang / libFuzzer (tools/fuzz.sh)
set -euo pipefail

packages=(
  g++ cmake ninja-build pkg-config
  libboost-dev               # Boost.DLL (header-only)
  nlohmann-json3-dev         # manifests
  doctest-dev                # tests
  libdlpack-dev              # DLTensor
  libcli11-dev libfmt-dev    # the kdispatch tool
  libbenchmark-dev           # tools/bench
  libssl-dev                 # sha256 of plugin libraries (libcrypto)
  libelf-dev                 # kdispatch inspect reads ELF without loading it
  python3-numpy              # tests check saved .npy files against numpy; Python tests
  python3-dev pybind11-dev   # the Python module (tools/python)
  python3-torch              # kdispatch.torch and its tests (torch 1.13, CPU; about 240 packages)
  libtorch-dev               # torch's C++ headers: kdispatch._torch_native (docs/python.md)
)
if [[ "${KDISPATCH_DEPS_NO_FUZZ:-0}" != 1 ]]; then
  packages+=(clang libfuzzer-14-dev)  # tools/fuzz.sh
fi
if [[ "${KDISPATCH_DEPS_NO_HIP:-0}" != 1 ]]; then
  packages+=(hipcc libamdhip64-dev)
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo_cmd=()
if [[ $(id -u) != 0 ]]; then sudo_cmd=(sudo); fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install-deps: done"
