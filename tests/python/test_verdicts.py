#!/usr/bin/env python3
"""Conformance verdicts from Python: kdispatch.testing.conformance records
each kernel's verdict; a run-time kernel of layernorm.rmsnorm 1% off fails,
kdispatch.doctor() lists it, and with fallback on a call that a failing
backend passes on skips it and runs on the next backend."""
import sys
import unittest

try:
    import torch
except ImportError:
    print("SKIPPED: this python has no torch")
    sys.exit(77)

import kdispatch
import kdispatch.testing as kt

OP = "layernorm.rmsnorm"


def rmsnorm(out, x, weight, *, eps):
    x32 = x.float()
    out.copy_((x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(out.dtype))


class OnePercentHigh:
    """rmsnorm, 1% high: every check fails it. Counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, out, x, weight, *, eps):
        self.calls += 1
        rmsnorm(out, x, weight, eps=eps)
        out.mul_(1.01)


def broken(out, x, weight, *, eps):
    out.fill_(-1.0e30)
    raise RuntimeError("py_broken: simulated internal failure")


class Verdicts(unittest.TestCase):
    def tearDown(self):
        kdispatch.set_fallback(False)
        for backend in ("py_broken", "py_wrong", "py_right"):
            try:
                kdispatch.unregister_kernel(OP, backend)
            except kdispatch.Error:
                pass
        kdispatch.configure()

    def test_a_kernel_that_failed_is_listed_and_never_a_fallback(self):
        wrong = OnePercentHigh()
        kdispatch.register_kernel(OP, "py_wrong", wrong, dtypes=["float32"], priority=900)
        kdispatch.register_kernel(OP, "py_right", rmsnorm, dtypes=["float32"], priority=800)
        checked, failures = kt.conformance(OP, "py_wrong", dtypes=["float32"])
        self.assertGreater(checked, 0)
        self.assertTrue(failures)
        checked, failures = kt.conformance(OP, "py_right", dtypes=["float32"])
        self.assertGreater(checked, 0)
        self.assertEqual(failures, [])
        failed = [v for v in kdispatch.doctor()["failed_verdicts"] if v["op"] == OP]
        self.assertEqual([(v["backend"], v["device"], v["library"], v["source"]) for v in failed],
                         [("py_wrong", "cpu", "run-time", "kdispatch.testing.conformance")], failed)
        self.assertTrue(failed[0]["detail"])

        kdispatch.register_kernel(OP, "py_broken", broken, dtypes=["float32"], priority=1000)
        kdispatch.set_fallback(True)
        generator = torch.Generator().manual_seed(3)
        x = torch.rand(5, 33, generator=generator) * 4 - 2
        weight = torch.rand(33, generator=generator) + 0.5
        out = torch.full_like(x, float("nan"))
        want = torch.empty_like(x)
        rmsnorm(want, x, weight, eps=1e-6)
        calls = wrong.calls
        kdispatch.call(OP, out, x, weight, eps=1e-6)
        self.assertEqual(wrong.calls, calls)  # skipped: it failed its checks
        torch.testing.assert_close(out, want)  # py_right ran the call
        # Named, the failed kernel still runs.
        kdispatch.call(OP, out, x, weight, eps=1e-6, backend="py_wrong")
        self.assertEqual(wrong.calls, calls + 1)


if __name__ == "__main__":
    unittest.main()
