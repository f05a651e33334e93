#!/usr/bin/env bash
# Copies the development headers that the GPU machine lacks (it has the
# runtime libraries: libelf.so.1, libcrypto.so.3) from this Debian machine
# into .gpu-carry/include, an ignored folder that travels with the checkout
# to the GPU machine, where tools/gpu/check.sh points CMake at it. Nothing is
# committed or downloaded.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=.gpu-carry/include
rm -rf .gpu-carry
mkdir -p "$dest/openssl"
cp -r /usr/include/dlpack "$dest/"
cp /usr/include/libelf.h /usr/include/gelf.h "$dest/"
cp /usr/include/openssl/*.h "$dest/openssl/"
cp /usr/include/x86_64-linux-gnu/openssl/*.h "$dest/openssl/"
du -sh .gpu-carry
