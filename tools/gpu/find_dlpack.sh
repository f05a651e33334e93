#!/usr/bin/env bash
# Prints a directory holding dlpack/dlpack.h, for machines without
# libdlpack-dev: KDISPATCH_DLPACK_INCLUDE_DIR, the headers carried by
# tools/gpu/prepare-carry.sh (.gpu-carry/include), /usr/include, or a copy of
# the dlpack.h that a Python package ships (cuda-core: _include/dlpack.h),
# put under build/gpu-dlpack/dlpack/. Exits 1 when there is none.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if [[ -n "${KDISPATCH_DLPACK_INCLUDE_DIR:-}" ]]; then echo "$KDISPATCH_DLPACK_INCLUDE_DIR"; exit 0; fi
if [[ -f "$root/.gpu-carry/include/dlpack/dlpack.h" ]]; then echo "$root/.gpu-carry/include"; exit 0; fi
if [[ -f /usr/include/dlpack/dlpack.h ]]; then echo /usr/include; exit 0; fi
header=$(python3 - <<'PY'
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
PY
)
[[ -n "$header" ]] || exit 1
mkdir -p "$root/build/gpu-dlpack/dlpack"
cp "$header" "$root/build/gpu-dlpack/dlpack/dlpack.h"
echo "dlpack.h: $header" >&2
echo "$root/build/gpu-dlpack"
