#!/usr/bin/env python3
"""The kdispatch package beside the kernels: errors (classes, codes, hints,
messages naming the argument), the capsule protocol (versioned and
unversioned capsules, renamed on use, deleter run once, never consumed
twice), the inventory functions against `kdispatch list --json`."""
import gc
import json
import os
import pathlib
import pickle
import subprocess
import sys
import unittest

try:
    import numpy as np
except ImportError:
    print("SKIPPED: this python has no numpy (Debian: python3-numpy)")
    sys.exit(77)

import kdispatch
import kdispatch.testing as kt
from dlpack_producer import OldProducer, Producer

OP = "layernorm.rmsnorm"


def rmsnorm_args(rows=3, h=37):
    rng = np.random.default_rng(7)
    x = rng.uniform(0.5, 2.0, (rows, h)).astype(np.float32)
    w = rng.uniform(0.5, 2.0, h).astype(np.float32)
    out = np.full_like(x, np.nan)
    return out, x, w


def assert_matches(out, x, w, **attrs):
    """`out` is what the reference backend writes for (x, w), within the op
    schema's tolerance."""
    want = kt.reference(OP, [np.full_like(out, np.nan), x, w], attrs)
    verdict = kt.compare(OP, [out, x, w], want)
    assert verdict.ok, verdict.first_mismatch


