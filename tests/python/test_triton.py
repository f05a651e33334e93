#!/usr/bin/env python3
"""The triton backend (kdispatch.triton) as an ordinary backend registered
at run time, on CUDA where triton imports: the conformance checks of each op
it has (every case of the op schema's tests, each dtype and variant, random
inputs, poisoned outputs, against the reference), its opt-in default, calls
through torch.ops.kdispatch on row-strided views, and its calls captured in
a CUDA graph and under torch.compile(fullgraph=True) equal to eager ones.

    test_triton.py                 the selection, call and capture tests
    test_triton.py --op OP         the conformance checks of OP ("all": of
                                   every op it has; exit 77, skipped: no
                                   kernel for OP)
    test_triton.py --unavailable   where triton or CUDA is missing: register()
                                   refuses with KD-E020 naming why (exit 77,
                                   skipped, where the backend is available)

Everything but --unavailable exits 77 (skipped) without CUDA and triton.
"""
import argparse
import sys
import unittest

try:
    import torch
except ImportError:
    print("SKIPPED: this python has no torch (Debian: python3-torch)")
    sys.exit(77)

import kdispatch
import kdispatch.testing as kt
import kdispatch.torch  # noqa: F401  (torch.ops.kdispatch)
import kdispatch.triton as ktriton

OP = None


class Registered(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.registered = ktriton.register()

    @classmethod
    def tearDownClass(cls):
        ktriton.unregister()


class Conformance(Registered):
    def test_the_kernels_pass_the_conformance_checks(self):
        for op in (sorted(ktriton.KERNELS) if OP == "all" else [OP]):
            checked, failures = kt.conformance(op, ktriton.BACKEND, device="cuda")
            self.assertGreater(checked, 0)
            self.assertEqual(failures[:3], [], f"{op}: {len(failures)} of {checked} calls differ")
            print(f"{op} on {ktriton.BACKEND} (cuda): {checked} calls checked", file=sys.stderr)


def _random(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=g) * 4 - 2).to(dtype).cuda()


class Triton(Registered):
    def test_opt_in_changes_no_selection(self):
        self.assertEqual(sorted(self.registered), sorted(ktriton.KERNELS))
        for op in self.registered:
            chosen = kdispatch.select(op, device="cuda")
            self.assertNotEqual(chosen["backend"], ktriton.BACKEND, op)
            names = [b["backend"] for b in kdispatch.backends(op, "cuda")]
            self.assertIn(ktriton.BACKEND, names, op)

    def test_not_a_cpu_backend(self):
        entry = [b for b in kdispatch.backends("layernorm.rmsnorm", "cpu") if b["backend"] == ktriton.BACKEND]
        self.assertEqual(len(entry), 1)
        self.assertFalse(entry[0]["eligible"])
        self.assertIn("not cpu", entry[0]["reason"])

    def test_row_strided_views_and_float32_weights(self):
        qkv = _random(7, 3 * 256, seed=1)
        x = qkv[:, 256:512]
        for w in (_random(256, seed=2), _random(256, dtype=torch.float32, seed=2)):
            out = torch.full((7, 256), float("nan"), dtype=torch.bfloat16, device="cuda")
            torch.ops.kdispatch.layernorm_rmsnorm(out, x, w, 1e-6, ktriton.BACKEND)
            host = [x.cpu(), w.cpu()]
            want = torch.full((7, 256), float("nan"), dtype=torch.bfloat16)
            kdispatch.call("layernorm.rmsnorm", want, *host, eps=1e-6, backend="reference")
            verdict = kt.compare("layernorm.rmsnorm", [out.cpu()] + host, [want] + host)
            self.assertTrue(verdict.ok, verdict.first_mismatch)

    def test_leading_dims_that_are_not_one_stride_apart_pass_on(self):
        x = _random(4, 6, 64).transpose(0, 1)  # [6, 4, 64], leading dims not collapsible
        out = torch.empty(6, 4, 64, dtype=torch.bfloat16, device="cuda")
        with self.assertRaises(kdispatch.Unsupported):
            ktriton.KERNELS["activation.silu_and_mul"](out[..., :32], x)

    def test_graph_and_compile_equal_eager(self):
        x, r, w = _random(64, 4096, seed=3), _random(64, 4096, seed=4), _random(4096, dtype=torch.float32, seed=5)
        gate = _random(64, 2 * 2048, seed=6)

        def step(x, r, w, gate):
            h = torch.empty_like(x)
            torch.ops.kdispatch.layernorm_rmsnorm(h, x, w, 1e-6, ktriton.BACKEND)
            x2, r2 = h.clone(), r.clone()
            torch.ops.kdispatch.layernorm_fused_add_rmsnorm(x2, r2, w, 1e-6, ktriton.BACKEND)
            a = torch.empty(64, 2048, dtype=x.dtype, device="cuda")
            torch.ops.kdispatch.activation_silu_and_mul(a, gate, ktriton.BACKEND)
            g = torch.empty_like(a)
            torch.ops.kdispatch.activation_gelu_tanh_and_mul(g, gate, ktriton.BACKEND)
            return h, x2, r2, a, g

        eager = step(x, r, w, gate)
        compiled = torch.compile(step, fullgraph=True)(x, r, w, gate)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step(x, r, w, gate)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step(x, r, w, gate)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        for name, e, c, g in zip(["rmsnorm", "x", "residual", "silu", "gelu_tanh"], eager, compiled, captured):
            self.assertTrue(torch.equal(e, c), f"{name}: torch.compile differs from eager")
            self.assertTrue(torch.equal(e, g), f"{name}: the CUDA graph's replay differs from eager")
        print("triton: rmsnorm, fused_add_rmsnorm, silu_and_mul, gelu_tanh_and_mul: torch.compile(fullgraph=True) "
              "and 3 CUDA-graph replays equal eager bit for bit", file=sys.stderr)


class Unavailable(unittest.TestCase):
    def test_register_names_what_is_missing(self):
        with self.assertRaises(kdispatch.PluginError) as caught:
            ktriton.register()
        self.assertEqual(caught.exception.code, "KD-E020")
        self.assertIn(ktriton.available(), str(caught.exception))
        for op in ktriton.KERNELS:
            names = [b["backend"] for b in kdispatch.backends(op, "cpu")]
            self.assertNotIn(ktriton.BACKEND, names)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op")
    parser.add_argument("--unavailable", action="store_true")
    args, rest = parser.parse_known_args()
    why = ktriton.available()
    if args.unavailable:
        if why is None:
            print("SKIPPED: triton and CUDA are available here (tests without --unavailable run)")
            sys.exit(77)
        suite = unittest.defaultTestLoader.loadTestsFromTestCase(Unavailable)
    else:
        if why is not None:
            print(f"SKIPPED: {why}")
            sys.exit(77)
        if args.op not in (None, "all") and args.op not in ktriton.KERNELS:
            print(f"SKIPPED: the triton backend has no kernel for {args.op}")
            sys.exit(77)
        OP = args.op
        loader = unittest.defaultTestLoader
        suite = unittest.TestSuite([loader.loadTestsFromTestCase(Conformance)] if OP else
                                   [loader.loadTestsFromTestCase(Triton)])
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    sys.exit(0 if result.wasSuccessful() else 1)
