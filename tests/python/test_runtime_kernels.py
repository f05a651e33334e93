#!/usr/bin/env python3
"""kdispatch.register_kernel: a torch formula of layernorm.rmsnorm as the
backend "torchy", called by name through kdispatch.call and
torch.ops.kdispatch, checked against the reference on the schema's cases
(random inputs, poisoned outputs, odd sizes); Unsupported passes a call on,
another exception fails it with its message; registrations survive
configure(); unregister_kernel withdraws them; bad arguments are kdispatch
errors with their codes."""
import sys
import unittest

try:
    import torch
except ImportError:
    print("SKIPPED: this python has no torch")
    sys.exit(77)

import kdispatch
import kdispatch.testing as kt
import kdispatch.torch  # noqa: F401  (registers torch.ops.kdispatch)

OP = "layernorm.rmsnorm"


def rmsnorm(out, x, weight, *, eps):
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    out.copy_(y.to(out.dtype))


class Calls:
    """A kernel that records what it was given, then runs the formula."""

    def __init__(self):
        self.seen = []

    def __call__(self, *tensors, **attrs):
        self.seen.append((tensors, attrs))
        rmsnorm(*tensors, **attrs)


def small_cases():
    return [c for c in kt.cases(OP) if c.elements <= 200_000]


class RuntimeKernels(unittest.TestCase):
    def tearDown(self):
        for backend in ("torchy", "torchy2", "picky", "broken"):
            try:
                kdispatch.unregister_kernel(OP, backend)
            except kdispatch.SelectionError:
                pass

    def test_formula_through_call_and_torch_ops_matches_the_reference(self):
        calls = Calls()
        kdispatch.register_kernel(OP, "torchy", calls, dtypes=["float32", "bfloat16", "float16"],
                                  description="rmsnorm in plain torch")
        self.assertIn("torchy", [b["backend"] for b in kdispatch.backends(OP)])
        checked = 0
        for dtype in ("float32", "bfloat16"):
            for case in small_cases():
                inputs = kt.inputs(OP, dtype, case, seed=3 + case.index)
                want = kt.reference(OP, inputs, case)
                got = [t.clone() for t in inputs]
                self.assertTrue(torch.isnan(got[0].float()).any() or got[0].numel() == 0, "outputs are poisoned")
                kdispatch.call(OP, *got, backend="torchy", **case.attrs)
                verdict = kt.compare(OP, got, want, case)
                self.assertTrue(verdict.ok, f"{dtype} {case}: {verdict.first_mismatch}")
                got = [t.clone() for t in inputs]
                torch.ops.kdispatch.layernorm_rmsnorm(*got, case.attrs.get("eps", 1e-6), backend="torchy")
                verdict = kt.compare(OP, got, want, case)
                self.assertTrue(verdict.ok, f"torch.ops {dtype} {case}: {verdict.first_mismatch}")
                checked += 1
        self.assertGreater(checked, 10)
        self.assertEqual(len(calls.seen), 2 * checked)  # every call ran the callable
        # The tensors are torch tensors over the call's memory; eps by name.
        out, x, w = kt.inputs(OP, "float32", small_cases()[1], seed=1)
        calls.seen.clear()
        kdispatch.call(OP, out, x, w, backend="torchy", eps=0.5)
        (tensors, attrs), = calls.seen
        self.assertEqual(attrs, {"eps": 0.5})
        self.assertTrue(all(isinstance(t, torch.Tensor) for t in tensors))
        self.assertEqual(tensors[0].data_ptr(), out.data_ptr())
        self.assertEqual(tensors[1].data_ptr(), x.data_ptr())

    def test_a_row_strided_view_arrives_with_its_strides(self):
        kdispatch.register_kernel(OP, "torchy", rmsnorm, dtypes=["float32"])
        big = torch.randn(5, 24)
        x = big[:, 3:20]  # rows of 17 with a stride of 24, at an offset
        w = torch.randn(17)
        out = torch.full((5, 17), float("nan"))
        kdispatch.call(OP, out, x, w, backend="torchy")
        want = kt.reference(OP, [out, x, w])
        self.assertTrue(kt.compare(OP, [out, x, w], want).ok)

    def test_priority_wins_and_unsupported_passes_the_call_on(self):
        def picky(out, x, weight, eps):
            if x.shape[-1] % 2:
                raise kdispatch.Unsupported("picky: rows of odd length")
            out.fill_(7.0)

        kdispatch.register_kernel(OP, "picky", picky, dtypes=["float32"], priority=900)
        kdispatch.register_kernel(OP, "torchy", rmsnorm, dtypes=["float32"], priority=800)
        chosen = kdispatch.select(OP, dtype="float32")
        self.assertEqual(chosen["backend"], "picky")
        self.assertEqual(chosen["rule"], "priority")
        out, x, w = kt.inputs(OP, "float32", [c for c in kt.cases(OP) if c.sizes["H"] == 7][0], seed=5)
        want = kt.reference(OP, [out, x, w])
        kdispatch.call(OP, out, x, w)  # odd rows: picky declines, torchy runs it
        self.assertTrue(kt.compare(OP, [out, x, w], want).ok)
        even = torch.randn(3, 8)
        out = torch.empty(3, 8)
        kdispatch.call(OP, out, even, torch.randn(8))
        self.assertTrue(bool((out == 7.0).all()))
        # Named, nothing else is tried: the message is the error's.
        out, x, w = kt.inputs(OP, "float32", [c for c in kt.cases(OP) if c.sizes["H"] == 7][0], seed=6)
        with self.assertRaises(kdispatch.KernelError) as caught:
            kdispatch.call(OP, out, x, w, backend="picky")
        self.assertIn("picky: rows of odd length", caught.exception.message)

    def test_another_exception_is_a_kernel_error_with_its_message(self):
        def broken(out, x, weight, eps):
            raise ZeroDivisionError("the formula divided by zero")

        kdispatch.register_kernel(OP, "broken", broken)
        out, x, w = torch.empty(2, 4), torch.randn(2, 4), torch.randn(4)
        with self.assertRaises(kdispatch.KernelError) as caught:
            kdispatch.call(OP, out, x, w, backend="broken")
        self.assertEqual(caught.exception.code, "KD-E040")
        self.assertIn("kernel registered at run time of backend 'broken'", caught.exception.message)
        self.assertIn("ZeroDivisionError: the formula divided by zero", caught.exception.message)

    def test_survives_configure_and_unregister_withdraws_it(self):
        kdispatch.register_kernel(OP, "torchy", rmsnorm, priority=1000)
        kdispatch.configure()
        self.assertEqual(kdispatch.select(OP, dtype="float32")["backend"], "torchy")
        out, x, w = torch.full((3, 9), float("nan")), torch.randn(3, 9), torch.randn(9)
        kdispatch.call(OP, out, x, w)
        self.assertTrue(kt.compare(OP, [out, x, w], kt.reference(OP, [out, x, w])).ok)

        handle = kdispatch.op(OP)
        kdispatch.unregister_kernel(OP, "torchy")
        self.assertNotIn("torchy", [b["backend"] for b in kdispatch.backends(OP)])
        self.assertNotEqual(kdispatch.select(OP, dtype="float32")["backend"], "torchy")
        out2 = torch.full((3, 9), float("nan"))
        handle(out2, x, w)  # a handle made before follows: another backend runs it
        self.assertTrue(kt.compare(OP, [out2, x, w], kt.reference(OP, [out2, x, w])).ok)
        with self.assertRaises(kdispatch.SelectionError) as caught:
            kdispatch.unregister_kernel(OP, "torchy")
        self.assertEqual(caught.exception.code, "KD-E002")
        kdispatch.configure()
        self.assertNotIn("torchy", [b["backend"] for b in kdispatch.backends(OP)])
        # Registered again, even with another callable.
        kdispatch.register_kernel(OP, "torchy", lambda *t, **a: rmsnorm(*t, **a))
        self.assertIn("torchy", [b["backend"] for b in kdispatch.backends(OP)])

    def test_registering_twice(self):
        kdispatch.register_kernel(OP, "torchy", rmsnorm)
        kdispatch.register_kernel(OP, "torchy", rmsnorm)  # the same callable: a no-op
        with self.assertRaises(kdispatch.RegistrationError) as caught:
            kdispatch.register_kernel(OP, "torchy", lambda *t, **a: None)
        self.assertEqual(caught.exception.code, "KD-E005")
        with self.assertRaises(kdispatch.RegistrationError) as caught:
            kdispatch.unregister_kernel(OP, "reference")
        self.assertIn("only kernels registered at run time can be unregistered", caught.exception.message)

    def test_bad_arguments_are_kdispatch_errors(self):
        bad = [
            (dict(op="layernorm.nothing"), kdispatch.SelectionError, "KD-E001", "'layernorm.nothing'"),
            (dict(constraints=["Q > 0"]), kdispatch.ManifestError, "KD-E011", "\"constraints\"[0] \"Q > 0\""),
            (dict(constraints=["H %% 2"]), kdispatch.ManifestError, "KD-E011", "constraints"),
            (dict(dtypes=["int8"]), kdispatch.ManifestError, "KD-E011", "unknown dtype 'int8'"),
            (dict(dtypes=["int32"]), kdispatch.ManifestError, "KD-E011", "not one the op's schema takes"),
            (dict(priority=5000), kdispatch.ManifestError, "KD-E011", "[-1000, 1000]"),
            (dict(priority="high"), kdispatch.ManifestError, "KD-E011", "priority"),
            (dict(targets=["gpu"]), kdispatch.ManifestError, "KD-E011", "device"),
            (dict(targets=[{"device": "cuda", "min_arch": "9"}]), kdispatch.ManifestError, "KD-E011", "min_arch"),
            (dict(targets=[{"device": "cpu", "colour": "red"}]), kdispatch.ManifestError, "KD-E011", "colour"),
            (dict(targets=[3]), kdispatch.ManifestError, "KD-E011", "targets"),
            (dict(backend="Not A Name"), kdispatch.ManifestError, "KD-E011", "[a-z0-9_]+"),
            (dict(fn=42), kdispatch.ManifestError, "KD-E011", "callable"),
        ]
        for change, cls, code, words in bad:
            args = dict(op=OP, backend="torchy2", fn=rmsnorm)
            args.update(change)
            with self.subTest(change=change):
                with self.assertRaises(cls) as caught:
                    kdispatch.register_kernel(args.pop("op"), args.pop("backend"), args.pop("fn"), **args)
                self.assertIsInstance(caught.exception, kdispatch.Error)
                self.assertEqual(caught.exception.code, code)
                self.assertIn(words, str(caught.exception))
        self.assertNotIn("torchy2", [b["backend"] for b in kdispatch.backends(OP)])

    def test_targets_in_the_manifest_syntax(self):
        kdispatch.register_kernel(OP, "torchy2", rmsnorm, targets=[{"device": "cuda", "min_arch": "9.0"}])
        entry = [b for b in kdispatch.backends(OP, device="cpu") if b["backend"] == "torchy2"]
        self.assertEqual(len(entry), 1)
        self.assertFalse(entry[0]["eligible"])
        with self.assertRaises(kdispatch.SelectionError):
            kdispatch.call(OP, torch.empty(2, 4), torch.randn(2, 4), torch.randn(4), backend="torchy2")


if __name__ == "__main__":
    unittest.main()