class Errors(unittest.TestCase):
    def test_wrong_shape_is_call_error_naming_the_argument(self):
        out, x, w = rmsnorm_args()
        with self.assertRaises(kdispatch.CallError) as caught:
            kdispatch.call(OP, out, x, w[:5])
        e = caught.exception
        self.assertEqual(e.code, "KD-E030")
        self.assertIn("'weight'", e.message)
        self.assertIn("'weight'", str(e))
        self.assertIsInstance(e, kdispatch.Error)
        self.assertIsInstance(e, ValueError)
        with self.assertRaises(kdispatch.CallError) as caught:
            kdispatch.op(OP)(out, x[:2], w)
        self.assertIn("'x'", caught.exception.message)

    def test_wrong_count_dtype_layout(self):
        out, x, w = rmsnorm_args()
        for args, needle in [((out, x), "takes 3 tensors"),
                             ((out, x.astype(np.float64), w), "'x'"),
                             ((out, np.ascontiguousarray(np.repeat(x, 2, axis=1))[:, ::2], w), "contiguous"),
                             ((out, [1.0, 2.0], w), "'x'")]:
            with self.assertRaises(kdispatch.CallError) as caught:
                kdispatch.call(OP, *args)
            self.assertEqual(caught.exception.code, "KD-E030")
            self.assertIn(needle, caught.exception.message)

    def test_attributes(self):
        out, x, w = rmsnorm_args()
        with self.assertRaises(kdispatch.CallError) as caught:
            kdispatch.call(OP, out, x, w, epsilon=1e-5)
        self.assertIn("epsilon", caught.exception.message)
        with self.assertRaises(kdispatch.CallError) as caught:
            kdispatch.call(OP, out, x, w, eps="small")
        self.assertIn("eps", caught.exception.message)
        kdispatch.call(OP, out, x, w, eps=np.float32(1e-5))  # NumPy scalars are numbers
        assert_matches(out, x, w, eps=1e-5)
        with self.assertRaises(kdispatch.CallError):
            kdispatch.call(OP, out, x, w, stream="default")

    def test_attribute_values_take_one_rule(self):
        # A float takes an int, an int and a bool take only their own type:
        # the rule of the CLI's --attr and of C++ callers alike.
        out, x, w = rmsnorm_args()
        kdispatch.call(OP, out, x, w, eps=1)
        assert_matches(out, x, w, eps=1.0)
        for value, given in ((True, "bool"), ("1e-5", "string")):
            with self.assertRaises(kdispatch.CallError) as caught:
                kdispatch.call(OP, out, x, w, eps=value)
            self.assertIn(f"attribute 'eps': expected float, got {given}", caught.exception.message)
        gating = np.random.default_rng(3).standard_normal((5, 8)).astype(np.float32)
        weights = np.full((5, 2), np.nan, np.float32)
        ids = np.full((5, 2), -1, np.int32)
        for value, given in ((1, "int"), (1.0, "float"), (np.int64(1), "int")):
            with self.assertRaises(kdispatch.CallError) as caught:
                kdispatch.call("moe.topk_softmax", weights, ids, gating, renormalize=value)
            self.assertIn(f"attribute 'renormalize': expected bool, got {given}", caught.exception.message)
        # NumPy's bool scalar is a bool, as NumPy's float and int scalars are numbers.
        kdispatch.call("moe.topk_softmax", weights, ids, gating, renormalize=np.bool_(True))
        np.testing.assert_allclose(weights.sum(axis=1), np.ones(5), rtol=1e-5)

    def test_stream_forms(self):
        class TorchLikeStream:
            cuda_stream = 0

        class CupyLikeStream:
            ptr = 0

        for stream in (None, 0, TorchLikeStream(), CupyLikeStream()):  # unused on the cpu, but checked
            out, x, w = rmsnorm_args()
            kdispatch.call(OP, out, x, w, stream=stream)
            assert_matches(out, x, w)

    def test_unknown_op_with_did_you_mean(self):
        out, x, w = rmsnorm_args()
        for attempt in (lambda: kdispatch.call("layernorm.rmsnrom", out, x, w),
                        lambda: kdispatch.op("layernorm.rmsnrom"),
                        lambda: kdispatch.select("layernorm.rmsnrom")):
            with self.assertRaises(kdispatch.SelectionError) as caught:
                attempt()
            self.assertEqual(caught.exception.code, "KD-E001")
            self.assertTrue(any("layernorm.rmsnorm" in h for h in caught.exception.hints), caught.exception.hints)

    def test_unknown_backend(self):
        with self.assertRaises(kdispatch.SelectionError) as caught:
            kdispatch.select(OP, backend="nonesuch", device="cpu")
        self.assertEqual(caught.exception.code, "KD-E002")

    def test_kernel_failure_is_kernel_error(self):
        positions = np.array([0, 7, 2], np.int64)
        query = np.random.default_rng(3).uniform(-1, 1, (3, 2, 8)).astype(np.float32)
        cache = np.random.default_rng(4).uniform(-1, 1, (5, 8)).astype(np.float32)
        with self.assertRaises(kdispatch.KernelError) as caught:
            # Position 7 is past the cache's 5 rows: the cpu kernel refuses it.
            kdispatch.call("embeddings.rotary_embedding", positions, query, None, cache, backend="cpu")
        self.assertEqual(caught.exception.code, "KD-E040")
        self.assertIn("position 7 of token 1", caught.exception.message)

    def test_errors_pickle(self):
        e = kdispatch.CallError("KD-E030", "op 'x': bad", ["a hint"])
        again = pickle.loads(pickle.dumps(e))
        self.assertEqual((again.code, again.message, again.hints), ("KD-E030", "op 'x': bad", ["a hint"]))

    def test_explain(self):
        text = kdispatch.explain("KD-E030")
        self.assertTrue(text.startswith("KD-E030: "), text)
        self.assertIn("Fix:", text)
        self.assertIn("KD-E001", kdispatch.error_codes())
        with self.assertRaises(ValueError):
            kdispatch.explain("KD-E999")


