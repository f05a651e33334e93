#!/usr/bin/env python3
"""Every error of the core reaches Python as an instance of the package's
Error classes, whatever was imported: kdispatch.torch alone, kdispatch
alone, or the extension module loaded on its own from the package folder
(then the classes are those of the top-level _errors, the same file)."""
import os
import subprocess
import sys

import kdispatch

PACKAGE = os.path.dirname(kdispatch.__file__)
CHECK = """
try:
    {call}
except Exception as e:
    import sys
    errors = sys.modules.get("kdispatch._errors") or sys.modules.get("_errors")
    assert errors is not None, f"no error module loaded; got {{type(e)}}: {{e}}"
    assert isinstance(e, errors.SelectionError), f"{{type(e)}}: {{e}}"
    assert isinstance(e, errors.Error) and e.code == "KD-E001", e
    print("ok", type(e).__module__, type(e).__name__)
else:
    raise SystemExit("no error raised")
"""
CASES = {
    "kdispatch.torch alone": ("import kdispatch.torch as m", "m._kdispatch.select('nope.op')", None),
    "kdispatch alone": ("import kdispatch", "kdispatch.select('nope.op')", None),
    "the extension module alone": ("import _kdispatch", "_kdispatch.select('nope.op')", PACKAGE),
}

failures = 0
for name, (imports, call, path) in CASES.items():
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = path
    if name == "kdispatch.torch alone":
        try:
            import torch  # noqa: F401
        except ImportError:
            print(f"skipped: {name} (no torch)")
            continue
    result = subprocess.run([sys.executable, "-c", imports + "\n" + CHECK.format(call=call)], env=env,
                            capture_output=True, text=True)
    if result.returncode != 0:
        failures += 1
        print(f"FAIL {name}: {result.stderr.strip().splitlines()[-1] if result.stderr.strip() else result.stdout}")
    else:
        print(f"ok   {name}: {result.stdout.strip()}")
sys.exit(1 if failures else 0)
