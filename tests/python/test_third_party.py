#!/usr/bin/env python3
"""An op that a plugin defines (a schema in its manifest's "ops") is a
kdispatch op and a torch custom op like the built-in ones. The plugin is
the fx_good fixture's library beside a copy of its manifest that adds a
schema for fixture.scale (out = x * factor); its fixture.fill keeps no
schema, so it is listed but neither callable nor registered with torch.

Usage: test_third_party.py FX_GOOD_DIR (the built fixture's folder)"""
import json
import os
import pathlib
import shutil
import sys
import tempfile

try:
    import numpy as np
    import torch
except ImportError as e:
    print(f"SKIPPED: {e} (Debian: python3-numpy, python3-torch)")
    sys.exit(77)

SCALE_SCHEMA = {
    "op": "fixture.scale",
    "doc": "out = x * factor",
    "tensors": [{"name": "out", "shape": ["*", "N"], "dtype": "float32", "written": True},
                {"name": "x", "shape": ["*", "N"], "dtype": "float32"}],
    "attrs": [{"name": "factor", "type": "float", "default": 1.0}],
    "dtypes": {},
}
failures = []


def check(ok, what):
    print(f"{'ok  ' if ok else 'FAIL'} {what}")
    if not ok:
        failures.append(what)


def main(fixture_dir, plugin_dir):
    source = pathlib.Path(fixture_dir)
    manifest = json.loads((source / "fx_good.json").read_text())
    manifest["ops"] = [SCALE_SCHEMA]
    (plugin_dir / "fx_good.json").write_text(json.dumps(manifest))
    shutil.copy2(source / manifest["library"], plugin_dir / manifest["library"])
    os.environ["KDISPATCH_ADD_PLUGIN_PATH"] = str(plugin_dir)  # read when the dispatcher is first used

    import kdispatch
    check("fixture.scale" in kdispatch.ops(), "the plugin's ops are listed")
    x = np.arange(1, 13, dtype=np.float32).reshape(3, 4)
    out = np.full_like(x, np.nan)
    kdispatch.call("fixture.scale", out, x, factor=3.0)
    check(np.array_equal(out, 3 * x), "kdispatch.call runs the plugin's op by its schema")
    try:
        kdispatch.call("fixture.scale", out[:2], x)
        check(False, "a wrong shape is refused")
    except kdispatch.CallError as e:
        check(e.code == "KD-E030" and "'x'" in e.message, f"a wrong shape is refused: {e.message}")
    try:
        kdispatch.call("fixture.fill", out, value=1.0)
        check(False, "an op without a schema is not callable")
    except kdispatch.CallError as e:
        check(e.code == "KD-E030" and "no schema" in e.message, f"an op without a schema is not callable: {e.message}")

    import kdispatch.torch as kt
    check(kt.registered.get("fixture.scale") == "fixture_scale" and "fixture.fill" not in kt.registered,
          "kdispatch.torch registers the op with a schema, not the one without")
    xt = torch.from_numpy(x)
    ot = torch.full_like(xt, float("nan"))
    torch.ops.kdispatch.fixture_scale(ot, xt, 2.0)
    check(torch.equal(ot, 2 * xt), "torch.ops.kdispatch.fixture_scale writes its output")
    check(torch.equal(kt.fixture.scale(xt, factor=0.5), 0.5 * xt), "the functional variant allocates and returns it")
    meta = torch.empty(5, 4, device="meta")
    torch.ops.kdispatch.fixture_scale(meta, meta, 2.0)
    try:
        torch.ops.kdispatch.fixture_scale(meta, torch.empty(5, 3, device="meta"), 2.0)
        check(False, "the fake implementation refuses a wrong shape")
    except kdispatch.CallError as e:
        check("'x'" in e.message, f"the fake implementation refuses a wrong shape: {e.message}")
    print(f"third-party op: {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__)
        sys.exit(2)
    with tempfile.TemporaryDirectory(prefix="kdispatch-plugin-") as d:
        sys.exit(main(sys.argv[1], pathlib.Path(d)))
