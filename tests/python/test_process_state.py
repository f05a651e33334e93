#!/usr/bin/env python3
"""The module's state over a process's life: configure() keeps no runtime
that nothing uses any more."""
import sys
import unittest

try:
    import numpy as np
except ImportError:
    print("SKIPPED: this python has no numpy (Debian: python3-numpy)")
    sys.exit(77)

import kdispatch

OP = "layernorm.rmsnorm"


def rmsnorm_args(rows=3, h=37):
    rng = np.random.default_rng(7)
    x = rng.uniform(0.5, 2.0, (rows, h)).astype(np.float32)
    w = rng.uniform(0.5, 2.0, h).astype(np.float32)
    return np.full_like(x, np.nan), x, w


class ProcessState(unittest.TestCase):
    def test_configure_keeps_no_runtime_nothing_uses(self):
        out, x, w = rmsnorm_args()
        kdispatch.call(OP, out, x, w)
        held = kdispatch.op(OP)  # keeps the runtime it was resolved with
        for _ in range(1000):
            kdispatch.configure()
            kdispatch.call(OP, out, x, w)
        # The current runtime and the one `held` points into.
        self.assertLessEqual(kdispatch._kdispatch._live_runtimes(), 2)
        held(out, x, w)
        del held
        kdispatch.configure()
        kdispatch.call(OP, out, x, w)
        self.assertEqual(kdispatch._kdispatch._live_runtimes(), 1)


if __name__ == "__main__":
    unittest.main()
