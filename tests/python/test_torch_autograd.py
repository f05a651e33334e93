#!/usr/bin/env python3
"""No op has a backward: a torch tensor that requires grad, with grad mode
on, is refused (KD-E030 naming it) by kdispatch.call, the torch ops and
their functional forms, instead of a result without a grad_fn; under
torch.no_grad() or with detached tensors the call runs.

A call writes its torch tensors as torch's own in-place ops do: through
every entry point, each written tensor's version counter goes up by one
(shared with its views and base), so that autograd refuses a backward
through a tensor that was saved for it and overwritten since."""
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
FUSED = "layernorm.fused_add_rmsnorm"  # writes x and residual in place, reads weight


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


# Each entry point, calling FUSED on (x, residual, weight).
ENTRY_POINTS = {
    "torch.ops.kdispatch": lambda x, r, w: torch.ops.kdispatch.layernorm_fused_add_rmsnorm(x, r, w, 1e-6),
    "kdispatch.call": lambda x, r, w: kdispatch.call(FUSED, x, r, w, eps=1e-6),
    "kdispatch.op": lambda x, r, w: kdispatch.op(FUSED)(x, r, w, eps=1e-6),
}


def fused_args(rows=4):
    return torch.rand(rows, 32), torch.rand(rows, 32), torch.rand(32)


class VersionCounter(unittest.TestCase):
    def test_each_written_tensor_once_per_call(self):
        for name, fn in ENTRY_POINTS.items():
            with self.subTest(name):
                x, r, w = fused_args()
                x0, r0, w0 = x._version, r._version, w._version
                fn(x, r, w)
                self.assertEqual((x._version, r._version, w._version), (x0 + 1, r0 + 1, w0))
                fn(x, r, w)
                self.assertEqual((x._version, r._version, w._version), (x0 + 2, r0 + 2, w0))

    def test_out_tensor(self):
        x, w = torch.rand(4, 32), torch.rand(32)
        out = torch.empty(4, 32)
        calls = [lambda: torch.ops.kdispatch.layernorm_rmsnorm(out, x, w, 1e-6),
                 lambda: kdispatch.call(RMS, out, x, w), lambda: kdispatch.op(RMS)(out, x, w)]
        for i, call in enumerate(calls):
            call()
            self.assertEqual((out._version, x._version, w._version), (i + 1, 0, 0))

    def test_a_view_bumps_the_counter_it_shares_with_its_base(self):
        for name, fn in ENTRY_POINTS.items():
            with self.subTest(name):
                base = torch.rand(8, 32)
                x = base[2:6]
                _, r, w = fused_args()
                b0 = base._version
                fn(x, r, w)
                self.assertEqual((base._version, x._version), (b0 + 1, b0 + 1))

    def test_a_refused_call_bumps_nothing(self):
        for name, fn in ENTRY_POINTS.items():
            with self.subTest(name):
                x, r, w = torch.rand(4, 32), torch.rand(4, 16), torch.rand(32)
                with self.assertRaises(kdispatch.CallError):
                    fn(x, r, w)
                self.assertEqual((x._version, r._version), (0, 0))

    def test_a_failed_kernel_bumps_what_it_may_have_written(self):
        rope = "embeddings.rotary_embedding"
        calls = {
            "torch.ops.kdispatch": lambda p, q, k, c: torch.ops.kdispatch.embeddings_rotary_embedding(
                p, q, k, c, True, backend="cpu"),
            "kdispatch.call": lambda p, q, k, c: kdispatch.call(rope, p, q, k, c, backend="cpu"),
            "kdispatch.op": lambda p, q, k, c: kdispatch.op(rope, backend="cpu")(p, q, k, c),
        }
        for name, fn in calls.items():
            with self.subTest(name):
                # Position 7 is past the cache's 5 rows: the cpu kernel fails on it.
                positions = torch.tensor([0, 7, 2])
                query, key, cache = torch.rand(3, 2, 8), torch.rand(3, 1, 8), torch.rand(5, 8)
                with self.assertRaises(kdispatch.KernelError):
                    fn(positions, query, key, cache)
                self.assertEqual((query._version, key._version, positions._version, cache._version), (1, 1, 0, 0))

    def test_inference_tensors_have_no_counter_and_run(self):
        for name, fn in ENTRY_POINTS.items():
            with self.subTest(name):
                with torch.inference_mode():
                    x, r, w = fused_args()
                    want = x.clone()
                    fn(x, r, w)
                self.assertTrue(x.is_inference())
                self.assertFalse(torch.equal(x, want))
                # Written outside inference mode, where torch refuses to count a write to it.
                want = x.clone()
                fn(x, r, w)
                self.assertFalse(torch.equal(x, want))
                # A normal tensor written in inference mode is counted, as torch counts it.
                x, r, w = fused_args()
                with torch.inference_mode():
                    fn(x, r, w)
                self.assertEqual(x._version, 1)

    def test_overwriting_a_tensor_saved_for_backward_fails_the_backward(self):
        # torch's own in-place op, for the words to expect.
        leaf = torch.rand(4, 32, requires_grad=True)
        x = torch.rand(4, 32)
        loss = (leaf * x).sum()  # saves x
        x.add_(1)
        with self.assertRaisesRegex(RuntimeError, "modified by an inplace operation"):
            loss.backward()
        for name, fn in ENTRY_POINTS.items():
            with self.subTest(name):
                leaf = torch.rand(4, 32, requires_grad=True)
                x, r, w = fused_args()
                loss = (leaf * x).sum()
                fn(x, r, w)
                with self.assertRaisesRegex(RuntimeError, "modified by an inplace operation"):
                    loss.backward()
                # The same through a view of the saved tensor.
                base = torch.rand(8, 32)
                loss = (leaf * base[:4]).sum()  # saves the view base[:4]
                fn(base[4:], r, w)  # writes other rows of its base
                with self.assertRaisesRegex(RuntimeError, "modified by an inplace operation"):
                    loss.backward()

    def test_each_form_of_torchs_bump_function(self):
        """torch._C._increment_version took one tensor (torch 2.1) and then a
        sequence of tensors: the form this torch has is found by trying, and
        calls bump once per written tensor through it. Stand-ins of both
        forms (built on copy_, which counts one write) run here whatever
        torch this is; the real one, where torch has it, last."""
        import kdispatch._torch_tensors as tt
        had = hasattr(torch._C, "_increment_version")
        real = getattr(torch._C, "_increment_version", None)

        def takes_sequence(tensors):
            for t in tensors:
                t.copy_(t)

        def takes_one(t):
            if not isinstance(t, torch.Tensor):
                raise TypeError("_increment_version(): incompatible function arguments")
            t.copy_(t)

        forms = [(takes_sequence, True), (takes_one, False)] + ([(real, None)] if had else [])
        try:
            for fake, sequence in forms:
                with self.subTest(fake.__name__ if sequence is not None else "torch's own"):
                    torch._C._increment_version = fake
                    for mode in (False, True):
                        with torch.inference_mode(mode):
                            found, found_sequence = tt._version_bump_function()
                        self.assertIs(found, fake)
                        if sequence is not None:
                            self.assertIs(found_sequence, sequence)
                    tt._enabled = False
                    tt.enable()
                    for name, fn in ENTRY_POINTS.items():
                        x, r, w = fused_args()
                        fn(x, r, w)
                        self.assertEqual((x._version, r._version, w._version), (1, 1, 0), name)
        finally:
            if had:
                torch._C._increment_version = real
            else:
                del torch._C._increment_version
            tt._enabled = False
            tt.enable()


if __name__ == "__main__":
    unittest.main()
