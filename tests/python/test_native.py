#!/usr/bin/env python3
"""The torch backend (kdispatch.native) as an ordinary backend registered at
run time: the conformance checks of each op it has (every case of the op
schema's tests, each dtype and variant, random inputs, poisoned outputs,
against the reference), calls through torch.ops.kdispatch naming it,
row-strided views, and its opt-in default, which changes no selection.

    test_native.py [--device cpu|cuda]      the selection and call tests
    test_native.py --op OP [--device ...]    the conformance checks of OP
                                             (exit 77, skipped: no formula)
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
import kdispatch.native as native
import kdispatch.testing as kt
import kdispatch.tuning
import kdispatch.torch  # noqa: F401  (torch.ops.kdispatch)

DEVICE = "cpu"
OP = None


class Registered(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.registered = native.register()

    @classmethod
    def tearDownClass(cls):
        native.unregister()


class Conformance(Registered):
    def test_the_formula_passes_the_conformance_checks(self):
        checked, failures = kt.conformance(OP, native.BACKEND, device=DEVICE)
        self.assertGreater(checked, 0)
        self.assertEqual(failures[:3], [], f"{OP}: {len(failures)} of {checked} calls differ")
        print(f"{OP} on {native.BACKEND} ({DEVICE}): {checked} calls checked", file=sys.stderr)


class Native(Registered):
    def test_opt_in_changes_no_selection(self):
        for op in self.registered:
            chosen = kdispatch.select(op, device=DEVICE)
            self.assertNotEqual(chosen["backend"], native.BACKEND, op)
            names = [b["backend"] for b in kdispatch.backends(op, DEVICE)]
            self.assertIn(native.BACKEND, names, op)

    def test_preference_makes_it_the_choice(self):
        op = "layernorm.rmsnorm"
        kdispatch.set_preference(op, [native.BACKEND])
        try:
            chosen = kdispatch.select(op, device=DEVICE)
            self.assertEqual((chosen["backend"], chosen["rule"]), (native.BACKEND, "preference"))
        finally:
            kdispatch.set_preference(op, None)

    def test_torch_op_names_it_on_row_strided_views(self):
        g = torch.Generator().manual_seed(3)
        wide = (torch.rand(5, 3 * 96, generator=g) * 4 - 2).to(torch.bfloat16).to(DEVICE)
        x = wide[:, 96:192]  # a column slice: rows 288 elements apart
        w = (torch.rand(96, generator=g) + 0.5).to(torch.bfloat16).to(DEVICE)
        out = torch.full((5, 96), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        torch.ops.kdispatch.layernorm_rmsnorm(out, x, w, 1e-6, native.BACKEND)
        want = torch.full_like(out, float("nan"))
        kdispatch.call("layernorm.rmsnorm", want, x.contiguous(), w, eps=1e-6, backend="reference")
        verdict = kt.compare("layernorm.rmsnorm", [out, x, w], [want, x, w])
        self.assertTrue(verdict.ok, verdict.first_mismatch)

    def test_fp8_cache_passes_as_unsupported(self):
        k = torch.rand(2, 1, 8)
        cache = torch.zeros(1, 4, 1, 8)
        with self.assertRaises(kdispatch.Unsupported):
            native.KERNELS["kvcache.reshape_and_cache_flash"](k, k, cache, cache, torch.tensor([0, 1]), None, None,
                                                             "fp8")

    def test_a_constraint_reads_rows(self):
        op = "layernorm.rmsnorm"
        seen = []

        def few_rows(out, x, weight, eps):
            seen.append(x.shape[0])
            native.KERNELS[op](out, x, weight, eps)

        kdispatch.register_kernel(op, "few", few_rows, constraints=["rows <= 4"], priority=5)
        try:
            for rows in (3, 10, 4):
                x = torch.rand(rows, 32) + 0.5
                kdispatch.call(op, torch.empty_like(x), x, torch.ones(32))
            self.assertEqual(seen, [3, 4])
            with self.assertRaises(kdispatch.SelectionError) as caught:
                x = torch.rand(2, 5, 32)
                kdispatch.call(op, torch.empty_like(x), x, torch.ones(32), backend="few")
            self.assertIn("rows = 10", str(caught.exception))
        finally:
            kdispatch.unregister_kernel(op, "few")

    def test_unknown_op_is_refused_by_name(self):
        with self.assertRaises(kdispatch.Error) as caught:
            native.register(["layernorm.no_such_op"])
        self.assertIn("layernorm.no_such_op", str(caught.exception))


class Tuned(Registered):
    """kdispatch.tuning.tune over the cpu plugin and the torch backend, and
    calls following a tuning file per shape."""

    def test_tune_measures_checks_and_picks_the_faster(self):
        import json
        import tempfile
        op = "layernorm.rmsnorm"
        with tempfile.TemporaryDirectory() as tmp:
            path = f"{tmp}/tuning.json"
            result = kdispatch.tuning.tune(op, [{"rows": 1, "H": 512}, {"rows": 256, "H": 512}], dtype="float32",
                                           device=DEVICE, out=path, budget=30, progress=False)
            try:
                self.assertEqual(len(result.rows), 2, result.table())
                for row in result.rows:
                    self.assertEqual(set(row["us"]), {"cpu", native.BACKEND})
                    self.assertEqual(row["choice"], min(row["us"], key=row["us"].get))
                with open(path) as f:
                    written = json.load(f)
                self.assertEqual(written["key"]["device"], "cpu")
                self.assertTrue({c["backend"] for c in written["choices"]} <= {"cpu", native.BACKEND})
                print(result.table(), file=sys.stderr)
            finally:
                kdispatch.set_tuning_file(None)

    def test_a_backend_that_differs_from_the_reference_is_left_out(self):
        op = "layernorm.rmsnorm"

        def wrong(out, x, weight, eps):
            out.copy_(x)

        kdispatch.register_kernel(op, "wrong", wrong, opt_in=True)
        try:
            result = kdispatch.tuning.tune(op, [{"rows": 3, "H": 64}], dtype="float32", device=DEVICE,
                                           backends=["cpu", "wrong"], budget=10, progress=False)
            self.assertEqual(set(result.rows[0]["us"]), {"cpu"})
            self.assertEqual([r[0] for r in result.rejected], ["wrong"])
            self.assertIn("differs from the reference", result.rejected[0][3])
        finally:
            kdispatch.unregister_kernel(op, "wrong")

    def test_calls_follow_the_file_per_shape(self):
        import tempfile
        op = "layernorm.rmsnorm"
        seen = []

        def spy(out, x, weight, eps):
            seen.append(x.shape[0])
            native.KERNELS[op](out, x, weight, eps)

        kdispatch.register_kernel(op, "spy", spy, priority=-1)
        measured = [{"op": op, "dtype": "float32", "sizes": {"rows": 1, "H": 64}, "us": {"cpu": 1.0, "spy": 5.0}},
                    {"op": op, "dtype": "float32", "sizes": {"rows": 4096, "H": 64}, "us": {"cpu": 5.0, "spy": 1.0}}]
        with tempfile.TemporaryDirectory() as tmp:
            path = f"{tmp}/tuning.json"
            kdispatch.write_tuning(path, "cpu", measured)
            kdispatch.set_tuning_file(path)
            try:
                rmsnorm = kdispatch.op(op)  # resolved before the calls: follows the file too
                for rows in (2, 3000, 1, 5000):
                    x, w = torch.rand(rows, 64) + 0.5, torch.rand(64) + 0.5
                    out = torch.full_like(x, float("nan"))
                    rmsnorm(out, x, w, eps=1e-6)
                    want = torch.full_like(x, float("nan"))
                    kdispatch.call(op, want, x, w, eps=1e-6, backend="reference")
                    self.assertTrue(kt.compare(op, [out, x, w], [want, x, w]).ok)
                self.assertEqual(seen, [3000, 5000])  # rows > 64: spy; the others: cpu
            finally:
                kdispatch.set_tuning_file(None)
                kdispatch.unregister_kernel(op, "spy")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--op")
    args, rest = parser.parse_known_args()
    DEVICE = args.device
    if DEVICE.startswith("cuda") and not torch.cuda.is_available():
        print("SKIPPED: no CUDA device")
        sys.exit(77)
    if args.op is not None and args.op not in native.KERNELS:
        print(f"SKIPPED: the torch backend has no formula for {args.op}")
        sys.exit(77)
    OP = args.op
    loader = unittest.defaultTestLoader
    suite = unittest.TestSuite([loader.loadTestsFromTestCase(Conformance)] if OP else
                               [loader.loadTestsFromTestCase(c) for c in (Native, Tuned)])
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    sys.exit(0 if result.wasSuccessful() else 1)
