"""kdispatch imported before torch, in one process: the import and a call work.

The module must export nothing but its init function: a module that exports
C++ runtime code it carries makes libstdc++, loaded first as its dependency,
bind its own calls to that copy, and torch's import then aborts ("free():
invalid pointer"). Run with the interpreter the module was built for; exit
code 77 (no torch) is a skip.
"""
import shutil
import subprocess
import sys

import kdispatch  # before torch, on purpose

assert "torch" not in sys.modules, "this test must import kdispatch before torch"

module = kdispatch._kdispatch.__file__
nm = shutil.which("nm")
if nm:
    out = subprocess.run([nm, "-D", "--defined-only", module], capture_output=True, text=True, check=True).stdout
    exported = sorted(line.split()[-1] for line in out.splitlines() if line.strip())
    assert exported == ["PyInit__kdispatch"], f"{module} exports more than its init function: {exported[:10]}"
    print(f"ok: {module} exports PyInit__kdispatch alone")
else:
    print("SKIPPED: the export check (no nm on PATH)")

try:
    import torch
except ImportError:
    print("SKIPPED: torch is not installed")
    sys.exit(77)
import kdispatch.torch as kt

devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
for device in devices:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 257, generator=g).to(device=device, dtype=torch.bfloat16)
    w = torch.randn(257, generator=g).to(device=device, dtype=torch.bfloat16)
    got = kt.layernorm.rmsnorm(x, w, eps=1e-6)
    want = kt.layernorm.rmsnorm(x.cpu(), w.cpu(), eps=1e-6, backend="reference")  # the reference runs on the host
    assert (got.cpu().float() - want.float()).abs().max().item() < 0.05, device
    print(f"ok: layernorm.rmsnorm on {device} after importing kdispatch before torch {torch.__version__}")
