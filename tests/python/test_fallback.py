#!/usr/bin/env python3
"""kdispatch.set_fallback over the fallback fixture plugins (fixture.fallback,
ranked fx_fb_picky > fx_fb_broken > fx_fb_good, and a reference kernel):
off, the broken kernel's failure is the call's error, naming it; on, it is
demoted (kdispatch.doctor() lists it) and calls run on the next backend."""
import argparse
import sys
import unittest

try:
    import numpy as np
except ImportError:
    print("SKIPPED: this python has no numpy (Debian: python3-numpy)")
    sys.exit(77)

import kdispatch

OP = "fixture.fallback"
FIXTURES = ""


def odd_rows(seed):
    """Rows of odd length, which fx_fb_picky declines: a call reaches fx_fb_broken."""
    x = np.random.default_rng(seed).uniform(-2.0, 2.0, (3, 5)).astype(np.float32)
    return np.full_like(x, np.nan), x


class Fallback(unittest.TestCase):
    def setUp(self):
        kdispatch.configure(plugin_path=[f"{FIXTURES}/{p}" for p in
                                         ("fx_fb_picky", "fx_fb_broken", "fx_fb_good", "fx_fb_reference")])

    def tearDown(self):
        kdispatch.set_fallback(False)
        kdispatch.configure()

    def test_off_fails_clearly_then_on_demotes_and_the_call_runs(self):
        kdispatch.set_fallback(False)
        self.assertFalse(kdispatch.fallback())
        out, x = odd_rows(5)
        with self.assertRaises(kdispatch.KernelError) as caught:
            kdispatch.call(OP, out, x)
        self.assertEqual(caught.exception.code, "KD-E040")
        self.assertIn("backend 'fx_fb_broken'", caught.exception.message)
        self.assertIn("simulated internal failure", caught.exception.message)
        self.assertEqual(kdispatch.doctor()["demotions"], [])

        kdispatch.set_fallback(True)
        self.assertTrue(kdispatch.fallback())
        op = kdispatch.op(OP)
        for seed in range(3):
            out, x = odd_rows(seed)
            op(out, x, factor=0.5)
            np.testing.assert_array_equal(out, x * np.float32(0.5))
        demotions = kdispatch.doctor()["demotions"]
        self.assertEqual(len(demotions), 1, demotions)
        self.assertEqual(demotions[0]["op"], OP)
        self.assertEqual(demotions[0]["backend"], "fx_fb_broken")
        self.assertEqual(demotions[0]["device"], "cpu:0")
        self.assertIn("[KD-E040]", demotions[0]["error"])
        self.assertIn("simulated internal failure", demotions[0]["error"])
        self.assertEqual(kdispatch.select(OP, device="cpu")["ranked"], ["fx_fb_picky", "fx_fb_good"])

    def test_the_setting_outlives_configure(self):
        kdispatch.set_fallback(True)
        self.setUp()
        self.assertTrue(kdispatch.fallback())
        kdispatch.set_fallback(False)
        self.setUp()
        self.assertFalse(kdispatch.fallback())


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--fixtures", required=True, help="the built fixture plugins (tests/fixtures/plugins)")
    args, rest = parser.parse_known_args()
    FIXTURES = args.fixtures
    unittest.main(argv=[sys.argv[0]] + rest)
