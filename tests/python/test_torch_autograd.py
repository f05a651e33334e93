#!/usr/bin/env python3
"""No op has a backward: a torch tensor that requires grad, with grad mode
on, is refused (KD-E030 naming it) by kdispatch.call, the torch ops and
their functional forms, instead of a result without a grad_fn; under
torch.no_grad() or with detached tensors the call runs."""
import sys
import unittest

try:
    import torch
except ImportError as e:
    print(f"SKIPPED: {e} (Debian: python3-torch)")
    sys.exit(77)

import kdispatch
import kdispatch.torch as kt

RMS = "layernorm.rmsnorm"


class Autograd(unittest.TestCase):
    def setUp(self):
        self.x = torch.rand(4, 32, requires_grad=True)
        self.w = torch.rand(32)

    def assert_refused(self, fn, name):
        with self.assertRaises(kdispatch.CallError) as caught:
            fn()
        self.assertEqual(caught.exception.code, "KD-E030")
        self.assertIn(f"'{name}': requires grad", caught.exception.message)
        self.assertIn("no backward", caught.exception.message)

    def test_functional_form(self):
        self.assert_refused(lambda: kt.layernorm.rmsnorm(self.x, self.w), "x")

    def test_torch_op(self):
        out = torch.empty(4, 32)
        self.assert_refused(lambda: torch.ops.kdispatch.layernorm_rmsnorm(out, self.x, self.w, 1e-6), "x")

    def test_call(self):
        out = torch.empty(4, 32)
        self.assert_refused(lambda: kdispatch.call(RMS, out, self.x, self.w), "x")
        self.assert_refused(lambda: kdispatch.op(RMS)(out, self.x, self.w), "x")

    def test_without_grad_it_runs(self):
        with torch.no_grad():
            out = kt.layernorm.rmsnorm(self.x, self.w)
        self.assertFalse(out.requires_grad)
        with torch.inference_mode():
            kt.layernorm.rmsnorm(self.x, self.w)
        kt.layernorm.rmsnorm(self.x.detach(), self.w)


if __name__ == "__main__":
    unittest.main()
