#!/usr/bin/env python3
"""torch tensors with the negative bit set (lazily negated views,
t.is_neg()) give kdispatch.call and kdispatch.op the values torch reads
from them: an input is resolved, a written tensor is refused with KD-E030
naming it. Also when kdispatch is imported before torch."""
import subprocess
import sys
import unittest

try:
    import torch
except ImportError as e:
    print(f"SKIPPED: {e} (Debian: python3-torch)")
    sys.exit(77)

RMS = "layernorm.rmsnorm"


def rms(x, w, eps=1e-6):
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()).to(x.dtype)


class NegativeBit(unittest.TestCase):
    def setUp(self):
        import kdispatch
        self.kd = kdispatch
        torch.manual_seed(3)
        self.x = torch.rand(4, 32) + 0.5
        self.w = torch.rand(32) + 0.5

    def test_input_is_resolved(self):
        neg = torch._neg_view(self.x)
        self.assertTrue(neg.is_neg())
        want = rms(-self.x, self.w)
        for call in (lambda out: self.kd.call(RMS, out, neg, self.w, backend="reference"),
                     lambda out: self.kd.op(RMS, "reference")(out, neg, self.w)):
            out = torch.full_like(self.x, float("nan"))
            call(out)
            torch.testing.assert_close(out, want)
        self.assertTrue(neg.is_neg(), "the caller's tensor is left as it was")

    def test_written_tensor_is_refused(self):
        out = torch._neg_view(torch.zeros(4, 32))
        with self.assertRaises(self.kd.CallError) as caught:
            self.kd.call(RMS, out, self.x, self.w)
        self.assertEqual(caught.exception.code, "KD-E030")
        self.assertIn("'out'", caught.exception.message)
        self.assertIn("negative bit", caught.exception.message)

    def test_torch_op_agrees(self):
        import kdispatch.torch  # noqa: F401
        neg = torch._neg_view(self.x)
        out = torch.full_like(self.x, float("nan"))
        torch.ops.kdispatch.layernorm_rmsnorm(out, neg, self.w, 1e-6, "reference")
        torch.testing.assert_close(out, rms(-self.x, self.w))


def imported_before_torch():
    """A fresh process that imports kdispatch before torch."""
    code = (
        "import kdispatch, torch\n"
        "x = torch.rand(4, 32) + 0.5; w = torch.rand(32) + 0.5\n"
        "out = torch.empty(4, 32)\n"
        "kdispatch.call('layernorm.rmsnorm', out, torch._neg_view(x), w, backend='reference')\n"
        "want = -(x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double())\n"
        "torch.testing.assert_close(out, want.float())\n"
        "print('resolved')\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


class ImportOrder(unittest.TestCase):
    def test_kdispatch_before_torch(self):
        result = imported_before_torch()
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("resolved", result.stdout)


if __name__ == "__main__":
    unittest.main()
