#!/usr/bin/env python3
"""8-bit float tensors where an op's schema allows none are refused with
KD-E030 naming the argument, never reaching a kernel: from a DLPack producer
(float8_e4m3fn and float8_e5m2 as DLPack 1.1 numbers them, and DLPack 1.1's
other 8-bit floats, which kdispatch does not handle), and, with a torch that
has torch.float8_e4m3fn, from torch tensors.
Usage: test_float8.py --dlpack | --torch (exit 77, skipped, without NumPy,
or with --torch, without a torch that has the 8-bit floats)"""
import importlib
import sys
import unittest

try:
    import numpy as np
except ImportError as e:
    print(f"SKIPPED: {e} (Debian: python3-numpy)")
    sys.exit(77)

import kdispatch
from dlpack_producer import OldProducer, Producer

RMS = "layernorm.rmsnorm"  # out, x, weight: float32, float16 or bfloat16
FLOAT8_E4M3FN = (10, 8)    # DLPack 1.1 kDLFloat8_e4m3fn
FLOAT8_E5M2 = (12, 8)      # DLPack 1.1 kDLFloat8_e5m2
FLOAT8_E4M3FNUZ = (11, 8)  # DLPack 1.1, not a kdispatch dtype


class Float8Refused(unittest.TestCase):
    def assert_refused(self, fn, *parts):
        with self.assertRaises(kdispatch.CallError) as caught:
            fn()
        e = caught.exception
        self.assertEqual(e.code, "KD-E030", e.message)
        for part in parts:
            self.assertIn(part, e.message)


class FromDLPack(Float8Refused):
    def setUp(self):
        self.out = np.full((3, 8), 0x7f, dtype=np.uint8)  # NaN in float8_e4m3fn
        self.x = np.full((3, 8), 0x38, dtype=np.uint8)    # 1.0 in float8_e4m3fn
        self.w = np.full((8,), 0x38, dtype=np.uint8)

    def test_every_tensor_float8(self):
        for producer in (Producer, OldProducer):
            for code, name in ((FLOAT8_E4M3FN, "float8_e4m3fn"), (FLOAT8_E5M2, "float8_e5m2")):
                with self.subTest(producer=producer.__name__, dtype=name):
                    args = [producer(a, dtype=code) for a in (self.out, self.x, self.w)]
                    self.assert_refused(lambda: kdispatch.call(RMS, *args), "'out'",
                                        f"expected dtype T in [float32, float16, bfloat16], got {name}")
                    self.assertTrue((self.out == 0x7f).all(), "the kernel ran")

    def test_float8_weight_beside_float32(self):
        out = np.full((3, 8), np.nan, dtype=np.float32)
        x = np.ones((3, 8), dtype=np.float32)
        self.assert_refused(lambda: kdispatch.call(RMS, out, x, Producer(self.w, dtype=FLOAT8_E5M2)),
                            "'weight'", "got float8_e5m2")
        self.assertTrue(np.isnan(out).all(), "the kernel ran")

    def test_unknown_float8_code(self):
        args = [Producer(a, dtype=FLOAT8_E4M3FNUZ) for a in (self.out, self.x, self.w)]
        self.assert_refused(lambda: kdispatch.call(RMS, *args), "'out'",
                            "DLPack 1.1 8-, 6- or 4-bit float kdispatch does not handle (code 11, 8 bits, 1 lanes)")


class FromTorch(Float8Refused):
    def test_torch_float8(self):
        import torch
        for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            with self.subTest(dtype=str(dtype)):
                out = torch.zeros(3, 8, dtype=torch.uint8).view(dtype)
                x = torch.ones(3, 8).to(dtype)
                w = torch.ones(8).to(dtype)
                name = str(dtype).removeprefix("torch.")
                self.assert_refused(lambda: kdispatch.call(RMS, out, x, w), "'out'",
                                    f"expected dtype T in [float32, float16, bfloat16], got {name}")
                self.assertTrue((out.view(torch.uint8) == 0).all(), "the kernel ran")
                # Through the torch reader too (kdispatch.torch knows the dtype).
                importlib.import_module("kdispatch.torch")  # binds no local name `kdispatch`
                f32_out, f32_x = torch.full((3, 8), float("nan")), torch.ones(3, 8)
                self.assert_refused(lambda: kdispatch.call(RMS, f32_out, f32_x, w), "'weight'", f"got {name}")


if __name__ == "__main__":
    mode = sys.argv.pop(1) if len(sys.argv) > 1 else "--dlpack"
    if mode == "--torch":
        try:
            import torch
        except ImportError as e:
            print(f"SKIPPED: {e} (Debian: python3-torch)")
            sys.exit(77)
        if not hasattr(torch, "float8_e4m3fn"):
            print(f"SKIPPED: torch {torch.__version__} has no float8_e4m3fn (torch >= 2.1 has)")
            sys.exit(77)
        suite = unittest.defaultTestLoader.loadTestsFromTestCase(FromTorch)
    else:
        suite = unittest.defaultTestLoader.loadTestsFromTestCase(FromDLPack)
    sys.exit(0 if unittest.TextTestRunner(verbosity=2).run(suite).wasSuccessful() else 1)
