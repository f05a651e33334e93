#!/usr/bin/env python3
"""kdispatch.tuning_key, kdispatch.write_tuning and kdispatch.set_tuning_file
over the fallback fixture plugins (fixture.fallback: fx_fb_picky ranks over
fx_fb_good by priority, with a reference kernel): a written file is followed
(rule 'tuned'), outlives configure(), a bad one raises with its KD code and
changes nothing, another machine's applies nothing."""
import argparse
import json
import os
import sys
import tempfile
import unittest

try:
    import numpy as np
except ImportError:
    print("SKIPPED: this python has no numpy (Debian: python3-numpy)")
    sys.exit(77)

import kdispatch

OP = "fixture.fallback"
FIXTURES = ""


class Tuning(unittest.TestCase):
    def setUp(self):
        kdispatch.configure(plugin_path=[f"{FIXTURES}/{p}" for p in ("fx_fb_picky", "fx_fb_good", "fx_fb_reference")])
        self.dir = tempfile.mkdtemp()

    def tearDown(self):
        kdispatch.set_tuning_file(None)
        kdispatch.configure()

    def select(self):
        return kdispatch.select(OP, device="cpu", dtype="float32")

    def write(self, name, measurements):
        path = os.path.join(self.dir, name)
        count = kdispatch.write_tuning(path, "cpu", measurements)
        with open(path) as f:
            return path, count, json.load(f)

    def test_key(self):
        key = kdispatch.tuning_key("cpu")
        self.assertEqual(key["device"], "cpu")
        self.assertEqual(key["kdispatch"], kdispatch.version)
        self.assertGreaterEqual(key["threads"], 1)
        self.assertTrue(key["backends"]["fx_fb_good"].startswith("sha256:"))
        self.assertNotIn("fx_fb_reference", key["backends"])
        with self.assertRaises(ValueError):
            kdispatch.tuning_key("tpu")

    def test_written_file_is_followed_and_outlives_configure(self):
        self.assertEqual(self.select()["rule"], "priority")
        self.assertEqual(self.select()["backend"], "fx_fb_picky")
        path, count, doc = self.write("one.json", [
            {"op": OP, "dtype": "float32", "sizes": {"N": 8}, "us": {"fx_fb_good": 1.0, "fx_fb_picky": 2.5}}])
        self.assertEqual(count, 1)
        self.assertEqual(doc["kdispatch_tuning"], 1)
        self.assertEqual(doc["choices"][0]["when"], "")
        self.assertEqual(doc["choices"][0]["backend"], "fx_fb_good")
        self.assertEqual(set(doc["key"]["backends"]), {"fx_fb_good"})
        kdispatch.set_tuning_file(path)
        s = self.select()
        self.assertEqual((s["backend"], s["rule"]), ("fx_fb_good", "tuned"))
        self.assertEqual(s["ranked"], ["fx_fb_good", "fx_fb_picky"])
        x = np.random.default_rng(3).uniform(-2.0, 2.0, (3, 8)).astype(np.float32)
        out = np.full_like(x, np.nan)
        kdispatch.call(OP, out, x, factor=0.5)
        np.testing.assert_array_equal(out, x * np.float32(0.5))
        self.setUp()  # configure() again: still followed
        self.assertEqual(self.select()["rule"], "tuned")
        kdispatch.set_tuning_file(None)
        self.assertEqual(self.select()["rule"], "priority")

    def test_shapes_give_boundaries(self):
        _, count, doc = self.write("two.json", [
            {"op": OP, "dtype": "float32", "sizes": {"N": 512}, "us": {"fx_fb_good": 9.0, "fx_fb_picky": 2.0}},
            {"op": OP, "dtype": "float32", "sizes": {"N": 8}, "us": {"fx_fb_good": 1.0, "fx_fb_picky": 2.0}}])
        self.assertEqual(count, 2)
        self.assertEqual([(c["when"], c["backend"]) for c in doc["choices"]],
                         [("N <= 64", "fx_fb_good"), ("N > 64", "fx_fb_picky")])
        # Without the call's sizes, select() ranks as if there were no file
        # and lists the choices that depend on them; calls follow them.
        self.assertEqual(self.select()["conditional"], [])
        kdispatch.set_tuning_file(os.path.join(self.dir, "two.json"))
        s = self.select()
        self.assertEqual((s["backend"], s["rule"]), ("fx_fb_picky", "priority"))
        self.assertEqual(s["conditional"], [
            {"dtype": "float32", "when": "N <= 64", "backend": "fx_fb_good"},
            {"dtype": "float32", "when": "N > 64", "backend": "fx_fb_picky"}])
        self.assertEqual(kdispatch.select(OP, device="cpu")["conditional"], s["conditional"])  # every dtype's
        rng = np.random.default_rng(5)
        for n in (8, 100):
            x = rng.uniform(-2.0, 2.0, (3, n)).astype(np.float32)
            out = np.full_like(x, np.nan)
            kdispatch.call(OP, out, x, factor=0.5)
            np.testing.assert_array_equal(out, x * np.float32(0.5))
        with self.assertRaises(ValueError):
            kdispatch.write_tuning(os.path.join(self.dir, "x.json"), "cpu",
                                   [{"op": OP, "dtype": "float99", "sizes": {}, "us": {"fx_fb_good": 1.0}}])

    def test_bad_file_raises_and_changes_nothing(self):
        path, _, doc = self.write("good.json", [
            {"op": OP, "dtype": "float32", "sizes": {"N": 8}, "us": {"fx_fb_good": 1.0, "fx_fb_picky": 2.5}}])
        kdispatch.set_tuning_file(path)
        bad = os.path.join(self.dir, "bad.json")
        with open(bad, "w") as f:
            f.write("{not json")
        with self.assertRaises(kdispatch.ManifestError) as caught:
            kdispatch.set_tuning_file(bad)
        self.assertEqual(caught.exception.code, "KD-E010")
        self.assertIn(bad, caught.exception.message)
        doc["choices"][0]["when"] = "Q > 1"
        with open(bad, "w") as f:
            json.dump(doc, f)
        with self.assertRaises(kdispatch.ManifestError) as caught:
            kdispatch.set_tuning_file(bad)
        self.assertEqual(caught.exception.code, "KD-E011")
        self.assertIn("/choices/0/when", caught.exception.message)
        self.assertEqual(self.select()["rule"], "tuned")

    def test_another_machines_file_applies_nothing(self):
        path, _, doc = self.write("other.json", [
            {"op": OP, "dtype": "float32", "sizes": {"N": 8}, "us": {"fx_fb_good": 1.0, "fx_fb_picky": 2.5}}])
        doc["key"]["threads"] = doc["key"]["threads"] + 1
        with open(path, "w") as f:
            json.dump(doc, f)
        kdispatch.set_tuning_file(path)
        self.assertEqual(self.select()["rule"], "priority")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--fixtures", required=True, help="the built fixture plugins (tests/fixtures/plugins)")
    args, rest = parser.parse_known_args()
    FIXTURES = args.fixtures
    unittest.main(argv=[sys.argv[0]] + rest)
