#!/usr/bin/env python3
"""The module's state over a process's life: configure() keeps no runtime
that nothing uses any more, and a process whose daemon threads are inside
calls when the interpreter exits ends with exit code 0."""
import subprocess
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


# Daemon threads call a host kernel in a loop (the GIL let go while it
# runs) while the main thread leaves the interpreter.
DAEMONS_AT_EXIT = """
import threading, time
import numpy as np
import kdispatch
x = np.random.default_rng(1).uniform(0.5, 2.0, (1024, 4096)).astype(np.float32)
w = np.ones(4096, dtype=np.float32)
op = kdispatch.op("layernorm.rmsnorm")
started = threading.Barrier(5)
def loop():
    out = np.empty_like(x)
    started.wait()
    while True:
        op(out, x, w, eps=1e-6)
        kdispatch.call("layernorm.rmsnorm", out, x, w)
for _ in range(4):
    threading.Thread(target=loop, daemon=True).start()
started.wait()
time.sleep(0.2)
print("leaving")
"""


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

    def test_daemon_threads_inside_calls_at_exit(self):
        for attempt in range(5):
            run = subprocess.run([sys.executable, "-c", DAEMONS_AT_EXIT], capture_output=True, text=True,
                                 timeout=120)
            self.assertEqual(run.returncode, 0, f"attempt {attempt}: exit code {run.returncode}: {run.stderr[-2000:]}")
            self.assertIn("leaving", run.stdout)


if __name__ == "__main__":
    unittest.main()
