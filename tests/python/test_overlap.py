#!/usr/bin/env python3
"""Written tensors that share memory with another argument are refused
(KD-E030 naming both) on every entry point: kdispatch.call with NumPy
arrays, with torch tensors, and torch.ops.kdispatch. Slices of one buffer
that share no byte (q and k of a fused QKV output, even and odd columns)
are accepted and give the reference's results."""
import sys
import unittest

try:
    import numpy as np
    import torch
except ImportError as e:
    print(f"SKIPPED: {e} (Debian: python3-numpy, python3-torch)")
    sys.exit(77)

import kdispatch
import kdispatch.testing as kt
import kdispatch.torch  # noqa: F401 - registers torch.ops.kdispatch

RMS = "layernorm.rmsnorm"
ROPE = "embeddings.rotary_embedding"


def rms_reference(x, w, eps=1e-6):
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + eps) * w).astype(x.dtype)


class Overlap(unittest.TestCase):
    def assert_refused(self, fn, *names):
        with self.assertRaises(kdispatch.CallError) as caught:
            fn()
        e = caught.exception
        self.assertEqual(e.code, "KD-E030")
        for name in names:
            self.assertIn(f"'{name}'", e.message)
        self.assertIn("overlaps", e.message)

    def test_numpy_out_partially_over_x(self):
        rng = np.random.default_rng(1)
        buf = rng.uniform(0.5, 2, (4, 33)).astype(np.float32)
        x, out = buf[:, :32], buf[:, 1:]
        w = np.ones(32, np.float32)
        before = buf.copy()
        self.assert_refused(lambda: kdispatch.call(RMS, out, x, w), "out", "x")
        self.assertTrue(np.array_equal(buf, before), "the refused call wrote nothing")

    def test_numpy_out_is_x(self):
        x = np.ones((4, 32), np.float32)
        w = np.ones(32, np.float32)
        self.assert_refused(lambda: kdispatch.call(RMS, x, x, w), "out", "x")

    def test_numpy_out_over_weight(self):
        buf = np.ones(64, np.float32)
        out = buf[:32].reshape(1, 32)
        x = np.ones((1, 32), np.float32)
        self.assert_refused(lambda: kdispatch.call(RMS, out, x, buf[16:48]), "out", "weight")

    def test_numpy_interleaved_rows_accepted(self):
        rng = np.random.default_rng(2)
        buf = rng.uniform(0.5, 2, (5, 64)).astype(np.float32)
        x = buf[:, :32]
        out = buf[:, 32:]
        w = rng.uniform(0.5, 2, 32).astype(np.float32)
        want = rms_reference(x, w)
        kdispatch.call(RMS, out, x, w, backend="reference")
        np.testing.assert_allclose(out, want, rtol=1e-5)

    def test_torch_query_is_key(self):
        q = torch.randn(3, 2, 8)
        pos = torch.arange(3)
        cache = torch.randn(16, 8)
        self.assert_refused(lambda: kdispatch.call(ROPE, pos, q, q, cache), "query", "key")
        self.assert_refused(lambda: torch.ops.kdispatch.embeddings_rotary_embedding(pos, q, q, cache), "query", "key")

    def test_torch_key_partially_over_query(self):
        qkv = torch.randn(3, 5 * 8)
        q = qkv[:, :16].view(3, 2, 8)
        k = qkv[:, 8:24].view(3, 2, 8)
        pos = torch.arange(3)
        cache = torch.randn(16, 8)
        self.assert_refused(lambda: torch.ops.kdispatch.embeddings_rotary_embedding(pos, q, k, cache), "query", "key")

    def test_torch_fused_qkv_slices_accepted(self):
        torch.manual_seed(0)
        qkv = torch.randn(6, (4 + 2 + 2) * 8)
        expect = qkv.clone()
        pos = torch.randint(0, 16, (6,))
        cache = torch.randn(16, 8)
        q = qkv[:, :32].view(6, 4, 8)
        k = qkv[:, 32:48].view(6, 2, 8)
        torch.ops.kdispatch.embeddings_rotary_embedding(pos, q, k, cache, True, backend="reference")
        eq = expect[:, :32].clone().view(6, 4, 8)
        ek = expect[:, 32:48].clone().view(6, 2, 8)
        torch.ops.kdispatch.embeddings_rotary_embedding(pos, eq, ek, cache, True, backend="reference")
        self.assertTrue(torch.equal(q, eq) and torch.equal(k, ek))
        self.assertTrue(torch.equal(qkv[:, 48:], expect[:, 48:]), "v untouched")

    def test_torch_out_over_x(self):
        x = torch.ones(4, 33)
        w = torch.ones(32)
        self.assert_refused(lambda: torch.ops.kdispatch.layernorm_rmsnorm(x[:, 1:], x[:, :32], w, 1e-6), "out", "x")

    def test_repeated_call_refused_after_an_accepted_one(self):
        # The same shapes as an accepted call: the remembered-call tier checks memory too.
        buf = np.ones((4, 64), np.float32)
        w = np.ones(32, np.float32)
        kdispatch.call(RMS, buf[:, 32:], buf[:, :32], w)
        self.assert_refused(lambda: kdispatch.call(RMS, buf[:, 16:48], buf[:, :32], w), "out", "x")


if __name__ == "__main__":
    unittest.main()