class Capsules(unittest.TestCase):
    def check_protocol(self, make, versioned):
        out, x, w = rmsnorm_args()
        producer = make(out)
        kdispatch.call(OP, producer, x, w)
        assert_matches(out, x, w)
        self.assertEqual(producer.exports, 1)
        self.assertEqual(producer.versioned_exports, int(versioned))
        self.assertEqual(producer.deleted, 1)  # by the consumer, once the call is done
        gc.collect()
        self.assertEqual(producer.deleted, 1)  # the renamed capsule's destructor leaves it alone

    def test_versioned_capsule(self):
        self.check_protocol(Producer, versioned=True)

    def test_unversioned_capsule(self):
        for _ in range(2):  # refused max_version: asked again without it, then at once without it
            self.check_protocol(OldProducer, versioned=False)

    def test_capsule_is_never_consumed_twice(self):
        out, x, w = rmsnorm_args()
        for versioned in (True, False):
            producer = Producer(out)
            capsule = producer.capsule(versioned)
            kdispatch.call(OP, capsule, x, w)
            self.assertEqual(producer.deleted, 1)
            with self.assertRaises(kdispatch.CallError) as caught:
                kdispatch.call(OP, capsule, x, w)
            self.assertIn("used already", caught.exception.message)
            self.assertIn("'out'", caught.exception.message)
            del capsule
            gc.collect()
            self.assertEqual(producer.deleted, 1)
        # NumPy's own capsules too.
        capsule = out.__dlpack__()
        kdispatch.call(OP, capsule, x, w)
        with self.assertRaises(kdispatch.CallError):
            kdispatch.call(OP, capsule, x, w)

    def test_unused_capsule_is_freed_by_its_producer(self):
        out, _, _ = rmsnorm_args()
        producer = Producer(out)
        capsule = producer.capsule(True)
        del capsule
        gc.collect()
        self.assertEqual(producer.deleted, 1)

    def test_deleter_runs_when_the_call_fails(self):
        out, x, w = rmsnorm_args()
        producer = Producer(out)
        with self.assertRaises(kdispatch.CallError):
            kdispatch.call(OP, producer, x, w[:3])
        self.assertEqual(producer.deleted, 1)

    def test_read_only_output_is_refused(self):
        out, x, w = rmsnorm_args()
        producer = Producer(out, read_only=True)
        with self.assertRaises(kdispatch.CallError) as caught:
            kdispatch.call(OP, producer, x, w)
        self.assertIn("read-only", caught.exception.message)
        self.assertEqual(producer.deleted, 1)
        self.assertTrue(np.isnan(out).all())
        kdispatch.call(OP, out, Producer(x, read_only=True), w)  # read-only inputs are fine
        assert_matches(out, x, w)

    def test_unknown_major_is_refused_and_freed(self):
        out, x, w = rmsnorm_args()
        producer = Producer(out, major=2)
        with self.assertRaises(kdispatch.CallError) as caught:
            kdispatch.call(OP, producer, x, w)
        self.assertIn("version 2.0", caught.exception.message)
        self.assertEqual(producer.deleted, 1)


