#!/usr/bin/env python3
"""kdispatch._torch_native, the helper built against torch's C++ headers,
reads torch tensors' negative bit and requires_grad, bumps the version
counters of written tensors and asks whether a torch-function mode is
active: it is used where it was built for this torch, and otherwise (turned
off, or built for another torch version) the reads go through torch's
bindings and say why; either way a call's checks give the same answers.

Skipped where the helper was not built (torch without C++ headers)."""
import importlib.util
import os
import subprocess
import sys
import unittest

try:
    import torch
except ImportError as e:
    print(f"SKIPPED: {e} (Debian: python3-torch)")
    sys.exit(77)

# Each call's checks, printed as one line per case: run in a fresh process
# for each way of reading (the reader is chosen when kdispatch meets torch).
CASES = r"""
import sys, torch
if len(sys.argv) > 1:
    torch.__version__ = sys.argv[1]  # a torch other than the helper's
import kdispatch
import kdispatch._torch_tensors as tt
RMS = "layernorm.rmsnorm"
torch.manual_seed(5)
x, w = torch.rand(3, 16) + 0.5, torch.rand(16) + 0.5
def call(out, x, w):
    try:
        kdispatch.call(RMS, out, x, w)
        return "ok"
    except kdispatch.CallError as e:
        return e.code + (" neg" if "negative bit" in e.message else "") + (" grad" if "requires grad" in e.message else "")
out = torch.full_like(x, float("nan"))
print("plain", call(out, x, w), out._version)
want = out.clone()
kdispatch.call(RMS, want, -x, w)
got = torch.full_like(x, float("nan"))
print("negated input", call(got, torch._neg_view(x), w), torch.equal(got, want))
print("negated output", call(torch._neg_view(torch.zeros(3, 16)), x, w))
print("grad", call(out, x, w.detach().requires_grad_()))
with torch.no_grad():
    print("grad under no_grad", call(out, x, w.detach().requires_grad_()))
with torch.inference_mode():
    i = torch.rand(3, 16)
print("inference tensor", call(torch.empty_like(i), i, w))
from torch.overrides import TorchFunctionMode
class Mode(TorchFunctionMode):
    def __torch_function__(self, f, types, args=(), kwargs=None):
        return f(*args, **(kwargs or {}))
with Mode():
    print("under a mode", call(out, x, w))
view = torch.rand(3, 40)[:, 4:20]  # rows 40 apart
got = torch.full((3, 32), float("nan"))[:, ::2]  # a last-dim stride of 2
print("row-strided view", call(torch.full_like(view, float("nan")), view, w), "last-dim stride", call(got, x, w))
print("zero rows", call(torch.empty(0, 16), torch.empty(0, 16), w))
print("complex", call(out, x.to(torch.complex64), w), "int8", call(out, x.to(torch.int8), w))
print("reason", tt.native_reason)
"""


def run(env_native=None, torch_version=None):
    env = dict(os.environ)
    env.pop("KDISPATCH_TORCH_NATIVE", None)
    if env_native is not None:
        env["KDISPATCH_TORCH_NATIVE"] = env_native
    args = [sys.executable, "-c", CASES] + ([torch_version] if torch_version else [])
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise AssertionError(f"exit {done.returncode}:\n{done.stdout}\n{done.stderr}")
    lines = done.stdout.splitlines()
    return [l for l in lines if not l.startswith("reason ")], lines[-1][len("reason "):]


class TorchNative(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.native, cls.native_reason = run()

    def test_used_where_built_for_this_torch(self):
        self.assertEqual(self.native_reason, "None")
        self.assertEqual(self.native, [
            "plain ok 1", "negated input ok True", "negated output KD-E030 neg", "grad KD-E030 grad",
            "grad under no_grad ok", "inference tensor ok", "under a mode ok",
            "row-strided view ok last-dim stride KD-E030", "zero rows ok", "complex KD-E030 int8 KD-E030"])

    def test_turned_off_reads_through_the_bindings_alike(self):
        lines, reason = run(env_native="0")
        self.assertEqual(reason, "turned off by KDISPATCH_TORCH_NATIVE=0")
        self.assertEqual(lines, self.native)

    def test_another_torch_version_reads_through_the_bindings_alike(self):
        lines, reason = run(torch_version="0.0.1")
        self.assertRegex(reason, r"built for torch \S+, and this is torch 0\.0\.1$")
        self.assertEqual(lines, self.native)


if __name__ == "__main__":
    if importlib.util.find_spec("kdispatch._torch_native") is None:
        print("SKIPPED: kdispatch._torch_native was not built (torch had no C++ headers: Debian's libtorch-dev)")
        sys.exit(77)
    unittest.main()
