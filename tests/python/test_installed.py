#!/usr/bin/env python3
"""The installed package works on its own: `cmake --install` of the build
into a temporary prefix, then a fresh interpreter with nothing but
PYTHONPATH (and PATH) set imports kdispatch from the prefix, finds the
prefix's plugins beside the prefix's core library, and runs a kernel;
where the build has kdispatch._torch_native, the installed one reads torch
tensors.

Usage: test_installed.py CMAKE BUILD_DIR PYTHON_INSTALL_DIR"""
import os
import pathlib
import subprocess
import sys
import tempfile

CHECK = r"""
import pathlib, sys
import numpy as np
import kdispatch, kdispatch.testing as kt
prefix = pathlib.Path(sys.argv[1]).resolve()
where = pathlib.Path(kdispatch.__file__).resolve()
assert prefix in where.parents, f"kdispatch imported from {where}, not from {prefix}"
for sub in ("compat", "integrations"):  # the subpackages are installed too
    assert (where.parent / sub / "__init__.py").is_file(), f"{sub} is not installed beside {where}"
chosen = kdispatch.select("layernorm.rmsnorm", device="cpu")
manifest = pathlib.Path(chosen["manifest"]).resolve()
assert prefix in manifest.parents, f"the cpu plugin came from {manifest}, not from {prefix}"
x = np.random.default_rng(0).uniform(0.5, 2, (3, 37)).astype(np.float32)
w = np.ones(37, np.float32)
out = np.full_like(x, np.nan)
kdispatch.call("layernorm.rmsnorm", out, x, w)
verdict = kt.check("layernorm.rmsnorm", [out, x, w], [np.full_like(x, np.nan), x, w])  # the installed reference
assert verdict.ok, verdict.first_mismatch
print("installed package:", where.parent, "plugins:", manifest.parent, "ops:", len(kdispatch.ops()))
if sys.argv[2] == "1":  # the build has kdispatch._torch_native: installed, and used under this torch
    import torch, kdispatch._torch_tensors as tt
    t = torch.rand(2, 37)
    kdispatch.call("layernorm.rmsnorm", torch.empty_like(t), t, torch.ones(37))
    assert tt.native_reason is None, tt.native_reason
    print("torch tensors read by", kdispatch._torch_native.__file__)
"""


def main():
    if len(sys.argv) != 4:
        print(__doc__)
        return 2
    cmake, build, python_dir = sys.argv[1:]
    try:
        import numpy  # noqa: F401
    except ImportError:
        print("SKIPPED: this python has no numpy (Debian: python3-numpy)")
        return 77
    with tempfile.TemporaryDirectory(prefix="kdispatch-install-") as prefix:
        install = subprocess.run([cmake, "--install", build, "--prefix", prefix], capture_output=True, text=True)
        if install.returncode != 0:
            print(install.stdout, install.stderr)
            return 1
        package_dir = pathlib.Path(prefix) / python_dir
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(package_dir)}
        built_native = any((pathlib.Path(build) / "python" / "kdispatch").glob("_torch_native*"))
        run = subprocess.run([sys.executable, "-c", CHECK, prefix, "1" if built_native else "0"], env=env,
                             cwd=prefix, capture_output=True, text=True)
        print(run.stdout, run.stderr, end="")
        return run.returncode


if __name__ == "__main__":
    sys.exit(main())