class Inventory(unittest.TestCase):
    def test_ops_match_the_tool(self):
        tool = os.environ.get("KDISPATCH_TOOL")
        self.assertTrue(tool, "KDISPATCH_TOOL names the kdispatch tool (ctest sets it)")
        listing = json.loads(subprocess.run([tool, "list", "--json"], check=True, capture_output=True,
                                            text=True).stdout)
        self.assertEqual(kdispatch.ops(), [o["op"] for o in listing["ops"]])

    def test_select_and_backends(self):
        chosen = kdispatch.select(OP, device="cpu", dtype="bfloat16")
        self.assertEqual(chosen["backend"], "cpu")
        self.assertEqual(chosen["plugin"], "cpu")
        self.assertTrue(chosen["symbol"])
        self.assertIsInstance(chosen["targets"], list)
        rows = kdispatch.backends(OP, device="cpu")
        self.assertIn("cpu", [r["backend"] for r in rows if r["eligible"]])
        with self.assertRaises(ValueError):
            kdispatch.select(OP, device="gpu")
        with self.assertRaises(ValueError):
            kdispatch.select(OP, dtype="float8")

    def test_preference_ranks_and_select_says_which_rule(self):
        """kdispatch.set_preference ranks an op's backends; select() names
        the rule and the ranked candidates. Two cuda backends (the cuda
        manifest and a second one) make a tie, read as metadata only."""
        import shutil
        import tempfile
        plugins = pathlib.Path(kdispatch.select(OP, device="cpu")["manifest"]).parent
        source = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "cli" / "triton.json"
        with tempfile.TemporaryDirectory() as tmp:
            # Manifests with stand-in libraries: select() opens none.
            for manifest in (plugins / "cpu.json", plugins / "cuda.json", source):
                if manifest.exists():
                    shutil.copy(manifest, tmp)
                    library = json.loads(manifest.read_text())["library"]
                    pathlib.Path(tmp, library).write_text("stand-in")
            try:
                kdispatch.configure(plugin_path=[tmp])
                if "cuda" not in [b["backend"] for b in kdispatch.backends(OP, device="cuda:9.0")]:
                    self.skipTest("no cuda manifest in the build's plugin folder")
                with self.assertRaises(kdispatch.SelectionError) as tie:
                    kdispatch.select(OP, device="cuda:9.0")
                self.assertEqual(tie.exception.code, "KD-E004")
                kdispatch.set_preference(OP, ["triton", "cuda"])
                self.assertEqual(kdispatch.preference(OP), ["triton", "cuda"])
                chosen = kdispatch.select(OP, device="cuda:9.0")
                self.assertEqual((chosen["backend"], chosen["rule"], chosen["ranked"]),
                                 ("triton", "preference", ["triton", "cuda"]))
                self.assertEqual(kdispatch.select(OP, device="cpu")["rule"], "only")
                self.assertEqual(kdispatch.select(OP, backend="cuda", device="cuda:9.0")["rule"], "named")
                # Refused preferences change nothing.
                with self.assertRaises(kdispatch.SelectionError) as unknown:
                    kdispatch.set_preference("layernorm.rmsnrom", ["cuda"])
                self.assertEqual(unknown.exception.code, "KD-E001")
                with self.assertRaises(kdispatch.SelectionError) as missing:
                    kdispatch.set_preference(OP, ["cdua"])
                self.assertEqual(missing.exception.code, "KD-E002")
                self.assertEqual(kdispatch.preference(OP), ["triton", "cuda"])
                # The preference outlives configure().
                kdispatch.configure(plugin_path=[tmp])
                self.assertEqual(kdispatch.select(OP, device="cuda:9.0")["backend"], "triton")
                kdispatch.set_preference(OP, None)
                self.assertEqual(kdispatch.preference(OP), [])
                with self.assertRaises(kdispatch.SelectionError):
                    kdispatch.select(OP, device="cuda:9.0")
            finally:
                kdispatch.set_preference(OP, None)
                kdispatch.configure()

    def test_doctor_is_the_tools_report(self):
        """One report, made by the core: kdispatch.doctor() is `kdispatch
        doctor --json` as dicts, field for field."""
        tool = os.environ.get("KDISPATCH_TOOL")
        self.assertTrue(tool, "KDISPATCH_TOOL names the kdispatch tool (ctest sets it)")
        # One search path for both (by default each looks beside its own program).
        plugins = str(pathlib.Path(kdispatch.select(OP, device="cpu")["manifest"]).parent)
        cli = json.loads(subprocess.run([tool, "doctor", "--json", "--plugin-path", plugins], capture_output=True,
                                        text=True).stdout)
        try:
            kdispatch.configure(plugin_path=[plugins])
            self.assertEqual(kdispatch.doctor(), cli)
        finally:
            kdispatch.configure()

    def test_doctor(self):
        report = kdispatch.doctor()
        self.assertIn("search_path", report)
        cpu = [p for p in report["plugins"] if p["name"] == "cpu"]
        self.assertEqual(len(cpu), 1)
        self.assertTrue(cpu[0]["loaded"], cpu[0])
        self.assertTrue(cpu[0]["devices"])

    def test_configure_sets_the_plugin_path(self):
        import tempfile
        out, x, w = rmsnorm_args()
        before = kdispatch.op(OP)
        with tempfile.TemporaryDirectory() as empty:
            try:
                kdispatch.configure(plugin_path=[empty])
                self.assertEqual(kdispatch.ops(), [])
                self.assertEqual(kdispatch.doctor()["search_path"], [empty])
                with self.assertRaises(kdispatch.SelectionError):
                    kdispatch.call(OP, out, x, w)
                before(out, x, w)  # a handle keeps the plugins it was resolved with
            finally:
                kdispatch.configure()
        self.assertIn(OP, kdispatch.ops())
        assert_matches(out, x, w)

    def test_schema_and_op_handle(self):
        s = kdispatch.schema(OP)
        self.assertEqual([t["name"] for t in s["tensors"]], ["out", "x", "weight"])
        self.assertEqual(s["attrs"][0]["name"], "eps")
        # The op schema's tolerances, one per dtype the output can have.
        self.assertEqual(sorted(s["tolerance"]), ["bfloat16", "float16", "float32"])
        self.assertEqual(set(s["tolerance"]["bfloat16"]), {"ulps", "atol", "mean_ulps"})
        handle = kdispatch.op(OP)
        self.assertEqual(handle.name, OP)
        self.assertIsNone(handle.backend)
        self.assertEqual(kdispatch.op(OP, backend="cpu").backend, "cpu")
        self.assertIsInstance(kdispatch.version, str)


if __name__ == "__main__":
    unittest.main(verbosity=2)
